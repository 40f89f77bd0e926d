"""What the trainer integration tests share: the small model's shape, a trainer config that
checkpoints every 2 steps, the trainer as a real process, a bus fixture with an event log, and
synthetic trajectory groups whose rollout log-probabilities are the model's own."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import zlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest_asyncio
import torch
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from common import subjects
from common.bus import connect, ensure_jetstream
from common.codec import encode
from common.config import config_argv
from common.errors import BelayerError
from common.events import EventTail
from common.natsserver import NatsServer
from common.training_config import OptimConfig
from model.config import load_model_config
from model.qwen3 import build_model
from model.train_forward import token_logprobs
from schemas.rollout import Trajectory
from services.trainer.client import GrpoConfig, TrainerConfig, trainer_status
from tests.integration.node_helpers import wait_until
from tests.unit.model_fixtures import ModelShape

GROUP = 2
SMALL = ModelShape(
    hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32,
    intermediate_size=128, vocab_size=512,
)  # fmt: skip
"""The ``model_dir`` fixture's shape (``tests/integration/shm_helpers.py``)."""
OPTIM = OptimConfig(lr=1e-2, seed=11)
GRPO = GrpoConfig(micro_batch_size=1)


def trainer_config(nats_url: str, run_id: str, ckpt: Path) -> TrainerConfig:
    return TrainerConfig(
        nats_url=nats_url,
        run_id=run_id,
        checkpoint_dir=ckpt,
        group_size=GROUP,
        groups_per_step=1,
        checkpoint_every=2,
        ack_wait_s=1.5,
        hold_before_checkpoint_s=1.0,
        optim=OPTIM,
        grpo=GRPO,
    )


class TrainerProc:
    """``python -m services.trainer`` as a real process."""

    def __init__(self, config: TrainerConfig, log: Path) -> None:
        self.config, self.log = config, log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "services.trainer", *config_argv(self.config)],
                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"},
            )  # fmt: skip

    async def ready(self, nc: NATS) -> None:
        async def answers() -> bool:
            assert self.proc is not None
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                await trainer_status(nc, timeout=0.5)
                return True
            except BelayerError:
                return False

        await wait_until(answers, timeout=60, what="the trainer answers")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest_asyncio.fixture
async def trainer_bus(nats_server: NatsServer) -> AsyncIterator[tuple[NATS, EventTail]]:
    """A client on the test's NATS server (JetStream streams declared) and its event log."""
    nc = await connect(nats_server.url, name="test-replay")
    await ensure_jetstream(nc.jetstream())
    log = await EventTail(nc).start()
    try:
        yield nc, log
    finally:
        await log.stop()
        await nc.drain()


def make_group(
    model_dir: Path, tensors: dict[str, torch.Tensor], version: int, tag: str
) -> list[Trajectory]:
    """One group of synthetic-token trajectories whose rollout log-probabilities are those of
    ``tensors`` (version ``version``) under the training forward; reward: share of even ids."""
    cfg = load_model_config(model_dir)
    model = build_model(cfg, tensors)
    out = []
    for i in range(GROUP):
        gen = torch.Generator().manual_seed(zlib.crc32(f"{tag}-{i}".encode()))
        prompt = torch.randint(5, 500, (5,), generator=gen).tolist()
        resp = torch.randint(5, 500, (7 + i,), generator=gen).tolist()
        mask = [1] * 4 + [0] * 2 + [1] * (1 + i)
        with torch.no_grad():
            lp = token_logprobs(model, torch.tensor([prompt + resp]))[0, len(prompt) - 1 :]
        out.append(
            Trajectory(
                trajectory_id=f"{tag}-{i}",
                rollout_id=tag,
                workload="test",
                task_id="t",
                slot=i,
                sample=i,
                attempt=0,
                prompt_ids=prompt,
                response_ids=resp,
                loss_mask=mask,
                logprobs=[float(x) if m else 0.0 for x, m in zip(lp, mask, strict=True)],
                weight_versions=[version if m else -1 for m in mask],
                reward=sum(t % 2 == 0 for t in resp) / len(resp),
                turns=1,
                finish_reason="answered",
            )
        )
    return out


async def run_to_exit(config: TrainerConfig) -> subprocess.CompletedProcess[str]:
    """Run a trainer that is expected to refuse to start (in a thread: the weight store
    serves from this event loop meanwhile)."""
    argv = [sys.executable, "-m", "services.trainer", *config_argv(config)]
    return await asyncio.to_thread(
        subprocess.run, argv, capture_output=True, text=True, timeout=120, check=False
    )


async def publish(js: JetStreamContext, trajs: list[Trajectory]) -> None:
    for t in trajs:
        await js.publish(
            subjects.trajectory(t.rollout_id, t.trajectory_id),
            encode(t),
            headers={"Nats-Msg-Id": t.trajectory_id},
        )
