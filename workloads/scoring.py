"""Rewards: the final ``Answer:`` of a single-turn task (DAPO's convention or a reasoning-gym
checker) and the hidden tests of a sandbox task (copied in after the agent finished, run,
every listed test must pass).

A hidden-test run that cannot finish because of the *sandbox* (container dead, environment
service gone) raises the service's error: that is an infrastructure failure for the caller to
recover from, never a reward of 0.
"""

from __future__ import annotations

import base64
import functools
import json
import re
import shlex
from typing import Any

from common.errors import InvalidRequest, Timeout
from schemas.env import EnvExecResult
from workloads.actions import parse_answer, sandbox_command
from workloads.base import (
    AnswerCheck,
    HiddenTests,
    Outcome,
    SandboxHandle,
    SandboxOps,
    Score,
    Task,
)

DEFAULT_TEST_COMMAND = (
    "python3 -m pytest -p no:cacheprovider -q --color=no --tb=line -rfEsp {tests}"
)
"""Test command of a task that names none: pytest with a one-line summary per test
(``PASSED id`` / ``FAILED id``), which ``parse_test_results`` reads."""

FRESH_BYTECODE = 'export PYTHONPYCACHEPREFIX="$(mktemp -d /tmp/belayer-pycache.XXXXXX)"\n'
"""Run before the hidden tests: Python compiles into a fresh directory and ignores the
``__pycache__`` the agent's own runs left, which is stale after a same-size edit within the
same second (bytecode is checked by source mtime and size): the tests see the files as they
are."""

WRITE_CHUNK = 48 * 1024
"""Bytes of a file written per ``exec`` (base64 grows it by a third; one argument of a
command line may hold at most 128 KiB)."""

# --- answers -------------------------------------------------------------------------------

_TEX_WRAPPERS = re.compile(r"\\(?:text|textbf|mathrm|mbox|boxed|overline)\{([^{}]*)\}")
_UNITS = re.compile(
    r"\b(?:units?|degrees?|cm|km|meters?|feet|inches|hours?|minutes?|dollars?|cents?|points?|ways)\b"
)


def normalize_answer(answer: str) -> str:
    """DAPO-style normalisation of a final answer so equal values compare equal: the part after
    the last ``=``, TeX wrappers (``\\boxed{}``, ``\\text{}``, ``$``) and trailing unit words
    removed, spaces and a final period dropped, thousands separators of integers removed."""
    s = answer.split("=")[-1]
    s = s.replace("\\$", "").replace("$", "").replace("\\!", "").replace("\\,", "")
    for _ in range(3):
        s = _TEX_WRAPPERS.sub(r"\1", s)
    s = _UNITS.sub("", s)
    s = (
        s.replace("\\left", "")
        .replace("\\right", "")
        .replace("^\\circ", "")
        .replace("^{\\circ}", "")
    )
    s = re.sub(r"\s+", "", s).rstrip(".")
    if re.fullmatch(r"[+-]?\d{1,3}(,\d{3})+", s):
        s = s.replace(",", "")
    if re.fullmatch(r"\+\d+(\.\d+)?", s):
        s = s[1:]
    return s


@functools.cache
def _rg_dataset(name: str) -> Any:
    import reasoning_gym

    return reasoning_gym.create_dataset(name, size=1, seed=0)


def score_answer(task: Task, response: str) -> Score:
    """Reward of a single-turn task from the model's response text (the text it meant: no
    special tokens, ``GenerateResult.text``), with its exact match beside it."""
    check = task.reward
    if not isinstance(check, AnswerCheck):
        raise InvalidRequest("task is not scored by its answer", task_id=task.id)
    answer = parse_answer(response)
    if answer is None:
        return Score(reward=0.0, answer=None, detail="no 'Answer:' line", exact=False)
    exact = normalize_answer(answer) == normalize_answer(check.ground_truth)
    if check.checker == "reasoning_gym":
        entry = json.loads(check.entry_json)
        value = float(_rg_dataset(check.dataset).score_answer(answer.rstrip(". "), entry))
        reward = max(0.0, min(1.0, value))
        return Score(reward=reward, answer=answer, detail="reasoning_gym", exact=exact)
    return Score(
        reward=1.0 if exact else 0.0,
        answer=answer,
        detail="match" if exact else "mismatch",
        exact=exact,
    )


def exact_match(task: Task, response: str) -> bool | None:
    """Whether ``response``'s final answer equals the task's reference (answer tasks; ``None``
    for a task scored otherwise): the exact-match accuracy reported beside the reward."""
    if not isinstance(task.reward, AnswerCheck):
        return None
    return score_answer(task, response).exact


# --- hidden tests --------------------------------------------------------------------------

_RESULT = re.compile(r"^(PASSED|FAILED|ERROR|XPASS|XFAIL)\s+(\S+)", re.M)


def parse_test_results(output: str) -> dict[str, str]:
    """Test id → ``PASSED``/``FAILED``/``ERROR``/… from pytest's short summary (``-r``)."""
    results: dict[str, str] = {}
    for status, test_id in _RESULT.findall(output):
        if test_id not in results or results[test_id] in ("PASSED", "XPASS"):
            results[test_id] = status  # an error in teardown after a pass is not a pass
    return results


def write_file_commands(files: dict[str, bytes]) -> list[str]:
    """Shell commands that write ``files`` (paths relative to the working directory or
    absolute) with ``base64 -d``, a chunk per command, creating parent directories."""
    commands = []
    for path, data in sorted(files.items()):
        q = shlex.quote(path)
        parent = path.rsplit("/", 1)[0] if "/" in path else ""
        prefix = f"mkdir -p {shlex.quote(parent)} && " if parent else ""
        chunks = [data[i : i + WRITE_CHUNK] for i in range(0, len(data), WRITE_CHUNK)] or [b""]
        for n, chunk in enumerate(chunks):
            b64 = base64.b64encode(chunk).decode()
            redirect = ">" if n == 0 else ">>"
            commands.append(
                f"{prefix if n == 0 else ''}printf %s '{b64}' | base64 -d {redirect} {q}"
            )
    return commands


def command_for_tests(check: HiddenTests) -> str:
    """The shell command that runs the task's listed tests."""
    ids = " ".join(shlex.quote(t) for t in [*check.fail_to_pass, *check.pass_to_pass])
    template = check.command or DEFAULT_TEST_COMMAND
    return template.replace("{tests}", ids) if "{tests}" in template else f"{template} {ids}"


async def _run(
    ops: SandboxOps, sandbox_id: str, workdir: str, command: str, timeout_s: float
) -> EnvExecResult:
    return await ops.exec(sandbox_id, sandbox_command(workdir, command), timeout_s=timeout_s)


async def score_tests(ops: SandboxOps, task: Task, sandbox_id: str) -> Score:
    """Copy the hidden tests into the sandbox the agent finished in, run the listed tests and
    score: 1.0 iff every ``FAIL_TO_PASS`` and ``PASS_TO_PASS`` test passed and the command
    exited 0, else 0.0 (also when the tests time out)."""
    check = task.reward
    if not isinstance(check, HiddenTests) or task.sandbox is None:
        raise InvalidRequest("task is not scored by hidden tests", task_id=task.id)
    workdir = task.sandbox.workdir
    for command in write_file_commands(check.files):
        r = await _run(ops, sandbox_id, workdir, command, 60.0)
        if r.exit_code != 0:
            return Score(reward=0.0, detail=f"could not write the hidden tests: {r.stderr[-300:]}")
    if check.test_patch:
        patch = {"/tmp/belayer-test.patch": check.test_patch.encode()}
        for command in write_file_commands(patch):
            await _run(ops, sandbox_id, workdir, command, 60.0)
        r = await _run(
            ops, sandbox_id, workdir, "git apply --whitespace=nowarn /tmp/belayer-test.patch", 60.0
        )
        if r.exit_code != 0:
            return Score(reward=0.0, detail=f"test patch does not apply: {r.stderr[-300:]}")
    wanted = [*check.fail_to_pass, *check.pass_to_pass]
    try:
        command = FRESH_BYTECODE + command_for_tests(check)
        r = await _run(ops, sandbox_id, workdir, command, check.timeout_s)
    except Timeout as exc:
        if "subject" in exc.data:  # the bus timed out, not the tests: infrastructure
            raise
        return Score(reward=0.0, failed=wanted, detail="tests timed out")
    results = parse_test_results(r.stdout)
    passed = [t for t in wanted if results.get(t) in ("PASSED", "XPASS")]
    failed = [t for t in wanted if t not in passed]
    ok = not failed and r.exit_code == 0 and bool(wanted)
    detail = "all tests passed" if ok else f"exit code {r.exit_code}; {len(failed)} not passed"
    return Score(reward=1.0 if ok else 0.0, passed=passed, failed=failed, detail=detail)


async def score(task: Task, outcome: Outcome) -> Score:
    """Score a finished trajectory: the response text for answer tasks, the sandbox for test
    tasks (``InvalidRequest`` if the outcome does not fit the task)."""
    if isinstance(task.reward, AnswerCheck):
        if not isinstance(outcome, str):
            raise InvalidRequest("an answer task is scored on the response text", task_id=task.id)
        return score_answer(task, outcome)
    if not isinstance(outcome, SandboxHandle):
        raise InvalidRequest("a sandbox task is scored on its sandbox", task_id=task.id)
    return await score_tests(outcome.ops, task, outcome.sandbox_id)
