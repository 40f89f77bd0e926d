"""``belayer soak``'s workloads beyond generate requests, and the sandbox faults.

- **Rollouts** (``--workload math|swe``): one lane submits rollouts back to back through the
  controller client (``services/controller/client.py``, which rides through controller
  restarts), waits for each, and reads every trajectory it published from TRAJECTORIES: each
  one goes to the history, so the checker can tell a slot published twice or never.
- **A sandbox lane** (``--workload swe``): one sandbox of the environment service, driven the
  way the controller drives one: write the action number into a file, checkpoint it, again; on
  any failure, restore the sandbox's ready checkpoint and read the file back. Every checkpoint
  the service acknowledged and every restore (with the file's content) goes to the history:
  an acknowledged checkpoint must never be lost, and a restored sandbox must hold exactly what
  its checkpoint held.
- **Sandbox faults** on that lane's sandbox: ``sandbox-kill`` (``docker kill`` of its
  container), ``sandbox-pause`` (``docker pause``: it hangs), ``checkpoint-interrupt`` (the
  environment service SIGKILLed while a checkpoint directory is being written).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

from bench import soak_check as sc
from bench.soak_node import SANDBOX_KINDS as SANDBOX_KINDS
from common.errors import BelayerError, BusUnavailable, SandboxError, Timeout
from schemas.rollout import RolloutAccepted, RolloutRequest
from schemas.serving import SamplingParams
from services.controller.client import submit, trajectories, wait
from services.controller.fault_actions import docker_fault
from services.environment.client import EnvClient

ROLLOUT_TIMEOUT_S = 600.0
"""A rollout not done this long after its submission counts as lost."""
SUBMIT_WAIT_S = 60.0
"""How long a rollout is submitted again while no controller answers."""
SUBMIT_TRY_S = 15.0
"""One submission's wait for its reply (the controller validates the tasks first)."""
MID_WRITE_TIMEOUT_S = 30.0
"""How long ``checkpoint-interrupt`` waits for a checkpoint to be in progress."""
TARGET_TIMEOUT_S = 30.0
"""How long ``sandbox-kill`` / ``sandbox-pause`` look for the lane's live container (the lane
between two sandboxes, or its container replaced as the fault lands) before the fault counts
as not injected."""
LIVE_STATES = ("running", "checkpointing")
"""States of a sandbox whose container runs (``services/environment/core.py``)."""
SANDBOX_FILE = "/root/soak-prefix"


def rollout_request(workload: str, rid: str, seed: int) -> RolloutRequest:
    """A small rollout: 2 tasks × 2 samples, short responses (swe: 2 turns)."""
    return RolloutRequest(
        workload=workload, rollout_id=rid, tasks=2, n=2, seed=seed,
        sampling=SamplingParams(temperature=1.0, max_tokens=48),
        max_turns=2, policy="never", deadline_s=300.0,
    )  # fmt: skip


async def submit_through_restarts(nc: Any, req: RolloutRequest) -> RolloutAccepted:
    """``submit``, again while no controller answers or a reply does not come in
    ``SUBMIT_TRY_S`` (one is restarting: a request the killed one took gets no reply), up to
    ``SUBMIT_WAIT_S``: the submission is idempotent for the rollout id (kept in the
    controller's store)."""
    deadline = time.monotonic() + SUBMIT_WAIT_S
    while True:
        try:
            return await submit(nc, req, timeout=SUBMIT_TRY_S)
        except (BusUnavailable, Timeout):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)  # the controller restarting: a bounded retry


async def rollout_lane(
    nc: Any, workload: str, tag: str, seed: int, stop: asyncio.Event, history: Any
) -> int:
    """Rollouts back to back until ``stop``; how many it submitted."""
    i = 0
    while not stop.is_set():
        rid = f"soak-{tag}-r{i}"
        i += 1
        try:
            accepted = await submit_through_restarts(
                nc, rollout_request(workload, rid, seed * 1000 + i)
            )
        except BelayerError as exc:
            history.write(sc.RolloutSubmitted(rid=rid, t=time.time(), workload=workload, slots=0))
            history.write(sc.RolloutEnded(rid=rid, t=time.time(), error=f"submit: {exc}"))
            continue
        history.write(
            sc.RolloutSubmitted(
                rid=rid, t=time.time(), workload=workload, slots=accepted.trajectories
            )
        )
        try:
            result = await wait(nc, rid, timeout=ROLLOUT_TIMEOUT_S)
            records = await trajectories(nc, rid, timeout=30.0)
        except BelayerError as exc:
            history.write(sc.RolloutEnded(rid=rid, t=time.time(), error=f"{exc.code}: {exc}"))
            continue
        for t in records:
            history.write(
                sc.TrajectorySeen(
                    rollout=rid, trajectory_id=t.trajectory_id, slot=t.slot,
                    attempt=t.attempt, t=time.time(),
                )
            )  # fmt: skip
        s = result.summary
        history.write(
            sc.RolloutEnded(
                rid=rid, t=time.time(), completed=s.trajectories_completed,
                slots_failed=s.slots_failed,
            )
        )  # fmt: skip
    return i


class SandboxLane:
    """One sandbox, checkpointed after every "action"; restored after every failure."""

    def __init__(self, nc: Any, run_dir: Path, history: Any) -> None:
        self.env = EnvClient(nc, timeout=30.0)
        self._kicked = asyncio.Event()
        self.checkpoints = run_dir / "env" / "checkpoints"
        self.history = history
        self.sandbox_id = ""
        self.container_id = ""
        self.prefix = 0
        self.last_ok_t = 0.0
        """When the lane last got a checkpoint acknowledged."""
        self.last_back_t = 0.0
        """When the lane last worked again after a failure (restored, or a fresh sandbox)."""
        self.between = True
        """The lane has no sandbox it works in: starting, or restoring after a failure."""

    def kick(self) -> None:
        """The environment service was restarted: a call in flight to the old one gets no
        reply; stop waiting for it (the lane restores, as after any failure)."""
        self._kicked.set()

    async def _call(self, aw: Any) -> Any:
        """``aw``, or ``BusUnavailable`` as soon as the lane is kicked."""
        op = asyncio.ensure_future(aw)
        kicked = asyncio.ensure_future(self._kicked.wait())
        try:
            await asyncio.wait({op, kicked}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            kicked.cancel()
            if not op.done():
                op.cancel()
        if self._kicked.is_set():
            self._kicked.clear()
            if not op.done() or op.cancelled() or op.exception() is not None:
                raise BusUnavailable("the environment service restarted during the call")
        return op.result()

    async def _start(self) -> None:
        created = await self._call(self.env.create(trajectory_id="soak-sandbox-lane"))
        self.sandbox_id, self.container_id = created.sandbox_id, created.container_id
        self.prefix = 0
        self.between = False

    async def _step(self) -> None:
        k = self.prefix + 1
        out = await self._call(
            self.env.exec(self.sandbox_id, f"echo {k} > {SANDBOX_FILE}", timeout_s=20)
        )
        if out.exit_code != 0 or out.timed_out:  # the write did not happen: not a step
            raise SandboxError("the lane's write failed", exit_code=out.exit_code, prefix=k)
        info = await self._call(
            self.env.checkpoint(self.sandbox_id, k, trajectory_id="soak-sandbox-lane")
        )
        self.prefix = k
        self.last_ok_t = time.time()
        self.history.write(
            sc.CheckpointAcked(
                sandbox=self.sandbox_id, prefix=k, checkpoint_id=info.checkpoint_id,
                t=self.last_ok_t,
            )
        )  # fmt: skip

    async def _recover(self, error: str) -> None:
        """Restore the ready checkpoint (or start a fresh sandbox when none is ready yet) and
        read the file back; retried until it works (the service may be restarting)."""
        self.between = True
        while True:
            try:
                if self.prefix == 0:
                    with contextlib.suppress(BelayerError):
                        await self._call(self.env.destroy(self.sandbox_id))
                    await self._start()
                    restored, content = 0, ""
                else:
                    r = await self._call(self.env.restore(self.sandbox_id))
                    self.container_id, restored = r.container_id, r.prefix
                    out = await self._call(
                        self.env.exec(self.sandbox_id, f"cat {SANDBOX_FILE}", timeout_s=20)
                    )
                    content = out.stdout.strip()
                self.last_back_t = time.time()
                self.history.write(
                    sc.SandboxBack(
                        sandbox=self.sandbox_id, prefix=restored, content=content,
                        acked=self.prefix, t=self.last_back_t, error=error[:300],
                    )
                )  # fmt: skip
                self.prefix = max(self.prefix, restored)
                self.between = False
                return
            except BelayerError as exc:
                error = f"{error[:200]}; then {exc.code}: {exc}"[:300]
                await asyncio.sleep(0.2)  # the service restarting: a bounded retry pause

    async def run(self, stop: asyncio.Event) -> int:
        """Steps until ``stop``; the checkpoints acknowledged. The sandbox is destroyed at the end."""
        while True:
            try:
                await self._start()
                break
            except BelayerError:
                if stop.is_set():
                    return 0
                await asyncio.sleep(0.5)  # the service not up yet: a bounded retry pause
        steps = 0
        try:
            while not stop.is_set():
                try:
                    await self._step()
                    steps += 1
                except BelayerError as exc:
                    await self._recover(f"{exc.code}: {exc}")
        finally:
            with contextlib.suppress(BelayerError, asyncio.CancelledError):
                await asyncio.wait_for(self.env.destroy(self.sandbox_id), 30.0)
        return steps

    async def live_container(self) -> str:
        """The container the environment service runs the lane's sandbox in now, as it lists
        it (empty: the lane is between sandboxes, or the sandbox is not running)."""
        if self.between or not self.sandbox_id:
            return ""
        try:
            listing = await self.env.list()
        except BelayerError:
            return ""
        for sb in listing.sandboxes:
            if sb.id == self.sandbox_id and sb.state in LIVE_STATES:
                return sb.container_id
        return ""

    def well_since(self, t: float) -> bool:
        """The lane worked again after ``t`` and a checkpoint was acknowledged since."""
        return self.last_back_t > t and self.last_ok_t > self.last_back_t

    def back_since(self, t: float) -> float | None:
        return self.last_back_t if self.last_back_t > t else None

    def writing(self) -> bool:
        """A checkpoint of the lane's sandbox is being written (its temporary directory)."""
        base = self.checkpoints / self.sandbox_id
        with contextlib.suppress(OSError):
            return any(p.name.startswith(".tmp-") for p in base.iterdir())
        return False


async def sandbox_fault(kind: str, lane: SandboxLane, env_pid: int) -> tuple[str, int, float]:
    """Do ``kind`` to the lane's sandbox; (target, pid, t): the pid SIGKILLed (0 for a
    container), when. ``checkpoint-interrupt`` waits (bounded) for a checkpoint in progress,
    then SIGKILLs the environment service (``env_pid``)."""
    if kind == "checkpoint-interrupt":
        deadline = time.monotonic() + MID_WRITE_TIMEOUT_S
        while True:
            if lane.writing() or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.002)  # bounded poll of the checkpoint directory
        mid = lane.writing()
        t = time.time()
        os.kill(env_pid, signal.SIGKILL)
        return ("environment (mid-write)" if mid else "environment (no write seen)"), env_pid, t
    return await container_fault(kind, lane)


async def container_fault(kind: str, lane: SandboxLane) -> tuple[str, int, float]:
    """``docker kill`` or ``docker pause`` of the container the lane's sandbox runs in at this
    moment: read from the environment service right before the fault; while the lane is
    between sandboxes, or when Docker says the container is not running (replaced as the fault
    landed), read again, up to ``TARGET_TIMEOUT_S`` (then ``SandboxError``: not injected).
    A pause lands whenever it falls, an exec starting included (the environment service
    reports it as the sandbox's failure and removes the wedged container)."""
    deadline = time.monotonic() + TARGET_TIMEOUT_S
    missed = "the lane had no live container"
    while True:
        cid = await lane.live_container()
        if cid:
            t = time.time()
            try:
                await asyncio.to_thread(docker_fault, kind, cid)
                return f"sandbox {lane.sandbox_id} ({cid[:12]})", 0, t
            except SandboxError as exc:  # replaced meanwhile: the next one is the target
                missed = str(exc)
        if time.monotonic() > deadline:
            raise SandboxError(f"{kind}: no live container to fault in {TARGET_TIMEOUT_S:g} s "
                               f"({missed})")  # fmt: skip
        await asyncio.sleep(0.05)  # the lane is between sandboxes: a bounded poll
