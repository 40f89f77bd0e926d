"""The soak's rollout and sandbox invariants (``bench/soak_check.py``) on histories built by
hand, and which parts of a node each fault kind touches (``bench/soak_faults.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest

from bench.soak_check import (
    CheckpointAcked,
    Record,
    RolloutEnded,
    RolloutSubmitted,
    SandboxBack,
    TrajectorySeen,
    check,
)
from bench.soak_faults import parts_of
from bench.soak_node import ALL_KINDS, SANDBOX_KINDS, kinds_for


def rollout(rid: str = "r0", slots: int = 2, seen: tuple[int, ...] = (0, 1)) -> list[Record]:
    out: list[Record] = [RolloutSubmitted(rid=rid, t=0.0, workload="math", slots=slots)]
    out += [
        TrajectorySeen(rollout=rid, trajectory_id=f"{rid}-s{s}-a{i}", slot=s, attempt=i, t=1.0)
        for i, s in enumerate(seen)
    ]
    out.append(RolloutEnded(rid=rid, t=2.0, completed=len(set(seen))))
    return out


def violations(records: list[Record]) -> list[tuple[str, str]]:
    return [(v.invariant, v.detail) for v in check(records)]


def test_every_slot_published_exactly_once_passes() -> None:
    assert violations(rollout()) == []


def test_a_slot_published_twice_or_never_is_caught() -> None:
    (twice,) = violations(rollout(seen=(0, 1, 1)))
    assert twice[0] == "trajectories" and "slot 1 published 2 times" in twice[1]
    (lost,) = violations(rollout(seen=(0,)))
    assert lost[0] == "trajectories" and "[1] never published" in lost[1]


def test_a_rollout_not_followed_to_its_end_is_caught() -> None:
    records = [*rollout()[:-1], RolloutEnded(rid="r0", t=2.0, error="timeout: not done")]
    (v,) = violations(records)
    assert v[0] == "trajectories" and "timeout" in v[1]
    (orphan,) = violations(rollout()[1:])
    assert "never submitted" in orphan[1]


def test_a_restore_must_hold_an_acknowledged_checkpoint() -> None:
    ok: list[Record] = [
        CheckpointAcked(sandbox="sb", prefix=3, checkpoint_id="c3", t=1.0),
        SandboxBack(sandbox="sb", prefix=3, content="3", acked=3, t=2.0),
        SandboxBack(sandbox="sb", prefix=4, content="4", acked=3, t=3.0),  # in flight: kept
        SandboxBack(sandbox="sb", prefix=0, content="", acked=0, t=4.0),  # a fresh sandbox
    ]
    assert violations(ok) == []
    lost = SandboxBack(sandbox="sb", prefix=2, content="2", acked=3, t=2.0)
    wrong = SandboxBack(sandbox="sb", prefix=3, content="2", acked=3, t=2.0)
    assert [v[0] for v in violations([lost, wrong])] == ["sandbox", "sandbox"]


def test_sandbox_kinds_only_with_a_sandbox_lane_and_parts_per_kind() -> None:
    procs = {"router", "weights", "kv", "controller", "environment"}
    assert not set(SANDBOX_KINDS) & set(kinds_for(procs, "belayer"))
    assert set(SANDBOX_KINDS) <= set(kinds_for(procs, "belayer", sandboxes=True))
    assert not set(SANDBOX_KINDS) & set(kinds_for(procs - {"environment"}, "belayer", True))
    engines = ("e0", "e1")
    assert parts_of("worker-kill", "e1", engines) == {"engine:e1"}
    assert parts_of("router-kill", "e0", engines) == {"router", "engine:e0", "engine:e1"}
    assert parts_of("controller-kill", "e0", engines) == {"controller"}
    for kind in (*SANDBOX_KINDS, "environment-kill"):
        assert parts_of(kind, "e0", engines) == {"environment"}
    assert set(ALL_KINDS) >= {"sandbox-kill", "sandbox-pause", "checkpoint-interrupt"}


def test_train_runs_the_trainer_and_draws_trainer_kill_and_is_refused_with_serve() -> None:
    from bench.soak import SoakOptions, check_options, soak_config
    from bench.soak_train import TRAIN_LR, TRAIN_SAMPLES, TRAIN_TASKS
    from common.config import RunPaths
    from common.errors import InvalidRequest

    procs = {"router", "weights", "kv", "controller"}
    assert "trainer-kill" not in kinds_for(procs, "belayer")
    assert "trainer-kill" in kinds_for(procs | {"trainer"}, "belayer")
    assert parts_of("trainer-kill", "e0", ("e0",)) == {"trainer"}
    paths = RunPaths(Path("/tmp/soak-node"))
    cfg = soak_config(paths, SoakOptions(workload="math", train=True))
    assert cfg.training and not soak_config(paths, SoakOptions(workload="math")).training
    t = cfg.trainer
    assert (t.group_size, t.groups_per_step, t.optim.lr) == (TRAIN_SAMPLES, TRAIN_TASKS, TRAIN_LR)
    assert t.checkpoint_dir == paths.root / "trainer"
    with pytest.raises(InvalidRequest, match="--workload math or swe"):
        check_options(SoakOptions(workload="serve", train=True))


async def test_a_sandbox_fault_aims_at_the_lane_s_container_of_the_moment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Between sandboxes (no live container listed) the fault waits; a container Docker says
    is not running any more (replaced as the fault landed) is read again: the fault lands on
    the lane's next container, never on the stale one."""
    from bench import soak_work
    from common.errors import SandboxError

    listed = iter(["", "", "old", "new"])  # what the environment service lists, read by read
    faulted: list[str] = []

    class Lane:
        sandbox_id = "sb-1"

        async def live_container(self) -> str:
            return next(listed)

    def docker_fault(kind: str, cid: str) -> None:
        if cid == "old":
            raise SandboxError(f"{kind} of {cid} failed: container not running")
        faulted.append(cid)

    monkeypatch.setattr(soak_work, "docker_fault", docker_fault)
    target, pid, _t = await soak_work.container_fault("sandbox-pause", cast(Any, Lane()))
    assert faulted == ["new"] and pid == 0 and "(new)" in target


async def test_a_status_read_that_misses_its_deadline_is_tried_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from bench import soak_node

    answers = iter([None, None, soak_node.NodeView(procs={"environment": (7, True)}, engines={})])

    async def view(_nc: Any) -> soak_node.NodeView | None:
        return next(answers)

    monkeypatch.setattr(soak_node, "view", view)
    v = await soak_node.view_within(None)
    assert v is not None and v.procs["environment"] == (7, True)


def test_the_soaks_node_restarts_a_killed_service_without_crash_loop_backoff() -> None:
    from bench.soak import SoakOptions, soak_config
    from common.config import RunPaths
    from services.supervisor.backoff import Backoff

    cfg = soak_config(RunPaths(Path("/tmp/soak-node")), SoakOptions(workload="swe"))
    assert cfg.router.failure_window_s == 0.0
    b = Backoff(cfg.restart_backoff_s, cfg.restart_backoff_max_s, cfg.stable_after_s)
    # Killed every few seconds (the schedule's pace on one service): the delay never grows.
    assert [b.next_delay(2.0) for _ in range(6)] == [cfg.restart_backoff_s] * 6


def test_a_docker_kill_sent_but_not_seen_exiting_is_a_kill_made() -> None:
    from services.controller.fault_actions import kill_sent_not_exited

    # dockerd's answer (soak, 2026-12-04) when a checkpoint held the container frozen.
    seen = (
        "500 Server Error for http+docker://localhost/v1.41/containers/12cc5bf9e3f0/kill: "
        'Internal Server Error ("Cannot kill container: 12cc5bf9e3f0: tried to kill container, '
        'but did not receive an exit event")'
    )
    assert kill_sent_not_exited(seen)
    assert not kill_sent_not_exited('404 Client Error: Not Found ("No such container: 12cc")')
    assert not kill_sent_not_exited("Cannot kill container: 12cc: container is not running")
