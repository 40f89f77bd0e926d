"""The weight store against a real nats-server: manifests map bit-exactly, in this process and
in another one (zero copy), pushes publish whole versions, bad pushes are refused with typed
errors, and no shared-memory file of the run survives a stop."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import uuid
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from common import shm, subjects
from common.bus import request
from common.codec import decode, encode
from common.errors import Conflict, InvalidRequest, NotFound
from schemas.events import WeightsUpdated
from schemas.weights import WeightManifest, WeightsPush
from services.weights import core
from services.weights.client import fetch_manifest, map_weights, push_weights
from services.weights.config import WeightStoreConfig
from services.weights.service import CURRENT_KEY, run
from services.weights.store import WeightStore
from tests.integration.shm_helpers import WAIT, running_service

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[2]


def running_store(config: WeightStoreConfig) -> AbstractAsyncContextManager[None]:
    """Run the service as a task; on exit stop it and check it removed its files."""
    return running_service(run, config, what="weight store")


def _filled(like: dict[str, torch.Tensor], value: float) -> dict[str, torch.Tensor]:
    return {name: torch.full_like(t, value) for name, t in like.items()}


async def test_manifest_maps_bit_exactly(nats_server, nc, js, model_dir, run_id) -> None:
    config = WeightStoreConfig(nats_url=nats_server.url, run_id=run_id, model_dir=model_dir)
    async with running_store(config):
        manifest = await fetch_manifest(nc)
        assert manifest.version == 1
        assert manifest.model_dir == str(model_dir.resolve())
        mapped = map_weights(manifest)  # its time is bench serve's attach_s, not a test's
        expected = load_file(model_dir / "model.safetensors")
        assert mapped.keys() == expected.keys()
        for name, t in expected.items():
            assert mapped[name].dtype == t.dtype and mapped[name].shape == t.shape
            assert torch.equal(mapped[name], t), name
        assert core.checksum(shm.attach_map(manifest.handle)) == manifest.checksum
        assert (await fetch_manifest(nc, version=1)) == manifest
        with pytest.raises(NotFound):
            await fetch_manifest(nc, version=7)
        # the bucket pointer holds the encoded manifest
        entry = await (await js.key_value(subjects.BUCKET_WEIGHT_VERSION)).get(CURRENT_KEY)
        assert decode(entry.value, WeightManifest) == manifest


CHILD = r"""
import json, sys, time
import torch
from common.codec import decode
from common import shm
from schemas.weights import WeightManifest
from services.weights import core
from services.weights.client import map_weights
manifest = decode(bytes.fromhex(sys.stdin.readline()), WeightManifest)
t0 = time.perf_counter()
tensors = map_weights(manifest)
map_s = time.perf_counter() - t0
digest = core.checksum(shm.attach_map(manifest.handle))
print(json.dumps({"map_s": map_s, "checksum": digest}), flush=True)
sys.stdin.readline()  # the parent wrote a sentinel through its own mapping
print(json.dumps({"first": tensors["model.norm.weight"][0].item()}), flush=True)
"""


async def _line(proc: asyncio.subprocess.Process) -> dict[str, float | str]:
    assert proc.stdout is not None
    raw = await asyncio.wait_for(proc.stdout.readline(), WAIT)
    assert raw, "child exited early"
    return json.loads(raw)


async def test_other_process_maps_same_memory(nats_server, nc, model_dir, run_id) -> None:
    config = WeightStoreConfig(nats_url=nats_server.url, run_id=run_id, model_dir=model_dir)
    async with running_store(config):
        manifest = await fetch_manifest(nc)
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            CHILD,
            cwd=REPO,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        assert proc.stdin is not None
        try:
            proc.stdin.write(encode(manifest).hex().encode() + b"\n")
            report = await _line(proc)
            assert report["checksum"] == manifest.checksum
            # Shared, not copied: a write through our mapping is visible in the child.
            norm = map_weights(manifest)["model.norm.weight"]
            original = norm[0].item()
            norm[0] = 1234.5
            try:
                proc.stdin.write(b"check\n")
                assert (await _line(proc))["first"] == 1234.5
            finally:
                norm[0] = original
            assert await asyncio.wait_for(proc.wait(), WAIT) == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


async def test_push_publishes_whole_versions(nats_server, nc, model_dir, run_id) -> None:
    config = WeightStoreConfig(
        nats_url=nats_server.url, run_id=run_id, model_dir=model_dir, keep_versions=2
    )
    events: asyncio.Queue[WeightsUpdated] = asyncio.Queue()

    async def on_event(msg) -> None:
        await events.put(decode(msg.data, WeightsUpdated))

    await nc.subscribe(subjects.event(WeightsUpdated.kind), cb=on_event)
    async with running_store(config):
        v1 = await fetch_manifest(nc)
        original = load_file(model_dir / "model.safetensors")
        v1_views = map_weights(v1)
        seen: dict[int, int] = {}
        pushing = True

        async def reader() -> None:
            # Each read maps one manifest: all tensors must come from that one version.
            while pushing:
                manifest = await fetch_manifest(nc)
                try:
                    tensors = map_weights(manifest)
                except NotFound:  # collected between get and map: allowed, retry
                    continue
                if manifest.version == 1:
                    assert all(torch.equal(tensors[n], t) for n, t in original.items())
                else:
                    assert all(bool((t == manifest.version).all()) for t in tensors.values())
                seen[manifest.version] = seen.get(manifest.version, 0) + 1

        reader_task = asyncio.create_task(reader())
        base = v1.version
        try:
            for value in (2.0, 3.0, 4.0):
                # reversed dict order: the layout is by name, not by insertion order
                state = dict(reversed(list(_filled(original, value).items())))
                manifest = await push_weights(nc, state, base, run_id)
                assert manifest.version == base + 1 == int(value)
                base = manifest.version
        finally:
            pushing = False
            await asyncio.wait_for(reader_task, WAIT)
        assert set(seen) <= {1, 2, 3, 4} and seen
        current = await fetch_manifest(nc)
        assert current.version == 4
        assert current.tensors == v1.tensors  # same layout, new bytes
        assert all(bool((t == 4.0).all()) for t in map_weights(current).values())
        # keep_versions=2: v1 and v2 are collected; an earlier mapping of v1 stays valid
        with pytest.raises(NotFound):
            await fetch_manifest(nc, version=2)
        with pytest.raises(NotFound):
            map_weights(v1)
        assert all(torch.equal(v1_views[n], t) for n, t in original.items())
        names = {p.name for p in shm.list_files(run_id)}
        assert names == {f"belayer-{run_id}-weights-v3", f"belayer-{run_id}-weights-v4"}
        got = [await asyncio.wait_for(events.get(), WAIT) for _ in range(3)]
        assert [e.version for e in got] == [2, 3, 4]
        assert [e.base_version for e in got] == [1, 2, 3]
        assert got[-1].checksum == current.checksum


async def test_bad_pushes_are_refused(nats_server, nc, model_dir, run_id) -> None:
    config = WeightStoreConfig(nats_url=nats_server.url, run_id=run_id, model_dir=model_dir)
    async with running_store(config):
        v1 = await fetch_manifest(nc)
        state = load_file(model_dir / "model.safetensors")
        with pytest.raises(Conflict):
            await push_weights(nc, state, base_version=0, run_id=run_id)
        missing = dict(state)
        missing.pop("lm_head.weight")
        with pytest.raises(InvalidRequest, match="names differ"):
            await push_weights(nc, missing, v1.version, run_id)
        reshaped = dict(state)
        reshaped["model.norm.weight"] = torch.ones(3)
        with pytest.raises(InvalidRequest, match="dtype or shape"):
            await push_weights(nc, reshaped, v1.version, run_id)
        # a checksum that does not match the bytes sent
        bad = WeightsPush(
            handle=v1.handle, tensors=v1.tensors, checksum="0" * 64, base_version=v1.version
        )
        with pytest.raises(InvalidRequest, match="checksum"):
            await request(nc, subjects.weights_push(), bad, WeightManifest, timeout=5)
        # memory that does not exist
        gone = WeightsPush(
            handle=shm.shm_handle(Path(f"/dev/shm/belayer-{run_id}-nope"), v1.handle.size),
            tensors=v1.tensors,
            checksum=v1.checksum,
            base_version=v1.version,
        )
        with pytest.raises(NotFound):
            await request(nc, subjects.weights_push(), gone, WeightManifest, timeout=5)
        # nothing half-published, no pusher temp file left behind
        assert (await fetch_manifest(nc)) == v1
        assert [p.name for p in shm.list_files(run_id)] == [f"belayer-{run_id}-weights-v1"]


def test_restarted_store_adopts_intact_version(model_dir, run_id) -> None:
    first = WeightStore(run_id, model_dir)
    v1 = first.start(None)
    # a store killed without cleanup leaves its file; the next one adopts it
    second = WeightStore(run_id, model_dir)
    assert second.start(v1) == v1
    # a damaged file is not adopted: the model is reloaded from disk as the next version
    shm.attach(v1.handle)[0] ^= 0xFF
    third = WeightStore(run_id, model_dir)
    v2 = third.start(v1)
    assert v2.version == 2 and v2.checksum == v1.checksum
    assert [p.name for p in shm.list_files(run_id)] == [f"belayer-{run_id}-weights-v2"]
    # another run's pointer is ignored: a fresh run starts at version 1, or at the
    # first_version it is given (a resumed run's node goes on with the run's numbering)
    other = f"o{uuid.uuid4().hex[:8]}"
    try:
        assert WeightStore(other, model_dir).start(v2).version == 1
        assert WeightStore(other, model_dir, first_version=14).start(v2).version == 14
    finally:
        for path in shm.list_files(other):
            shm.unlink(path)
    third.close()
    assert shm.list_files(run_id) == []


async def test_main_serves_until_sigterm(nats_server, nc, js, model_dir, run_id) -> None:
    kv = await js.key_value(subjects.BUCKET_WEIGHT_VERSION)
    watcher = await kv.watch(CURRENT_KEY)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services.weights",
        "--nats-url",
        nats_server.url,
        "--run-id",
        run_id,
        "--model-dir",
        str(model_dir),
        cwd=REPO,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        entry = await watcher.updates(timeout=WAIT)
        while entry is None or entry.value is None:  # the watcher's "caught up" marker
            entry = await watcher.updates(timeout=WAIT)
        manifest = decode(entry.value, WeightManifest)
        assert manifest == await fetch_manifest(nc)
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), WAIT) == 0
        assert shm.list_files(run_id) == []
        assert not Path(manifest.handle.path).exists()  # noqa: ASYNC240 (one stat, in a test)
    finally:
        await watcher.stop()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
