"""The bus: connecting to NATS, typed request/reply, serving a subject, JetStream declarations.

Library exceptions are translated here into ``common.errors`` types, so services and callers
only ever catch Belayer errors.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import (
    KeyValueConfig,
    ObjectStoreConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)

from common import subjects
from common.auth import BusConfig, inbox_prefix, public_key_of, read_seed, redact
from common.codec import decode, encode, error_reply, raise_error
from common.errors import (
    BelayerError,
    BusUnavailable,
    Overloaded,
    ResourceLimit,
    Timeout,
    Unauthorized,
)
from common.logging import get_logger
from common.tasks import keep
from schemas.base import ErrorReply, Message

R = TypeVar("R")

log = get_logger(component="bus")

RECONNECT_WAIT_S = 0.25
"""Pause between two tries of the same NATS server (nats-py's ``reconnect_time_wait``)."""


def connect_attempts(timeout: float, reconnect: bool) -> int:
    """nats-py's ``max_reconnect_attempts`` once connected: unbounded (-1) for a service's
    connection (it keeps reconnecting), else as many tries of a refusing server as fit in
    ``timeout`` less one pause. The first connect of every connection uses the bounded count
    (``reconnect=False``), so it gives up by itself before the timeout; a service's connection
    lifts the bound once it is up. Counting on the timeout alone could hang: nats-py retries a
    refusing server forever when the count is unbounded, and Python 3.11's
    ``asyncio.wait_for`` inside its connect can swallow the cancellation that should stop it
    (seen once in a CI run: ``belayer up --join`` a dead port hung past its 120 s test
    limit)."""
    if reconnect:
        return -1
    return max(1, int(timeout / RECONNECT_WAIT_S) - 1)


async def connect(
    url: str,
    *,
    name: str,
    bus: BusConfig | None = None,
    timeout: float = 5.0,
    reconnect: bool = True,
) -> NATS:
    """Connect to NATS as the identity in ``bus.creds`` (none: anonymous), over TLS when
    ``bus`` names a CA, or raise within ``timeout`` seconds: ``Unauthorized`` for credentials
    or TLS files that are missing, unreadable, do not match or are refused, ``BusUnavailable``
    (with the URL) when no server answers. ``url`` may list several servers, comma-separated
    (a cluster: the client fails over between them). Every bus connection of Belayer is made
    here; a permission violation the server reports on it is one ``bus_permission_denied``
    log line."""
    bus = bus or BusConfig()
    servers = [u.strip() for u in url.split(",") if u.strip()]
    if not servers:
        raise BusUnavailable("no NATS URL given")
    opts: dict[str, Any] = {}
    if bus.creds:
        seed = read_seed(bus.creds)  # Unauthorized naming the file (never its content)
        opts["nkeys_seed"] = str(bus.creds)
        opts["inbox_prefix"] = inbox_prefix(public_key_of(seed))
        del seed
    if bus.tls_ca or bus.tls_cert or any(u.startswith("tls://") for u in servers):
        opts["tls"] = tls_context(bus)
    where = ",".join(servers)
    denials = _Denials()

    async def error_cb(exc: Exception) -> None:
        subject = await _error_cb(name, exc)
        if subject:
            denials.report(subject)

    try:
        nc = await asyncio.wait_for(
            nats.connect(
                servers,
                name=name,
                connect_timeout=min(timeout, 2.0),
                max_reconnect_attempts=connect_attempts(timeout, reconnect=False),
                reconnect_time_wait=RECONNECT_WAIT_S,
                allow_reconnect=reconnect,
                error_cb=error_cb,
                **opts,
            ),
            timeout,
        )
        nc._belayer_denials = denials  # type: ignore[attr-defined]  # our attribute on nats-py's client
        # nats-py reads this option at each reconnection: a service's connection now retries
        # without bound (its first connect above was bounded).
        nc.options["max_reconnect_attempts"] = connect_attempts(timeout, reconnect)
        return nc
    except ssl.SSLError as exc:
        raise Unauthorized(f"TLS with NATS at {where} failed: {exc.reason or exc}") from None
    except (TimeoutError, OSError, nats.errors.Error) as exc:
        why = redact(str(exc) or type(exc).__name__)
        if "authorization violation" in why.lower() or "authentication" in why.lower():
            raise Unauthorized(
                f"NATS at {where} refused this connection's credentials ({why})", url=where
            ) from None
        raise BusUnavailable(f"cannot reach NATS at {where}: {why}", url=where) from None


def tls_context(bus: BusConfig) -> ssl.SSLContext:
    """The client TLS context of ``bus`` (its CA, and its certificate if it has one);
    ``Unauthorized`` with a one-line reason for a file that is missing or does not match."""
    try:
        ctx = ssl.create_default_context(cafile=bus.tls_ca or None)
        if bus.tls_cert:
            ctx.load_cert_chain(bus.tls_cert, bus.tls_key)
    except FileNotFoundError as exc:
        raise Unauthorized(f"TLS file {exc.filename} does not exist") from None
    except (ssl.SSLError, OSError) as exc:
        files = ", ".join(f for f in (bus.tls_ca, bus.tls_cert, bus.tls_key) if f)
        reason = getattr(exc, "reason", None) or getattr(exc, "strerror", None) or str(exc)
        raise Unauthorized(f"TLS files ({files}) are not usable: {reason}") from None
    return ctx


_PERMISSION = re.compile(r'Permissions Violation for (\w+) (?:to|from) "?([^"\s]+)"?', re.I)


async def _error_cb(name: str, exc: Exception) -> str:
    """Log a client error; the subject of a publish permission violation, else ``""``."""
    text = redact(str(exc))
    found = _PERMISSION.search(text)
    if found:
        log.warning(
            "bus_permission_denied",
            connection=name,
            operation=found.group(1).lower(),
            subject=found.group(2),
            error=text,
        )
        return found.group(2) if found.group(1).lower() == "publish" else ""
    log.debug("nats_client_error", connection=name, error=text)
    return ""


class _Denials:
    """Publish permission violations the server reported on one connection, so a request
    to a forbidden subject fails at once with ``Unauthorized`` instead of waiting for its
    time-out (the server drops the message and says so only asynchronously)."""

    def __init__(self) -> None:
        self.waiting: dict[str, set[asyncio.Future[None]]] = {}

    def report(self, subject: str) -> None:
        """``subject`` as the server's error names it (nats-py lowercases that message)."""
        for fut in self.waiting.pop(subject.lower(), set()):
            if not fut.done():
                fut.set_result(None)

    async def race(self, subject: str, call: Awaitable[R]) -> R:
        denied: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiting.setdefault(subject.lower(), set()).add(denied)
        task = asyncio.ensure_future(call)
        try:
            both: set[asyncio.Future[Any]] = {task, denied}
            await asyncio.wait(both, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                return task.result()
            task.cancel()
            raise Unauthorized("this identity may not publish to the subject", subject=subject)
        finally:
            if not task.done():
                task.cancel()
            self.waiting.get(subject.lower(), set()).discard(denied)


RESPONDER_POLL_S = 0.05
"""``request(responder_wait_s=…)``: the first pause before asking again (doubling)."""
RESPONDER_POLL_MAX_S = 0.5
"""... and the longest pause between two asks."""


async def request(
    nc: NATS,
    subject: str,
    msg: Message,
    reply_type: type[R],
    *,
    timeout: float = 5.0,
    responder_wait_s: float = 0.0,
) -> R:
    """Send ``msg`` and decode the reply as ``reply_type`` (one message class: the result is
    typed as it); an ``ErrorReply`` raises its typed error, no responder raises
    ``BusUnavailable``, silence raises ``Timeout``, a subject this connection's identity may
    not publish to raises ``Unauthorized`` (the server said so). ``responder_wait_s``: while
    no service answers (one the supervisor is restarting), ask again for up to that long
    instead of failing at once; each ask waits ``timeout`` for its reply."""
    denials: _Denials | None = getattr(nc, "_belayer_denials", None)
    loop = asyncio.get_running_loop()
    give_up, pause = loop.time() + responder_wait_s, RESPONDER_POLL_S
    while True:
        try:
            call = nc.request(subject, encode(msg), timeout=timeout)
            resp = await (call if denials is None else denials.race(subject, call))
            break
        except nats.errors.NoRespondersError:
            if loop.time() + pause > give_up:
                raise BusUnavailable(
                    "no service answers on this subject", subject=subject
                ) from None
        except nats.errors.TimeoutError:
            raise Timeout("no reply in time", subject=subject, timeout=timeout) from None
        except nats.errors.ConnectionClosedError:
            raise BusUnavailable("NATS connection closed", subject=subject) from None
        await asyncio.sleep(pause)  # a restarting service: ask again, backing off
        pause = min(pause * 2, RESPONDER_POLL_MAX_S)
    reply = decode(resp.data, reply_type | ErrorReply)
    if isinstance(reply, ErrorReply):
        raise_error(reply)
    return cast(R, reply)


Handler = Callable[[Any, Msg], Awaitable[Message | None]]

MAX_REQUEST_BYTES = 1 << 20
"""Default bound on one request's size (a subject may set its own, up to the server's
``max_payload``): a larger one is refused ``resource_limit`` before a byte is decoded."""
MAX_PENDING = 256
"""Default bound on the requests of one subject held at once (queued and running); beyond it
a request is refused ``overloaded`` (retryable) unread, so a flood costs neither memory nor
the other subjects' callers their turn."""


class Server:
    """Serves typed requests on subjects; every failure becomes an ``ErrorReply`` and a log line,
    never a dead subscription. Before any work, a request with no reply subject is dropped (a
    log line), one over ``max_bytes`` is refused ``resource_limit`` unread and one beyond
    ``max_pending`` held requests of its subject is refused ``overloaded``. Handlers run in
    tracked tasks (so ``drain`` can wait for them): in arrival order one at a time, or with
    ``concurrent=True`` side by side."""

    def __init__(self, nc: NATS, *, service: str) -> None:
        self.nc = nc
        self.service = service
        self.subs: list[Subscription] = []
        self.tasks: set[asyncio.Task[None]] = set()
        self.log = get_logger(service=service)
        self.shed: dict[str, int] = {}
        """Requests refused unread per subject (too large, overloaded, no reply subject)."""
        self._last_shed_log: dict[str, float] = {}

    async def serve(
        self,
        subject: str,
        request_type: Any,
        handler: Handler,
        *,
        queue: str | None = None,
        concurrent: bool = False,
        max_bytes: int = MAX_REQUEST_BYTES,
        max_pending: int = MAX_PENDING,
        reply_required: bool = True,
    ) -> Subscription:
        """Serve ``subject``. ``reply_required=False`` for a subject callers publish to
        without waiting (``engine.<id>.abort``)."""
        held = 0
        turn = asyncio.Lock()

        async def handle(msg: Msg) -> None:
            nonlocal held
            try:
                if concurrent:
                    await answer(msg)
                else:
                    async with turn:  # FIFO: one at a time, in arrival order
                        await answer(msg)
            finally:
                held -= 1

        async def answer(msg: Msg) -> None:
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
                await self._reply(subject, msg.reply, reply)

        async def cb(msg: Msg) -> None:
            nonlocal held
            if reply_required and not msg.reply:
                self._count_shed(subject, "no_reply_subject")
                return
            if len(msg.data) > max_bytes:
                self._count_shed(subject, "too_large")
                if msg.reply:
                    too_big = ResourceLimit(
                        "request too large", bytes=len(msg.data), limit=max_bytes
                    )
                    await self._reply(subject, msg.reply, error_reply(too_big))
                return
            if held >= max_pending:
                self._count_shed(subject, "overloaded")
                if msg.reply:
                    busy = Overloaded(
                        "too many requests on this subject; retry later",
                        subject=subject,
                        limit=max_pending,
                    )
                    await self._reply(subject, msg.reply, error_reply(busy))
                return
            held += 1
            keep(self.tasks, asyncio.create_task(handle(msg)))

        sub = await self.nc.subscribe(subject, queue=queue or "", cb=cb)
        # Round-trip to the server so the subscription is live before anyone is told "ready"
        # (otherwise a request from another connection can beat our SUB and see no responders).
        await self.nc.flush(timeout=5)
        self.subs.append(sub)
        return sub

    async def _reply(self, subject: str, inbox: str, reply: Message) -> None:
        try:
            await self.nc.publish(inbox, encode(reply))
        except nats.errors.Error as exc:
            self.log.warning("reply_failed", subject=subject, error=repr(exc))

    def _count_shed(self, subject: str, why: str) -> None:
        """Count a request refused unread; log it at most once a second per subject."""
        key = f"{subject}:{why}"
        self.shed[key] = self.shed.get(key, 0) + 1
        now = time.monotonic()
        if now - self._last_shed_log.get(key, -1e9) >= 1.0:
            self._last_shed_log[key] = now
            self.log.warning("request_shed", subject=subject, reason=why, total=self.shed[key])

    async def drain(self, timeout: float = 10.0) -> None:
        """Stop taking requests and let the in-flight ones finish and reply, all within
        ``timeout``. ``sub.drain()`` unsubscribes but still hands over every message the server
        already sent (``unsubscribe()`` would drop pending messages); every handler is a
        tracked task, waited for after. The connection stays open (its owner drains it last).
        Idempotent."""
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

ENV_HOST_TTL_S = 60.0
"""An environment host's registration expires this long after its last refresh (a host
refreshes every ``EnvConfig.register_every_s``)."""

BUCKETS: dict[str, dict[str, Any]] = {
    subjects.BUCKET_WEIGHT_VERSION: dict(history=5),
    subjects.BUCKET_ENGINE_EPOCHS: dict(history=5),
    subjects.BUCKET_REQUESTS: dict(history=1, ttl=DAY),
    subjects.BUCKET_SANDBOX_PREFIX: dict(history=5),
    subjects.BUCKET_ROLLOUTS: dict(history=1, ttl=7 * DAY),
    subjects.BUCKET_TRAJECTORY_PREFIX: dict(history=1, ttl=7 * DAY),
    subjects.BUCKET_ENV_HOSTS: dict(history=1, ttl=ENV_HOST_TTL_S),
}

OBJECT_STORES: dict[str, dict[str, Any]] = {
    subjects.OBJECT_STORE_CHECKPOINTS: dict(ttl=DAY, max_bytes=4 << 30),
}
"""JetStream Object Stores: ready sandbox checkpoints (deleted with their sandbox; the TTL
bounds what a dead host leaves)."""


JETSTREAM_READY_S = 30.0
"""How long ``ensure_jetstream`` waits for JetStream to answer (a cluster that is still
electing its meta leader answers "temporarily unavailable")."""


async def ensure_jetstream(js: JetStreamContext, *, replicas: int = 1, update: bool = True) -> None:
    """``declare_jetstream``, retried while JetStream is not ready yet (bounded)."""
    await js_call(
        lambda: declare_jetstream(js, replicas=replicas, update=update),
        what="JetStream is not available",
        timeout=JETSTREAM_READY_S,
    )


JS_TRANSIENT: tuple[type[BaseException], ...] = (
    nats.js.errors.ServiceUnavailableError,
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    TimeoutError,
)
"""JetStream API failures that heal by themselves: no stream leader yet (a server of a
cluster died and its replicas are electing one), or a request lost in that moment."""


async def js_call(
    call: Callable[[], Awaitable[R]], *, what: str, timeout: float = JETSTREAM_READY_S
) -> R:
    """``call()`` retried on transient JetStream failures for at most ``timeout`` seconds;
    then ``BusUnavailable`` naming ``what`` (never a raw nats error)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await call()
        except JS_TRANSIENT as exc:
            if time.monotonic() > deadline:
                raise BusUnavailable(f"{what} (no answer in {timeout:g} s): {exc!r}") from None
            await asyncio.sleep(0.25)  # bounded retry while a stream elects its leader


async def declare_jetstream(
    js: JetStreamContext, *, replicas: int = 1, update: bool = True
) -> None:
    """Declare every stream and KV bucket idempotently, each with ``replicas`` JetStream
    replicas (3 on a three-server cluster). What exists is looked up first (the only
    JetStream API call a service's identity may make on streams it does not own); what is
    missing is created; with ``update`` (the supervisor, whose identity may) a stream whose
    limits or replica count differ is updated to this declaration."""
    for name, params in STREAMS.items():
        config = StreamConfig(
            name=name,
            storage=StorageType.FILE,
            retention=RetentionPolicy.LIMITS,
            num_replicas=replicas,
            **params,
        )
        try:
            info = await js.stream_info(name)
        except nats.js.errors.NotFoundError:
            try:
                await js.add_stream(config)
            except nats.js.errors.BadRequestError:  # created meanwhile by another process
                if update:
                    await js.update_stream(config)
            continue
        if update and not _stream_matches(info.config, config):
            await js.update_stream(config)
    for bucket, params in BUCKETS.items():
        try:
            kv = await js.key_value(bucket)
        except nats.js.errors.BucketNotFoundError:
            await js.create_key_value(KeyValueConfig(bucket=bucket, replicas=replicas, **params))
            continue
        if update:
            info = await js.stream_info(f"KV_{bucket}")
            if (info.config.num_replicas or 1) != replicas:
                await js.update_stream(dataclasses.replace(info.config, num_replicas=replicas))
        del kv
    for bucket, params in OBJECT_STORES.items():
        try:
            await js.object_store(bucket)
        except nats.js.errors.BucketNotFoundError:
            obs = ObjectStoreConfig(
                bucket=bucket, replicas=replicas, storage=StorageType.FILE, **params
            )
            await js.create_object_store(bucket, obs)
            continue
        if update:
            info = await js.stream_info(subjects.object_store_stream(bucket))
            if (info.config.num_replicas or 1) != replicas:
                await js.update_stream(dataclasses.replace(info.config, num_replicas=replicas))


def _stream_matches(have: StreamConfig, want: StreamConfig) -> bool:
    """Whether an existing stream has the limits and replica count of this declaration."""

    def limits(c: StreamConfig) -> tuple[Any, ...]:
        unset = (None, -1, 0)
        return (
            sorted(c.subjects or []),
            round(c.max_age or 0.0, 3),
            -1 if c.max_bytes in unset else c.max_bytes,
            -1 if c.max_msgs in unset else c.max_msgs,
            round(c.duplicate_window or 0.0, 3),
            c.num_replicas or 1,
        )

    return limits(have) == limits(want)
