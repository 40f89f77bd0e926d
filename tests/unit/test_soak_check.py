"""The soak's invariant checker (``bench/soak_check.py``) on histories built by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.soak_check import (
    SLOW_S,
    BatchSeen,
    Delta,
    EpochSeen,
    Errored,
    Fault,
    Finished,
    Leftovers,
    Record,
    Reference,
    RolloutEnded,
    RolloutSubmitted,
    Submitted,
    TrajectorySeen,
    check,
    dump,
    fault_table,
    load,
)
from bench.soak_train_check import (
    Trained,
    TrainerResumedSeen,
    TrainError,
    TrainLane,
    TrainLaneEnded,
    trained_counts,
)


def sub(rid: str, t: float = 0.0, stream: bool = True) -> Submitted:
    return Submitted(
        rid=rid, t=t, stream=stream, prompt="p", temperature=0.0, seed=None, max_tokens=4
    )


def good(rid: str = "r1", tokens: tuple[int, ...] = (1, 2, 3, 4)) -> list[Record]:
    """A streaming request handed its tokens in two deltas, finished, with its reference."""
    toks = list(tokens)
    return [
        sub(rid),
        Delta(rid=rid, t=1.0, start=0, tokens=toks[:2]),
        Delta(rid=rid, t=2.0, start=2, tokens=toks[2:]),
        Finished(rid=rid, t=2.1, tokens=toks, finish_reason="length"),
        Reference(rid=rid, tokens=toks),
    ]


def invariants(records: list[Record]) -> list[str]:
    return [v.invariant for v in check(records)]


def test_a_clean_history_passes() -> None:
    records = [
        *good("a"),
        *good("b", (5, 6)),
        sub("c", stream=False),
        Finished(rid="c", t=3.0, tokens=[9], finish_reason="length"),
        Reference(rid="c", tokens=[9]),
        EpochSeen(engine="e0", epoch=1, t=0.0),
        EpochSeen(engine="e0", epoch=2, t=5.0),
        BatchSeen(engine="e0", epoch=1, pid=10, t=0.5),
        BatchSeen(engine="e0", epoch=2, pid=11, t=5.5),
        Fault(kind="worker-kill", t=1.5, target="e0", pid=10, recovered_t=1.6),
        Leftovers(),
    ]
    assert check(records) == []


def test_a_request_must_finish_exactly_once() -> None:
    unfinished: list[Record] = [sub("r")]
    assert invariants(unfinished) == ["finished_once"]
    twice = [*good("r"), Finished(rid="r", t=3.0, tokens=[1, 2, 3, 4], finish_reason="length")]
    assert invariants(twice) == ["finished_once"]
    errored: list[Record] = [sub("r"), Errored(rid="r", t=1.0, error="timeout")]
    assert invariants(errored) == ["finished_once"]
    stray: list[Record] = [Finished(rid="x", t=1.0, tokens=[], finish_reason="length")]
    assert invariants(stray) == ["finished_once"]


def test_tokens_must_equal_the_reference() -> None:
    records = good("r")
    records[-1] = Reference(rid="r", tokens=[1, 2, 9, 4])
    (v,) = check(records)
    assert v.invariant == "reference" and "index 2" in v.detail
    shorter = good("r")
    shorter[-1] = Reference(rid="r", tokens=[1, 2, 3])
    assert "index 3" in check(shorter)[0].detail
    assert invariants(good("r")[:-1]) == ["reference"]  # none computed
    failed = [*good("r")[:-1], Reference(rid="r", tokens=[], error="boom")]
    assert invariants(failed) == ["reference"]


@pytest.mark.parametrize(
    ("starts", "what"),
    [((0, 1), "overlap"), ((0, 3), "gap"), ((1, 2), "gap")],
)
def test_a_token_handed_twice_or_out_of_order_is_caught(starts: tuple[int, int], what: str) -> None:
    records = good("r")
    records[1] = Delta(rid="r", t=1.0, start=starts[0], tokens=[1, 2])
    records[2] = Delta(rid="r", t=2.0, start=starts[1], tokens=[3, 4])
    (v,) = check(records)
    assert v.invariant == "stream" and what in v.detail


def test_deltas_must_add_up_to_the_result() -> None:
    records = good("r")
    del records[2]  # the second delta never came, yet the result holds 4 tokens
    assert invariants(records) == ["stream"]
    quiet: list[Record] = [sub("q", stream=False), Delta(rid="q", t=1.0, start=0, tokens=[1])]
    quiet += [Finished(rid="q", t=2, tokens=[1], finish_reason="length")]
    quiet += [Reference(rid="q", tokens=[1])]
    assert invariants(quiet) == ["stream"]


def test_epochs_only_grow_and_one_worker_streams_per_epoch() -> None:
    back: list[Record] = [
        EpochSeen(engine="e0", epoch=3, t=1.0),
        EpochSeen(engine="e0", epoch=2, t=2.0),
    ]
    assert invariants(back) == ["epochs"]
    # out of order in the file, in order in time: fine; another engine's epochs are its own
    fine: list[Record] = [
        EpochSeen(engine="e0", epoch=3, t=2.0),
        EpochSeen(engine="e0", epoch=2, t=1.0),
        EpochSeen(engine="e1", epoch=1, t=3.0),
    ]
    assert check(fine) == []
    brain: list[Record] = [
        BatchSeen(engine="e0", epoch=4, pid=10, t=1.0),
        BatchSeen(engine="e0", epoch=4, pid=11, t=1.1),
        BatchSeen(engine="e1", epoch=4, pid=12, t=1.2),
    ]
    (v,) = check(brain)
    assert v.invariant == "split_brain" and v.subject == "e0" and "[10, 11]" in v.detail


def test_unrecovered_faults_and_leftovers_are_violations() -> None:
    records: list[Record] = [
        Fault(kind="router-kill", t=1.0, target="router", pid=5, recovered_t=None, detail="x"),
        Leftovers(processes=["123 python -m services.worker"], shm=["/dev/shm/belayer-x"]),
    ]
    assert invariants(records) == ["recovered", "leftovers", "leftovers"]


def test_the_fault_table_counts_recoveries_and_slow_requests() -> None:
    records: list[Record] = [
        Fault(kind="worker-kill", t=10.0, target="e0", pid=1, recovered_t=10.1, back_t=10.05),
        Fault(kind="worker-kill", t=20.0, target="e0", pid=2, recovered_t=20.3),
        Fault(kind="worker-kill", t=25.0, target="e0", pid=4, recovered_t=25.2),
        Fault(kind="worker-hang", t=30.0, target="e0", pid=3, recovered_t=None),
        # in flight at 10.0: next token 0.05 s later; at 30.0: 2.5 s later (slow)
        sub("a", t=9.0),
        Delta(rid="a", t=9.5, start=0, tokens=[1]),
        Delta(rid="a", t=10.05, start=1, tokens=[2]),
        Finished(rid="a", t=10.2, tokens=[1, 2], finish_reason="length"),
        sub("b", t=29.0),
        Delta(rid="b", t=29.5, start=0, tokens=[1]),
        Delta(rid="b", t=30.0 + SLOW_S + 0.5, start=1, tokens=[2]),
        Finished(rid="b", t=33.0, tokens=[1, 2], finish_reason="length"),
        # not streaming, or not in flight: not counted
        sub("c", t=9.0, stream=False),
        Finished(rid="c", t=11.0, tokens=[1], finish_reason="length"),
        sub("d", t=10.5),
        Finished(rid="d", t=11.0, tokens=[], finish_reason="length"),
    ]
    kill, hang = fault_table(records)
    assert (kill.kind, kill.count, kill.recovered) == ("worker-kill", 3, 3)
    assert kill.recover_p50_s == pytest.approx(0.2) and kill.recover_p99_s == pytest.approx(0.3)
    assert kill.back_p50_s == pytest.approx(0.05)  # the one fault that says when it was back
    assert (kill.requests_hit, kill.slow) == (1, 0)
    assert (hang.count, hang.recovered, hang.recover_p50_s) == (1, 0, None)
    assert (hang.requests_hit, hang.slow) == (1, 1)
    assert hang.wait_max_s == pytest.approx(SLOW_S + 0.5)


def test_records_round_trip_through_jsonl(tmp_path: Path) -> None:
    records = [*good("r"), Fault(kind="shadow-kill", t=1.0, target="e0", pid=7), Leftovers()]
    path = tmp_path / "history.jsonl"
    path.write_bytes(b"".join(dump(r) for r in records))
    assert load(path) == records
    path.write_bytes(b'{"type": "nonsense"}\n')
    with pytest.raises(ValueError, match=r"history\.jsonl:1"):
        load(path)


def test_a_fault_not_injected_is_reported_as_such_not_as_a_failed_recovery() -> None:
    records: list[Record] = [
        Fault(
            kind="sandbox-pause",
            t=1.0,
            target="e0",
            pid=0,
            injected=False,
            detail="could not be injected: SandboxError('no live container')",
        ),
        # an older history marks it in its detail only
        Fault(
            kind="environment-kill",
            t=2.0,
            target="environment",
            pid=0,
            detail="could not be injected: BelayerError('the node does not answer')",
        ),
        Fault(kind="sandbox-pause", t=3.0, target="e0", pid=0, recovered_t=4.0, back_t=3.5),
    ]
    assert invariants(records) == ["injected", "injected"]
    pause, env = fault_table(records)
    assert (pause.count, pause.not_injected, pause.recovered) == (2, 1, 1)
    assert (env.count, env.not_injected, env.recovered) == (1, 1, 0)


def lane(t: float = 0.0) -> TrainLane:
    return TrainLane(t=t, workload="math", tasks=2, n=2, base_step=0)


def seen(*tids: str) -> list[Record]:
    """Rollout ``r`` submitted, each of ``tids`` published in its slot, done."""
    return [
        RolloutSubmitted(rid="r", t=0.1, workload="math", slots=len(tids)),
        *(TrajectorySeen(rollout="r", trajectory_id=tid, slot=i, attempt=0, t=0.5)
          for i, tid in enumerate(tids)),
        RolloutEnded(rid="r", t=0.6, completed=len(tids)),
    ]  # fmt: skip


def trained(step: int, *tids: str, t: float = 1.0, via: str = "event") -> Trained:
    return Trained(step=step, rollout="r", trajectory_ids=list(tids), version=step, t=t, via=via)


def test_a_clean_training_history_passes_and_is_counted() -> None:
    records: list[Record] = [
        lane(), *seen("a", "b", "c", "d"), trained(1, "a", "b"),
        trained(2, "c", "d", via="resume"), TrainLaneEnded(t=3.0, steps=2),
    ]  # fmt: skip
    assert check(records) == []
    assert trained_counts(records) == (2, 4)


def test_a_trajectory_trained_twice_or_never_published_is_caught() -> None:
    records: list[Record] = [
        lane(), *seen("a", "b"), trained(1, "a", "b"), trained(2, "b", "x"),
        TrainLaneEnded(t=3.0, steps=2),
    ]  # fmt: skip
    found = {(v.invariant, v.subject) for v in check(records)}
    assert found == {("trained_once", "b"), ("trained_published", "step 2")}


def test_train_steps_must_strictly_increase() -> None:
    records: list[Record] = [
        lane(), *seen("a", "b", "c"), trained(2, "a"), trained(2, "b"), trained(1, "c"),
        TrainLaneEnded(t=3.0, steps=3),
    ]  # fmt: skip
    found = [(v.invariant, v.detail) for v in check(records)]
    assert found == [("train_steps", "finished twice"), ("train_steps", "after step 2")]


def test_the_lane_must_train_after_every_trainer_kill_and_never_fail() -> None:
    kill = Fault(kind="trainer-kill", t=5.0, target="trainer", pid=9, recovered_t=6.0)
    ok = [lane(), *seen("a"), trained(1, "a", t=7.0), kill, TrainLaneEnded(t=8.0, steps=1)]
    assert check(ok) == []
    stalled = [lane(), *seen("a"), trained(1, "a", t=4.0), kill, TrainLaneEnded(t=8.0, steps=1)]
    assert invariants(stalled) == ["train_lane"]
    failed: list[Record] = [*ok, TrainError(step=2, t=7.5, error="timeout: no train_step")]
    assert [(v.invariant, v.subject) for v in check(failed)] == [("train_lane", "lane step 2")]
    assert invariants([lane()]) == ["train_lane", "train_lane"]  # nothing trained, no end
    could_not_start: list[Record] = [
        TrainError(step=0, t=1.0, error="invalid_request: the node runs no trainer"),
        TrainLaneEnded(t=2.0, steps=0),
    ]
    assert [v.subject for v in check(could_not_start)] == ["lane step 0", "lane"]


def test_a_history_without_training_checks_none_of_it() -> None:
    assert check([*good(), TrainerResumedSeen(step=1, version=1, trained=4, replay_steps=0,
                                              t=1.0)]) == []  # fmt: skip
    assert trained_counts(good()) == (0, 0)
