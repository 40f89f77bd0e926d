"""A rollout's counts from its attempts (pure)."""

from __future__ import annotations

from collections.abc import Iterable

from schemas.rollout import RecoveryLog, RolloutState, RolloutSummary, Timings, TrajectoryRow
from services.controller.policy import PolicyStats


def summarize(
    state: RolloutState,
    slots: int,
    rows: Iterable[TrajectoryRow],
    logs: Iterable[tuple[RecoveryLog, Timings]],
    *,
    now: float,
    stats: PolicyStats | None = None,
) -> RolloutSummary:
    """Counts over every attempt so far: ``rows`` (one per attempt, running ones included) and
    their recovery logs and timings; wall time up to ``now`` or the rollout's end; the
    policy's failure estimates from ``stats``."""
    rows = list(rows)
    finished = [r for r in rows if r.state == "finished"]
    done_slots = {r.slot for r in finished}
    failed_attempts = [r for r in rows if r.state == "failed"]
    per_slot: dict[int, int] = {}
    for r in failed_attempts:
        per_slot[r.slot] = per_slot.get(r.slot, 0) + 1
    out = RolloutSummary(
        trajectories=slots,
        trajectories_completed=len(done_slots),
        trajectories_failed=len(failed_attempts),
        slots_failed=sum(
            1
            for slot, n in per_slot.items()
            if slot not in done_slots and n >= state.request.max_attempts
        ),
        running=sum(1 for r in rows if r.state == "running"),
        restored=sum(1 for r in finished if r.restores or r.restarts_from_scratch),
        reward_failures=sum(1 for r in finished if r.reward_error),
        mean_reward=_mean([r.reward for r in finished if not r.reward_error]),
        failures_injected=state.failures_injected,
        failures_recovered=state.failures_recovered,
        controller_restarts=max(0, state.incarnations - 1),
        rollout_s=round((state.finished_at or now) - state.accepted_at, 3),
    )
    for rec, tim in logs:
        out.env_failures += rec.sandbox_failures
        out.env_restores += rec.restores
        out.restarts_from_scratch += rec.restarts_from_scratch
        out.restarts_from_scratch_with_checkpoint += rec.restarts_from_scratch_with_checkpoint
        out.checkpoints += rec.checkpoints
        out.checkpoint_failures += rec.checkpoint_failures
        out.engine_handovers += rec.engine_handovers
        out.visible_checkpoint_s += tim.visible_checkpoint_s
        out.checkpoint_s += tim.checkpoint_s
        out.llm_s += tim.llm_s
        out.env_s += tim.env_s
        out.trajectory_s += tim.total_s
    for name in ("visible_checkpoint_s", "checkpoint_s", "llm_s", "env_s", "trajectory_s"):
        setattr(out, name, round(getattr(out, name), 4))
    if out.mean_reward is not None:
        out.mean_reward = round(out.mean_reward, 4)
    if stats is not None:
        node = stats.step_probability()
        out.failure_p_estimate = None if node is None else round(node, 6)
        for image in sorted(stats.images):
            p = stats.step_probability(image)
            if p is not None:
                out.failure_p_by_image[image] = round(p, 6)
    return out


def _mean(values: list[float]) -> float | None:
    """The mean of ``values`` (None for none: nothing was scored)."""
    return sum(values) / len(values) if values else None
