"""Pure core of the environment service: state machine, manifests, restore order, schemas."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest

from common.codec import decode, encode
from common.errors import CheckpointInvalid, Conflict, InvalidRequest
from schemas.env import EnvCheckpoint, EnvExec, EnvListing, SandboxInfo
from services.environment import core
from services.environment.core import Manifest, SandboxState


def _m(cid: str, prefix: int, sandbox: str = "sb-1") -> Manifest:
    return Manifest(
        sandbox_id=sandbox,
        trajectory_id="t",
        prefix=prefix,
        checkpoint_id=cid,
        image="img",
        created_at=float(prefix),
        fs_bytes=1,
        fs_sha256="x",
        criu_bytes=1,
        criu_files={"a.img": 1},
        criu_sha256={"a.img": "d"},
        method="runc",
    )


def test_state_machine() -> None:
    core.check_transition(SandboxState.RUNNING, SandboxState.CHECKPOINTING)
    core.check_transition(SandboxState.FAILED, SandboxState.RESTORING)
    with pytest.raises(Conflict):
        core.check_transition(SandboxState.DESTROYED, SandboxState.RUNNING)
    with pytest.raises(Conflict):
        core.check_transition(SandboxState.CHECKPOINTING, SandboxState.RESTORING)


def test_restore_candidates_follow_the_ready_pointer() -> None:
    ms = [_m("c1", 1), _m("c3", 3), _m("c2", 2), _m("c4", 4)]  # c4 was never published
    got = core.restore_candidates(ms, ready_checkpoint_id="c3", requested=None)
    assert [m.checkpoint_id for m in got] == ["c3", "c2", "c1"]
    assert core.restore_candidates(ms, ready_checkpoint_id=None, requested=None) == []
    assert [
        m.checkpoint_id
        for m in core.restore_candidates(ms, ready_checkpoint_id="c3", requested="c1")
    ] == ["c1"]


def test_restore_candidates_when_the_ready_one_is_quarantined() -> None:
    ms = [_m("c1", 1), _m("c2", 2), _m("c4", 4)]  # c3 (the ready one) was quarantined
    got = core.restore_candidates(ms, ready_checkpoint_id="c3", requested=None, ready_prefix=3)
    assert [m.checkpoint_id for m in got] == ["c2", "c1"]
    assert core.restore_candidates(ms, ready_checkpoint_id="c3", requested=None) == []


def test_prune_keeps_the_newest_and_the_protected() -> None:
    ms = [_m("c1", 1), _m("c2", 2), _m("c3", 3), _m("c4", 4), _m("c5", 5)]
    assert core.prune_plan(ms, 2, set()) == ["c3", "c2", "c1"]
    assert core.prune_plan(ms, 2, {"c1"}) == ["c3", "c2"]  # c1: the last one that restored
    assert core.prune_plan(ms, 0, set()) == ["c4", "c3", "c2", "c1"]  # always keeps one


def test_manifest_round_trip_and_ownership(tmp_path: Path) -> None:
    m = _m("sb-1-k000001-abc", 1)
    core.write_manifest(tmp_path, m)
    back = core.read_manifest(tmp_path)
    assert back == m
    core.check_manifest(back, sandbox_id="sb-1", checkpoint_id="sb-1-k000001-abc")
    with pytest.raises(Conflict, match="another sandbox"):
        core.check_manifest(back, sandbox_id="sb-2", checkpoint_id="sb-1-k000001-abc")
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointInvalid):
        core.read_manifest(tmp_path)


def test_criu_files_are_checked(tmp_path: Path) -> None:
    (tmp_path / "criu").mkdir()
    m = _m("c", 1)
    with pytest.raises(CheckpointInvalid, match="missing"):
        core.check_criu_files(tmp_path, m)
    (tmp_path / "criu" / "a.img").write_bytes(b"xy")
    with pytest.raises(CheckpointInvalid, match="wrong size"):
        core.check_criu_files(tmp_path, m)
    (tmp_path / "criu" / "a.img").write_bytes(b"x")
    core.check_criu_files(tmp_path, m)
    m.criu_sha256 = {}  # a manifest that does not bind every image to a digest is refused
    with pytest.raises(CheckpointInvalid, match="digest"):
        core.check_criu_files(tmp_path, m)


def test_manifest_digests_bind_a_checkpoint_to_its_ready_pointer(tmp_path: Path) -> None:
    core.write_manifest(tmp_path, _m("c2", 2))
    digest = core.manifest_digest(tmp_path)
    assert len(digest) == 64
    core.check_manifest_digest("c2", digest, {"c1": "a", "c2": digest})
    core.check_manifest_digest("c2", digest, None)  # no pointer: nothing to compare with
    with pytest.raises(CheckpointInvalid, match="modified"):
        core.check_manifest_digest("c2", "f" * 64, {"c2": digest})
    with pytest.raises(CheckpointInvalid, match="substituted"):
        core.check_manifest_digest("c9", digest, {"c2": digest})
    with pytest.raises(CheckpointInvalid, match="no manifest"):
        core.manifest_digest(tmp_path / "absent")
    # the pointer keeps the digests of checkpoints that still exist, plus the new one
    got = core.carry_manifests({"c1": "a", "c2": "b", "c0": "z"}, {"c1", "c2"}, "c3", "c")
    assert got == {"c1": "a", "c2": "b", "c3": "c"}


def test_ids_and_records(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest):
        core.validate_sandbox_id("a.b")
    cid = core.checkpoint_id_for("sb-1", 42)
    assert cid.startswith("sb-1-k000042-")
    rec = core.SandboxRecord(
        id="sb-1", image="i", container_id="c", limits=core.Limits(memory_mb=1, cpus=1.0, pids=1)
    )
    core.save_record(tmp_path, rec)
    assert core.load_records(tmp_path) == [rec]
    core.remove_record(tmp_path, "sb-1")
    assert core.load_records(tmp_path) == []


def test_env_messages_are_plain_msgpack() -> None:
    raw = msgpack.unpackb(encode(EnvExec(sandbox_id="sb-1", command="ls")))
    assert raw == {
        "type": "EnvExec.v1",
        "sandbox_id": "sb-1",
        "command": "ls",
        "timeout_s": 30.0,
        "workdir": "",
    }
    payload = msgpack.packb({"type": "EnvCheckpoint.v1", "sandbox_id": "s", "prefix": 3})
    assert decode(payload, EnvCheckpoint).prefix == 3
    listing = EnvListing(
        sandboxes=[SandboxInfo(id="s", container_id="c", image="i", state="running")]
    )
    assert decode(encode(listing), EnvListing) == listing
