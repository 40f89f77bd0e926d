"""`belayer run`'s per-step progress line ends with the time the remaining steps will take at
this invocation's mean step time (TRL's and verl's progress bars show one too)."""

from __future__ import annotations

import io
from typing import Any

from rich.console import Console

from services.cli.run import Ui


def _record(step: int, step_s: float) -> dict[str, Any]:
    return {"step": step, "reward_mean": 0.5, "heldout_reward": 0.25, "heldout_exact": 0.25,
            "tokens": 100, "rollout_s": 1.0, "train_s": 1.0, "push_s": 0.1, "eval_s": 0.5,
            "failures_injected": 0, "failures_recovered": 0, "logprob_diff_max": 0.0,
            "weight_version": step + 1, "step_s": step_s}  # fmt: skip


def test_each_step_line_says_how_long_the_rest_will_take() -> None:
    out = io.StringIO()
    ui = Ui(Console(file=out, soft_wrap=True))
    lines = []
    for step, seconds in ((3, 4.0), (4, 2.0), (5, 9.0)):  # a resumed run: steps 3-5 of 5
        ui.begin_step(step, 5)
        ui.end_step(_record(step, seconds))
        lines.append(out.getvalue().splitlines()[-1])
    assert lines[0].endswith("weights v4, about 8 s left")  # 2 steps × 4 s
    assert lines[1].endswith("weights v5, about 3 s left")  # 1 step × mean(4, 2)
    assert lines[2].endswith("weights v6")  # the last step: nothing left
