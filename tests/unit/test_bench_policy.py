"""The arithmetic of ``belayer bench policy``'s verdicts, on hand-made rollout summaries."""

from __future__ import annotations

from typing import Any

from bench.policy import hidden_checkpoint_cost, increase, ratio_vs_no_checkpoints, summarize


def rollout(
    rollout_s: float, *, trajectory_s: float = 100.0, checkpoints: int = 0
) -> dict[str, Any]:
    return {
        "rollout_s": rollout_s, "trajectory_s": trajectory_s, "visible_checkpoint_s": 0.5,
        "llm_s": 50.0, "checkpoints": checkpoints, "env_failures": 0, "env_restores": 0,
        "restarts_from_scratch": 0, "restarts_from_scratch_with_checkpoint": 0,
        "trajectories_completed": 16, "trajectories": 16,
    }  # fmt: skip


def table(ra0: float, ra5: float, never0: float, never5: float) -> dict[str, Any]:
    return summarize(
        {
            "risk-aware@0.0": [rollout(ra0 - 1), rollout(ra0 + 1)],
            "risk-aware@0.05": [rollout(ra5), rollout(ra5)],
            "never@0.0": [rollout(never0), rollout(never0)],
            "never@0.05": [rollout(never5), rollout(never5)],
            "always@0.0": [rollout(1.0, trajectory_s=110.5, checkpoints=10)] * 2,
        }
    )


def test_increases_are_mean_differences_from_p0() -> None:
    t = table(ra0=40.0, ra5=42.0, never0=38.0, never5=46.0)
    assert increase(t, "risk-aware") == 2.0
    assert increase(t, "never") == 8.0
    assert increase(t, "always") is None  # no p = 0.05 row


def test_ratio_vs_no_checkpoints_charges_risk_awares_p0_checkpoints() -> None:
    # risk-aware's own baseline (40) hides 2 s of checkpoints that never's (38) does not have
    t = table(ra0=40.0, ra5=42.0, never0=38.0, never5=46.0)
    assert ratio_vs_no_checkpoints(t) == (42.0 - 38.0) / (46.0 - 38.0)
    faster = table(ra0=40.0, ra5=37.0, never0=38.0, never5=46.0)
    assert ratio_vs_no_checkpoints(faster) == 0.0  # below the baseline: no increase
    assert ratio_vs_no_checkpoints(table(40.0, 42.0, 38.0, 38.0)) is None  # nothing to compare
    assert ratio_vs_no_checkpoints({}) is None


def test_hidden_cost_is_per_checkpoint_beyond_the_visible_wait() -> None:
    t = table(ra0=40.0, ra5=42.0, never0=38.0, never5=46.0)
    # always: 110.5 trajectory-s, never 100, visible 0.5 → 10 s over 10 checkpoints a repeat
    assert hidden_checkpoint_cost(t, repeats=2) == 1.0
