"""Is an engine's worker alive, and is it the one the router thinks it is? One ping on
``engine.<id>.ping``, waiting for the reply of a given worker (pid and epoch).

A registration is only believed once the registering process answers its engine's ping with
its own pid and epoch, and the router's remote heartbeat asks the registered worker the same
way. Every process subscribed to the subject answers (for a moment an old worker and its
successor both may), so the replies are read until the expected worker's arrives.
"""

from __future__ import annotations

import time

from nats.aio.client import Client as NATS

from common import subjects
from common.codec import decode, encode
from common.errors import BelayerError
from schemas.base import ErrorReply
from schemas.serving import Ping, PingReply


async def ping_engine(
    nc: NATS,
    engine_id: str,
    *,
    timeout: float,
    pid: int | None = None,
    epoch: int | None = None,
) -> PingReply | None:
    """The ping reply of ``engine_id``'s worker with this ``pid`` and ``epoch`` (either one
    ``None``: any), or ``None`` when no such worker answers within ``timeout`` (no responders,
    silence, or only other processes answering)."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    try:
        await nc.publish(subjects.engine_ping(engine_id), encode(Ping()), reply=inbox)
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                msg = await sub.next_msg(timeout=left)
            except TimeoutError:  # nats raises a subclass of the builtin one
                return None
            if msg.headers and msg.headers.get("Status") == "503":
                return None  # nobody serves the engine
            try:
                reply = decode(msg.data, PingReply | ErrorReply)
            except BelayerError:
                continue
            if not isinstance(reply, PingReply) or reply.engine_id != engine_id:
                continue
            if (pid is None or reply.pid == pid) and (epoch is None or reply.epoch == epoch):
                return reply
        return None
    finally:
        await sub.unsubscribe()
