"""``table``: a plain table of prompts and answers, as users keep their datasets (a ``.jsonl``,
``.json`` or ``.parquet`` file or a 🤗 ``datasets`` ``save_to_disk`` directory), with the
prompt and answer in columns they name (``--prompt-column``, ``--answer-column``).

A prompt that is a string becomes the math chat (the ``math`` workload's system instruction,
then the string as the user's turn); a list of ``{role, content}`` is the chat as it is. The
answer (a string or a number) is the ground truth of DAPO's answer check (the normalised last
``Answer:`` line equals the normalised answer). Every other column of the row is the task's
metadata, so it reaches a reward function as a keyword argument (``workloads.rewards``).
A column missing from the dataset is one error naming it, the dataset and the columns it has;
a value of the wrong type, one error naming the column and the row."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

from common.errors import InvalidRequest
from workloads.actions import MATH_INSTRUCTION
from workloads.base import (
    AnswerCheck,
    ChatMessage,
    Outcome,
    Task,
    TaskLimits,
    check_count,
    find_task,
    split_held_out,
)
from workloads.rows import column_names, read_rows
from workloads.scoring import score

PROMPT_COLUMN = "prompt"
"""The prompt column when none is named."""
ANSWER_COLUMN = "answer"
"""The answer column when none is named."""
TABLE_LIMITS = TaskLimits(max_turns=1, max_response_tokens=1024)
"""Single turn, answers up to 1024 tokens (``table`` and ``dapo`` tasks)."""
ROLES = ("system", "user", "assistant")
MATH_STYLE = ("math", "dapo", "table")
"""Workloads whose ``--dataset`` naming columns is read by ``table``."""
SANDBOXED = ("swe", "swe-bundled", "swe-gym")


class RowTasks:
    """A workload over rows read once (``table``, ``dapo``): ``all`` of them, the ``train``
    rows (``tasks`` shuffles them by seed) and the held-out ``evaluation`` rows; each task
    scored by its answer check."""

    name: str
    path: Path
    all: list[Task]
    train: list[Task]
    evaluation: list[Task]

    def tasks(self, count: int, seed: int = 0) -> list[Task]:
        check_count(count, len(self.train), what=f"{self.name} tasks")
        order = list(self.train)
        random.Random(seed).shuffle(order)
        return order[:count]

    def held_out(self, count: int) -> list[Task]:
        check_count(count, len(self.evaluation), what=f"{self.name} held-out tasks")
        return self.evaluation[:count]

    def task(self, task_id: str) -> Task:
        return find_task(self.all, task_id, self.name)

    async def reward(self, task: Task, outcome: Outcome) -> float:
        return (await score(task, outcome)).reward

    def row_task(
        self, i: int, prompt: list[ChatMessage], truth: str, metadata: dict[str, str]
    ) -> Task:
        """Row ``i``'s single-turn task, id ``<name>-<i>``, scored by DAPO's answer check; its
        metadata is the file and the row, then ``metadata``."""
        return Task(
            id=f"{self.name}-{i}",
            workload=self.name,
            prompt=prompt,
            reward=AnswerCheck(ground_truth=truth, checker="dapo"),
            limits=TABLE_LIMITS,
            reference_answer=truth,
            metadata={"source": str(self.path), "row": str(i), **metadata},
        )


class TableWorkload(RowTasks):
    """``table``: one single-turn task per row (module doc). Task ids are ``table-<row>`` (rows
    count from 0); the last ``held_out`` rows are the evaluation set (default: a tenth)."""

    name = "table"

    def __init__(
        self,
        *,
        path: str | Path,
        prompt_column: str = PROMPT_COLUMN,
        answer_column: str = ANSWER_COLUMN,
        held_out: int = -1,
    ) -> None:
        self.path = Path(path)
        for option, value in (("prompt_column", prompt_column), ("answer_column", answer_column)):
            if not isinstance(value, str) or not value:
                raise InvalidRequest(f"{option} must be a column name", **{option: value})
        self.prompt_column, self.answer_column = prompt_column, answer_column
        rows = read_rows(self.path)
        present = column_names(rows)
        for what, column in (("prompt", prompt_column), ("answer", answer_column)):
            if column_path(column, present) is None:
                raise InvalidRequest(
                    f"dataset has no {what} column {column!r}; its columns: {', '.join(present)}",
                    path=str(self.path),
                )
        try:
            self.all = [self._task(i, row) for i, row in enumerate(rows)]
        except InvalidRequest as exc:  # a cell of the wrong type: name the dataset too
            raise InvalidRequest(exc.message, path=str(self.path), **exc.data) from None
        self.train, self.evaluation = split_held_out(self.all, held_out)

    def _task(self, i: int, row: dict[str, Any]) -> Task:
        prompt = to_messages(cell(row, self.prompt_column, i), self.prompt_column, i)
        truth = to_answer(cell(row, self.answer_column, i), self.answer_column, i)
        used = {
            (column_path(c, list(row)) or [c])[0] for c in (self.prompt_column, self.answer_column)
        }
        others = {
            str(k): v if isinstance(v, str) else json.dumps(v, default=str)
            for k, v in row.items()
            if k not in used and v is not None
        }
        return self.row_task(i, prompt, truth, others)


def column_path(column: str, present: list[str]) -> list[str] | None:
    """The keys that reach ``column`` among ``present``: itself, or (``a.b``, when there is no
    column of that full name) column ``a`` then key ``b``; None when its column is absent."""
    if column in present:
        return [column]
    head, _, rest = column.partition(".")
    if rest and head in present:
        return [head, *rest.split(".")]
    return None


def cell(row: dict[str, Any], column: str, i: int) -> Any:
    """Row ``i``'s value of ``column`` (``a.b``: key ``b`` of column ``a``'s object)."""
    value: Any = row
    for key in column_path(column, list(row)) or [column]:
        if not isinstance(value, dict) or value.get(key) is None:
            raise InvalidRequest(f"column {column!r} is empty in row {i}")
        value = value[key]
    return value


def mistyped(column: str, row: int, expected: str, value: Any) -> InvalidRequest:
    return InvalidRequest(
        f"column {column!r}, row {row}: {expected}, not {type(value).__name__}",
        value=repr(value)[:80],
    )


def to_messages(value: Any, column: str, row: int) -> list[ChatMessage]:
    """A prompt cell as the task's chat (module doc)."""
    expected = "a prompt is a non-empty string or a list of {role, content}"
    if isinstance(value, str):
        if not value.strip():
            raise mistyped(column, row, expected, value)
        return math_chat(value)
    if not isinstance(value, list | tuple) or not value:
        raise mistyped(column, row, expected, value)
    messages = []
    for turn in value:
        try:
            messages.append(chat_turn(turn))
        except ValueError:
            raise mistyped(
                column, row, "every turn needs a role system|user|assistant and a string content",
                turn,
            ) from None  # fmt: skip
    return messages


def math_chat(question: str) -> list[ChatMessage]:
    """The math chat of ``question``: the ``math`` workloads' system instruction, then the
    question as the user's turn (``math`` and ``table`` prompts)."""
    return [
        ChatMessage(role="system", content=MATH_INSTRUCTION),
        ChatMessage(role="user", content=question),
    ]


def chat_turn(turn: Any) -> ChatMessage:
    """One ``{role, content}`` turn of a dataset's prompt (``table`` and ``dapo`` rows);
    ``ValueError`` saying what it lacks (``needs a role …`` or ``needs a string content``)."""
    if not isinstance(turn, dict) or turn.get("role") not in ROLES:
        raise ValueError("needs a role system|user|assistant")
    if not isinstance(turn.get("content"), str):
        raise ValueError("needs a string content")
    return ChatMessage(role=turn["role"], content=turn["content"])


def to_answer(value: Any, column: str, row: int) -> str:
    """An answer cell as the ground truth: a non-empty string or a finite number."""
    expected = "an answer is a non-empty string or a number"
    if isinstance(value, str) and value.strip():
        return value.strip()
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, float) and math.isfinite(value):
        return str(int(value)) if value.is_integer() else repr(value)
    raise mistyped(column, row, expected, value)


def dataset_workload(
    workload: str, dataset: str, prompt_column: str = "", answer_column: str = ""
) -> tuple[str, dict[str, Any]]:
    """The workload and options a request names with a dataset and columns: named columns read
    a ``math``/``dapo``/``table`` dataset as a ``table`` (a plugin gets them as its
    ``prompt_column``/``answer_column`` options); ``InvalidRequest`` for columns without a
    dataset or for a sandbox workload."""
    options: dict[str, Any] = {"path": dataset} if dataset else {}
    if not (prompt_column or answer_column):
        return workload, options
    if not dataset:
        raise InvalidRequest("--prompt-column and --answer-column name columns of --dataset")
    if workload in SANDBOXED:
        raise InvalidRequest(
            "--prompt-column and --answer-column read prompt/answer tables (math), "
            f"not {workload} instances"
        )
    if prompt_column:
        options["prompt_column"] = prompt_column
    if answer_column:
        options["answer_column"] = answer_column
    return ("table" if workload in MATH_STYLE else workload), options
