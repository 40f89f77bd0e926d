"""Lifecycle and recovery events (``belayer.events.<kind>``, persisted in stream EVENTS)."""

from __future__ import annotations

from typing import Any

from schemas.base import Message


class Event(Message, tag="Event.v1"):
    """One event. ``kind`` equals the last subject token (``handover_detected``, …)."""

    kind: str
    ts: float
    """Unix time (seconds) when it happened."""
    source: str
    """Service that published it (``router``, ``shadow:e0``, ``supervisor``…)."""
    engine_id: str | None = None
    request_id: str | None = None
    data: dict[str, Any] = {}
    """Kind-specific fields (timestamps of handover steps, pids, epochs, counts…)."""
