"""Exactly once between checkpoints: a trainer that checkpoints every 2 steps is SIGKILLed in
its second step, after the first step's weights were already pushed. The restarted trainer
redoes both planned steps from its last checkpoint on the very same trajectories (redelivered:
they were never acked), checks the version the store already has instead of pushing it again,
pushes the second, and ends bitwise where an uninterrupted run ends. Real nats-server, the real
weight store, the trainer as a real process, the real model."""

from __future__ import annotations

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
from model.tiny import init_tiny_model
from model.training import load_weights, publishable_state_dict, read_meta
from schemas.events import TrainerResumed, TrainStep, TrainStepStarted, WeightsUpdated
from services.trainer import journal
from services.trainer.service import to_sample
from services.trainer.update import grpo_step, new_state, weights_equal
from services.weights.client import fetch_manifest, map_weights
from services.weights.config import WeightStoreConfig
from services.weights.service import run as run_weights
from tests.integration.node_helpers import wait_until
from tests.integration.shm_helpers import running_service
from tests.integration.trainer_helpers import (
    GROUP,
    GRPO,
    OPTIM,
    SMALL,
    TrainerProc,
    make_group,
    publish,
    run_to_exit,
    trainer_config,
)

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


async def test_a_kill_between_checkpoints_replays_both_steps_exactly(
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
    trainer = TrainerProc(trainer_config(nats_server.url, run_id, ckpt), tmp_path / "trainer.out")
    async with running_service(run_weights, store, what="weight store"):
        try:
            trainer.start()
            await trainer.ready(nc)
            base = load_safetensors(model_dir)
            first = make_group(model_dir, base, 1, "a")
            await publish(js, first)
            step1 = await log.wait_for(TrainStep, step=1, timeout=60)
            assert not step1.checkpointed and step1.logprob_diff_max <= 1e-4
            v2 = map_weights(await fetch_manifest(nc, 2))
            second = make_group(model_dir, dict(v2), 2, "b")
            await publish(js, second)
            await log.wait_for(TrainStepStarted, step=2, replay=False, timeout=60)
            trainer.kill()  # mid-step 2: step 1 pushed (version 2) but in no checkpoint
            assert journal.latest_checkpoint(ckpt) == (0, journal.checkpoint_path(ckpt, 0))

            trainer.start()
            resumed = await log.wait_for(TrainerResumed, timeout=60)
            assert (resumed.step, resumed.version, resumed.store_version) == (0, 1, 2)
            assert resumed.replay_steps == 2 and not resumed.pushed
            done = await log.wait_for(TrainStep, step=2, replay=True, timeout=60)
            assert done.checkpointed and done.version == 3
            redo = [e for e in log.matching(TrainStep, step=1) if e.replay]
            assert len(redo) == 1 and redo[0].loss == step1.loss
            # version 2 was checked, not pushed again; version 3 pushed once
            pushes = [e.version for e in log.matching(WeightsUpdated)]
            assert pushes == [2, 3]
            meta = read_meta(journal.checkpoint_path(ckpt, 2))
            assert meta["trained"] == [t.trajectory_id for t in first + second]

            async def acked() -> bool:
                info = await js.consumer_info(subjects.STREAM_TRAJECTORIES, "trainer")
                return info.num_ack_pending == 0 and info.num_pending == 0

            await wait_until(acked, timeout=20, what="all four trajectories acked")

            # an uninterrupted run of the same two steps ends at the same weights
            torch.set_num_threads(1)
            state = new_state(load_model_config(model_dir), base, 1, OPTIM)
            for batch in (first, second):
                samples = [to_sample(t, 0, 1.0) for t in batch]
                grpo_step(state, samples, group_size=GROUP, grpo=GRPO, optim=OPTIM, pad_id=0)
            ours = publishable_state_dict(state.model)
            assert weights_equal(ours, load_weights(journal.checkpoint_path(ckpt, 2)))
            v3 = map_weights(await fetch_manifest(nc, 3))
            assert weights_equal(ours, dict(v3))
        finally:
            trainer.stop()


async def test_a_checkpoint_of_another_run_or_model_is_refused_before_training(
    nats_server: NatsServer,
    trainer_bus: tuple[NATS, EventTail],
    model_dir: Path,
    run_id: str,
    tmp_path: Path,
) -> None:
    nc, _ = trainer_bus
    ckpt = tmp_path / "trainer"
    store = WeightStoreConfig(nats_url=nats_server.url, run_id=run_id, model_dir=model_dir)
    async with running_service(run_weights, store, what="weight store"):
        first = TrainerProc(trainer_config(nats_server.url, run_id, ckpt), tmp_path / "a.out")
        try:
            first.start()
            await first.ready(nc)
        finally:
            first.stop()
        assert first.proc is not None and first.proc.returncode == 0
        assert journal.latest_checkpoint(ckpt) is not None

        other_run = trainer_config(nats_server.url, run_id + "x", ckpt)
        out = await run_to_exit(other_run)
        assert out.returncode == 1 and "pass --resume" in out.stderr, out.stderr[-2000:]

    other_model = init_tiny_model(tmp_path / "other", **(SMALL | {"hidden_size": 32}))
    store_b = WeightStoreConfig(nats_url=nats_server.url, run_id=run_id, model_dir=other_model)
    async with running_service(run_weights, store_b, what="weight store"):
        resume = replace(trainer_config(nats_server.url, run_id, ckpt), resume=True)
        out = await run_to_exit(resume)
        assert out.returncode == 1 and "another model" in out.stderr, out.stderr[-2000:]
