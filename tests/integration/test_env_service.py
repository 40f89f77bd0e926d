"""The environment service on real dockerd + CRIU: prefix-consistent checkpoint/restore,
hostile checkpoints, bad input, concurrency."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path

import msgspec
import pytest

from common import subjects
from common.codec import decode
from common.errors import (
    CheckpointInvalid,
    Conflict,
    InvalidRequest,
    NotFound,
    SandboxError,
    Timeout,
)
from schemas.env import ReadyPointer, SandboxLimits
from schemas.events import CheckpointReady
from services.environment.client import EnvClient
from tests.integration.env_helpers import (
    BUMP,
    COUNTER,
    START_COUNTER,
    TREE_HASH,
    EnvHarness,
    env_kill,
    make_config,
    running_env,
    versioned_checkpoints,
)

pytestmark = [pytest.mark.docker]


async def _pointer(js, sandbox_id: str) -> ReadyPointer:
    kv = await js.key_value(subjects.BUCKET_SANDBOX_PREFIX)
    entry = await kv.get(sandbox_id)
    return msgspec.msgpack.decode(entry.value, type=ReadyPointer)


@pytest.mark.timeout(180)
async def test_checkpoint_kill_restore_is_prefix_consistent(env, js) -> None:
    c = env.client
    sub = await js.subscribe(subjects.event(CheckpointReady.kind))
    sb = await c.create(files={"/root/counter.py": COUNTER}, trajectory_id="traj-1")
    sid = sb.sandbox_id
    setup = (
        "echo one > /root/a && mkdir -p /root/d && echo two > /root/d/b && "
        "echo keep > /root/c && rm -f /etc/motd /etc/issue.net && " + START_COUNTER
    )
    assert (await c.exec(sid, setup)).exit_code == 0
    assert (await c.exec(sid, BUMP)).stdout.strip() == "1"
    assert (await c.exec(sid, "echo changed >> /root/c && rm /root/d/b")).exit_code == 0
    hash_k = (await c.exec(sid, TREE_HASH)).stdout.strip()

    info = await c.checkpoint(sid, 1)
    assert info.prefix == 1 and info.fs_bytes > 0 and info.criu_bytes > 0
    ptr = await _pointer(js, sid)
    assert (ptr.prefix, ptr.checkpoint_id) == (1, info.checkpoint_id)
    msg = await sub.next_msg(timeout=5)
    event = decode(msg.data, CheckpointReady)
    assert event.checkpoint == info and event.checkpoint.prefix == 1
    assert event.checkpoint.trajectory_id == "traj-1"

    # more actions after k: change, delete, create, advance the process
    later = "echo later > /root/a && rm /root/c && echo new > /root/new && " + BUMP
    assert (await c.exec(sid, later)).stdout.strip().endswith("2")
    assert (await c.exec(sid, TREE_HASH)).stdout.strip() != hash_k

    await env_kill(env, sid)
    restored = await c.restore(sid)
    assert restored.prefix == 1 and restored.checkpoint_id == info.checkpoint_id
    assert restored.container_id != sb.container_id

    assert (await c.exec(sid, TREE_HASH)).stdout.strip() == hash_k
    gone = await c.exec(sid, "ls /root/d/b /etc/motd /root/new 2>&1; cat /root/c")
    assert "No such file" in gone.stdout and gone.stdout.count("No such file") == 3
    assert gone.stdout.strip().endswith("keep\nchanged")
    # the process continues from its in-memory state at k (n == 1), writing to its open file
    assert (await c.exec(sid, BUMP)).stdout.strip() == "2"
    assert (await c.exec(sid, "cat /root/count.log")).stdout.split() == ["1", "2"]

    listing = {s.id: s for s in (await c.list()).sandboxes}
    assert listing[sid].ready_prefix == 1 and listing[sid].container_id == restored.container_id
    await c.destroy(sid)
    with pytest.raises(NotFound):
        await c.exec(sid, "true")


@pytest.mark.timeout(180)
async def test_hostile_and_corrupt_checkpoints_fall_back(env, js, tmp_path) -> None:
    import tarfile

    c = env.client
    sid = (await c.create()).sandbox_id
    first, second = await versioned_checkpoints(c, sid, 2)
    d = env.config.checkpoint_root / sid / second.checkpoint_id
    # a hostile archive whose checksum matches the manifest: the validator must refuse it
    evil = tmp_path / "evil.tar"
    with tarfile.open(evil, "w") as tf:
        info = tarfile.TarInfo("../../../../tmp/belayer-escape")
        info.size = 0
        tf.addfile(info)
    (d / "fs.tar").write_bytes(evil.read_bytes())
    manifest = json.loads((d / "manifest.json").read_text())
    import hashlib

    manifest["fs_sha256"] = hashlib.sha256(evil.read_bytes()).hexdigest()
    (d / "manifest.json").write_text(json.dumps(manifest))
    # the ready pointer recorded the manifest's digest: the rewrite is refused as such ...
    assert (await _pointer(js, sid)).manifests[second.checkpoint_id] == second.manifest_sha256
    with pytest.raises(CheckpointInvalid, match="manifest digest mismatch"):
        await c.restore(sid, second.checkpoint_id)
    # ... and without recorded digests (a pointer of an older release) the archive validator
    # still refuses the traversal before any byte is written
    kv = await js.key_value(subjects.BUCKET_SANDBOX_PREFIX)
    old = await _pointer(js, sid)
    old.manifests = {}
    await kv.put(sid, msgspec.msgpack.encode(old))
    (d.parent / f".quarantine-{second.checkpoint_id}").rename(d)
    with pytest.raises(CheckpointInvalid, match="escapes"):
        await c.restore(sid, second.checkpoint_id)
    (d.parent / f".quarantine-{second.checkpoint_id}").rename(d)
    # default restore: the hostile newest is rejected, the previous ready one is used
    r = await c.restore(sid)
    assert r.checkpoint_id == first.checkpoint_id and second.checkpoint_id in r.fallback_from
    assert (await c.exec(sid, "cat /root/v")).stdout.strip() == "v1"
    assert (await _pointer(js, sid)).prefix == 1
    assert not await asyncio.to_thread(os.path.exists, "/tmp/belayer-escape")

    # a checkpoint of another sandbox is refused
    other = (await c.create()).sandbox_id
    await c.exec(other, "true")
    with pytest.raises(Conflict):
        await c.restore(other, first.checkpoint_id)
    with pytest.raises(NotFound):
        await c.restore(other)  # no ready checkpoint yet


@pytest.mark.timeout(180)
async def test_tampered_checkpoints_are_refused_and_fall_back(
    nc, js, nats_server, tmp_path
) -> None:
    """A modified (manifest rewritten to match), truncated, bit-flipped or substituted
    checkpoint is refused on restore; the newest untouched ready checkpoint is used."""
    async with running_env(nc, nats_server.url, tmp_path, keep_checkpoints=5) as env:
        await _tampered(env, js)


async def _tampered(env: EnvHarness, js) -> None:
    c = env.client
    sid = (await c.create()).sandbox_id
    cks = await versioned_checkpoints(c, sid, 4)
    ptr = await _pointer(js, sid)
    assert ptr.manifests == {ck.checkpoint_id: ck.manifest_sha256 for ck in cks}
    for ck in cks:
        assert set(ck.digests) >= {"fs.tar"} and any(n.startswith("criu/") for n in ck.digests)
    base = env.config.checkpoint_root / sid
    d = [base / ck.checkpoint_id for ck in cks]
    # 4: one byte of the biggest CRIU image flipped (same size)
    img = max((d[3] / "criu").iterdir(), key=lambda p: p.stat().st_size)
    raw = bytearray(img.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    img.write_bytes(bytes(raw))
    # 3: the layer archive truncated
    (d[2] / "fs.tar").write_bytes((d[2] / "fs.tar").read_bytes()[:1024])
    # 2: the layer replaced by checkpoint 3's and the manifest rewritten to match it
    (d[1] / "fs.tar").write_bytes((d[2] / "fs.tar").read_bytes())
    m2 = json.loads((d[1] / "manifest.json").read_text())
    m2["fs_sha256"], m2["fs_bytes"] = cks[2].digests["fs.tar"], 1024
    (d[1] / "manifest.json").write_text(json.dumps(m2))
    # a substituted checkpoint: a copy of 1 planted under a new id (its manifest names it)
    planted = f"{sid}-k000009-abcdef"
    await asyncio.to_thread(shutil.copytree, d[0], base / planted)
    m9 = json.loads((base / planted / "manifest.json").read_text())
    m9["checkpoint_id"], m9["prefix"] = planted, 9
    (base / planted / "manifest.json").write_text(json.dumps(m9))
    with pytest.raises(CheckpointInvalid, match="substituted"):
        await c.restore(sid, planted)

    r = await c.restore(sid)
    assert r.checkpoint_id == cks[0].checkpoint_id
    outcomes = {a.checkpoint_id: (a.outcome, a.error) for a in r.candidates}
    assert "CRIU image checksum mismatch" in outcomes[cks[3].checkpoint_id][1]
    assert "checksum mismatch" in outcomes[cks[2].checkpoint_id][1]
    assert "manifest digest mismatch" in outcomes[cks[1].checkpoint_id][1]
    assert all(outcomes[ck.checkpoint_id][0] == "quarantined" for ck in cks[1:])
    assert (await c.exec(sid, "cat /root/v")).stdout.strip() == "v1"
    after = await _pointer(js, sid)
    assert after.checkpoint_id == cks[0].checkpoint_id
    assert after.manifests[cks[0].checkpoint_id] == cks[0].manifest_sha256
    # the sandbox goes on: a new checkpoint is recorded next to the one that restored
    await c.exec(sid, "echo v5 > /root/v")
    five = await c.checkpoint(sid, 5)
    assert (await _pointer(js, sid)).manifests.keys() >= {
        cks[0].checkpoint_id,
        five.checkpoint_id,
    }


@pytest.mark.timeout(150)
async def test_bad_input_gives_clear_errors(env) -> None:
    c = env.client
    with pytest.raises(NotFound):
        await c.exec("sb-nope", "true")
    with pytest.raises(NotFound):
        await c.checkpoint("sb-nope", 1)
    with pytest.raises(InvalidRequest):
        await c.create(sandbox_id="bad.id")
    sid = (await c.create(limits=SandboxLimits(memory_mb=256, pids=64))).sandbox_id
    other = (await c.create()).sandbox_id
    with pytest.raises(Timeout, match="timeout"):
        await c.exec(sid, "sleep 30 & sleep 30", timeout_s=1.0)
    huge = await c.exec(sid, "head -c 50000000 /dev/zero | tr '\\0' x", timeout_s=20)
    assert huge.truncated and len(huge.stdout) == env.config.exec_output_cap
    net = await c.exec(sid, "ls /sys/class/net")
    assert net.stdout.split() == ["lo"]  # no network: loopback only
    caps = await c.exec(sid, "grep CapEff /proc/self/status")
    assert caps.stdout.split()[1] == "0000000000000000"
    await c.checkpoint(sid, 3)
    with pytest.raises(Conflict):
        await c.checkpoint(sid, 2)  # the prefix must advance
    # the other sandbox is unaffected by all of this
    assert (await c.exec(other, "echo fine")).stdout.strip() == "fine"


@pytest.mark.timeout(240)
async def test_eight_sandboxes_checkpoint_at_once(env) -> None:
    c = env.client
    ids = [(await c.create(limits=SandboxLimits(memory_mb=128))).sandbox_id for _ in range(8)]
    await asyncio.gather(*(c.exec(s, f"echo {s} > /root/me") for s in ids))
    infos = await asyncio.gather(*(c.checkpoint(s, 1) for s in ids))
    assert sorted(i.sandbox_id for i in infos) == sorted(ids)
    await asyncio.gather(*(c.exec(s, "rm /root/me") for s in ids))
    await asyncio.gather(*(c.restore(s) for s in ids))
    outs = await asyncio.gather(*(c.exec(s, "cat /root/me") for s in ids))
    assert [o.stdout.strip() for o in outs] == ids


async def test_requests_while_dockerd_is_unreachable_get_a_clear_error(
    nc, nats_server, tmp_path
) -> None:
    """dockerd down (here: the service pointed at a socket nobody serves): every request gets a
    typed error naming dockerd, and the service keeps answering."""
    config = make_config(
        tmp_path, nats_url=nats_server.url, docker_url="unix:///nonexistent/docker.sock"
    )
    harness = EnvHarness(config, EnvClient(nc, timeout=30))
    await harness.start()
    try:
        for _ in range(2):
            with pytest.raises(SandboxError, match="dockerd"):
                await harness.client.create()
        assert (await harness.client.list()).sandboxes == []
    finally:
        await harness.shutdown()


@pytest.mark.timeout(180)
async def test_a_restored_sandbox_is_an_ordinary_docker_container(env) -> None:
    """The fast restore path (runc restore under containerd's shim, through the ``belayer``
    runtime) leaves a container Docker manages like any other: inspect, exec, limits, kill,
    listing, and it can be checkpointed and restored again."""
    import docker

    c = env.client
    dk = docker.DockerClient(version="auto")
    limits = SandboxLimits(memory_mb=200, cpus=0.5, pids=64)
    sid = (await c.create(limits=limits)).sandbox_id
    await c.exec(sid, "echo one > /root/f")
    await c.checkpoint(sid, 1)
    await env_kill(env, sid)
    r = await c.restore(sid)
    assert r.method == "runtime"  # deploy/install_env.sh registers the runtime
    host = dk.api.inspect_container(r.container_id)
    assert host["State"]["Running"] and not host["State"]["Paused"]
    assert host["HostConfig"]["Runtime"] == env.config.restore_runtime
    assert (host["HostConfig"]["Memory"], host["HostConfig"]["PidsLimit"]) == (200 << 20, 64)
    # the limits hold on the restored processes' cgroups (the host's view: CRIU restores the
    # container's own /sys/fs/cgroup mount as the whole hierarchy, on either restore path)
    assert _cgroup_limits(int(host["State"]["Pid"])) == (200 << 20, 64, 50000)
    listing = {s.id: s for s in (await c.list()).sandboxes}
    assert (listing[sid].container_id, listing[sid].state) == (r.container_id, "running")
    await c.exec(sid, "echo two > /root/f")
    await c.checkpoint(sid, 2)  # runc finds the restored container under the runtime's root
    await env_kill(env, sid)
    with pytest.raises(SandboxError, match="dead"):
        await c.exec(sid, "true")
    again = await c.restore(sid)
    assert again.prefix == 2 and [a.outcome for a in again.candidates] == ["restored"]
    assert (await c.exec(sid, "cat /root/f")).stdout.strip() == "two"


def _cgroup_limits(pid: int) -> tuple[int, int, int]:
    """(memory bytes, pids, CPU quota in µs per 100 ms) of the cgroups ``pid`` runs in."""
    paths: dict[str, str] = {}
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(","):
            paths[controller] = path.lstrip("/")
    if "memory" in paths:  # cgroup v1: one hierarchy per controller

        def v1(controller: str, name: str) -> int:
            return int(Path("/sys/fs/cgroup", controller, paths[controller], name).read_text())

        return (
            v1("memory", "memory.limit_in_bytes"),
            v1("pids", "pids.max"),
            v1("cpu", "cpu.cfs_quota_us"),
        )
    v2 = Path("/sys/fs/cgroup", paths[""])
    quota, period = (v2 / "cpu.max").read_text().split()
    return (
        int((v2 / "memory.max").read_text()),
        int((v2 / "pids.max").read_text()),
        int(quota) * 100_000 // int(period),
    )
