"""Turn a scheduled batch into model inputs, run the model, return next-token logits.

The inputs are built on the CPU and moved to the KV cache's device (a no-op on the CPU); the
logits come back on the CPU, where the sampler draws (its seeded draws are then the same
whichever device ran the model)."""

from __future__ import annotations

import torch
from torch import Tensor

from model.paged import StepKeys
from model.qwen3 import AttentionMetadata, Qwen3ForCausalLM
from services.worker.engine.sequence import Sequence


class ModelRunner:
    """Runs :class:`Qwen3ForCausalLM` over the paged KV cache for one batch at a time."""

    def __init__(self, model: Qwen3ForCausalLM, kv_cache: Tensor, block_size: int) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.step_keys = StepKeys()
        """Deterministic decode: the keys one step read, kept for the next step of the same
        sequences (``model.det_attention``); cleared whenever anything else writes the cache."""

    @torch.inference_mode()
    def run(
        self, seqs: list[Sequence], is_prefill: bool, drafts: list[list[int]] | None = None
    ) -> Tensor:
        """Logits ``[len(seqs), vocab]`` at the last position of each sequence; with
        ``drafts`` (a decode step), also one row per draft token after its sequence's row, in
        sequence order: the logits at the position the draft token was fed in at."""
        return self.run_on(self.kv_cache, seqs, is_prefill, drafts)

    @torch.inference_mode()
    def run_on(
        self,
        kv_cache: Tensor,
        seqs: list[Sequence],
        is_prefill: bool,
        drafts: list[list[int]] | None = None,
    ) -> Tensor:
        """Like :meth:`run` but on another cache of the same geometry (warm-up scratch)."""
        dev = kv_cache.device
        if is_prefill:
            self.step_keys.clear()
            input_ids, positions, attn, last = self._prepare_prefill(seqs, dev)
            hidden = self.model(input_ids, positions, attn, kv_cache)[last]
        else:
            input_ids, positions, attn = self._prepare_decode(seqs, dev, drafts)
            if kv_cache is self.kv_cache and self.model.deterministic:
                self.step_keys.begin(tuple(seq.request_id for seq in seqs))
                attn.step_keys = self.step_keys
            else:
                self.step_keys.clear()
            hidden = self.model(input_ids, positions, attn, kv_cache)
        logits = self.model.compute_logits(hidden)
        return logits if dev.type == "cpu" else logits.cpu()

    def _prepare_prefill(
        self, seqs: list[Sequence], dev: torch.device
    ) -> tuple[Tensor, Tensor, AttentionMetadata, Tensor]:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        last: list[int] = []
        for seq in seqs:
            n = seq.num_tokens
            input_ids.extend(seq.token_ids)
            positions.extend(range(n))
            for i, block in enumerate(seq.block_table):
                start = block * bs
                slots.extend(range(start, start + min(bs, n - i * bs)))
            seq_lens.append(n)
            last.append(len(input_ids) - 1)
        attn = AttentionMetadata.prefill(torch.tensor(slots, device=dev), seq_lens)
        return (
            torch.tensor(input_ids, device=dev),
            torch.tensor(positions, device=dev),
            attn,
            torch.tensor(last, device=dev),
        )

    def _prepare_decode(
        self, seqs: list[Sequence], dev: torch.device, drafts: list[list[int]] | None = None
    ) -> tuple[Tensor, Tensor, AttentionMetadata]:
        """One row per sequence (its last token), each followed by a row per draft token at
        the next positions. A draft row is a decode row of the same sequence one position on:
        its K/V is written before any row attends (every layer writes the step's keys first),
        so it attends to the drafts before it, as a later decode step would."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        owners: list[Sequence] = []
        for i, seq in enumerate(seqs):
            fed = [seq.last_token] + (drafts[i] if drafts is not None else [])
            input_ids += fed
            positions += range(seq.num_tokens - 1, seq.num_tokens - 1 + len(fed))
            owners += [seq] * len(fed)
        slots = [
            seq.block_table[p // bs] * bs + p % bs for seq, p in zip(owners, positions, strict=True)
        ]
        max_blocks = max(len(seq.block_table) for seq in seqs)
        # Padding points at block 0: it is read but masked out, never written.
        tables = [seq.block_table + [0] * (max_blocks - len(seq.block_table)) for seq in owners]
        context_lens = torch.tensor(positions, device=dev) + 1
        groups = None
        if drafts is not None and any(drafts):
            groups = [1 + len(d) for d in drafts]
        attn = AttentionMetadata.decode(
            torch.tensor(slots, device=dev),
            torch.tensor(tables, device=dev),
            context_lens,
            self.block_size,
            groups,
            longest=max(positions) + 1,
            mask=not self.model.deterministic,
        )
        return torch.tensor(input_ids, device=dev), torch.tensor(positions, device=dev), attn
