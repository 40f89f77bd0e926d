"""``belayer soak``'s fault schedule: faults on different parts of the node overlap, a part is
never faulted before it is whole again.

Fault *i* is due *i* × duration / faults into the run; up to ``LOOKAHEAD`` due faults wait at
once, and the first of them (in the schedule's order) that can be injected is — a later one
passes an earlier one only on parts the earlier one cannot use, so none is starved. Each
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
from dataclasses import dataclass, field
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


LOOKAHEAD = 4
"""Due faults that wait at once: a later one goes first when an earlier one waits for parts
it does not need (an engine re-warming its shadow holds no controller kill back)."""


@dataclass
class Waiting:
    """A due fault of the schedule, not injected yet."""

    i: int
    kind: str
    engine: str
    deadline: float
    """Monotonic time past which it is injected even if its parts are not whole."""
    settled: dict[str, float] = field(default_factory=dict)
    """Engine → since when the fault's parts (on that engine) are free and whole."""


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

    def _try_claim(self, w: Waiting, reserved: frozenset[str]) -> tuple[str, frozenset[str]] | None:
        """Claim the fault's parts if they are free, not reserved by an earlier waiting fault,
        and whole for ``SETTLE_S`` (or ``RECOVER_TIMEOUT_S`` went by since it was due: injected
        anyway, said so); None: not yet."""
        e = self.free_engine(w.engine) if w.kind in sn.WORKER_KINDS else w.engine
        if e is None:
            return None
        parts = parts_of(w.kind, e, self.target.engines)
        if parts & (self.busy | reserved):
            w.settled.pop(e, None)
            return None
        v = self.viewer.latest
        now = time.monotonic()
        if v is not None and self.whole(v, parts):
            w.settled.setdefault(e, now)
        else:
            w.settled.pop(e, None)
        whole = e in w.settled and now - w.settled[e] >= SETTLE_S
        if not whole and now <= w.deadline:
            return None
        if not whole:
            progress(f"{w.kind}: not whole {RECOVER_TIMEOUT_S:g} s on; injecting anyway")
        self.busy |= parts
        return e, parts

    def _next_claim(self, waiting: list[Waiting]) -> tuple[Waiting, str, frozenset[str]] | None:
        """The first waiting fault (in the schedule's order) that can be injected now. A later
        one passes an earlier one only on parts the earlier one cannot use (``reserved``), so
        a fault waiting for its engines is never starved by the faults behind it."""
        reserved: frozenset[str] = frozenset()
        for w in waiting:
            got = self._try_claim(w, reserved)
            if got is not None:
                return w, *got
            reserved |= self.reserves(w)
        return None

    def reserves(self, w: Waiting) -> frozenset[str]:
        """The parts a waiting fault may take: a worker kind any engine, the others theirs."""
        if w.kind in sn.WORKER_KINDS:
            return frozenset(f"engine:{e}" for e in self.target.engines)
        return parts_of(w.kind, w.engine, self.target.engines)

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
        """Every fault of ``plan`` (kind, engine), fault i no sooner than i × duration / n; up to
        ``LOOKAHEAD`` due faults wait at once, and the first of them that can be injected is."""
        t0 = time.monotonic()
        interval = duration_s / max(1, len(plan))
        pending: set[asyncio.Task[None]] = set()
        waiting: list[Waiting] = []
        due = 0  # the next fault of the plan not yet waiting
        try:
            while due < len(plan) or waiting:
                now = time.monotonic()
                while due < len(plan) and len(waiting) < LOOKAHEAD and t0 + due * interval <= now:
                    kind, engine = plan[due]
                    waiting.append(Waiting(due, kind, engine, now + RECOVER_TIMEOUT_S))
                    due += 1
                if self.retired:
                    progress("an engine was retired as unhealthy (a node of your own needs "
                             "`belayer up --failure-window 0`): no more faults")  # fmt: skip
                    break
                got = self._next_claim(waiting)
                if got is None:
                    await asyncio.sleep(POLL_S)  # the pacing, or until a recovery frees parts
                    continue
                w, e, parts = got
                waiting.remove(w)
                task = await self._start(w, e, parts, len(plan))
                if task is not None:
                    pending.add(task)
                    task.add_done_callback(pending.discard)
            if pending:
                await asyncio.gather(*pending)
        finally:
            for task in pending:
                task.cancel()
        return self.faults

    async def _start(
        self, w: Waiting, e: str, parts: frozenset[str], n: int
    ) -> asyncio.Task[None] | None:
        """Inject ``w`` on its claimed parts; the task that waits for its recovery (None: it
        could not be injected, recorded as such)."""
        try:
            target, pid, t = await self._inject(w.kind, e)
        except (BelayerError, KeyError, OSError) as exc:  # reported as not injected
            self.busy -= parts
            fault = sc.Fault(kind=w.kind, t=time.time(), target=e, pid=0, injected=False,
                             detail=f"could not be injected: {exc!r}")  # fmt: skip
            self.history.write(fault)
            self.faults.append(fault)
            progress(f"fault {w.i + 1}/{n}: {w.kind}: {fault.detail}")
            return None
        except BaseException:
            self.busy -= parts
            raise
        return asyncio.create_task(self._recover(w.i, n, w.kind, target, pid, t, parts))
