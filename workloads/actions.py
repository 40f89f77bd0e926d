"""The action convention between the model and the sandbox (docs/workloads.md), shared by the
controller, the warm start and the runner so all of them read and write the same format.

* A response acts with exactly one fenced ```` ```bash ```` block (```` ```sh ```` also counts):
  its body is one shell command run in the task's workdir.
* A sandbox task finishes with a block whose body is exactly ``submit`` (``FINISH_COMMAND``).
* A single-turn (math) task finishes with a final ``Answer: …`` line and no bash block.
* Anything else is invalid; the agent is told so in its next observation.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

FINISH_COMMAND = "submit"
"""Body of the bash block that ends a sandbox task."""

ANSWER_PREFIX = "Answer:"
"""Start of the final line of a math response (DAPO's convention)."""

_FENCE = re.compile(r"```[ \t]*(bash|sh)[ \t]*\r?\n(.*?)```", re.S | re.I)
_ANY_FENCE = re.compile(r"```")
_ANSWER = re.compile(r"(?i)answer\s*:[ \t]*([^\n]*)")


@dataclass(frozen=True)
class BashAction:
    """Run ``command`` in the sandbox."""

    command: str
    """The block's body, stripped."""


@dataclass(frozen=True)
class SubmitAction:
    """The agent is done (sandbox tasks): score the sandbox."""


@dataclass(frozen=True)
class AnswerAction:
    """The agent gave its final answer (single-turn tasks)."""

    answer: str
    """Text after the last ``Answer:``, stripped."""


@dataclass(frozen=True)
class InvalidAction:
    """The response follows no form of the convention."""

    reason: str
    """What is wrong, in words (shown to the agent)."""


Action = BashAction | SubmitAction | AnswerAction | InvalidAction
"""What one response asks for."""


def parse_action(text: str) -> Action:
    """Read one model response: exactly one bash block → ``BashAction`` (``SubmitAction`` if
    its body is ``submit``); no bash block but an ``Answer:`` line → ``AnswerAction``; else
    ``InvalidAction`` with the reason."""
    blocks = _FENCE.findall(text)
    if len(blocks) > 1:
        return InvalidAction(f"found {len(blocks)} ```bash blocks; use exactly one per response")
    if len(blocks) == 1:
        command = blocks[0][1].strip()
        if not command:
            return InvalidAction("the ```bash block is empty")
        if command == FINISH_COMMAND:
            return SubmitAction()
        return BashAction(command)
    answer = parse_answer(text)
    if answer is not None:
        return AnswerAction(answer)
    if _ANY_FENCE.search(text):
        return InvalidAction("a code block must be a closed ```bash block")
    return InvalidAction("no ```bash block and no final 'Answer:' line")


def parse_answer(text: str) -> str | None:
    """The text after the last ``Answer:`` (case-insensitive, as DAPO reads it), stripped;
    ``None`` when there is none or it is empty."""
    found = _ANSWER.findall(text)
    if not found:
        return None
    answer = found[-1].strip()
    return answer or None


THOUGHT_PREFIX = "THOUGHT:"
"""How a response that reasons before it acts starts (mini-swe-agent's convention)."""


def format_action(command: str, thought: str = "") -> str:
    """The canonical response that runs ``command`` (demonstrations), after a
    ``THOUGHT: …`` paragraph when ``thought`` is given."""
    block = f"```bash\n{command.strip()}\n```"
    return f"{THOUGHT_PREFIX} {thought.strip()}\n\n{block}" if thought.strip() else block


def format_answer(answer: str) -> str:
    """The canonical final line of a math response."""
    return f"{ANSWER_PREFIX} {answer.strip()}"


NO_BYTECODE = "export PYTHONDONTWRITEBYTECODE=1"
"""Python in a sandbox writes no ``__pycache__``: bytecode is checked by the source's mtime (1 s)
and size, so an edit of the same size within the second after a test run would otherwise run
the old code (seen: a demonstration's fix re-recorded as failing)."""


def sandbox_command(workdir: str, command: str) -> str:
    """The shell text the sandbox runs for an agent ``command``: no Python bytecode written
    (``NO_BYTECODE``), then ``cd`` into the task's workdir (on its own line, so no operator of
    ``command`` binds to it)."""
    return f"{NO_BYTECODE}\ncd {shlex.quote(workdir)} || exit 97\n{command}"


_TEST_DURATION = re.compile(
    r"\b(passed|failed|errors?|skipped|xfailed|xpassed|warnings?|deselected|no tests ran)"
    r" in \d+(?:\.\d+)?s(?: \(\d+:\d\d:\d\d\))?"
)
"""pytest's summary clock (``1 failed, 2 passed in 0.07s``, ``in 61.00s (0:01:01)``)."""


def without_durations(text: str) -> str:
    """``text`` without the wall-clock time of pytest's summary line (``1 failed, 2 passed in
    0.07s`` → ``1 failed, 2 passed``). The same command in the same sandbox state then gives
    the same observation, so a response regenerated after a sandbox restore or a worker
    handover sees what the lost one saw (failure transparency): the timing was the one part of
    a test run's output that changed from run to run."""
    return _TEST_DURATION.sub(r"\1", text)


def _cut(text: str, limit: int) -> tuple[str, int]:
    if len(text) <= limit:
        return text, 0
    return text[:limit], len(text) - limit


def format_observation(
    stdout: str,
    stderr: str,
    exit_code: int,
    *,
    limit_chars: int,
    timed_out: bool = False,
    timeout_s: float = 0.0,
    truncated: bool = False,
) -> str:
    """The next user turn after a command: exit code (or the timeout), stdout, then stderr
    under a ``[stderr]`` marker (test timings dropped: :func:`without_durations`), cut to
    ``limit_chars`` in all with the cut marked. A non-zero exit or a timeout of the agent's
    own command is an ordinary observation."""
    head = (
        f"exit_code: timeout (killed after {timeout_s:g} s)"
        if timed_out
        else f"exit_code: {exit_code}"
    )
    body, stderr = without_durations(stdout), without_durations(stderr)
    if stderr:
        body = f"{body}{'' if not body or body.endswith(chr(10)) else chr(10)}[stderr]\n{stderr}"
    body, dropped = _cut(body, max(0, limit_chars - len(head) - 1))
    out = f"{head}\n{body}" if body else head
    if dropped or truncated:
        more = f"{dropped} more characters" if dropped else "the sandbox capped the output"
        out = f"{out.rstrip(chr(10))}\n[output truncated: {more}]"
    return out


def invalid_action_observation(reason: str) -> str:
    """The next user turn after an unparseable response."""
    return (
        f"Invalid response: {reason}. Reply with exactly one ```bash block, "
        f"or ```bash\n{FINISH_COMMAND}\n``` when you are done."
    )


MATH_INSTRUCTION = "Solve the problem. End your response with a line 'Answer: <answer>'."
"""System turn of the generated math tasks."""

SWE_INSTRUCTION = (
    "You fix a bug in the Python repository in {workdir}. Each response: one ```bash block "
    "with one shell command; it runs in {workdir} and you see its output. Edit files with "
    "sed or python3. Run the tests with: python3 -m pytest -q. When the bug is fixed, reply "
    "```bash\n" + FINISH_COMMAND + "\n```."
)
"""System turn of the SWE tasks (``{workdir}`` is filled in)."""
