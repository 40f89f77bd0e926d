"""Scheduler: admission limits, decode batching, preemption, abort and finishing rules."""

from __future__ import annotations

from typing import Any

import pytest

from services.worker.engine.config import EngineConfig
from services.worker.engine.scheduler import Scheduler
from services.worker.engine.sequence import SamplingParams, Sequence, SequenceStatus

EOS = 2


def make(config: EngineConfig | None = None) -> Scheduler:
    return Scheduler(
        config
        or EngineConfig(num_blocks=64, block_size=4, max_model_len=64, max_num_batched_tokens=256),
        eos_token_ids=(EOS,),
    )


def seq(rid: str, n: int = 4, **sampling: Any) -> Sequence:
    return Sequence(rid, [10] * n, SamplingParams(**sampling))


def run_step(s: Scheduler, token: int = 7) -> tuple[list[Sequence], bool]:
    batch, prefill = s.schedule()
    s.postprocess(batch, [token] * len(batch), [-1.0] * len(batch))
    return batch, prefill


def test_prefill_admission_bounded_by_max_num_seqs() -> None:
    s = make(
        EngineConfig(
            max_num_seqs=3,
            num_blocks=64,
            block_size=4,
            max_model_len=64,
            max_num_batched_tokens=256,
        )
    )
    for i in range(5):
        s.add(seq(f"r{i}"))
    batch, prefill = s.schedule()
    assert prefill and [q.request_id for q in batch] == ["r0", "r1", "r2"]
    assert len(s.waiting) == 2 and all(q.status is SequenceStatus.RUNNING for q in batch)


def test_prefill_admission_bounded_by_batched_tokens() -> None:
    s = make(EngineConfig(num_blocks=64, block_size=4, max_model_len=32, max_num_batched_tokens=40))
    for i in range(3):
        s.add(seq(f"r{i}", n=20))
    batch, _ = s.schedule()
    assert len(batch) == 2
    batch, prefill = s.schedule()  # next step admits the third before decoding
    assert prefill and [q.request_id for q in batch] == ["r2"]


def test_prefill_admission_bounded_by_free_blocks() -> None:
    s = make(EngineConfig(num_blocks=5, block_size=4, max_model_len=16, max_num_batched_tokens=256))
    s.add(seq("a", n=12))  # 3 blocks
    s.add(seq("b", n=12))  # 3 more: does not fit
    batch, _ = s.schedule()
    assert [q.request_id for q in batch] == ["a"] and len(s.waiting) == 1


def test_decode_batches_every_running_sequence_after_prefill() -> None:
    s = make()
    s.add(seq("a"))
    s.add(seq("b", n=6))
    run_step(s)
    batch, prefill = run_step(s)
    assert not prefill and {q.request_id for q in batch} == {"a", "b"}
    assert batch[0].num_tokens == 6 and batch[1].num_tokens == 8


def test_preemption_frees_blocks_and_requeues_first() -> None:
    # 4 blocks of 2 tokens; two sequences of 4 tokens hold all of them.
    s = make(EngineConfig(num_blocks=4, block_size=2, max_model_len=8, max_num_batched_tokens=64))
    s.add(seq("a", n=4, max_tokens=4))
    s.add(seq("b", n=4, max_tokens=4))
    run_step(s)  # prefill both: 4 blocks used, each now has 5 tokens
    batch, prefill = s.schedule()
    assert not prefill and [q.request_id for q in batch] == ["a"]
    assert s.num_preemptions == 1
    b = s.waiting[0]
    assert b.request_id == "b" and b.block_table == [] and b.status is SequenceStatus.WAITING
    assert b.num_tokens == 5  # its generated token is kept and recomputed later
    s.postprocess(batch, [7], [-1.0])
    # "a" keeps decoding until it finishes, then "b" is re-admitted as a prefill of 5 tokens.
    while s.running:
        run_step(s)
    batch, prefill = s.schedule()
    assert prefill and batch == [b] and len(b.block_table) == 3


def test_abort_waiting_and_running() -> None:
    s = make()
    s.add(seq("run"))
    run_step(s)
    s.add(seq("wait"))
    assert s.block_manager.num_free_blocks == 63
    aborted = s.abort("run")
    assert aborted is not None and aborted.finish_reason == "abort" and aborted.is_finished
    assert s.block_manager.num_free_blocks == 64 and not s.running
    assert s.abort("wait") is not None
    assert s.abort("nope") is None
    assert not s.has_unfinished()


@pytest.mark.parametrize(
    ("sampling", "token", "steps", "reason"),
    [
        ({"max_tokens": 3}, 7, 3, "length"),
        ({}, EOS, 1, "stop"),
        ({"stop_token_ids": (9,)}, 9, 1, "stop"),
        ({"ignore_eos": True, "max_tokens": 2}, EOS, 2, "length"),
    ],
)
def test_finish_rules(sampling: dict[str, Any], token: int, steps: int, reason: str) -> None:
    s = make()
    q = seq("r", **sampling)
    s.add(q)
    for _ in range(steps):
        assert not q.is_finished
        run_step(s, token)
    assert q.is_finished and q.finish_reason == reason
    assert not s.running and s.block_manager.num_free_blocks == 64


def test_finish_at_max_model_len() -> None:
    s = make(EngineConfig(num_blocks=64, block_size=4, max_model_len=6, max_num_batched_tokens=64))
    q = seq("r", n=4, max_tokens=100)
    s.add(q)
    run_step(s)
    run_step(s)
    assert q.finish_reason == "length" and q.num_tokens == 6


def test_add_rejects_requests_that_cannot_run() -> None:
    s = make(EngineConfig(num_blocks=2, block_size=4, max_model_len=16, max_num_batched_tokens=64))
    with pytest.raises(ValueError, match="max_model_len"):
        s.add(seq("long", n=16))
    with pytest.raises(ValueError, match="empty prompt"):
        s.add(seq("empty", n=0))
    with pytest.raises(ValueError, match="KV blocks"):
        s.add(seq("big", n=4, max_tokens=10))
