"""An example Belayer workload plugin: "say the word in capital letters".

A complete plugin is one factory returning an object with ``name``, ``tasks``, ``held_out``,
``task`` and ``reward`` (the ``workloads.Workload`` protocol, docs/workloads.md "Your own
workload"). Use it without installing anything::

    PYTHONPATH=examples/plugin belayer up --workload-plugin belayer_example_tasks:make
    PYTHONPATH=examples/plugin belayer rollout --workload belayer_example_tasks:make ...
    PYTHONPATH=examples/plugin belayer run --workload belayer_example_tasks:make --steps 2

``make_judged`` is the same workload declaring a reward service (``rewards``) instead.

or install this directory (``pip install examples/plugin``): its ``pyproject.toml`` declares
the entry point ``capitals`` in the group ``belayer.workloads``, so every service finds it by
that name with no listing.
"""

from __future__ import annotations

import random

from common.errors import InvalidRequest, NotFound
from workloads import AnswerCheck, ChatMessage, Outcome, Task, TaskLimits, score

WORDS = (
    "apple bread cloud dance eagle flame grape house input jelly knife lemon mouse night ocean "
    "piano queen river stone tiger under voice water xenon yacht zebra"
).split()
"""The vocabulary tasks are drawn from; the last eight words are held out."""
HELD_OUT = WORDS[-8:]
LIMITS = TaskLimits(max_turns=1, action_timeout_s=1.0, observation_chars=64, max_response_tokens=16)
INSTRUCTION = "Repeat the word in capital letters. End with a line 'Answer: <WORD>'."


class Capitals:
    """``capitals``: one-turn tasks scored by exact match of the ``Answer:`` line."""

    name = "capitals"
    run_defaults = {"tasks": 4, "n": 4, "held_out": 8, "lr": 2e-4}
    """Optional: ``belayer run --workload``'s defaults for this workload (tasks per step,
    samples per task, held-out tasks, peak learning rate); a flag given wins."""

    def __init__(self, *, held_out_words: int = len(HELD_OUT)) -> None:
        if not 1 <= held_out_words <= len(HELD_OUT):
            raise InvalidRequest("held_out_words must be in 1..8", held_out_words=held_out_words)
        self.held = HELD_OUT[:held_out_words]
        self.train = [w for w in WORDS if w not in HELD_OUT]

    def _task(self, tag: str, word: str) -> Task:
        return Task(
            id=f"cap-{tag}-{word}",
            workload=self.name,
            prompt=[
                ChatMessage(role="system", content=INSTRUCTION),
                ChatMessage(role="user", content=word),
            ],
            reward=AnswerCheck(ground_truth=word.upper(), checker="dapo"),
            limits=LIMITS,
            reference_answer=word.upper(),
            metadata={"word": word},
        )

    def tasks(self, count: int, seed: int = 0) -> list[Task]:
        if count < 1:
            raise InvalidRequest("count must be positive", count=count)
        rng = random.Random(seed)
        return [self._task(f"t{seed}x{i}", rng.choice(self.train)) for i in range(count)]

    def held_out(self, count: int) -> list[Task]:
        return [self._task("h", w) for w in self.held[:count]]

    def task(self, task_id: str) -> Task:
        parts = task_id.split("-")
        if len(parts) == 3 and parts[0] == "cap" and parts[2] in WORDS:
            return self._task(parts[1], parts[2])
        raise NotFound("unknown task id", workload=self.name, task_id=task_id)

    async def reward(self, task: Task, outcome: Outcome) -> float:
        return (await score(task, outcome)).reward


def make(*, held_out_words: int = len(HELD_OUT)) -> Capitals:
    """The factory Belayer calls (``belayer_example_tasks:make``) with the workload options
    (keyword-only, so an unknown option is one clear error before anything starts)."""
    return Capitals(held_out_words=held_out_words)


class JudgedCapitals(Capitals):
    """``capitals`` scored by a reward service on the bus instead of its own ``reward``."""

    def __init__(self, *, service: str, held_out_words: int) -> None:
        super().__init__(held_out_words=held_out_words)
        self.rewards = [f"service:{service}"]
        """Optional: the reward services (``service:<name>``) that score this workload's
        trajectories when a rollout or run names no ``--reward`` (docs/protocol.md §5.1)."""


def make_judged(*, service: str = "exact", held_out_words: int = len(HELD_OUT)) -> Capitals:
    """``belayer_example_tasks:make_judged``: the same tasks, scored by the reward service
    ``belayer.reward.<service>`` (e.g. ``tests/integration/reward_service.mjs``)."""
    return JudgedCapitals(service=service, held_out_words=held_out_words)
