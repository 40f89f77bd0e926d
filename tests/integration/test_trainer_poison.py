"""A poison trajectory does not crash-loop the trainer. Real nats-server, the real weight store,
the trainer as a real process, the real model: a well-formed record whose response holds a
token id beyond the vocabulary makes the update's forward raise. Before, the trainer died, was
restarted, read the same unacked records and died again, forever. Now the trajectory goes to
the dead-letter subject with its group mate (a group trains whole or not at all), the batch's
other group is held again, and the next step trains it — in the same process, to the weights
an update that never saw the poison gives."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from nats.aio.client import Client as NATS

from common import subjects
from common.events import EventTail
from common.natsserver import NatsServer
from model.config import load_model_config
from model.loader import load_safetensors
from model.training import load_weights, publishable_state_dict, read_meta
from schemas.events import TrainerCheckpointed, TrainStep, TrajectoryRefused
from services.trainer import journal
from services.trainer.client import trainer_status
from services.trainer.service import to_sample
from services.trainer.update import grpo_step, new_state, weights_equal
from services.weights.config import WeightStoreConfig
from services.weights.service import run as run_weights
from tests.integration.node_helpers import wait_until
from tests.integration.shm_helpers import running_service
from tests.integration.trainer_helpers import (
    GROUP,
    OPTIM,
    SMALL,
    TrainerProc,
    make_group,
    publish,
    trainer_config,
)

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


async def test_a_poison_trajectory_is_dead_lettered_and_training_goes_on(
    nats_server: NatsServer,
    trainer_bus: tuple[NATS, EventTail],
    model_dir: Path,
    run_id: str,
    tmp_path: Path,
) -> None:
    nc, log = trainer_bus
    js = nc.jetstream()
    ckpt = tmp_path / "trainer"
    config = dataclasses.replace(
        trainer_config(nats_server.url, run_id, ckpt),
        groups_per_step=2,
        checkpoint_every=1,
        hold_before_checkpoint_s=0.0,
    )
    store = WeightStoreConfig(nats_url=nats_server.url, run_id=run_id, model_dir=model_dir)
    trainer = TrainerProc(config, tmp_path / "trainer.out")
    async with running_service(run_weights, store, what="weight store"):
        try:
            trainer.start()
            await trainer.ready(nc)
            assert trainer.proc is not None
            pid = trainer.proc.pid
            base = load_safetensors(model_dir)
            poison = make_group(model_dir, base, 1, "p")
            bad = poison[1]
            bad.response_ids[-1] = SMALL["vocab_size"] + 7  # well-formed, but no such token
            first = make_group(model_dir, base, 1, "a")
            await publish(js, poison + first)  # one batch: groups p and a

            refused = await log.wait_for(TrajectoryRefused, reason="poison", timeout=60)
            assert refused.trajectory_id == bad.trajectory_id
            assert refused.detail.startswith("IndexError")
            mate = await log.wait_for(TrajectoryRefused, reason="group_dropped", timeout=10)
            assert mate.trajectory_id == poison[0].trajectory_id
            dead = [await js.get_msg(subjects.STREAM_DEADLETTER, seq) for seq in (1, 2)]
            headers = [m.headers or {} for m in dead]  # none at all fails as a missing key
            assert {h["Belayer-Subject"] for h in headers} == {
                subjects.trajectory("p", t.trajectory_id) for t in poison
            }
            assert all(h["Belayer-Error"] for h in headers)

            async def holds_group_a() -> bool:
                st = await trainer_status(nc)
                return st.held == GROUP and st.step == 0 and st.refused == 2

            await wait_until(holds_group_a, timeout=30, what="group a held again, step 0")
            assert trainer.proc.poll() is None and trainer.proc.pid == pid  # no crash, no restart

            second = make_group(model_dir, base, 1, "b")
            await publish(js, second)
            step = await log.wait_for(TrainStep, step=1, timeout=60)
            assert step.samples == 2 * GROUP and not step.replay and step.checkpointed
            await log.wait_for(TrainerCheckpointed, step=1, timeout=30)
            meta = read_meta(journal.checkpoint_path(ckpt, 1))
            assert meta["trained"] == [t.trajectory_id for t in first + second]

            async def acked() -> bool:
                info = await js.consumer_info(subjects.STREAM_TRAJECTORIES, config.consumer)
                return info.num_ack_pending == 0 and info.num_pending == 0

            await wait_until(acked, timeout=30, what="every trajectory acked")
            assert trainer.proc.poll() is None and trainer.proc.pid == pid

            # the failed tries left no trace: the same update run here from scratch
            torch.set_num_threads(1)
            state = new_state(load_model_config(model_dir), base, 1, OPTIM)
            samples = [to_sample(t, 0, 1.0) for t in first + second]
            again = grpo_step(state, samples, group_size=GROUP, grpo=config.grpo, optim=OPTIM,
                              pad_id=0)  # fmt: skip
            assert again.loss == step.loss
            ours = publishable_state_dict(state.model)
            assert weights_equal(ours, load_weights(journal.checkpoint_path(ckpt, 1)))
        finally:
            trainer.stop()
