"""Reward functions shaped like TRL's: ``fn(prompts, completions, **columns) -> list[float |
None]``, loaded by ``module:function`` spec and combined as TRL's ``GRPOTrainer`` combines
its ``reward_funcs``: each function's value times its weight, summed over the functions that
gave one (``None``: not applicable to this sample — TRL's ``nansum``).

Belayer scores one trajectory at a time, so every call gets lists of one, in TRL's
conversational format: ``prompts=[[{"role": …, "content": …}, …]]`` (the task's chat),
``completions=[[{"role": "assistant", "content": <final response>}]]``, and as columns
``task_id``, ``answer`` (the task's reference answer) and each of the task's ``metadata`` keys
— all lists of one. A function runs in a worker thread, so a slow one does not stall the
controller.

A function that raises, returns something other than a list of one finite number or ``None``,
or a sample every function calls not applicable, is ``RewardFailed`` naming the function: that
trajectory's reward failed (recorded as ``Trajectory.reward_error`` and counted), the rollout
and the training step go on.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from common.errors import InvalidRequest, RewardFailed
from workloads.base import Outcome, SandboxHandle, Task, Workload
from workloads.plugins import import_callable

RewardFn = Callable[..., Any]
"""``fn(prompts, completions, **columns) -> list[float | None]``."""


SERVICE_PREFIX = "service:"
"""A reward spec ``service:<name>`` asks the reward service ``belayer.reward.<name>`` on the
bus instead of calling a Python function."""

AskService = Callable[[str, Task, Outcome], Awaitable[float | None]]
"""``ask(name, task, outcome)``: the score a reward service gives (``None``: not
applicable); raises ``RewardFailed`` when it cannot get one."""


@dataclass(frozen=True)
class Loaded:
    """One reward function: its spec (its name in errors) and the callable, or the name of
    the reward service that plays its part."""

    spec: str
    fn: RewardFn | None = None
    service: str = ""


def service_name(spec: str) -> str:
    """The service a ``service:<name>`` spec names ("" for a ``module:function`` spec)."""
    return spec.removeprefix(SERVICE_PREFIX) if spec.startswith(SERVICE_PREFIX) else ""


def load_reward_functions(specs: Sequence[str]) -> list[Loaded]:
    """Import every ``module:function`` spec (a ``service:<name>`` one imports nothing);
    ``InvalidRequest`` naming the first that cannot be imported."""
    return [
        Loaded(spec, service=service_name(spec))
        if service_name(spec)
        else Loaded(spec, import_callable(spec, "reward function"))
        for spec in specs
    ]


def declared_rewards(wl: object) -> list[str]:
    """The reward services a workload declares in an optional attribute ``rewards`` (a list of
    ``service:<name>`` specs): they score its trajectories when a request names no reward.
    ``InvalidRequest`` for anything else (a Python reward is the workload's ``reward``)."""
    specs = getattr(wl, "rewards", None)
    if specs is None:
        return []
    name = getattr(wl, "name", "?")
    if not isinstance(specs, list | tuple) or not all(
        isinstance(s, str) and service_name(s) for s in specs
    ):
        raise InvalidRequest(
            f"workload {name!r}: rewards must be a list of 'service:<name>' specs "
            "(a Python reward is the workload's reward method)",
            rewards=repr(specs)[:120],
        )
    return list(specs)


def check_weights(specs: Sequence[str], weights: Sequence[float]) -> list[float]:
    """The weights to use: one per function (empty: all 1)."""
    if not weights:
        return [1.0] * len(specs)
    if len(weights) != len(specs):
        raise InvalidRequest(
            "give one reward weight per reward function", functions=len(specs), weights=len(weights)
        )
    if not all(math.isfinite(w) for w in weights):
        raise InvalidRequest("reward weights must be finite numbers")
    return [float(w) for w in weights]


def combine(values: Sequence[float | None], weights: Sequence[float]) -> float | None:
    """TRL's combination: the weighted sum over the functions that gave a value; ``None``
    when none did."""
    given = [(v, w) for v, w in zip(values, weights, strict=True) if v is not None]
    if not given:
        return None
    return float(sum(v * w for v, w in given))


def columns_of(task: Task) -> dict[str, list[Any]]:
    """The keyword arguments a reward function gets besides prompts and completions."""
    cols: dict[str, list[Any]] = {k: [v] for k, v in task.metadata.items()}
    cols.update(task_id=[task.id], answer=[task.reference_answer])
    return cols


async def call_one(
    f: Loaded, task: Task, outcome: Outcome, ask: AskService | None = None
) -> float | None:
    """One function's value for one trajectory (``RewardFailed`` if it fails)."""
    if f.service:
        if ask is None:
            raise RewardFailed("no bus to reach the reward service on", service=f.service)
        return await ask(f.service, task, outcome)
    assert f.fn is not None and isinstance(outcome, str)
    completion = str(outcome)
    prompts = [[{"role": m.role, "content": m.content} for m in task.prompt]]
    completions = [[{"role": "assistant", "content": completion}]]
    try:
        out = await asyncio.to_thread(
            f.fn, prompts=prompts, completions=completions, **columns_of(task)
        )
    except Exception as exc:  # the user's code: one typed record, never the step
        raise RewardFailed(
            "the reward function raised", function=f.spec, error=f"{type(exc).__name__}: {exc}"
        ) from None
    if not isinstance(out, list | tuple) or len(out) != 1:
        raise RewardFailed(
            "a reward function returns a list with one value per completion",
            function=f.spec,
            returned=type(out).__name__,
        )
    value = out[0]
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RewardFailed(
            "a reward is a finite number or None", function=f.spec, returned=repr(value)[:80]
        )
    return float(value)


class RewardFunctions:
    """``base``'s tasks, scored by reward functions instead of ``base.reward``."""

    def __init__(
        self,
        base: Workload,
        functions: list[Loaded],
        weights: list[float],
        ask: AskService | None = None,
    ) -> None:
        self.base, self.functions, self.weights, self.ask = base, functions, weights, ask
        self.name = base.name

    def tasks(self, count: int, seed: int = 0) -> list[Task]:
        return self.base.tasks(count, seed)

    def held_out(self, count: int) -> list[Task]:
        return self.base.held_out(count)

    def task(self, task_id: str) -> Task:
        return self.base.task(task_id)

    async def reward(self, task: Task, outcome: Outcome) -> float:
        if isinstance(outcome, SandboxHandle) and any(not f.service for f in self.functions):
            raise InvalidRequest(
                "reward functions score answer tasks; a sandbox task takes reward services only",
                task=task.id,
            )
        values = [await call_one(f, task, outcome, self.ask) for f in self.functions]
        total = combine(values, self.weights)
        if total is None:
            raise RewardFailed(
                "no reward function applies to this sample (every one returned None)",
                functions=[f.spec for f in self.functions],
            )
        return total
