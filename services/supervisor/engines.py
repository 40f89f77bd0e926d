"""The supervisor's rollout engines: one main worker and (belayer mode) one shadow per engine.

- belayer mode: when the main worker exits or hangs, the shadow normally takes over within a
  second and announces ``handover_complete``; the supervisor then kills any residual old worker,
  promotes the shadow to main and starts a fresh shadow. If the handover fails — the shadow dies
  during it, or it is not confirmed within ``handover_timeout_s`` — the main worker is restarted
  cold (``handover_failed``; the decision is ``policy.handover_decision``), whether it exited or
  still runs hung: the router holds the engine down for good once a failure was reported, so
  nothing else would bring it back.
- baseline mode: no shadow; a dead worker stays dead until the router's remote heartbeat
  takes the engine down (``engine_failed``), then a new worker is started cold (weights read
  from disk).
- an engine marked unhealthy is retired: its processes are stopped and not restarted.

Events only tell the supervisor *when to look* — anyone on the bus can publish one. Before it
acts, it asks the owners of the decision (``router.status``: the router's engine registry; the
``engine_epochs`` bucket) and checks their answer against its own process table: a shadow is
promoted only once the router has it registered as the engine's worker under the epoch the
bucket holds; an engine is retired only if the router lists it unhealthy; a baseline worker is
restarted only if the router has taken down exactly the worker the supervisor runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from common import events
from common.codec import decode
from common.config import RunPaths
from common.epoch import current_epoch
from common.errors import BelayerError
from common.guard import isolated
from common.heartbeat import read_identity
from common.logging import get_logger
from common.tasks import keep
from schemas.events import (
    EngineFailedEvent,
    EngineRetired,
    EngineUnhealthy,
    EventBase,
    HandoverComplete,
    HandoverDetected,
    HandoverFailed,
    ResidualKilled,
    ServiceExited,
    ServiceRestarted,
)
from schemas.serving import EngineFailed, EngineInfo
from services.router.client import report_engine_failed, router_status
from services.supervisor.config import SupervisorConfig
from services.supervisor.policy import (
    HandoverAction,
    HandoverDecision,
    HandoverView,
    cold_restart_confirmed,
    handover_decision,
    promotion_confirmed,
    retirement_confirmed,
)
from services.supervisor.procs import Child


class EngineHost(Protocol):
    """What the engines need of the node supervisor (which is one): its config and run paths,
    its bus, its stop flag, its process table and how to start a child, and event publishing.
    Narrow on purpose: the engines never reach into the supervisor's other state."""

    @property
    def config(self) -> SupervisorConfig: ...

    @property
    def engine_ids(self) -> list[str]: ...

    @property
    def paths(self) -> RunPaths: ...

    @property
    def nc(self) -> NATS | None: ...

    @property
    def stop_requested(self) -> asyncio.Event: ...

    @property
    def children(self) -> dict[str, Child]: ...

    def worker_argv(
        self, engine_id: str, role: str = "main", *, cold: bool = False
    ) -> list[str]: ...

    def child(self, name: str, argv: list[str], stop_timeout: float = 5.0) -> Child: ...

    async def publish(self, event: EventBase) -> None: ...


log = get_logger(service="supervisor", component="engines")

RECHECK_S = 0.5
"""Pause between two looks at an undecided handover once its deadline passed (the router did
not answer)."""


@dataclass
class Slot:
    engine_id: str
    main: Child | None = None
    shadow: Child | None = None
    retired: bool = False
    promoted: asyncio.Event = field(default_factory=asyncio.Event)
    guard: asyncio.Task[None] | None = None
    """Sees a shadow's takeover from a main worker that still runs through (``_guard``)."""


class Engines:
    def __init__(self, host: EngineHost) -> None:
        self.host = host
        self.cfg = host.config
        self.slots = {eid: Slot(eid) for eid in host.engine_ids}
        self.tasks: set[asyncio.Task[None]] = set()

    @property
    def belayer(self) -> bool:
        return self.cfg.recovery == "belayer"

    # --- processes --------------------------------------------------------------------------
    def _spawn_task(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        keep(self.tasks, asyncio.create_task(coro, name=name))

    async def _start(
        self, slot: Slot, role: str, *, cold: bool = False, watch: bool = True
    ) -> Child:
        eid = slot.engine_id
        argv = self.host.worker_argv(eid, role, cold=cold)
        child = self.host.child(f"{'worker' if role == 'main' else 'shadow'}-{eid}", argv)
        if role == "main":
            slot.main = child
        else:
            slot.shadow = child
        await child.start()
        if watch:
            self._spawn_task(self.watch(child), f"watch_{child.name}")
        return child

    async def start_all(self) -> None:
        for slot in self.slots.values():
            await self._start(slot, "main", watch=False)
        if self.belayer:
            for slot in self.slots.values():
                await self._start(slot, "shadow", watch=False)

    def watch_all(self) -> None:
        for slot in self.slots.values():
            for child in (slot.main, slot.shadow):
                if child is not None:
                    self._spawn_task(self.watch(child), f"watch_{child.name}")

    def _slot_of(self, child: Child) -> Slot | None:
        for slot in self.slots.values():
            if child is slot.main or child is slot.shadow:
                return slot
        return None

    async def watch(self, child: Child) -> None:
        while True:
            assert child.proc is not None
            code = await child.proc.wait()
            slot = self._slot_of(child)
            if self.host.stop_requested.is_set() or child.stopping or slot is None or slot.retired:
                return
            ran = time.monotonic() - child.started_at
            await self.host.publish(
                ServiceExited(name=child.name, code=code, pid=child.pid, ran_s=round(ran, 3))
            )
            if child is slot.shadow:
                delay = child.backoff.next_delay(ran)
                await asyncio.sleep(delay)  # backoff before restarting a crashing shadow
                if (
                    slot.shadow is child
                    and not slot.retired
                    and not self.host.stop_requested.is_set()
                ):
                    child.started_at = time.monotonic()  # a failed start: a crash at once
                    with isolated(log, "watch", name=child.name):  # retried after backoff
                        await child.start()
                        await self.host.publish(ServiceRestarted(name=child.name, pid=child.pid))
                    continue
                return
            # the main worker exited
            if not self.belayer:
                return  # baseline: the router's remote heartbeat notices; engine_failed restarts it
            await self._report_failure(slot, child)
            shadow = slot.shadow
            if shadow is not None and shadow.alive:
                shadow_pid = shadow.pid
                decision = await self._see_handover(slot, child)
                if decision.action is not HandoverAction.COLD_RESTART:
                    return  # the shadow took over (this child is retired) or the engine retired
                if decision.reason == "deadline":
                    self._kill_shadow(slot, shadow_pid)
            # No handover (in time): restart the main worker cold, with backoff.
            await asyncio.sleep(child.backoff.next_delay(ran))
            if slot.main is not child or slot.retired or self.host.stop_requested.is_set():
                return
            self._forget_heartbeat(slot)
            child.started_at = time.monotonic()  # a failed start: a crash at once (backoff grows)
            with isolated(log, "watch", name=child.name):
                await child.start()
                await self.host.publish(
                    ServiceRestarted(name=child.name, pid=child.pid, mode="cold")
                )

    async def _report_failure(self, slot: Slot, child: Child) -> None:
        """Tell the router (idempotent per epoch) — the epoch comes from the dead worker's
        heartbeat identity, so a report never hits a newer worker."""
        found = read_identity(self.host.paths.heartbeat_file(slot.engine_id))
        if found is None or found[0].pid != child.pid or self.host.nc is None:
            return
        ident = found[0]
        failed = EngineFailed(
            engine_id=slot.engine_id,
            epoch=ident.epoch,
            pid=ident.pid,
            reason="exited",
            detected_at=time.time(),
        )
        await report_engine_failed(self.host.nc, failed, timeout=1.0)

    # --- failed handovers --------------------------------------------------------------------
    def _guard_if_running(self, slot: Slot, old_pid: int) -> None:
        """A shadow began taking over from ``old_pid``: if that is the main worker this
        supervisor runs and it still runs (hung or stalled — an exited one is its watcher's
        to restart), see the takeover through (``_guard``), once per engine at a time."""
        main = slot.main
        if main is None or main.pid != old_pid or not main.alive or slot.shadow is None:
            return
        if slot.guard is not None and not slot.guard.done():
            return
        guard = asyncio.create_task(self._guard(slot, main), name=f"guard_{slot.engine_id}")
        slot.guard = keep(self.tasks, guard)

    async def _guard(self, slot: Slot, failed: Child) -> None:
        """The takeover from a still-running main worker failed: kill it (and a shadow stuck
        in the takeover, which its watcher starts again) and start the main worker cold."""
        with isolated(log, "guard", engine=slot.engine_id):
            shadow_pid = slot.shadow.pid if slot.shadow is not None else None
            decision = await self._see_handover(slot, failed, running=True)
            if decision.action is not HandoverAction.COLD_RESTART:
                return
            if slot.main is not failed or slot.retired or self.host.stop_requested.is_set():
                return
            if decision.reason == "deadline":
                self._kill_shadow(slot, shadow_pid)
            await self._cold_restart(slot, from_disk=False)

    def _kill_shadow(self, slot: Slot, pid: int | None) -> None:
        """SIGKILL the shadow ``pid`` stuck in a takeover (if it still is the engine's
        shadow); not ``stopping``: its watcher starts a fresh one."""
        shadow = slot.shadow
        if shadow is not None and shadow.proc is not None and shadow.pid == pid and shadow.alive:
            with contextlib.suppress(ProcessLookupError):
                shadow.proc.kill()

    async def _see_handover(
        self, slot: Slot, failed: Child, *, running: bool = False
    ) -> HandoverDecision:
        """Follow the shadow's takeover from ``failed`` until it is confirmed or has failed
        (``policy.handover_decision``); a failure is logged and published
        (``handover_failed``) — the caller then restarts the main worker cold. ``running``:
        ``failed`` still ran when the takeover began; should it exit meanwhile, its watcher
        follows the takeover from there (this returns ``done``)."""
        t0 = time.monotonic()
        deadline = t0 + self.cfg.handover_timeout_s
        promoted, shadow = slot.promoted, slot.shadow
        proc = shadow.proc if shadow is not None and shadow.alive else None
        shadow_pid = proc.pid if proc is not None else None
        failed_proc, failed_pid = failed.proc, failed.pid

        def failed_alive() -> bool:
            return failed_proc is not None and failed_proc.returncode is None

        def shadow_alive() -> bool:
            return proc is not None and proc.returncode is None

        while True:
            remaining = deadline - time.monotonic()
            if remaining > 0 and shadow_alive() and not promoted.is_set():
                assert proc is not None and failed_proc is not None
                waiters = [
                    asyncio.ensure_future(promoted.wait()),
                    asyncio.ensure_future(proc.wait()),
                ]
                if running:
                    waiters.append(asyncio.ensure_future(failed_proc.wait()))
                await asyncio.wait(waiters, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
                for w in waiters:
                    w.cancel()
            if slot.retired or self.host.stop_requested.is_set():
                return HandoverDecision(HandoverAction.DONE, "engine retired or node stopping")
            if running and not failed_alive():
                return HandoverDecision(HandoverAction.DONE, "exited: its watcher follows")
            info = None if promoted.is_set() else await self._router_view(slot.engine_id)
            main = slot.main
            decision = handover_decision(
                HandoverView(
                    promoted=promoted.is_set(),
                    deadline_passed=time.monotonic() >= deadline,
                    failed_pid=failed_pid,
                    main_pid=main.pid if main is not None else None,
                    main_alive=failed_alive(),
                    shadow_pid=shadow_pid,
                    shadow_alive=shadow_alive(),
                    router_state=info.state if info is not None else None,
                    router_pid=info.worker_pid if info is not None else None,
                )
            )
            if decision.action is HandoverAction.PROMOTE:
                await self._promote_if_confirmed(slot)  # in case its event was missed
                return decision
            if decision.action is HandoverAction.COLD_RESTART:
                waited = round(time.monotonic() - t0, 3)
                log.warning(
                    "handover_failed_cold_restart",
                    engine=slot.engine_id,
                    reason=decision.reason,
                    shadow_pid=shadow_pid,
                    old_pid=failed_pid,
                    waited_s=waited,
                )
                await self.host.publish(
                    HandoverFailed(
                        engine_id=slot.engine_id,
                        reason=decision.reason,
                        shadow_pid=shadow_pid,
                        old_pid=failed_pid,
                        waited_s=waited,
                    )
                )
                return decision
            if decision.action is HandoverAction.DONE:
                return decision
            if deadline - time.monotonic() <= 0 or not shadow_alive():
                await asyncio.sleep(RECHECK_S)  # bounded re-check: the router did not answer

    def _forget_heartbeat(self, slot: Slot) -> None:
        """Before a cold restart: the old worker's heartbeat file goes, so a shadow started
        meanwhile waits for the new worker instead of taking over from the dead one."""
        with contextlib.suppress(OSError):
            self.host.paths.heartbeat_file(slot.engine_id).unlink(missing_ok=True)

    # --- events -----------------------------------------------------------------------------
    async def subscribe(self) -> None:
        nc = self.host.nc
        assert nc is not None
        for typ in (HandoverDetected, HandoverComplete, EngineFailedEvent, EngineUnhealthy):
            await nc.subscribe(events.subject(typ), cb=self._on_event)

    async def _on_event(self, msg: Msg) -> None:
        """A hint to look: what the event claims is checked with the router and the epoch
        bucket before anything is done."""
        try:
            ev = decode(
                msg.data, HandoverDetected | HandoverComplete | EngineFailedEvent | EngineUnhealthy
            )
        except BelayerError:
            return
        slot = self.slots.get(ev.engine_id)
        if slot is None or slot.retired or self.host.stop_requested.is_set():
            return
        if isinstance(ev, HandoverDetected) and self.belayer:
            self._guard_if_running(slot, ev.old_pid)
        elif isinstance(ev, HandoverComplete):
            await self._promote_if_confirmed(slot)
        elif isinstance(ev, EngineFailedEvent) and not self.belayer:
            await self._cold_restart_if_confirmed(slot)
        elif isinstance(ev, EngineUnhealthy):
            await self._retire_if_confirmed(slot)

    async def _router_view(self, engine_id: str) -> EngineInfo | None:
        """The router's registry entry for the engine (None if the router cannot say)."""
        nc = self.host.nc
        if nc is None:
            return None
        try:
            st = await router_status(nc, timeout=2.0)
        except BelayerError as exc:
            log.warning("router_status_failed", engine=engine_id, error=str(exc))
            return None
        return next((e for e in st.engines if e.id == engine_id), None)

    def _not_confirmed(self, slot: Slot, action: str, info: EngineInfo | None, **kw: Any) -> None:
        log.warning(
            "event_not_confirmed",
            engine=slot.engine_id,
            action=action,
            router_state=info.state if info else None,
            router_pid=info.worker_pid if info else None,
            **kw,
        )

    async def _promote_if_confirmed(self, slot: Slot) -> None:
        """Promote the shadow only if the router has it as the engine's worker, under the
        epoch the ``engine_epochs`` bucket holds."""
        shadow = slot.shadow
        if slot.retired or self.host.stop_requested.is_set() or self.host.nc is None:
            return
        if shadow is None or shadow.pid is None or not shadow.alive:
            return
        info = await self._router_view(slot.engine_id)
        try:
            claimed, _ = await current_epoch(self.host.nc.jetstream(), slot.engine_id)
        except (nats.errors.Error, TimeoutError) as exc:  # JetStream unavailable: not now
            log.warning("epoch_read_failed", engine=slot.engine_id, error=repr(exc))
            claimed = -1
        confirmed = promotion_confirmed(
            shadow_pid=shadow.pid,
            shadow_alive=shadow.alive,
            router_state=info.state if info else None,
            router_pid=info.worker_pid if info else None,
            router_epoch=info.epoch if info else None,
            claimed_epoch=claimed,
        )
        if not confirmed or slot.shadow is not shadow or slot.retired:  # or it changed meanwhile
            self._not_confirmed(slot, "promote", info, shadow_pid=shadow.pid, claimed=claimed)
            return
        await self._promote(slot, shadow.pid)

    async def _retire_if_confirmed(self, slot: Slot) -> None:
        info = await self._router_view(slot.engine_id)
        if not retirement_confirmed(info.state if info else None):
            self._not_confirmed(slot, "retire", info)
            return
        await self._retire(slot, "repeated failure")

    async def _cold_restart_if_confirmed(self, slot: Slot) -> None:
        """Baseline: restart only the worker the router took down, and only if it is the
        one this supervisor runs."""
        info = await self._router_view(slot.engine_id)
        main = slot.main
        if not cold_restart_confirmed(
            main_pid=main.pid if main else None,
            router_state=info.state if info else None,
            router_pid=info.worker_pid if info else None,
        ):
            self._not_confirmed(slot, "cold_restart", info, main_pid=main.pid if main else None)
            return
        await self._cold_restart(slot)

    async def _promote(self, slot: Slot, pid: int) -> None:
        shadow, old = slot.shadow, slot.main
        if shadow is None or shadow.pid != pid:
            log.warning("handover_from_unknown_process", engine=slot.engine_id, pid=pid)
            return
        if old is not None:
            if old.alive:  # residual old worker (hung): the control plane kills it
                await old.stop(timeout=0.0)
                await self.host.publish(ResidualKilled(engine_id=slot.engine_id, pid=old.pid))
            old.stopping = True
        shadow.name = f"worker-{slot.engine_id}"
        slot.main, slot.shadow = shadow, None
        self.host.children.pop(f"shadow-{slot.engine_id}", None)
        self.host.children[shadow.name] = shadow
        slot.promoted.set()
        slot.promoted = asyncio.Event()
        await self._start(slot, "shadow")
        log.info("shadow_promoted", engine=slot.engine_id, pid=pid)

    async def _cold_restart(self, slot: Slot, *, from_disk: bool = True) -> None:
        """A new main worker (weights from the model directory with ``from_disk``, the
        baseline's restart; else from the weight store, at its current version)."""
        old = slot.main
        if old is not None:
            old.stopping = True
            if old.alive:
                await old.stop(timeout=0.0)  # a hung worker is killed before its replacement starts
        self._forget_heartbeat(slot)
        new = await self._start(slot, "main", cold=from_disk)
        await self.host.publish(ServiceRestarted(name=new.name, pid=new.pid, mode="cold"))

    async def _retire(self, slot: Slot, reason: str) -> None:
        slot.retired = True
        for child in (slot.main, slot.shadow):
            if child is not None:
                await child.stop(timeout=2.0)
        await self.host.publish(EngineRetired(engine_id=slot.engine_id, reason=reason))
        log.warning("engine_retired", engine=slot.engine_id, reason=reason)
