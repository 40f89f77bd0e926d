"""Validation of writable-layer archives before they are installed into a fresh container. Pure.

A checkpoint's ``fs.tar`` is a GNU/pax tar of an overlay upper directory. Before restore it
must not be able to write outside the new upper directory, whatever its origin:

* member names are relative, contain no ``..`` component and no NUL;
* no member lies *below* a symlink member (extraction would follow the link);
* hard links point at an earlier regular member of the same archive;
* the only device node allowed is the overlay whiteout (character device 0:0);
* member count and total size stay under caps.

Symlink *targets* may be absolute: inside the container they resolve against its root, and
the extraction never follows them (see the second rule).
"""

from __future__ import annotations

import tarfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from common.errors import CheckpointInvalid


@dataclass(frozen=True)
class ArchiveLimits:
    """Caps for one writable-layer archive."""

    max_bytes: int = 4 << 30
    """Total size of the members' data."""
    max_members: int = 500_000
    """Number of members."""


@dataclass(frozen=True)
class ArchiveSummary:
    """What a valid archive holds."""

    members: int
    data_bytes: int
    whiteouts: int


def normalize(name: str) -> str:
    """``./a/b/`` → ``a/b``; ``.`` → ``""``. Raises on absolute or ``..`` names."""
    if "\x00" in name:
        raise CheckpointInvalid("archive member name contains NUL", member=repr(name))
    if name.startswith("/"):
        raise CheckpointInvalid("archive member has an absolute path", member=name)
    parts = [p for p in PurePosixPath(name).parts if p not in ("", ".")]
    if ".." in parts:
        raise CheckpointInvalid("archive member escapes the layer with '..'", member=name)
    return "/".join(parts)


def validate_members(members: list[tarfile.TarInfo], limits: ArchiveLimits) -> ArchiveSummary:
    """Check every member against the rules above; raise ``CheckpointInvalid`` on the first
    violation (naming the member)."""
    if len(members) > limits.max_members:
        raise CheckpointInvalid(
            "archive has too many members", members=len(members), limit=limits.max_members
        )
    symlinks: set[str] = set()
    regular: set[str] = set()
    total = 0
    whiteouts = 0
    for m in members:
        name = normalize(m.name)
        parts = name.split("/") if name else []
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in symlinks:
                raise CheckpointInvalid("archive member lies below a symlink", member=m.name)
        if m.issym():
            symlinks.add(name)
        elif m.islnk():
            target = normalize(m.linkname)
            if target not in regular:
                raise CheckpointInvalid(
                    "hard link to a path outside the archive", member=m.name, target=m.linkname
                )
        elif m.ischr() or m.isblk():
            if not (m.ischr() and m.devmajor == 0 and m.devminor == 0):
                raise CheckpointInvalid(
                    "device node in the archive",
                    member=m.name,
                    major=m.devmajor,
                    minor=m.devminor,
                )
            whiteouts += 1
        elif m.isreg():
            regular.add(name)
            total += m.size
            if total > limits.max_bytes:
                raise CheckpointInvalid(
                    "archive exceeds the size cap", bytes=total, limit=limits.max_bytes
                )
        elif not (m.isdir() or m.isfifo()):
            raise CheckpointInvalid("unsupported archive member type", member=m.name)
    return ArchiveSummary(members=len(members), data_bytes=total, whiteouts=whiteouts)


def validate_archive(path: Path, limits: ArchiveLimits | None = None) -> ArchiveSummary:
    """Read ``path``'s headers (data is skipped, not read) and validate them."""
    limits = limits or ArchiveLimits()
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise CheckpointInvalid("archive missing", path=str(path), error=str(exc)) from None
    if size > limits.max_bytes + 64 * (limits.max_members + 16) * 1024:
        raise CheckpointInvalid("archive file exceeds the size cap", bytes=size)
    try:
        with tarfile.open(path, mode="r:") as tf:
            members = []
            for m in tf:
                members.append(m)
                if len(members) > limits.max_members:
                    break
    except (tarfile.TarError, OSError, UnicodeError) as exc:
        raise CheckpointInvalid("archive is corrupt", path=str(path), error=str(exc)) from None
    return validate_members(members, limits)
