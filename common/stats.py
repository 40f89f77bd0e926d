"""Percentile-bootstrap intervals: a statistic with the 2.5th and 97.5th percentiles of its
resampled values, seeded (so a report says the same interval every time it is made).

``bootstrap(pairs, statistic)`` resamples whole pairs (the two sides of one pair were measured
together, so their noise is shared); ``paired_gain`` is the change of a mean between two
evaluations of the same items (a run's held-out tasks before and after training). Pure: the
benchmarks' verdicts (``bench.stats``) and ``belayer run``'s report both use it.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

RESAMPLES = 2000
"""Bootstrap resamples per interval."""
LEVEL = 0.95
"""Coverage of every interval."""


@dataclass(frozen=True)
class Interval:
    """A statistic with its bootstrap interval."""

    value: float
    """On the measured sample."""
    low: float
    """Lower bound (the ``(1 - LEVEL) / 2`` percentile of the resampled statistic)."""
    high: float
    """Upper bound."""
    n: int
    """Pairs it was computed from."""

    def as_json(self) -> dict[str, Any]:
        return {
            "value": round(self.value, 4),
            "ci95": [round(self.low, 4), round(self.high, 4)],
            "n": self.n,
        }


def bootstrap(
    pairs: Sequence[T],
    statistic: Callable[[Sequence[T]], float | None],
    *,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> Interval | None:
    """The statistic of ``pairs`` with its percentile-bootstrap interval (resampling whole
    pairs with replacement, ``seed``-ed). ``None`` when there are fewer than 2 pairs or the
    statistic is undefined on the sample; resamples where it is undefined are skipped."""
    if len(pairs) < 2:
        return None
    value = statistic(pairs)
    if value is None:
        return None
    rng = random.Random(seed)
    values: list[float] = []
    for _ in range(resamples):
        v = statistic([pairs[rng.randrange(len(pairs))] for _ in pairs])
        if v is not None:
            values.append(v)
    return percentile_interval(value, values, len(pairs))


def bootstrap_many(
    pairs: Sequence[T],
    statistics_of: Callable[[Sequence[T]], Mapping[str, float | None]],
    *,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> dict[str, Interval | None]:
    """``bootstrap`` of several statistics computed together (one call per resample returns
    them all, by key), on the same resamples. A key is ``None`` where ``bootstrap`` would be."""
    if len(pairs) < 2:
        return {k: None for k in statistics_of(pairs)}
    point = statistics_of(pairs)
    rng = random.Random(seed)
    samples: dict[str, list[float]] = {k: [] for k in point}
    for _ in range(resamples):
        for k, v in statistics_of([pairs[rng.randrange(len(pairs))] for _ in pairs]).items():
            if v is not None and k in samples:
                samples[k].append(v)
    return {
        k: percentile_interval(value, samples[k], len(pairs)) if value is not None else None
        for k, value in point.items()
    }


def percentile_interval(value: float, values: list[float], n: int) -> Interval | None:
    """The percentile interval of resampled ``values`` around ``value``."""
    if not values:
        return None
    values = sorted(values)
    tail = (1.0 - LEVEL) / 2
    low = values[int(tail * (len(values) - 1))]
    high = values[round((1.0 - tail) * (len(values) - 1))]
    return Interval(value=value, low=low, high=high, n=n)


def paired_gain(before: Mapping[str, float], after: Mapping[str, float]) -> Interval | None:
    """mean(after) − mean(before) over the items both have (by key), with its paired
    bootstrap interval (an item's two values resampled together). ``None`` with fewer than 2
    such items."""
    pairs = [(before[k], after[k]) for k in sorted(before) if k in after]

    def diff(ps: Sequence[tuple[float, float]]) -> float:
        return sum(b for _, b in ps) / len(ps) - sum(a for a, _ in ps) / len(ps)

    return bootstrap(pairs, diff)
