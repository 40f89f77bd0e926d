"""The math workloads: reasoning-gym generation is deterministic by seed and disjoint from the
held-out set; DAPO's answer convention; the DAPO loader on the shipped files and on bad ones."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common.errors import InvalidRequest, NotFound
from workloads import AnswerCheck, Task, load_workload, score_answer
from workloads.scoring import normalize_answer

DATA = Path(__file__).resolve().parents[2] / "workloads" / "data"


def test_generation_is_deterministic_by_seed_and_never_held_out() -> None:
    a = load_workload("math").tasks(40, seed=3)
    b = load_workload("math").tasks(40, seed=3)
    c = load_workload("math").tasks(40, seed=4)
    assert [msgspec.json.encode(t) for t in a] == [msgspec.json.encode(t) for t in b]
    assert [t.prompt for t in a] != [t.prompt for t in c]
    assert len({t.id for t in a}) == 40
    assert {t.metadata["generator"] for t in a} == {"basic_arithmetic", "chain_sum"}
    held = {t.prompt[-1].content for t in load_workload("math").held_out(256)}
    assert not held & {t.prompt[-1].content for t in a + c}
    for t in a:
        assert t.sandbox is None and t.limits.max_turns == 1
        assert all(
            abs(int(n)) <= 100
            for n in t.metadata["expression"].replace("-", " ").split()
            if n.isdigit()
        )


def test_task_id_round_trips_and_unknown_ids_are_not_found() -> None:
    w = load_workload("math")
    for t in w.tasks(5, seed=9) + w.held_out(3):
        assert w.task(t.id) == t
    for bad in ("math-nope-t1-0", "math-chain_sum-x-0", "dapo-1", ""):
        with pytest.raises(NotFound):
            w.task(bad)


def test_reasoning_gym_checker_scores_the_final_answer_line() -> None:
    task = load_workload("math").tasks(1, seed=0)[0]
    right = task.reference_answer
    assert score_answer(task, f"Let me add.\nAnswer: {right}").reward == 1.0
    assert score_answer(task, f"Answer: {int(right) + 1}\n").reward == 0.0
    assert score_answer(task, f"I think it is {right}.").reward == 0.0  # no Answer: line


@pytest.mark.parametrize(
    ("response", "parsed", "reward"),
    [
        ("17 + 25 = 42\nAnswer: 42", "42", 1.0),
        ("Answer: 41\nwait, no.\nAnswer: 42", "42", 1.0),  # the last one counts
        ("answer:   $42$.", "$42$.", 1.0),  # case, TeX dollars, final period
        ("Answer: \\boxed{42}", "\\boxed{42}", 1.0),
        ("Answer: x = 42", "x = 42", 1.0),
        ("Answer: 43", "43", 0.0),
        ("The answer is 42", None, 0.0),  # missing
        ("Answer:\n42", None, 0.0),  # malformed: nothing after the colon
        ("", None, 0.0),
    ],
)
def test_dapo_answer_convention(response: str, parsed: str | None, reward: float) -> None:
    task = load_workload("dapo", path=DATA / "dapo_sample.jsonl").task("dapo-0")
    assert task.reference_answer == "42"
    score = score_answer(task, response)
    assert (score.answer, score.reward) == (parsed, reward)


def test_normalisation() -> None:
    assert normalize_answer("1,024") == "1024"
    assert normalize_answer("\\text{12 cm}") == "12"
    assert normalize_answer("+5") == "5"
    assert normalize_answer("\\frac{1}{2}") == "\\frac{1}{2}"
    assert normalize_answer("1,2") == "1,2"  # a list, not a thousands separator


@pytest.mark.parametrize("name", ["dapo_sample.jsonl", "dapo_sample.parquet"])
def test_dapo_loader_on_the_shipped_files(name: str) -> None:
    w = load_workload("dapo", path=DATA / name)
    assert len(w.tasks(11)) == 11 and len(w.held_out(1)) == 1  # 12 rows: the last is held out
    held = w.held_out(1)[0]
    assert held.id == "dapo-11" and held not in w.tasks(11, seed=5)
    t = w.task("dapo-3")
    assert t.prompt[0].role == "user" and "Answer:" in t.prompt[0].content
    assert isinstance(t.reward, AnswerCheck) and t.reward.ground_truth == "180"
    assert w.tasks(5, seed=1) == w.tasks(5, seed=1) != w.tasks(5, seed=2)
    assert isinstance(msgspec.json.decode(msgspec.json.encode(t), type=Task), Task)


def test_shipped_jsonl_and_parquet_hold_the_same_tasks() -> None:
    a = load_workload("dapo", path=DATA / "dapo_sample.jsonl")
    b = load_workload("dapo", path=DATA / "dapo_sample.parquet")
    assert [(t.prompt, t.reward) for t in a.all] == [(t.prompt, t.reward) for t in b.all]  # type: ignore[attr-defined]  # all: DapoWorkload only


def _rows() -> list[dict[str, object]]:
    return [json.loads(line) for line in (DATA / "dapo_sample.jsonl").read_text().splitlines()]


def test_dapo_file_with_a_missing_column_is_a_clear_error(tmp_path: Path) -> None:
    rows = _rows()
    for r in rows:
        del r["reward_model"]
    jsonl = tmp_path / "bad.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(InvalidRequest, match="reward_model") as exc:
        load_workload("dapo", path=jsonl)
    assert exc.value.data["missing"] == ["reward_model"]
    parquet = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    with pytest.raises(InvalidRequest, match="reward_model"):
        load_workload("dapo", path=parquet)
    rows = _rows()
    rows[2]["reward_model"] = {"style": "rule"}  # no ground_truth inside
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(InvalidRequest, match="ground_truth") as exc:
        load_workload("dapo", path=jsonl)
    assert exc.value.data["row"] == 2


def test_bad_files_and_options_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(NotFound):
        load_workload("dapo", path=tmp_path / "absent.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": []}\nnot json\n')
    with pytest.raises(InvalidRequest, match="malformed JSON line") as exc:
        load_workload("dapo", path=bad)
    assert exc.value.data["line"] == 2
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(InvalidRequest, match="jsonl"):
        load_workload("dapo", path=tmp_path / "x.csv")
    with pytest.raises(InvalidRequest, match="missing workload option"):
        load_workload("dapo")
    with pytest.raises(InvalidRequest, match="unknown workload option"):
        load_workload("math", digits=3)
    with pytest.raises(InvalidRequest, match="generator"):
        load_workload("math", generators=["calculus"])
    with pytest.raises(NotFound, match="unknown workload"):
        load_workload("chess")


@pytest.mark.parametrize("count", [0, -1, True])
def test_non_positive_counts_are_invalid(count: int) -> None:
    with pytest.raises(InvalidRequest, match="count"):
        load_workload("math").tasks(count)
    with pytest.raises(InvalidRequest, match="count"):
        load_workload("dapo", path=DATA / "dapo_sample.jsonl").held_out(count)


def test_more_tasks_than_a_file_holds_is_invalid() -> None:
    with pytest.raises(InvalidRequest, match="only 11 available"):
        load_workload("dapo", path=DATA / "dapo_sample.jsonl").tasks(12)
