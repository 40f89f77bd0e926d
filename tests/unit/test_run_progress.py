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


def test_the_summary_line_shows_rewards_as_the_table_does(capsys: Any) -> None:
    from services.cli.run import print_summary

    report = {"run_id": "math1", "steps": 2, "trajectories_completed": 128,
              "trajectories_lost": 0, "failures_injected": 0, "failures_recovered": 0,
              "env_restores": 0, "handovers": 0, "trainer_restarts": 0, "weight_version": 3,
              "reward_first_step": 0.25, "reward_last_step": 0.4922,
              "heldout_reward_start": 0.25, "heldout_reward_last": None,
              "logprob_diff_max": 0.0, "wall_seconds": 17.2, "errors": [], "run_dir": "r",
              "plots": []}  # fmt: skip
    print_summary(report, [_record(1, 3.0), _record(2, 3.0)], "math")
    out = capsys.readouterr().out
    assert "reward 0.250 → 0.492, held-out 0.250 → -, logprob diff max 0.0, 17 s" in out
    gain = {"value": 0.4844, "ci95": [0.3594, 0.6094], "n": 64}
    report |= {"heldout_reward_last": 0.7344, "heldout_gain": gain}
    print_summary(report, [_record(1, 3.0), _record(2, 3.0)], "math")
    out = capsys.readouterr().out
    assert "held-out 0.250 → 0.734 (+0.484, 95 % CI +0.359 … +0.609 over 64 tasks), " in out
