"""BlockManager: allocation, growth at block boundaries, freeing, impossible sequences."""

from __future__ import annotations

import pytest

from services.worker.engine.block_manager import BlockManager
from services.worker.engine.sequence import SamplingParams, Sequence


def seq(n: int, rid: str = "r") -> Sequence:
    return Sequence(rid, list(range(n)), SamplingParams())


def test_allocate_takes_ceil_blocks_and_free_returns_them() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = seq(5, "a"), seq(4, "b")
    bm.allocate(a)
    bm.allocate(b)
    assert len(a.block_table) == 2 and len(b.block_table) == 1
    assert len(set(a.block_table) | set(b.block_table)) == 3
    assert bm.num_free_blocks == 5
    bm.free(a)
    assert a.block_table == [] and bm.num_free_blocks == 7


def test_can_allocate_respects_free_blocks() -> None:
    bm = BlockManager(num_blocks=3, block_size=4)
    bm.allocate(seq(8, "a"))
    assert bm.can_allocate(seq(4))
    assert not bm.can_allocate(seq(5))
    with pytest.raises(RuntimeError):
        bm.allocate(seq(5))


def test_append_slot_takes_a_block_only_at_a_boundary() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    s = seq(4)
    bm.allocate(s)
    assert len(s.block_table) == 1
    s.token_ids.append(99)  # 5th token starts block 2
    assert bm.can_append(s)
    bm.append_slot(s)
    assert len(s.block_table) == 2
    s.token_ids.append(100)  # 6th token fits in block 2
    bm.append_slot(s)
    assert len(s.block_table) == 2 and bm.num_free_blocks == 2


def test_can_append_false_when_a_new_block_is_needed_and_none_is_free() -> None:
    bm = BlockManager(num_blocks=2, block_size=2)
    a, b = seq(2, "a"), seq(2, "b")
    bm.allocate(a)
    bm.allocate(b)
    a.token_ids.append(7)
    assert not bm.can_append(a)
    with pytest.raises(RuntimeError):
        bm.append_slot(a)


def test_check_fits_names_the_limit() -> None:
    bm = BlockManager(num_blocks=4, block_size=16)
    bm.check_fits(64)
    with pytest.raises(ValueError, match="65 tokens needs 5 KV blocks"):
        bm.check_fits(65)


def test_allocate_twice_is_a_bug() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    s = seq(3)
    bm.allocate(s)
    with pytest.raises(RuntimeError, match="already holds"):
        bm.allocate(s)
