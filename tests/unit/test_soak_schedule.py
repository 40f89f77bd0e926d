"""The soak's schedule picks the first due fault it can inject: a later fault passes one that
waits for its engines only on parts that one cannot use."""

from __future__ import annotations

import time

import pytest

from bench import soak_faults as sf
from bench import soak_node as sn


class _Viewer:
    def __init__(self, view: sn.NodeView) -> None:
        self.latest = view
        self.nc = None


def _schedule(monkeypatch: pytest.MonkeyPatch, busy: set[str]) -> sf.Schedule:
    monkeypatch.setattr(sf, "SETTLE_S", 0.0)  # whole once is whole enough here
    names = frozenset({"router", "kv", "controller", "worker-e0", "worker-e1"})
    procs = {n: (100 + i, True) for i, n in enumerate(sorted(names))}
    engines = {e: (True, procs[f"worker-{e}"][0]) for e in ("e0", "e1")}  # up, main worker
    view = sn.NodeView(procs=procs, engines=engines)
    target = sn.Target(names=names, engines=("e0", "e1"), shadows=False, events=None)
    s = sf.Schedule(target, _Viewer(view), None, history=None)  # type: ignore[arg-type]  # the poller's view only
    s.busy = set(busy)
    return s


def _waiting(*faults: tuple[str, str]) -> list[sf.Waiting]:
    far = time.monotonic() + 60
    return [sf.Waiting(i, kind, engine, far) for i, (kind, engine) in enumerate(faults)]


def test_a_service_fault_passes_one_waiting_for_a_busy_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    s = _schedule(monkeypatch, {"engine:e0"})
    w = _waiting(("router-kill", "e0"), ("controller-kill", "e0"))
    got = s._next_claim(w)
    assert got is not None and got[0] is w[1] and got[2] == frozenset({"controller"})
    assert "controller" in s.busy


def test_a_later_engine_fault_does_not_starve_a_waiting_wide_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    s = _schedule(monkeypatch, {"engine:e0"})
    # e1 is free and whole, but the router kill before it needs e1 too: it waits its turn
    assert s._next_claim(_waiting(("router-kill", "e0"), ("worker-kill", "e1"))) is None
    assert s.busy == {"engine:e0"}
    # in the schedule's order, the worker kill takes the free engine
    got = s._next_claim(_waiting(("worker-kill", "e0"), ("router-kill", "e0")))
    assert got is not None and got[1] == "e1"


def test_the_first_fault_goes_first_when_it_can(monkeypatch: pytest.MonkeyPatch) -> None:
    s = _schedule(monkeypatch, set())
    w = _waiting(("kv-kill", "e0"), ("controller-kill", "e0"))
    got = s._next_claim(w)
    assert got is not None and got[0] is w[0]
    assert got[2] == frozenset({"kv", "engine:e0", "engine:e1"})
