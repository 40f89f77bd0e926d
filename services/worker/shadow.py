"""Shadow worker: a fully prepared standby for one engine that takes over when the main
worker dies or hangs.

Ahead of time it does everything slow (imports, mapping weights and KV arena, building and
warming the engine), then idles, checking the main worker's pid (pidfd) and heartbeat mtime
every ``watch_interval_s``. On failure it runs the five-step handover, publishing an event with
timestamps at each step:

1. detect      — the pid exited, or the heartbeat is older than ``hang_threshold_s``; the router
                 is told at once so it stops using the engine (``handover_detected``);
2. health      — a tiny forward pass; the weight store and KV arena answer on the bus in time;
                 a residual old worker (hung, not dead) is SIGKILLed so it can never touch the
                 arena again (``handover_health_ok``);
3. flush       — epoch+1 is claimed by compare-and-set (against the watched worker's epoch),
                 then the KV arena is zeroed under exactly that epoch: the arena takes a flush
                 only for the epoch claimed in ``engine_epochs``, once (``handover_flushed``);
4. ready       — the engine loop starts and the engine's subjects are served under the new
                 epoch (``handover_ready``);
5. register    — the router checks the claim and pings this worker, then registers it,
                 resuming every interrupted request at token level (``handover_complete``).

From then on this process *is* the engine's main worker; the supervisor starts a fresh shadow.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from common import events
from common.epoch import current_epoch
from common.errors import Conflict
from common.heartbeat import Identity, PidWatch, Verdict, assess, read_identity
from common.logging import get_logger
from schemas.events import (
    EventBase,
    HandoverComplete,
    HandoverDetected,
    HandoverFlushed,
    HandoverHealthOk,
    HandoverReady,
    ShadowReady,
)
from schemas.serving import EngineFailed
from services.kv.client import fetch_arena
from services.router.client import report_engine_failed
from services.weights.client import fetch_manifest
from services.worker.config import WorkerConfig
from services.worker.service import Worker, WorkerProcess


@dataclass
class Detection:
    identity: Identity
    verdict: Verdict
    detected_at: float
    """Unix time."""
    heartbeat_age_s: float


async def watch_main(config: WorkerConfig, stop: asyncio.Event) -> Detection | None:
    """Wait until the main worker is dead or hung (None if ``stop`` is set first).

    Death is seen the instant it happens: the main worker's pidfd is registered with the event
    loop. The heartbeat file (hangs) is read every ``watch_interval_s``; nothing else runs, so
    an idle shadow costs next to no CPU."""
    loop = asyncio.get_running_loop()
    hb = Path(config.heartbeat_file)
    pid_watch: PidWatch | None = None
    died = asyncio.Event()

    def unwatch() -> None:
        if pid_watch is not None:
            if pid_watch.fd is not None:
                loop.remove_reader(pid_watch.fd)
            pid_watch.close()

    try:
        while not stop.is_set():
            found = read_identity(hb)
            if found is not None:
                ident, mtime = found
                if pid_watch is None or pid_watch.pid != ident.pid:
                    unwatch()
                    died = asyncio.Event()
                    pid_watch = PidWatch(ident.pid)
                    if pid_watch.fd is None:
                        died.set()
                    else:
                        loop.add_reader(pid_watch.fd, died.set)
                now = time.time()
                verdict = assess(
                    pid_alive=not died.is_set() and pid_watch.alive(),
                    age_s=now - mtime,
                    stale_after_s=config.hang_threshold_s,
                )
                if verdict in (Verdict.DEAD, Verdict.HUNG):
                    return Detection(ident, verdict, now, now - mtime)
            waiters = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(died.wait())]
            await asyncio.wait(
                waiters, timeout=config.watch_interval_s, return_when=asyncio.FIRST_COMPLETED
            )
            for w in waiters:
                w.cancel()
        return None
    finally:
        unwatch()


def kill_residual(pid: int, timeout: float = 2.0) -> bool:
    """SIGKILL a residual (hung) old worker and wait until it is gone. True if one was killed."""
    watch = PidWatch(pid)
    try:
        if not watch.alive():
            return False
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout
        while watch.alive() and time.monotonic() < deadline:
            time.sleep(0.002)  # a SIGKILLed process is gone within milliseconds
        return True
    finally:
        watch.close()


class Shadow:
    def __init__(self, config: WorkerConfig, worker: Worker) -> None:
        self.config = config
        self.worker = worker
        self.engine_id = config.engine_id
        self.source = f"shadow:{config.engine_id}"
        self.log = get_logger(engine=config.engine_id, pid=os.getpid(), role="shadow")

    async def event(self, event: EventBase) -> None:
        await events.publish(self.worker.js, event)

    async def handover(self, d: Detection) -> int:
        """Steps 1-5. Returns the new epoch; raises ``Conflict`` if another worker won."""
        old = d.identity
        epoch_now, _ = await current_epoch(self.worker.js, self.engine_id)
        if epoch_now != old.epoch:
            raise Conflict("engine already moved on", epoch=epoch_now, watched=old.epoch)
        t = {"t_detect": d.detected_at}
        await self._detected(d)
        t["t_health"] = await self._health(old.pid)
        # 3. claim epoch+1 (compare-and-set against the watched one), then flush the arena
        # under exactly that epoch.
        epoch = await self.worker.claim(
            expected_epoch=old.epoch, flush_timeout=self.config.bus_check_timeout_s * 4
        )
        t["t_flush"] = time.time()
        await self.event(
            HandoverFlushed(source=self.source, engine_id=self.engine_id, t_flush=t["t_flush"])
        )
        # 4 + 5. serve under the new epoch and register.
        await self.worker.serve_engine(on_ready=self._on_ready)
        t["t_ready"] = self._t_ready
        t["t_registered"] = time.time()
        await self._complete(old, epoch, t)
        return epoch

    async def _detected(self, d: Detection) -> None:
        """1. detect: tell the router right away so nothing more is placed on the dead
        worker; announce it."""
        old = d.identity
        failed = EngineFailed(
            engine_id=self.engine_id,
            epoch=old.epoch,
            pid=old.pid,
            reason="exited" if d.verdict is Verdict.DEAD else "hung",
            detected_at=d.detected_at,
        )
        await report_engine_failed(self.worker.nc, failed, timeout=self.config.bus_check_timeout_s)
        await self.event(
            HandoverDetected(
                source=self.source,
                engine_id=self.engine_id,
                old_pid=old.pid,
                old_epoch=old.epoch,
                verdict=d.verdict.value,
                heartbeat_age_s=round(d.heartbeat_age_s, 4),
                t_detect=d.detected_at,
            )
        )

    async def _health(self, old_pid: int) -> float:
        """2. health check: our own engine, then the two memory owners on the bus; a residual
        old worker is killed so it never writes the arena again. Returns when it passed."""
        nc, timeout = self.worker.nc, self.config.bus_check_timeout_s
        forward_s = self.worker.health_check()
        host, wait = self.config.host, self.config.owner_restart_wait_s
        await fetch_manifest(nc, timeout=timeout, host=host, restart_wait_s=wait)
        await fetch_arena(nc, self.engine_id, timeout=timeout, host=host, restart_wait_s=wait)
        killed = kill_residual(old_pid)
        t_health = time.time()
        await self.event(
            HandoverHealthOk(
                source=self.source,
                engine_id=self.engine_id,
                forward_s=round(forward_s, 4),
                residual_killed=killed,
                t_health=t_health,
            )
        )
        return t_health

    async def _complete(self, old: Identity, epoch: int, t: dict[str, float]) -> None:
        """The ready and complete events, with every step's time."""
        src, eid = self.source, self.engine_id
        await self.event(
            HandoverReady(source=src, engine_id=eid, epoch=epoch, t_ready=t["t_ready"])
        )
        await self.event(
            HandoverComplete(
                source=src,
                engine_id=eid,
                epoch=epoch,
                pid=self.worker.pid,
                old_pid=old.pid,
                old_epoch=old.epoch,
                detect_to_registered_s=round(t["t_registered"] - t["t_detect"], 4),
                t_detect=t["t_detect"],
                t_health=t["t_health"],
                t_flush=t["t_flush"],
                t_ready=t["t_ready"],
                t_registered=t["t_registered"],
            )
        )
        self.log.info(
            "handover_complete",
            epoch=epoch,
            old_pid=old.pid,
            seconds=round(t["t_registered"] - t["t_detect"], 4),
        )

    _t_ready = 0.0

    def _on_ready(self) -> None:
        self._t_ready = time.time()


class ShadowService(WorkerProcess):
    """Prepare a worker without claiming the engine, watch the main worker (``watch_loop``),
    take over when it fails, then serve as the engine's main worker until stopped. A stop
    during a handover lets the handover finish first."""

    def __init__(self, config: WorkerConfig) -> None:
        config = dataclasses.replace(config, role="shadow")
        super().__init__(config, name=f"shadow:{config.engine_id}")
        self.shadow: Shadow | None = None
        self.handing_over = asyncio.Lock()

    async def setup(self) -> None:
        config = self.config
        self.worker = worker = Worker(config, self.nc, self.js, self.server)
        self.shadow = shadow = Shadow(config, worker)
        await worker.prepare()
        await worker.watch_weights()  # stay on the newest version while waiting
        await shadow.event(
            ShadowReady(
                source=shadow.source,
                engine_id=config.engine_id,
                pid=worker.pid,
                attach_s=worker.timings.get("attach_s", 0.0),
                build_warm_s=worker.timings.get("build_warm_s", 0.0),
            )
        )

    async def watch_loop(self) -> None:
        """Watch the main worker until it fails, then hand over (once; this process then is
        the engine's main worker)."""
        assert self.shadow is not None
        while True:
            detection = await watch_main(self.config, self.stop_requested)
            if detection is None:
                return
            async with self.handing_over:
                try:
                    await self.shadow.handover(detection)
                    return
                except Conflict as exc:
                    # Another worker already took the engine (e.g. a cold restart won the
                    # race): stay a shadow and watch the new main worker.
                    self.shadow.log.info("handover_skipped", reason=str(exc))
            await asyncio.sleep(self.config.watch_interval_s)

    async def drain(self) -> None:
        async with self.handing_over:  # a handover under way completes first
            await super().drain()
