"""``swe-gym``: SWE-Gym / SWE-bench instance files (``.jsonl``, ``.json`` or ``.parquet``).

Each row: ``instance_id``, ``repo``, ``base_commit``, ``problem_statement``, ``FAIL_TO_PASS``
and ``PASS_TO_PASS`` (a list or a JSON string of one); optional ``test_patch`` (the diff that
adds the hidden tests), ``test_command`` (or ``test_cmd``), ``image``, ``repo_path``,
``workdir``, ``setup``.

Where the repository comes from, per row:

* **an image** (the row's ``image``, or the ``image_template`` option formatted with
  ``{instance_id}``, ``{repo}`` and ``{instance_key}`` — SWE-bench's lower-case id with ``__``
  → ``_1776_``): the repository is inside the image at ``workdir`` (default ``/testbed``) and
  ``test_patch`` is applied there with ``git apply`` at scoring time;
* **a local directory** (the row's ``repo_path``, relative to the file, else
  ``<repos_dir>/<owner>__<name>``): a git checkout is exported at ``base_commit`` (``git
  archive``), a plain directory is taken as it is; its files are written to ``/root/repo`` in
  the ``image`` option's image and ``test_patch`` is applied here, on the host.

A missing repository, commit or image is a ``NotFound`` at load time, before any sandbox starts.
"""

from __future__ import annotations

import io
import json
import random
import re
import subprocess
import tarfile
from pathlib import Path
from typing import Any

from common.errors import InvalidRequest, NotFound
from workloads.actions import SWE_INSTRUCTION
from workloads.base import (
    ChatMessage,
    HiddenTests,
    Outcome,
    SandboxSpec,
    Task,
    check_count,
    find_task,
    split_held_out,
)
from workloads.patch import apply_patch
from workloads.rows import read_rows, require_columns
from workloads.scoring import score
from workloads.swe import (
    MAX_TASK_BYTES,
    SWE_IMAGE,
    SWE_LIMITS,
    files_of_tests,
    read_tree,
    require_image,
)

SWE_GYM_COLUMNS = (
    "instance_id",
    "repo",
    "base_commit",
    "problem_statement",
    "FAIL_TO_PASS",
    "PASS_TO_PASS",
)
"""Columns an instance file must have."""

_TASK_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")


def _test_list(value: Any, column: str, where: dict[str, Any]) -> list[str]:
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except ValueError:
            raise InvalidRequest(f"{column} is not a JSON list", column=column, **where) from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InvalidRequest(f"{column} must be a list of test ids", column=column, **where)
    return list(value)


def _instance_key(instance_id: str) -> str:
    return instance_id.replace("__", "_1776_").lower()


def git_export(repo: Path, commit: str) -> dict[str, bytes]:
    """The files of ``repo`` at ``commit`` (``git archive``); ``NotFound`` for an unknown commit."""
    try:
        out = subprocess.run(
            ["git", "-C", str(repo), "archive", "--format=tar", commit],
            capture_output=True,
            timeout=120,
            check=False,
        )
    except FileNotFoundError:
        raise NotFound("git is needed to export the repository", repo=str(repo)) from None
    if out.returncode != 0:
        raise NotFound(
            "base_commit not found in the repository",
            repo=str(repo),
            commit=commit,
            error=out.stderr.decode(errors="replace")[-300:],
        )
    files: dict[str, bytes] = {}
    total = 0
    with tarfile.open(fileobj=io.BytesIO(out.stdout)) as tf:
        for member in tf.getmembers():
            if not member.isfile():
                continue
            f = tf.extractfile(member)
            if f is None:
                continue
            data = f.read()
            total += len(data)
            if total > MAX_TASK_BYTES:
                raise InvalidRequest("repository too large for a sandbox", repo=str(repo))
            files[member.name] = data
    return files


class SweGymWorkload:
    """``swe-gym``: instances of a SWE-Gym / SWE-bench file. Options: ``path`` (the file),
    ``repos_dir``, ``image_template``, ``image`` (for local repositories; default
    ``belayer-swe:1``), ``check_images`` (default true), ``held_out`` (last rows kept for
    evaluation; default a tenth)."""

    name = "swe-gym"

    def __init__(
        self,
        *,
        path: str | Path,
        repos_dir: str | Path | None = None,
        image_template: str = "",
        image: str = SWE_IMAGE,
        check_images: bool = True,
        held_out: int = -1,
    ) -> None:
        self.path = Path(path)
        rows = read_rows(self.path)
        require_columns(rows, SWE_GYM_COLUMNS, self.path)
        self.repos_dir = Path(repos_dir) if repos_dir is not None else None
        self.image_template = image_template
        self.image = image
        self.all = [self._task(i, row) for i, row in enumerate(rows)]
        if check_images:
            for img in sorted({t.sandbox.image for t in self.all if t.sandbox is not None}):
                require_image(img)
        self.train, self.evaluation = split_held_out(self.all, held_out)

    def _task(self, i: int, row: dict[str, Any]) -> Task:
        where: dict[str, Any] = {"path": str(self.path), "row": i}
        instance_id = str(row["instance_id"])
        task_id = instance_id.replace(".", "_")
        if not _TASK_ID.fullmatch(task_id):
            raise InvalidRequest(
                "instance_id is not a valid task id", instance=instance_id, **where
            )
        f2p = _test_list(row["FAIL_TO_PASS"], "FAIL_TO_PASS", where)
        p2p = _test_list(row["PASS_TO_PASS"], "PASS_TO_PASS", where)
        if not f2p:
            raise InvalidRequest("FAIL_TO_PASS is empty", instance=instance_id, **where)
        test_patch = str(row.get("test_patch") or "")
        command = str(row.get("test_command") or row.get("test_cmd") or "")
        image = str(row.get("image") or "")
        if not image and self.image_template:
            image = self.image_template.format(
                instance_id=instance_id, repo=row["repo"], instance_key=_instance_key(instance_id)
            )
        if image:  # the repository is inside the image
            workdir = str(row.get("workdir") or "/testbed")
            files: dict[str, bytes] = {}
            hidden = HiddenTests(
                fail_to_pass=f2p, pass_to_pass=p2p, test_patch=test_patch, command=command
            )
        else:
            workdir = str(row.get("workdir") or "/root/repo")
            image = self.image
            files = self._local_files(row, instance_id, where)
            patched = apply_patch(files, test_patch) if test_patch else {}
            restore = {p: files[p] for p in files_of_tests(f2p + p2p) if p in files}
            hidden = HiddenTests(
                fail_to_pass=f2p, pass_to_pass=p2p, files={**restore, **patched}, command=command
            )
        return Task(
            id=task_id,
            workload=self.name,
            prompt=[
                ChatMessage(role="system", content=SWE_INSTRUCTION.format(workdir=workdir)),
                ChatMessage(role="user", content=str(row["problem_statement"]).strip()),
            ],
            reward=hidden,
            sandbox=SandboxSpec(
                image=image, workdir=workdir, files=files, setup=str(row.get("setup") or "")
            ),
            limits=SWE_LIMITS,
            metadata={
                "source": str(self.path),
                "row": str(i),
                "instance_id": instance_id,
                "repo": str(row["repo"]),
                "base_commit": str(row["base_commit"]),
            },
        )

    def _local_files(
        self, row: dict[str, Any], instance_id: str, where: dict[str, Any]
    ) -> dict[str, bytes]:
        if row.get("repo_path"):
            repo = Path(str(row["repo_path"]))
            if not repo.is_absolute():
                repo = self.path.parent / repo
        elif self.repos_dir is not None:
            repo = self.repos_dir / str(row["repo"]).replace("/", "__")
        else:
            raise NotFound(
                "no repository for the instance: give it an image (image column or image_template) "
                "or a local checkout (repo_path column or repos_dir)",
                instance=instance_id,
                **where,
            )
        if not repo.is_dir():
            raise NotFound("repository not found", instance=instance_id, repo=str(repo), **where)
        if (repo / ".git").exists():
            if not row["base_commit"]:
                raise InvalidRequest(
                    "base_commit is empty for a git repository", instance=instance_id, **where
                )
            return git_export(repo, str(row["base_commit"]))
        return read_tree(repo)

    def tasks(self, count: int, seed: int = 0) -> list[Task]:
        check_count(count, len(self.train), what="swe-gym tasks")
        order = list(self.train)
        random.Random(seed).shuffle(order)
        return order[:count]

    def held_out(self, count: int) -> list[Task]:
        check_count(count, len(self.evaluation), what="swe-gym held-out tasks")
        return self.evaluation[:count]

    def task(self, task_id: str) -> Task:
        return find_task(self.all, task_id, self.name)

    async def reward(self, task: Task, outcome: Outcome) -> float:
        return (await score(task, outcome)).reward
