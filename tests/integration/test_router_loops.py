"""The router's background loops outlive one bad record (real nats-server, the real router on
a tiny model's tokenizer): a record no decode would let in — an engine id that is not a
subject token — is logged and dropped, and the loop goes on with the next item."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from common import subjects
from common.codec import decode
from schemas.serving import AcceptedRequest, SamplingParams, TokenLogChunk
from services.router.config import RouterConfig
from services.router.service import RouterService
from services.router.state import EngineStatus, PersistChunk

pytestmark = pytest.mark.timeout(60)


def _router(nc: NATS, js: JetStreamContext, model_dir: Path) -> RouterService:
    """The router service with its bus handles set, as the lifecycle sets them before
    ``setup`` (its loops are driven by hand here)."""
    config = RouterConfig(
        model_dir=str(model_dir), heartbeat_interval_s=0.05, heartbeat_timeout_s=0.2
    )
    router = RouterService(config)
    router.nc, router.js = nc, js
    return router


async def test_heartbeat_loop_outlives_an_engine_it_cannot_ping(nc, js, model_dir) -> None:
    router = _router(nc, js, model_dir)
    router.core.register("a.b", 1, 4242)  # first in the registry, and no subject can name it
    router.core.register("e0", 1, 4243)  # no such worker: it misses its pings
    task = asyncio.create_task(router.heartbeat_loop())
    try:
        deadline = time.monotonic() + 20
        while router.core.engines["e0"].status is not EngineStatus.DOWN:
            assert not task.done(), f"heartbeat loop ended: {task.exception()!r}"
            assert time.monotonic() < deadline, "e0 was never pinged"
            await asyncio.sleep(0.05)  # polling the loop's effect on the registry (bounded)
        assert not task.done()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_persist_loop_drops_a_bad_chunk_and_persists_the_next(nc, js, model_dir) -> None:
    router = _router(nc, js, model_dir)
    task = asyncio.create_task(router.persist_loop())
    try:
        bad = TokenLogChunk(
            request_id="a.b", chunk_index=0, start=0, token_ids=[1], logprobs=[0.0], weight_versions=[1]
        )  # fmt: skip
        router.persist_q.put_nowait(PersistChunk(bad))
        good = AcceptedRequest(
            request_id="ok-1", prompt_token_ids=[1, 2], sampling=SamplingParams()
        )
        router.persist_q.put_nowait(good)
        await asyncio.wait_for(router.persist_q.join(), 20)
        assert not task.done(), f"persist loop ended: {task.exception()!r}"
        msg = await js.get_last_msg(subjects.STREAM_REQUESTS, subjects.request_log("ok-1"))
        assert decode(msg.data, AcceptedRequest).request_id == "ok-1"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_worker_silent_at_discovery_is_found_by_the_heartbeat_loop(
    nc, js, model_dir
) -> None:
    """A restarted router pings the engines of the epoch bucket once; a worker that misses that
    ping (a loaded machine) registers nowhere else, so the heartbeat loop keeps asking until it
    answers — then the engine is up and the restored request waiting for it is placed. The
    worker here is the three subjects a worker answers (ping, state, generate) on the real bus."""
    from common.bus import Server
    from common.epoch import claim_epoch
    from schemas.base import Ok
    from schemas.serving import EngineStateReply, EngineStateRequest, EngineSubmit, Ping, PingReply

    router = _router(nc, js, model_dir)
    epoch = await claim_epoch(js, "e0")
    router.core.restore("r-1", [1, 2, 3], SamplingParams(seed=1), [], inbox=None)
    await router.discover(("e0",))  # nothing answers e0's ping yet
    assert router.silent == {"e0"}
    assert "e0" not in router.core.engines
    assert router.core.pending == ["r-1"]  # kept, waiting for an engine

    answering = Server(nc, service="worker-e0")

    async def on_ping(_req: Ping, _msg: object) -> PingReply:
        return PingReply(
            engine_id="e0", epoch=epoch, pid=4244, running=0, waiting=0, weight_version=0, steps=0
        )

    submitted: list[str] = []

    async def on_state(_req: EngineStateRequest, _msg: object) -> EngineStateReply:
        return EngineStateReply(engine_id="e0", epoch=epoch, weight_version=0, requests=[])

    async def on_submit(req: EngineSubmit, _msg: object) -> Ok:
        submitted.extend(r.request_id for r in req.requests)
        return Ok()

    await answering.serve(subjects.engine_ping("e0"), Ping, on_ping)
    await answering.serve(subjects.engine_state("e0"), EngineStateRequest, on_state)
    await answering.serve(subjects.engine_generate("e0"), EngineSubmit, on_submit)
    task = asyncio.create_task(router.heartbeat_loop())
    try:
        deadline = time.monotonic() + 20
        while "e0" not in router.core.engines:
            assert not task.done(), f"heartbeat loop ended: {task.exception()!r}"
            assert time.monotonic() < deadline, "the silent engine was never found again"
            await asyncio.sleep(0.05)  # polling the loop's effect on the registry (bounded)
        assert router.silent == set()
        eng = router.core.engines["e0"]
        assert (eng.epoch, eng.worker_pid) == (epoch, 4244)
        assert router.core.active["r-1"].engine_id == "e0"  # placed on the found engine
        while not submitted:
            assert time.monotonic() < deadline, "the restored request was never submitted"
            await asyncio.sleep(0.05)
        assert submitted == ["r-1"]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await answering.drain(timeout=1.0)
