"""Intervals for the benchmarks' verdicts: a percentile bootstrap over paired samples, and a
verdict that carries its interval (a point estimate alone says nothing about noise).

``bootstrap(pairs, statistic)`` resamples whole pairs (the two sides of one pair were measured
together, so their noise is shared), seeded, and returns the statistic's point value with the
2.5th and 97.5th percentiles of its resampled values. ``interval_verdict`` reads the interval
against a target: PASS when all of it meets the target, MISS when none of it does, UNSURE when
it straddles the target — never a verdict from the point alone.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
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
    if not values:
        return None
    values.sort()
    tail = (1.0 - LEVEL) / 2
    low = values[int(tail * (len(values) - 1))]
    high = values[round((1.0 - tail) * (len(values) - 1))]
    return Interval(value=value, low=low, high=high, n=len(pairs))


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
