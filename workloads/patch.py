"""A strict unified-diff applier (no fuzz): applies SWE-bench ``test_patch`` diffs to a
repository held in memory, so the hidden test files of a locally checked-out instance are
known before any sandbox starts (the sandbox image needs no ``git``)."""

from __future__ import annotations

import re

from common.errors import InvalidRequest

_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def _path(header: str) -> str | None:
    name = header.split("\t", 1)[0].strip()
    if name == "/dev/null":
        return None
    return name[2:] if name[:2] in ("a/", "b/") else name


def _apply_hunks(old: list[str], hunks: list[tuple[int, list[str]]], path: str) -> list[str]:
    out: list[str] = []
    pos = 0  # next line of ``old`` not yet copied
    for start, body in hunks:
        before = [ln[1:] for ln in body if ln[:1] in (" ", "-")]
        after = [ln[1:] for ln in body if ln[:1] in (" ", "+")]
        at = max(start - 1, 0) if before else start
        if old[at : at + len(before)] != before:
            # The stated line moved (an earlier hunk or file drift): look for the exact block.
            at = next(
                (
                    i
                    for i in range(pos, len(old) - len(before) + 1)
                    if old[i : i + len(before)] == before
                ),
                -1,
            )
            if at < 0:
                raise InvalidRequest("test patch does not apply", path=path, line=start)
        if at < pos:
            raise InvalidRequest("test patch hunks overlap", path=path, line=start)
        out += old[pos:at] + after
        pos = at + len(before)
    return out + old[pos:]


def apply_patch(files: dict[str, bytes], patch: str) -> dict[str, bytes]:
    """The files ``patch`` creates or changes, after applying it to ``files`` (relative path →
    bytes). ``InvalidRequest`` if it does not apply exactly or deletes a file."""
    lines = patch.splitlines(keepends=True)
    result: dict[str, bytes] = {}
    i = 0
    while i < len(lines):
        if (
            not lines[i].startswith("--- ")
            or i + 1 >= len(lines)
            or not lines[i + 1].startswith("+++ ")
        ):
            i += 1
            continue
        src, dst = _path(lines[i][4:]), _path(lines[i + 1][4:])
        i += 2
        if dst is None:
            raise InvalidRequest("test patch deletes a file (unsupported)", path=src)
        hunks: list[tuple[int, list[str]]] = []
        while i < len(lines) and (m := _HUNK.match(lines[i])):
            old_n = int(m[2]) if m[2] is not None else 1
            new_n = int(m[4]) if m[4] is not None else 1
            body: list[str] = []
            i += 1
            seen_old = seen_new = 0
            while i < len(lines) and (seen_old < old_n or seen_new < new_n):
                ln = lines[i]
                if ln.startswith("\\"):  # "\ No newline at end of file"
                    if body:
                        body[-1] = body[-1].rstrip("\n")
                    i += 1
                    continue
                tag = ln[:1]
                if tag not in (" ", "-", "+"):
                    if ln in ("\n", "\r\n"):  # an empty context line some tools strip
                        ln, tag = " " + ln, " "
                    else:
                        raise InvalidRequest("malformed hunk in test patch", path=dst)
                seen_old += tag in (" ", "-")
                seen_new += tag in (" ", "+")
                body.append(ln)
                i += 1
            if i < len(lines) and lines[i].startswith("\\"):
                body[-1] = body[-1].rstrip("\n")
                i += 1
            hunks.append((int(m[1]), body))
        base = files.get(src, b"") if src is not None else b""
        if src is not None and src not in files and src not in result:
            raise InvalidRequest("test patch changes a file the repository lacks", path=src)
        if src is not None and src in result:
            base = result[src]
        old = base.decode().splitlines(keepends=True)
        result[dst] = "".join(_apply_hunks(old, hunks, dst)).encode()
    if not result:
        raise InvalidRequest("test patch holds no file diff")
    return result
