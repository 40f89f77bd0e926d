"""The engine core: ``step()`` = schedule → run the model → sample → postprocess.

Pure and synchronous (no bus, no asyncio). The weights and the KV cache are tensors the
caller hands in, normally zero-copy views of shared memory owned by the weight store and the
KV arena; the engine never copies or reallocates them.

With ``EngineConfig.deterministic`` the model runs its batch-invariant forward
(:mod:`model.batch_invariant`) and the warm-up checks that it really is batch-invariant on this
machine; every draw of the sampler is a pure function of ``(seed, token index)``, and a request
without a seed gets one of its own when it is added, so no request's samples depend on
another's.

``device`` (``cpu`` or ``cuda``, resolved by :func:`common.device.resolve_device`): on the CPU
the weights and the cache are used in place; on ``cuda`` the engine copies the weights to the
GPU and keeps a KV cache of the same geometry there, its own (a handover resumes from tokens,
not from the previous worker's KV memory: the arena is flushed on every claim). The
batch-invariant kernels are the CPU's; ``cuda`` needs ``deterministic=False`` (on GPUs that
guarantee is SGLang's ``--enable-deterministic-inference``: the ``sglang`` backend).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import torch
from torch import Tensor

from model.config import ModelConfig
from model.fused import prepare_for_inference
from model.qwen3 import Qwen3ForCausalLM, build_model, kv_cache_shape
from services.worker.engine.backend import EngineBackend
from services.worker.engine.config import EngineConfig
from services.worker.engine.draft import PROMPT_LOOKUP_MAX, PromptLookup, share_rows
from services.worker.engine.model_runner import ModelRunner
from services.worker.engine.sampler import Sampler
from services.worker.engine.scheduler import Scheduler
from services.worker.engine.sequence import SamplingParams, Sequence


@dataclass
class StepOutput:
    """What one request produced in one step."""

    request_id: str
    new_token_ids: list[int]
    """Tokens generated in this step (empty for an abort)."""
    new_logprobs: list[float]
    """Logprob of each new token (see :mod:`sampler` for which distribution)."""
    finished: bool
    finish_reason: str | None = None
    """``stop`` (EOS or a stop token), ``length`` (max_tokens / max_model_len) or ``abort``."""


@dataclass
class GenerationResult:
    """A whole request's output, from :meth:`LLMEngine.generate`."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None


class LLMEngine(EngineBackend):
    """Continuous-batching inference over mapped weights and a mapped KV cache."""

    def __init__(
        self,
        model_config: ModelConfig,
        params: dict[str, Tensor],
        kv_cache: Tensor,
        config: EngineConfig | None = None,
        *,
        eos_token_ids: tuple[int, ...] | None = None,
        sampler_seed: int | None = None,
        device: str = "cpu",
    ) -> None:
        """``params`` are HF-named weights; ``kv_cache`` has
        :func:`~model.qwen3.kv_cache_shape` for ``config``'s geometry and starts
        finite (zeros). ``eos_token_ids`` defaults to the model config's; ``sampler_seed``
        seeds the random stream of requests that carry no seed. ``device``: see the module doc.
        """
        self.model_config = model_config
        self.config = config = config or EngineConfig()
        _check_kv_cache(model_config, config, kv_cache)
        self.device = torch.device(device)
        if self.device.type != "cpu":
            if config.deterministic:
                raise ValueError(
                    f"deterministic mode runs on the CPU only in the belayer engine; on "
                    f"{device} turn it off (--no-engine-deterministic) or use the sglang backend"
                )
            params = _on_device(params, self.device)
            kv_cache = torch.zeros_like(kv_cache, device=self.device)
        if config.max_model_len > model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len={config.max_model_len} exceeds the model's "
                f"max_position_embeddings={model_config.max_position_embeddings}"
            )
        self.model = self._build_model(params)
        eos = model_config.eos_token_id if eos_token_ids is None else eos_token_ids
        self.scheduler = Scheduler(config, eos)
        self.runner = ModelRunner(self.model, kv_cache, config.block_size)
        self.sampler = Sampler(sampler_seed, model_config.output_vocab_size)
        self._live: dict[str, Sequence] = {}
        self._pending: list[StepOutput] = []
        self._ids = itertools.count()
        self._speculates = (
            config.deterministic and config.speculative_tokens > 0 and config.speculative_rows > 0
        )
        self._lookups: dict[str, PromptLookup] = {}
        self.draft_tokens_proposed = 0
        """Draft tokens fed to decode steps since start (speculative decoding)."""
        self.draft_tokens_accepted = 0
        """Of those, the tokens the engine kept (each equal to what one-token decoding gives)."""

    def load_weights(self, params: dict[str, Tensor]) -> None:
        """Switch to another weight version (zero copy: ``params`` are mapped views). Call it
        between steps; running requests continue on the new weights from their next token."""
        model = self._build_model(_on_device(params, self.device))
        self.model = model
        self.runner.model = model

    def _build_model(self, params: dict[str, Tensor]) -> Qwen3ForCausalLM:
        """The model over ``params``, with the engine's fused and packed products where the
        model is small enough for them to pay (:mod:`model.fused`: same bits, fewer and cheaper
        matmuls)."""
        model = build_model(self.model_config, params, deterministic=self.config.deterministic)
        prepare_for_inference(model)
        return model

    def _is_live(self, request_id: str) -> bool:
        return request_id in self._live

    def _queue(self, rid: str, prompt: list[int], sampling: SamplingParams, offset: int) -> None:
        """The generated ``offset`` shifts the seeded sampler's token index. Also refused
        (``ValueError``): token ids outside the vocabulary, an empty prompt, a prompt that
        leaves no room under ``max_model_len``, a request that could never fit the KV cache."""
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise ValueError(f"{rid}: prompt has token ids outside [0, {vocab})")
        if sampling.seed is None and not sampling.greedy:
            # A seed of its own: its draws are then (seed, j), whatever else is in the batch.
            sampling = dataclasses.replace(sampling, seed=self.sampler.new_seed())
        seq = Sequence(rid, list(prompt), sampling, offset)
        self.scheduler.add(seq)
        self._live[rid] = seq

    def abort_request(self, request_id: str) -> bool:
        """Stop a request; the next :meth:`step` reports it finished with ``abort``.
        Returns False if the id is unknown or already finished."""
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return False
        del self._live[request_id]
        self._lookups.pop(request_id, None)
        self._pending.append(StepOutput(request_id, [], [], True, "abort"))
        return True

    def step(self) -> list[StepOutput]:
        """Run one scheduling turn; one output per request that got a token or finished."""
        outputs, self._pending = self._pending, []
        if not self.scheduler.has_unfinished():
            return outputs
        seqs, is_prefill = self.scheduler.schedule()
        if not seqs:
            return outputs
        if self._speculates and not is_prefill:
            return outputs + self._speculative_step(seqs)
        logits = self.runner.run(seqs, is_prefill)
        tokens, logprobs = self.sampler(
            logits, [s.sampling for s in seqs], [s.sample_index for s in seqs]
        )
        self.scheduler.postprocess(seqs, tokens, logprobs)
        for seq, token, logprob in zip(seqs, tokens, logprobs, strict=True):
            outputs.append(self._output(seq, [token], [logprob]))
        return outputs

    def _output(self, seq: Sequence, tokens: list[int], logprobs: list[float]) -> StepOutput:
        """The step's output of ``seq`` (forgotten here once finished)."""
        if seq.is_finished:
            del self._live[seq.request_id]
            self._lookups.pop(seq.request_id, None)
        return StepOutput(seq.request_id, tokens, logprobs, seq.is_finished, seq.finish_reason)

    def _speculative_step(self, seqs: list[Sequence]) -> list[StepOutput]:
        """A decode step that also feeds each sequence's draft tokens (prompt lookup) and keeps
        the longest prefix of them the model itself produces, plus the token after it.

        Exact in deterministic mode: row ``j`` of a sequence computes position ``n - 1 + j``
        from the sequence's tokens and drafts before it, bitwise as a later one-token step
        would once those drafts are its tokens; its token is drawn with the sampler's index
        of that position (``sample_index + j``). So where the drafts agree with the drawn
        tokens, the tokens and log-probabilities are the ones one-token decoding gives."""
        drafts = self._drafts(seqs)
        logits = self.runner.run(seqs, False, drafts)
        params: list[SamplingParams] = []
        indices: list[int] = []
        for seq, draft in zip(seqs, drafts, strict=True):
            params += [seq.sampling] * (len(draft) + 1)
            indices += range(seq.sample_index, seq.sample_index + len(draft) + 1)
        tokens, logprobs = self.sampler(logits, params, indices)
        outputs, row = [], 0
        for seq, draft in zip(seqs, drafts, strict=True):
            drawn = tokens[row : row + len(draft) + 1]
            kept = 1
            while kept <= len(draft) and draft[kept - 1] == drawn[kept - 1]:
                kept += 1
            if draft:
                lookup = self._lookups[seq.request_id]
                lookup.fed, lookup.kept = lookup.fed + len(draft), lookup.kept + kept - 1
            n = self.scheduler.accept(seq, drawn[:kept], logprobs[row : row + kept])
            self.draft_tokens_proposed += len(draft)
            self.draft_tokens_accepted += n - 1
            outputs.append(self._output(seq, drawn[:n], logprobs[row : row + n]))
            row += len(draft) + 1
        return outputs

    def _drafts(self, seqs: list[Sequence]) -> list[list[int]]:
        """Each sequence's guesses, cut to ``speculative_rows`` in all (a first draft token for
        every sequence that has one, then a second, and so on), then up to
        ``speculative_rows_confident`` more for confident guesses (:meth:`_guess`)."""
        guesses = [self._guess(seq) for seq in seqs]
        cfg = self.config
        counts = share_rows([len(g) for g, _ in guesses], cfg.speculative_rows)
        confident = [len(g) if sure else 0 for g, sure in guesses]
        counts = share_rows(confident, cfg.speculative_rows_confident, counts)
        manager = self.scheduler.block_manager
        drafts = []
        for seq, (guess, _), count in zip(seqs, guesses, counts, strict=True):
            if count:
                room = manager.reserve(seq, seq.num_tokens + count, len(self.scheduler.running))
                count = min(count, room - seq.num_tokens)
            drafts.append(guess[:count])
        return drafts

    def _guess(self, seq: Sequence) -> tuple[list[int], bool]:
        """Up to ``speculative_tokens`` guesses of ``seq``'s next tokens that its budget and the
        model length leave room for (KV blocks: :meth:`_drafts` takes one only while every
        running sequence's next token still finds one free), and whether they are confident:
        found by a full-length match for a sequence whose drafts have mostly been kept
        (:attr:`~services.worker.engine.draft.PromptLookup.trusted`)."""
        cfg = self.config
        k = min(
            cfg.speculative_tokens,
            seq.sampling.max_tokens - seq.num_generated - 1,
            cfg.max_model_len - seq.num_tokens - 1,
        )
        if k < 1:
            return [], False
        lookup = self._lookups.get(seq.request_id)
        if lookup is None:
            lookup = self._lookups[seq.request_id] = PromptLookup()
        guess, match = lookup.guess(seq.token_ids, k)
        return guess, match >= PROMPT_LOOKUP_MAX and lookup.trusted

    def has_unfinished(self) -> bool:
        """True while a request waits, runs, or has an abort not yet reported."""
        return self.scheduler.has_unfinished() or bool(self._pending)

    @property
    def num_running(self) -> int:
        """Requests holding KV blocks."""
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Requests queued (new or preempted)."""
        return len(self.scheduler.waiting)

    def warmup(self) -> None:
        """Run a tiny prefill, decode and sampling so the first real step pays no first-call
        costs. Uses a private scratch cache: the shared arena may be in use by another worker.

        In deterministic mode it also checks the claim on this machine: the logits of a
        sequence's last token must be bitwise the same from a decode step (next to another
        sequence) as from a prefill of the whole sequence alone; ``RuntimeError`` otherwise.
        """
        cfg = self.config
        n = min(8, cfg.max_model_len - 1)
        per_seq = -(-(n + 1) // cfg.block_size)
        scratch = torch.zeros(
            kv_cache_shape(self.model_config, 3 * per_seq, cfg.block_size),
            dtype=self.model_config.dtype,
            device=self.device,
        )
        vocab = self.model_config.vocab_size
        prompts = [[(7 * j + 3 * i + 1) % vocab for j in range(n)] for i in (0, 1)]
        seqs = [
            Sequence(f"warmup-{i}", p, SamplingParams(temperature=0)) for i, p in enumerate(prompts)
        ]
        for i, seq in enumerate(seqs):
            seq.block_table = list(range(i * per_seq, (i + 1) * per_seq))
        logits = self.runner.run_on(scratch, seqs, True)
        self.sampler(logits, [SamplingParams(temperature=0.7, top_p=0.9, seed=0)] * 2, [0, 1])
        for seq in seqs:
            seq.token_ids.append(0)
        decoded = self.runner.run_on(scratch, seqs, False)
        self.sampler(decoded, [s.sampling for s in seqs], [0, 0])
        if cfg.deterministic:
            whole = Sequence("warmup-whole", list(seqs[0].token_ids), SamplingParams(temperature=0))
            whole.block_table = list(range(2 * per_seq, 3 * per_seq))
            prefilled = self.runner.run_on(scratch, [whole], True)
            if not torch.equal(prefilled[0], decoded[0]):
                raise RuntimeError(
                    "deterministic mode: this machine's kernels are not batch-invariant (a "
                    "decode step and a prefill gave different logits for the same position); "
                    "run with one torch thread, or turn deterministic mode off"
                )

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams | list[SamplingParams]
    ) -> list[GenerationResult]:
        """Run ``prompts`` to completion (tests, benchmarks); results in prompt order."""
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        ids = [f"generate-{next(self._ids)}" for _ in prompts]
        results = {rid: GenerationResult(rid, [], [], None) for rid in ids}
        for rid, prompt, p in zip(ids, prompts, params, strict=True):
            self.add_request(rid, prompt, p)
        while self.has_unfinished() and any(r.finish_reason is None for r in results.values()):
            for out in self.step():
                result = results.get(out.request_id)
                if result is None:
                    continue
                result.token_ids.extend(out.new_token_ids)
                result.logprobs.extend(out.new_logprobs)
                result.finish_reason = out.finish_reason
        return [results[rid] for rid in ids]


def _on_device(params: dict[str, Tensor], device: torch.device) -> dict[str, Tensor]:
    """``params`` on ``device``: the same tensors where they already are, else copies."""
    return {k: v if v.device == device else v.to(device) for k, v in params.items()}


def _check_kv_cache(model_config: ModelConfig, config: EngineConfig, kv_cache: Tensor) -> None:
    expected = kv_cache_shape(model_config, config.num_blocks, config.block_size)
    if tuple(kv_cache.shape) != expected:
        raise ValueError(
            f"kv_cache shape {tuple(kv_cache.shape)} != expected {expected} "
            f"(num_blocks={config.num_blocks}, block_size={config.block_size})"
        )
    if kv_cache.dtype != model_config.dtype:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} != model dtype {model_config.dtype}")
    if not kv_cache.is_contiguous():
        # The model writes through flat views; a non-contiguous cache would be copied.
        raise ValueError("kv_cache must be contiguous")
