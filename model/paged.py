"""The paged KV cache's geometry and one step's attention metadata: where the step's tokens go in
the cache and what each sequence (or each row of one, with draft tokens) attends to. Pure
bookkeeping over index tensors, shared by the engine's model runner and :mod:`model.qwen3`."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from model import batch_invariant as bi
from model.config import kv_cache_shape as kv_cache_shape  # re-exported: callers import it here

STEP_KEYS_MAX_BYTES = 256 * 2**20
"""Most bytes :class:`StepKeys` keeps (all layers): a copy of the running batch's keys and values,
chunk-padded. Past it the layers that do not fit read the cache every step, as without it
(the tiny model's batch of 8: 8 MiB; 64 math prompts: 32 MiB)."""


class StepKeys:
    """Deterministic decode: each layer's keys and values of the last decode step's sequences
    in the deterministic attention's chunk layout (:mod:`model.det_attention`), kept for the
    next step while it runs the same sequences in the same order, so that a step writes its new
    keys into them instead of reading the whole context from the cache again in every layer.

    The owner (the engine's model runner) calls :meth:`begin` before each decode step with the
    batch's identity, and :meth:`clear` when anything else writes the cache (a prefill, another
    cache); a layer's copy is told apart by its cache's address and kept only while its shape
    (chunk count, sequences) stays the same, and only within ``max_bytes`` in all."""

    def __init__(self, max_bytes: int = STEP_KEYS_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._batch: Hashable | None = None
        self._layers: dict[int, Tensor] = {}

    def begin(self, batch: Hashable) -> None:
        """A decode step of ``batch`` (the sequences, in row order) is about to run."""
        if batch != self._batch:
            self.clear()
            self._batch = batch

    def clear(self) -> None:
        """Forget every copy (the cache may have changed under them)."""
        self._batch = None
        self._layers.clear()

    def get(self, layer_cache: Tensor, shape: tuple[int, ...]) -> Tensor | None:
        """The kept copy of ``layer_cache``'s keys, if it has ``shape``."""
        kept = self._layers.get(layer_cache.data_ptr())
        return kept if kept is not None and tuple(kept.shape) == shape else None

    def put(self, layer_cache: Tensor, kv: Tensor) -> None:
        """Keep ``kv`` (read from ``layer_cache`` this step) for the next step, if it fits."""
        key = layer_cache.data_ptr()
        self._layers.pop(key, None)
        held = sum(t.nbytes for t in self._layers.values())
        if held + kv.nbytes <= self.max_bytes:
            self._layers[key] = kv


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the KV cache and what each sequence attends to.

    Build with :meth:`prefill` or :meth:`decode`. A prefill step holds whole sequences from
    position 0 (no prefix caching: a preempted sequence is recomputed from scratch); a decode
    step holds one new token per row: one row per sequence, followed by a row per draft token
    of that sequence at the next positions when it speculates (``row_groups``).
    """

    is_prefill: bool
    """True when the batch is whole sequences, false for one token per row (decode)."""
    slot_mapping: Tensor
    """``[T]`` flat cache slot (``block * block_size + offset``) of every input token."""
    seq_lens: list[int]
    """Prefill only: tokens of each sequence, in batch order."""
    block_tables: Tensor | None = None
    """Decode only: ``[B, max_blocks]`` block ids per sequence, padded with any valid id."""
    attn_mask: Tensor | None = None
    """Decode only: ``[B, 1, 1, max_blocks * block_size]``, true where a slot is in context."""
    context_lens: Tensor | None = None
    """Decode only: ``[B]`` tokens in each sequence's context, the new one included."""
    block_size: int = 0
    """Decode only: token slots per KV block (to address a position through a block table)."""
    det_cache: dict[str, Any] = field(default_factory=dict)
    """Deterministic decode: tensors derived from this metadata once per step and shared by
    the layers (the cache gather index, the attention masks)."""
    row_groups: list[int] | None = None
    """Decode only: consecutive rows of one sequence (its last token, then draft tokens at the
    next positions: speculative decoding), per sequence; None: one row each. Deterministic
    mode attends with each group's rows together, over its sequence's keys read once."""
    step_keys: StepKeys | None = None
    """Deterministic decode: where the keys read for this step are kept for the next one
    (:class:`StepKeys`); None: read from the cache every step."""
    longest: int = 0
    """Decode only: the longest context of the step (``context_lens``' maximum)."""
    _det_slots: list[Tensor] | None = field(default=None, repr=False)

    @classmethod
    def prefill(cls, slot_mapping: Tensor, seq_lens: list[int]) -> AttentionMetadata:
        """Metadata for whole sequences packed one after the other."""
        return cls(is_prefill=True, slot_mapping=slot_mapping, seq_lens=seq_lens)

    @classmethod
    def decode(
        cls,
        slot_mapping: Tensor,
        block_tables: Tensor,
        context_lens: Tensor,
        block_size: int,
        row_groups: list[int] | None = None,
        *,
        longest: int | None = None,
        mask: bool = True,
    ) -> AttentionMetadata:
        """Metadata for one token per row; ``context_lens`` counts that token too. A sequence
        may have several consecutive rows at consecutive positions (``row_groups``).
        ``longest``: ``context_lens``' maximum where the caller knows it; ``mask``: build the
        fast attention's mask (the deterministic attention does not read it)."""
        attn_mask = None
        if mask:  # built once per step, shared by every layer
            span = block_tables.shape[1] * block_size
            keys = torch.arange(span, device=context_lens.device) < context_lens[:, None]
            attn_mask = keys[:, None, None, :]
        return cls(
            is_prefill=False,
            slot_mapping=slot_mapping,
            seq_lens=[],
            block_tables=block_tables,
            attn_mask=attn_mask,
            context_lens=context_lens,
            block_size=block_size,
            row_groups=row_groups,
            longest=int(context_lens.max()) if longest is None else longest,
        )

    def det_chunks(self) -> int:
        """Deterministic decode: attention chunks that cover the longest context."""
        return bi.chunks_for(self.longest)

    def deterministic_kv_slots(self) -> list[Tensor]:
        """Per sequence, the flat cache slot of each key position, padded with slot 0 (read,
        then masked) to a whole number of attention chunks (the deterministic forward; built
        once per step, on first use)."""
        if self._det_slots is None:
            self._det_slots = self._kv_slots()
        return self._det_slots

    def _kv_slots(self) -> list[Tensor]:
        if self.is_prefill:
            out, start = [], 0
            for n in self.seq_lens:
                pad = bi.chunks_for(n) * bi.ATTENTION_CHUNK - n
                seg = self.slot_mapping[start : start + n]
                out.append(torch.cat([seg, seg.new_zeros(pad)]))
                start += n
            return out
        assert self.block_tables is not None
        bs, width = self.block_size, self.block_tables.shape[1]
        length = self.det_chunks() * bi.ATTENTION_CHUNK
        pos = torch.arange(length, device=self.block_tables.device)
        # Positions past a table's end point at its last block: read, then masked out.
        slots = self.block_tables[:, (pos // bs).clamp(max=width - 1)] * bs + pos % bs
        return [slots]
