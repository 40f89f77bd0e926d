"""Publishing and reading events (``schemas/events.py``): the one place that turns an event into
its subject ``belayer.events.<kind>`` and persists it in stream ``EVENTS``.

Events inform, they do not command: they record what happened for operators, benchmarks and
tests. A service that reacts to one takes it only as a hint of when to look: the supervisor,
seeing ``handover_complete``, promotes a shadow only after the router's registry and the
``engine_epochs`` bucket confirm it (``services/supervisor/engines.py``), since anyone on the
bus may publish an event.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec
import nats.errors
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy

from common import subjects
from common.codec import decode, encode
from common.errors import BelayerError, Timeout
from common.logging import get_logger
from schemas.events import AnyEvent, EventBase

E = TypeVar("E", bound=EventBase)

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


class EventTail:
    """The node's events in arrival order, kept (a JetStream ordered consumer of stream
    ``EVENTS``: from its first event, or only those published from now on); ``wait_for``
    blocks, bounded, until a matching one is there. The RL loop, the benchmarks and the tests
    follow a node with it."""

    def __init__(self, nc: Any) -> None:
        self.nc = nc
        self.events: list[EventBase] = []
        self._changed = asyncio.Condition()
        self._sub: Any = None

    async def start(self, *, new_only: bool = False) -> EventTail:
        """Subscribe: every event the stream holds (default), or only new ones."""

        async def cb(msg: Any) -> None:
            try:
                ev: EventBase = decode(msg.data, AnyEvent)
            except BelayerError:
                return  # not ours to trust, or a newer kind
            async with self._changed:
                self.events.append(ev)
                self._changed.notify_all()

        policy = DeliverPolicy.NEW if new_only else DeliverPolicy.ALL
        self._sub = await self.nc.jetstream().subscribe(
            subjects.EVENTS_ALL, ordered_consumer=True, cb=cb, deliver_policy=policy
        )
        return self

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()

    def matching(
        self, typ: type[E], engine_id: str | None = None, *, after: float = 0.0, **fields: object
    ) -> list[E]:
        """Events of type ``typ`` (for ``engine_id``, stamped after ``after``, with these
        field values), in arrival order."""
        accepts = _matcher(typ, engine_id, after, fields)
        return [e for e in self.events if isinstance(e, typ) and accepts(e)]

    async def wait_for(
        self,
        typ: type[E],
        engine_id: str | None = None,
        *,
        after: float = 0.0,
        timeout: float = 30.0,
        **fields: object,
    ) -> E:
        """The first event ``matching`` finds, waiting up to ``timeout`` for it."""

        what = f"{typ.kind} event" + (f" for {engine_id}" if engine_id else "")
        found = await self.wait_until(
            _matcher(typ, engine_id, after, fields), timeout, f"{what} {fields or ''}".rstrip()
        )
        assert isinstance(found, typ)
        return found

    async def wait_until(
        self, match: Callable[[EventBase], bool], timeout: float, what: str
    ) -> EventBase:
        """The first event ``match`` accepts (from the start of the tail), waiting up to
        ``timeout``; past it a ``Timeout`` that lists the last events seen."""

        async def first() -> EventBase:
            async with self._changed:
                while True:
                    for e in self.events:
                        if match(e):
                            return e
                    await self._changed.wait()

        try:
            return await asyncio.wait_for(first(), timeout)
        except TimeoutError:
            seen = "\n  ".join(describe(e) for e in self.events[-20:])
            raise Timeout(
                f"no {what} within {timeout:g} s; last events:\n  {seen}", timeout=timeout
            ) from None


def _matcher(
    typ: type[EventBase], engine_id: str | None, after: float, fields: dict[str, object]
) -> Callable[[EventBase], bool]:
    def accepts(e: EventBase) -> bool:
        return (
            isinstance(e, typ)
            and (engine_id is None or getattr(e, "engine_id", None) == engine_id)
            and e.ts > after
            and all(getattr(e, k) == v for k, v in fields.items())
        )

    return accepts
