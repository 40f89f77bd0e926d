"""The trainer's learning rate over optimiser steps (``model.training.make_scheduler``):
warm-up, then constant or a cosine to 0 over ``decay_steps``; a resumed scheduler goes on
exactly where the checkpointed one was."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from common.training_config import OptimConfig
from model.training import make_scheduler, train_step


def lrs(cfg: OptimConfig, steps: int) -> list[float]:
    """The learning rate after each of ``steps`` optimiser steps."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    sched = make_scheduler(opt, cfg)
    out = []
    for _ in range(steps):
        opt.step()
        sched.step()
        out.append(opt.param_groups[0]["lr"])
    return out


def test_constant_without_decay_steps() -> None:
    assert lrs(OptimConfig(lr=1e-3), 5) == [1e-3] * 5


def test_cosine_falls_to_zero_over_decay_steps_and_stays() -> None:
    got = lrs(OptimConfig(lr=5e-5, decay_steps=20), 22)
    want = [5e-5 * 0.5 * (1 + math.cos(math.pi * s / 20)) for s in range(1, 21)]
    assert got[:20] == pytest.approx(want, rel=1e-12)
    assert got[9] == pytest.approx(2.5e-5)  # half way: half the peak
    assert got[19] == 0.0 and got[20:] == [0.0, 0.0]
    assert all(a > b for a, b in itertools.pairwise(got[:20]))


def test_warm_up_then_cosine() -> None:
    got = lrs(OptimConfig(lr=1.0, warmup_steps=4, decay_steps=4), 9)
    assert got[:3] == pytest.approx([0.5, 0.75, 1.0])
    assert got[3:8] == pytest.approx([0.5 * (1 + math.cos(math.pi * s / 4)) for s in range(5)])


def test_a_resumed_scheduler_goes_on_exactly() -> None:
    cfg = OptimConfig(lr=1e-4, decay_steps=10)
    whole = lrs(cfg, 10)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    first = make_scheduler(opt, cfg)
    for _ in range(4):
        opt.step()
        first.step()
    state = first.state_dict()
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    resumed = make_scheduler(opt2, cfg)
    resumed.load_state_dict(state)
    rest = []
    for _ in range(6):
        opt2.step()
        resumed.step()
        rest.append(opt2.param_groups[0]["lr"])
    assert rest == whole[4:]


def test_train_step_reports_the_rate_it_used() -> None:
    """``StepStats.lr`` (a run's ``lr`` in metrics.jsonl) is the rate the update's last
    optimiser step used, not the next one's: the last step of a cosine over the run reports
    the small rate it trained with, not 0."""
    param = torch.nn.Parameter(torch.zeros(1))
    cfg = OptimConfig(lr=1e-3, decay_steps=4)
    opt = torch.optim.SGD([param], lr=cfg.lr)
    sched = make_scheduler(opt, cfg)

    def loss_fn(x: float) -> torch.Tensor:
        return (param * x).sum()

    one = [[1.0]]  # one mini-batch of one micro-batch: one optimiser step per update
    got = [train_step(param_model(param), opt, sched, one, loss_fn, max_grad_norm=1e9).lr]
    got += [train_step(param_model(param), opt, sched, one, loss_fn, max_grad_norm=1e9).lr]
    two = [[1.0], [1.0]]  # two optimiser steps: the second one's rate
    got += [train_step(param_model(param), opt, sched, two, loss_fn, max_grad_norm=1e9).lr]
    want = [1e-3 * 0.5 * (1 + math.cos(math.pi * s / 4)) for s in (0, 1, 3)]
    assert got == pytest.approx(want, rel=1e-12)
    assert got[-1] > 0.0
    # SGD with lr r moves the parameter by -r per unit gradient: the rates reported were used
    assert float(param.detach()) == pytest.approx(-sum(lrs_used(cfg, 4)), rel=1e-6)


def param_model(param: torch.nn.Parameter) -> torch.nn.Module:
    model = torch.nn.Module()
    model.p = param
    return model


def lrs_used(cfg: OptimConfig, steps: int) -> list[float]:
    """The rate each of the first ``steps`` optimiser steps uses."""
    return [cfg.lr * 0.5 * (1 + math.cos(math.pi * s / cfg.decay_steps)) for s in range(steps)]


def test_negative_decay_steps_refused() -> None:
    with pytest.raises(ValueError, match="decay_steps"):
        OptimConfig(decay_steps=-1)


def test_belayer_run_decays_over_its_steps(tmp_path) -> None:
    from services.rl.node import run_trainer_config
    from services.rl.options import LR_SCHEDULES, RunOptions, check_options

    cfg = run_trainer_config(group_size=8, groups_per_step=8, checkpoint_dir=tmp_path)
    assert cfg.optim.decay_steps == 0
    cfg = run_trainer_config(
        group_size=8, groups_per_step=8, checkpoint_dir=tmp_path, lr=5e-5, decay_steps=20
    )
    assert (cfg.optim.lr, cfg.optim.decay_steps) == (5e-5, 20 * cfg.grpo.minibatches)
    assert RunOptions("math").lr_schedule == "cosine" and "constant" in LR_SCHEDULES
    with pytest.raises(Exception, match="--lr-schedule"):
        check_options(RunOptions("math", lr_schedule="linear"))


def test_belayer_run_objective_options(tmp_path) -> None:
    """``--loss-type``, ``--beta``, ``--minibatches`` reach the trainer of the run's node; the
    cosine then spans every optimiser step of the run (steps × minibatches)."""
    from services.rl.node import run_trainer_config
    from services.rl.options import LOSS_TYPES, RunOptions, check_options, objective
    from services.trainer.client import GrpoConfig

    assert objective(RunOptions("math")) == GrpoConfig()
    assert set(LOSS_TYPES) == {"dapo", "grpo", "bnpo", "dr_grpo"}
    opts = RunOptions("math", loss_type="dr_grpo", beta=0.04, minibatches=2)
    cfg = run_trainer_config(
        group_size=8, groups_per_step=8, checkpoint_dir=tmp_path, decay_steps=20,
        objective=objective(opts),
    )  # fmt: skip
    assert (cfg.grpo.loss_type, cfg.grpo.beta, cfg.grpo.minibatches) == ("dr_grpo", 0.04, 2)
    assert cfg.optim.decay_steps == 40
    with pytest.raises(
        Exception, match="loss type must be one of grpo, bnpo, dr_grpo, dapo, got 'ppo'"
    ):
        check_options(RunOptions("math", loss_type="ppo"))
    with pytest.raises(Exception, match="beta"):
        check_options(RunOptions("math", beta=-1.0))
