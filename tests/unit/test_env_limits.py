"""Sandbox limits cannot be switched off: the environment core refuses every limit that is not
positive, finite and within the service's configured maximum, naming the field."""

from __future__ import annotations

import math

import pytest

from common.errors import InvalidRequest
from services.environment import core
from services.environment.config import EnvConfig

CAPS = core.Limits(memory_mb=1024, cpus=2.0, pids=512)


def _limits(**kw: float) -> core.Limits:
    base: dict[str, float] = {"memory_mb": 256, "cpus": 1.0, "pids": 64}
    return core.Limits(**{**base, **kw})  # type: ignore[arg-type]  # int fields take float test values too


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("memory_mb", 0),
        ("memory_mb", -1),
        ("memory_mb", 1025),
        ("cpus", 0.0),
        ("cpus", -1.0),
        ("cpus", math.nan),
        ("cpus", math.inf),
        ("cpus", 2.5),
        ("cpus", 0.001),  # NanoCpus would round to a limit below Docker's floor
        ("pids", 0),
        ("pids", -1),
        ("pids", 513),
    ],
)
def test_out_of_range_limits_are_invalid_requests(name: str, value: float) -> None:
    with pytest.raises(InvalidRequest) as err:
        core.check_limits(_limits(**{name: value}), CAPS)
    assert err.value.data["field"] == f"$.limits.{name}"


def test_limits_at_the_caps_pass() -> None:
    assert core.check_limits(_limits(memory_mb=1024, cpus=2.0, pids=512), CAPS).pids == 512
    assert core.check_limits(_limits(cpus=0.01), CAPS).cpus == 0.01


def test_the_service_caps_are_configured_once() -> None:
    cfg = EnvConfig()
    assert cfg.max_memory_mb >= cfg.default_memory_mb and cfg.max_pids >= cfg.default_pids
    assert cfg.max_cpus >= 1.0
