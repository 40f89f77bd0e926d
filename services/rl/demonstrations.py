"""Demonstrations for the warm start (:mod:`services.rl.warm`; ``belayer model init --tiny
--warm-start math|swe|swe-long``): the half that needs the workloads and a real sandbox; the
training itself is :mod:`model.warm_start`.

* **math**: problems of the ``math`` workload (reasoning-gym, offline), answered in the
  convention: the left-to-right working, one line per operation, then ``Answer: N``.
* **swe**: generated training instances of every *training* bug family
  (``workloads.swe_gen``; ``SWE_DEMO_PER_FAMILY`` each, never a held-out instance or family)
  run for real — a private nats-server and environment service, real sandboxes of the task's
  image — with the general recipe (``SWE_VARIANTS``: run the tests, read the modules, fix the
  line with one ``sed`` — written with the instance's names or naming nothing, ``swe_variant``
  — run the tests again), each episode checked against the hidden tests. The transcript holds the real observations, formatted as the
  controller formats them (``workloads.runner``), and ends with the submit action.
* **swe-long**: the bundled training tasks (``swe-bundled``), one long episode each in the manner of mini-swe-agent: every
  response reasons first (a ``THOUGHT:`` paragraph) and then acts; the agent explores the
  repository and its tests, runs the tests, reads the module, fixes it and runs the tests
  again (``long_episode``: 8–10 actions). Responses longer than a checkpoint and trajectories
  of many steps are the regime of the paper's SWE runs; ``belayer bench policy`` uses it.

Both are cached as JSON lines under ``<cache>/demonstrations/`` keyed by what they depend on,
so a rerun reads them back (no sandbox, no network).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import shlex
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from common.errors import InvalidRequest, SandboxError
from common.logging import get_logger
from model.warm_start import Demonstration, read_demonstrations, write_demonstrations
from services.environment.client import with_private_env
from workloads import FINISH_COMMAND, format_action, format_answer, load_workload
from workloads.base import SandboxOps, Task
from workloads.math_tasks import GENERATORS
from workloads.runner import run_episode
from workloads.swe import SweWorkload
from workloads.swe_families import TRAIN_FAMILIES, TRAIN_POOLS

log = get_logger(component="warm_start")

T = TypeVar("T")

CACHE_ENV = "BELAYER_CACHE_DIR"
"""Environment variable naming the cache directory (default ``~/.cache/belayer``)."""

DEMO_VERSION = 2
"""Bumped when the demonstrations a recipe makes change (2: one per trained example)."""

MATH_DEMOS = 12_800
"""Math demonstrations (training problems of the ``math`` workload, never held-out ones), drawn
fresh rather than a small pool cycled; ``SFT["math"]`` trains 2.5 passes over them."""

MATH_DIRECT_SHARE = 0.5
"""Share of math demonstrations that answer at once (``Answer: N``); the others work the sum
out left to right first. Which ones: a hash of the task id (stable across runs). After the warm
start the model mostly answers at once (greedy) and is mostly wrong doing so, while working it
out is mostly right: the behaviour GRPO finds and reinforces (docs/training.md)."""

SWE_DEMO_VERSION = 5
"""Bumped when the ``swe`` and ``swe-long`` recipes change (2: generated tasks and the general
recipe; 3: the sandbox writes no Python bytecode, so a fix is never hidden by a stale
``__pycache__``; 4: observations drop pytest's run time, ``workloads.actions.without_durations``;
5: one recipe per task, name-free or named, ``swe_variant``)."""

SWE_DEMO_PER_FAMILY = 32
"""``swe`` demonstrations per training family (3 until the observations lost pytest's clock: the
model retrained on those 33 no longer followed its recipe on new instances; on 88 it does). 32
since the fix is written two ways (``SWE_NAMED_SHARE``): at 16 the model garbled the name-free
scripts, at 32 it writes them exactly (docs/workloads.md)."""

SWE_DEMO_SEED = 1000
"""Seed of the demonstrated training instances (a run's default seed 0 draws others)."""

SWE_RECORD_CONCURRENCY = 3
"""Demonstration episodes recorded at once."""

TEST_COMMAND = "python3 -m pytest -q"
"""The visible tests, as the SWE system prompt tells the agent to run them."""


def cache_root(explicit: Path | None = None) -> Path:
    """``explicit``, else ``$BELAYER_CACHE_DIR``, else ``$XDG_CACHE_HOME/belayer``, else
    ``~/.cache/belayer``."""
    if explicit is not None:
        return Path(explicit)
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "belayer"


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _cached(
    path: Path, make: Callable[[], list[Demonstration]], refresh: bool
) -> list[Demonstration]:
    if path.is_file() and not refresh:
        demos = read_demonstrations(path)
        if demos:
            return demos
    demos = make()
    write_demonstrations(path, demos)
    log.info("demonstrations_written", path=str(path), count=len(demos))
    return demos


# --- math -------------------------------------------------------------------------------
def math_working(expression: str) -> tuple[list[str], int]:
    """The left-to-right working of ``a ± b [± c]`` (one ``x op y = z`` line per operation)
    and its value."""
    parts = expression.split()
    if len(parts) < 3 or len(parts) % 2 == 0:
        raise InvalidRequest("not an a ± b ± … expression", expression=expression)
    acc = int(parts[0])
    lines = []
    for op, raw in zip(parts[1::2], parts[2::2], strict=True):
        if op not in "+-":
            raise InvalidRequest("only + and - are worked out", expression=expression)
        value = acc + int(raw) if op == "+" else acc - int(raw)
        lines.append(f"{acc} {op} {raw} = {value}")
        acc = value
    return lines, acc


def math_response(task: Task) -> str:
    """The demonstration response of a ``math`` task: its working, then ``Answer: N``."""
    lines, value = math_working(task.metadata["expression"])
    if str(value) != task.reference_answer:
        raise InvalidRequest(
            "working disagrees with the reference answer", task_id=task.id, value=value
        )
    return "\n".join([*lines, format_answer(task.reference_answer)])


def answers_at_once(task: Task) -> bool:
    """Whether ``task``'s demonstration answers at once (``MATH_DIRECT_SHARE`` of the tasks)."""
    frac = int.from_bytes(hashlib.sha256(task.id.encode()).digest()[:4], "big") / 2**32
    return frac < MATH_DIRECT_SHARE


def prompt_turns(task: Task) -> tuple[tuple[str, str], ...]:
    """The task's prompt as ``(role, content)`` turns."""
    return tuple((m.role, m.content) for m in task.prompt)


def math_demonstrations(
    cache: Path, count: int = MATH_DEMOS, seed: int = 0, *, refresh: bool = False
) -> list[Demonstration]:
    """``count`` math demonstrations (cached): ``MATH_DIRECT_SHARE`` answer at once
    (variant ``direct``), the others show their working first (``working``)."""
    key = _digest(
        {
            "v": DEMO_VERSION,
            "kind": "math",
            "count": count,
            "seed": seed,
            "direct": MATH_DIRECT_SHARE,
            "generators": GENERATORS,
        }
    )

    def demo(t: Task) -> Demonstration:
        direct = answers_at_once(t)
        text = format_answer(t.reference_answer) if direct else math_response(t)
        return Demonstration(
            task_id=t.id,
            messages=(*prompt_turns(t), ("assistant", text)),
            variant="direct" if direct else "working",
        )

    def make() -> list[Demonstration]:
        return [demo(t) for t in load_workload("math").tasks(count, seed=seed)]

    return _cached(cache / "demonstrations" / f"math-{key}.jsonl", make, refresh)


# --- swe --------------------------------------------------------------------------------
READ_COMMAND = "cat $(find . -name '*.py' ! -name 'test_*' | sort)"
"""Print the repository's modules (not its tests) without naming any of them."""


def general_actions(task: Task) -> list[str]:
    """The general skill on one task, naming nothing of the instance: run the tests (the
    failing one shows the call and what it returned), read the modules, fix the line by its
    shape (the family's name-free ``sed -E``, task metadata ``pattern_fix``), run the tests
    again. What a tiny model can carry to names it never saw: it copies no name."""
    fix = task.metadata.get("pattern_fix") or ""
    if not fix:
        raise InvalidRequest("the task has no name-free fix", task_id=task.id)
    return [TEST_COMMAND, READ_COMMAND, fix, TEST_COMMAND]


def named_actions(task: Task) -> list[str]:
    """The same episode with the fix written with the instance's names: the reference ``sed``
    with the fragment of the printed line and the module's path. Right in every
    demonstration; for the model it needs every name copied exactly, which a tiny model
    mostly gets wrong on names it never saw (docs/workloads.md)."""
    return [TEST_COMMAND, READ_COMMAND, *task.reference_actions, TEST_COMMAND]


SWE_VARIANTS: dict[str, tuple[Callable[[Task], list[str]], float]] = {
    "pattern": (general_actions, 1.0),
    "named": (named_actions, 1.0),
}
"""The action lists a demonstrated task may get (each then ends with the submit action) and
the reward each must get; ``swe_variant`` picks one per task."""

SWE_NAMED_SHARE = 0.6
"""Share of ``swe`` demonstrations whose fix is written with names (``named``: ``sed -i
's/…/…/' <path>``); the others name nothing (``pattern``: ``find … sed -E``). Which ones: a
hash of the task id. The lever that made math learn (``MATH_DIRECT_SHARE``): after the warm
start the model writes either kind of fix, the named one first when greedy; the named one
mostly fails on names it has not seen and the name-free one mostly works, so GRPO has a
behaviour to find and reinforce — one that carries to held-out instances (docs/training.md)."""


def swe_variant(task: Task) -> str:
    """The recipe ``task``'s demonstration follows (``SWE_NAMED_SHARE`` get ``named``)."""
    frac = int.from_bytes(hashlib.sha256(f"swe:{task.id}".encode()).digest()[:4], "big") / 2**32
    return "named" if frac < SWE_NAMED_SHARE else "pattern"


COPY_DRILLS = 2000
"""Copy drills of the copying experiment (``copy_drills``; docs/workloads.md "Teaching the swe
model to copy"): not yet part of a recipe."""


def _drill_item(rng: random.Random) -> str:
    nouns, words = TRAIN_POOLS.nouns, TRAIN_POOLS.words
    n, w = rng.choice(nouns), rng.choice(words)
    kinds = [
        f"{n}.py",
        f"{rng.choice(nouns)}/{n}.py",
        f"{rng.choice(nouns)}_{n}({w}, {rng.choice(words)})",
        f"{w.upper()} = {rng.randrange(100)}",
        f"{w} {rng.choice(['<', '>', '>=', '+', '-', '*', '%'])} {rng.choice(words)}",
        f"{w}[{rng.randrange(3)}]",
        f"range({w}, {rng.choice(words)} + 1)",
    ]
    return rng.choice(kinds)


def copy_drills(count: int = COPY_DRILLS, seed: int = 0) -> list[Demonstration]:
    """``count`` one-turn drills: the user shows 3–8 names, paths and code fragments drawn like
    a training instance's (training pools only), the answer repeats them exactly. Every
    answer token is a copy: a tiny model trained only on the episodes learns which names are
    likely rather than to copy the one in front of it (docs/workloads.md "Teaching the swe model
    to copy")."""
    rng = random.Random(f"copy-drills:{seed}")
    out = []
    for k in range(count):
        text = "\n".join(_drill_item(rng) for _ in range(rng.randint(3, 8)))
        out.append(
            Demonstration(
                task_id=f"drill-{k}",
                messages=(("user", f"Repeat exactly:\n{text}"), ("assistant", text)),
                variant="drill",
            )
        )
    return out


Step = tuple[str, str]
"""One response of a demonstration: (its thought, empty for none; its command)."""

THOUGHTS: dict[str, str] = {
    "ls": "I start by looking at how the repository is laid out: which modules it has and "
    "where the tests live, so that I know which files the issue is about.",
    "ls tests": "Next I list the test directory to see which test files exist and which parts "
    "of the code they cover.",
    "cat test": "I read the visible tests to learn how the code is called and what they expect "
    "from it.",
    "test before": "Before I change anything I run the visible tests once, so that I know what "
    "passes now and can tell later whether my fix broke something.",
    "cat module": "The issue names the module with the bug, so I print its source and look for "
    "the line that does what the issue describes.",
    "grep def": "To be sure where each function starts I list the definitions in the modules "
    "with their line numbers.",
    "sed": "I have found the faulty line, so I fix it with one small edit in place and change "
    "nothing else in the file.",
    "nohup": "The issue wants the fixed server to keep running, so I start it in the background, "
    "where it stays up after this command returns.",
    "run": "With the fixed server running I do what the issue asks of it, so that the live "
    "server holds the right state.",
    "test after": "With the fix in place I run the visible tests again to check that everything "
    "still passes.",
    "submit": "The bug is fixed and the tests pass, so I submit my work.",
}
"""The ``THOUGHT:`` of each kind of step of ``long_episode``."""


def edited_module(task: Task) -> str:
    """The ``.py`` file the task's reference actions edit (the module the issue is about)."""
    for action in task.reference_actions:
        words = shlex.split(action)
        if words and words[0] == "sed":
            for word in reversed(words):
                if word.endswith(".py"):
                    return word
    raise InvalidRequest("no reference action edits a .py file with sed", task_id=task.id)


def long_episode(task: Task) -> list[Step]:
    """The ``swe-long`` recipe: explore (``ls``, ``ls tests``, the visible tests), run the
    tests, read the module, list the definitions, the reference actions, the tests again — each
    action after a thought. (The submit follows in ``swe_transcript``.)"""
    module = edited_module(task)
    steps: list[Step] = [
        (THOUGHTS["ls"], "ls"),
        (THOUGHTS["ls tests"], "ls tests"),
        (THOUGHTS["cat test"], "cat tests/*.py"),
        (THOUGHTS["test before"], TEST_COMMAND),
        (THOUGHTS["cat module"], f"cat {module}"),
        (THOUGHTS["grep def"], "grep -n 'def ' *.py"),
    ]
    for action in task.reference_actions:
        first = shlex.split(action)[0]
        steps.append((THOUGHTS.get(first, THOUGHTS["run"]), action))
    steps.append((THOUGHTS["test after"], TEST_COMMAND))
    return steps


SWE_LONG_VARIANTS: dict[str, tuple[Callable[[Task], list[Step]], float]] = {
    "long": (long_episode, 1.0),
}
"""The ``swe-long`` recipes (like ``SWE_VARIANTS``, with a thought before every action)."""


def swe_transcript(
    task: Task,
    actions: Sequence[str],
    observations: Sequence[str],
    thoughts: Sequence[str] | None = None,
    finish_thought: str = "",
) -> tuple[tuple[str, str], ...]:
    """The chat of one episode: the prompt, each action (``format_action``, after its thought
    if any) followed by its observation, then the submit action."""
    turns = list(prompt_turns(task))
    thoughts = list(thoughts) if thoughts is not None else [""] * len(actions)
    for action, observation, thought in zip(actions, observations, thoughts, strict=True):
        turns += [("assistant", format_action(action, thought)), ("user", observation)]
    turns.append(("assistant", format_action(FINISH_COMMAND, finish_thought)))
    return tuple(turns)


def plain_variants() -> dict[str, tuple[Callable[[Task], list[Step]], float]]:
    """``SWE_VARIANTS`` as recipes of steps without thoughts."""

    def steps(recipe: Callable[[Task], list[str]]) -> Callable[[Task], list[Step]]:
        return lambda task: [("", a) for a in recipe(task)]

    return {k: (steps(f), r) for k, (f, r) in SWE_VARIANTS.items()}


async def record_swe(
    ops: SandboxOps,
    tasks: Sequence[Task],
    variants: dict[str, tuple[Callable[[Task], list[Step]], float]],
    *,
    concurrency: int = SWE_RECORD_CONCURRENCY,
    pick: Callable[[Task], str] | None = None,
) -> list[Demonstration]:
    """Run every task × variant in a real sandbox (``concurrency`` episodes at once; the result
    in task × variant order) — or, with ``pick``, each task in the one variant it picks; each
    episode must score what its variant expects."""
    gate = asyncio.Semaphore(concurrency)

    async def record(task: Task, variant: str) -> Demonstration:
        recipe, expected = variants[variant]
        steps = recipe(task)
        actions = [command for _, command in steps]
        thoughts = [thought for thought, _ in steps]
        finish = THOUGHTS["submit"] if any(thoughts) else ""
        async with gate:
            episode = await run_episode(ops, task, actions=actions)
        reward = episode.score.reward if episode.score else -1.0
        if reward != expected:
            raise SandboxError(
                "a demonstration did not score what its recipe expects",
                task_id=task.id,
                variant=variant,
                reward=reward,
                expected=expected,
                detail=episode.score.detail if episode.score else "",
            )
        log.info("swe_demonstration_recorded", task_id=task.id, variant=variant)
        observations = [s.observation for s in episode.steps]
        return Demonstration(
            task_id=task.id,
            messages=swe_transcript(task, actions, observations, thoughts, finish),
            variant=variant,
        )

    pairs = [(t, pick(t)) for t in tasks] if pick else [(t, v) for t in tasks for v in variants]
    return list(await asyncio.gather(*(record(t, v) for t, v in pairs)))


def _task_fingerprint(task: Task) -> dict[str, Any]:
    spec = task.sandbox
    return {
        "id": task.id,
        "prompt": prompt_turns(task),
        "actions": list(task.reference_actions),
        "image": spec.image if spec else "",
        "setup": spec.setup if spec else "",
        "files": {p: hashlib.sha256(c).hexdigest() for p, c in sorted(spec.files.items())}
        if spec
        else {},
        "limits": [task.limits.observation_chars, task.limits.action_timeout_s],
    }


def swe_demonstrations(
    cache: Path, *, refresh: bool = False, kind: str = "swe"
) -> list[Demonstration]:
    """The SWE demonstrations of ``kind`` (``swe`` or ``swe-long``; cached; recorded in real
    sandboxes when not)."""
    if kind == "swe":
        count = SWE_DEMO_PER_FAMILY * len(TRAIN_FAMILIES)
        tasks = load_workload("swe", check_image=False).tasks(count, seed=SWE_DEMO_SEED)
        variants = plain_variants()
        pick: Callable[[Task], str] | None = swe_variant
        shown: dict[str, Any] = {k: [f(tasks[0]), r] for k, (f, r) in SWE_VARIANTS.items()}
        fingerprint: dict[str, Any] = {
            "v": DEMO_VERSION,
            "swe_v": SWE_DEMO_VERSION,
            "kind": "swe",
            "variants": shown,
            "picked": [swe_variant(t) for t in tasks],
        }
    else:
        swe = SweWorkload(check_image=False, generated=False)  # the swe-bundled workload
        tasks = sorted(swe.tasks(len(swe.train)), key=lambda t: t.id)
        variants = SWE_LONG_VARIANTS
        pick = None
        shown = {k: [[f(t) for t in tasks], r] for k, (f, r) in variants.items()}
        fingerprint = {
            "v": DEMO_VERSION,
            "swe_v": SWE_DEMO_VERSION,
            "kind": kind,
            "variants": shown,
            "thoughts": THOUGHTS,
        }
    key = _digest({**fingerprint, "tasks": [_task_fingerprint(t) for t in tasks]})

    def make() -> list[Demonstration]:
        load_workload("swe")  # the image must exist: NotFound naming the fix otherwise
        return asyncio.run(
            with_private_env(lambda ops: record_swe(ops, tasks, variants, pick=pick))
        )

    return _cached(cache / "demonstrations" / f"{kind}-{key}.jsonl", make, refresh)


def demonstrations(kind: str, cache: Path, *, refresh: bool = False) -> list[Demonstration]:
    """The demonstrations of ``kind`` (``math``, ``swe`` or ``swe-long``)."""
    if kind == "math":
        return math_demonstrations(cache, refresh=refresh)
    if kind in ("swe", "swe-long"):
        return swe_demonstrations(cache, refresh=refresh, kind=kind)
    raise InvalidRequest("unknown warm-start kind", kind=kind, known=["math", "swe", "swe-long"])
