"""Which torch device a service computes on: the one choice the worker's engine and the trainer
share (their ``device`` field, flag ``--device auto|cpu|cuda``).

``cpu`` is the default everywhere, so nothing changes where no GPU is configured. ``cuda``
refuses to start without a usable CUDA device (one clear line, not a traceback deep in torch);
``auto`` takes ``cuda`` when torch sees one and ``cpu`` otherwise. Importing this module does not
import torch; :func:`resolve_device` does, only to ask whether CUDA is there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, get_args

DeviceChoice = Literal["auto", "cpu", "cuda"]
"""What a config may say; :func:`resolve_device` turns it into ``cpu`` or ``cuda``."""

DEVICE_CHOICES: tuple[str, ...] = get_args(DeviceChoice)


class DeviceUnavailable(ValueError):
    """``cuda`` was asked for where torch sees no CUDA device (or an unknown choice)."""


def cuda_available() -> bool:
    """Whether torch sees a usable CUDA device (imports torch)."""
    import torch

    return bool(torch.cuda.is_available())


def resolve_device(choice: str, *, has_cuda: Callable[[], bool] = cuda_available) -> str:
    """``cpu`` or ``cuda`` for a config's ``choice``; ``has_cuda`` is asked only when it matters
    (``auto``/``cuda``). Raises :class:`DeviceUnavailable` (one line) for ``cuda`` without a
    CUDA device, or for a choice that is none of ``auto``, ``cpu``, ``cuda``."""
    if choice not in DEVICE_CHOICES:
        raise DeviceUnavailable(
            f"device must be one of {', '.join(DEVICE_CHOICES)}, got {choice!r}"
        )
    if choice == "cpu":
        return "cpu"
    if has_cuda():
        return "cuda"
    if choice == "auto":
        return "cpu"
    raise DeviceUnavailable(
        "device 'cuda' was asked for but torch sees no CUDA device here "
        "(no GPU, or a CPU-only torch build); use --device cpu or --device auto"
    )
