"""A rollout's counts from its attempts: failed attempts are counted but never as completed
slots, a slot is failed only once it used up its attempts, times and recoveries add up."""

from __future__ import annotations

from typing import Literal

import msgspec

from schemas.rollout import RecoveryLog, RolloutRequest, RolloutState, Timings, TrajectoryRow
from services.controller.summary import summarize


def row(
    slot: int,
    attempt: int,
    state: Literal["running", "finished", "failed"],
    reward: float = 0.0,
    restores: int = 0,
) -> TrajectoryRow:
    return TrajectoryRow(
        trajectory_id=f"r-s{slot}-a{attempt}", task_id="t", slot=slot, attempt=attempt,
        state=state, reward=reward, restores=restores,
    )  # fmt: skip


def test_counts() -> None:
    state = RolloutState(
        request=RolloutRequest(workload="swe", rollout_id="r", n=2, max_attempts=2),
        task_ids=["t", "u"], accepted_at=100.0, failures_injected=3, failures_recovered=2,
        incarnations=2, attempts=[1, 0, 1, 0],
    )  # fmt: skip
    rows = [
        row(0, 0, "failed"),
        row(0, 1, "finished", 1.0, restores=1),
        row(1, 0, "finished", 0.0),
        row(2, 0, "failed"),
        row(2, 1, "failed"),
        row(3, 0, "running"),
    ]
    logs = [
        (
            RecoveryLog(sandbox_failures=2, restores=1, checkpoints=3),
            Timings(visible_checkpoint_s=0.5, llm_s=2.0),
        ),
        (
            RecoveryLog(restarts_from_scratch=1, restarts_from_scratch_with_checkpoint=1),
            Timings(checkpoint_s=1.5, env_s=1.0),
        ),
    ]
    s = summarize(state, 4, rows, logs, now=112.5)
    assert (s.trajectories, s.trajectories_completed, s.trajectories_failed) == (4, 2, 3)
    assert (s.slots_failed, s.running, s.restored) == (1, 1, 1)
    assert s.mean_reward == 0.5 and s.rollout_s == 12.5
    assert (s.env_failures, s.env_restores, s.restarts_from_scratch, s.checkpoints) == (2, 1, 1, 3)
    assert s.restarts_from_scratch_with_checkpoint == 1
    assert (s.visible_checkpoint_s, s.checkpoint_s, s.llm_s, s.env_s) == (0.5, 1.5, 2.0, 1.0)
    assert (s.failures_injected, s.failures_recovered, s.controller_restarts) == (3, 2, 1)
    state.finished_at = 110.0
    assert summarize(state, 4, rows, logs, now=500.0).rollout_s == 10.0


def test_failed_rewards_are_counted_and_left_out_of_the_mean() -> None:
    state = RolloutState(
        request=RolloutRequest(workload="math", rollout_id="r", n=2), task_ids=["t"],
        accepted_at=0.0, attempts=[0, 0],
    )  # fmt: skip
    failed = [
        msgspec.structs.replace(row(i, 0, "finished"), reward_error="reward_failed")
        for i in range(2)
    ]
    s = summarize(state, 2, failed, [], now=1.0)
    assert (s.trajectories_completed, s.reward_failures, s.mean_reward) == (2, 2, None)
    mixed = [failed[0], row(1, 0, "finished", 0.75)]
    s = summarize(state, 2, mixed, [], now=1.0)
    assert (s.reward_failures, s.mean_reward) == (1, 0.75)


def test_the_policys_failure_estimates_are_reported() -> None:
    from services.controller.policy import PolicyConfig, PolicyStats

    state = RolloutState(
        request=RolloutRequest(workload="swe", rollout_id="r"), task_ids=["t"], accepted_at=0.0
    )
    assert summarize(state, 1, [], [], now=1.0).failure_p_estimate is None
    stats = PolicyStats(PolicyConfig())
    for _ in range(10):
        stats.observe_exposure(0.5, "img")
    stats.observe_failure("img")
    s = summarize(state, 1, [], [], now=1.0, stats=stats)
    assert s.failure_p_estimate is not None and 0.0 < s.failure_p_estimate < 1.0
    assert s.failure_p_by_image == {"img": s.failure_p_estimate}  # one image: the node's
