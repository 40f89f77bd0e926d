"""Continuous batching: decide which sequences run each step, and retire finished ones.

Pure bookkeeping (no tensors). Each step is either a prefill of newly admitted sequences or
a decode of every running sequence, as in nano-vllm: prefill is admitted first, bounded by
``max_num_seqs``, ``max_num_batched_tokens`` and free KV blocks. When a decode step runs out
of blocks, the most recently admitted sequence is preempted: its blocks are freed and it
returns to the front of the queue, to be recomputed from its tokens later.
"""

from __future__ import annotations

from collections import deque

from services.worker.engine.block_manager import BlockManager
from services.worker.engine.config import EngineConfig
from services.worker.engine.sequence import Sequence, SequenceStatus


class Scheduler:
    """Waiting and running queues over one :class:`BlockManager`."""

    def __init__(self, config: EngineConfig, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.block_manager = BlockManager(config.num_blocks, config.block_size)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0
        """Preemptions since start (a sign the KV cache is too small for the load)."""

    def add(self, seq: Sequence) -> None:
        """Queue ``seq``; ``ValueError`` if it can never run."""
        if seq.num_tokens == 0:
            raise ValueError(f"{seq.request_id}: empty prompt")
        if seq.num_tokens >= self.config.max_model_len:
            raise ValueError(
                f"{seq.request_id}: prompt of {seq.num_tokens} tokens leaves no room under "
                f"max_model_len={self.config.max_model_len}"
            )
        longest = min(seq.num_tokens + seq.sampling.max_tokens, self.config.max_model_len)
        self.block_manager.check_fits(longest)
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        """True while any sequence waits or runs."""
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """Pick this step's batch; returns ``(sequences, is_prefill)``."""
        batch = self._admit_prefill()
        if batch:
            return batch, True
        return self._schedule_decode(), False

    def _admit_prefill(self) -> list[Sequence]:
        batch: list[Sequence] = []
        num_tokens = 0
        cfg = self.config
        while self.waiting and len(self.running) < cfg.max_num_seqs:
            seq = self.waiting[0]
            if num_tokens + seq.num_tokens > cfg.max_num_batched_tokens:
                break
            if not self.block_manager.can_allocate(seq):
                break
            self.block_manager.allocate(seq)
            num_tokens += seq.num_tokens
            seq.status = SequenceStatus.RUNNING
            self.waiting.popleft()
            self.running.append(seq)
            batch.append(seq)
        return batch

    def _schedule_decode(self) -> list[Sequence]:
        batch: list[Sequence] = []
        while self.running:
            seq = self.running.popleft()
            while not self.block_manager.can_append(seq):
                if self.running:
                    self._preempt(self.running.pop())
                else:
                    self._preempt(seq)
                    break
            else:
                self.block_manager.append_slot(seq)
                batch.append(seq)
        self.running.extend(batch)
        return batch

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def postprocess(
        self, seqs: list[Sequence], token_ids: list[int], logprobs: list[float]
    ) -> None:
        """Append each sequence's new token and retire those that finished."""
        for seq, token, logprob in zip(seqs, token_ids, logprobs, strict=True):
            self.accept(seq, [token], [logprob])

    def accept(self, seq: Sequence, token_ids: list[int], logprobs: list[float]) -> int:
        """Append ``seq``'s tokens of one step in order until it finishes (the rest of a
        speculative step's is dropped, as one-token decoding would never have produced it);
        retires it if it finished. Returns the tokens appended."""
        for n, (token, logprob) in enumerate(zip(token_ids, logprobs, strict=True), start=1):
            seq.token_ids.append(token)
            seq.output_logprobs.append(logprob)
            reason = self._finish_reason(seq, token)
            if reason is not None:
                self._finish(seq, reason)
                self.running.remove(seq)
                return n
        return len(token_ids)

    def abort(self, request_id: str) -> Sequence | None:
        """Drop a waiting or running request; returns it, or None if unknown."""
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self._finish(seq, "abort")
                    return seq
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.block_manager.free(seq)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.sampling
        if token in params.stop_token_ids:
            return "stop"
        if not params.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if seq.num_generated >= params.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return "length"
        return None
