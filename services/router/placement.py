"""Where a request goes: the least-loaded up engine with room, or the engine it is pinned to,
by what the workers themselves report holding. Pure; ``RouterCore`` owns the state."""

from __future__ import annotations

from schemas.serving import EngineRequest
from services.router.state import (
    Action,
    EngineState,
    EngineStatus,
    RequestState,
    SubmitToEngine,
)


def target_engine(engines: dict[str, EngineState], req: RequestState) -> EngineState | None:
    """The engine ``req`` goes to now, or None (it waits). A pin to an engine that left or is
    unhealthy is dropped: any healthy engine will do."""
    if req.pinned_engine is not None:
        pinned = engines.get(req.pinned_engine)
        if pinned is not None and pinned.status is EngineStatus.UP:
            return pinned if pinned.has_room else None
        if pinned is None or pinned.status is EngineStatus.UNHEALTHY:
            req.pinned_engine = None
        else:
            return None  # its engine is down: it waits for the engine's next worker
    ups = [e for e in engines.values() if e.status is EngineStatus.UP and e.has_room]
    return min(ups, key=lambda e: (e.load, e.id)) if ups else None


def place(
    engines: dict[str, EngineState],
    pending: list[str],
    reqs: list[RequestState],
    *,
    baseline: bool,
) -> list[Action]:
    """Assign each of ``reqs`` to its target engine (one submit per engine); those with
    nowhere to go join ``pending``."""
    by_engine: dict[str, list[EngineRequest]] = {}
    for req in reqs:
        target = target_engine(engines, req)
        if target is None:
            if req.request_id not in pending:
                pending.append(req.request_id)
            req.engine_id = None
            continue
        req.engine_id = target.id
        if not req.engine_history or req.engine_history[-1] != target.id:
            req.engine_history.append(target.id)
        target.assigned.add(req.request_id)
        target.sent_since_report += 1
        by_engine.setdefault(target.id, []).append(req.engine_request(baseline=baseline))
    return [SubmitToEngine(eid, engines[eid].epoch, ers) for eid, ers in by_engine.items()]
