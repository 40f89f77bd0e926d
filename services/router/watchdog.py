"""The stall watchdog's decisions, pure. A worker's step batches are core-NATS publishes: one
lost (a server killed, a slow consumer cut off) shows as a gap at the request's next delta and
is resubmitted there — unless it held the request's last tokens. Then no delta ever comes, and
only the worker's own copy of the request says it is done. Each heartbeat the router asks an
engine's worker for the requests that got no token since the previous one (``stalled``) and
acts on each copy (``verdict``)."""

from __future__ import annotations

from typing import Literal

from schemas.serving import HeldRequest
from services.router.state import EngineState, RequestState

Verdict = Literal["wait", "finish", "resubmit"]


def stalled(eng: EngineState, active: dict[str, RequestState]) -> list[str]:
    """The requests assigned to ``eng`` whose tokens held did not change since the previous
    call (each call marks them anew): queued ones, and ones whose last batch was lost."""
    out: list[str] = []
    for rid in sorted(eng.assigned):
        req = active.get(rid)
        if req is None:
            continue
        mark = (eng.id, eng.epoch, len(req.tokens))
        if req.watch_mark == mark:
            out.append(rid)
        req.watch_mark = mark
    return out


def extends(copy: HeldRequest, req: RequestState) -> bool:
    """Does the worker's copy hold every token the router holds, and maybe more?"""
    held = len(req.tokens)
    return len(copy.token_ids) >= held and list(copy.token_ids[:held]) == req.tokens


def verdict(req: RequestState, copy: HeldRequest | None) -> Verdict:
    """``wait``: the worker still runs or queues it (its deltas come). ``finish``: the worker
    finished it and its copy extends the tokens held (the lost last tokens are in it).
    ``resubmit``: the worker has no copy (a lost submit), a different one, or one it dropped
    (finished ``abort``: not the caller's abort, which ends the request at the router)."""
    if copy is not None and not copy.finished:
        return "wait"
    if copy is not None and copy.finish_reason != "abort" and extends(copy, req):
        return "finish"
    return "resubmit"
