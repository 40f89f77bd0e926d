"""What a node looks like from its bus: its status (engines, router, processes) and its event
history. ``belayer.AsyncNode.status`` / ``AsyncNode.history`` and the CLI's ``belayer status`` /
``belayer events`` are both these functions."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec

from common import subjects
from common.auth import redact
from common.bus import js_call
from common.codec import decode
from common.errors import BelayerError, BusUnavailable, Timeout
from common.heartbeat import process_alive
from common.node import NodeInfo
from schemas.events import AnyEvent, EventBase
from schemas.node import SupervisorStatus
from schemas.serving import RouterStatus
from services.router.client import router_status
from services.supervisor.client import supervisor_status


async def node_status(nc: Any, *, url: str, node: NodeInfo | None) -> dict[str, Any]:
    """The node's status as ``belayer status --json`` prints it: ``nats_url`` (credentials
    redacted), ``run_id``, ``recovery``, ``state`` (``ready``, or ``degraded`` while the router
    restarts: engines as last known, never an error), ``ready`` (the supervisor's), ``router``,
    ``engines`` (id, epoch, worker pid, health …), ``inflight``, ``finished``,
    ``token_log_chunk``, ``metrics`` and ``procs`` (name, pid, alive, restarts). ``node`` is the
    node file when the node runs on this host (its pids can then be checked here)."""
    try:
        rs: RouterStatus | None = await router_status(nc, timeout=3)
    except (BusUnavailable, Timeout):
        rs = None
    try:
        ss: SupervisorStatus | None = await supervisor_status(nc, timeout=2)
    except BelayerError:
        ss = None
    procs: list[dict[str, Any]] = [msgspec.to_builtins(p) for p in ss.procs] if ss else []
    router_proc = next((p for p in procs if p["name"] == "router"), None)
    if rs is not None:
        engines = [msgspec.to_builtins(e) for e in rs.engines]
        mark_dead_workers(engines, procs if ss else None, local=node is not None)
    else:
        # Last known: epochs from the engine_epochs bucket, pids from the supervisor.
        pids = {p["name"]: p["pid"] for p in procs}
        engines = [
            {"id": eid, "epoch": ep, "worker_pid": pids.get(f"worker-{eid}"), "healthy": None}
            for eid, ep in sorted((await engine_epochs(nc)).items())
        ]
    return {
        "nats_url": redact(url),
        "run_id": node.run_id if node else (ss.run_id if ss else None),
        "recovery": node.recovery if node else None,
        "state": "ready" if rs is not None else "degraded",
        "ready": bool(ss and ss.ready),
        "router": {
            "alive": rs is not None,
            "restarts": router_proc["restarts"] if router_proc else 0,
        },
        "engines": engines,
        "inflight": rs.inflight if rs else None,
        "finished": rs.finished if rs else None,
        "token_log_chunk": rs.token_log_chunk if rs else None,
        "metrics": rs.metrics if rs else {},
        "procs": procs,
    }


def mark_dead_workers(
    engines: list[dict[str, Any]], procs: list[dict[str, Any]] | None, *, local: bool
) -> None:
    """Never show a dead pid as healthy: an engine whose worker pid is not a live process of
    the node (the supervisor's table; without it, this host's, for a local node) is shown
    down, whatever the router last heard."""
    if procs is not None:
        live = {p["pid"] for p in procs if p["alive"]}
        gone = [e for e in engines if e["worker_pid"] not in live]
    elif local:
        gone = [e for e in engines if not process_alive(e["worker_pid"])]
    else:
        return
    for e in gone:
        if e["healthy"]:
            e["healthy"], e["state"] = False, "down"


async def engine_epochs(nc: Any) -> dict[str, int]:
    """Every engine's epoch from the ``engine_epochs`` KV bucket ({} if unreadable)."""
    try:
        kv = await nc.jetstream().key_value(subjects.BUCKET_ENGINE_EPOCHS)
        keys = await kv.keys()
    except Exception:  # no bucket yet, or JetStream unavailable: nothing is known
        return {}
    out: dict[str, int] = {}
    for key in keys:
        with contextlib.suppress(Exception):
            entry = await kv.get(key)
            out[key] = int(entry.value or b"0")
    return out


@dataclass(frozen=True)
class UnknownEvent:
    """An event of the stream this version cannot decode (an older or newer type)."""

    subject: str
    error: str


async def event_history(
    nc: Any, *, kind: str = "", follow: bool = True, duration: float = 0.0
) -> AsyncIterator[EventBase | UnknownEvent]:
    """The node's events from the start of the ``EVENTS`` stream (``kind``: only that kind),
    in order; with ``follow``, then the new ones as they come, for ``duration`` seconds (0:
    until the caller stops); without, it ends at the last one stored."""
    js = nc.jetstream()
    subject = subjects.event(kind) if kind else subjects.EVENTS_ALL
    what = "cannot read EVENTS"
    sub = await js_call(lambda: js.subscribe(subject, ordered_consumer=True), what=what)
    info = await js_call(lambda: js.stream_info(subjects.STREAM_EVENTS), what=what)
    pending = info.state.messages
    seen = 0
    deadline = time.monotonic() + duration if duration else None
    try:
        while follow or seen < pending:
            wait = 1.0 if deadline is None else max(0.0, deadline - time.monotonic())
            if deadline is not None and wait == 0.0:
                return
            try:
                msg = await sub.next_msg(timeout=min(wait, 1.0) if follow else 1.0)
            except TimeoutError:  # nats' TimeoutError subclasses the builtin one
                if not follow:
                    return
                continue
            seen += 1
            try:
                yield decode(msg.data, AnyEvent)
            except BelayerError as exc:
                yield UnknownEvent(msg.subject, str(exc))
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
