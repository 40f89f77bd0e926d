"""Intervals for the benchmarks' verdicts: a percentile bootstrap over paired samples, and a
verdict that carries its interval (a point estimate alone says nothing about noise).

``bootstrap(pairs, statistic)`` resamples whole pairs (the two sides of one pair were measured
together, so their noise is shared), seeded, and returns the statistic's point value with the
2.5th and 97.5th percentiles of its resampled values. ``interval_verdict`` reads the interval
against a target: PASS when all of it meets the target, MISS when none of it does, UNSURE when
it straddles the target — never a verdict from the point alone.

The helpers every benchmark uses: ``median_interval`` and ``quantile_interval`` over repeats,
``paired_ratio`` (the ratio of two medians measured in pairs), ``two_sample`` (a statistic of
two independent samples, each resampled on its own), ``judge`` (a target's verdict from its
interval; an *invariant* — a count of violations that must be 0, a share that must be all — is
judged on every trial instead: one violation is a MISS, its interval still stated) and
``ci_text`` (the interval as a table shows it).
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from bench.report import MISS, Target, percentile, targets_json, verdict
from common.stats import RESAMPLES, Interval, bootstrap, percentile_interval
from common.stats import bootstrap_many as bootstrap_many  # the benchmarks import it from here

T = TypeVar("T")
U = TypeVar("U")
UNSURE = "UNSURE"


def interval_verdict(interval: Interval | None, op: str, bound: float) -> str:
    """``PASS`` if the whole interval meets ``op bound`` (``<=`` or ``>=``), ``MISS`` if none
    of it does, ``UNSURE`` if it straddles the bound; ``n/a`` without an interval."""
    if interval is None:
        return "n/a"
    if op == "<=":
        meets_all, meets_none = interval.high <= bound, interval.low > bound
    elif op == ">=":
        meets_all, meets_none = interval.low >= bound, interval.high < bound
    else:
        raise ValueError(f"unknown comparison {op!r}")
    return "PASS" if meets_all else "MISS" if meets_none else "UNSURE"


def two_sample(
    a: Sequence[T],
    b: Sequence[U],
    statistic: Callable[[Sequence[T], Sequence[U]], float | None],
    *,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> Interval | None:
    """The statistic of two independent samples with its percentile-bootstrap interval, each
    sample resampled on its own (they were not measured in pairs). ``None`` when either has
    fewer than 2 values; ``n`` is the smaller sample."""
    if len(a) < 2 or len(b) < 2:
        return None
    value = statistic(a, b)
    if value is None:
        return None
    rng = random.Random(seed)
    values: list[float] = []
    for _ in range(resamples):
        ra = [a[rng.randrange(len(a))] for _ in a]
        rb = [b[rng.randrange(len(b))] for _ in b]
        v = statistic(ra, rb)
        if v is not None:
            values.append(v)
    return percentile_interval(value, values, min(len(a), len(b)))


def median_interval(values: Sequence[float]) -> Interval | None:
    """The median of repeated measurements with its interval over the repeats."""
    return bootstrap(list(values), statistics.median)


def quantile_interval(values: Sequence[float], q: float) -> Interval | None:
    """The nearest-rank ``q``-th percentile (``bench.report.percentile``) with its interval."""
    return bootstrap(list(values), lambda vs: percentile(list(vs), q))


def paired_ratio(numerator: Sequence[float], denominator: Sequence[float]) -> Interval | None:
    """median(numerator) / median(denominator), measured in pairs (run i of each side
    together: they share the machine's drift), with its interval over the pairs."""

    def stat(ps: Sequence[tuple[float, float]]) -> float | None:
        den = statistics.median(d for _, d in ps)
        return statistics.median(n for n, _ in ps) / den if den else None

    return bootstrap(list(zip(numerator, denominator, strict=False)), stat)


def median_ratio(numerator: Sequence[float], denominator: Sequence[float]) -> Interval | None:
    """median(numerator) / median(denominator) of two independent samples (not paired)."""

    def stat(a: Sequence[float], b: Sequence[float]) -> float | None:
        den = statistics.median(b)
        return statistics.median(a) / den if den else None

    return two_sample(list(numerator), list(denominator), stat)


def judge(
    target: Target, interval: Interval | None, value: float | None, *, invariant: bool = False
) -> str:
    """A target's verdict. Unmeasured: MISS. An ``invariant`` (violations counted over every
    trial): PASS or MISS from ``value``. Otherwise from the interval (``interval_verdict``);
    a value without an interval (a single measurement) is UNSURE."""
    if value is None:
        return MISS
    if invariant:
        return verdict(value, target)
    if interval is None:
        return UNSURE
    return interval_verdict(interval, *target)


def judge_all(
    targets: Mapping[str, Target],
    values: Mapping[str, float | None],
    intervals: Mapping[str, Interval | None],
    invariants: Sequence[str] = (),
) -> dict[str, str]:
    """``judge`` for every target whose key is in ``values``."""
    return {
        key: judge(t, intervals.get(key), values[key], invariant=key in invariants)
        for key, t in targets.items()
        if key in values
    }


def judged_json(
    targets: Mapping[str, Target],
    values: Mapping[str, float | None],
    intervals: Mapping[str, Interval | None],
    invariants: Sequence[str] = (),
) -> dict[str, Any]:
    """A result's judged part: ``targets`` (:func:`bench.report.targets_json`), ``intervals``
    (:func:`intervals_json`) and ``verdicts`` (:func:`judge_all`)."""
    return {
        "targets": targets_json(targets),
        "intervals": intervals_json(intervals),
        "verdicts": judge_all(targets, values, intervals, invariants),
    }


def intervals_json(
    intervals: Mapping[str, Interval | None],
) -> dict[str, dict[str, Any] | None]:
    """The ``intervals`` entry of a result: key → ``{"value", "ci95", "n"}`` or null (fewer
    than 2 samples)."""
    return {k: i.as_json() if i else None for k, i in intervals.items()}


def ci_text(interval: Interval | dict[str, Any] | None, show: Callable[[float], str]) -> str:
    """`` [95 % CI low … high]`` with each bound shown by ``show``; `` [no interval: n < 2]``
    without one."""
    if interval is None:
        return " [no interval: n < 2]"
    low, high = interval["ci95"] if isinstance(interval, dict) else (interval.low, interval.high)
    return f" [95 % CI {show(low)} … {show(high)}]"
