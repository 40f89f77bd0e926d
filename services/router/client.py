"""Client side of the router: ``generate`` (send a request, collect the streamed replies, and
ride through a router restart), ``router_status`` (its engine registry and counters) and
``report_engine_failed`` (a shadow's or a supervisor's word that an engine's worker is gone).

The router never generates a request id twice: resubmitting the same request re-attaches to it
(a catch-up delta of every token so far, then the live ones) or replays its finished result.
So when the router goes away — no responders, a stream that stops, a gap — this client simply
resubmits the same request (bounded backoff) until the caller's deadline, placing deltas by
their index: every token reaches ``on_delta`` exactly once, in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from common import subjects
from common.bus import request
from common.codec import decode, encode, raise_error
from common.errors import BelayerError, BusUnavailable, Overloaded, Timeout
from common.logging import get_logger
from schemas.base import ErrorReply, Ok
from schemas.serving import (
    EngineFailed,
    GenerateReply,
    GenerateRequest,
    GenerateResult,
    RouterStatus,
    StatusRequest,
    TokenDelta,
)
from services.router.config import RouterConfig as RouterConfig  # the supervisor's, re-exported

log = get_logger(component="router-client")

#: How long a stream may stay silent before the client re-attaches (a router that died mid-
#: stream sends nothing more; a re-attach to a live router costs one catch-up delta).
SILENCE_S = 5.0
#: How long the router may take to say whether it still works on a silent request.
PROBE_S = 1.0
#: Backoff between re-attach attempts: first delay, cap.
BACKOFF_S = (0.1, 1.0)
#: Error codes that mean "the path to the router broke" or "not now" (a flood being shed),
#: not "the request is refused": the request is resubmitted after a backoff.
_TRANSPORT_CODES = frozenset({BusUnavailable.code, Timeout.code, Overloaded.code})


class _Reattach(Exception):
    """This attempt's stream is gone (no responders, silence, a gap): resubmit."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


@dataclass
class _Stream:
    """What the caller has received so far, across attempts."""

    on_delta: Callable[[TokenDelta], None] | None
    received: int = 0
    routers: list[str] = field(default_factory=list)
    """Distinct router incarnations seen, in order."""
    probed: str = ""
    """The router incarnation a silence probe found working on the request (``_still_working``)."""
    outages: int = 0
    """Attempts that found no router at all."""
    finished_seen: bool = False
    """A silence probe found the request finished (its result may still be on its way)."""

    def saw(self, router_id: str) -> None:
        if router_id and router_id not in self.routers:
            self.routers.append(router_id)

    def place(self, d: TokenDelta) -> None:
        """Hand on the part of ``d`` the caller does not hold yet (placement by index)."""
        self.saw(d.router_id)
        if d.start > self.received:
            raise _Reattach("gap in the token stream")
        skip = self.received - d.start
        if skip >= len(d.token_ids):
            return
        fresh = msgspec.structs.replace(
            d,
            start=self.received,
            token_ids=d.token_ids[skip:],
            logprobs=d.logprobs[skip:],
        )
        self.received += len(fresh.token_ids)
        if self.on_delta is not None:
            self.on_delta(fresh)

    def finish(self, result: GenerateResult) -> GenerateResult:
        """The result, with the tokens the caller has not been handed yet (if streaming) and
        the router restarts it rode through."""
        self.saw(result.router_id)
        if self.on_delta is not None and self.received < len(result.token_ids):
            # A replayed result carries no deltas: hand on the rest from it, by index.
            self.place(
                TokenDelta(
                    request_id=result.request_id,
                    start=self.received,
                    token_ids=result.token_ids[self.received :],
                    logprobs=result.logprobs[self.received :],
                    weight_version=result.weight_version,
                    router_id=result.router_id,
                )
            )
        restarts = max(len(self.routers) - 1, self.outages, result.router_restarts)
        return msgspec.structs.replace(result, router_restarts=restarts)


async def generate(
    nc: NATS,
    req: GenerateRequest,
    *,
    timeout: float = 300.0,
    on_delta: Callable[[TokenDelta], None] | None = None,
    silence_s: float = SILENCE_S,
) -> GenerateResult:
    """Submit ``req`` to the router and wait for its result, within ``timeout`` seconds overall.

    Each token is passed to ``on_delta`` exactly once, in order. No responders, a dropped or
    silent stream (``silence_s``) and a gap are retryable: the same request id is resubmitted
    with bounded backoff and the client re-attaches to the running or finished request. The
    result's ``router_restarts`` counts the router restarts ridden through. Raises the typed
    error the router answers with, or, once the deadline passes, ``Timeout`` (retryable)
    naming the request id.
    """
    deadline = time.monotonic() + timeout
    stream = _Stream(on_delta)
    delay, cap = BACKOFF_S
    why = ""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise Timeout(
                "no result before the deadline",
                request_id=req.request_id,
                timeout=timeout,
                last_problem=why or "none",
            )
        try:
            return await _attempt(nc, req, stream, min(remaining, silence_s), deadline)
        except _Reattach as exc:
            why = exc.why
            if why == "no responders":
                stream.outages += 1
            log.info(
                "router_reattach", request_id=req.request_id, why=why, received=stream.received
            )
        await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, cap)


async def _attempt(
    nc: NATS, req: GenerateRequest, stream: _Stream, silence_s: float, deadline: float
) -> GenerateResult:
    """One submission: read replies until the result, or raise ``_Reattach``."""
    inbox = nc.new_inbox()
    queue: asyncio.Queue[Msg] = asyncio.Queue()

    async def cb(msg: Msg) -> None:
        queue.put_nowait(msg)

    sub = await nc.subscribe(inbox, cb=cb)
    try:
        await nc.publish(subjects.router_generate(), encode(req), reply=inbox)
        while True:
            wait = min(silence_s, deadline - time.monotonic())
            if wait <= 0:
                raise _Reattach("deadline")
            try:
                msg = await asyncio.wait_for(queue.get(), wait)
            except TimeoutError:
                if await _still_working(nc, req.request_id, stream):
                    continue  # a long request, quiet until its result: keep waiting
                raise _Reattach("silent stream") from None
            if msg.headers and msg.headers.get("Status") == "503":
                raise _Reattach("no responders")
            reply = decode(msg.data, GenerateReply)
            if isinstance(reply, ErrorReply):
                if reply.code in _TRANSPORT_CODES:
                    raise _Reattach(f"router answered {reply.code}")
                raise_error(reply)
            elif isinstance(reply, TokenDelta):
                stream.place(reply)
            else:
                assert isinstance(reply, GenerateResult)
                return stream.finish(reply)
    finally:
        try:
            await sub.unsubscribe()
        except Exception:  # the connection may be reconnecting; the inbox is abandoned anyway
            pass


async def router_status(nc: NATS, *, timeout: float = 5.0, request_id: str = "") -> RouterStatus:
    """The router's view: every engine (state, epoch, worker pid, queue) and its counters, and
    with ``request_id`` what it knows of that request (``request``). ``BusUnavailable`` when no
    router answers, ``Timeout`` when it does not in time."""
    return await request(
        nc,
        subjects.router_status(),
        StatusRequest(request_id=request_id),
        RouterStatus,
        timeout=timeout,
    )


async def report_engine_failed(nc: NATS, failed: EngineFailed, *, timeout: float) -> None:
    """Tell the router that ``failed.engine_id``'s main worker at ``failed.epoch`` died or hung,
    so nothing more is placed on it (a report about an already replaced worker is ignored).
    Best effort: a report the router did not take within ``timeout`` (none answers, or it
    refuses) is dropped."""
    with contextlib.suppress(BelayerError):
        await request(nc, subjects.router_engine_failed(), failed, Ok, timeout=timeout)


async def _still_working(nc: NATS, request_id: str, stream: _Stream) -> bool:
    """After ``silence_s`` with nothing on the inbox: is the router that holds the request
    alive and still working on it? A non-streamed request sends nothing until its result, so
    silence alone does not mean the router went away. True only if a router answers within
    ``PROBE_S``, holds the request as active, and is the incarnation the stream came from (a
    restarted router may not know this inbox: re-attach to it). A request the router holds as
    finished gets one more silence: the router marks it finished before its result, queued
    behind the last token-log write, reaches the inbox. Anything else — no responders, no
    answer, finished a second time (the result went to an inbox gone quiet), unknown —
    re-attaches."""
    try:
        st = await router_status(nc, timeout=PROBE_S, request_id=request_id)
    except (BusUnavailable, Timeout):
        return False
    if st.request == "finished" and not stream.finished_seen:
        stream.finished_seen = True
        return True
    if st.request != "active":
        return False
    if not st.router_id:
        return False  # an older router cannot say which incarnation it is
    if stream.probed and st.router_id != stream.probed:
        return False
    stream.probed = st.router_id
    return not stream.routers or st.router_id in stream.routers
