"""The data-parallel trainer (``--procs 2``) on real processes and a real gloo process group.

1. Two ranks compute the update the single process computes: the loss within 1e-6.
2. A rank SIGKILLed mid-step stops the whole trainer (non-zero exit, no rank left behind,
   nothing acked); the restarted trainer resumes from its checkpoint and redoes the planned
   steps from the very same trajectories, each once: in deterministic mode its new group of
   ranks recomputes the pushed version bit for bit (run to run), and its losses are the single
   process's within 1e-6."""

from __future__ import annotations

import os
import signal
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from nats.aio.client import Client as NATS

from common import subjects
from common.events import EventTail
from common.natsserver import NatsServer
from model.config import load_model_config
from model.loader import load_safetensors
from model.training import read_meta
from schemas.events import TrainerResumed, TrainStep, TrainStepStarted, WeightsUpdated
from services.trainer import journal
from services.trainer.client import GrpoConfig, TrainerConfig
from services.trainer.ranks import Ranks
from services.trainer.records import to_sample
from services.trainer.update import grpo_step, new_state, save_state
from services.weights.client import fetch_manifest, map_weights
from services.weights.config import WeightStoreConfig
from services.weights.service import run as run_weights
from tests.integration.node_helpers import wait_until
from tests.integration.shm_helpers import running_service
from tests.integration.trainer_helpers import (
    GROUP,
    OPTIM,
    TrainerProc,
    make_group,
    publish,
    trainer_config,
)

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]
PAIRS = GrpoConfig(micro_batch_size=GROUP)
"""A step's one group in one micro-batch: each of the 2 ranks computes one of its rows."""


def test_two_ranks_give_the_single_process_update(model_dir: Path, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    cfg, base = load_model_config(model_dir), load_safetensors(model_dir)
    # 4 rows, micro-batches of 3: shares of 2 and 1 rows, and an empty one; grpo's loss
    # divides by sequences, so every share is rescaled
    grpo = GrpoConfig(loss_type="grpo", micro_batch_size=3)
    trajs = make_group(model_dir, base, 1, "a") + make_group(model_dir, base, 1, "b")
    samples = [to_sample(t, 0, 1.0) for t in trajs]
    kw = {"group_size": GROUP, "grpo": grpo, "optim": OPTIM, "pad_id": 0}
    single = new_state(cfg, base, 1, OPTIM, deterministic=True)
    ckpt = tmp_path / "trainer"
    save_state(journal.checkpoint_path(ckpt, 0), single, {})
    expected = [grpo_step(single, samples, **kw).loss for _ in range(2)]  # type: ignore[arg-type]

    config = TrainerConfig(
        checkpoint_dir=ckpt, group_size=GROUP, groups_per_step=2, optim=OPTIM, grpo=grpo,
        deterministic=True, procs=2,
    )  # fmt: skip
    state = new_state(cfg, base, 1, OPTIM, deterministic=True)
    ranks = Ranks.spawn(config, cfg, ckpt)
    try:
        ranks.join()
        losses = [ranks.grpo_step(state, samples, **kw).loss for _ in range(2)]  # type: ignore[arg-type]
    finally:
        ranks.close()
    assert not any(p.is_alive() for p in ranks.procs)
    assert losses == pytest.approx(expected, abs=1e-6)
    assert state.step == 2 and state.version == 3


def _ranks_of(pid: int) -> list[int]:
    """The trainer's child processes that are ranks (multiprocessing spawn children)."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            cmd = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
            if b"multiprocessing" in cmd and b"resource_tracker" not in cmd:
                out.append(int(child))
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def test_a_rank_killed_mid_step_stops_the_trainer_and_the_steps_are_redone_once(
    nats_server: NatsServer,
    trainer_bus: tuple[NATS, EventTail],
    model_dir: Path,
    run_id: str,
    tmp_path: Path,
) -> None:
    nc, log = trainer_bus
    js = nc.jetstream()
    ckpt = tmp_path / "trainer"
    store = WeightStoreConfig(
        nats_url=nats_server.url, run_id=run_id, model_dir=model_dir, keep_versions=3
    )
    config = replace(
        trainer_config(nats_server.url, run_id, ckpt), procs=2, deterministic=True, grpo=PAIRS
    )
    trainer = TrainerProc(config, tmp_path / "trainer.out")
    async with running_service(run_weights, store, what="weight store"):
        try:
            trainer.start()
            await trainer.ready(nc)
            assert trainer.proc is not None
            ranks = _ranks_of(trainer.proc.pid)
            assert len(ranks) == 1, ranks
            base = load_safetensors(model_dir)
            first = make_group(model_dir, base, 1, "a")
            await publish(js, first)
            step1 = await log.wait_for(TrainStep, step=1, timeout=60)
            assert not step1.checkpointed  # checkpoints every 2 steps
            second = make_group(model_dir, dict(map_weights(await fetch_manifest(nc, 2))), 2, "b")
            await publish(js, second)
            await log.wait_for(TrainStepStarted, step=2, replay=False, timeout=60)
            os.kill(ranks[0], signal.SIGKILL)  # mid-step 2 (its update, or before its checkpoint)
            code = await wait_until_exit(trainer)
            assert code != 0, trainer.log.read_text()[-3000:]
            assert "rank" in trainer.log.read_text()
            assert not _alive(ranks[0])
            assert journal.latest_checkpoint(ckpt) == (0, journal.checkpoint_path(ckpt, 0))
            info = await js.consumer_info(subjects.STREAM_TRAJECTORIES, "trainer")
            assert info.num_ack_pending == 4  # nothing acked: no checkpoint holds the steps

            trainer.start()
            resumed = await log.wait_for(TrainerResumed, timeout=60)
            assert (resumed.step, resumed.replay_steps) == (0, 2)
            done = await log.wait_for(TrainStep, step=2, replay=True, timeout=60)
            assert done.checkpointed
            redo = [e for e in log.matching(TrainStep, step=1) if e.replay]
            assert len(redo) == 1 and redo[0].loss == step1.loss  # bitwise, run to run
            assert redo[0].trajectory_ids == step1.trajectory_ids
            # version 2 was recomputed bit for bit (checked against the store, not pushed again)
            assert [e.version for e in log.matching(WeightsUpdated)] == [2, 3]
            meta = read_meta(journal.checkpoint_path(ckpt, 2))
            assert meta["trained"] == [t.trajectory_id for t in first + second]

            async def acked() -> bool:
                info = await js.consumer_info(subjects.STREAM_TRAJECTORIES, "trainer")
                return info.num_ack_pending == 0 and info.num_pending == 0

            await wait_until(acked, timeout=20, what="all four trajectories acked")

            # one process: the same losses within 1e-6
            torch.set_num_threads(1)
            state = new_state(load_model_config(model_dir), base, 1, OPTIM, deterministic=True)
            for batch, ours in ((first, step1), (second, done)):
                samples = [to_sample(t, 0, 1.0) for t in batch]
                got = grpo_step(state, samples, group_size=GROUP, grpo=PAIRS, optim=OPTIM, pad_id=0)
                assert abs(got.loss - ours.loss) <= 1e-6
        finally:
            trainer.stop()


async def wait_until_exit(trainer: TrainerProc) -> int:
    """The trainer's exit code (it exits on its own once a rank is lost)."""
    proc = trainer.proc
    assert proc is not None

    async def exited() -> bool:
        return proc.poll() is not None

    await wait_until(exited, timeout=60, what="the trainer exits")
    code = proc.returncode
    assert code is not None
    return code
