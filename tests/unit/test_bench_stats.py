"""Verdicts carry their interval: the bootstrap resamples whole pairs, is seeded, and a verdict
is PASS or MISS only when the whole interval is on one side of the target."""

from __future__ import annotations

import statistics

import pytest

from bench.stats import Interval, bootstrap, interval_verdict
from bench.train import cost_interval, overhead_interval


def test_bootstrap_brackets_the_statistic_and_is_seeded() -> None:
    pairs = [(1.0 + 0.01 * i, 1.0) for i in range(10)]
    ci = bootstrap(pairs, lambda ps: statistics.mean(b / a for b, a in ps))
    assert ci is not None and ci.n == 10
    assert ci.low <= ci.value <= ci.high
    assert ci.value == pytest.approx(1.045)
    assert 1.0 <= ci.low < ci.high <= 1.09
    again = bootstrap(pairs, lambda ps: statistics.mean(b / a for b, a in ps))
    assert again == ci
    # Identical pairs have no spread at all.
    flat = bootstrap([(2.0, 1.0)] * 5, lambda ps: statistics.mean(b / a for b, a in ps))
    assert flat is not None and flat.low == flat.high == flat.value == 2.0


def test_too_few_pairs_have_no_interval() -> None:
    assert bootstrap([(1.0, 1.0)], lambda ps: 0.0) is None
    assert bootstrap([], lambda ps: 0.0) is None
    assert interval_verdict(None, "<=", 0.01) == "n/a"


def test_a_verdict_reads_the_whole_interval() -> None:
    def iv(lo: float, hi: float) -> Interval:
        return Interval(value=(lo + hi) / 2, low=lo, high=hi, n=5)

    assert interval_verdict(iv(-0.02, 0.005), "<=", 0.01) == "PASS"
    assert interval_verdict(iv(0.02, 0.05), "<=", 0.01) == "MISS"
    assert interval_verdict(iv(0.0, 0.02), "<=", 0.01) == "UNSURE"
    assert interval_verdict(iv(3.0, 5.0), ">=", 2.0) == "PASS"
    assert interval_verdict(iv(0.5, 1.5), ">=", 2.0) == "MISS"
    with pytest.raises(ValueError):
        interval_verdict(iv(0, 1), "<", 1)


def test_bench_train_intervals_pair_its_samples() -> None:
    over = overhead_interval([10.1, 10.0, 10.2, 9.9], [10.0, 10.0, 10.0, 10.0])
    assert over is not None and over.n == 4 and over.low <= over.value <= over.high
    # Belayer adds ~1 s per worker kill, the baseline ~20 s: the ratio's interval is near 20.
    cost = cost_interval([1.0, 1.2, 0.8, 1.0, 1.0], [20.0, 19.0, 21.0, 20.0, 20.0], floor=0.1)
    assert cost is not None and cost.value == pytest.approx(20.0)
    assert 15.0 < cost.low <= cost.value <= cost.high < 26.0
    # Belayer's added time under its noise floor: the floor stands in (a lower bound).
    floored = cost_interval([0.0, -0.1, 0.05], [10.0, 10.0, 10.0], floor=0.5)
    assert floored is not None and floored.value == pytest.approx(20.0)


def test_helpers_for_repeats_pairs_and_independent_samples() -> None:
    from bench.stats import median_interval, median_ratio, paired_ratio, quantile_interval

    runs = [100.0, 104.0, 98.0, 101.0, 99.0]
    med = median_interval(runs)
    assert med is not None and med.value == 100.0 and 98.0 <= med.low <= 100.0 <= med.high <= 104.0
    p99 = quantile_interval(runs, 99)
    assert p99 is not None and p99.value == 104.0 and p99.high == 104.0
    # Paired: a drift that hits both sides of a pair cancels; the ratio stays 0.5.
    drift = [1.0, 2.0, 3.0, 4.0]
    paired = paired_ratio([d * 0.5 for d in drift], drift)
    assert paired is not None and paired.value == 0.5
    # Independent samples are resampled each on its own: the same drift widens the interval.
    unpaired = median_ratio([d * 0.5 for d in drift], drift)
    assert unpaired is not None and unpaired.value == pytest.approx(0.5)
    assert unpaired.low < 0.5 < unpaired.high
    assert median_ratio([1.0], drift) is None  # one value: no interval


def test_two_sample_and_many_statistics_are_seeded() -> None:
    from bench.stats import bootstrap_many, two_sample

    a, b = [1.0, 2.0, 3.0], [10.0, 11.0, 12.0]
    one = two_sample(a, b, lambda x, y: statistics.mean(y) - statistics.mean(x))
    assert one is not None and one.value == 9.0 and one.n == 3
    assert one == two_sample(a, b, lambda x, y: statistics.mean(y) - statistics.mean(x))
    assert two_sample([1.0], b, lambda x, y: 0.0) is None
    many = bootstrap_many(a, lambda xs: {"mean": statistics.mean(xs), "none": None})
    assert many["none"] is None
    alone = bootstrap(a, statistics.mean)
    assert many["mean"] == alone  # the same resamples as bootstrap's with the same seed
    assert bootstrap_many([1.0], lambda xs: {"m": 1.0}) == {"m": None}


def test_judge_reads_the_interval_or_counts_an_invariant() -> None:
    from bench.stats import UNSURE, ci_text, judge, judge_all

    def iv(lo: float, hi: float) -> Interval:
        return Interval(value=(lo + hi) / 2, low=lo, high=hi, n=5)

    assert judge(("<=", 0.2), iv(0.1, 0.15), 0.12) == "PASS"
    assert judge(("<=", 0.2), iv(0.1, 0.3), 0.12) == UNSURE  # the point alone would pass
    assert judge(("<=", 0.2), None, 0.12) == UNSURE  # one measurement: no interval
    assert judge(("<=", 0.2), None, None) == "MISS"  # not measured
    # An invariant: one violation in any trial is a MISS, whatever the interval says.
    assert judge(("<=", 0.0), iv(0.0, 1.0), 1.0, invariant=True) == "MISS"
    assert judge((">=", 1.0), iv(1.0, 1.0), 1.0, invariant=True) == "PASS"
    got = judge_all(
        {"a": ("<=", 1.0), "b": ("<=", 0.0), "c": (">=", 5.0)},
        {"a": 0.5, "b": 0.0},
        {"a": iv(0.4, 0.6), "b": None},
        invariants=("b",),
    )
    assert got == {"a": "PASS", "b": "PASS"}  # c was not measured: no verdict
    assert ci_text(iv(0.4, 0.6), lambda x: f"{x:.1f}") == " [95 % CI 0.4 … 0.6]"
    assert ci_text(iv(0.4, 0.6).as_json(), lambda x: f"{x:.1f}") == " [95 % CI 0.4 … 0.6]"
    assert "no interval" in ci_text(None, str)


def test_bench_train_states_each_failure_cost_with_its_interval(tmp_path) -> None:
    from pathlib import Path

    from bench.train import Side, report

    def side(name: str, free: list[float], worker: list[float], sandbox: list[float]) -> Side:
        s = Side(name, name, "never", Path(tmp_path))
        s.free = free
        for label, times in (("worker-kill", worker), ("sandbox-kill", sandbox)):
            s.steps += [{"label": label, "step_s": t, "failures_injected": 1} for t in times]
        return s

    # Belayer: failure-free 10 s; a worker kill adds ~1 s; a sandbox kill is faster than the
    # median failure-free step (−0.2 s: noise, shown as measured, never clamped to 0).
    bel = side("belayer", [10.0, 10.1, 9.9, 10.0, 10.0], [11.0, 11.2, 10.8, 11.0, 11.0],
               [9.8, 9.8, 9.8, 9.8, 9.8])  # fmt: skip
    base = side("baseline", [10.0, 10.0, 10.0, 10.0, 10.0], [20.0, 19.0, 21.0, 20.0, 20.0],
                [14.0, 15.0, 16.0, 15.0, 15.0])  # fmt: skip
    r = report(bel, base, 5, 5, 4, 2, {}, tmp_path / "train.json")
    assert r["worker_added_belayer_s"] == pytest.approx(1.0)
    assert r["sandbox_added_belayer_s"] == pytest.approx(-0.2)  # as measured
    assert r["kills_landed"]["worker_added_baseline_s"] == 5
    for key in ("worker_added_belayer_s", "worker_added_baseline_s", "sandbox_added_belayer_s",
                "sandbox_added_baseline_s", "worker_ratio", "sandbox_ratio", "overhead"):  # fmt: skip
        ci = r["intervals"][key]
        assert ci is not None and ci["ci95"][0] <= ci["value"] <= ci["ci95"][1], key
    assert r["intervals"]["sandbox_added_belayer_s"]["ci95"] == [-0.2, -0.2]
    assert r["ratios_are_lower_bounds"] == {"worker": False, "sandbox": True}
    assert r["verdicts"]["overhead"] in ("PASS", "MISS", "UNSURE")
    assert "commit" in r and "date" in r
