"""The run's counters come from ids and texts: slots lost are the slots with no trained
trajectory id (not a difference of counts), exact-match accuracy is read from each response as
the controller scored it, and a step that compared no log-probability is an error."""

from __future__ import annotations

import pytest

from model.tiny import init_tiny_model
from model.tokenizer import Tokenizer, load_tokenizer
from schemas.rollout import Trajectory
from services.rl.counters import compared_nothing, exact_share, lost_slots
from workloads import load_workload, score_answer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    model_dir = init_tiny_model(
        tmp_path_factory.mktemp("tiny"), hidden_size=64, num_layers=1, head_dim=16,
        intermediate_size=64, vocab_size=1024,
    )  # fmt: skip
    return load_tokenizer(model_dir)


def traj(
    slot: int, attempt: int, task_id: str = "t", response: list[int] | None = None
) -> Trajectory:
    ids = response or [1]
    return Trajectory(
        trajectory_id=f"r-s{slot}-a{attempt}", rollout_id="r", workload="math", task_id=task_id,
        slot=slot, sample=slot % 2, attempt=attempt, prompt_ids=[1], response_ids=ids,
        loss_mask=[1] * len(ids), logprobs=[-1.0] * len(ids), weight_versions=[1] * len(ids),
        reward=0.0, turns=1, finish_reason="answered",
    )  # fmt: skip


def test_lost_slots_are_the_slots_without_a_trained_id() -> None:
    published = [traj(0, 0), traj(1, 1), traj(2, 0), traj(3, 0)]
    assert lost_slots(4, published, {"r-s0-a0", "r-s1-a1", "r-s2-a0", "r-s3-a0"}) == []
    # Same count trained, but one of them is another rollout's: slot 3 is lost all the same.
    assert lost_slots(4, published, {"r-s0-a0", "r-s1-a1", "r-s2-a0", "x-s3-a0"}) == [3]
    # An earlier attempt's id does not stand for the published one.
    assert lost_slots(4, published, {"r-s0-a0", "r-s1-a0", "r-s2-a0", "r-s3-a0"}) == [1]
    # A slot that was never published is lost, whatever else was trained.
    assert lost_slots(5, published, {t.trajectory_id for t in published}) == [4]


def test_a_step_that_compared_nothing_is_an_error() -> None:
    assert compared_nothing(3, 120) is None
    error = compared_nothing(3, 0)
    assert error is not None and "step 3" in error and "compared no log-probability" in error


def test_exact_share_reads_each_answer_as_scored(tokenizer: Tokenizer) -> None:
    wl = load_workload("math")
    tasks = wl.tasks(3, seed=0)
    im_end = tokenizer.token_to_id("<|im_end|>")
    assert im_end is not None

    def response(text: str) -> list[int]:
        return [*tokenizer.encode(text), im_end]  # the engine keeps the EOS in token_ids

    right = [
        traj(i, 0, t.id, response(f"Answer: {t.reference_answer}")) for i, t in enumerate(tasks)
    ]
    wrong = traj(3, 0, tasks[0].id, response(f"Answer: 1{tasks[0].reference_answer}"))
    assert exact_share(wl, right, tokenizer) == 1.0
    assert exact_share(wl, [*right, wrong], tokenizer) == 0.75
    assert exact_share(wl, [], tokenizer) is None


def test_a_correct_answer_scores_full_reward_and_a_wrong_one_the_checkers_value() -> None:
    task = load_workload("math").tasks(1, seed=0)[0]
    truth = task.reference_answer
    correct = score_answer(task, f"{truth} is it\nAnswer: {truth}")
    assert (correct.reward, correct.exact) == (1.0, True)
    wrong = score_answer(task, f"Answer: 1{truth}")  # reasoning-gym: len(oracle) / len(answer)
    assert wrong.exact is False and wrong.reward == pytest.approx(len(truth) / (len(truth) + 1))
    assert score_answer(task, "no answer here").exact is False
