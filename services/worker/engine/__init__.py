"""The rollout worker's inference engine: pure, synchronous, no networking (nano-vllm style).

``config`` (``EngineConfig``, light: the worker's and the supervisor's configs nest it),
``llm_engine`` (``LLMEngine``), ``scheduler``, ``block_manager``, ``model_runner``, ``sampler``,
``sequence``. Nothing is imported here, so importing the config does not import torch."""
