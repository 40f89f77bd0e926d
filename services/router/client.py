"""Client side of ``router.generate``: send a request, collect the streamed replies."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from common import subjects
from common.codec import decode, encode, raise_error
from common.errors import BusUnavailable, InvalidRequest, Timeout
from schemas.base import ErrorReply
from schemas.serving import GenerateReply, GenerateRequest, GenerateResult, TokenDelta


async def generate(
    nc: NATS,
    req: GenerateRequest,
    *,
    timeout: float = 300.0,
    on_delta: Callable[[TokenDelta], None] | None = None,
) -> GenerateResult:
    """Submit ``req`` to the router and wait for its result. Deltas are checked for gaps and
    overlaps (each token is passed to ``on_delta`` exactly once). Raises typed errors."""
    inbox = nc.new_inbox()
    queue: asyncio.Queue[Msg] = asyncio.Queue()

    async def cb(msg: Msg) -> None:
        queue.put_nowait(msg)

    sub = await nc.subscribe(inbox, cb=cb)
    received = 0
    try:
        await nc.publish(subjects.router_generate(), encode(req), reply=inbox)
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise Timeout("no result in time", request_id=req.request_id, timeout=timeout)
            try:
                msg = await asyncio.wait_for(queue.get(), remaining)
            except TimeoutError:
                continue
            if msg.headers and msg.headers.get("Status") == "503":
                raise BusUnavailable("no router is serving router.generate")
            reply = decode(msg.data, GenerateReply)
            if isinstance(reply, ErrorReply):
                raise_error(reply)
            elif isinstance(reply, TokenDelta):
                if reply.start > received:
                    raise InvalidRequest(
                        "gap in the token stream", expected=received, got=reply.start
                    )
                skip = received - reply.start
                if skip < len(reply.token_ids):
                    fresh = TokenDelta(
                        request_id=reply.request_id,
                        start=received,
                        token_ids=reply.token_ids[skip:],
                        logprobs=reply.logprobs[skip:],
                        weight_version=reply.weight_version,
                    )
                    received += len(fresh.token_ids)
                    if on_delta is not None:
                        on_delta(fresh)
            else:
                assert isinstance(reply, GenerateResult)
                return reply
    finally:
        await sub.unsubscribe()
