"""The event catalogue of docs/protocol.md (§6) must match ``schemas/events.py`` exactly: every
event kind is documented with its type and tag, and each kind's field table lists exactly the
struct's fields (besides the common ``ts`` and ``source``) with their type, default and meaning
(the field's docstring). Print the catalogue as the code has it, to paste into the doc:
    .venv/bin/python tests/unit/test_event_catalogue.py
"""

from __future__ import annotations

import ast
import json
import re
import sys
import time
from pathlib import Path

import msgspec

from common import events as common_events
from common import subjects
from schemas import events

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "protocol.md"
SOURCES_FILES = [ROOT / "schemas" / n for n in ("event_base.py", "events.py", "events_training.py")]
"""Where the event types are written (``schemas/events.py`` gathers them into ``AnyEvent``)."""
CATALOGUE_START = "### 6.2 Event catalogue"
COMMON = ("ts", "source")
"""Fields every event has: documented once, in the common-fields table (§6.1)."""

Row = tuple[str, str, str]
"""(type, default, meaning) of one field, as the doc writes them."""


# --- the code's side -------------------------------------------------------------------------
def _field_sources() -> dict[str, dict[str, tuple[str, str]]]:
    """Class name → field name → (annotation, docstring) as written in ``schemas/events.py``."""
    out: dict[str, dict[str, tuple[str, str]]] = {}
    nodes = [n for f in SOURCES_FILES for n in ast.parse(f.read_text()).body]
    for node in nodes:
        if not isinstance(node, ast.ClassDef):
            continue
        fields: dict[str, tuple[str, str]] = {}
        body = node.body
        for i, stmt in enumerate(body):
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                doc = ""
                nxt = body[i + 1] if i + 1 < len(body) else None
                if (
                    isinstance(nxt, ast.Expr)
                    and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)
                ):
                    doc = nxt.value.value
                fields[stmt.target.id] = (ast.unparse(stmt.annotation), doc)
        out[node.name] = fields
    return out


SOURCES = _field_sources()


def _markdown(text: str) -> str:
    """A docstring or type as one table cell: one line, ``x`` → `x`, pipes escaped."""
    text = " ".join(text.split()).replace("``", "`")
    return text.replace("|", "\\|")


def _default(info: msgspec.structs.FieldInfo) -> str:
    if info.required:
        return "required"
    if info.default_factory is time.time:
        return "now"
    if info.default_factory is not msgspec.NODEFAULT:
        return f"`{info.default_factory()!r}`"
    value = info.default
    return f"`{json.dumps(value)}`" if isinstance(value, str) else f"`{value!r}`"


def code_rows(cls: type) -> dict[str, Row]:
    """Field name → (type, default, meaning) of an event type (annotation and docstring from
    the class that declares the field, or the nearest base that documents it)."""
    rows: dict[str, Row] = {}
    for info in msgspec.structs.fields(cls):
        annotation, doc = "", ""
        for base in cls.__mro__:
            found = SOURCES.get(base.__name__, {}).get(info.name)
            if found is not None:
                annotation = annotation or found[0]
                doc = doc or found[1]
        rows[info.name] = (f"`{_markdown(annotation)}`", _default(info), _markdown(doc))
    return rows


def catalogue_order(cls: type) -> list[str]:
    """The doc's order: ``engine_id`` first, then the kind's own fields as declared."""
    names = [n for n in code_rows(cls) if n not in COMMON]
    return sorted(names, key=lambda n: n != "engine_id")


# --- the doc's side --------------------------------------------------------------------------
def _cells(line: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def parse_table(lines: list[str]) -> dict[str, Row]:
    """The first ``| field | type | default | meaning |`` table in ``lines``."""
    rows: dict[str, Row] = {}
    started = False
    for line in lines:
        if line.startswith("| field |"):
            started = True
            continue
        if not started:
            continue
        if not line.startswith("|"):
            break
        cells = _cells(line)
        if set(cells[0]) <= {"-", " "}:
            continue
        assert len(cells) == 4, f"malformed catalogue row: {line!r}"
        rows[cells[0].strip("`")] = (cells[1], cells[2], cells[3])
    return rows


def doc_catalogue() -> dict[str, tuple[str, list[str]]]:
    """Kind → (its heading paragraph, the lines of its section) from §6.2."""
    text = DOC.read_text()
    assert CATALOGUE_START in text, f"docs/protocol.md has no '{CATALOGUE_START}' section"
    body = text.split(CATALOGUE_START, 1)[1].split("\n## ", 1)[0]
    sections: dict[str, tuple[str, list[str]]] = {}
    for chunk in re.split(r"^#### ", body, flags=re.M)[1:]:
        heading, *lines = chunk.splitlines()
        match = re.fullmatch(r"`([a-z0-9_]+)`", heading.strip())
        assert match, f"catalogue heading is not a kind: {heading!r}"
        kind = match.group(1)
        assert kind not in sections, f"kind {kind} documented twice"
        intro = " ".join(line for line in lines if line and not line.startswith("|"))
        sections[kind] = (intro, lines)
    return sections


# --- tests -----------------------------------------------------------------------------------
def test_every_event_kind_is_in_the_catalogue_and_nothing_else() -> None:
    doc = doc_catalogue()
    code = {cls.kind for cls in events.EVENT_TYPES}
    assert not code - set(doc), f"event kinds missing from docs/protocol.md §6.2: {code - set(doc)}"
    assert not set(doc) - code, f"documented kinds that do not exist: {set(doc) - code}"


def test_each_kind_names_its_type_tag_and_publisher() -> None:
    doc = doc_catalogue()
    for cls in events.EVENT_TYPES:
        intro, _ = doc[cls.kind]
        tag = cls.__struct_config__.tag
        assert f"`{cls.__name__}`" in intro and f"`{tag}`" in intro, (
            f"§6.2 {cls.kind}: should name `{cls.__name__}` and tag `{tag}`"
        )
        assert "Published by" in intro, f"§6.2 {cls.kind}: say who publishes it and when"


def test_each_kind_documents_exactly_its_fields() -> None:
    doc = doc_catalogue()
    problems: list[str] = []
    for cls in events.EVENT_TYPES:
        want = {n: r for n, r in code_rows(cls).items() if n not in COMMON}
        have = parse_table(doc[cls.kind][1])
        for name in sorted(set(want) - set(have)):
            problems.append(f"{cls.kind}: field `{name}` is not documented")
        for name in sorted(set(have) - set(want)):
            problems.append(f"{cls.kind}: documented field `{name}` does not exist")
        for name in sorted(set(want) & set(have)):
            if want[name] != have[name]:
                problems.append(f"{cls.kind}.{name}: doc {have[name]} != code {want[name]}")
    assert not problems, "docs/protocol.md §6.2 drifted from schemas/events.py:\n" + "\n".join(
        problems
    )


def test_common_fields_are_documented() -> None:
    text = DOC.read_text()
    section = text.split("### 6.1 Common fields", 1)[1].split(CATALOGUE_START, 1)[0]
    have = parse_table(section.splitlines())
    want = {n: r for n, r in code_rows(events.EventBase).items() if n in COMMON}
    assert have == want


def test_kinds_tags_and_subjects() -> None:
    kinds = [cls.kind for cls in events.EVENT_TYPES]
    assert len(set(kinds)) == len(kinds), "two event types share a kind"
    for cls in events.EVENT_TYPES:
        assert subjects.check_token(cls.kind) == cls.kind
        assert cls.__struct_config__.tag == f"{cls.__name__}.v1"
        assert common_events.subject(cls) == f"belayer.events.{cls.kind}"
        rows = code_rows(cls)
        for name in catalogue_order(cls):
            assert rows[name][2], f"{cls.__name__}.{name} has no docstring"


def test_per_request_recovery_events_name_the_requests() -> None:
    many = (
        events.RequestsResumed,
        events.RequestsAdopted,
        events.EngineFailedEvent,
        events.EngineRecovered,
        events.EngineUnhealthy,
        events.StaleOutputRejected,
    )
    one = (events.AdoptMismatch, events.TokenGapResubmitted, events.RequestFailed)
    for cls in many:
        assert code_rows(cls)["request_ids"][0] == "`list[RequestId]`", cls.__name__
    for single in one:
        assert code_rows(single)["request_id"][0] == "`RequestId`", single.__name__


# --- printing the catalogue ------------------------------------------------------------------
def render(cls: type[events.EventBase]) -> str:
    """The §6.2 section of one kind as the code has it (the intro paragraph is a stub: write
    who publishes it and when)."""
    rows = code_rows(cls)
    doc = " ".join((cls.__doc__ or "").split()).replace("``", "`")
    lines = [
        f"#### `{cls.kind}`",
        "",
        f"`{cls.__name__}` — tag `{cls.__struct_config__.tag}`. Published by … {doc}",
        "",
        "| field | type | default | meaning |",
        "| --- | --- | --- | --- |",
        *(f"| `{n}` | {' | '.join(rows[n])} |" for n in catalogue_order(cls)),
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write("\n".join(render(cls) for cls in events.EVENT_TYPES))
