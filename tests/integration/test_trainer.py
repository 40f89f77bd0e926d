"""The GRPO trainer inside a real node (nats-server, weight store, router, worker + shadow, the
trainer, all real processes; the real tiny model): trajectories generated through the router
and published to stream TRAJECTORIES are trained on, the new weights are pushed and the
workers switch; a malformed record is dead-lettered; a trainer SIGKILLed mid-step is restarted
by the supervisor, resumes from its checkpoint, trains every trajectory exactly once, and its
update equals the same update run without a kill; a trainer SIGKILLed after a step's checkpoint
and before its `train_step` publishes that event again when it resumes (`republished`), and
training goes on."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio
import torch
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from common import subjects
from common.bus import connect
from common.codec import decode, encode
from common.config import config_argv
from common.events import EventTail
from common.training_config import OptimConfig
from model.config import load_model_config
from model.training import load_weights, publishable_state_dict, read_meta, weights_sha256
from schemas.events import (
    ServiceRestarted,
    TrainerCheckpointed,
    TrainerResumed,
    TrainStep,
    TrainStepStarted,
    TrajectoryRefused,
    WeightsUpdated,
    WorkerWeightsSwapped,
)
from schemas.rollout import Trajectory
from schemas.serving import GenerateRequest, SamplingParams
from services.router.client import generate
from services.supervisor.config import SupervisorConfig
from services.trainer import journal
from services.trainer.client import GrpoConfig, TrainerConfig, trainer_status
from services.trainer.service import to_sample
from services.trainer.update import grpo_step, load_state, weights_equal
from services.weights.client import fetch_manifest, map_weights
from tests.integration.node_helpers import Node, stop_node, supervisor_pids, wait_until

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

GROUP, GROUPS = 2, 2
TRAINER = TrainerConfig(
    group_size=GROUP,
    groups_per_step=GROUPS,
    ack_wait_s=2.0,
    hold_before_checkpoint_s=2.0,  # a kill right after train_step_started lands mid-step
    hold_after_checkpoint_s=3.0,  # a kill right after trainer_checkpointed lands before the push
    optim=OptimConfig(lr=1e-3, seed=3),
    grpo=GrpoConfig(micro_batch_size=2),
)
OBSERVATION = [101, 102, 103]
DETERMINISTIC = SupervisorConfig().worker.engine.deterministic
"""The node's engines (and so its trainer) run the batch-invariant forward by default."""


@pytest.fixture(scope="module")
def training_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """A node with the trainer, started like ``belayer up --detach`` (the supervisor in its
    own session), stopped with ``belayer down`` and checked for leftovers."""
    run_dir = tmp_path_factory.mktemp("trainer-node")
    config = SupervisorConfig(run_dir=str(run_dir), training=True, trainer=TRAINER)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    with open(run_dir / "logs" / "supervisor.out", "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.supervisor", *config_argv(config)],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    deadline = time.monotonic() + 240
    node_file = run_dir / "node.json"
    while True:
        info = json.loads(node_file.read_text()) if node_file.exists() else {}
        if info.get("ready"):
            break
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError((run_dir / "logs" / "supervisor.out").read_text()[-3000:])
        time.sleep(0.1)  # polling the node file the supervisor writes when ready
    node = Node(run_dir=run_dir, nats_url=info["nats_url"], run_id=info["run_id"])
    try:
        yield node
    finally:
        stop_node(node)
        proc.wait(timeout=30)


@pytest_asyncio.fixture
async def bus(training_node: Node) -> AsyncIterator[tuple[NATS, EventTail]]:
    """The node's operator (reads every stream) and its event log."""
    nc = await connect(
        training_node.nats_url, name="test-trainer", bus=training_node.bus("operator")
    )
    log = await EventTail(nc).start()
    try:
        yield nc, log
    finally:
        await log.stop()
        await nc.drain()


@pytest_asyncio.fixture
async def controller_js(training_node: Node) -> AsyncIterator[JetStreamContext]:
    """JetStream as the controller: only it may publish trajectories."""
    nc = await training_node.connect("test-trajectories", "controller")
    try:
        yield nc.jetstream()
    finally:
        await nc.drain()


async def rollout(nc: NATS, rollout_id: str, version: int) -> list[Trajectory]:
    """GROUPS tasks × GROUP samples sampled through the router from the real tiny model: an
    observation, the model's turn, another observation (only the model's tokens are trained
    on); reward: share of even model tokens."""

    async def one(task: int, sample: int) -> Trajectory:
        tid = f"{rollout_id}-t{task}-s{sample}"
        prompt = [(37 * task + 11 * k + 5) % 2000 + 10 for k in range(6 + task)]
        sp = SamplingParams(
            temperature=1.0, seed=1000 * task + sample, max_tokens=6 + 2 * sample, ignore_eos=True
        )
        req = GenerateRequest(
            request_id=tid, prompt_token_ids=prompt + OBSERVATION, sampling=sp, stream=False
        )
        a = await generate(nc, req, timeout=120)
        assert set(a.token_weight_versions) == {version}
        obs, n = len(OBSERVATION), len(a.token_ids)
        return Trajectory(
            trajectory_id=tid, rollout_id=rollout_id, workload="test", task_id=f"task{task}",
            slot=task * GROUP + sample, sample=sample, attempt=0, prompt_ids=prompt,
            response_ids=OBSERVATION + a.token_ids + OBSERVATION,
            loss_mask=[0] * obs + [1] * n + [0] * obs,
            logprobs=[0.0] * obs + a.logprobs + [0.0] * obs,
            weight_versions=[-1] * obs + a.token_weight_versions + [-1] * obs,
            reward=sum(t % 2 == 0 for t in a.token_ids) / n, turns=1, finish_reason="answered",
        )  # fmt: skip

    return list(await asyncio.gather(*(one(t, s) for t in range(GROUPS) for s in range(GROUP))))


async def publish(js: JetStreamContext, trajs: list[Trajectory]) -> None:
    for t in trajs:
        await js.publish(
            subjects.trajectory(t.rollout_id, t.trajectory_id),
            encode(t),
            headers={"Nats-Msg-Id": t.trajectory_id},
        )


async def all_acked(js: JetStreamContext) -> bool:
    info = await js.consumer_info(subjects.STREAM_TRAJECTORIES, TRAINER.consumer)
    return info.num_ack_pending == 0 and info.num_pending == 0


async def test_a_batch_trains_pushes_and_the_workers_switch(
    bus: tuple[NATS, EventTail], controller_js: JetStreamContext
) -> None:
    nc, log = bus
    js = nc.jetstream()
    st = await trainer_status(nc)
    trajs = await rollout(nc, f"ok{st.version}", st.version)
    # a malformed record on the stream: dead-lettered and acked, training goes on
    bad = subjects.trajectory("junk", "junk-1")
    await controller_js.publish(
        bad, b"\x81\xa4type\xabTrajectory.v1", headers={"Nats-Msg-Id": "junk-1"}
    )
    await publish(controller_js, trajs)

    step = await log.wait_for(TrainStep, step=st.step + 1, timeout=120)
    assert step.version == st.version + 1 and step.samples == GROUP * GROUPS
    assert step.tokens == sum(sum(t.loss_mask) for t in trajs)  # observation tokens excluded
    assert step.logprob_diff_max <= 1e-4 and step.unchecked_tokens == 0  # fp32 CPU agreement
    if DETERMINISTIC:  # batch-invariant engine and training forward: bitwise on-policy
        assert step.logprob_diff_max == 0.0
    assert step.checkpointed and not step.replay
    assert step.reward_mean == pytest.approx(sum(t.reward for t in trajs) / len(trajs))
    pushed = await log.wait_for(WeightsUpdated, version=st.version + 1)
    assert pushed.base_version == st.version
    for role in ("main", "shadow"):
        await log.wait_for(WorkerWeightsSwapped, "e0", version=st.version + 1, role=role)

    refused = await log.wait_for(TrajectoryRefused, reason="malformed")
    assert refused.trajectory_id == "junk-1"
    dead = await js.get_last_msg(subjects.STREAM_DEADLETTER, subjects.dead_letter("trajectories"))
    assert dead.data == b"\x81\xa4type\xabTrajectory.v1" and dead.headers is not None
    assert dead.headers["Belayer-Subject"] == bad
    await wait_until(lambda: all_acked(js), timeout=30, what="every trajectory acked")

    # the next rollout runs on the trained weights
    nxt = await generate(
        nc,
        GenerateRequest(request_id=f"after{step.version}", prompt_token_ids=[5, 6, 7],
                        sampling=SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)),
    )  # fmt: skip
    assert set(nxt.token_weight_versions) == {step.version}


async def test_a_trainer_killed_mid_step_resumes_and_trains_each_trajectory_once(
    training_node: Node, bus: tuple[NATS, EventTail], controller_js: JetStreamContext
) -> None:
    nc, log = bus
    js = nc.jetstream()
    st = await trainer_status(nc)
    s0, v0 = st.step, st.version
    ckpt_dir = training_node.run_dir / "trainer"
    before = json.loads((journal.checkpoint_path(ckpt_dir, s0) / "meta.json").read_text())
    trajs = await rollout(nc, f"kill{v0}", v0)
    await publish(controller_js, trajs)

    started = await log.wait_for(TrainStepStarted, step=s0 + 1, replay=False, timeout=120)
    pid = (await supervisor_pids(nc))["trainer"]
    os.kill(pid, signal.SIGKILL)
    killed_at = time.time()
    assert not journal.checkpoint_path(ckpt_dir, s0 + 1).exists()  # the kill landed mid-step

    await log.wait_for(ServiceRestarted, name="trainer", after=killed_at, timeout=60)
    resumed = await log.wait_for(TrainerResumed, after=killed_at, timeout=60)
    assert (resumed.step, resumed.version, resumed.replay_steps) == (s0, v0, 1)
    assert not resumed.pushed and resumed.trained == len(before["trained"])
    done = await log.wait_for(TrainStep, step=s0 + 1, after=started.ts, timeout=120)
    assert done.replay and done.version == v0 + 1 and done.samples == len(trajs)
    assert done.logprob_diff_max <= 1e-4
    await wait_until(lambda: all_acked(js), timeout=30, what="every trajectory acked")

    # exactly once: the checkpoint records every trajectory once, the step ran to the end once
    after = json.loads((journal.checkpoint_path(ckpt_dir, s0 + 1) / "meta.json").read_text())
    new = after["trained"][len(before["trained"]) :]
    assert after["trained"][: len(before["trained"])] == before["trained"]
    assert sorted(new) == sorted(t.trajectory_id for t in trajs) and len(
        set(after["trained"])
    ) == len(after["trained"])
    assert len(log.matching(TrainStep, step=s0 + 1)) == 1
    assert len(log.matching(WeightsUpdated, version=v0 + 1)) == 1
    status = await trainer_status(nc)
    assert (status.step, status.version, status.trained, status.held) == (
        s0 + 1,
        v0 + 1,
        len(after["trained"]),
        0,
    )

    # deterministic through the kill: the same update from the same checkpoint on the same
    # trajectories, run here without a kill, gives bitwise the same weights
    plan = journal.read_plan(journal.plan_path(ckpt_dir, s0 + 1))
    assert list(plan.trajectory_ids) == new
    by_id = {t.trajectory_id: t for t in trajs}
    samples = [
        to_sample(decode(encode(by_id[i]), Trajectory), 0, TRAINER.temperature)
        for i in plan.trajectory_ids
    ]
    info = json.loads((training_node.run_dir / "node.json").read_text())
    cfg = load_model_config(info["model_dir"])
    torch.set_num_threads(1)
    state, _ = load_state(
        journal.checkpoint_path(ckpt_dir, s0), cfg, TRAINER.optim, deterministic=DETERMINISTIC
    )
    again = grpo_step(
        state, samples, group_size=GROUP, grpo=TRAINER.grpo, optim=TRAINER.optim,
        pad_id=TRAINER.pad_token_id,
    )  # fmt: skip
    assert again.loss == done.loss and again.version == v0 + 1
    ours = publishable_state_dict(state.model)
    resumed_weights = load_weights(journal.checkpoint_path(ckpt_dir, s0 + 1))
    assert weights_equal(ours, resumed_weights)
    served = map_weights(await fetch_manifest(nc, v0 + 1))
    assert weights_equal(ours, dict(served))


async def test_a_trainer_killed_after_a_checkpoint_publishes_the_step_s_event_again(
    training_node: Node, bus: tuple[NATS, EventTail], controller_js: JetStreamContext
) -> None:
    nc, log = bus
    js = nc.jetstream()
    st = await trainer_status(nc)
    s0, v0 = st.step, st.version
    ckpt_dir = training_node.run_dir / "trainer"
    before = read_meta(journal.checkpoint_path(ckpt_dir, s0))["trained"]
    trajs = await rollout(nc, f"late{v0}", v0)
    await publish(controller_js, trajs)

    # killed once the step's checkpoint is durable: before its push, its acks, its train_step
    checkpointed = await log.wait_for(TrainerCheckpointed, step=s0 + 1, timeout=120)
    pid = (await supervisor_pids(nc))["trainer"]
    os.kill(pid, signal.SIGKILL)
    killed_at = time.time()

    await log.wait_for(ServiceRestarted, name="trainer", after=killed_at, timeout=60)
    resumed = await log.wait_for(TrainerResumed, after=killed_at, timeout=60)
    assert (resumed.step, resumed.version, resumed.replay_steps) == (s0 + 1, v0 + 1, 0)
    assert resumed.pushed  # the killed trainer never pushed: the resumed one did
    again = await log.wait_for(TrainStep, step=s0 + 1, timeout=60)
    assert log.matching(TrainStep, step=s0 + 1) == [again]  # the first publication never came
    assert again.republished and again.ts >= resumed.ts and again.checkpointed
    assert not again.replay and (again.checkpoint_s, again.push_s) == (0.0, 0.0)
    assert again.version == checkpointed.version == v0 + 1
    assert sorted(again.trajectory_ids) == sorted(t.trajectory_id for t in trajs)
    assert again.samples == len(trajs) and again.logprob_diff_max <= 1e-4
    # its weights are the checkpoint's, and the store serves them under its version
    path = journal.checkpoint_path(ckpt_dir, s0 + 1)
    assert read_meta(path)["version"] == again.version
    assert again.weights_sha256 == weights_sha256(load_weights(path))
    served = map_weights(await fetch_manifest(nc, v0 + 1))
    assert weights_sha256(dict(served)) == again.weights_sha256
    await wait_until(lambda: all_acked(js), timeout=30, what="every trajectory acked")

    # training goes on: the next step trains on the republished step's weights
    for role in ("main", "shadow"):
        await log.wait_for(WorkerWeightsSwapped, "e0", version=v0 + 1, role=role, timeout=60)
    nxt = await rollout(nc, f"next{v0}", v0 + 1)
    await publish(controller_js, nxt)
    done = await log.wait_for(TrainStep, step=s0 + 2, timeout=120)
    assert not (done.replay or done.republished) and done.version == v0 + 2
    assert log.matching(TrainStep, step=s0 + 1) == [again]
    await wait_until(lambda: all_acked(js), timeout=30, what="every trajectory acked")

    # no trajectory trained twice: each step's batch once, in order, in the checkpoints
    after = read_meta(journal.checkpoint_path(ckpt_dir, s0 + 2))["trained"]
    assert after == before + list(again.trajectory_ids) + list(done.trajectory_ids)
    assert len(set(after)) == len(after)
    status = await trainer_status(nc)
    assert (status.step, status.version, status.held) == (s0 + 2, v0 + 2, 0)
