"""A step's ``train_step`` published again by a restarted trainer (``republished``): what the
step's checkpoint records of the event and the event made again from that record
(``services/trainer/records.py``, pure; once through a real checkpoint of the small model),
and what its consumers make of it — the node's
metrics count the step once, the RL loop's ``await_train_step`` takes the first event of its
own step only, the soak's lane records the step once. Events are handed to a real
``EventTail`` by hand (no bus)."""

from __future__ import annotations

import asyncio
import json
import math
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from bench.soak_train_check import TrainLane, TrainLaneEnded, check_training
from common.codec import decode, encode
from common.events import EventTail
from common.training_config import OptimConfig
from model.config import load_model_config
from model.loader import load_safetensors
from model.training import load_weights, publishable_state_dict, read_meta, weights_sha256
from schemas.events import TrainerResumed, TrainStep, TrainStepStarted
from services.rl.loop import Quiet, await_train_step
from services.rl.options import StepFaults
from services.rl.records import Phases
from services.supervisor import metrics
from services.trainer import journal, records
from services.trainer.config import GrpoConfig
from services.trainer.core import Sample
from services.trainer.update import grpo_step, load_state, new_state, save_state
from tests.unit.model_fixtures import write_small_model
from tests.unit.soak_train_helpers import arrive, context, lane, train_step


def step_event(step: int, **fields: Any) -> TrainStep:
    """A ``train_step`` as the trainer builds it before the checkpoint (push and checkpoint
    seconds not known yet)."""
    base = train_step(step, [f"t{step}-0", f"t{step}-1"])
    fields = {"loss": 0.25, "grad_norm": 1.5, "step_s": 3.2, "batch_sha256": "cd"} | fields
    return msgspec.structs.replace(base, **fields)


def checkpoint_meta(event: TrainStep) -> dict[str, Any]:
    """A checkpoint's ``meta`` holding the step's record, through JSON as ``meta.json`` is."""
    meta = {"run_id": "r", "model": [], "step": event.step, "version": event.version,
            "trained": list(event.trajectory_ids), records.TRAIN_STEP_META:
            records.checkpoint_record(event)}  # fmt: skip
    return dict(json.loads(json.dumps(meta, sort_keys=True)))


def test_the_checkpoint_s_record_gives_the_event_back_marked_republished() -> None:
    known = step_event(5)
    again = records.republished(checkpoint_meta(known), version=6)
    assert again is not None and again.republished and not known.republished
    assert again.version == 6 and again.source == "trainer"
    same = ("ts", "republished")
    assert {k: v for k, v in msgspec.structs.asdict(again).items() if k not in same} == {
        k: v for k, v in msgspec.structs.asdict(known).items() if k not in same
    }
    assert again.ts >= known.ts
    # the checkpoint's weights as the store numbers them at the resume
    renumbered = records.republished(checkpoint_meta(known), version=9)
    assert renumbered is not None and renumbered.version == 9
    # a loss that is not a number survives the JSON file
    nan = records.republished(checkpoint_meta(step_event(5, loss=math.nan)), version=6)
    assert nan is not None and math.isnan(nan.loss)


def test_a_real_checkpoint_s_record_gives_its_weights_sha256_and_version(tmp_path: Path) -> None:
    """One update of the small model, checkpointed as the trainer does (``save_state`` with the
    record in its meta): the event made again from the files names the checkpoint's weights."""
    model_dir = write_small_model(tmp_path / "model")
    cfg, optim = load_model_config(model_dir), OptimConfig(lr=1e-2, seed=5)
    state = new_state(cfg, load_safetensors(model_dir), 1, optim)
    batch = [
        Sample(trajectory_id=f"{g}{i}", group_id=g, sample_index=i, prompt_ids=(3, 4, 5),
               response_ids=(7 + i, 8, 9), loss_mask=(1, 0, 1), rollout_logprobs=(-1.0, 0.0, -2.0),
               weight_versions=(1, -1, 1), reward=float(i))
        for g in ("A", "B") for i in range(2)
    ]  # fmt: skip
    result = grpo_step(state, batch, group_size=2, grpo=GrpoConfig(), optim=optim, pad_id=0)
    known = records.train_step(
        result, version=state.version, checkpoint_s=0.0, push_s=0.0, step_s=1.0,
        checkpointed=True, replay=False, batch_sha256=records.batch_sha256(batch),
        weights_sha256=weights_sha256(publishable_state_dict(state.model)),
    )  # fmt: skip
    path = journal.checkpoint_path(tmp_path / "ckpt", state.step)
    save_state(
        path, state, {"run_id": "r", records.TRAIN_STEP_META: records.checkpoint_record(known)}
    )
    loaded, meta = load_state(path, cfg, optim)
    assert meta == read_meta(path)
    again = records.republished(meta, loaded.version)
    assert again is not None and again.republished and (again.step, again.version) == (1, 2)
    assert again.weights_sha256 == weights_sha256(load_weights(path)) == known.weights_sha256
    assert again.trajectory_ids == ["A0", "A1", "B0", "B1"] and again.loss == result.loss


def test_no_event_without_a_record_of_the_checkpoint_s_own_step() -> None:
    step0 = {"run_id": "r", "model": [], "step": 0, "version": 1, "trained": []}
    assert records.republished(step0, version=1) is None  # step 0's, or an older trainer's
    other = checkpoint_meta(step_event(5)) | {"step": 6}
    assert records.republished(other, version=7) is None
    broken = checkpoint_meta(step_event(5))
    broken[records.TRAIN_STEP_META] = {"type": "TrainStep.v1", "step": 5}
    assert records.republished(broken, version=6) is None


def test_an_older_train_step_decodes_as_not_republished() -> None:
    old = msgspec.msgpack.decode(encode(step_event(5)))
    del old["republished"]
    assert decode(msgspec.msgpack.encode(old), TrainStep).republished is False


def test_a_republished_step_is_not_counted_twice_by_the_node_s_metrics() -> None:
    first = step_event(5)
    gauges = [
        metrics.Sample("belayer_trainer_loss", (), 0.25),
        metrics.Sample("belayer_trainer_reward_mean", (), 0.0),
        metrics.Sample("belayer_trainer_logprob_diff_max", (), 0.0),
    ]
    assert metrics.event_samples(first) == [
        metrics.Sample("belayer_trainer_steps", (), 1),
        metrics.Sample("belayer_trainer_step_seconds", (), 0.0),
        *gauges,
    ]
    again = msgspec.structs.replace(first, republished=True)
    assert metrics.event_samples(again) == gauges


async def test_the_loop_takes_its_own_step_s_first_event(tmp_path: Path) -> None:
    tail, ctx = EventTail(None), context(tmp_path)  # base_step 4: loop step 1 is step 5
    first = step_event(5)
    await arrive(
        tail,
        TrainStepStarted(step=5, base_version=5, samples=2, replay=False),
        # a trainer restarted from step 4's checkpoint republished step 4: not step 5's event
        msgspec.structs.replace(step_event(4), republished=True),
        first,
        msgspec.structs.replace(step_event(5), republished=True),  # a duplicate of step 5
    )
    done = await asyncio.wait_for(
        await_train_step(None, tail, ctx, 1, StepFaults(), Quiet(), Phases()), 5.0
    )
    assert done is first


@pytest.mark.parametrize("original", [True, False])
async def test_the_lane_counts_a_republished_step_once(tmp_path: Path, original: bool) -> None:
    """Killed after step 5's checkpoint, before (``original`` False) or after its first
    ``train_step``: the lane's step 5 ends once, the next lane step waits for step 6."""
    tail, ctx = EventTail(None), context(tmp_path)
    lane_ = lane(tail, tmp_path)
    t0 = time.time()
    started = TrainStepStarted(step=5, base_version=5, samples=2, replay=False)
    resumed = TrainerResumed(step=5, version=6, store_version=6, trained=10, replay_steps=0,
                             pushed=not original)  # fmt: skip
    again = msgspec.structs.replace(step_event(5), republished=True)
    await arrive(tail, started, *([step_event(5)] if original else []), resumed, again)
    five = await asyncio.wait_for(lane_._trained(ctx, 1, Phases(), t0), 5.0)
    assert (five.step, five.version) == (5, 6)
    await arrive(
        tail,
        TrainStepStarted(step=6, base_version=6, samples=2, replay=False),
        step_event(6),
    )
    six = await asyncio.wait_for(lane_._trained(ctx, 2, Phases(), time.time()), 5.0)
    assert (six.step, six.via) == (6, "event")
    history = [TrainLane(t=t0, workload="math", tasks=2, n=2, base_step=4), five, six,
               TrainLaneEnded(t=time.time(), steps=2)]  # fmt: skip
    published = {t for s in (five, six) for t in s.trajectory_ids}
    assert list(check_training(history, published, kills=[])) == []


async def test_a_lane_step_counted_from_its_republished_event_says_so(tmp_path: Path) -> None:
    tail, ctx = EventTail(None), context(tmp_path)
    started = TrainStepStarted(step=5, base_version=5, samples=2, replay=False)
    await arrive(tail, started, msgspec.structs.replace(step_event(5), republished=True))
    done = await asyncio.wait_for(lane(tail, tmp_path)._trained(ctx, 1, Phases(), time.time()), 5.0)
    assert (done.step, done.via, done.trajectory_ids) == (5, "republished", ["t5-0", "t5-1"])
