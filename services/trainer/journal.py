"""The trainer's files under ``checkpoint_dir`` (pure file I/O, no bus):

```
<checkpoint_dir>/
  step-00000000/        checkpoint after 0 steps (written at the first start)
  step-00000003/        model.safetensors, train_state.pt, meta.json (model.training)
  plans/step-00000004.json   the batch of step 4, durable before step 4 trains
  reference.safetensors      the starting weights (the KL reference, with beta > 0)
```

A **plan** fixes a step's batch — its trajectory ids in order and the version it starts
from — before the update runs, and counts the tries of that update (a batch the update keeps
failing on is dead-lettered after ``step_attempts``, its plan removed). A trainer killed mid-step (or between checkpoints) restarts
from its latest checkpoint and redoes every planned step after it with exactly the planned
trajectories (redelivered, since they were never acked), so the redone update is the same
update, bit for bit, and no trajectory is trained twice or dropped. Every file is written
atomically (temporary file or directory, fsync, rename).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHECKPOINT_PREFIX = "step-"
PLANS = "plans"
REFERENCE = "reference.safetensors"


@dataclass(frozen=True)
class Plan:
    """The batch of one step."""

    step: int
    """The step it is (checkpoint ``step - 1`` or a replayed plan precedes it)."""
    base_version: int
    """Weight version the update starts from."""
    trajectory_ids: tuple[str, ...]
    """The batch, in training order."""
    attempts: int = 0
    """Tries of this step's update so far (by this trainer and any that died on it)."""


def checkpoint_path(root: Path, step: int) -> Path:
    return Path(root) / f"{CHECKPOINT_PREFIX}{step:08d}"


def checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root`` (a ``meta.json`` inside), oldest first."""
    out: list[tuple[int, Path]] = []
    if not Path(root).is_dir():
        return out
    for p in Path(root).iterdir():
        name = p.name
        if not name.startswith(CHECKPOINT_PREFIX) or "." in name:
            continue
        digits = name[len(CHECKPOINT_PREFIX) :]
        if digits.isdigit() and (p / "meta.json").exists():
            out.append((int(digits), p))
    return sorted(out)


def latest_checkpoint(root: Path) -> tuple[int, Path] | None:
    found = checkpoints(root)
    return found[-1] if found else None


def remove_checkpoints_after(root: Path, step: int) -> list[int]:
    """Remove the checkpoints of the steps after ``step``, newest first, when one at or before
    ``step`` remains to restart from (else nothing); returns the steps removed. Each goes out
    of sight at once (renamed to a name :func:`checkpoints` skips, then deleted)."""
    found = checkpoints(root)
    if not any(s <= step for s, _ in found):
        return []
    removed = []
    for s, p in reversed([(s, p) for s, p in found if s > step]):
        hidden = p.with_name(f"{p.name}.old-{os.getpid()}")
        os.replace(p, hidden)
        shutil.rmtree(hidden, ignore_errors=True)
        removed.append(s)
    return sorted(removed)


def write_json_atomic(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(data, f, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def plan_path(root: Path, step: int) -> Path:
    return Path(root) / PLANS / f"{CHECKPOINT_PREFIX}{step:08d}.json"


def write_plan(root: Path, plan: Plan) -> None:
    write_json_atomic(
        plan_path(root, plan.step),
        {
            "step": plan.step,
            "base_version": plan.base_version,
            "trajectory_ids": list(plan.trajectory_ids),
            "attempts": plan.attempts,
        },
    )


def read_plan(path: Path) -> Plan:
    data = json.loads(Path(path).read_text())
    return Plan(
        int(data["step"]),
        int(data["base_version"]),
        tuple(data["trajectory_ids"]),
        int(data.get("attempts", 0)),
    )


def plans_after(root: Path, step: int) -> list[Plan]:
    """The contiguous run of plans for steps ``step + 1, step + 2, …`` (a gap ends it)."""
    out = []
    nxt = step + 1
    while plan_path(root, nxt).exists():
        out.append(read_plan(plan_path(root, nxt)))
        nxt += 1
    return out


def remove_plans_from(root: Path, step: int) -> list[Path]:
    """Remove the plans of ``step`` and later (a dropped batch: its step is planned afresh
    with the next batch); returns what was removed."""
    removed = [plan_path(root, p.step) for p in plans_after(root, step - 1)]
    for f in removed:
        f.unlink(missing_ok=True)
    if removed:
        fd = os.open(Path(root) / PLANS, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return removed


def prune(root: Path, keep: int) -> list[Path]:
    """Remove all but the newest ``keep`` checkpoints, the plans of steps the oldest kept
    checkpoint already holds (the others stay: what each step after it trained on), and
    leftovers of interrupted writes; returns what was removed."""
    root = Path(root)
    found = checkpoints(root)
    removed = [p for _, p in found[:-keep]] if keep > 0 else []
    kept = found[-keep:] if keep > 0 else found
    oldest = kept[0][0] if kept else -1
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    plans = root / PLANS
    if plans.is_dir():
        for f in plans.iterdir():
            digits = f.name.removeprefix(CHECKPOINT_PREFIX).removesuffix(".json")
            if f.name.startswith(".") or (digits.isdigit() and int(digits) <= oldest):
                f.unlink(missing_ok=True)
                removed.append(f)
    for p in root.iterdir() if root.is_dir() else []:
        if p.name.startswith(CHECKPOINT_PREFIX) and (".tmp-" in p.name or ".old-" in p.name):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed
