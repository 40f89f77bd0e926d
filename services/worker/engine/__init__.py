"""The rollout worker's inference engine: pure, synchronous, no networking (nano-vllm style)."""

from services.worker.engine.config import EngineConfig
from services.worker.engine.llm_engine import GenerationResult, LLMEngine, StepOutput
from services.worker.engine.sequence import SamplingParams, Sequence, SequenceStatus

__all__ = [
    "EngineConfig",
    "GenerationResult",
    "LLMEngine",
    "SamplingParams",
    "Sequence",
    "SequenceStatus",
    "StepOutput",
]
