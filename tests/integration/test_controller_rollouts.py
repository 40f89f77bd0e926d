"""The controller in a real node (real NATS, real Docker + CRIU, the node's tiny random model):
bad input is refused before any sandbox starts; every finished trajectory is published once to
TRAJECTORIES with a well-formed record; a worker SIGKILL during a rollout is absorbed (handover
recorded, the tokens exactly those of an uninterrupted run); a sandbox killed with no ready
checkpoint restarts from the base image with L_0, counted, and the failure never reaches the
model. (Recovery to a ready checkpoint needs actions, i.e. the warm-started model:
``test_controller_recovery.py``.)"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import docker
import msgspec
import pytest

from common import subjects
from common.errors import Conflict, InvalidRequest, NotFound
from common.events import EventTail
from model.chat import ChatFormat
from model.tokenizer import load_tokenizer
from schemas.events import FailureInjected, RolloutDone, TrajectoryRestored
from schemas.rollout import FaultSpec, RolloutRequest, Trajectory
from schemas.seeds import derive_seed
from schemas.serving import GenerateRequest, SamplingParams
from services.controller.client import submit, trajectories, wait
from services.environment.client import EnvClient, node_label
from services.router.client import generate
from tests.integration.env_helpers import leftover_containers
from tests.integration.node_helpers import Node, cli

pytestmark = [pytest.mark.docker, pytest.mark.timeout(300)]
NODE_ARGS = ("--environment",)
"""The module's node (``tests/node_fixtures.py``): with the environment service."""

SAMPLE_DIR = Path(__file__).resolve().parents[2] / "workloads" / "data"


async def bus(node: Node, identity: str = "client") -> Any:
    """A connection as one of the node's identities (``client``: a user; ``operator``: also
    sandboxes; ``controller``: its KV and TRAJECTORIES publishing)."""
    return await node.connect("test-controller", identity)


def chat_of(node: Node) -> ChatFormat:
    info = json.loads((node.run_dir / "node.json").read_text())
    return ChatFormat(load_tokenizer(info["model_dir"]))


def check_record(t: Trajectory, chat: ChatFormat) -> None:
    """The shape every published trajectory has."""
    n = len(t.response_ids)
    assert len(t.loss_mask) == len(t.logprobs) == len(t.weight_versions) == n
    assert set(t.loss_mask) <= {0, 1} and sum(t.loss_mask) > 0
    for m, lp, v in zip(t.loss_mask, t.logprobs, t.weight_versions, strict=True):
        assert (lp <= 0.0 and v >= 1) if m else (lp == 0.0 and v == -1)
    assert chat.tokenizer.decode(t.prompt_ids).endswith("<|im_start|>assistant\n")
    assert t.finish_reason != "failed" and t.turns >= 1


async def test_bad_input_is_refused_before_any_sandbox_starts(node: Node, tmp_path: Path) -> None:
    nc = await bus(node)
    ops = await bus(node, "operator")
    env = EnvClient(ops)
    before = {s.id for s in (await env.list()).sandboxes}
    missing_columns = tmp_path / "dapo.jsonl"
    missing_columns.write_text(json.dumps({"prompt": [{"role": "user", "content": "1+1?"}]}) + "\n")
    row = json.loads((SAMPLE_DIR / "swe_gym_sample.jsonl").read_text().splitlines()[0])
    row.update(image="belayer-no-such-image:1", repo_path="")
    no_image = tmp_path / "swe.jsonl"
    no_image.write_text(json.dumps(row) + "\n")
    cases: list[tuple[RolloutRequest, type[Exception], str]] = [
        (RolloutRequest(workload="nosuch"), NotFound, "unknown workload"),
        (RolloutRequest(workload="swe", task_ids=["no_such_task"]), NotFound, "unknown task"),
        (RolloutRequest(workload="dapo", dataset=str(missing_columns)), InvalidRequest, "column"),
        (RolloutRequest(workload="swe-gym", dataset=str(no_image)), NotFound, "image"),
        (RolloutRequest(workload="swe", tasks=1, policy="sometimes"), InvalidRequest, "policy"),
        (
            RolloutRequest(
                workload="swe",
                tasks=1,
                inject=[FaultSpec(kind="sandbox-kill", trigger="turn", value=1, target=5)],
            ),
            InvalidRequest,
            "does not exist",
        ),
        (
            RolloutRequest(
                workload="math",
                tasks=1,
                inject=[FaultSpec(kind="sandbox-kill", trigger="turn", value=1)],
            ),
            InvalidRequest,
            "no sandbox",
        ),
    ]
    try:
        for req, err, words in cases:
            with pytest.raises(err, match=words):
                await submit(nc, req)
        # n = 0 is refused on decode, naming the field
        with pytest.raises(InvalidRequest) as info:
            await nc_request_raw(nc, {"type": "RolloutRequest.v1", "workload": "swe", "n": 0})
        assert info.value.data.get("field") == "$.n"
        after = {s.id for s in (await env.list()).sandboxes}
        assert after == before, "a refused request started a sandbox"
    finally:
        await ops.drain()
        await nc.drain()
    # the CLI refuses a bad injection spec before it sends anything (exit 2, one line)
    bad = cli(
        "rollout", "swe", "--inject", "sandbox-kill@turn=0", run_dir=node.run_dir, check=False
    )
    assert bad.returncode == 2 and "--inject" in bad.stderr and "T ≥ 1" in bad.stderr


async def nc_request_raw(nc: Any, payload: dict[str, Any]) -> Any:
    """Send a raw MessagePack map (what a client in another language may send)."""
    import msgpack

    from common.codec import decode, raise_error
    from schemas.base import ErrorReply
    from schemas.rollout import RolloutAccepted

    msg = await nc.request(subjects.rollout_submit(), msgpack.packb(payload), timeout=10)
    reply = decode(msg.data, RolloutAccepted | ErrorReply)
    if isinstance(reply, ErrorReply):
        raise_error(reply)
    return reply


async def test_math_rollout_publishes_every_trajectory_once(node: Node) -> None:
    nc = await bus(node)
    events = await EventTail(nc).start()
    chat = chat_of(node)
    try:
        req = RolloutRequest(workload="math", rollout_id="math-once", tasks=3, n=2, seed=5)
        accepted = await submit(nc, req)
        assert accepted.trajectories == 6 and len(accepted.task_ids) == 3
        again = await submit(nc, req)
        assert again.existing and again.rollout_id == "math-once"
        with pytest.raises(Conflict):
            await submit(nc, msgspec.structs.replace(req, n=3))
        result = await wait(nc, "math-once", timeout=120)
        s = result.summary
        assert (s.trajectories, s.trajectories_completed, s.trajectories_failed) == (6, 6, 0)
        records = await trajectories(nc, "math-once")
        assert [t.slot for t in records] == list(range(6))
        assert {t.trajectory_id for t in records} == {f"math-once-s{i}-a0" for i in range(6)}
        for t in records:
            check_record(t, chat)
            assert t.sample == t.slot % 2 and t.seed == derive_seed(5, t.sample)
            assert t.task_id == accepted.task_ids[t.slot // 2]
        # each group's samples got distinct seeds, hence (in deterministic mode) own tokens
        assert records[0].response_ids != records[1].response_ids
        # a republication under the same msg id is dropped by the server
        ctl = await bus(node, "controller")
        js = ctl.jetstream()
        info = await js.stream_info(subjects.STREAM_TRAJECTORIES)
        ack = await js.publish(
            subjects.trajectory("math-once", records[0].trajectory_id),
            b"dup",
            headers={"Nats-Msg-Id": records[0].trajectory_id},
        )
        assert (
            ack.duplicate
            and (await js.stream_info(subjects.STREAM_TRAJECTORIES)).state.messages
            == info.state.messages
        )
        await ctl.drain()
        done = await events.wait_for(RolloutDone, rollout_id="math-once", timeout=10)
        assert done.trajectories_completed == 6 and done.mean_reward == s.mean_reward
    finally:
        await events.stop()
        await nc.drain()


async def test_worker_kill_is_absorbed_without_duplicate_tokens(node: Node) -> None:
    """A worker SIGKILLed while the trajectories' first responses stream: the handover is in
    their recovery logs, and each response is token for token what an uninterrupted run of the
    same request gives (no token lost or repeated; deterministic mode)."""
    nc = await bus(node)
    events = await EventTail(nc).start()
    try:
        req = RolloutRequest(
            workload="swe", rollout_id="wkill", tasks=2, n=2,
            sampling=SamplingParams(temperature=1.0, max_tokens=256),
            inject=[FaultSpec(kind="worker-kill", trigger="s", value=1.5, text="worker-kill@s=1.5")],
        )  # fmt: skip
        await submit(nc, req)
        result = await wait(nc, "wkill", timeout=240)
        s = result.summary
        assert s.trajectories_completed == 4 and s.failures_injected == 1
        assert s.failures_recovered == 1, "the killed worker's engine never came back"
        assert s.engine_handovers >= 1
        records = await trajectories(nc, "wkill")
        resumed = [t for t in records if t.recovery.engine_handovers]
        assert resumed, "no trajectory's request rode through the handover"
        injected = await events.wait_for(FailureInjected, rollout_id="wkill", timeout=5)
        assert injected.fault == "worker-kill" and injected.target.startswith("pid ")
        for t in resumed:
            first = t.loss_mask.index(1)
            end = first
            while end < len(t.loss_mask) and t.loss_mask[end] == 1:
                end += 1
            replay = await generate(
                nc,
                GenerateRequest(
                    request_id=f"replay-{t.trajectory_id}",
                    prompt_token_ids=t.prompt_ids,
                    sampling=SamplingParams(
                        temperature=1.0, max_tokens=256, seed=derive_seed(t.seed, 1)
                    ),
                ),
                timeout=120,
            )
            assert t.response_ids[first:end] == replay.token_ids
    finally:
        await events.stop()
        await nc.drain()


async def test_sandbox_failure_without_a_checkpoint_restarts_from_scratch(node: Node) -> None:
    """The random model acts never, so no checkpoint is ever ready: a killed sandbox comes back
    from the base image with context L_0 (counted), and nothing of the failure reaches the
    model."""
    nc = await bus(node)
    events = await EventTail(nc).start()
    chat = chat_of(node)
    try:
        req = RolloutRequest(
            workload="swe", rollout_id="scratch", task_ids=["calc_clamp"], n=1,
            sampling=SamplingParams(temperature=1.0, max_tokens=256),
            inject=[FaultSpec(kind="sandbox-kill", trigger="s", value=0.3, text="sandbox-kill@s=0.3")],
        )  # fmt: skip
        await submit(nc, req)
        result = await wait(nc, "scratch", timeout=240)
        s = result.summary
        assert s.trajectories_completed == 1 and s.failures_injected == 1
        assert s.env_failures >= 1 and s.restarts_from_scratch >= 1 and s.env_restores == 0
        assert s.restarts_from_scratch_with_checkpoint == 0 and s.failures_recovered == 1
        (t,) = await trajectories(nc, "scratch")
        check_record(t, chat)
        assert t.recovery.restarts_from_scratch >= 1
        restored = await events.wait_for(TrajectoryRestored, rollout_id="scratch", timeout=5)
        assert restored.from_scratch and restored.prefix == 0
        assert restored.context_tokens == len(t.prompt_ids)
        text = chat.tokenizer.decode(t.response_ids)
        for word in ("container", "sandbox_error", "dead", "full_restore", "Docker"):
            assert word not in text, f"the failure reached the model: {word!r} in the context"
    finally:
        await events.stop()
        await nc.drain()
    await asyncio.sleep(0)  # let the client close
    client = docker.DockerClient(version="auto", timeout=10)
    left = [
        c for c in leftover_containers(client, node_label(node.run_id))
        if "scratch" in (client.containers.get(c).labels.get("belayer.sandbox") or "")
    ]  # fmt: skip
    assert not left, "a finished trajectory left its sandbox behind"


async def test_actions_cannot_reach_the_network_or_the_host(node: Node) -> None:
    """An agent's action in a workload sandbox, run as the controller runs it: no network, and
    what it writes stays inside the sandbox (the host's file system is untouched)."""
    import uuid

    from workloads.actions import sandbox_command
    from workloads.registry import load_workload

    task = load_workload("swe").task("calc_clamp")
    assert task.sandbox is not None
    nc = await bus(node, "operator")
    env = EnvClient(nc)
    marker = Path(f"/tmp/belayer-escape-{uuid.uuid4().hex[:8]}")
    created = await env.create(
        image=task.sandbox.image, files=task.sandbox.absolute_files(), limits=task.sandbox.limits
    )
    try:
        net = await env.exec(
            created.sandbox_id,
            sandbox_command(
                task.sandbox.workdir,
                "python3 -c \"import socket; socket.create_connection(('1.1.1.1', 53), timeout=3)\"",
            ),
            timeout_s=20,
        )
        assert net.exit_code != 0 and "unreachable" in net.stderr.lower()
        wrote = await env.exec(
            created.sandbox_id,
            sandbox_command(task.sandbox.workdir, f"echo escaped > {marker} && cat {marker}"),
            timeout_s=20,
        )
        assert wrote.exit_code == 0 and wrote.stdout.strip() == "escaped"
        assert not await asyncio.to_thread(marker.exists), "a sandbox write reached the host"
        mount = await env.exec(created.sandbox_id, "mount -t tmpfs none /mnt", timeout_s=20)
        assert mount.exit_code != 0  # no capabilities: nothing to remount or escape with
    finally:
        await env.destroy(created.sandbox_id)
        await nc.drain()
