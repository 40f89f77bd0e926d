"""Writable-layer archive validation: hostile members are rejected with a clear error."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from common.errors import CheckpointInvalid
from services.environment.archive import ArchiveLimits, validate_archive


def _tar(path: Path, members: list[tuple[str, str, dict]]) -> Path:
    with tarfile.open(path, "w") as tf:
        for name, kind, extra in members:
            info = tarfile.TarInfo(name)
            data = extra.get("data", b"")
            if kind == "dir":
                info.type = tarfile.DIRTYPE
            elif kind == "sym":
                info.type, info.linkname = tarfile.SYMTYPE, extra["target"]
            elif kind == "hard":
                info.type, info.linkname = tarfile.LNKTYPE, extra["target"]
            elif kind == "chr":
                info.type = tarfile.CHRTYPE
                info.devmajor, info.devminor = extra.get("dev", (0, 0))
            elif kind == "blk":
                info.type, info.devmajor, info.devminor = tarfile.BLKTYPE, 8, 0
            else:
                info.size = len(data)
            tf.addfile(info, io.BytesIO(data) if kind == "file" else None)
    return path


def test_a_normal_layer_with_whiteouts_and_absolute_symlinks_is_valid(tmp_path: Path) -> None:
    p = _tar(
        tmp_path / "ok.tar",
        [
            ("./", "dir", {}),
            ("./root/", "dir", {}),
            ("./root/a", "file", {"data": b"hello"}),
            ("./root/link", "sym", {"target": "/usr/bin/python3"}),
            ("./root/hard", "hard", {"target": "./root/a"}),
            ("./etc/motd", "chr", {"dev": (0, 0)}),
        ],
    )
    s = validate_archive(p)
    assert s.whiteouts == 1 and s.data_bytes == 5 and s.members == 6


@pytest.mark.parametrize(
    ("members", "match"),
    [
        ([("/etc/passwd", "file", {})], "absolute"),
        ([("../../x", "file", {})], "escapes"),
        ([("a/../../x", "file", {})], "escapes"),
        ([("l", "sym", {"target": "/etc"}), ("l/passwd", "file", {})], "below a symlink"),
        ([("h", "hard", {"target": "/etc/shadow"})], "absolute"),
        ([("h", "hard", {"target": "nowhere"})], "hard link"),
        ([("h", "hard", {"target": "../x"})], "escapes"),
        ([("sda", "blk", {})], "device node"),
        ([("mem", "chr", {"dev": (1, 1)})], "device node"),
    ],
)
def test_hostile_members_are_rejected(tmp_path: Path, members: list, match: str) -> None:
    with pytest.raises(CheckpointInvalid, match=match):
        validate_archive(_tar(tmp_path / "bad.tar", members))


def test_size_and_count_caps(tmp_path: Path) -> None:
    p = _tar(tmp_path / "big.tar", [("a", "file", {"data": b"x" * 1000})])
    with pytest.raises(CheckpointInvalid, match="size cap"):
        validate_archive(p, ArchiveLimits(max_bytes=100))
    p = _tar(tmp_path / "many.tar", [(f"f{i}", "file", {}) for i in range(20)])
    with pytest.raises(CheckpointInvalid, match="too many"):
        validate_archive(p, ArchiveLimits(max_members=10))


def test_corrupt_or_missing_archive(tmp_path: Path) -> None:
    bad = tmp_path / "corrupt.tar"
    bad.write_bytes(b"\x00garbage" * 300)
    with pytest.raises(CheckpointInvalid):
        validate_archive(bad)
    with pytest.raises(CheckpointInvalid, match="missing"):
        validate_archive(tmp_path / "nope.tar")
