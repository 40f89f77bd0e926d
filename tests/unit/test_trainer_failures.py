"""A failed update never crash-loops the trainer: which trajectories fail on their own
(``update.find_poison``, on the real small model), what is dead-lettered, retried or held again
(``core.after_step_failure``, pure), and the plan's count of tries (``journal``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from model.config import ModelConfig, load_model_config
from model.loader import load_safetensors
from model.training import OptimConfig, publishable_state_dict
from services.trainer import journal
from services.trainer.config import GrpoConfig, TrainerConfig
from services.trainer.core import Batcher, FailureAction, Sample, after_step_failure
from services.trainer.update import find_poison, grpo_step, new_state, weights_equal
from tests.unit.model_fixtures import write_small_model

torch.set_num_threads(1)

OPTIM = OptimConfig(lr=1e-2, seed=5)
GRPO = GrpoConfig(micro_batch_size=4)


def sample(tid: str, group: str, index: int, **changes: object) -> Sample:
    s = Sample(
        trajectory_id=tid,
        group_id=group,
        sample_index=index,
        prompt_ids=(3, 4, 5, 6),
        response_ids=(7 + index, 8, 9 + 2 * index),
        loss_mask=(1, 0, 1),
        rollout_logprobs=(-1.0, 0.0, -2.0),
        weight_versions=(1, -1, 1),
        reward=float(index),
    )
    return dataclasses.replace(s, **changes)  # type: ignore[arg-type]  # changes: fields by name


def batch() -> list[Sample]:
    return [sample(f"{g}{i}", g, i) for g in ("A", "B", "C") for i in range(2)]


# --- the decision (pure) ------------------------------------------------------------------------
def test_a_poison_trajectory_is_dead_lettered_with_its_group_and_the_rest_is_held_again() -> None:
    got = after_step_failure(
        batch(), {"B1": "IndexError: index out of range"}, attempts=1, max_attempts=3, error="x"
    )
    assert got.action is FailureAction.DROP_CULPRITS
    assert got.dead_letter == (
        ("B0", "group_dropped", "group mate B1 fails the update"),
        ("B1", "poison", "IndexError: index out of range"),
    )
    assert got.keep == ("A0", "A1", "C0", "C1")


def test_an_unexplained_failure_is_retried_then_the_batch_is_dead_lettered() -> None:
    first = after_step_failure(batch(), {}, attempts=1, max_attempts=3, error="boom")
    assert first.action is FailureAction.RETRY and not first.dead_letter
    assert after_step_failure(batch(), {}, attempts=2, max_attempts=3, error="boom").action is (
        FailureAction.RETRY
    )
    last = after_step_failure(batch(), {"other": "not in the batch"}, attempts=3, max_attempts=3,
                              error="boom")  # fmt: skip
    assert last.action is FailureAction.DROP_BATCH and not last.keep
    assert [d[:2] for d in last.dead_letter] == [(s.trajectory_id, "step_failed") for s in batch()]
    assert "failed 3 times on this batch: boom" in last.dead_letter[0][2]
    # one try allowed: no retry at all
    once = after_step_failure(batch(), {}, attempts=1, max_attempts=1, error="boom")
    assert once.action is FailureAction.DROP_BATCH


def test_held_again_groups_make_the_next_batch() -> None:
    b = Batcher(group_size=2, groups_per_step=2)
    for s in batch():
        b.offer(s, 1)
    taken = b.next_batch(1)
    assert taken is not None and [s.group_id for s in taken] == ["A", "A", "B", "B"]
    b.give_back(s for s in taken if s.group_id == "A")
    again = b.next_batch(1)
    assert again is not None and {s.group_id for s in again} == {"A", "C"}


def test_step_attempts_is_a_trainer_knob_of_at_least_one() -> None:
    assert TrainerConfig().step_attempts == 3
    with pytest.raises(ValueError, match="step_attempts"):
        TrainerConfig(step_attempts=0)


# --- finding the culprits on the real model -------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_small_model(tmp_path_factory.mktemp("small-model"))


@pytest.fixture(scope="module")
def cfg(model_dir: Path) -> ModelConfig:
    return load_model_config(model_dir)


def test_find_poison_names_exactly_the_trajectories_the_update_fails_on(
    cfg: ModelConfig, model_dir: Path
) -> None:
    """A token id beyond the vocabulary (the forward raises) and a rollout log-probability of
    -1e30 on tokens whose weights are gone (a finite record, an infinite ratio): the update
    fails on the batch, leaves the state untouched, and exactly those two are named."""
    state = new_state(cfg, load_safetensors(model_dir), 1, OPTIM)
    before = {k: v.clone() for k, v in publishable_state_dict(state.model).items()}
    good = batch()
    out_of_vocab = dataclasses.replace(good[3], response_ids=(7, 8, cfg.vocab_size + 7))
    huge = dataclasses.replace(
        good[4], weight_versions=(0, -1, 0), rollout_logprobs=(-1e30, 0.0, -1e30)
    )
    poisoned = [*good[:3], out_of_vocab, huge, good[5]]
    with pytest.raises(IndexError):
        grpo_step(state, poisoned, group_size=2, grpo=GRPO, optim=OPTIM, pad_id=0)
    with pytest.raises(FloatingPointError):
        grpo_step(state, [*good[:4], huge, good[5]], group_size=2, grpo=GRPO, optim=OPTIM,
                  pad_id=0)  # fmt: skip
    assert (state.step, state.version, state.scheduler.last_epoch) == (0, 1, 0)
    assert weights_equal(before, publishable_state_dict(state.model))

    found = find_poison(state, poisoned, group_size=2, grpo=GRPO, pad_id=0)
    assert set(found) == {"B1", "C0"}
    assert found["B1"].startswith("IndexError") and "non-finite" in found["C0"]
    assert find_poison(state, good, group_size=2, grpo=GRPO, pad_id=0) == {}
    # what is left trains, and the same as it would have without the failed tries
    res = grpo_step(state, good[:2], group_size=2, grpo=GRPO, optim=OPTIM, pad_id=0)
    clean = new_state(cfg, load_safetensors(model_dir), 1, OPTIM)
    ref = grpo_step(clean, good[:2], group_size=2, grpo=GRPO, optim=OPTIM, pad_id=0)
    assert res.loss == ref.loss
    assert weights_equal(publishable_state_dict(state.model), publishable_state_dict(clean.model))


# --- the plan's count of tries --------------------------------------------------------------------
def test_a_plan_counts_its_tries_and_a_dropped_step_forgets_its_plans(tmp_path: Path) -> None:
    for step in (3, 4, 5):
        journal.write_plan(tmp_path, journal.Plan(step, step, (f"t{step}",), attempts=step - 2))
    assert journal.read_plan(journal.plan_path(tmp_path, 4)).attempts == 2
    (journal.plan_path(tmp_path, 6)).write_text('{"step": 6, "base_version": 6, '
                                                 '"trajectory_ids": ["t6"]}')  # fmt: skip
    assert journal.read_plan(journal.plan_path(tmp_path, 6)).attempts == 0  # an older plan
    removed = journal.remove_plans_from(tmp_path, 4)
    assert sorted(p.name for p in removed) == [
        "step-00000004.json",
        "step-00000005.json",
        "step-00000006.json",
    ]
    assert [p.step for p in journal.plans_after(tmp_path, 2)] == [3]
