"""The worker's engine interface, and the backends behind it.

A worker drives its engine only through :class:`EngineBackend` — queue a request (a resumed one
is its prompt plus the tokens a previous worker generated, ``generated_offset`` of them), abort
one, run a step, switch weights — so the engine can be swapped without touching the bus side
(``services/worker/runtime.py``). Two backends:

``belayer`` (the default): :class:`~services.worker.engine.llm_engine.LLMEngine`, on the CPU or
on ``cuda`` (``--device``); the weights are the weight store's mapped memory (copied to the GPU
on ``cuda``).

``sglang``: :class:`~services.worker.sglang_engine.SglangEngine`, SGLang's offline ``Engine``
for GPU nodes; it loads the weights from the model directory on disk and needs ``cuda`` and the
``sglang`` package. Selecting it anywhere else fails at start with one line
(:func:`check_backend`). ``services/worker/backends.py`` builds the one the config names (the
sglang one drives SGLang's event loop, so it lives outside this pure package).

Importing this module imports neither torch nor sglang.
"""

from __future__ import annotations

import importlib.util
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal, get_args

if TYPE_CHECKING:
    from torch import Tensor

    from services.worker.engine.llm_engine import StepOutput
    from services.worker.engine.sequence import SamplingParams

EngineBackendName = Literal["belayer", "sglang"]
"""What ``--engine-backend`` may say."""

BACKENDS: tuple[str, ...] = get_args(EngineBackendName)


class EngineBackend(ABC):
    """What the worker's scheduling loop and its handover need from an engine. Every backend
    derives from it: :meth:`add_request` makes the checks common to all of them, then the
    backend queues the request (:meth:`_queue`)."""

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        generated_offset: int = 0,
    ) -> None:
        """Queue a request. ``generated_offset`` = tokens at the end of the prompt that a
        previous worker generated (a resume). ``ValueError`` (one line) for one the engine can
        never serve: a duplicate id, an offset outside the prompt, or the backend's own
        refusals (an empty prompt, one that leaves no room under ``max_model_len``, …)."""
        if self._is_live(request_id):
            raise ValueError(f"duplicate request id {request_id!r}")
        if generated_offset < 0 or generated_offset > len(prompt_token_ids):
            raise ValueError(f"generated_offset={generated_offset} outside the prompt")
        self._queue(request_id, prompt_token_ids, sampling, generated_offset)

    @abstractmethod
    def _is_live(self, request_id: str) -> bool:
        """Whether ``request_id`` is queued or running (not finished, not aborted)."""

    @abstractmethod
    def _queue(self, rid: str, prompt: list[int], sampling: SamplingParams, offset: int) -> None:
        """Queue a request that passed :meth:`add_request`'s checks (or refuse it)."""

    @abstractmethod
    def abort_request(self, request_id: str) -> bool:
        """Stop a request; the next step reports it finished with ``abort``."""

    @abstractmethod
    def step(self) -> list[StepOutput]:
        """New tokens (and finishes) since the last step, one output per request."""

    @abstractmethod
    def has_unfinished(self) -> bool: ...

    @property
    @abstractmethod
    def num_running(self) -> int: ...

    @property
    @abstractmethod
    def num_waiting(self) -> int: ...

    @abstractmethod
    def warmup(self) -> None:
        """Pay first-call costs ahead of time; also the shadow's health check."""

    @abstractmethod
    def load_weights(self, params: dict[str, Tensor]) -> None:
        """Switch to another weight version between steps."""


def sglang_importable() -> bool:
    """Whether the ``sglang`` package is installed (without importing it)."""
    return importlib.util.find_spec("sglang") is not None


def check_backend(
    backend: str, device: str, *, has_sglang: Callable[[], bool] = sglang_importable
) -> None:
    """Refuse, in one line (``ValueError``), a backend this process cannot run: an unknown
    name, or ``sglang`` without ``cuda`` (``device`` is the resolved one) or without the
    ``sglang`` package."""
    if backend not in BACKENDS:
        raise ValueError(f"engine backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend != "sglang":
        return
    if device != "cuda":
        raise ValueError(
            f"engine backend 'sglang' runs on a GPU only, but the device is {device!r} "
            "(use --device cuda on a machine with CUDA, or --engine-backend belayer)"
        )
    if not has_sglang():
        raise ValueError(
            "engine backend 'sglang' needs the sglang package, which is not installed here "
            "(pip install sglang on the GPU node, or --engine-backend belayer)"
        )
