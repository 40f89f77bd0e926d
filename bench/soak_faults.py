"""``belayer soak``'s fault schedule: faults on different parts of the node overlap, a part is
never faulted before it is whole again.

Fault *i* is injected no sooner than *i* × duration / faults, in the schedule's order. Each
fault touches *parts* of the node: a worker kind its engine; ``router-kill``, ``kv-kill`` and
``weights-kill`` their service and every engine (a handover needs all three); the sandbox
kinds and ``environment-kill`` the environment (the sandbox lane lives there); any other
service kind its service. A fault waits until no fault still recovering touches one of its
parts and those parts are whole (processes alive, engines up under their main worker with a
warm shadow, the sandbox lane working); then it is injected and its recovery is waited for in
the background while the next faults go on. A worker kind drawn for an engine that is busy
goes to the next free engine: with more engines (``--engines``) more worker faults overlap.

One poller reads the node's state (the supervisor's table, the router's engines) every
``POLL_S`` for every waiter.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from bench import soak_check as sc
from bench import soak_node as sn
from bench import soak_work as sw
from bench.report import progress as report_progress
from bench.soak_cluster import NatsFaults
from common.errors import BelayerError

POLL_S = 0.05
RECOVER_TIMEOUT_S = 60.0
"""A part not whole again this long after a fault did not recover."""
SETTLE_S = 1.0
"""A part is faulted once it has been whole this long (a shadow that dies of an earlier fault
a moment after the node looked whole is seen first)."""
WIDE = ("router-kill", "kv-kill", "weights-kill")
"""Service kinds that touch every engine too."""


def progress(message: str) -> None:
    report_progress("soak", message)


class Viewer:
    """The node's latest state, read every ``POLL_S`` for every waiter."""

    def __init__(self, nc: Any) -> None:
        self.nc = nc
        self.latest: sn.NodeView | None = None
        self.t = 0.0
        self._changed = asyncio.Event()

    async def run(self) -> None:
        while True:
            v = await sn.view(self.nc)
            if v is not None:
                self.latest, self.t = v, time.time()
                changed, self._changed = self._changed, asyncio.Event()
                changed.set()
            await asyncio.sleep(POLL_S)  # the poll's pace, not synchronisation

    async def until(self, pred: Callable[[sn.NodeView], bool], timeout: float) -> float | None:
        """Unix time of the first view where ``pred`` holds; None past ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            v = self.latest
            if v is not None and pred(v):
                return self.t
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(left, 1.0))


def parts_of(kind: str, engine: str, engines: tuple[str, ...]) -> frozenset[str]:
    """The parts of the node a fault touches."""
    if kind in sn.WORKER_KINDS:
        return frozenset({f"engine:{engine}"})
    if kind in sw.SANDBOX_KINDS:
        return frozenset({"environment"})
    if kind in sn.CLUSTER_KINDS:  # every service's bus connection fails over
        return frozenset({"nats", *(f"engine:{e}" for e in engines)})
    service = sn.SERVICE_KINDS[kind]
    if kind in WIDE:
        return frozenset({service, *(f"engine:{e}" for e in engines)})
    return frozenset({service})


class Schedule:
    """Injects the faults of the schedule, overlapping their recoveries."""

    def __init__(
        self,
        target: sn.Target,
        viewer: Viewer,
        lane: sw.SandboxLane | None,
        history: Any,
        nats: NatsFaults | None = None,
    ) -> None:
        self.target = target
        self.viewer = viewer
        self.lane = lane
        self.history = history
        self.nats = nats
        self.busy: set[str] = set()
        self.faults: list[sc.Fault] = []
        self.retired = False

    def whole(
        self, v: sn.NodeView, parts: frozenset[str], gone: int = 0, since: float = 0.0
    ) -> bool:
        """The parts are whole (and ``gone`` dead; the sandbox lane working since ``since``)."""
        t = self.target
        if gone and sn.process_alive(gone):
            return False
        for part in parts:
            if part.startswith("engine:"):
                e = part.removeprefix("engine:")
                up, pid = v.engines.get(e, (False, 0))
                main = v.procs.get(f"worker-{e}", (0, False))[0]
                if not up or pid != main or (gone and pid == gone):
                    return False
                if t.shadows:
                    shadow, alive = v.procs.get(f"shadow-{e}", (0, False))
                    if not alive or shadow == gone or not t.shadow_warm(shadow):
                        return False
                continue
            pid, alive = v.procs.get(part, (0, False))
            if part in t.names and (not alive or not pid or pid == gone):
                return False
            if part == "environment" and self.lane is not None:
                if not self.lane.last_ok_t:  # not one checkpoint acknowledged yet
                    return False
                if since and not self.lane.well_since(since):
                    return False
                if not since and self.lane.last_back_t > self.lane.last_ok_t:
                    return False
        return True

    def free_engine(self, engine: str) -> str | None:
        """``engine`` if no fault touches it, else the next free one; None: all busy."""
        es = self.target.engines
        i = es.index(engine)
        for e in (*es[i:], *es[:i]):
            if f"engine:{e}" not in self.busy:
                return e
        return None

    async def _claim(self, kind: str, engine: str) -> tuple[str, frozenset[str]]:
        """Wait until the fault's parts are free and whole (free, and ``RECOVER_TIMEOUT_S``
        gone by: injected anyway, said so); claim them."""
        deadline = time.monotonic() + RECOVER_TIMEOUT_S
        settled: dict[str, float] = {}  # engine → since when its parts are free and whole
        while True:
            e = self.free_engine(engine) if kind in sn.WORKER_KINDS else engine
            if e is not None:
                parts = parts_of(kind, e, self.target.engines)
                v = self.viewer.latest
                now = time.monotonic()
                if not parts & self.busy and v is not None and self.whole(v, parts):
                    settled.setdefault(e, now)
                else:
                    settled.pop(e, None)
                whole = e in settled and now - settled[e] >= SETTLE_S
                if not parts & self.busy and (whole or now > deadline):
                    if not whole:
                        progress(f"{kind}: not whole {RECOVER_TIMEOUT_S:g} s on; injecting anyway")
                    self.busy |= parts
                    return e, parts
            await asyncio.sleep(POLL_S)  # until a recovery frees the parts

    async def _inject(self, kind: str, engine: str) -> tuple[str, int, float]:
        """Do ``kind``; (target, pid, t)."""
        if kind in sw.SANDBOX_KINDS:
            assert self.lane is not None
            v = await sn.view_within(self.viewer.nc) or self.viewer.latest
            env_pid = v.procs["environment"][0] if v else 0
            return await sw.sandbox_fault(kind, self.lane, env_pid)
        if kind in sn.CLUSTER_KINDS:
            assert self.nats is not None
            return await self.nats.inject()
        inj = await self.target.inject(self.viewer.nc, kind, engine)
        return inj.target, inj.pid, inj.t

    async def _recover(
        self, i: int, n: int, kind: str, target: str, pid: int, t: float, parts: frozenset[str]
    ) -> None:
        """Wait for the fault's part to be back and its parts whole; record it; free them."""
        try:
            if kind in ("sandbox-kill", "sandbox-pause"):
                lane = self.lane
                assert lane is not None
                back = await self.viewer.until(
                    lambda _v: lane.back_since(t) is not None, RECOVER_TIMEOUT_S
                )
                back = lane.back_since(t) if back else None
            elif kind in sn.CLUSTER_KINDS:
                assert self.nats is not None
                back = await self.nats.back(target, RECOVER_TIMEOUT_S)
            else:
                inj = sn.Injected(
                    kind if kind != "checkpoint-interrupt" else "environment-kill",
                    target if kind != "checkpoint-interrupt" else "environment",
                    pid,
                    t,
                )
                back = await self.viewer.until(
                    lambda v: sn.Target.is_back(v, inj), RECOVER_TIMEOUT_S
                )
                if inj.kind == "environment-kill" and self.lane is not None:
                    self.lane.kick()  # its call in flight to the killed service gets no reply
            since = t if "environment" in parts else 0.0
            left = max(0.0, t + RECOVER_TIMEOUT_S - time.time())  # the 60 s count from the fault
            whole = await self.viewer.until(
                lambda v: self.whole(v, parts, gone=pid, since=since), left
            )
            if whole is not None and back is not None:
                whole = max(whole, back)  # the last view may predate the part's return
            fault = sc.Fault(
                kind=kind, t=t, target=target, pid=pid, recovered_t=whole, back_t=back,
                detail="" if whole else f"not whole {RECOVER_TIMEOUT_S:g} s after the fault",
            )  # fmt: skip
            self.history.write(fault)
            self.faults.append(fault)
            v = self.viewer.latest
            if whole is None and v is not None and v.retired:
                self.retired = True
            took = (f"back in {back - t:.2f} s, whole in {whole - t:.2f} s"
                    if back and whole else "NOT recovered")  # fmt: skip
            progress(f"fault {i + 1}/{n}: {kind} {target} (pid {pid}): {took}")
        finally:
            self.busy -= parts

    async def run(self, plan: list[tuple[str, str]], duration_s: float) -> list[sc.Fault]:
        """Every fault of ``plan`` (kind, engine), fault i no sooner than i × duration / n."""
        t0 = time.monotonic()
        interval = duration_s / max(1, len(plan))
        pending: set[asyncio.Task[None]] = set()
        try:
            for i, (kind, engine) in enumerate(plan):
                await asyncio.sleep(max(0.0, t0 + i * interval - time.monotonic()))  # the pacing
                if self.retired:
                    progress("an engine was retired as unhealthy (a node of your own needs "
                             "`belayer up --failure-window 0`): no more faults")  # fmt: skip
                    break
                e, parts = await self._claim(kind, engine)
                try:
                    target, pid, t = await self._inject(kind, e)
                except (BelayerError, KeyError, OSError) as exc:  # reported as not injected
                    self.busy -= parts
                    fault = sc.Fault(kind=kind, t=time.time(), target=e, pid=0, injected=False,
                                     detail=f"could not be injected: {exc!r}")  # fmt: skip
                    self.history.write(fault)
                    self.faults.append(fault)
                    progress(f"fault {i + 1}/{len(plan)}: {kind}: {fault.detail}")
                    continue
                except BaseException:
                    self.busy -= parts
                    raise
                task = asyncio.create_task(self._recover(i, len(plan), kind, target, pid, t, parts))
                pending.add(task)
                task.add_done_callback(pending.discard)
            if pending:
                await asyncio.gather(*pending)
        finally:
            for task in pending:
                task.cancel()
        return self.faults
