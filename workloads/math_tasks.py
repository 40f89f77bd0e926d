"""Math workloads (single-turn, no sandbox): ``math`` generates small arithmetic problems with
reasoning-gym's generators and scores them with its checkers; ``dapo`` reads a
DAPO-Math-17k-style file and scores with DAPO's answer convention (the last ``Answer: …``)."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common.errors import InvalidRequest, NotFound
from workloads.base import (
    AnswerCheck,
    Outcome,
    Task,
    TaskLimits,
    check_count,
    split_held_out,
)
from workloads.rows import read_rows, require_columns
from workloads.scoring import score
from workloads.table import RowTasks, chat_turn, math_chat

MATH_LIMITS = TaskLimits(
    max_turns=1, action_timeout_s=1.0, observation_chars=64, max_response_tokens=64
)
"""Single turn, short answers."""

HELD_OUT_SIZE = 256
"""Size of the fixed held-out set of the generated math workload."""

GENERATORS: dict[str, dict[str, Any]] = {
    "basic_arithmetic": {
        "min_terms": 3,
        "max_terms": 3,
        "operators": ("+", "-"),
        "allow_parentheses": False,
        "allow_negation": False,
    },
    "chain_sum": {"min_terms": 3, "max_terms": 3, "allow_negation": False},
}
"""reasoning-gym generators the ``math`` workload knows, with the settings that keep the
problems small (digits are set by the workload's ``max_digits``): three terms, so the warm
start answers about half of them at once and GRPO has groups of mixed rewards to learn
from (two terms: the warm start answers nearly all; docs/training.md)."""


_TASK_ID = re.compile(r"math-(?P<generator>[a-z_]+)-(?P<tag>h|t\d+)-(?P<index>\d+)")


def _seed(*parts: object) -> int:
    """A stable 31-bit seed from ``parts`` (reasoning-gym seeds item i with seed + i, so
    nearby seeds would share items: spread them out)."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFF_FFFF


class MathWorkload:
    """``math``: arithmetic from reasoning-gym (``basic_arithmetic``, ``chain_sum``), one-digit
    numbers by default (``max_digits``: up to 6) so the tiny warm-started model solves a useful
    fraction and GRPO has groups with differing rewards (docs/training.md).

    Task ids are ``math-<generator>-<t|h><seed>-<index>``: ``task(id)`` regenerates the task."""

    name = "math"

    def __init__(
        self,
        *,
        generators: Sequence[str] = ("basic_arithmetic", "chain_sum"),
        max_digits: int = 1,
    ) -> None:
        if isinstance(generators, str):
            generators = [generators]
        unknown = [g for g in generators if g not in GENERATORS]
        if unknown or not generators:
            raise InvalidRequest(
                "unknown math generator", unknown=unknown, known=sorted(GENERATORS)
            )
        if not isinstance(max_digits, int) or not 1 <= max_digits <= 6:
            raise InvalidRequest("max_digits must be an integer in 1..6", max_digits=max_digits)
        self.generators = list(generators)
        self.max_digits = max_digits
        self._datasets: dict[tuple[str, int], Any] = {}
        self._held: list[Task] | None = None
        self._held_questions: set[str] | None = None

    def _dataset(self, generator: str, seed: int) -> Any:
        key = (generator, seed)
        if key not in self._datasets:
            import reasoning_gym

            options = dict(GENERATORS[generator], min_digits=1, max_digits=self.max_digits)
            self._datasets[key] = reasoning_gym.create_dataset(
                generator, seed=seed, size=1_000_000, **options
            )
        return self._datasets[key]

    def _make(self, generator: str, tag: str, index: int) -> Task:
        ds = self._dataset(generator, _seed(generator, tag))
        entry = ds[index]
        return Task(
            id=f"math-{generator}-{tag}-{index}",
            workload=self.name,
            prompt=math_chat(entry["question"]),
            reward=AnswerCheck(
                ground_truth=str(entry["answer"]),
                checker="reasoning_gym",
                dataset=generator,
                entry_json=json.dumps(entry, default=list),
            ),
            limits=MATH_LIMITS,
            reference_answer=str(entry["answer"]),
            metadata={"generator": generator, "expression": str(entry["metadata"]["expression"])},
        )

    def _held_out_all(self) -> list[Task]:
        if self._held is None:
            n = len(self.generators)
            self._held = [
                self._make(self.generators[i % n], "h", i // n) for i in range(HELD_OUT_SIZE)
            ]
        return self._held

    def held_out(self, count: int) -> list[Task]:
        check_count(count, HELD_OUT_SIZE, what="math held-out tasks")
        return self._held_out_all()[:count]

    def tasks(self, count: int, seed: int = 0) -> list[Task]:
        check_count(count, None, what="math tasks")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise InvalidRequest("seed must be a non-negative integer", seed=seed)
        if self._held_questions is None:
            self._held_questions = {t.prompt[-1].content for t in self._held_out_all()}
        out: list[Task] = []
        index = 0
        while len(out) < count:
            for generator in self.generators:
                task = self._make(generator, f"t{seed}", index)
                if task.prompt[-1].content not in self._held_questions and len(out) < count:
                    out.append(task)
            index += 1
        return out

    def task(self, task_id: str) -> Task:
        m = _TASK_ID.fullmatch(task_id)
        if m and m["generator"] in self.generators:
            return self._make(m["generator"], m["tag"], int(m["index"]))
        raise NotFound("unknown task id", workload=self.name, task_id=task_id)

    async def reward(self, task: Task, outcome: Outcome) -> float:
        return (await score(task, outcome)).reward


DAPO_COLUMNS = ("prompt", "reward_model")
"""Columns a DAPO-style file must have (``reward_model.ground_truth`` inside)."""


class DapoWorkload(RowTasks):
    """``dapo``: a DAPO-Math-17k-style ``.parquet`` or ``.jsonl`` file. Each row: ``prompt`` (a
    list of ``{role, content}``), ``reward_model.ground_truth``; optional ``data_source``,
    ``extra_info``. The last ``held_out`` rows are the evaluation set (default: a tenth)."""

    name = "dapo"

    def __init__(self, *, path: str | Path, held_out: int = -1) -> None:
        self.path = Path(path)
        rows = read_rows(self.path)
        require_columns(rows, DAPO_COLUMNS, self.path)
        self.all = [self._task(i, row) for i, row in enumerate(rows)]
        self.train, self.evaluation = split_held_out(self.all, held_out)

    def _task(self, i: int, row: dict[str, Any]) -> Task:
        where = {"path": str(self.path), "row": i}
        prompt = row["prompt"]
        if isinstance(prompt, str):
            prompt = json.loads(prompt)
        if not isinstance(prompt, list) or not prompt:
            raise InvalidRequest("prompt must be a non-empty list of {role, content}", **where)
        try:
            messages = [chat_turn(turn) for turn in prompt]
        except ValueError as exc:
            raise InvalidRequest(f"prompt turn {exc}", **where) from None
        rm = row["reward_model"]
        if isinstance(rm, str):
            rm = json.loads(rm)
        if not isinstance(rm, dict) or rm.get("ground_truth") in (None, ""):
            raise InvalidRequest("missing column reward_model.ground_truth", **where)
        truth = str(rm["ground_truth"])
        extra = row.get("extra_info") or {}
        return self.row_task(
            i,
            messages,
            truth,
            {
                "data_source": str(row.get("data_source") or ""),
                "index": str(extra.get("index", "")) if isinstance(extra, dict) else "",
            },
        )
