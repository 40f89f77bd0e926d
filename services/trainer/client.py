"""What other services and users call: the trainer's config (the supervisor starts it from
it) and its status. Importing this module does not load torch; the GRPO math itself is
``services.trainer.core`` (``grpo_loss``, ``group_advantages``)."""

from __future__ import annotations

from nats.aio.client import Client as NATS

from common import subjects
from common.bus import request
from schemas.trainer import TrainerStatus, TrainerStatusRequest
from services.trainer.config import GrpoConfig, TrainerConfig

__all__ = ["GrpoConfig", "TrainerConfig", "trainer_status"]


async def trainer_status(nc: NATS, timeout: float = 2.0) -> TrainerStatus:
    """Where the trainer stands; ``BusUnavailable`` when no trainer runs."""
    reply: TrainerStatus = await request(
        nc, subjects.trainer_status(), TrainerStatusRequest(), TrainerStatus, timeout=timeout
    )
    return reply
