"""What a restarted router reads back: the durable request and token logs (JetStream), and
which engines still have a live worker (the epoch bucket, then a ping at the claimed epoch).

Plain functions over the bus handles and the core they fill; the service decides when to call
them (``RouterService.setup``, and the heartbeat loop for a worker that did not answer yet).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from common import subjects
from common.bus import js_call, request
from common.codec import decode
from common.epoch import current_epoch
from common.errors import BelayerError
from schemas.serving import (
    AcceptedRequest,
    EngineStateReply,
    EngineStateRequest,
    PingReply,
    TokenLogChunk,
)
from services.router.core import RouterCore
from services.router.liveness import ping_engine
from services.router.state import request_identity

M = TypeVar("M")


async def read_log(
    js: JetStreamContext, stream: str, subject: str, typ: type[M], *, timeout_s: float, log: Any
) -> list[M]:
    """Every message of ``stream`` on ``subject``, decoded (a bad record is logged and
    skipped), read for at most ``timeout_s``."""
    what = f"cannot read {stream}"
    try:
        info = await js_call(lambda: js.stream_info(stream), what=what)
    except nats.js.errors.NotFoundError:
        return []
    if info.state.messages == 0:
        return []
    sub = await js_call(lambda: js.subscribe(subject, ordered_consumer=True), what=what)
    out: list[M] = []
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            try:
                msg = await sub.next_msg(timeout=1.0)
            except TimeoutError:
                break
            try:
                out.append(decode(msg.data, typ))
            except BelayerError as exc:
                log.warning("bad_log_record", stream=stream, error=str(exc))
            if msg.metadata.num_pending == 0:
                break
    finally:
        await sub.unsubscribe()
    return out


async def restore_from_log(
    js: JetStreamContext, core: RouterCore, *, timeout_s: float, log: Any
) -> None:
    """After a restart: finished requests become replayable, unfinished ones resume from their
    last logged chunk (at most k tokens are regenerated; seeds make them identical). Pending
    requests are held (``core.hold_pending``) until the live workers have been asked what they
    still run."""
    t0 = time.monotonic()
    accepted = await read_log(
        js,
        subjects.STREAM_REQUESTS,
        subjects.REQUEST_LOG_ALL,
        AcceptedRequest,
        timeout_s=timeout_s,
        log=log,
    )
    if not accepted:
        return
    core.hold_pending = True
    chunks = await read_log(
        js, subjects.STREAM_TOKENS, subjects.TOKEN_LOG_ALL, TokenLogChunk, timeout_s=timeout_s, log=log
    )  # fmt: skip
    by_request: dict[str, list[TokenLogChunk]] = {}
    for c in chunks:
        by_request.setdefault(c.request_id, []).append(c)
    for a in accepted:
        sampling = msgspec.structs.replace(a.sampling, seed=None) if a.seed_filled else a.sampling
        core.restore(
            a.request_id,
            a.prompt_token_ids,
            a.sampling,
            by_request.get(a.request_id, []),
            inbox=a.reply_to,
            identity=request_identity(a.prompt_token_ids, sampling),
        )
    log.info(
        "router_restored",
        requests=len(accepted),
        unfinished=len(core.active),
        chunks=len(chunks),
        seconds=round(time.monotonic() - t0, 3),
    )


@dataclass(frozen=True)
class LiveEngine:
    """An engine whose worker answered its ping at the epoch the bucket says it claimed."""

    engine_id: str
    epoch: int
    pong: PingReply


async def live_engines(
    nc: NATS, js: JetStreamContext, engine_ids: Sequence[str], *, timeout_s: float
) -> tuple[list[LiveEngine], list[str]]:
    """Of ``engine_ids``, those with a claimed epoch whose worker answers within ``timeout_s``,
    and those with a claimed epoch whose worker does not (yet): a worker only registers at its
    start, so a restarted router must find it, and keep trying the ones that were silent (a
    ping missed on a loaded machine would otherwise leave an engine unknown for good)."""
    live: list[LiveEngine] = []
    silent: list[str] = []
    for engine_id in engine_ids:
        # One direct read per engine, not the bucket's key list: nats-py lists keys with a
        # watcher whose end-of-replay marker can come early (a partial list, or a spurious
        # NoKeysError) or never; a restarted router then neither found its engine nor tried it
        # again (seen once in CI: the engine never came back under the new router).
        epoch, revision = await current_epoch(js, engine_id)
        if revision is None:
            continue  # never claimed: no worker started yet
        pong = await ping_engine(nc, engine_id, epoch=epoch, timeout=timeout_s)
        if pong is None:
            silent.append(engine_id)
        else:
            live.append(LiveEngine(engine_id, epoch, pong))
    return live, silent


async def held_requests(
    nc: NATS, engine_id: str, request_ids: list[str], *, timeout_s: float
) -> EngineStateReply:
    """What ``engine_id``'s worker still holds of ``request_ids`` (tokens so far, finished or
    not). Raises the typed error of a worker that does not answer."""
    return await request(
        nc,
        subjects.engine_state(engine_id),
        EngineStateRequest(request_ids=request_ids),
        EngineStateReply,
        timeout=timeout_s,
    )
