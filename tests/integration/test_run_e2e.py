"""``belayer run swe`` end to end, real everything: the CLI starts a node (nats-server, weight
store, KV arena, router, worker + shadow, Docker + CRIU sandboxes, controller, trainer) for the
warm-started tiny SWE model and trains 2 GRPO steps while a rollout worker, a sandbox and the
trainer itself are SIGKILLed:

- every trajectory completes and is trained exactly once (0 lost), rewards are computed;
- the weight version advances by 2 and the engines generate with it;
- deterministic mode: the training forward agrees with the engine bitwise (diff exactly 0);
- the trainer killed during step 2's update resumed from its step-1 checkpoint and redid the
  step: the same update, recomputed here from that checkpoint on the same trajectories,
  gives bitwise the weights the node serves (on this model the update can be zero — each
  group all solved or all unsolved —; the runs whose weights always move are the math ones
  of test_transparency.py and test_run_resume.py);
- the run directory holds metrics.jsonl, TensorBoard files, samples.jsonl, the report and
  its plots.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from common.bus import connect
from common.codec import decode, encode
from common.config import RunPaths
from common.node import read_node, resolve_bus
from model.config import load_model_config
from model.training import load_weights, publishable_state_dict
from schemas.rollout import Trajectory
from services.controller.client import trajectories
from services.rl.node import run_trainer_config
from services.rl.options import LR_DEFAULTS
from services.trainer import journal
from services.trainer.service import to_sample
from services.trainer.update import grpo_step, load_state, weights_equal
from services.weights.client import fetch_manifest, map_weights
from tests.integration.env_helpers import require_docker
from tests.integration.node_helpers import Node, stop_node

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(420)]

TASKS, N = 4, 2
HELD_OUT = 4  # of swe's 18 (the default): evaluating all 18 twice took half the run
INJECT = "worker-kill@step=1,sandbox-kill@step=1,trainer-kill@step=2"


def belayer_run(home: Path, *args: str, timeout: float = 360.0) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "BELAYER_HOME": str(home)}
    return subprocess.run(
        [sys.executable, "-m", "services.cli.main", "run", *args],
        capture_output=True, text=True, timeout=timeout, env=env, check=False,
    )  # fmt: skip


async def test_two_steps_through_worker_sandbox_and_trainer_kills(
    warm_model: Callable[[str], Path], tmp_path: Path
) -> None:
    require_docker()
    model = warm_model("swe")
    out = tmp_path / "run"
    proc = belayer_run(
        tmp_path / "home", "swe", "--steps", "2", "--tasks", str(TASKS), "--n", str(N),
        "--model", str(model), "--out", str(out), "--inject", INJECT, "--keep-node", "--json",
        "--held-out", str(HELD_OUT),
    )  # fmt: skip
    node_paths = RunPaths(out / "node")
    info = read_node(node_paths)
    node = (
        Node(run_dir=node_paths.root, nats_url=info.nats_url, run_id=info.run_id) if info else None
    )
    try:
        assert proc.returncode == 0, f"belayer run failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
        report = json.loads(proc.stdout)
        assert node is not None
        check_run(report, out)
        await check_exact_resume(report, out, model, node_paths)
    finally:
        if node is not None:
            stop_node(node)


def check_run(report: dict, out: Path) -> None:
    slots = TASKS * N
    # nothing lost, every trajectory trained once, rewards computed
    assert report["steps"] == 2 and report["errors"] == [], report["errors"]
    assert report["trajectories_completed"] == 2 * slots
    assert report["trajectories_lost"] == 0 and report["trajectories_trained"] == 2 * slots
    steps = [r for r in report["per_step"] if r["step"] >= 1]
    for r in steps:
        assert r["trajectories_completed"] == r["trajectories_trained"] == slots
        assert 0.0 <= r["reward_mean"] <= 1.0 and r["tokens"] > 0
    # swe evaluates the held-out tasks every 5 steps and after the last: step 2, not step 1
    assert "heldout_reward" not in steps[0] and 0.0 <= steps[1]["heldout_reward"] <= 1.0
    assert (
        len(steps[1]["heldout_rewards"]) == HELD_OUT
        and report["heldout_reward_last"] == steps[1]["heldout_reward"]
    )
    assert report["reward_first_step"] == steps[0]["reward_mean"]
    assert report["reward_last_step"] == steps[1]["reward_mean"]
    # every injection fired and was recovered from
    assert report["failures_injected"] == 3 == report["failures_recovered"]
    fired = {e["detail"] for e in report["timeline"] if e["type"] == "injected"}
    assert fired == set(INJECT.split(","))
    assert report["handovers"] >= 1 and report["trainer_restarts"] == 1
    assert report["env_restores"] + report["restarts_from_scratch"] >= 1
    # the weights advanced by exactly 2 versions; deterministic: bitwise on-policy
    assert report["weight_version"] == report["weight_version_start"] + 2
    assert report["deterministic"] and report["logprob_diff_max"] == 0.0
    # the logs users read
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert samples and all(
        {"prompt", "response", "reward", "recovery"} <= s.keys() for s in samples
    )
    assert any(s["recovery"] for s in samples)  # the killed sandbox's trajectory is sampled
    assert list((out / "tb").glob("events.out.tfevents.*"))
    assert (out / "report.md").read_text().startswith("# belayer run swe")
    assert sorted(Path(p).name for p in report["plots"]) == [
        "failures.png",
        "reward.png",
        "time.png",
    ]
    assert all(Path(p).stat().st_size > 1000 for p in report["plots"])


async def check_exact_resume(report: dict, out: Path, model: Path, node_paths: RunPaths) -> None:
    """Step 2 was redone by the restarted trainer; redo it here from the same checkpoint on the
    same trajectories: the same weights, bit for bit."""
    kill = next(k for k in report["kills"] if k["kind"] == "trainer-kill")
    assert kill["recovered_t"] and kill["replay_steps"] == 1  # the kill landed mid-update
    url, bus = resolve_bus(None, role="operator", paths=node_paths)
    nc = await connect(url, name="test-run-e2e", bus=bus)
    try:
        rollout_id = report["per_step"][-1]["rollout_id"]
        trajs = {t.trajectory_id: t for t in await trajectories(nc, rollout_id)}
        served = dict(map_weights(await fetch_manifest(nc, report["weight_version"])))
    finally:
        await nc.drain()
    redo_step_2(report, out / "trainer", model, trajs, served)


def redo_step_2(
    report: dict, ckpt: Path, model: Path, trajs: dict[str, Trajectory], served: dict
) -> None:
    plan = journal.read_plan(journal.plan_path(ckpt, 2))
    assert sorted(plan.trajectory_ids) == sorted(trajs)
    # The run's trainer: swe's learning rate, a cosine over the run's 2 steps (the defaults).
    trainer = run_trainer_config(
        group_size=N, groups_per_step=TASKS, checkpoint_dir=ckpt, lr=LR_DEFAULTS["swe"],
        decay_steps=2,
    )  # fmt: skip
    samples = [
        to_sample(decode(encode(trajs[i]), Trajectory), 0, trainer.temperature)
        for i in plan.trajectory_ids
    ]
    torch.set_num_threads(1)
    state, _ = load_state(
        journal.checkpoint_path(ckpt, 1), load_model_config(model), trainer.optim,
        deterministic=True,
    )  # fmt: skip
    again = grpo_step(
        state, samples, group_size=N, grpo=trainer.grpo, optim=trainer.optim,
        pad_id=trainer.pad_token_id,
    )  # fmt: skip
    ours = publishable_state_dict(state.model)
    assert again.version == report["weight_version"]
    assert weights_equal(ours, load_weights(journal.checkpoint_path(ckpt, 2)))
    assert weights_equal(ours, served)
    trained = json.loads((journal.checkpoint_path(ckpt, 2) / "meta.json").read_text())["trained"]
    assert len(trained) == len(set(trained)) == 2 * TASKS * N  # each trajectory once
