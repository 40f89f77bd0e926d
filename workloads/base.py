"""The task API every workload speaks: a ``Task`` (prompt, optional sandbox, reward check,
limits), the ``Workload`` protocol the controller loads by name, and ``SandboxOps``, the few
sandbox calls scoring needs (``services.environment.client.EnvClient`` satisfies it
structurally; workloads never import a service).

Tasks are plain data (msgspec structs): they encode with ``msgspec.json``/``msgpack`` and hold
no callables; the reward *check* is data too (``AnswerCheck`` or ``HiddenTests``) and
``workloads.scoring`` evaluates it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Literal, Protocol, runtime_checkable

import msgspec

from common.errors import InvalidRequest, NotFound
from schemas.env import EnvCreated, EnvExecResult, SandboxLimits

Role = Literal["system", "user", "assistant"]
"""Chat roles a prompt may hold."""

TaskId = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{1,128}\Z")]
"""A task id: the ``schemas.base.Id`` characters (it may become part of a trajectory id)."""


class ChatMessage(msgspec.Struct, frozen=True, kw_only=True):
    """One chat turn of a prompt."""

    role: Role
    """``system``, ``user`` or ``assistant``."""
    content: str
    """The turn's text."""


class TaskLimits(msgspec.Struct, frozen=True, kw_only=True):
    """How far one trajectory of the task may go (the controller may lower these)."""

    max_turns: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 20
    """Most model responses (each one action) before the trajectory ends as ``max_turns``."""
    action_timeout_s: Annotated[float, msgspec.Meta(gt=0.0, le=3600.0)] = 30.0
    """Deadline of one agent command in the sandbox; past it the command is killed and the
    agent sees a timeout observation."""
    observation_chars: Annotated[int, msgspec.Meta(ge=64, le=1_000_000)] = 1000
    """An observation is cut to this many characters (the cut is marked)."""
    max_response_tokens: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 256
    """Most tokens the model may generate in one response."""


class SandboxSpec(msgspec.Struct, frozen=True, kw_only=True):
    """The sandbox a task runs in: an image, the task files and a setup command."""

    image: str
    """Docker image (built locally: ``deploy/install_env.sh``; no registry pulls)."""
    workdir: str = "/root/repo"
    """Absolute directory every agent command runs in (``workloads.actions.sandbox_command``);
    ``files`` are relative to it."""
    files: dict[str, bytes] = {}
    """Task files written into the sandbox at creation: path relative to ``workdir`` → bytes."""
    setup: str = ""
    """Shell command run once in ``workdir`` after creation, before the agent's first turn
    (empty: none); a non-zero exit fails the sandbox start."""
    setup_timeout_s: Annotated[float, msgspec.Meta(gt=0.0, le=3600.0)] = 120.0
    """Deadline of ``setup``."""
    limits: SandboxLimits = msgspec.field(
        default_factory=lambda: SandboxLimits(memory_mb=256, cpus=1.0, pids=128)
    )
    """Resource limits of the sandbox."""

    def absolute_files(self) -> dict[str, bytes]:
        """``files`` keyed by absolute sandbox path (what ``SandboxOps.create`` takes)."""
        base = self.workdir.rstrip("/")
        return {f"{base}/{rel}": data for rel, data in self.files.items()}


class AnswerCheck(msgspec.Struct, frozen=True, kw_only=True, tag="answer"):
    """Reward of a single-turn task: the final ``Answer: …`` line against a ground truth."""

    ground_truth: str
    """The expected answer."""
    checker: Literal["dapo", "reasoning_gym"] = "dapo"
    """``dapo``: 1.0 iff the normalised answer equals the normalised ground truth, else 0.0;
    ``reasoning_gym``: the generator's own ``score_answer`` (in [0, 1])."""
    dataset: str = ""
    """reasoning-gym generator name (``checker == "reasoning_gym"``)."""
    entry_json: str = ""
    """The reasoning-gym entry (question, answer, metadata) as JSON, passed to its checker."""


class HiddenTests(msgspec.Struct, frozen=True, kw_only=True, tag="tests"):
    """Reward of a sandbox task: tests the agent never sees, copied in and run after it
    finished; 1.0 iff every listed test passes, else 0.0."""

    fail_to_pass: list[str]
    """Test ids that fail before the fix and must pass after it."""
    pass_to_pass: list[str]
    """Test ids that pass before the fix and must still pass."""
    files: dict[str, bytes] = {}
    """Files written (over whatever the agent left) into the workdir just before the tests run:
    path relative to the workdir → bytes."""
    test_patch: str = ""
    """A unified diff applied with ``git apply`` in the sandbox before the tests run (SWE-bench
    images that hold their repository); empty: none."""
    command: str = ""
    """Test command run in the workdir; ``{tests}`` is replaced by the quoted test ids (else
    they are appended). Empty: ``workloads.scoring.DEFAULT_TEST_COMMAND``."""
    timeout_s: Annotated[float, msgspec.Meta(gt=0.0, le=3600.0)] = 120.0
    """Deadline of the test command; past it the reward is 0."""


RewardCheck = AnswerCheck | HiddenTests
"""What decides a task's reward."""


class Task(msgspec.Struct, frozen=True, kw_only=True):
    """One task: what the model is asked, where it acts, how it is scored."""

    id: TaskId
    """Unique within its workload; ``Workload.task(id)`` gives the task back."""
    workload: str
    """Name of the workload that made it (``load_workload(name)``)."""
    prompt: list[ChatMessage]
    """The chat the first model turn continues."""
    reward: RewardCheck
    """How the outcome is scored (``workloads.scoring``)."""
    sandbox: SandboxSpec | None = None
    """The sandbox the agent acts in; ``None``: single-turn, no actions."""
    limits: TaskLimits = msgspec.field(default_factory=TaskLimits)
    """Turn, time and size limits."""
    reference_actions: list[str] = []
    """Shell actions that solve a sandbox task (demonstrations; proof that it is solvable).
    The finishing ``submit`` is not among them."""
    reference_answer: str = ""
    """The answer a single-turn task expects (demonstrations)."""
    metadata: dict[str, str] = {}
    """Free-form provenance (source file, row, generator, instance id)."""


class Score(msgspec.Struct, frozen=True, kw_only=True):
    """A reward with what it was computed from."""

    reward: float
    """In [0, 1]."""
    answer: str | None = None
    """The parsed final answer (answer tasks; ``None``: no ``Answer:`` line)."""
    passed: list[str] = []
    """Test ids that passed (test tasks)."""
    failed: list[str] = []
    """Listed test ids that did not pass (failed, errored or never ran)."""
    detail: str = ""
    """Why the reward is what it is, in words (e.g. ``tests timed out``)."""
    exact: bool | None = None
    """Answer tasks: the parsed answer equals the reference after normalisation (exact-match
    accuracy, reported beside a reward that may give partial credit); ``None`` otherwise."""


class SandboxOps(Protocol):
    """The sandbox calls scoring and the runner make, with the arguments they always pass
    (``EnvClient`` has these methods; its defaults are its own)."""

    async def create(
        self,
        *,
        image: str,
        files: dict[str, bytes],
        limits: SandboxLimits,
        trajectory_id: str,
        sandbox_id: str,
    ) -> EnvCreated: ...

    async def exec(self, sandbox_id: str, command: str, timeout_s: float) -> EnvExecResult: ...

    async def destroy(self, sandbox_id: str) -> object: ...


@dataclass(frozen=True)
class SandboxHandle:
    """Outcome of a sandbox task for ``Workload.reward``: the sandbox the agent finished in."""

    ops: SandboxOps
    """How to reach it."""
    sandbox_id: str
    """Which sandbox."""
    trajectory_id: str = ""
    """The trajectory scored (empty: not a rollout's)."""
    response: str = ""
    """The model's final response text."""
    token_ids: tuple[int, ...] = ()
    """The token ids the model generated, every turn (observations left out)."""


class ResponseText(str):
    """An answer task's outcome as the controller hands it to ``Workload.reward``: the final
    response text — a ``str``, and read as one by every workload — that also carries the
    trajectory's id and the token ids the model generated (what a reward service is sent)."""

    trajectory_id: str
    token_ids: tuple[int, ...]

    def __new__(
        cls, text: str, *, token_ids: Sequence[int] = (), trajectory_id: str = ""
    ) -> ResponseText:
        self = super().__new__(cls, text)
        self.token_ids, self.trajectory_id = tuple(token_ids), trajectory_id
        return self


Outcome = str | SandboxHandle
"""What a finished trajectory is scored on: the final response text (answer tasks; the
controller passes a ``ResponseText``) or the sandbox it finished in (test tasks)."""


@runtime_checkable
class Workload(Protocol):
    """A task library: ``load_workload(name, **options)`` returns one."""

    name: str
    """The registry name."""

    def tasks(self, count: int, seed: int = 0) -> list[Task]:
        """``count`` training tasks, the same for the same (options, count, seed); never any of
        ``held_out``'s. ``InvalidRequest`` for ``count < 1`` or more than the workload has."""
        ...

    def held_out(self, count: int) -> list[Task]:
        """The first ``count`` tasks of the fixed evaluation set."""
        ...

    def task(self, task_id: str) -> Task:
        """The task with this id (training or held out); ``NotFound`` if there is none."""
        ...

    async def reward(self, task: Task, outcome: Outcome) -> float:
        """Score a finished trajectory (``workloads.scoring.score``)."""
        ...


def check_count(count: int, available: int | None = None, *, what: str = "tasks") -> None:
    """``InvalidRequest`` unless ``1 <= count`` (and ``count <= available`` when finite)."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise InvalidRequest(f"{what}: count must be a positive integer", count=count)
    if available is not None and count > available:
        raise InvalidRequest(
            f"{what}: asked for {count}, only {available} available",
            count=count,
            available=available,
        )


def find_task(tasks: list[Task], task_id: str, workload: str) -> Task:
    """The task with this id among ``tasks``; ``NotFound`` naming the workload otherwise."""
    for t in tasks:
        if t.id == task_id:
            return t
    raise NotFound("unknown task id", workload=workload, task_id=task_id)


def split_held_out(tasks: list[Task], held_out: int) -> tuple[list[Task], list[Task]]:
    """(training, evaluation): the last ``held_out`` tasks are held out (``-1``: a tenth, at
    least one when there are two or more). ``InvalidRequest`` if nothing is left to train on."""
    n = len(tasks)
    if isinstance(held_out, bool) or not isinstance(held_out, int) or held_out < -1:
        raise InvalidRequest("held_out must be an integer >= -1", held_out=held_out)
    if held_out == -1:
        held_out = n // 10 if n >= 10 else (1 if n >= 2 else 0)
    if held_out >= n:
        raise InvalidRequest("held_out must leave training rows", held_out=held_out, rows=n)
    return tasks[: n - held_out], tasks[n - held_out :]
