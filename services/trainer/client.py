"""What other services and users call: the trainer's config (the supervisor starts it from
it) and its status. Importing this module does not load torch; the GRPO math itself is
``services.trainer.core`` (``grpo_loss``, ``group_advantages``)."""

from __future__ import annotations

import json
from pathlib import Path

from nats.aio.client import Client as NATS

from common import subjects
from common.bus import request
from schemas.trainer import TrainerStatus, TrainerStatusRequest
from services.trainer import journal
from services.trainer.config import GrpoConfig, LossType, TrainerConfig

__all__ = [
    "GrpoConfig",
    "LossType",
    "TrainerConfig",
    "checkpoint_version",
    "drop_unreplayable_plans",
    "roll_back_to",
    "trainer_status",
]


def drop_unreplayable_plans(checkpoint_dir: Path) -> list[int]:
    """Remove the durable plans of the steps after the trainer's latest checkpoint (a fresh
    node's bus holds none of their trajectories, so they cannot be redone from the plan: the
    run redoes them with new rollouts). Returns those steps. No torch, no bus."""
    latest = journal.latest_checkpoint(checkpoint_dir)
    step = latest[0] if latest else 0
    dropped = []
    for plan in journal.plans_after(checkpoint_dir, step):
        journal.plan_path(checkpoint_dir, plan.step).unlink(missing_ok=True)
        dropped.append(plan.step)
    return dropped


def roll_back_to(checkpoint_dir: Path, step: int) -> list[int]:
    """Make ``step`` the trainer's latest checkpoint again: remove the checkpoints after it (a
    run stopped after the trainer checkpointed a step but before the run recorded it redoes
    that step), when one at or before ``step`` remains. Returns the steps removed. No torch,
    no bus."""
    return journal.remove_checkpoints_after(checkpoint_dir, step)


def checkpoint_version(checkpoint_dir: Path) -> int:
    """The weight version the trainer's latest checkpoint holds (0: none, or unreadable).
    No torch, no bus."""
    found = journal.latest_checkpoint(checkpoint_dir)
    if found is None:
        return 0
    try:
        return int(json.loads((found[1] / "meta.json").read_text()).get("version", 0))
    except (OSError, ValueError, TypeError, AttributeError):
        return 0


async def trainer_status(nc: NATS, timeout: float = 2.0) -> TrainerStatus:
    """Where the trainer stands; ``BusUnavailable`` when no trainer runs."""
    reply: TrainerStatus = await request(
        nc, subjects.trainer_status(), TrainerStatusRequest(), TrainerStatus, timeout=timeout
    )
    return reply
