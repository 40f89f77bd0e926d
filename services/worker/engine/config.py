"""Engine configuration: one frozen dataclass, every field defaulted and documented."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    """Limits of the scheduler and the geometry of the paged KV cache."""

    max_num_seqs: int = 16
    """Sequences running at once (the decode batch size)."""
    max_num_batched_tokens: int = 4096
    """Tokens in one prefill step. Prefill is not chunked, so this is at least max_model_len."""
    block_size: int = 16
    """Token slots per KV-cache block; must match the arena's tensor."""
    num_blocks: int = 512
    """KV-cache blocks in the arena; must match the arena's tensor."""
    max_model_len: int = 2048
    """Longest sequence (prompt + generated); a request reaching it finishes with 'length'."""
    deterministic: bool = True
    """Batch-invariant inference: a request's logits, tokens and logprobs depend only on the
    weights, its tokens, its sampling parameters and its seed — not on the batch, its
    neighbours, prefill vs decode, or which worker runs it — so a seeded sampled request
    resumes exactly, and a trainer built with the same switch computes bitwise-equal
    log-probabilities (``model.batch_invariant``; on GPU: SGLang's
    ``--enable-deterministic-inference``). Costs some throughput (``belayer bench engine``)."""
    speculative_tokens: int = 7
    """Deterministic mode: draft tokens per sequence per decode step, guessed by prompt lookup
    (:mod:`~services.worker.engine.draft`) and verified in the same forward; 0 turns it off.
    Exact, not approximate: every row of a deterministic step is computed as if alone, so an
    accepted token, its log-probability and every later token are bitwise those of one-token
    decoding (seeded sampling included); a wrong guess costs only its row. Ignored in fast
    mode, whose rows are not batch-invariant."""
    speculative_rows: int = 8
    """Draft rows one decode step feeds in all, handed out one per sequence per round: a
    batch-1 step gets ``speculative_tokens`` drafts for little (a step's cost is mostly per
    operation, not per row, on a small model), a batch-8 step about one per sequence (each
    row costs there)."""
    speculative_rows_confident: int = 16
    """Draft rows a decode step may feed beyond ``speculative_rows``, for confident guesses only:
    found by a full-length (three-token) match, for a sequence whose drafts have been kept at
    least 80 % of the time (``PromptLookup.trusted``). Measured on an AMD EPYC (2026-12-07,
    batch 8, deterministic): SmolLM2-135M, whose drafts are kept 97 % of the time, 1.22x the
    tokens/s of 8 draft rows in all; the tiny model (62 %) unchanged within the noise."""

    def __post_init__(self) -> None:
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "block_size",
            "num_blocks",
            "max_model_len",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        drafts = (self.speculative_tokens, self.speculative_rows, self.speculative_rows_confident)
        if min(drafts) < 0:
            raise ValueError(
                "speculative_tokens, speculative_rows and speculative_rows_confident must be "
                f">= 0, got {', '.join(map(str, drafts))}"
            )
        if self.max_num_batched_tokens < self.max_model_len:
            # A preempted sequence is recomputed in one prefill, up to max_model_len tokens.
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                f"max_model_len={self.max_model_len} (prefill is not chunked)"
            )
