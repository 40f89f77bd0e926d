"""The supervisor's rollout engines: one main worker and (belayer mode) one shadow per engine.

- belayer mode: when the main worker exits, the shadow normally takes over within a second and
  announces ``handover_complete``; the supervisor then kills any residual old worker, promotes
  the shadow to main and starts a fresh shadow. If no handover comes in time, the main worker is
  restarted cold.
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
from typing import TYPE_CHECKING, Any

import nats.errors
from nats.aio.msg import Msg

from common import events, subjects
from common.bus import request
from common.codec import decode
from common.epoch import current_epoch
from common.errors import BelayerError
from common.guard import isolated
from common.heartbeat import read_identity
from common.logging import get_logger
from schemas.base import Ok
from schemas.events import (
    EngineFailedEvent,
    EngineRetired,
    EngineUnhealthy,
    HandoverComplete,
    ResidualKilled,
    ServiceExited,
    ServiceRestarted,
)
from schemas.serving import EngineFailed, EngineInfo, RouterStatus, StatusRequest
from services.supervisor.procs import Child

if TYPE_CHECKING:
    from services.supervisor.service import Supervisor

log = get_logger(service="supervisor", component="engines")


@dataclass
class Slot:
    engine_id: str
    main: Child | None = None
    shadow: Child | None = None
    retired: bool = False
    promoted: asyncio.Event = field(default_factory=asyncio.Event)


class Engines:
    def __init__(self, sup: Supervisor) -> None:
        self.sup = sup
        self.cfg = sup.config
        self.slots = {eid: Slot(eid) for eid in sup.engine_ids}
        self.tasks: set[asyncio.Task[None]] = set()

    @property
    def belayer(self) -> bool:
        return self.cfg.recovery == "belayer"

    # --- processes --------------------------------------------------------------------------
    def _spawn_task(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _start(
        self, slot: Slot, role: str, *, cold: bool = False, watch: bool = True
    ) -> Child:
        eid = slot.engine_id
        argv = self.sup.worker_argv(eid, role, cold=cold)
        child = self.sup._child(f"{'worker' if role == 'main' else 'shadow'}-{eid}", argv)
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
            if self.sup.stop_requested.is_set() or child.stopping or slot is None or slot.retired:
                return
            ran = time.monotonic() - child.started_at
            await self.sup.publish(
                ServiceExited(name=child.name, code=code, pid=child.pid, ran_s=round(ran, 3))
            )
            if child is slot.shadow:
                delay = child.backoff.next_delay(ran)
                await asyncio.sleep(delay)  # backoff before restarting a crashing shadow
                if (
                    slot.shadow is child
                    and not slot.retired
                    and not self.sup.stop_requested.is_set()
                ):
                    child.started_at = time.monotonic()  # a failed start: a crash at once
                    with isolated(log, "watch", name=child.name):  # retried after backoff
                        await child.start()
                        await self.sup.publish(ServiceRestarted(name=child.name, pid=child.pid))
                    continue
                return
            # the main worker exited
            if not self.belayer:
                return  # baseline: the router's remote heartbeat notices; engine_failed restarts it
            await self._report_failure(slot, child)
            shadow = slot.shadow
            if shadow is not None and shadow.alive:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(slot.promoted.wait(), self.cfg.handover_timeout_s)
                if slot.main is child and not slot.retired:
                    await self._promote_if_confirmed(slot)  # in case its event was missed
                if slot.main is not child or slot.retired:
                    return  # the shadow took over (this child is retired) or the engine retired
            # No handover in time: restart the main worker cold, with backoff.
            await asyncio.sleep(child.backoff.next_delay(ran))
            if slot.main is not child or slot.retired or self.sup.stop_requested.is_set():
                return
            child.started_at = time.monotonic()  # a failed start: a crash at once (backoff grows)
            with isolated(log, "watch", name=child.name):
                await child.start()
                await self.sup.publish(
                    ServiceRestarted(name=child.name, pid=child.pid, mode="cold")
                )

    async def _report_failure(self, slot: Slot, child: Child) -> None:
        """Tell the router (idempotent per epoch) — the epoch comes from the dead worker's
        heartbeat identity, so a report never hits a newer worker."""
        found = read_identity(self.sup.paths.heartbeat_file(slot.engine_id))
        if found is None or found[0].pid != child.pid or self.sup.nc is None:
            return
        ident = found[0]
        with contextlib.suppress(BelayerError):
            await request(
                self.sup.nc,
                subjects.router_engine_failed(),
                EngineFailed(
                    engine_id=slot.engine_id,
                    epoch=ident.epoch,
                    pid=ident.pid,
                    reason="exited",
                    detected_at=time.time(),
                ),
                Ok,
                timeout=1.0,
            )

    # --- events -----------------------------------------------------------------------------
    async def subscribe(self) -> None:
        nc = self.sup.nc
        assert nc is not None
        for typ in (HandoverComplete, EngineFailedEvent, EngineUnhealthy):
            await nc.subscribe(events.subject(typ), cb=self._on_event)

    async def _on_event(self, msg: Msg) -> None:
        """A hint to look: what the event claims is checked with the router and the epoch
        bucket before anything is done."""
        try:
            ev = decode(msg.data, HandoverComplete | EngineFailedEvent | EngineUnhealthy)
        except BelayerError:
            return
        slot = self.slots.get(ev.engine_id)
        if slot is None or slot.retired or self.sup.stop_requested.is_set():
            return
        if isinstance(ev, HandoverComplete):
            await self._promote_if_confirmed(slot)
        elif isinstance(ev, EngineFailedEvent) and not self.belayer:
            await self._cold_restart_if_confirmed(slot)
        elif isinstance(ev, EngineUnhealthy):
            await self._retire_if_confirmed(slot)

    async def _router_view(self, engine_id: str) -> EngineInfo | None:
        """The router's registry entry for the engine (None if the router cannot say)."""
        nc = self.sup.nc
        if nc is None:
            return None
        try:
            st: RouterStatus = await request(
                nc, subjects.router_status(), StatusRequest(), RouterStatus, timeout=2.0
            )
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
        if slot.retired or self.sup.stop_requested.is_set() or self.sup.nc is None:
            return
        if shadow is None or shadow.pid is None or not shadow.alive:
            return
        info = await self._router_view(slot.engine_id)
        try:
            claimed, _ = await current_epoch(self.sup.nc.jetstream(), slot.engine_id)
        except (nats.errors.Error, TimeoutError) as exc:  # JetStream unavailable: not now
            log.warning("epoch_read_failed", engine=slot.engine_id, error=repr(exc))
            claimed = -1
        if (
            info is None
            or info.worker_pid != shadow.pid
            or info.epoch != claimed
            or info.state != "up"
            or slot.shadow is not shadow
            or slot.retired
        ):
            self._not_confirmed(slot, "promote", info, shadow_pid=shadow.pid, claimed=claimed)
            return
        await self._promote(slot, shadow.pid)

    async def _retire_if_confirmed(self, slot: Slot) -> None:
        info = await self._router_view(slot.engine_id)
        if info is None or info.state != "unhealthy":
            self._not_confirmed(slot, "retire", info)
            return
        await self._retire(slot, "repeated failure")

    async def _cold_restart_if_confirmed(self, slot: Slot) -> None:
        """Baseline: restart only the worker the router took down, and only if it is the
        one this supervisor runs."""
        info = await self._router_view(slot.engine_id)
        main = slot.main
        if info is None or info.state != "down" or main is None or info.worker_pid != main.pid:
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
                await self.sup.publish(ResidualKilled(engine_id=slot.engine_id, pid=old.pid))
            old.stopping = True
        shadow.name = f"worker-{slot.engine_id}"
        slot.main, slot.shadow = shadow, None
        self.sup.children.pop(f"shadow-{slot.engine_id}", None)
        self.sup.children[shadow.name] = shadow
        slot.promoted.set()
        slot.promoted = asyncio.Event()
        await self._start(slot, "shadow")
        log.info("shadow_promoted", engine=slot.engine_id, pid=pid)

    async def _cold_restart(self, slot: Slot) -> None:
        old = slot.main
        if old is not None:
            old.stopping = True
            if old.alive:
                await old.stop(timeout=0.0)  # a hung worker is killed before its replacement starts
        new = await self._start(slot, "main", cold=True)
        await self.sup.publish(ServiceRestarted(name=new.name, pid=new.pid, mode="cold"))

    async def _retire(self, slot: Slot, reason: str) -> None:
        slot.retired = True
        for child in (slot.main, slot.shadow):
            if child is not None:
                await child.stop(timeout=2.0)
        await self.sup.publish(EngineRetired(engine_id=slot.engine_id, reason=reason))
        log.warning("engine_retired", engine=slot.engine_id, reason=reason)
