"""Datasets as users keep them (``--dataset`` with ``--prompt-column``/``--answer-column``):
JSONL, Parquet and a real 🤗 ``datasets`` ``save_to_disk`` directory become ``table`` tasks
scored by the answer; a missing column is one error naming it, the dataset and the columns it
has; a mistyped cell, one naming the column and the row. DAPO files read as before."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common.errors import InvalidRequest, NotFound
from services.rl.options import RunOptions, check_options, choose_tasks, workload_spec
from workloads import AnswerCheck, Task, load_workload, score_answer
from workloads.actions import MATH_INSTRUCTION
from workloads.rewards import columns_of
from workloads.table import dataset_workload

DATA = Path(__file__).resolve().parents[2] / "workloads" / "data"
ROOT = Path(__file__).resolve().parents[2]


def qa_rows(count: int = 12) -> list[dict[str, Any]]:
    return [
        {"question": f"What is {i} + 1?", "answer": i + 1, "level": f"l{i % 3}"}
        for i in range(count)
    ]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def table(path: Path, **columns: str) -> Any:
    return load_workload("table", path=str(path), **columns)


def check_qa(w: Any) -> None:
    """What ``qa_rows`` become: the math chat, the answer as DAPO's ground truth."""
    t: Task = w.task("table-3")
    assert [(m.role, m.content) for m in t.prompt] == [
        ("system", MATH_INSTRUCTION),
        ("user", "What is 3 + 1?"),
    ]
    assert isinstance(t.reward, AnswerCheck)
    assert t.reward.ground_truth == "4" and t.reward.checker == "dapo"
    assert score_answer(t, "3 plus 1.\nAnswer: 4").reward == 1.0
    assert score_answer(t, "Answer: 5").reward == 0.0
    assert t.metadata["level"] == "l0" and "question" not in t.metadata
    assert columns_of(t)["level"] == ["l0"]  # extra columns reach reward functions
    assert len(w.tasks(11, seed=1)) == 11 and [h.id for h in w.held_out(1)] == ["table-11"]


def test_jsonl_with_named_columns(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "qa.jsonl", qa_rows())
    check_qa(table(path, prompt_column="question", answer_column="answer"))


def test_parquet_with_named_columns_and_chat_prompts(tmp_path: Path) -> None:
    path = tmp_path / "qa.parquet"
    pq.write_table(pa.Table.from_pylist(qa_rows()), path)
    check_qa(table(path, prompt_column="question"))  # answer: the default column
    chats = [
        {"q": [{"role": "user", "content": f"{i} * 2 = ?"}], "a": float(i * 2)} for i in range(4)
    ]
    pq.write_table(pa.Table.from_pylist(chats), path)
    t = table(path, prompt_column="q", answer_column="a").task("table-2")
    assert [(m.role, m.content) for m in t.prompt] == [("user", "2 * 2 = ?")]  # as it is
    assert t.reference_answer == "4"  # 4.0 → "4"


def test_a_save_to_disk_directory(tmp_path: Path) -> None:
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(qa_rows()).save_to_disk(str(saved))
    check_qa(table(saved, prompt_column="question"))
    # a DatasetDict: its train split (or its only split)
    both = tmp_path / "dict"
    d = datasets.DatasetDict(
        train=datasets.Dataset.from_list(qa_rows()),
        test=datasets.Dataset.from_list(qa_rows(3)),
    )
    d.save_to_disk(str(both))
    assert len(table(both, prompt_column="question").all) == 12
    only = tmp_path / "only"
    datasets.DatasetDict(test=datasets.Dataset.from_list(qa_rows(3))).save_to_disk(str(only))
    assert len(table(only, prompt_column="question").all) == 3
    two = tmp_path / "two"
    datasets.DatasetDict(
        a=datasets.Dataset.from_list(qa_rows(2)), b=datasets.Dataset.from_list(qa_rows(2))
    ).save_to_disk(str(two))
    with pytest.raises(InvalidRequest, match="without a train split") as exc:
        table(two, prompt_column="question")
    assert exc.value.data["splits"] == ["a", "b"]
    with pytest.raises(InvalidRequest, match="not a datasets save_to_disk directory"):
        table(tmp_path / "dict" / "..", prompt_column="question")


def test_dapo_files_read_as_before_and_as_a_table() -> None:
    w = load_workload("dapo", path=DATA / "dapo_sample.parquet")
    reward = w.task("dapo-3").reward
    assert isinstance(reward, AnswerCheck) and reward.ground_truth
    t = table(DATA / "dapo_sample.parquet", answer_column="reward_model.ground_truth")
    d = w.task("dapo-0")
    assert t.task("table-0").prompt == d.prompt  # a chat prompt is used as it is
    assert t.task("table-0").reference_answer == d.reference_answer


def test_a_missing_column_names_it_the_dataset_and_the_columns(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "qa.jsonl", qa_rows())
    with pytest.raises(InvalidRequest) as exc:
        table(path, prompt_column="q", answer_column="answer")
    text = str(exc.value)
    assert "no prompt column 'q'" in text and "its columns: question, answer, level" in text
    assert exc.value.data["path"] == str(path)
    with pytest.raises(InvalidRequest, match="no answer column 'solution'"):
        table(path, prompt_column="question", answer_column="solution")
    with pytest.raises(InvalidRequest, match="no prompt column 'prompt'"):  # the default
        table(path)
    with pytest.raises(NotFound):
        table(tmp_path / "absent.jsonl", prompt_column="question")


@pytest.mark.parametrize(
    ("row", "words"),
    [
        ({"question": "1+1?", "answer": [2]}, "column 'answer', row 5: an answer is"),
        ({"question": "1+1?", "answer": True}, "column 'answer', row 5: an answer is"),
        ({"question": "1+1?", "answer": " "}, "column 'answer', row 5: an answer is"),
        ({"question": "1+1?", "answer": None}, "column 'answer' is empty in row 5"),
        ({"question": "1+1?"}, "column 'answer' is empty in row 5"),
        ({"question": 7, "answer": "2"}, "column 'question', row 5: a prompt is"),
        ({"question": [], "answer": "2"}, "column 'question', row 5: a prompt is"),
        ({"question": [{"role": "bot", "content": "hi"}], "answer": "2"}, "row 5: every turn"),
    ],
)
def test_a_mistyped_cell_names_the_column_and_the_row(
    tmp_path: Path, row: dict[str, Any], words: str
) -> None:
    rows: list[dict[str, Any]] = qa_rows(8)
    rows[5] = {**row, "level": "x"}
    path = write_jsonl(tmp_path / "qa.jsonl", rows)
    with pytest.raises(InvalidRequest, match=words.replace("+", r"\+")) as exc:
        table(path, prompt_column="question")
    assert exc.value.data["path"] == str(path)


def test_which_workload_a_dataset_and_columns_select(tmp_path: Path) -> None:
    assert dataset_workload("math", "", "", "") == ("math", {})
    assert dataset_workload("dapo", "f.jsonl") == ("dapo", {"path": "f.jsonl"})
    assert dataset_workload("math", "f.jsonl", "q", "a") == (
        "table",
        {"path": "f.jsonl", "prompt_column": "q", "answer_column": "a"},
    )
    assert dataset_workload("dapo", "f.jsonl", "", "a")[0] == "table"
    assert dataset_workload("my.pkg:make", "f.jsonl", "q")[0] == "my.pkg:make"  # a plugin's own
    with pytest.raises(InvalidRequest, match="name columns of --dataset"):
        dataset_workload("math", "", "q", "")
    with pytest.raises(InvalidRequest, match="not swe-gym instances"):
        dataset_workload("swe-gym", "f.jsonl", "q", "a")
    # belayer run: math's dataset is dapo, or a table when columns are named
    path = write_jsonl(tmp_path / "qa.jsonl", qa_rows())
    assert workload_spec("math", str(path)) == ("dapo", {"path": str(path.resolve())})
    assert workload_spec("math", str(path), "question", "answer")[0] == "table"
    pool, held, sandboxed = choose_tasks(
        "math", str(path), 4, 2, 1, 0, columns=("question", "answer")
    )
    assert len(pool) == 8 and all(t.startswith("table-") for t in pool + held)
    assert held == ["table-11"] and not sandboxed
    with pytest.raises(InvalidRequest, match="no prompt column 'q'"):
        choose_tasks("math", str(path), 4, 2, 1, 0, columns=("q", "answer"))
    # math's default 64 held-out tasks: a small dataset's held-out rows, unless asked for
    cols = ("question", "answer")
    _, held, _ = choose_tasks("math", str(path), 4, 2, 64, 0, cols, held_out_is_default=True)
    assert held == ["table-11"]
    with pytest.raises(InvalidRequest, match=r"--held-out: .*only 1 available"):
        choose_tasks("math", str(path), 4, 2, 64, 0, cols)
    with pytest.raises(InvalidRequest, match="name columns of --dataset"):
        check_options(RunOptions(workload="math", steps=1, prompt_column="q"))
    with pytest.raises(InvalidRequest, match="not swe-gym instances"):
        check_options(RunOptions(workload="swe", steps=1, dataset=str(path), answer_column="a"))


def belayer(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "services.cli.main", *args],
        capture_output=True, text=True, timeout=120, check=False, cwd=cwd, env=env,
    )  # fmt: skip


def test_the_cli_takes_the_columns_and_refuses_bad_ones_in_one_line(tmp_path: Path) -> None:
    for command in ("run", "rollout"):
        shown = belayer(command, "--help", cwd=tmp_path)
        assert shown.returncode == 0
        assert "--prompt-column" in shown.stdout and "--answer-column" in shown.stdout
    path = write_jsonl(tmp_path / "qa.jsonl", qa_rows())
    proc = belayer(
        "run", "math", "--dataset", str(path), "--prompt-column", "q", "--answer-column",
        "answer", "--out", str(tmp_path / "r"), "--run-dir", str(tmp_path / "node"), cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert "no prompt column 'q'" in lines[0] and "question, answer, level" in lines[0]
    assert str(path) in lines[0]
    assert not (tmp_path / "r").exists() and not (tmp_path / "node").exists()  # nothing started
    proc = belayer("rollout", "math", "--prompt-column", "q", cwd=tmp_path)  # no node needed
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "name columns of --dataset" in proc.stderr
