"""``belayer run --eval-every K``: the held-out tasks are evaluated before training, after every
K-th step and after the last; a step not evaluated has no ``heldout_*`` fields, and the run's
start/last held-out numbers come from the evaluated steps."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from common.errors import InvalidRequest
from services.rl.held_out import EvalResult
from services.rl.loop import evaluates
from services.rl.records import held_fields
from services.rl.run_workload import run_defaults
from tests.unit.soak_train_helpers import context


def test_every_k_th_step_and_the_last_are_evaluated(tmp_path: Path) -> None:
    ctx = replace(context(tmp_path), steps=12, eval_every=5)
    assert [s for s in range(1, 13) if evaluates(ctx, s)] == [5, 10, 12]
    ctx = replace(ctx, eval_every=1)
    assert [s for s in range(1, 13) if evaluates(ctx, s)] == list(range(1, 13))


def test_held_fields_are_the_evaluation_s_own() -> None:
    held = EvalResult(rewards={"a": 1.0, "b": 0.0})
    fields = held_fields(held)
    assert fields["heldout_rewards"] == {"a": 1.0, "b": 0.0} and fields["heldout_reward"] == 0.5


def test_a_plugin_may_declare_eval_every() -> None:
    assert run_defaults("w", {"eval_every": 4}) == {"eval_every": 4}
    with pytest.raises(InvalidRequest, match="eval_every must be a whole number"):
        run_defaults("w", {"eval_every": 0})


def test_the_rollout_temperature_is_the_workload_s_unless_given(tmp_path: Path) -> None:
    """``belayer run``'s rollouts sample at ``--temperature``, else at the workload's default
    (swe 0.7, math 1, a plugin 1); the step's request carries it."""
    from services.rl.loop import step_request
    from services.rl.options import TEMPERATURE_DEFAULTS, RunOptions, StepFaults
    from services.rl.run_workload import resolve

    assert TEMPERATURE_DEFAULTS == {"math": 1.0, "swe": 0.7}
    assert resolve(RunOptions("swe")).temperature == 0.7
    assert resolve(RunOptions("math")).temperature == 1.0
    ctx = replace(context(tmp_path), temperature=0.7)
    assert step_request(ctx, 1, StepFaults()).sampling.temperature == 0.7
