"""The fields every event carries, and the per-publisher event bases (``schemas/events.py``
has the catalogue of event types)."""

from __future__ import annotations

import time
from typing import ClassVar

import msgspec

from schemas.base import Message
from schemas.serving import EngineId


# --- common fields ---------------------------------------------------------------------------
class EventBase(Message, kw_only=True):
    """Fields every event carries."""

    kind: ClassVar[str]
    """Last token of the subject (``handover_complete``): a class constant, not sent."""

    ts: float = msgspec.field(default_factory=time.time)
    """Unix time (seconds) when the event was built, just before it was published."""
    source: str
    """Who published it: ``router``, ``supervisor``, ``weights``, ``kv``, ``controller``,
    ``environment:<node>``, ``worker:<engine_id>`` (a main worker) or ``shadow:<engine_id>``."""


class EngineEvent(EventBase, kw_only=True):
    """An event about one engine."""

    engine_id: EngineId
    """Engine the event is about (``e0``, …)."""


class RouterEvent(EngineEvent, kw_only=True):
    """Published by the router."""

    source: str = "router"


class SupervisorEvent(EventBase, kw_only=True):
    """Published by the supervisor."""

    source: str = "supervisor"


class WeightStoreEvent(EventBase, kw_only=True):
    """Published by the weight store."""

    source: str = "weights"


class KvArenaEvent(EngineEvent, kw_only=True):
    """Published by the KV arena."""

    source: str = "kv"
