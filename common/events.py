"""Publishing and reading events (``schemas/events.py``): the one place that turns an event into
its subject ``belayer.events.<kind>`` and persists it in stream ``EVENTS``.

Events inform, they do not command: they record what happened for operators, benchmarks and
tests. A service that reacts to one takes it only as a hint of when to look: the supervisor,
seeing ``handover_complete``, promotes a shadow only after the router's registry and the
``engine_epochs`` bucket confirm it (``services/supervisor/engines.py``), since anyone on the
bus may publish an event.
"""

from __future__ import annotations

from typing import Any

import msgspec
import nats.errors
from nats.js import JetStreamContext

from common import subjects
from common.codec import encode
from common.logging import get_logger
from schemas.events import EventBase

log = get_logger(component="events")

#: Fields every event has; ``fields`` leaves them out.
COMMON_FIELDS = ("ts", "source", "engine_id")


def subject(event: EventBase | type[EventBase]) -> str:
    """``belayer.events.<kind>`` of an event or event type."""
    return subjects.event(event.kind)


async def publish(js: JetStreamContext, event: EventBase, *, msg_id: str | None = None) -> None:
    """Persist ``event`` on its subject (with ``Nats-Msg-Id`` ``msg_id`` for exactly-once
    publishing); never raises: events are best effort, a failure is logged."""
    headers = {"Nats-Msg-Id": msg_id} if msg_id else None
    try:
        await js.publish(subject(event), encode(event), headers=headers, timeout=2.0)
    except (TimeoutError, nats.errors.Error) as exc:
        log.warning("event_publish_failed", kind=event.kind, error=repr(exc))


def fields(event: EventBase) -> dict[str, Any]:
    """The kind-specific fields of ``event`` as plain values (for printing)."""
    return {k: v for k, v in msgspec.structs.asdict(event).items() if k not in COMMON_FIELDS}


def describe(event: EventBase) -> str:
    """One readable line: ``kind source engine key=value …`` (the timestamp left out)."""
    engine = getattr(event, "engine_id", None) or ""
    extra = " ".join(f"{k}={_short(v)}" for k, v in fields(event).items())
    return f"{event.kind:24} {event.source:14} {engine:4} {extra}".rstrip()


def _short(value: Any) -> str:
    if isinstance(value, float):
        return str(round(value, 4))
    if isinstance(value, msgspec.Struct):
        return "{" + " ".join(f"{k}={v}" for k, v in msgspec.structs.asdict(value).items()) + "}"
    if isinstance(value, list):
        more = f", … {len(value)} in all" if len(value) > 8 else ""
        return f"[{', '.join(map(str, value[:8]))}{more}]"
    return str(value)
