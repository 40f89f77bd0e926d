"""Node-wide paths and names shared by the CLI, the supervisor and the services, and the
command-line generator of every service's config.

Per-service settings live in one frozen dataclass per service (``services/<name>/config.py``);
this module holds what several of them must agree on — where the run directory is and how
shared-memory files are named (so ``belayer down`` can remove every one of them) — and turns
such a dataclass into command-line flags and back (``parse_config``, ``config_argv``).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import functools
import inspect
import itertools
import os
import textwrap
import types
import typing
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any, Literal, NoReturn, TypeVar

SHM_DIR = Path("/dev/shm")


@dataclass(frozen=True)
class RunPaths:
    """Layout of a node's run directory (default ``./.belayer``)."""

    root: Path

    @classmethod
    def default(cls) -> RunPaths:
        return cls(Path(os.environ.get("BELAYER_HOME", ".belayer")).resolve())

    @property
    def node_file(self) -> Path:
        """JSON written by ``up``: nats_url, supervisor pid, run id."""
        return self.root / "node.json"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def nats_store(self) -> Path:
        return self.root / "nats"

    @property
    def heartbeats(self) -> Path:
        return self.root / "heartbeat"

    @property
    def models(self) -> Path:
        return self.root / "models"

    @property
    def auth(self) -> Path:
        """The node's identities (nkey seed files, mode 0600; ``common/auth.py``)."""
        return self.root / "auth"

    def heartbeat_file(self, engine_id: str) -> Path:
        return self.heartbeats / f"{engine_id}.hb"


def shm_prefix(run_id: str) -> str:
    """Prefix of every /dev/shm file this node creates."""
    return f"belayer-{run_id}-"


def shm_path(run_id: str, name: str) -> Path:
    """A shared-memory file of this node."""
    return SHM_DIR / f"{shm_prefix(run_id)}{name}"


def unmakeable_dir(path: Path) -> str | None:
    """Why ``path`` cannot be (or be made) a directory this process writes in; None when it
    can. Leaves the file system as it found it: the missing part is made, then removed."""
    missing: list[Path] = []
    probe = path
    while not probe.exists() and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is not a directory"
    try:
        for part in reversed(missing):
            part.mkdir()
    except OSError as exc:
        return exc.strerror or str(exc)
    finally:
        for part in missing:
            with contextlib.suppress(OSError):
                part.rmdir()
    if not missing and not os.access(path, os.W_OK):
        return "not writable"
    return None


# --- command-line flags generated from a config dataclass ---------------------------------
#
# Every service's settings are one frozen dataclass whose fields carry docstrings. The flags of
# ``python -m services.<name>`` are generated from it — one ``--field-name`` per field, typed by
# the annotation, documented by the docstring, defaulted by the dataclass — and
# ``config_argv`` turns a config back into the flags that reproduce it, so a parent process
# (the supervisor) forwards a child's config instead of re-declaring its knobs.
#
# Supported annotations: ``str``, ``int``, ``float``, ``bool`` (``--x/--no-x``), ``Path``,
# ``Literal[...]`` (choices), ``tuple[T, ...]`` of those scalars (comma-separated), ``T | None``
# (an empty value means None), and a nested config dataclass, flattened with its field name
# as prefix (``engine.max_num_seqs`` → ``--engine-max-num-seqs``).

C = TypeVar("C")
_NONE = type(None)


@dataclass(frozen=True)
class _Kind:
    """How values of one annotation are read from and written to the command line."""

    parse: Callable[[str], Any]
    show: Callable[[Any], str]
    metavar: str
    boolean: bool = False


@dataclass(frozen=True)
class _Flag:
    path: tuple[str, ...]
    """Field names from the top config down to this field."""
    kind: _Kind
    default: Any
    """The default value, or ``dataclasses.MISSING`` for a required field."""
    doc: str

    @property
    def flag(self) -> str:
        return "--" + "-".join(self.path).replace("_", "-")

    @property
    def dest(self) -> str:
        return ".".join(self.path)


def _named(fn: Callable[[str], Any], name: str) -> Callable[[str], Any]:
    fn.__name__ = name  # argparse names it in "invalid <name> value"
    return fn


def _scalar_kind(tp: Any, where: str) -> _Kind:
    if tp is bool:
        return _Kind(parse=_named(_parse_bool, "bool"), show=_show_bool, metavar="BOOL")
    if tp in (int, float, str):
        metavar = "TEXT" if tp is str else tp.__name__.upper()
        return _Kind(parse=tp, show=repr if tp is float else str, metavar=metavar)
    if isinstance(tp, type) and issubclass(tp, PurePath):
        return _Kind(parse=_named(tp, "path"), show=str, metavar="PATH")
    if typing.get_origin(tp) is Literal:
        values = typing.get_args(tp)
        by_text = {str(v): v for v in values}

        def parse_choice(text: str) -> Any:
            if text not in by_text:
                raise argparse.ArgumentTypeError(
                    f"invalid choice: {text!r} (choose from {', '.join(by_text)})"
                )
            return by_text[text]

        return _Kind(parse=parse_choice, show=str, metavar="{" + ",".join(by_text) + "}")
    raise TypeError(f"{where}: unsupported config field type {tp!r}")


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


def _show_bool(value: Any) -> str:
    return "true" if value else "false"


def _kind(tp: Any, where: str) -> _Kind:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType) and _NONE in args:
        rest = [a for a in args if a is not _NONE]
        if len(rest) != 1 or rest[0] is bool:
            raise TypeError(f"{where}: unsupported optional type {tp!r}")
        inner = _kind(rest[0], where)
        return _Kind(
            parse=_named(lambda s: None if s == "" else inner.parse(s), inner.metavar.lower()),
            show=lambda v: "" if v is None else inner.show(v),
            metavar=inner.metavar,
        )
    if origin is tuple:
        if len(args) != 2 or args[1] is not Ellipsis:
            raise TypeError(f"{where}: only tuple[T, ...] is supported, not {tp!r}")
        item = _scalar_kind(args[0], where)
        return _Kind(
            parse=_named(
                lambda s: tuple(item.parse(p.strip()) for p in s.split(",") if p.strip()),
                "list",
            ),
            show=lambda v: ",".join(item.show(x) for x in v),
            metavar=f"{item.metavar}[,...]",
        )
    if tp is bool:
        return _Kind(parse=_parse_bool, show=_show_bool, metavar="", boolean=True)
    return _scalar_kind(tp, where)


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field's attribute docstring (the string literal right after it in the class body),
    as one line; inherited fields included."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, nxt in itertools.pairwise(body):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[node.target.id] = " ".join(inspect.cleandoc(nxt.value.value).split())
    return docs


def _flags(cls: type, prefix: tuple[str, ...] = (), base: Any = None) -> list[_Flag]:
    """Every leaf field of ``cls`` (nested configs flattened); defaults come from ``base`` (an
    instance of ``cls``) when given, else from the dataclass."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    out: list[_Flag] = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        tp, path = hints[f.name], (*prefix, f.name)
        default = getattr(base, f.name) if base is not None else _default(f)
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            out += _flags(tp, path, None if default is dataclasses.MISSING else default)
            continue
        where = f"{cls.__name__}.{f.name}"
        out.append(_Flag(path, _kind(tp, where), default, docs.get(f.name, "")))
    return out


def _groups(cls: type, prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], str]]:
    """(path, docstring) of every nested config field, depth first."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if f.init and isinstance(tp, type) and dataclasses.is_dataclass(tp):
            yield (*prefix, f.name), docs.get(f.name, "")
            yield from _groups(tp, (*prefix, f.name))


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line on stderr and exit status 2 (no usage dump, no traceback)."""
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _help(flag: _Flag) -> str:
    text = flag.doc.replace("``", "")
    if flag.default is dataclasses.MISSING:
        text += " (required)"
    elif flag.kind.boolean:
        text += f" (default: {'on' if flag.default else 'off'})"
    elif flag.default is None:
        text += " (default: none)"
    else:
        shown = flag.kind.show(flag.default)
        text += f" (default: {shown if shown else 'empty'})"
    return text.replace("%", "%%")


def build_parser(
    cls: type, *, prog: str | None = None, description: str | None = None
) -> argparse.ArgumentParser:
    """The argument parser of ``cls``: one flag per (flattened) field. Values not given on the
    command line are left out of the namespace, so the dataclass applies its own defaults."""
    if description is not None:
        description = description.replace("``", "")
    parser = _Parser(prog=prog, description=description, usage="%(prog)s [options]")
    groups: dict[tuple[str, ...], Any] = {(): parser}
    for path, doc in _groups(cls):
        groups[path] = parser.add_argument_group(
            "--" + "-".join(path).replace("_", "-") + "-*", doc.replace("``", "") or None
        )
    for flag in _flags(cls):
        group = groups[flag.path[:-1]]
        common: dict[str, Any] = dict(dest=flag.dest, default=argparse.SUPPRESS, help=_help(flag))
        if flag.kind.boolean:
            group.add_argument(flag.flag, action=argparse.BooleanOptionalAction, **common)
        else:
            group.add_argument(
                flag.flag,
                type=flag.kind.parse,
                metavar=flag.kind.metavar,
                required=flag.default is dataclasses.MISSING,
                **common,
            )
    return parser


def _build(cls: type, given: dict[tuple[str, ...], Any], prefix: tuple[str, ...], base: Any) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        tp, path = hints[f.name], (*prefix, f.name)
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            if any(p[: len(path)] == path for p in given):
                inner = getattr(base, f.name) if base is not None else _default(f)
                kwargs[f.name] = _build(
                    tp, given, path, None if inner is dataclasses.MISSING else inner
                )
        elif path in given:
            kwargs[f.name] = given[path]
    return dataclasses.replace(base, **kwargs) if base is not None else cls(**kwargs)


def parse_config(
    cls: type[C],
    argv: Sequence[str] | None = None,
    *,
    prog: str | None = None,
    description: str | None = None,
) -> C:
    """Command line → ``cls``. ``--help`` lists every field with its docstring and default; a
    bad value, or a ``ValueError`` from the config's ``__post_init__``, exits with status 2 and
    one line on stderr."""
    parser = build_parser(cls, prog=prog, description=description)
    namespace = vars(parser.parse_args(argv))
    given = {flag.path: namespace[flag.dest] for flag in _flags(cls) if flag.dest in namespace}
    try:
        config: C = _build(cls, given, (), None)
    except ValueError as exc:
        parser.error(str(exc))
    return config


def config_argv(config: Any) -> list[str]:
    """The flags that make ``parse_config`` rebuild ``config``: only fields that differ from
    their defaults, each as ``--flag=value`` (``--x``/``--no-x`` for booleans). Raises
    ``ValueError`` for a value the command line cannot carry (say, a comma inside a tuple item)."""
    out: list[str] = []
    for flag in _flags(type(config)):
        value: Any = config
        for name in flag.path:
            value = getattr(value, name)
        if flag.default is not dataclasses.MISSING and value == flag.default:
            continue
        if flag.kind.boolean:
            out.append(flag.flag if value else "--no-" + flag.flag[2:])
            continue
        text = flag.kind.show(value)
        if flag.kind.parse(text) != value:
            raise ValueError(f"{flag.flag}: {value!r} cannot be written as a command-line value")
        out.append(f"{flag.flag}={text}")
    return out
