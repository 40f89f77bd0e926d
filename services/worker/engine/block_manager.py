"""Bookkeeping of the paged KV cache: which blocks belong to which sequence.

A sequence of ``n`` tokens needs ``ceil(n / block_size)`` blocks; token ``p`` lives in slot
``block_table[p // block_size] * block_size + p % block_size``. No prefix caching: blocks are
never shared, so freeing is plain.
"""

from __future__ import annotations

from collections import deque

from services.worker.engine.sequence import Sequence


class BlockManager:
    """Allocates KV-cache blocks to sequences."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds."""
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def check_fits(self, num_tokens: int) -> None:
        """Raise ``ValueError`` if a sequence of ``num_tokens`` could never fit the cache."""
        needed = self.blocks_needed(num_tokens)
        if needed > self.num_blocks:
            raise ValueError(
                f"a sequence of {num_tokens} tokens needs {needed} KV blocks, but the cache has "
                f"only {self.num_blocks} blocks of {self.block_size} tokens"
            )

    def can_allocate(self, seq: Sequence) -> bool:
        """True if the whole of ``seq`` (for a prefill) fits in the free blocks."""
        return self.blocks_needed(seq.num_tokens) <= len(self._free)

    def allocate(self, seq: Sequence) -> None:
        """Give ``seq`` blocks for all its tokens (prefill)."""
        if seq.block_table:
            raise RuntimeError(f"{seq.request_id}: already holds blocks")
        needed = self.blocks_needed(seq.num_tokens)
        if needed > len(self._free):
            raise RuntimeError(f"{seq.request_id}: needs {needed} blocks, {len(self._free)} free")
        seq.block_table = [self._free.popleft() for _ in range(needed)]

    def can_append(self, seq: Sequence) -> bool:
        """True if the token ``seq`` feeds next (its last one) has a slot or a block is free."""
        return len(seq.block_table) >= self.blocks_needed(seq.num_tokens) or bool(self._free)

    def append_slot(self, seq: Sequence) -> None:
        """Make room for ``seq``'s last token, taking a new block when it starts one."""
        if len(seq.block_table) < self.blocks_needed(seq.num_tokens):
            if not self._free:
                raise RuntimeError(f"{seq.request_id}: no free KV block")
            seq.block_table.append(self._free.popleft())

    def reserve(self, seq: Sequence, num_tokens: int, keep_free: int) -> int:
        """Tokens ``seq`` has slots for, after taking blocks towards ``num_tokens`` while more
        than ``keep_free`` blocks stay free (draft tokens: room that no other sequence's next
        token needs)."""
        while len(seq.block_table) < self.blocks_needed(num_tokens) and len(self._free) > keep_free:
            seq.block_table.append(self._free.popleft())
        return len(seq.block_table) * self.block_size

    def free(self, seq: Sequence) -> None:
        """Return ``seq``'s blocks to the pool."""
        # Most recently used first: their cache lines are the warmest.
        self._free.extendleft(reversed(seq.block_table))
        seq.block_table = []
