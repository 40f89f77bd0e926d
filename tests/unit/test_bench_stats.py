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
