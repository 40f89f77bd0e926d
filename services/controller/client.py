"""Typed client of the controller (used by the CLI, the benchmark, the trainer): submit a
rollout, follow it through controller restarts, read its trajectories from TRAJECTORIES. Also
re-exports what others need of the controller: its config (the supervisor) and the injection
grammar (front ends that extend it)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import nats.errors
from nats.aio.client import Client as NATS

from common import subjects
from common.bus import js_call, request
from common.codec import decode
from common.errors import BelayerError, BusUnavailable, Timeout
from schemas.rollout import (
    RolloutAccepted,
    RolloutRequest,
    RolloutResult,
    RolloutStatusRequest,
    Trajectory,
)
from services.controller.config import ControllerConfig as ControllerConfig
from services.controller.fault_specs import KINDS as KINDS
from services.controller.fault_specs import TRIGGERS as TRIGGERS
from services.controller.fault_specs import Trigger as Trigger
from services.controller.fault_specs import parse_inject as parse_inject
from services.controller.policy import parse_policy as parse_policy
from services.controller.reward_service import ask_reward_service as ask_reward_service

#: How often ``wait`` asks for the rollout's status.
POLL_S = 0.25


async def submit(nc: NATS, req: RolloutRequest, *, timeout: float = 120.0) -> RolloutAccepted:
    """Submit ``req``; the reply comes once it is validated (workload, tasks, images) and
    started. Idempotent for the same ``rollout_id`` and request."""
    return await request(nc, subjects.rollout_submit(), req, RolloutAccepted, timeout=timeout)


async def status(nc: NATS, rollout_id: str, *, timeout: float = 10.0) -> RolloutResult:
    return await request(
        nc,
        subjects.rollout_status(),
        RolloutStatusRequest(rollout_id=rollout_id),
        RolloutResult,
        timeout=timeout,
    )


async def wait(
    nc: NATS,
    rollout_id: str,
    *,
    timeout: float = 3600.0,
    on_progress: Callable[[RolloutResult], None] | None = None,
) -> RolloutResult:
    """Until the rollout is done, calling ``on_progress`` with each status. A controller that
    is restarting (no responders, no reply) is waited for; other errors raise."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = await status(
                nc, rollout_id, timeout=min(10.0, max(0.5, deadline - time.monotonic()))
            )
        except (BusUnavailable, Timeout):
            result = None
        if result is not None:
            if on_progress is not None:
                on_progress(result)
            if result.state == "done":
                return result
        if time.monotonic() > deadline:
            raise Timeout("rollout not done before the deadline", rollout_id=rollout_id)
        await asyncio.sleep(POLL_S)  # bounded poll: the controller may restart meanwhile


async def trajectories(nc: NATS, rollout_id: str, *, timeout: float = 10.0) -> list[Trajectory]:
    """Every published trajectory of the rollout (stream TRAJECTORIES), in slot order."""
    js = nc.jetstream()
    subject = subjects.rollout_trajectories(rollout_id)
    deadline = time.monotonic() + timeout
    what = "cannot read TRAJECTORIES"
    try:
        info = await js_call(
            lambda: js.stream_info(subjects.STREAM_TRAJECTORIES, subjects_filter=subject),
            what=what,
            timeout=timeout,
        )
    except nats.errors.Error as exc:
        raise BusUnavailable(f"{what}: {exc!r}") from None
    want = sum((info.state.subjects or {}).values()) if info.state.subjects else 0
    out: list[Trajectory] = []
    if want == 0:
        return out
    try:
        sub = await js_call(
            lambda: js.subscribe(subject, ordered_consumer=True),
            what=what,
            timeout=max(0.0, deadline - time.monotonic()),
        )
    except nats.errors.Error as exc:
        raise BusUnavailable(f"{what}: {exc!r}") from None
    try:
        while len(out) < want:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Timeout("trajectories not read in time", rollout_id=rollout_id)
            try:
                msg = await sub.next_msg(timeout=left)
            except nats.errors.TimeoutError:
                raise Timeout("trajectories not read in time", rollout_id=rollout_id) from None
            try:
                out.append(decode(msg.data, Trajectory))
            except BelayerError:
                want -= 1  # not ours to trust; skip it
    finally:
        await sub.unsubscribe()
    return sorted(out, key=lambda t: (t.slot, t.attempt))
