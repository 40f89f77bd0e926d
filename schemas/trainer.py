"""Messages of the GRPO trainer (``belayer.trainer.*``). The trainer consumes ``Trajectory``
records (``schemas/rollout.py``) from stream ``TRAJECTORIES`` and reports each step as a
``train_step`` event (``schemas/events.py``); this is its request/reply surface."""

from __future__ import annotations

from schemas.base import Message


class TrainerStatusRequest(Message, tag="TrainerStatusRequest.v1"):
    """Request on ``belayer.trainer.status``: answered with ``TrainerStatus``."""


class TrainerStatus(Message, tag="TrainerStatus.v1"):
    """Where the trainer stands."""

    step: int
    """Updates done (checkpointed or not)."""
    version: int
    """Weight version of the trainer's current weights."""
    checkpoint_step: int
    """Steps the latest durable checkpoint holds."""
    trained: int
    """Trajectories trained on so far."""
    held: int
    """Trajectories held for a batch (incomplete groups, or a future version)."""
    refused: int
    """Trajectories acked without training (malformed, stale, duplicate) since it started."""
    group_size: int
    """Samples per group (``n``)."""
    batch_size: int
    """Trajectories per step."""
    replaying: int
    """Planned steps still to redo after a restart (0 in normal running)."""
    pid: int = 0
    """The trainer's process id."""
    busy: bool = False
    """An update is running right now."""
