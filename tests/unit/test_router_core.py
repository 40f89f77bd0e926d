"""RouterCore: placement, streaming, token log, dedup, epochs, resume, unhealthy engines."""

from __future__ import annotations

from typing import Any

import pytest

from common.errors import Conflict, EngineUnavailable, NotFound, ResourceLimit
from common.limits import ServingLimits
from schemas.events import (
    EngineFailedEvent,
    EngineRecovered,
    EngineUnhealthy,
    EventBase,
    RequestsAdopted,
    RequestsResumed,
    StaleOutputRejected,
    TokenGapResubmitted,
)
from schemas.serving import GenerateResult, SamplingParams, SeqDelta, StepBatch, TokenDelta
from services.router.config import RouterConfig
from services.router.core import RouterCore
from services.router.state import (
    EmitEvent,
    PersistChunk,
    SendToCaller,
    SubmitToEngine,
)


def core(**kw: Any) -> RouterCore:  # Any: each value is the RouterConfig field it names
    return RouterCore(
        RouterConfig(token_log_chunk=4, **kw), decode=lambda ids: " ".join(map(str, ids))
    )


def batch(
    engine: str,
    epoch: int,
    rid: str,
    toks: list[int],
    *,
    finished: bool = False,
    version: int = 1,
    pid: int = 100,
    start: int = -1,
) -> StepBatch:
    return StepBatch(
        engine_id=engine, epoch=epoch, worker_pid=pid, step=1, weight_version=version,
        deltas=[SeqDelta(request_id=rid, token_ids=toks, logprobs=[-0.5] * len(toks), finished=finished,
                         finish_reason="length" if finished else None, start=start)],
    )  # fmt: skip


def of(actions: list, kind: type) -> list:
    return [a for a in actions if isinstance(a, kind)]


def emitted(actions: list) -> list[EventBase]:
    """The events among ``actions`` (each an ``EmitEvent`` carrying a typed event)."""
    return [a.event for a in of(actions, EmitEvent)]


def test_least_loaded_placement_spreads_requests() -> None:
    c = core()
    c.register("e0", 1, 100)
    c.register("e1", 1, 101)
    placed = []
    for i in range(4):
        (sub,) = of(
            c.submit(f"r{i}", [1, 2], SamplingParams(max_tokens=8), inbox=f"in{i}"), SubmitToEngine
        )
        placed.append(sub.engine_id)
    assert sorted(placed) == ["e0", "e0", "e1", "e1"]


def test_stream_log_and_finish() -> None:
    c = core()
    c.register("e0", 1, 100)
    c.submit("r", [1, 2, 3], SamplingParams(max_tokens=6), inbox="in")
    acts = c.on_step(batch("e0", 1, "r", [5, 6, 7]))
    (d,) = [a.message for a in of(acts, SendToCaller)]
    assert isinstance(d, TokenDelta) and d.start == 0 and d.token_ids == [5, 6, 7]
    assert not of(acts, PersistChunk)
    acts = c.on_step(batch("e0", 1, "r", [8, 9, 10], finished=True))
    chunks = [a.chunk for a in of(acts, PersistChunk)]
    assert [(ch.chunk_index, ch.start, ch.token_ids, ch.final) for ch in chunks] == [
        (0, 0, [5, 6, 7, 8], False),
        (1, 4, [9, 10], True),
    ]
    msgs = [a.message for a in of(acts, SendToCaller)]
    assert isinstance(msgs[0], TokenDelta) and msgs[0].start == 3
    result = msgs[-1]
    assert isinstance(result, GenerateResult)
    assert result.token_ids == [5, 6, 7, 8, 9, 10] and result.finish_reason == "length"
    assert result.token_weight_versions == [1] * 6
    assert "r" not in c.active and c.engines["e0"].assigned == set()


def test_resubmitted_id_is_never_generated_twice() -> None:
    c = core()
    c.register("e0", 1, 100)
    assert of(c.submit("r", [1], SamplingParams(max_tokens=2), inbox="a"), SubmitToEngine)
    c.on_step(batch("e0", 1, "r", [4]))
    again = c.submit("r", [1], SamplingParams(max_tokens=2), inbox="b")
    assert not of(again, SubmitToEngine)
    (catch_up,) = [a.message for a in of(again, SendToCaller)]
    assert catch_up.token_ids == [4]
    done = c.on_step(batch("e0", 1, "r", [5], finished=True))
    assert {a.inbox for a in of(done, SendToCaller) if isinstance(a.message, GenerateResult)} == {
        "a",
        "b",
    }
    replay = c.submit("r", [1], SamplingParams(max_tokens=2), inbox="c")
    assert [type(a.message) for a in of(replay, SendToCaller)] == [GenerateResult]
    assert not of(replay, SubmitToEngine)
    with pytest.raises(Conflict):
        c.submit("x", [1], SamplingParams(), inbox="a")
        c.submit("x", [2], SamplingParams(), inbox="a")


def test_stale_epoch_output_is_rejected_and_resume_holds_tokens() -> None:
    c = core()
    c.register("e0", 1, 100)
    c.submit("r", [1, 2], SamplingParams(max_tokens=10, seed=3), inbox="in")
    c.on_step(batch("e0", 1, "r", [7, 8, 9]))
    (failed,) = emitted(c.engine_failed("e0", now=0.0, reason="heartbeat"))
    assert isinstance(failed, EngineFailedEvent) and failed.request_ids == ["r"]
    assert failed.engine_id == "e0" and (failed.epoch, failed.pid) == (1, 100)
    acts = c.register("e0", 2, 200)
    (resumed,) = of(emitted(acts), RequestsResumed)
    assert (resumed.request_ids, resumed.count, resumed.held_tokens) == (["r"], 1, 3)
    (sub,) = of(acts, SubmitToEngine)
    (er,) = sub.requests
    assert sub.epoch == 2
    assert (
        er.token_ids == [1, 2, 7, 8, 9] and er.generated_offset == 3 and er.sampling.max_tokens == 7
    )
    # the old worker comes back (SIGCONT): its output never reaches the caller
    stale = c.on_step(batch("e0", 1, "r", [99], pid=100))
    assert not of(stale, SendToCaller)
    (rejected,) = emitted(stale)
    assert isinstance(rejected, StaleOutputRejected) and rejected.kind == "stale_output_rejected"
    assert (rejected.epoch, rejected.current_epoch, rejected.request_ids) == (1, 2, ["r"])
    acts = c.on_step(batch("e0", 2, "r", [10], pid=200))
    assert [a.message.start for a in of(acts, SendToCaller)] == [3]
    with pytest.raises(Conflict):
        c.register("e0", 1, 300)


def test_repeated_failure_marks_unhealthy_and_spreads_evenly() -> None:
    c = core(failure_window_s=30.0)
    for e in ("e0", "e1", "e2"):
        c.register(e, 1, 100)
    for i in range(6):
        c.submit(f"r{i}", [1], SamplingParams(max_tokens=4), inbox="in", engine_id="e0")
    c.engine_failed("e0", now=0.0, reason="crash")
    c.register("e0", 2, 101)
    acts = c.engine_failed("e0", now=5.0, reason="crash")
    (unhealthy,) = of(emitted(acts), EngineUnhealthy)
    assert unhealthy.request_ids == [f"r{i}" for i in range(6)] and unhealthy.moved_requests == 6
    assert unhealthy.alert and unhealthy.reason == "repeated failure"
    targets = [s.engine_id for s in of(acts, SubmitToEngine) for _ in s.requests]
    assert sorted(targets) == ["e1"] * 3 + ["e2"] * 3
    assert not c.engines["e0"].info().healthy
    with pytest.raises(EngineUnavailable):
        c.validate([1], SamplingParams(), "e0")


def test_failures_outside_window_do_not_mark_unhealthy() -> None:
    c = core(failure_window_s=10.0)
    c.register("e0", 1, 100)
    c.engine_failed("e0", now=0.0, reason="crash")
    c.register("e0", 2, 101)
    acts = c.engine_failed("e0", now=50.0, reason="crash")
    assert not of(emitted(acts), EngineUnhealthy)


def test_requests_wait_for_an_engine() -> None:
    c = core()
    assert c.submit("r", [1], SamplingParams(), inbox="in") == []
    assert c.pending == ["r"]
    (sub,) = of(c.register("e0", 1, 100), SubmitToEngine)
    assert [r.request_id for r in sub.requests] == ["r"]


def test_bad_input() -> None:
    c = core(limits=ServingLimits(max_prompt_tokens=4))
    with pytest.raises(ResourceLimit):
        c.submit("r", [1] * 5, SamplingParams(), inbox="in")
    with pytest.raises(NotFound):
        c.submit("r", [1], SamplingParams(), inbox="in", engine_id="nope")
    with pytest.raises(NotFound):
        c.cancel("nope")
    with pytest.raises(NotFound):
        c.engine_failed("nope", now=0.0, reason="x")


def test_baseline_regenerates_from_scratch_without_duplicates() -> None:
    c = core(recovery="baseline")
    c.register("e0", 1, 100)
    c.submit("r", [1], SamplingParams(max_tokens=5, temperature=0), inbox="in")
    c.on_step(batch("e0", 1, "r", [4, 5]))
    c.engine_failed("e0", now=0.0, reason="crash")
    (sub,) = of(c.register("e0", 2, 101), SubmitToEngine)
    assert sub.requests[0].token_ids == [1] and sub.requests[0].generated_offset == 0
    acts = c.on_step(batch("e0", 2, "r", [4, 5, 6], start=0, pid=101))
    (d,) = [a.message for a in of(acts, SendToCaller)]
    assert d.start == 2 and d.token_ids == [6]
    assert c.regenerated_tokens == 2


def test_tokens_are_placed_by_index() -> None:
    c = core()
    c.register("e0", 1, 100)
    c.submit("r", [1], SamplingParams(max_tokens=10), inbox="in")
    c.on_step(batch("e0", 1, "r", [4, 5], start=0))
    # a duplicate batch changes nothing and reaches no caller
    assert not of(c.on_step(batch("e0", 1, "r", [4, 5], start=0)), SendToCaller)
    # a gap (a lost batch) resubmits from the held tokens instead of skipping any
    acts = c.on_step(batch("e0", 1, "r", [9], start=5))
    (gap,) = emitted(acts)
    assert isinstance(gap, TokenGapResubmitted)
    assert (gap.request_id, gap.held, gap.start) == ("r", 2, 5)
    (sub,) = of(acts, SubmitToEngine)
    assert sub.requests[0].token_ids == [1, 4, 5] and sub.requests[0].held_logprobs == [-0.5, -0.5]
    assert c.active["r"].tokens == [4, 5]


def test_a_caller_holds_every_logged_token_and_at_most_k_more() -> None:
    """Whatever prefix of the ordered actions went out before a router dies, the caller holds
    all the durable tokens and at most k (4) more: a restarted router, streaming on from the
    log, leaves no gap and re-sends at most k. Steps of every size, a long one included."""
    c = core()
    c.register("e0", 1, 100)
    c.submit("r", [1], SamplingParams(max_tokens=40), inbox="in")
    sizes = [1, 3, 2, 10, 1, 5, 4, 9, 5]
    acts: list = []
    start = 0
    for i, n in enumerate(sizes):
        toks = list(range(start, start + n))
        acts += c.on_step(batch("e0", 1, "r", toks, finished=i == len(sizes) - 1))
        start += n
    held = logged = 0
    for a in acts:
        if isinstance(a, SendToCaller) and isinstance(a.message, TokenDelta):
            assert a.message.start == held
            held += len(a.message.token_ids)
        elif isinstance(a, PersistChunk):
            assert a.chunk.start == logged and a.chunk.token_ids == list(range(logged, held))
            logged += len(a.chunk.token_ids)
        assert logged <= held <= logged + 4, (held, logged)
    assert held == logged == sum(sizes)


def test_restarted_router_adopts_what_workers_hold() -> None:
    from schemas.serving import HeldRequest, TokenLogChunk

    c = core()
    c.hold_pending = True
    log = [
        TokenLogChunk(
            request_id="r",
            chunk_index=0,
            start=0,
            token_ids=[4, 5, 6, 7],
            logprobs=[-1.0] * 4,
            weight_versions=[1] * 4,
        )
    ]
    c.restore("r", [1], SamplingParams(max_tokens=10), log, inbox="in")
    c.restore("q", [2], SamplingParams(max_tokens=10), [], inbox="in2")
    assert not of(c.register("e0", 1, 100), SubmitToEngine)  # held until adoption is done
    held = [
        HeldRequest(
            request_id="r", token_ids=[4, 5, 6, 7, 8, 9], logprobs=[-1.0] * 4 + [-2.0, -3.0]
        )
    ]
    acts = c.adopt("e0", held, weight_version=1)
    (adopted,) = emitted(acts)
    assert isinstance(adopted, RequestsAdopted)
    assert adopted.request_ids == ["r"] and adopted.count == 1
    (catch_up,) = [a.message for a in of(acts, SendToCaller)]
    assert catch_up.start == 4 and catch_up.token_ids == [8, 9]
    assert c.active["r"].engine_id == "e0" and c.active["r"].logprobs[-1] == -3.0
    # the worker's next tokens continue by index; the one nobody holds is resubmitted
    more = c.on_step(batch("e0", 1, "r", [10], start=6))
    assert [a.message.token_ids for a in of(more, SendToCaller)] == [[10]]
    (sub,) = of(c.release_pending(), SubmitToEngine)
    assert [r.request_id for r in sub.requests] == ["q"]
    assert c.regenerated_tokens == 0


def test_restore_from_log() -> None:
    from schemas.serving import TokenLogChunk

    c = core()
    chunks = [
        TokenLogChunk(
            request_id="r",
            chunk_index=0,
            start=0,
            token_ids=[1, 2, 3, 4],
            logprobs=[0.0] * 4,
            weight_versions=[1] * 4,
        ),
    ]
    c.restore("r", [9], SamplingParams(max_tokens=10), chunks, inbox="in")
    (sub,) = of(c.register("e0", 1, 100), SubmitToEngine)
    assert sub.requests[0].token_ids == [9, 1, 2, 3, 4] and sub.requests[0].generated_offset == 4
    final = [
        *chunks,
        TokenLogChunk(
            request_id="q",
            chunk_index=0,
            start=0,
            token_ids=[5],
            logprobs=[0.0],
            weight_versions=[1],
            final=True,
            finish_reason="stop",
        ),
    ]
    c.restore("q", [9], SamplingParams(), final[1:], inbox=None)
    assert c.finished["q"].token_ids == [5]


def test_false_alarm_engine_comes_back_with_its_requests() -> None:
    c = core()
    c.register("e0", 1, 100)
    c.submit("r", [1], SamplingParams(max_tokens=8), inbox="in")
    c.on_step(batch("e0", 1, "r", [4, 5], start=0))
    c.engine_failed("e0", now=0.0, reason="submit failed")
    assert c.engine_recovered("e0", 1, 999) == []  # not the worker it knew
    acts = c.engine_recovered("e0", 1, 100)
    (recovered,) = emitted(acts)
    assert isinstance(recovered, EngineRecovered) and recovered.kind == "engine_recovered"
    assert recovered.request_ids == ["r"] and recovered.requests == 1
    (sub,) = of(acts, SubmitToEngine)
    assert sub.requests[0].token_ids == [1, 4, 5] and sub.requests[0].generated_offset == 2
    assert c.engines["e0"].info().healthy


def test_a_missed_ping_is_only_a_suspicion_in_belayer_mode() -> None:
    """Belayer mode: a ping answered too late on a loaded machine takes the engine down, but
    no shadow or supervisor acts on a live worker, so the same worker answering again brings
    it back with its requests, and the false alarm does not count toward unhealthy."""
    c = core()
    c.register("e0", 1, 100)
    c.submit("r", [1], SamplingParams(max_tokens=8), inbox="in")
    c.on_step(batch("e0", 1, "r", [4, 5], start=0))
    c.engine_failed("e0", now=0.0, reason="heartbeat", epoch=1)
    assert not c.engines["e0"].info().healthy
    acts = c.engine_recovered("e0", 1, 100)
    (sub,) = of(acts, SubmitToEngine)
    assert sub.requests[0].token_ids == [1, 4, 5] and sub.requests[0].generated_offset == 2
    assert c.engines["e0"].info().healthy and c.engines["e0"].failures == []
    # a second false alarm inside the window is again only a suspicion, not "repeated failure"
    assert not of(emitted(c.engine_failed("e0", now=1.0, reason="heartbeat")), EngineUnhealthy)
    # confirmed by the shadow meanwhile (hung): final, the shadow's registration resumes it
    c.engine_failed("e0", now=1.5, reason="hung", epoch=1)
    assert c.engine_recovered("e0", 1, 100) == []
    # baseline mode: the heartbeat is the detector and a cold restart follows: final
    b = core(recovery="baseline")
    b.register("e0", 1, 100)
    b.engine_failed("e0", now=0.0, reason="heartbeat", epoch=1)
    assert b.engine_recovered("e0", 1, 100) == []


def test_a_confirmed_failure_is_never_taken_back() -> None:
    """SIGSTOP + SIGCONT: the shadow reported a hang; the woken old worker answering pings must
    not bring the engine back (its requests wait for the shadow's registration)."""
    c = core()
    c.register("e0", 1, 100)
    c.submit("r", [1], SamplingParams(max_tokens=8), inbox="in")
    c.engine_failed("e0", now=0.0, reason="hung", epoch=1)
    assert c.engine_recovered("e0", 1, 100) == []
    # a router suspicion confirmed by the supervisor's report is final too
    c2 = core()
    c2.register("e0", 1, 100)
    c2.engine_failed("e0", now=0.0, reason="submit failed", epoch=1)
    c2.engine_failed("e0", now=1.0, reason="exited", epoch=1)
    assert c2.engine_recovered("e0", 1, 100) == []
    assert len(c2.engines["e0"].failures) == 1  # one failure, reported twice


@pytest.mark.parametrize(
    ("prompt", "sampling"),
    [([9, 9], SamplingParams(max_tokens=2)), ([1], SamplingParams(max_tokens=3))],
)
@pytest.mark.parametrize("finished", [False, True])
def test_reused_id_with_a_different_request_is_conflict(
    prompt: list[int], sampling: SamplingParams, finished: bool
) -> None:
    c = core()
    c.register("e0", 1, 100)
    c.submit("r", [1], SamplingParams(max_tokens=2), inbox="a")
    if finished:
        c.on_step(batch("e0", 1, "r", [4, 5], finished=True))
        assert "r" in c.finished
    with pytest.raises(Conflict) as err:
        c.submit("r", prompt, sampling, inbox="b")
    assert err.value.data["field"] == "$.request_id"
    # The same request again is still fine (attach or replay).
    again = c.submit("r", [1], SamplingParams(max_tokens=2), inbox="c")
    assert finished == any(isinstance(a.message, GenerateResult) for a in of(again, SendToCaller))


def counts(engine: str, epoch: int, running: int, waiting: int, pid: int = 100) -> StepBatch:
    """A step batch that only reports the worker's own counts."""
    return StepBatch(
        engine_id=engine, epoch=epoch, worker_pid=pid, step=2, weight_version=1, deltas=[],
        running=running, waiting=waiting,
    )  # fmt: skip


def test_placement_follows_the_workers_own_counts() -> None:
    """Work the router did not send (a direct submit) counts: the router places by what the
    worker reports holding, keeps requests itself while every engine is full, and places them
    as soon as a worker reports room."""
    c = core(limits=ServingLimits(max_queued=2))
    c.register("e0", 1, 100, max_num_seqs=2)
    c.register("e1", 1, 200, max_num_seqs=2)
    c.on_step(counts("e0", 1, running=2, waiting=2))  # full with someone else's work
    (sub,) = of(c.submit("a", [1], SamplingParams(), inbox="in"), SubmitToEngine)
    assert sub.engine_id == "e1"
    c.on_step(counts("e1", 1, running=2, waiting=2, pid=200))
    assert c.submit("b", [1], SamplingParams(), inbox="in") == [] and c.pending == ["b"]
    pinned = c.submit("p", [1], SamplingParams(), inbox="in", engine_id="e0")
    assert pinned == [] and c.pending == ["b", "p"]
    acts = c.on_step(counts("e0", 1, running=1, waiting=0))
    assert [
        (s.engine_id, [r.request_id for r in s.requests]) for s in of(acts, SubmitToEngine)
    ] == [("e0", ["b", "p"])]
    assert c.pending == [] and c.engines["e0"].info().holding == 3


def test_a_refused_submit_moves_the_requests_and_a_rejected_one_fails_them() -> None:
    c = core()
    c.register("e0", 1, 100)
    c.register("e1", 1, 200)
    (sub,) = of(c.submit("r", [1], SamplingParams(), inbox="in"), SubmitToEngine)
    assert sub.engine_id == "e0"
    (moved,) = of(c.submit_refused("e0", 1, ["r"]), SubmitToEngine)
    assert moved.engine_id == "e1" and not c.engines["e0"].has_room
    assert c.engines["e0"].status.value == "up"  # a full queue is no failure
    acts = c.submit_rejected("e1", ["r"], "prompt too long")
    (res,) = [a.message for a in of(acts, SendToCaller)]
    assert isinstance(res, GenerateResult) and res.finish_reason == "error"


def test_output_of_another_process_under_the_current_epoch_is_stale() -> None:
    c = core()
    c.register("e0", 1, 100)
    c.submit("r", [1], SamplingParams(max_tokens=8), inbox="in")
    acts = c.on_step(batch("e0", 1, "r", [4, 5], pid=999))
    (stale,) = emitted(acts)
    assert isinstance(stale, StaleOutputRejected) and stale.pid == 999
    assert c.active["r"].tokens == []


def test_status_shows_a_down_engine_as_not_healthy() -> None:
    c = core()
    c.register("e0", 1, 100)
    c.engine_failed("e0", now=0.0, reason="exited", epoch=1)
    info = c.engines["e0"].info()
    assert not info.healthy and info.state == "down"


def test_a_lost_last_batch_is_taken_from_the_workers_finished_copy() -> None:
    from schemas.events import StalledRequestReconciled
    from schemas.serving import HeldRequest

    c = core()
    c.register("e0", 1, 100)
    c.submit("r", [1, 2], SamplingParams(max_tokens=4), inbox="in")
    c.submit("q", [3], SamplingParams(max_tokens=9), inbox="in2")
    c.on_step(batch("e0", 1, "r", [5, 6]))
    assert c.stalled("e0") == []  # the first look only marks
    c.on_step(batch("e0", 1, "q", [7]))
    assert c.stalled("e0") == ["r"]  # q got a token since; r did not
    # The worker finished r; the batch holding its last two tokens never arrived.
    copies = [
        HeldRequest(request_id="r", token_ids=[5, 6, 8, 9], logprobs=[-0.5] * 2 + [-1.0, -2.0],
                    finished=True, finish_reason="length"),
    ]  # fmt: skip
    assert c.reconcile("e0", 0, ["r"], copies, 1) == []  # a reply from an older epoch
    acts = c.reconcile("e0", 1, ["r"], copies, 1)
    (event,) = emitted(acts)
    assert isinstance(event, StalledRequestReconciled)
    assert (event.request_id, event.held, event.recovered, event.outcome) == ("r", 2, 2, "finished")
    delta, result = [a.message for a in of(acts, SendToCaller)]
    assert isinstance(delta, TokenDelta) and (delta.start, delta.token_ids) == (2, [8, 9])
    assert isinstance(result, GenerateResult) and result.token_ids == [5, 6, 8, 9]
    assert result.logprobs[-1] == -2.0 and result.finish_reason == "length"
    chunks = [(a.chunk.token_ids, a.chunk.final) for a in of(acts, PersistChunk)]
    assert chunks == [([5, 6, 8, 9], False), ([], True)]  # k = 4: a full chunk, then the end
    assert "r" not in c.active and c.engines["e0"].assigned == {"q"}
    # the batch was only late after all: it changes nothing
    assert c.on_step(batch("e0", 1, "r", [8, 9], start=2, finished=True)) == []
    assert c.regenerated_tokens == 0 and c.metrics()["tokens"] == 5


def test_a_stalled_request_waits_or_is_resubmitted_by_what_the_worker_holds() -> None:
    from schemas.events import StalledRequestReconciled
    from schemas.serving import HeldRequest

    c = core()
    c.register("e0", 1, 100)
    for rid in ("queued", "lost", "other", "dropped"):
        c.submit(rid, [1], SamplingParams(max_tokens=8), inbox=f"in-{rid}")
        c.on_step(batch("e0", 1, rid, [4]))
    c.stalled("e0")
    asked = c.stalled("e0")
    assert asked == ["dropped", "lost", "other", "queued"]
    copies = [
        HeldRequest(request_id="queued", token_ids=[4], logprobs=[-0.5]),
        HeldRequest(request_id="other", token_ids=[6, 6], logprobs=[-0.5] * 2, finished=True),
        HeldRequest(
            request_id="dropped",
            token_ids=[4],
            logprobs=[-0.5],
            finished=True,
            finish_reason="abort",
        ),
    ]  # still queued; no copy of "lost" (its submit was lost); one that disagrees; one dropped
    acts = c.reconcile("e0", 1, asked, copies, 1)
    events = emitted(acts)
    assert all(isinstance(e, StalledRequestReconciled) for e in events)
    assert [(e.request_id, e.outcome) for e in events] == [  # type: ignore[attr-defined]
        ("dropped", "resubmitted"),
        ("lost", "resubmitted"),
        ("other", "resubmitted"),
    ]
    subs = of(acts, SubmitToEngine)
    assert [(s.engine_id, s.requests[0].request_id, s.requests[0].token_ids) for s in subs] == [
        ("e0", "dropped", [1, 4]),
        ("e0", "lost", [1, 4]),
        ("e0", "other", [1, 4]),
    ]
    assert not of(acts, SendToCaller) and set(c.active) == {"queued", "lost", "other", "dropped"}
    # a down engine's requests wait for its next worker: nothing to watch
    c.engine_failed("e0", 0.0, reason="exited")
    assert c.stalled("e0") == [] and c.reconcile("e0", 1, asked, copies, 1) == []
