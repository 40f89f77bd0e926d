"""The arithmetic of ``belayer bench policy``'s verdicts, on hand-made rollout summaries: values
as measured (a negative increase stays negative), intervals over the repeats, the estimating
risk-aware judged and the oracle reported beside it."""

from __future__ import annotations

from typing import Any

import pytest

from bench.policy import (
    ORACLE,
    PROBABILITIES,
    VARIANTS,
    hidden_checkpoint_cost,
    increase,
    judge_runs,
    ratio_vs_no_checkpoints,
    report_rows,
    summarize,
)


def rollout(
    rollout_s: float,
    *,
    trajectory_s: float = 100.0,
    checkpoints: int = 0,
    with_checkpoint: int = 0,
    estimate: float | None = None,
) -> dict[str, Any]:
    return {
        "rollout_s": rollout_s, "trajectory_s": trajectory_s, "visible_checkpoint_s": 0.5,
        "llm_s": 50.0, "checkpoints": checkpoints, "env_failures": 0, "env_restores": 0,
        "restarts_from_scratch": with_checkpoint,
        "restarts_from_scratch_with_checkpoint": with_checkpoint,
        "trajectories_completed": 16, "trajectories": 16, "failure_p_estimate": estimate,
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
    # below the baseline: shown as measured, negative (noise), never clamped to 0
    assert ratio_vs_no_checkpoints(faster) == (37.0 - 38.0) / (46.0 - 38.0)
    assert ratio_vs_no_checkpoints(table(40.0, 42.0, 38.0, 38.0)) is None  # nothing to compare
    assert ratio_vs_no_checkpoints({}) is None


def test_hidden_cost_is_per_checkpoint_beyond_the_visible_wait() -> None:
    t = table(ra0=40.0, ra5=42.0, never0=38.0, never5=46.0)
    # always: 110.5 trajectory-s, never 100, visible 0.5 → 10 s over 10 checkpoints a repeat
    assert hidden_checkpoint_cost(t, repeats=2) == 1.0


def runs(
    increase_ra: list[float], increase_oracle: list[float], *, with_checkpoint: int = 0
) -> dict[str, list[dict[str, Any]]]:
    """Every variant at every p, one rollout a repeat: never's rollout grows 10 s from p = 0
    to 0.05, risk-aware's and the oracle's by the given seconds (repeat r)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for r, (ra, orc) in enumerate(zip(increase_ra, increase_oracle, strict=True)):
        for p in PROBABILITIES:
            grow = p / 0.05
            for v in VARIANTS:
                extra = {"risk-aware": ra, ORACLE: orc, "never": 10.0}.get(v, 0.0)
                est = p * 0.9 if v == "risk-aware" and p else None
                row = rollout(40.0 + r + grow * extra, estimate=est,
                              with_checkpoint=with_checkpoint if v == "risk-aware" else 0)  # fmt: skip
                out.setdefault(f"{v}@{p}", []).append(row)
    return out


def test_the_verdict_reads_the_interval_over_repeats_and_judges_the_estimating_policy() -> None:
    # risk-aware (estimating): +1..+3 s vs never's +10 s → ratio 0.1..0.3, all under 1/3
    # the oracle: +2..+5 s → 0.2..0.5, its interval straddles 1/3 (reported, not judged)
    got = judge_runs(runs([1.0, 2.0, 3.0], [2.0, 3.5, 5.0]), repeats=3)
    assert got["values"]["increase_ratio_vs_scratch"] == 0.2
    ci = got["intervals"]["increase_ratio_vs_scratch"]
    assert ci["n"] == 3 and 0.1 <= ci["ci95"][0] <= 0.2 <= ci["ci95"][1] <= 0.3
    assert got["verdicts"]["increase_ratio_vs_scratch"] == "PASS"
    assert got["oracle_values"]["increase_ratio_vs_scratch"] == 0.35
    assert got["oracle_verdicts"]["increase_ratio_vs_scratch"] == "UNSURE"
    assert got["verdicts"]["restarts_with_checkpoint"] == "PASS"
    assert got["verdicts"]["risk_aware_visible_fraction"] == "PASS"  # 0.5 / 100 s
    # Both failure probabilities: the injected (oracle) and the one risk-aware estimated.
    assert got["failure_p"]["0.05"]["oracle"] == 0.05
    assert got["failure_p"]["0.05"]["estimated"]["mean"] == pytest.approx(0.045)
    assert got["failure_p"]["0.0"]["estimated"]["mean"] is None
    rows = report_rows({**got, "results": got["results"]})
    shown = {r.metric: r for r in rows}
    assert "95 % CI" in shown["risk-aware increase p=0→0.05 / restart-from-scratch's"].value
    assert any("estimate / injected" in m and "0.0450 / 0.05" in r.value for m, r in shown.items())


def test_a_negative_increase_is_shown_as_measured() -> None:
    got = judge_runs(runs([-2.0, -1.0, -3.0], [1.0, 1.0, 1.0]), repeats=3)
    assert got["values"]["increase_ratio_vs_scratch"] == -0.2
    assert got["risk_aware_increase_s"] == -2.0
    assert got["verdicts"]["increase_ratio_vs_scratch"] == "PASS"
    row = next(r for r in report_rows(got) if r.metric.startswith("risk-aware increase"))
    assert row.value.startswith("-0.2")


def test_one_restart_with_a_ready_checkpoint_is_a_miss_whatever_its_interval() -> None:
    r = runs([1.0, 1.0, 1.0], [1.0, 1.0, 1.0])
    r["risk-aware@0.05"][1]["restarts_from_scratch_with_checkpoint"] = 1
    got = judge_runs(r, repeats=3)
    assert got["values"]["restarts_with_checkpoint"] == 1.0
    assert got["intervals"]["restarts_with_checkpoint"]["ci95"][0] == 0.0  # resamples without it
    assert got["verdicts"]["restarts_with_checkpoint"] == "MISS"
