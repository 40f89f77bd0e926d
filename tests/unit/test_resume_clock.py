"""ResumeClock: the router taking a worker down → each resumed request's first new token from
the engine's next worker (``resumed_first_token``), driven through the real RouterCore."""

from __future__ import annotations

from typing import Literal

from schemas.events import RequestsResumed, ResumedFirstToken
from schemas.serving import SamplingParams, SeqDelta, StepBatch
from services.router.config import RouterConfig
from services.router.core import RouterCore
from services.router.resume_clock import MAX_WAIT_S, ResumeClock
from services.router.state import Action, EmitEvent

Recovery = Literal["belayer", "baseline"]
"""``RouterConfig.recovery``'s values."""


def step(engine: str, epoch: int, pid: int, deltas: dict[str, tuple[int, list[int]]]) -> StepBatch:
    return StepBatch(
        engine_id=engine, epoch=epoch, worker_pid=pid, step=1, weight_version=1,
        deltas=[SeqDelta(request_id=r, token_ids=t, logprobs=[-0.5] * len(t), start=s)
                for r, (s, t) in deltas.items()],
    )  # fmt: skip


class Node:
    """A RouterCore with the clock fed as the router's service feeds it."""

    def __init__(self, recovery: Recovery = "belayer") -> None:
        self.core = RouterCore(
            RouterConfig(token_log_chunk=4, recovery=recovery),
            decode=lambda ids: " ".join(map(str, ids)),
        )
        self.clock = ResumeClock()

    def run(self, actions: list[Action], now: float) -> None:
        for a in actions:
            if isinstance(a, EmitEvent):
                active = self.core.active
                held = {r: len(active[r].tokens) for r in active}
                self.clock.on_event(a.event, now, held)

    def step(self, batch: StepBatch, now: float) -> ResumedFirstToken | None:
        self.run(self.core.on_step(batch), now)
        return self.clock.on_step(batch, now)


def started(recovery: Recovery = "belayer") -> Node:
    n = Node(recovery)
    n.run(n.core.register("e0", 1, 100), 0.0)
    for rid in ("a", "b"):
        n.run(n.core.submit(rid, [1, 2], SamplingParams(max_tokens=20), inbox=rid), 0.0)
    assert n.step(step("e0", 1, 100, {"a": (0, [5, 6]), "b": (0, [7])}), 1.0) is None
    return n


def test_first_resumed_token_timed_from_the_failure() -> None:
    n = started()
    n.run(n.core.engine_failed("e0", 10.0, reason="hung", epoch=1), 10.0)
    n.run(n.core.register("e0", 2, 200, now=10.4), 10.4)
    # The old worker's late output is not the resumed token.
    assert n.step(step("e0", 1, 100, {"a": (2, [9])}), 10.5) is None
    first = n.step(step("e0", 2, 200, {"a": (2, [8]), "b": (1, [3])}), 10.75)
    assert first is not None
    assert (first.engine_id, first.epoch, first.request_ids) == ("e0", 2, ["a", "b"])
    assert first.seconds == [0.75, 0.75]
    assert n.step(step("e0", 2, 200, {"a": (3, [4])}), 11.0) is None  # timed once


def test_regenerated_tokens_are_not_the_first_new_one() -> None:
    n = started("baseline")
    n.run(n.core.engine_failed("e0", 10.0, reason="exited", epoch=1), 10.0)
    n.run(n.core.register("e0", 2, 200, now=12.0), 12.0)
    assert n.step(step("e0", 2, 200, {"a": (0, [5])}), 13.0) is None  # held: dropped
    first = n.step(step("e0", 2, 200, {"a": (1, [6, 11])}), 14.0)
    assert first is not None and first.request_ids == ["a"] and first.seconds == [4.0]


def test_a_replacement_without_a_report_is_timed_from_the_registration() -> None:
    n = started()
    n.run(n.core.register("e0", 2, 200, now=20.0), 20.0)  # engine_failed reason "replaced"
    first = n.step(step("e0", 2, 200, {"b": (1, [3])}), 20.5)
    assert first is not None and first.seconds == [0.5]


def test_no_failure_seen_nothing_timed_and_old_waits_pruned() -> None:
    clock = ResumeClock()
    resumed = RequestsResumed(engine_id="e0", epoch=2, count=1, held_tokens=3, request_ids=["a"])
    clock.on_event(resumed, 1.0, {"a": 3})
    assert clock.waiting == {}
    n = started()
    n.run(n.core.engine_failed("e0", 10.0, reason="hung", epoch=1), 10.0)
    n.run(n.core.register("e0", 2, 200, now=10.0), 10.0)
    assert set(n.clock.waiting) == {"a", "b"}
    n.clock.failed_at["e1"] = 10.0 + MAX_WAIT_S + 1
    later = RequestsResumed(engine_id="e1", epoch=3, count=0, held_tokens=0, request_ids=[])
    n.clock.on_event(later, 10.0 + MAX_WAIT_S + 1, {})
    assert n.clock.waiting == {}
