"""The bundled SWE tasks for real (real dockerd, real environment service, the locally built
``belayer-swe:1`` image): each scores 0 unfixed and 1 after its reference fix; the running-process
task needs its process (and the state the agent put into it), also across a checkpoint/restore."""

from __future__ import annotations

import json
from pathlib import Path

import docker
import pytest

from common.errors import NotFound
from workloads import HiddenTests, SandboxHandle, SandboxOps, load_workload
from workloads.runner import run_action, run_episode
from workloads.scoring import score_tests
from workloads.swe import SWE_IMAGE

pytestmark = [pytest.mark.docker]

DATA = Path(__file__).resolve().parents[2] / "workloads" / "data"

# Stop the agent's kvd and wait (bounded) until it is gone; the bracket keeps the pattern from
# matching this very shell's command line.
KILL_SERVER = (
    "pkill -f '^python3 kvd[.]py'; for i in $(seq 100); do "
    "pgrep -f '^python3 kvd[.]py' >/dev/null || exit 0; sleep 0.05; done; exit 1"
)


@pytest.mark.timeout(300)
async def test_every_bundled_task_scores_0_unfixed_and_1_after_its_reference_fix(env) -> None:
    ops: SandboxOps = env.client  # EnvClient satisfies the workloads protocol structurally
    swe = load_workload("swe-bundled")
    tasks = swe.tasks(len(swe.train)) + swe.held_out(len(swe.evaluation))  # type: ignore[attr-defined]  # not in the protocol
    assert len(tasks) >= 4 and {t.id for t in tasks} >= {"kv_daemon"}
    for task in tasks:
        before = await run_episode(ops, task, actions=[])
        assert before.score is not None and before.score.reward == 0.0, (task.id, before.score)
        assert isinstance(task.reward, HiddenTests), task.id
        assert set(task.reward.fail_to_pass) <= set(before.score.failed), task.id
        assert set(task.reward.pass_to_pass) <= set(before.score.passed), task.id
        after = await run_episode(ops, task, trajectory_id=f"verify-{task.id}".replace("_", "-"))
        assert after.score is not None and after.score.reward == 1.0, (
            task.id,
            after.score,
            after.steps,
        )
        assert all(s.exit_code == 0 and not s.timed_out for s in after.steps), task.id
    assert not (await env.client.list()).sandboxes


@pytest.mark.timeout(120)
async def test_tests_the_agent_ran_before_a_fix_do_not_hide_it(env) -> None:
    """The agent runs the visible tests with bytecode writing switched back on (sandbox
    commands write none by default: ``workloads.actions.NO_BYTECODE``; an agent can undo that),
    so Python caches calc.py's bytecode; then it fixes calc.py with an edit of the same size and
    the same mtime (as ``touch -r``, rsync or a checkout can leave it): bytecode validated by
    mtime and size is stale, and the hidden tests must not run it — the fix scores 1."""
    ops: SandboxOps = env.client
    task = load_workload("swe").task("calc_clamp")
    (fix,) = task.reference_actions
    actions = [
        "env -u PYTHONDONTWRITEBYTECODE python3 -m pytest -q",
        f"cp -p calc.py /tmp/calc.orig && {fix} && touch -r /tmp/calc.orig calc.py",
        "ls __pycache__ && stat -c %s calc.py /tmp/calc.orig",
    ]
    ep = await run_episode(ops, task, actions=actions)
    assert all(s.exit_code == 0 for s in ep.steps), [s.observation for s in ep.steps]
    sizes = ep.steps[2].observation.split()[-2:]
    assert sizes[0] == sizes[1] and "calc" in ep.steps[2].observation  # a stale .pyc is there
    assert ep.score is not None and ep.score.reward == 1.0, ep.score


async def test_an_edit_right_after_a_test_run_is_what_the_next_run_sees(env) -> None:
    """Sandbox commands write no bytecode, so a same-size, same-mtime fix made right after a
    test run is what the agent's next test run imports (no stale ``__pycache__`` to hide it)."""
    ops: SandboxOps = env.client
    task = load_workload("swe").task("calc_clamp")
    (fix,) = task.reference_actions
    actions = [
        "python3 -m pytest -q",
        f"cp -p calc.py /tmp/calc.orig && {fix} && touch -r /tmp/calc.orig calc.py",
        "test ! -e __pycache__ && python3 -m pytest -q",
    ]
    ep = await run_episode(ops, task, actions=actions)
    assert ep.steps[0].exit_code == 0 and "passed" in ep.steps[0].observation
    # No __pycache__ after the first run, so the next run imports the fixed file.
    assert ep.steps[2].exit_code == 0, ep.steps[2].observation
    assert ep.score is not None and ep.score.reward == 1.0, ep.score


@pytest.mark.timeout(240)
async def test_running_process_task_needs_the_process_and_its_state(env) -> None:
    ops: SandboxOps = env.client
    swe = load_workload("swe")
    task = swe.task("kv_daemon")
    fix, start, put = task.reference_actions

    # Files fixed but the server never started: 0.
    ep = await run_episode(ops, task, actions=[fix])
    assert ep.score is not None and ep.score.reward == 0.0
    assert "tests/test_live.py::test_parse_keeps_spaces" in ep.score.passed
    assert "tests/test_live.py::test_server_holds_greeting" in ep.score.failed

    # Server started *before* the fix: the running process has the old code, 0.
    ep = await run_episode(ops, task, actions=[start, put, fix])
    assert ep.score is not None and ep.score.reward == 0.0
    assert "tests/test_live.py::test_server_keeps_spaces" in ep.score.failed

    # Solved, then the process is killed: 0; started again, its memory is empty: still 0.
    ep = await run_episode(ops, task, keep=True)
    sid = ep.sandbox_id
    try:
        assert ep.score is not None and ep.score.reward == 1.0
        assert await swe.reward(task, SandboxHandle(ops, sid)) == 1.0
        killed = await run_action(ops, task, sid, KILL_SERVER)
        assert killed.exit_code == 0, killed.observation
        assert (await score_tests(ops, task, sid)).reward == 0.0
        assert (await run_action(ops, task, sid, start)).exit_code == 0
        score = await score_tests(ops, task, sid)
        assert score.reward == 0.0 and score.failed == [
            "tests/test_live.py::test_server_holds_greeting"
        ]
    finally:
        await env.client.destroy(sid)


@pytest.mark.timeout(240)
async def test_running_process_state_survives_checkpoint_and_restore(env) -> None:
    """The controller restores this task's sandbox to a ready prefix: the server and the value
    the agent stored in its memory come back with it."""
    ops: SandboxOps = env.client
    task = load_workload("swe").task("kv_daemon")
    ep = await run_episode(ops, task, keep=True, trajectory_id="kv-restore")
    sid = ep.sandbox_id
    try:
        assert ep.score is not None and ep.score.reward == 1.0
        await env.client.checkpoint(sid, 3, trajectory_id="kv-restore")
        listing = {s.id: s for s in (await env.client.list()).sandboxes}
        docker.DockerClient(version="auto").api.kill(listing[sid].container_id)
        await env.client.restore(sid)
        assert (await score_tests(ops, task, sid)).reward == 1.0
    finally:
        await env.client.destroy(sid)


def test_a_missing_image_is_a_clear_error_at_load(tmp_path: Path) -> None:
    """deploy/install_env.sh built the image the bundled tasks name; a missing one is a
    ``NotFound`` when the workload loads, before any sandbox starts."""
    assert load_workload("swe").task("calc_clamp").sandbox.image == SWE_IMAGE  # type: ignore[union-attr]  # SWE tasks have one
    with pytest.raises(NotFound, match="sandbox image not found") as exc:
        load_workload("swe", image="belayer-absent:0")
    assert exc.value.data["image"] == "belayer-absent:0"
    row = json.loads((DATA / "swe_gym_sample.jsonl").read_text().splitlines()[0])
    row["image"] = "belayer-absent-instance:0"
    path = tmp_path / "instances.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(NotFound, match="sandbox image not found"):
        load_workload("swe-gym", path=path)
    assert load_workload("swe-gym", path=DATA / "swe_gym_sample.jsonl").tasks(1)
