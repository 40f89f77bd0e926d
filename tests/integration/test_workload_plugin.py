"""A user's workload through a real node: the example plugin (``examples/plugin``, on
PYTHONPATH as a user would put it) enabled with ``belayer up --workload-plugin``; ``belayer
rollout`` runs its tasks on the controller, which scores them with the plugin's own reward; a
plugin the node was not started with is refused ``unauthorized`` — the controller imports no
code a request names."""

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


@pytest.fixture(scope="module")
def plugin_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    with pytest.MonkeyPatch.context() as mp:
        path = os.environ.get("PYTHONPATH", "")
        mp.setenv("PYTHONPATH", f"{EXAMPLE}{os.pathsep}{path}" if path else str(EXAMPLE))
        node = start_node(tmp_path_factory.mktemp("plugin"), "--workload-plugin", SPEC)
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
