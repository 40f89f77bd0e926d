"""Build the engine a worker's config names (``--engine-backend``), behind the worker's engine
interface (:class:`~services.worker.engine.backend.EngineBackend`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.worker.engine.backend import EngineBackend, check_backend

if TYPE_CHECKING:
    from torch import Tensor

    from model.config import ModelConfig
    from services.worker.engine.config import EngineConfig


def build_engine(
    backend: str,
    model_config: ModelConfig,
    params: dict[str, Tensor],
    kv_cache: Tensor,
    config: EngineConfig,
    *,
    device: str,
    model_dir: str,
) -> EngineBackend:
    """The engine ``backend`` names, after :func:`check_backend`. ``params``/``kv_cache`` are
    the weight store's and the KV arena's tensors (the ``sglang`` backend keeps its own KV
    cache and reads the weights from ``model_dir``)."""
    check_backend(backend, device)
    if backend == "sglang":
        from services.worker.sglang_engine import SglangEngine

        return SglangEngine(model_dir, model_config, config)
    from services.worker.engine.llm_engine import LLMEngine

    return LLMEngine(model_config, params, kv_cache, config, device=device)
