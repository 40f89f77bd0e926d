"""Run a sandbox task for real through any ``SandboxOps`` (the environment service's
``EnvClient``): start its sandbox, run actions as the agent would, score with the hidden tests.
Used to prove every bundled task solvable and to record demonstrations with real
observations."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.errors import InvalidRequest, SandboxError, Timeout
from workloads.actions import format_observation, sandbox_command
from workloads.base import SandboxOps, SandboxSpec, Score, Task
from workloads.scoring import score_tests


@dataclass(frozen=True)
class Step:
    """One action and what it gave."""

    action: str
    """The agent's command."""
    stdout: str
    """Its standard output (the sandbox's cap applies)."""
    stderr: str
    """Its standard error."""
    exit_code: int
    """Exit status (-1 after a timeout)."""
    timed_out: bool
    """Killed at the task's action timeout."""
    truncated: bool
    """The sandbox capped the output."""
    observation: str
    """The next user turn, as the controller formats it (``format_observation``)."""


@dataclass
class Episode:
    """A task run start to end in one sandbox."""

    task_id: str
    """Which task."""
    sandbox_id: str
    """The sandbox it ran in (destroyed unless ``keep=True``)."""
    steps: list[Step] = field(default_factory=list)
    """The actions in order."""
    score: Score | None = None
    """The hidden-test score after the last action (``None`` if not scored)."""


def _spec(task: Task) -> SandboxSpec:
    if task.sandbox is None:
        raise InvalidRequest("task has no sandbox", task_id=task.id)
    return task.sandbox


async def open_sandbox(
    ops: SandboxOps, task: Task, *, sandbox_id: str = "", trajectory_id: str = ""
) -> str:
    """Create the task's sandbox (image, files, limits), run its setup; returns the sandbox id.
    ``SandboxError`` (and the sandbox destroyed) if the setup fails."""
    spec = _spec(task)
    created = await ops.create(
        image=spec.image,
        files=spec.absolute_files(),
        limits=spec.limits,
        trajectory_id=trajectory_id,
        sandbox_id=sandbox_id,
    )
    sid = created.sandbox_id
    if spec.setup:
        try:
            r = await ops.exec(
                sid, sandbox_command(spec.workdir, spec.setup), timeout_s=spec.setup_timeout_s
            )
        except BaseException:
            await ops.destroy(sid)
            raise
        if r.exit_code != 0:
            await ops.destroy(sid)
            raise SandboxError(
                "task setup failed", task_id=task.id, exit_code=r.exit_code, stderr=r.stderr[-500:]
            )
    return sid


async def run_action(ops: SandboxOps, task: Task, sandbox_id: str, command: str) -> Step:
    """Run one agent command in the task's workdir. Its own failure or timeout is an ordinary
    step; a sandbox or bus failure raises (infrastructure, for the caller to recover)."""
    spec = _spec(task)
    limit = task.limits.action_timeout_s
    try:
        r = await ops.exec(sandbox_id, sandbox_command(spec.workdir, command), timeout_s=limit)
    except Timeout as exc:
        if "subject" in exc.data:  # the bus timed out, not the command
            raise
        out = str(exc.data.get("stdout_tail", ""))
        obs = format_observation(
            out, "", -1, limit_chars=task.limits.observation_chars, timed_out=True, timeout_s=limit
        )
        return Step(command, out, "", -1, True, False, obs)
    obs = format_observation(
        r.stdout,
        r.stderr,
        r.exit_code,
        limit_chars=task.limits.observation_chars,
        truncated=r.truncated,
    )
    return Step(command, r.stdout, r.stderr, r.exit_code, False, r.truncated, obs)


async def run_episode(
    ops: SandboxOps,
    task: Task,
    actions: list[str] | None = None,
    *,
    keep: bool = False,
    trajectory_id: str = "",
) -> Episode:
    """Open the task's sandbox, run ``actions`` (default: its reference actions; ``[]``: the
    unfixed repository), then score it with the hidden tests. The sandbox is destroyed unless
    ``keep`` (then the hidden tests are in it: score only once the agent is done)."""
    sid = await open_sandbox(ops, task, trajectory_id=trajectory_id)
    episode = Episode(task_id=task.id, sandbox_id=sid)
    try:
        for command in task.reference_actions if actions is None else actions:
            episode.steps.append(await run_action(ops, task, sid, command))
        episode.score = await score_tests(ops, task, sid)
    finally:
        if not keep:
            await ops.destroy(sid)
    return episode
