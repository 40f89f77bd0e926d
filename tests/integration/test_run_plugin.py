"""``belayer run --workload SPEC`` end to end: the example plugin (``examples/plugin``, on
PYTHONPATH as a user would put it) trained for 2 GRPO steps on a node the run starts itself
(nats-server, weight store, KV arena, router, worker, controller, trainer) for the tests'
tiny random model (``model_dir``: the rewards, not the learning, are checked here), its
rollouts scored by a TRL-shaped reward function (``--reward``) the node enables:

- 2 steps recorded, each trajectory trained from its token ids, no error;
- the rewards are the reward function's (2 × brevity: fractions up to 2, which the
  plugin's own exact-match reward, 0 or 1, never gives), in training and held-out alike;
- the tasks are the plugin's, and ``run.json`` records the spec and the reward functions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "plugin"
SPEC = "belayer_example_tasks:make"
BREVITY = "belayer_example_rewards:brevity"
TASKS, N, STEPS = 2, 2, 2


def test_the_example_plugin_trains_two_steps(model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    path = os.environ.get("PYTHONPATH", "")
    env = {
        **os.environ,
        "BELAYER_HOME": str(tmp_path / "home"),
        "PYTHONPATH": f"{EXAMPLE}{os.pathsep}{path}" if path else str(EXAMPLE),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli.main", "run", "--workload", SPEC,
         "--steps", str(STEPS), "--tasks", str(TASKS), "--n", str(N), "--held-out", "2",
         "--model", str(model_dir), "--out", str(out), "--reward", BREVITY,
         "--reward-weights", "2", "--json"],
        capture_output=True, text=True, timeout=280, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, f"belayer run failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    report = json.loads(proc.stdout)
    assert report["workload"] == SPEC and report["errors"] == [], report["errors"]
    assert report["steps"] == STEPS
    steps = [r for r in report["per_step"] if r["step"] >= 1]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:  # every trajectory trained, from its token ids
        assert r["trajectories_completed"] == r["trajectories_trained"] == TASKS * N
        assert r["trajectories_lost"] == 0 and r["tokens"] > 0
        rewards = r["rewards"]
        assert len(rewards) == TASKS * N and all(0.0 <= x <= 2.0 for x in rewards), rewards
    every = [x for r in steps for x in r["rewards"]]
    assert any(x not in (0.0, 1.0) for x in every), every  # the reward function's, not 0/1
    held = list(steps[-1]["heldout_rewards"].values())
    assert len(held) == 2 and any(x not in (0.0, 1.0) for x in held), held
    assert report["weight_version"] == report["weight_version_start"] + STEPS
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["task_id"].startswith("cap-") for s in samples)
    state = json.loads((out / "run.json").read_text())
    assert state["workload"] == SPEC and state["rewards"] == [BREVITY]
    assert state["reward_weights"] == [2.0] and state["run_id"].startswith("capitals")
