"""Recovery aligned with the LLM context, on a real node (NATS, Docker + CRIU) serving the
warm-started tiny SWE model (``belayer model init --tiny --warm-start swe DIR``: it acts in the
action convention, so trajectories run actions, take checkpoints and can be broken):

- a sandbox killed after a ready checkpoint: every trajectory completes; the restore went to
  the ready prefix C_k; the context was truncated to exactly L_k (the durable association's
  token ids); the kept actions are the prefix's followed by newly generated ones, none of those
  run after the checkpoint; the restored sandbox's files are the checkpoint's;
- no ready checkpoint: a fresh sandbox from the base image with L_0, counted;
- a failure never shows up in any observation;
- a controller SIGKILLed mid-rollout: the restarted controller adopts the rollout and every
  trajectory finishes, each published once.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import signal
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import pytest
from nats.aio.client import Client as NATS

from common import subjects
from common.codec import decode
from common.events import EventTail
from model.chat import ChatFormat
from model.tokenizer import load_tokenizer
from schemas.events import FailureRecovered, RolloutDone, TrajectoriesAdopted, TrajectoryRestored
from schemas.rollout import FaultSpec, RolloutRequest, Trajectory, TrajectoryState
from schemas.serving import SamplingParams
from services.controller.client import submit, trajectories, wait
from services.controller.fault_specs import parse_inject
from services.environment.client import EnvClient
from services.environment.docker_ops import INIT_COMMAND, INIT_SLEEP
from tests.integration.env_helpers import require_docker
from tests.integration.node_helpers import Node, cli, start_node, stop_node

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(900)]

MULTI_STEP = ["kv_daemon", "shop_total", "calc_clamp"]
"""Bundled tasks whose solutions take more than one action."""
SAMPLING = SamplingParams(temperature=1.0, max_tokens=128)
"""Sampled (deterministic per seed): some trajectories take several actions, the tests need
those (a greedy warm start may act once and submit)."""

FAILURE_WORDS = (
    "container",
    "sandbox_error",
    "full_restore",
    "Docker",
    "dockerd",
    "bus_unavailable",
)
"""Words of an infrastructure error: none may appear in a model's context."""


@pytest.fixture(scope="module")
def warm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The warm-started tiny SWE model (cached by the model layer after the first build);
    ``BELAYER_TEST_SWE_MODEL`` names an already made one instead."""
    given = os.environ.get("BELAYER_TEST_SWE_MODEL")
    if given:
        return Path(given)
    out = tmp_path_factory.mktemp("warm") / "swe"
    proc = cli("model", "init", "--tiny", "--warm-start", "swe", str(out),
               run_dir=out.parent, timeout=900, check=False)  # fmt: skip
    assert proc.returncode == 0, f"warm start failed:\n{proc.stdout}\n{proc.stderr}"
    return out


@pytest.fixture(scope="module")
def warm_node(warm_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    require_docker()
    node = start_node(
        tmp_path_factory.mktemp("ctlrec"), "--environment", "--model", str(warm_model)
    )
    try:
        yield node
    finally:
        stop_node(node)


async def first_of(*waits: Any) -> Any:
    """The result of whichever wait ends first (the others are cancelled)."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for t in pending:
        t.cancel()
    return next(iter(done)).result()


def chat_of(model_dir: Path) -> ChatFormat:
    return ChatFormat(load_tokenizer(model_dir))


def controller_pid(node: Node) -> int:
    return node.pids()["controller"]


class PrefixLog:
    """Every write of KV ``trajectory_prefix`` (the durable (trajectory, k, C_k, L_k)) while the
    test runs."""

    def __init__(self) -> None:
        self.states: list[TrajectoryState] = []
        self._watcher: Any = None

    async def start(self, nc: Any) -> PrefixLog:
        """``nc``: a connection allowed to read the bucket (the controller's identity)."""
        kv = await nc.jetstream().key_value(subjects.BUCKET_TRAJECTORY_PREFIX)
        self._watcher = await kv.watchall(include_history=False)
        self._task = asyncio.create_task(self._pump())
        return self

    async def _pump(self) -> None:
        async for entry in self._watcher:
            if entry is None or not entry.value:
                continue
            self.states.append(decode(entry.value, TrajectoryState))

    async def stop(self) -> None:
        self._task.cancel()
        await self._watcher.stop()

    def at_checkpoint(self, trajectory_id: str, checkpoint_id: str) -> TrajectoryState:
        """The state written when ``checkpoint_id`` became the latest ready one."""
        for st in self.states:
            if (
                st.trajectory_id == trajectory_id
                and st.ready
                and st.ready[-1].checkpoint_id == checkpoint_id
            ):
                return st
        raise AssertionError(f"no durable prefix of {trajectory_id} at {checkpoint_id}")


def upper_dir_files(container_id: str, under: str) -> dict[str, str]:
    """sha256 of each regular file below ``under`` in the container's overlay upper dir."""
    client = docker.DockerClient(version="auto", timeout=10)
    upper = Path(client.api.inspect_container(container_id)["GraphDriver"]["Data"]["UpperDir"])
    out = {}
    root = upper / under
    for p in sorted(root.rglob("*")) if root.is_dir() else []:
        if p.is_file() and not p.is_symlink() and "__pycache__" not in p.parts:
            out[str(p.relative_to(upper))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def archive_files(fs_tar: Path, under: str) -> dict[str, str]:
    out = {}
    with tarfile.open(fs_tar) as tar:
        for m in tar.getmembers():
            name = m.name.lstrip("./")
            if m.isfile() and name.startswith(under) and "__pycache__" not in name:
                data = tar.extractfile(m)
                assert data is not None
                out[name] = hashlib.sha256(io.BytesIO(data.read()).getvalue()).hexdigest()
    return out


def context_text(chat: ChatFormat, t: Trajectory) -> str:
    return chat.tokenizer.decode(t.prompt_ids + t.response_ids)


async def freeze_and_compare(warm_node: Node, ops: NATS, pid: int, ev: TrajectoryRestored) -> bool:
    """Right after a restore (the controller stopped so no action runs meanwhile): the
    restored sandbox's workdir files are those archived in C_k, and every process CRIU
    dumped into C_k runs again. True once compared."""
    os.kill(pid, signal.SIGSTOP)
    try:
        listing = await EnvClient(ops).list()
        (sb,) = [s for s in listing.sandboxes if s.id == ev.sandbox_id]
        ck_dir = warm_node.run_dir / "env" / "checkpoints" / ev.sandbox_id / ev.checkpoint_id
        want = archive_files(ck_dir / "fs.tar", "root/repo")
        assert want, "the checkpoint archived no workdir file"
        assert upper_dir_files(sb.container_id, "root/repo") == want
        manifest = json.loads((ck_dir / "manifest.json").read_text())
        if manifest["method"] == "layer":
            # C_k was quiescent (no process but init): the restored sandbox runs init and
            # its sleep, nothing the agent started after C_k
            ps = await EnvClient(ops).exec(ev.sandbox_id, "ps -eo args=", timeout_s=10)
            lines = ps.stdout.splitlines()
            live_args = {a.strip() for a in lines if "ps -eo args=" not in a}
            assert live_args == {" ".join(INIT_COMMAND), " ".join(INIT_SLEEP)}, live_args
            return True
        # the processes: every task CRIU dumped (core-<tid>.img) runs again, same tid
        dumped = {
            int(name[5:-4])
            for name in manifest["criu_files"]
            if name.startswith("core-") and name.endswith(".img")
        }
        ps = await EnvClient(ops).exec(ev.sandbox_id, "ps -eLo lwp=", timeout_s=10)
        live = {int(x) for x in ps.stdout.split()}
        assert dumped and dumped <= live, (dumped, live)
        return True
    finally:
        os.kill(pid, signal.SIGCONT)


async def test_sandbox_killed_after_a_ready_checkpoint(warm_node: Node, warm_model: Path) -> None:
    nc = await warm_node.connect("test-recovery")
    events = await EventTail(nc).start()
    ctl = await warm_node.connect("test-recovery-kv", "controller")
    ops = await warm_node.connect("test-recovery-env", "operator")
    prefixes = await PrefixLog().start(ctl)
    chat = chat_of(warm_model)
    checked_files: list[str] = []
    pid = controller_pid(warm_node)

    try:
        req = RolloutRequest(
            workload="swe", rollout_id="kill-after-ckpt", task_ids=MULTI_STEP, n=4,
            policy="always", sampling=SAMPLING, seed=3,
            inject=parse_inject("sandbox-kill@turn=2"), max_turns=8,
        )  # fmt: skip
        await submit(nc, req)
        first = await first_of(
            events.wait_for(TrajectoryRestored, rollout_id="kill-after-ckpt", timeout=600),
            events.wait_for(RolloutDone, rollout_id="kill-after-ckpt", timeout=600),
        )
        if isinstance(first, TrajectoryRestored) and not first.from_scratch:
            if await freeze_and_compare(warm_node, ops, pid, first):
                checked_files.append(first.trajectory_id)
        result = await wait(nc, "kill-after-ckpt", timeout=600)
        s = result.summary
        assert s.trajectories_completed == 12 and s.slots_failed == 0
        records = {t.trajectory_id: t for t in await trajectories(nc, "kill-after-ckpt")}
        assert len(records) == 12
        hit = [t for t in records.values() if t.recovery.sandbox_failures]
        assert hit, "no trajectory got to its second action (did the warm start act?)"
        assert s.restarts_from_scratch_with_checkpoint == 0
        restores = events.matching(TrajectoryRestored, rollout_id="kill-after-ckpt")
        for t in hit:
            (ev,) = [e for e in restores if e.trajectory_id == t.trajectory_id][:1]
            # policy always: C_1 was ready; the kill after action 2 fails checkpoint 2
            assert not ev.from_scratch and ev.prefix == 1, ev
            at_k = prefixes.at_checkpoint(t.trajectory_id, ev.checkpoint_id)
            n = len(at_k.response_ids)
            assert ev.context_tokens == len(t.prompt_ids) + n
            assert t.response_ids[:n] == at_k.response_ids  # truncated to exactly L_k
            assert t.loss_mask[:n] == at_k.loss_mask and t.logprobs[:n] == at_k.logprobs
            assert t.actions[: ev.prefix] == at_k.actions  # the prefix's actions, kept
            (killed,) = [e for e in t.recovery.entries if e.kind == "injected"]
            later = t.actions[ev.prefix :]
            assert all(a.generation > killed.generation for a in later), (
                "an action run after the checkpoint survived the restore"
            )
            assert [a.prefix for a in t.actions] == list(range(len(t.actions)))
        for t in records.values():
            text = context_text(chat, t)
            assert not [w for w in FAILURE_WORDS if w in text], t.trajectory_id
        assert s.failures_recovered == s.failures_injected >= len(hit)
        assert checked_files or not isinstance(first, TrajectoryRestored) or first.from_scratch
    finally:
        await prefixes.stop()
        await events.stop()
        for conn in (ctl, ops, nc):
            await conn.drain()


async def test_no_ready_checkpoint_restarts_from_the_base_image(
    warm_node: Node, warm_model: Path
) -> None:
    nc = await warm_node.connect("test-recovery")
    events = await EventTail(nc).start()
    try:
        req = RolloutRequest(
            workload="swe", rollout_id="no-ckpt", task_ids=MULTI_STEP[:2], n=2, policy="never",
            sampling=SAMPLING, seed=4,
            inject=parse_inject("sandbox-kill@turn=1"), max_turns=8,
        )  # fmt: skip
        await submit(nc, req)
        result = await wait(nc, "no-ckpt", timeout=600)
        s = result.summary
        assert s.trajectories_completed == 4 and s.checkpoints == 0 and s.env_restores == 0
        records = await trajectories(nc, "no-ckpt")
        hit = [t for t in records if t.recovery.sandbox_failures]
        assert hit and s.restarts_from_scratch >= len(hit)
        assert s.restarts_from_scratch_with_checkpoint == 0
        for t in hit:
            (ev,) = [
                e for e in events.matching(TrajectoryRestored) if e.trajectory_id == t.trajectory_id
            ][:1]
            assert ev.from_scratch and ev.prefix == 0 and ev.context_tokens == len(t.prompt_ids)
            (killed,) = [e for e in t.recovery.entries if e.kind == "injected"]
            assert all(a.generation > killed.generation for a in t.actions)
    finally:
        await events.stop()
        await nc.drain()


async def test_controller_restart_mid_rollout(warm_node: Node) -> None:
    nc = await warm_node.connect("test-recovery")
    events = await EventTail(nc).start()
    try:
        req = RolloutRequest(
            workload="swe", rollout_id="ctl-restart", task_ids=MULTI_STEP, n=2, policy="always",
            sampling=SAMPLING, seed=5,
            inject=[FaultSpec(kind="controller-kill", trigger="turn", value=1, text="controller-kill@turn=1")],
            max_turns=8,
        )  # fmt: skip
        await submit(nc, req)
        adopted = await events.wait_for(TrajectoriesAdopted, rollout_id="ctl-restart", timeout=300)
        assert adopted.incarnation == 2
        result = await wait(nc, "ctl-restart", timeout=600)
        s = result.summary
        assert s.trajectories_completed == 6 and s.controller_restarts == 1
        assert s.failures_injected == 1 and s.failures_recovered == 1
        await events.wait_for(FailureRecovered, rollout_id="ctl-restart", timeout=10)
        records = await trajectories(nc, "ctl-restart")
        assert sorted(t.slot for t in records) == list(range(6))  # each published once
        info = await nc.jetstream().stream_info(
            subjects.STREAM_TRAJECTORIES,
            subjects_filter=subjects.rollout_trajectories("ctl-restart"),
        )
        assert sum((info.state.subjects or {}).values()) == 6
        resumed = [t for t in records if any(e.kind == "adopted" for e in t.recovery.entries)]
        assert {t.trajectory_id for t in resumed} <= set(adopted.trajectory_ids)
        for t in resumed:
            assert [a.prefix for a in t.actions] == list(range(len(t.actions)))
    finally:
        await events.stop()
        await nc.drain()
