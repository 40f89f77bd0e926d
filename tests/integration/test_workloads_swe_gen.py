"""Generated SWE tasks for real (real dockerd, real environment service, the locally built
``belayer-swe:1`` image): a training instance, a held-out instance and a held-out-family
instance each score 0 unfixed and 1 after their reference fix, and the general recipe the
``swe`` demonstrations record (tests, read the module, fix, tests) shows the agent the failing
call and then a clean pass."""

from __future__ import annotations

import pytest

from services.rl.demonstrations import general_actions
from workloads import HiddenTests, SandboxOps, load_workload
from workloads.runner import run_episode

pytestmark = [pytest.mark.docker]

TASK_IDS = [
    "gen-missing_clamp-t-0",  # cobalt.py, test_cobalt.py
    "gen-inverted_condition-t-0",  # nectar/pillar.py, tests/test_pillar.py
    "gen-boundary-i-0",  # marina/oasis.py, tests/test_oasis.py
    "gen-missing_abs-f-0",  # fjord/quiver.py, test_quiver.py
]


@pytest.mark.timeout(150)
async def test_generated_tasks_score_0_unfixed_and_1_after_the_reference_fix(env) -> None:
    ops: SandboxOps = env.client
    swe = load_workload("swe")
    tasks = [swe.task(t) for t in TASK_IDS]
    assert {t.metadata["split"] for t in tasks} == {"train", "heldout-instance", "heldout-family"}
    for task in tasks:
        before = await run_episode(ops, task, actions=[])
        assert before.score is not None and before.score.reward == 0.0, (task.id, before.score)
        assert isinstance(task.reward, HiddenTests), task.id
        assert set(task.reward.fail_to_pass) <= set(before.score.failed), task.id
        assert set(task.reward.pass_to_pass) <= set(before.score.passed), task.id
        after = await run_episode(ops, task)
        assert after.score is not None and after.score.reward == 1.0, (task.id, after.score)
        assert all(s.exit_code == 0 and not s.timed_out for s in after.steps), task.id

    task = tasks[0]
    ep = await run_episode(ops, task, actions=general_actions(task))
    assert ep.score is not None and ep.score.reward == 1.0, ep.score
    first, shown, fix, last = (s.observation for s in ep.steps)
    call = task.prompt[-1].content.split(" returns ")[0]
    assert first.startswith("exit_code: 1") and call in first and "1 failed" in first
    assert shown.startswith("exit_code: 0") and "def " in shown
    assert fix == "exit_code: 0" and last.startswith("exit_code: 0") and " passed" in last
    assert len(first) < 1000 and "failed" not in last  # the observation fits, uncut
    assert not (await env.client.list()).sandboxes
