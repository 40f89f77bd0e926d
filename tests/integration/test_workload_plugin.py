"""A user's workload through a real node: the example plugin (``examples/plugin``, on
PYTHONPATH as a user would put it) enabled with ``belayer up --workload-plugin``; ``belayer
rollout`` runs its tasks on the controller, which scores them with the plugin's own reward; a
plugin the node was not started with is refused ``unauthorized`` — the controller imports no
code a request names. Reward functions (TRL-shaped, ``belayer rollout --reward``) score instead
of the workload's reward; one that raises leaves a typed ``reward_error`` on each trajectory,
counted in ``reward_failures``, and the rollout completes. A user's own dataset (a
``datasets`` ``save_to_disk`` directory, ``--prompt-column``/``--answer-column``) rolls out on
the same node."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.node_helpers import Node, cli, start_node, stop_node

pytestmark = pytest.mark.timeout(300)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "plugin"
SPEC = "belayer_example_tasks:make"
BREVITY = "belayer_example_rewards:brevity"
BROKEN = "belayer_example_rewards:broken"


@pytest.fixture(scope="module")
def plugin_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    with pytest.MonkeyPatch.context() as mp:
        path = os.environ.get("PYTHONPATH", "")
        mp.setenv("PYTHONPATH", f"{EXAMPLE}{os.pathsep}{path}" if path else str(EXAMPLE))
        node = start_node(
            tmp_path_factory.mktemp("plugin"), "--workload-plugin", SPEC,
            "--reward-function", BREVITY, "--reward-function", BROKEN,
        )  # fmt: skip
        try:
            yield node
        finally:
            stop_node(node)


def test_a_plugin_workload_rolls_out_and_is_scored_by_its_own_reward(plugin_node: Node) -> None:
    args = ["rollout", SPEC, "--tasks", "2", "--n", "2", "--max-tokens", "8"]
    out = cli(*args, "--temperature", "1", "--json", run_dir=plugin_node.run_dir, timeout=180)
    result = json.loads(out.stdout)
    assert result["workload"] == SPEC
    assert result["trajectories_completed"] == 4 == len(result["trajectories"])
    rows = result["trajectories"]
    assert {r["task_id"].split("-")[0] for r in rows} == {"cap"}  # the plugin's own tasks
    assert all(r["reward"] in (0.0, 1.0) for r in rows)  # its exact-match reward


def test_a_plugin_the_node_does_not_enable_is_refused(plugin_node: Node) -> None:
    out = cli(
        "rollout", "os:getcwd", "--tasks", "1", "--json",
        run_dir=plugin_node.run_dir, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode != 0
    assert "does not run that workload plugin" in out.stderr
    assert "Traceback" not in out.stderr


def _rollout(node: Node, *extra: str) -> dict:
    args = ["rollout", SPEC, "--tasks", "2", "--n", "2", "--max-tokens", "8", "--json", *extra]
    return dict(json.loads(cli(*args, run_dir=node.run_dir, timeout=180).stdout))


def test_reward_functions_score_instead_of_the_workload(plugin_node: Node) -> None:
    result = _rollout(plugin_node, "--reward", BREVITY, "--reward-weights", "2")
    assert result["trajectories_completed"] == 4 and result["reward_failures"] == 0
    for row in result["trajectories"]:
        assert row["reward_error"] == ""
        assert 0.0 < row["reward"] <= 2.0  # 2 × (1 - characters / 100) of a short response


def test_a_failing_reward_function_is_a_counted_record_not_a_failed_rollout(
    plugin_node: Node,
) -> None:
    result = _rollout(plugin_node, "--reward", BROKEN)
    assert result["trajectories_completed"] == 4 == result["reward_failures"]
    assert result["trajectories_failed"] == 0
    for row in result["trajectories"]:
        assert row["state"] == "finished"
        assert "broken on purpose" in row["reward_error"]
        assert BROKEN in row["reward_error"]


def test_a_reward_function_the_node_does_not_enable_is_refused(plugin_node: Node) -> None:
    out = cli(
        "rollout", SPEC, "--tasks", "1", "--reward", "belayer_example_rewards:exact",
        run_dir=plugin_node.run_dir, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode != 0 and "does not run that reward function" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_users_dataset_rolls_out_by_its_columns(plugin_node: Node, tmp_path: Path) -> None:
    """``--dataset`` a ``datasets`` ``save_to_disk`` directory with ``--prompt-column`` and
    ``--answer-column``: the controller reads it as a ``table`` and scores by the answer; a
    column it lacks is the one error line, naming the column and the columns it has."""
    import datasets

    saved = tmp_path / "qa"
    rows = [{"question": f"What is {i} + {i}?", "solution": str(2 * i)} for i in range(6)]
    datasets.Dataset.from_list(rows).save_to_disk(str(saved))
    args = ["rollout", "math", "--dataset", str(saved), "--tasks", "2", "--max-tokens", "8"]
    out = cli(
        *args, "--prompt-column", "question", "--answer-column", "solution", "--json",
        run_dir=plugin_node.run_dir, timeout=180,
    )  # fmt: skip
    result = json.loads(out.stdout)
    assert result["trajectories_completed"] == 2 and result["trajectories_failed"] == 0
    assert all(r["task_id"].startswith("table-") for r in result["trajectories"])
    assert all(r["reward"] in (0.0, 1.0) for r in result["trajectories"])
    bad = cli(
        *args, "--prompt-column", "q", "--answer-column", "solution",
        run_dir=plugin_node.run_dir, timeout=60, check=False,
    )  # fmt: skip
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
    assert "no prompt column 'q'" in bad.stderr and "question, solution" in bad.stderr
