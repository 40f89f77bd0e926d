"""The bus: connecting to NATS, typed request/reply, serving a subject, JetStream declarations.

Library exceptions are translated here into ``common.errors`` types, so services and callers
only ever catch Belayer errors.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, RetentionPolicy, StorageType, StreamConfig

from common import subjects
from common.codec import decode, encode, error_reply, raise_error
from common.errors import BelayerError, BusUnavailable, Timeout
from common.logging import get_logger
from schemas.base import ErrorReply, Message

R = TypeVar("R")

log = get_logger(component="bus")


async def connect(url: str, *, name: str, timeout: float = 5.0, reconnect: bool = True) -> NATS:
    """Connect to NATS or raise ``BusUnavailable`` (with the URL) within ``timeout`` seconds."""
    try:
        return await asyncio.wait_for(
            nats.connect(
                url,
                name=name,
                connect_timeout=min(timeout, 2.0),
                max_reconnect_attempts=-1 if reconnect else 0,
                reconnect_time_wait=0.25,
                allow_reconnect=reconnect,
                error_cb=_error_cb,
            ),
            timeout,
        )
    except (TimeoutError, OSError, nats.errors.Error) as exc:
        why = str(exc) or type(exc).__name__
        raise BusUnavailable(f"cannot reach NATS at {url}: {why}", url=url) from None


async def _error_cb(exc: Exception) -> None:
    log.debug("nats_client_error", error=repr(exc))


async def request(
    nc: NATS,
    subject: str,
    msg: Message,
    reply_type: Any,
    *,
    timeout: float = 5.0,
) -> Any:
    """Send ``msg`` and decode the reply as ``reply_type``; an ``ErrorReply`` raises its typed
    error, no responder raises ``BusUnavailable``, silence raises ``Timeout``."""
    try:
        resp = await nc.request(subject, encode(msg), timeout=timeout)
    except nats.errors.NoRespondersError:
        raise BusUnavailable("no service answers on this subject", subject=subject) from None
    except nats.errors.TimeoutError:
        raise Timeout("no reply in time", subject=subject, timeout=timeout) from None
    except nats.errors.ConnectionClosedError:
        raise BusUnavailable("NATS connection closed", subject=subject) from None
    reply = decode(resp.data, reply_type | ErrorReply)
    if isinstance(reply, ErrorReply):
        raise_error(reply)
    return reply


Handler = Callable[[Any, Msg], Awaitable[Message | None]]


class Server:
    """Serves typed requests on subjects; every failure becomes an ``ErrorReply`` and a log line,
    never a dead subscription. ``concurrent=True`` handles each message in its own task (tracked,
    so ``drain`` can wait for them)."""

    def __init__(self, nc: NATS, *, service: str) -> None:
        self.nc = nc
        self.service = service
        self.subs: list[Subscription] = []
        self.tasks: set[asyncio.Task[None]] = set()
        self.log = get_logger(service=service)

    async def serve(
        self,
        subject: str,
        request_type: Any,
        handler: Handler,
        *,
        queue: str | None = None,
        concurrent: bool = False,
    ) -> Subscription:
        async def handle(msg: Msg) -> None:
            reply: Message | None
            try:
                req = decode(msg.data, request_type)
                reply = await handler(req, msg)
            except BelayerError as exc:
                self.log.warning("request_rejected", subject=subject, code=exc.code, error=str(exc))
                reply = error_reply(exc)
            except Exception as exc:  # a bug in one request must not kill the subscription
                self.log.exception("request_failed", subject=subject)
                reply = error_reply(BelayerError(f"internal error: {type(exc).__name__}: {exc}"))
            if reply is not None and msg.reply:
                try:
                    await self.nc.publish(msg.reply, encode(reply))
                except nats.errors.Error as exc:
                    self.log.warning("reply_failed", subject=subject, error=repr(exc))

        async def cb(msg: Msg) -> None:
            if not concurrent:
                await handle(msg)
                return
            task = asyncio.create_task(handle(msg))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

        sub = await self.nc.subscribe(subject, queue=queue or "", cb=cb)
        # Round-trip to the server so the subscription is live before anyone is told "ready"
        # (otherwise a request from another connection can beat our SUB and see no responders).
        await self.nc.flush(timeout=5)
        self.subs.append(sub)
        return sub

    async def drain(self, timeout: float = 10.0) -> None:
        """Stop taking requests and let the in-flight ones finish and reply, all within
        ``timeout``. ``sub.drain()`` unsubscribes but still hands over every message the server
        already sent and waits until its handler returned (``unsubscribe()`` would cancel the
        handler and drop pending messages); concurrent handlers are tracked tasks, waited for
        after. The connection stays open (its owner drains it last). Idempotent."""
        subs, self.subs = self.subs, []
        deadline = asyncio.get_running_loop().time() + timeout
        drains = [asyncio.ensure_future(_drain_sub(sub)) for sub in subs]
        if drains:
            _, late = await asyncio.wait(drains, timeout=timeout)
            for task in late:
                task.cancel()
            if late:
                self.log.warning("drain_timeout", subscriptions=len(late), timeout=timeout)
        left = deadline - asyncio.get_running_loop().time()
        if self.tasks:
            _, late_handlers = await asyncio.wait(set(self.tasks), timeout=max(0.0, left))
            if late_handlers:
                self.log.warning("drain_timeout", handlers=len(late_handlers), timeout=timeout)


async def _drain_sub(sub: Subscription) -> None:
    try:
        await sub.drain()
    except nats.errors.Error:  # connection closed or draining, or already unsubscribed
        pass


# --- JetStream ----------------------------------------------------------------------------
DAY = 24 * 3600.0

STREAMS: dict[str, dict[str, Any]] = {
    subjects.STREAM_TOKENS: dict(
        subjects=[subjects.TOKEN_LOG_ALL],
        max_age=DAY,
        max_bytes=1 << 30,
        duplicate_window=300.0,
    ),
    subjects.STREAM_REQUESTS: dict(
        subjects=[subjects.REQUEST_LOG_ALL],
        max_age=DAY,
        max_bytes=256 << 20,
        duplicate_window=300.0,
    ),
    subjects.STREAM_EVENTS: dict(
        subjects=[subjects.EVENTS_ALL],
        max_age=DAY,
        max_msgs=200_000,
        max_bytes=256 << 20,
        duplicate_window=120.0,
    ),
    subjects.STREAM_TRAJECTORIES: dict(
        subjects=[subjects.TRAJECTORIES_ALL],
        max_age=7 * DAY,
        max_bytes=1 << 30,
        duplicate_window=300.0,
    ),
    subjects.STREAM_DEADLETTER: dict(
        subjects=[subjects.DEAD_LETTER_ALL],
        max_age=7 * DAY,
        max_bytes=256 << 20,
        duplicate_window=300.0,
    ),
}

BUCKETS: dict[str, dict[str, Any]] = {
    subjects.BUCKET_WEIGHT_VERSION: dict(history=5),
    subjects.BUCKET_ENGINE_EPOCHS: dict(history=5),
    subjects.BUCKET_REQUESTS: dict(history=1, ttl=DAY),
    subjects.BUCKET_SANDBOX_PREFIX: dict(history=5),
    subjects.BUCKET_ROLLOUTS: dict(history=1, ttl=7 * DAY),
    subjects.BUCKET_TRAJECTORY_PREFIX: dict(history=1, ttl=7 * DAY),
}


async def ensure_jetstream(js: JetStreamContext) -> None:
    """Declare every stream and KV bucket idempotently (create, or update to this config)."""
    for name, params in STREAMS.items():
        config = StreamConfig(
            name=name, storage=StorageType.FILE, retention=RetentionPolicy.LIMITS, **params
        )
        try:
            await js.add_stream(config)
        except nats.js.errors.BadRequestError:
            await js.update_stream(config)
    for bucket, params in BUCKETS.items():
        try:
            await js.key_value(bucket)
        except nats.js.errors.BucketNotFoundError:
            await js.create_key_value(KeyValueConfig(bucket=bucket, **params))
