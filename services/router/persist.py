"""The router's ordered writer: accepted requests and token-log chunks to JetStream (with
deterministic message ids, so a retried write is stored once), events, and what callers get —
token deltas and results, which must not overtake the chunks before them. One FIFO queue, one
writer: a delta or a result goes out only after every chunk queued before it is durable."""

from __future__ import annotations

from typing import Any

import nats.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from common import events, subjects
from common.codec import encode
from schemas.serving import AcceptedRequest
from services.router.state import EmitEvent, PersistChunk, SendToCaller

Persistable = PersistChunk | EmitEvent | SendToCaller | AcceptedRequest
"""What the router's persist queue carries."""

WRITE_TIMEOUT_S = 5.0
"""Longest wait for JetStream to acknowledge one write."""


async def persist(nc: NATS, js: JetStreamContext, item: Persistable, log: Any) -> None:
    """Write one queued item. A failed write is logged, not raised (the loop goes on)."""
    if isinstance(item, AcceptedRequest):
        try:
            await js.publish(
                subjects.request_log(item.request_id),
                encode(item),
                headers={"Nats-Msg-Id": item.request_id},
                timeout=WRITE_TIMEOUT_S,
            )
        except (TimeoutError, nats.errors.Error) as exc:
            log.warning("request_log_publish_failed", request=item.request_id, error=repr(exc))
    elif isinstance(item, SendToCaller):
        try:
            await nc.publish(item.inbox, encode(item.message))
        except nats.errors.Error as exc:
            log.warning("caller_publish_failed", error=repr(exc))
    elif isinstance(item, PersistChunk):
        c = item.chunk
        try:
            await js.publish(
                subjects.token_log(c.request_id),
                encode(c),
                headers={"Nats-Msg-Id": f"{c.request_id}:{c.chunk_index}"},
                timeout=WRITE_TIMEOUT_S,
            )
        except (TimeoutError, nats.errors.Error) as exc:
            log.error("token_log_publish_failed", request=c.request_id, error=repr(exc))
    else:
        await events.publish(js, item.event)
