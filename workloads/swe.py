"""``swe``: tiny Python bug-fix repositories scored by hidden tests in the locally built
``belayer-swe:1`` image (python3 + pytest, no network; ``deploy/install_env.sh`` builds it):
generated ones (``workloads.swe_gen``: bug families × instances, with held-out instances and
held-out families) by default, and the bundled ones (``workloads/swe_tasks/<task_id>/``),
loadable by id and as the task list of the ``swe-bundled`` workload.

A task directory holds ``task.toml`` (problem statement, ``fail_to_pass``, ``pass_to_pass``,
``reference_actions``, optional ``held_out``, ``setup``, ``max_turns``), ``repo/`` (the files
the agent starts from, written to ``/root/repo``) and ``hidden/`` (the tests the agent never
sees, copied over the repository only for scoring).
"""

from __future__ import annotations

import random
import tomllib
from pathlib import Path
from typing import Any

from common.errors import InvalidRequest, NotFound, SandboxError
from workloads.actions import SWE_INSTRUCTION
from workloads.base import (
    ChatMessage,
    HiddenTests,
    Outcome,
    SandboxSpec,
    Task,
    TaskLimits,
    check_count,
    find_task,
)
from workloads.scoring import score
from workloads.swe_families import TRAIN_FAMILIES
from workloads.swe_gen import Instance, held_out_ids, instance, parse_instance_id, training_ids

SWE_IMAGE = "belayer-swe:1"
"""The sandbox image of the bundled tasks (``belayer-sandbox:1`` + pytest)."""

BUNDLED_DIR = Path(__file__).resolve().parent / "swe_tasks"
"""Where the bundled tasks live."""

WORKDIR = "/root/repo"
"""Where a bundled task's repository lies in its sandbox."""

SWE_LIMITS = TaskLimits(
    max_turns=20, action_timeout_s=30.0, observation_chars=1000, max_response_tokens=256
)
"""Limits of the bundled tasks (a tiny model's context is 2048 tokens)."""

GENERATED_LIMITS = TaskLimits(
    max_turns=6, action_timeout_s=30.0, observation_chars=1000, max_response_tokens=256
)
"""Limits of the generated tasks: their fix takes 5 responses (test, read, fix, test, submit),
so 6 turns leave room for a second fix. (10 until 2026-12-05: of 60 solved training episodes
58 took 5 turns; failed ones ran on to 8.4 turns on average, most of a rollout's time.)"""

HELD_OUT_SIZE = 96
"""Length of the fixed held-out list of the generated tasks."""

HELD_OUT_DEFAULT = 12
"""Held-out tasks a caller without a count takes (``SweWorkload.evaluation``): 8 held-out
instances and 4 held-out-family tasks."""

MAX_TASK_BYTES = 4 * 1024 * 1024
"""Largest total size of a task's files (they travel in one sandbox-create message)."""

_TASK_KEYS = {
    "problem_statement",
    "fail_to_pass",
    "pass_to_pass",
    "reference_actions",
    "held_out",
    "setup",
    "max_turns",
}
_SKIP = {"__pycache__", ".git", ".pytest_cache"}


def read_tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (relative path → bytes), without caches and ``.git``;
    ``ResourceLimit``-style ``InvalidRequest`` past ``MAX_TASK_BYTES``."""
    files: dict[str, bytes] = {}
    total = 0
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if any(part in _SKIP for part in rel.parts) or p.suffix == ".pyc" or not p.is_file():
            continue
        data = p.read_bytes()
        total += len(data)
        if total > MAX_TASK_BYTES:
            raise InvalidRequest("task files too large", root=str(root), limit=MAX_TASK_BYTES)
        files[rel.as_posix()] = data
    return files


def files_of_tests(test_ids: list[str]) -> set[str]:
    """The file part of pytest ids (``tests/test_x.py::test_y`` → ``tests/test_x.py``)."""
    return {t.split("::", 1)[0] for t in test_ids}


def image_exists(image: str) -> bool:
    """Whether dockerd has ``image`` locally (blocking; ``SandboxError`` if dockerd cannot be
    reached)."""
    import docker

    try:
        client = docker.DockerClient(version="auto", timeout=10)
    except docker.errors.DockerException as exc:
        raise SandboxError(
            "cannot reach dockerd to check the image", image=image, error=str(exc)
        ) from None
    try:
        client.images.get(image)
        return True
    except docker.errors.ImageNotFound:
        return False
    except docker.errors.APIError as exc:
        if getattr(exc, "status_code", None) == 404:
            return False
        raise SandboxError(
            "dockerd failed to inspect the image", image=image, error=str(exc)
        ) from None
    finally:
        client.close()


def require_image(image: str) -> None:
    """``NotFound`` with the fix unless the image exists locally."""
    if not image_exists(image):
        raise NotFound(
            "sandbox image not found (images are built locally: run deploy/install_env.sh)",
            image=image,
        )


def _str_list(value: Any, key: str, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise InvalidRequest(f"{key} must be a list of non-empty strings", task=where)
    return list(value)


def load_task_dir(directory: Path, *, image: str = SWE_IMAGE, workload: str = "swe") -> Task:
    """One bundled-format task directory as a ``Task``."""
    where = directory.name
    manifest = directory / "task.toml"
    if not manifest.is_file():
        raise NotFound("task directory has no task.toml", task=where, path=str(directory))
    try:
        meta = tomllib.loads(manifest.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise InvalidRequest("task.toml is not valid TOML", task=where, error=str(exc)) from None
    unknown = sorted(set(meta) - _TASK_KEYS)
    missing = sorted({"problem_statement", "fail_to_pass", "pass_to_pass"} - set(meta))
    if unknown or missing:
        raise InvalidRequest("bad task.toml keys", task=where, unknown=unknown, missing=missing)
    f2p = _str_list(meta["fail_to_pass"], "fail_to_pass", where)
    p2p = _str_list(meta["pass_to_pass"], "pass_to_pass", where)
    if not f2p:
        raise InvalidRequest("fail_to_pass must name at least one test", task=where)
    repo = read_tree(directory / "repo")
    hidden = read_tree(directory / "hidden") if (directory / "hidden").is_dir() else {}
    # Scoring restores the repository's own copies of the listed test files (the agent may
    # have edited them) and adds the hidden ones.
    restore = {p: repo[p] for p in files_of_tests(f2p + p2p) if p in repo}
    missing_tests = sorted(files_of_tests(f2p + p2p) - set(repo) - set(hidden))
    if missing_tests:
        raise InvalidRequest(
            "test ids name files neither repo/ nor hidden/ has", task=where, files=missing_tests
        )
    statement = str(meta["problem_statement"]).strip()
    return Task(
        id=where,
        workload=workload,
        prompt=[
            ChatMessage(role="system", content=SWE_INSTRUCTION.format(workdir=WORKDIR)),
            ChatMessage(role="user", content=statement),
        ],
        reward=HiddenTests(fail_to_pass=f2p, pass_to_pass=p2p, files={**restore, **hidden}),
        sandbox=SandboxSpec(
            image=image, workdir=WORKDIR, files=repo, setup=str(meta.get("setup", ""))
        ),
        limits=TaskLimits(
            max_turns=int(meta.get("max_turns", SWE_LIMITS.max_turns)),
            action_timeout_s=SWE_LIMITS.action_timeout_s,
            observation_chars=SWE_LIMITS.observation_chars,
            max_response_tokens=SWE_LIMITS.max_response_tokens,
        ),
        reference_actions=_str_list(meta.get("reference_actions", []), "reference_actions", where),
        metadata={"source": "bundled", "held_out": str(bool(meta.get("held_out", False))).lower()},
    )


def generated_task(inst: Instance, *, image: str = SWE_IMAGE, workload: str = "swe") -> Task:
    """A generated instance (``workloads.swe_gen``) as a ``Task``: its repository in
    ``/root/repo``, the hidden tests plus the repository's own test files restored for scoring,
    ``GENERATED_LIMITS``, its ``sed`` fix as the reference action, metadata ``family``,
    ``split``, ``module`` and ``pattern_fix`` (the same fix naming nothing)."""
    restore = {
        p: inst.files[p]
        for p in files_of_tests(inst.fail_to_pass + inst.pass_to_pass)
        if p in inst.files
    }
    return Task(
        id=inst.id,
        workload=workload,
        prompt=[
            ChatMessage(role="system", content=SWE_INSTRUCTION.format(workdir=WORKDIR)),
            ChatMessage(role="user", content=inst.statement),
        ],
        reward=HiddenTests(
            fail_to_pass=list(inst.fail_to_pass),
            pass_to_pass=list(inst.pass_to_pass),
            files={**restore, **inst.hidden},
        ),
        sandbox=SandboxSpec(image=image, workdir=WORKDIR, files=dict(inst.files)),
        limits=GENERATED_LIMITS,
        reference_actions=[inst.fix],
        metadata={
            "source": "generated",
            "family": inst.family,
            "split": inst.split,
            "held_out": str(inst.split != "train").lower(),
            "module": inst.module,
            "pattern_fix": inst.pattern_fix,
        },
    )


class SweWorkload:
    """``swe``: generated bug-fix tasks (``workloads.swe_gen``) by default; the bundled tasks
    stay loadable by their ids. Options: ``image`` (default ``belayer-swe:1``),
    ``check_image`` (default true: ``NotFound`` at load when the image is missing),
    ``tasks_dir`` (another directory of tasks in the bundled format), ``generated`` (default
    true; false: ``tasks``/``held_out`` are the directory's own, the ``swe-bundled``
    workload).

    Generated: ``tasks(count, seed)`` are training instances of the training families (any
    count); ``held_out(count)`` is a fixed list mixing held-out instances of the training
    families and instances of the held-out families, two to one (task metadata ``family``
    and ``split`` = ``heldout-instance`` | ``heldout-family``, so reports can split the
    reward). ``train`` / ``evaluation`` are the first round (one instance per training
    family) and the first ``HELD_OUT_DEFAULT`` held-out tasks: what a caller without a count
    takes."""

    name = "swe"

    def __init__(
        self,
        *,
        image: str = SWE_IMAGE,
        check_image: bool = True,
        tasks_dir: str | Path = BUNDLED_DIR,
        generated: bool = True,
    ) -> None:
        root = Path(tasks_dir)
        if not root.is_dir():
            raise NotFound("swe tasks directory not found", path=str(root))
        dirs = sorted(p for p in root.iterdir() if (p / "task.toml").is_file())
        if not dirs:
            raise NotFound("no tasks (*/task.toml) in the swe tasks directory", path=str(root))
        if check_image:
            require_image(image)
        self.image = image
        self.generated = generated
        self.all = [load_task_dir(d, image=image, workload=self.name) for d in dirs]
        if generated:
            self.train = self.tasks(len(TRAIN_FAMILIES))
            self.evaluation = self.held_out(HELD_OUT_DEFAULT)
        else:
            self.train = [t for t in self.all if t.metadata["held_out"] != "true"]
            self.evaluation = [t for t in self.all if t.metadata["held_out"] == "true"]

    def _generated(self, task_id: str) -> Task:
        found = parse_instance_id(task_id)
        if found is None:
            raise NotFound("unknown task id", workload=self.name, task_id=task_id)
        return generated_task(instance(*found), image=self.image, workload=self.name)

    def tasks(self, count: int, seed: int = 0) -> list[Task]:
        if self.generated:
            check_count(count, None, what="swe tasks")
            if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
                raise InvalidRequest("seed must be a non-negative integer", seed=seed)
            return [self._generated(i) for i in training_ids(count, seed)]
        check_count(count, len(self.train), what="swe tasks")
        order = list(self.train)
        random.Random(seed).shuffle(order)
        return order[:count]

    def held_out(self, count: int) -> list[Task]:
        if self.generated:
            check_count(count, HELD_OUT_SIZE, what="swe held-out tasks")
            return [self._generated(i) for i in held_out_ids(count)]
        check_count(count, len(self.evaluation), what="swe held-out tasks")
        return self.evaluation[:count]

    def task(self, task_id: str) -> Task:
        if parse_instance_id(task_id) is not None:
            return self._generated(task_id)
        return find_task(self.all, task_id, self.name)

    async def reward(self, task: Task, outcome: Outcome) -> float:
        return (await score(task, outcome)).reward


def bundled_options(
    *, image: str = SWE_IMAGE, check_image: bool = True, tasks_dir: str | Path = BUNDLED_DIR
) -> None:
    """The options of ``swe-bundled`` (``SweWorkload`` with ``generated=False``), for
    ``load_workload``'s option check."""
