"""The ``sglang`` engine backend: SGLang's offline ``Engine`` behind the worker's engine interface
(:class:`~services.worker.engine.backend.EngineBackend`), for GPU nodes.

Not run in this project yet: no GPU was available where it was written. ``sglang`` is imported
only when this backend is built (``--engine-backend sglang``), and only through
``importlib``, so neither importing Belayer nor type-checking it needs the package.

Mapping. A request (a fresh one, or a resumed one whose prompt already ends with the
``generated_offset`` tokens a dead worker produced — the router sends the remaining
``max_tokens``) becomes one streamed ``Engine.async_generate(input_ids=..., sampling_params=...,
return_logprob=True, stream=True, rid=...)``; each streamed chunk's new tokens and their
log-probabilities become one :class:`StepOutput`, which :meth:`SglangEngine.step` hands to the
scheduling loop. Aborts go to the tokenizer manager's ``abort_request``; weight versions to
``update_weights_from_tensor``. SGLang schedules and batches on its own, keeps its own KV cache
on the GPU, reads the weights from the model directory at start, and with
``EngineConfig.deterministic`` runs with ``enable_deterministic_inference`` (its
batch-invariant kernels). Greedy resumes are exact wherever its kernels are; a seeded sampled
request passes its seed as ``sampling_seed``, and whether a resume then redraws the same tokens
is SGLang's guarantee, not Belayer's.

The engine's asyncio loop: SGLang's ``Engine`` keeps the loop it was built on. It is built in a
thread of its own, where no loop runs, so it makes a private one, which that thread then runs
(recent SGLang skips its signal handlers off the main thread). Every call crosses to that loop
with ``run_coroutine_threadsafe``: neither the worker's asyncio loop nor the scheduling loop's
thread ever runs SGLang's coroutines, so a blocking call from either cannot deadlock.
"""

from __future__ import annotations

import asyncio
import importlib
import queue
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from services.worker.engine.backend import EngineBackend
from services.worker.engine.llm_engine import StepOutput

if TYPE_CHECKING:
    from torch import Tensor

    from model.config import ModelConfig
    from services.worker.engine.config import EngineConfig
    from services.worker.engine.sequence import SamplingParams

STEP_WAIT_S = 0.01
"""How long :meth:`SglangEngine.step` waits for a first new token before returning none."""
CALL_TIMEOUT_S = 120.0
"""Longest wait for a blocking call into SGLang (warm-up, a weight switch)."""


def sampling_params(sampling: SamplingParams) -> dict[str, Any]:
    """The engine's sampling parameters as SGLang's ``sampling_params`` dict (greedy:
    temperature 0, which SGLang turns into top-k 1)."""
    out: dict[str, Any] = {
        "temperature": 0.0 if sampling.greedy else sampling.temperature,
        "top_p": sampling.top_p,
        "max_new_tokens": sampling.max_tokens,
        "stop_token_ids": list(sampling.stop_token_ids),
        "ignore_eos": sampling.ignore_eos,
    }
    if sampling.seed is not None and not sampling.greedy:
        out["sampling_seed"] = sampling.seed
    return out


def finish_reason(meta: dict[str, Any]) -> str | None:
    """SGLang's ``meta_info["finish_reason"]`` (``None`` or ``{"type": ...}``) as the engine's
    ``stop`` / ``length`` / ``abort`` (``None`` while the request runs)."""
    reason = meta.get("finish_reason")
    if reason is None:
        return None
    kind = reason.get("type") if isinstance(reason, dict) else str(reason)
    return kind if kind in ("stop", "length", "abort") else "stop"


def new_tokens(meta: dict[str, Any], seen: int) -> tuple[list[int], list[float], int]:
    """The tokens a streamed chunk adds after ``seen`` earlier ones, their log-probabilities,
    and the new total. Works whether SGLang streams the whole output so far or only the
    increment (``incremental_streaming_output``): ``completion_tokens`` is always the total,
    and the newest entries of ``output_token_logprobs`` (``(logprob, token_id, text)``) are the
    new tokens."""
    total = int(meta.get("completion_tokens", 0))
    pairs = list(meta.get("output_token_logprobs") or [])
    fresh = pairs[len(pairs) - (total - seen) :] if total > seen else []
    return [int(p[1]) for p in fresh], [float(p[0]) for p in fresh], max(total, seen)


class SglangEngine(EngineBackend):
    """SGLang's offline engine, driven as the worker's engine (see the module doc)."""

    def __init__(
        self, model_dir: str, model_config: ModelConfig, config: EngineConfig, **engine_args: Any
    ) -> None:
        """Start SGLang on ``model_dir`` (an HF directory); ``engine_args`` go to its
        ``Engine`` on top of the ones the engine config implies."""
        self.model_config = model_config
        self.config = config
        args: dict[str, Any] = {
            "model_path": model_dir,
            "skip_tokenizer_init": True,
            "context_length": config.max_model_len,
            "max_running_requests": config.max_num_seqs,
            "enable_deterministic_inference": config.deterministic,
            "log_level": "error",
        }
        args.update(engine_args)
        built: Future[Any] = Future()
        self._thread = threading.Thread(
            target=_serve, args=(args, built), name="sglang-loop", daemon=True
        )
        self._thread.start()
        self.engine: Any = built.result()  # SGLang's start-up error, if any, is raised here
        self.loop: asyncio.AbstractEventLoop = self.engine.loop
        self._outputs: queue.SimpleQueue[StepOutput] = queue.SimpleQueue()
        self._live: dict[str, Future[None]] = {}
        self._lock = threading.Lock()

    # --- requests -------------------------------------------------------------------------
    def _is_live(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._live

    def _queue(self, rid: str, prompt: list[int], sampling: SamplingParams, offset: int) -> None:
        """Stream one request; a resumed one's prompt already holds its ``offset`` earlier
        tokens (SGLang simply prefills them)."""
        if not prompt:
            raise ValueError(f"{rid}: empty prompt")
        if len(prompt) >= self.config.max_model_len:
            raise ValueError(
                f"{rid}: prompt of {len(prompt)} tokens leaves no room under "
                f"max_model_len={self.config.max_model_len}"
            )
        coro = self._stream(rid, list(prompt), sampling_params(sampling))
        with self._lock:
            self._live[rid] = asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def _stream(self, rid: str, input_ids: list[int], params: dict[str, Any]) -> None:
        seen = 0
        try:
            chunks = await self.engine.async_generate(
                input_ids=input_ids,
                sampling_params=params,
                return_logprob=True,
                stream=True,
                rid=rid,
            )
            async for chunk in chunks:
                meta = chunk.get("meta_info", {})
                ids, lps, seen = new_tokens(meta, seen)
                reason = finish_reason(meta)
                if ids or reason is not None:
                    self._emit(StepOutput(rid, ids, lps, reason is not None, reason))
                if reason is not None:
                    return
            self._emit(StepOutput(rid, [], [], True, "stop"))
        except Exception:  # one request's failure is that request's, not the worker's
            self._emit(StepOutput(rid, [], [], True, "error"))

    def _emit(self, out: StepOutput) -> None:
        with self._lock:
            if out.request_id not in self._live:
                return  # aborted: its abort output was already reported
            if out.finished:
                del self._live[out.request_id]
        self._outputs.put(out)

    def abort_request(self, request_id: str) -> bool:
        with self._lock:
            if self._live.pop(request_id, None) is None:
                return False
        self.loop.call_soon_threadsafe(
            lambda: self.engine.tokenizer_manager.abort_request(rid=request_id)
        )
        self._outputs.put(StepOutput(request_id, [], [], True, "abort"))
        return True

    def step(self) -> list[StepOutput]:
        """What arrived since the last step (waits up to ``STEP_WAIT_S`` for the first)."""
        out: list[StepOutput] = []
        try:
            out.append(self._outputs.get(timeout=STEP_WAIT_S))
            while True:
                out.append(self._outputs.get_nowait())
        except queue.Empty:
            return out

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._live) or not self._outputs.empty()

    @property
    def num_running(self) -> int:
        with self._lock:
            return len(self._live)

    @property
    def num_waiting(self) -> int:
        return 0  # SGLang queues internally; its running count covers them

    # --- engine-wide ------------------------------------------------------------------------
    def warmup(self) -> None:
        """Two greedy tokens end to end (also the shadow's health check)."""
        coro = self.engine.async_generate(
            input_ids=[1, 2, 3], sampling_params={"temperature": 0.0, "max_new_tokens": 2}
        )
        asyncio.run_coroutine_threadsafe(coro, self.loop).result(CALL_TIMEOUT_S)

    def load_weights(self, params: dict[str, Tensor]) -> None:
        """Switch SGLang to ``params`` (HF names) between its steps; its prefix cache is
        flushed with them."""
        io_struct = importlib.import_module("sglang.srt.managers.io_struct")
        utils = importlib.import_module("sglang.srt.utils")
        named = list(params.items())
        req = io_struct.UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=[utils.MultiprocessingSerializer.serialize(named)],
            load_format=None,
            flush_cache=True,
        )
        coro = self.engine.tokenizer_manager.update_weights_from_tensor(req, None)
        asyncio.run_coroutine_threadsafe(coro, self.loop).result(CALL_TIMEOUT_S)

    def shutdown(self) -> None:
        self.engine.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)


def _serve(args: dict[str, Any], built: Future[Any]) -> None:
    """The SGLang thread: build the ``Engine`` here (no loop runs in this thread, so it makes
    its own), hand it over, then run its loop until :meth:`SglangEngine.shutdown`."""
    try:
        engine = importlib.import_module("sglang").Engine(**args)
    except BaseException as exc:
        built.set_exception(exc)
        return
    built.set_result(engine)
    engine.loop.run_forever()
