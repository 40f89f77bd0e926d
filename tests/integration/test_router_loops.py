"""The router's background loops outlive one bad record (real nats-server, the real router on
a tiny model's tokenizer): a record no decode would let in — an engine id that is not a
subject token — is logged and dropped, and the loop goes on with the next item."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from common import subjects
from common.codec import decode
from schemas.serving import AcceptedRequest, SamplingParams, TokenLogChunk
from services.router.config import RouterConfig
from services.router.service import Router
from services.router.state import EngineStatus, PersistChunk

pytestmark = pytest.mark.timeout(60)


def _router(nc: object, js: object, model_dir: Path) -> Router:
    config = RouterConfig(
        model_dir=str(model_dir), heartbeat_interval_s=0.05, heartbeat_timeout_s=0.2
    )
    return Router(config, nc, js)  # type: ignore[arg-type]


async def test_heartbeat_loop_outlives_an_engine_it_cannot_ping(nc, js, model_dir) -> None:  # type: ignore[no-untyped-def]
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


async def test_persist_loop_drops_a_bad_chunk_and_persists_the_next(nc, js, model_dir) -> None:  # type: ignore[no-untyped-def]
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
