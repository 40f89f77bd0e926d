"""The trainer's side of its records on the bus: a ``Trajectory`` as the trainer's ``Sample``,
acks, the dead-letter copy, the texts of refusals, the ``train_step`` event of an update (and
its record in the step's checkpoint, published again at a resume), and the weights of the older
versions a batch's tokens came from."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import nats.errors
import torch
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from common import subjects
from common.errors import BusUnavailable, NotFound, Timeout
from model.config import ModelConfig
from model.qwen3 import Qwen3ForCausalLM, build_model
from schemas.base import ID_PATTERN
from schemas.events import LogprobMismatch, TrainStep
from schemas.events_training import UpdateMetrics
from schemas.rollout import Trajectory
from schemas.weights import WeightManifest
from services.trainer.core import Sample, Verdict, without_trailing_context
from services.trainer.update import weights_equal
from services.weights.client import fetch_manifest, map_weights, push_weights

STORE_WAIT_S = 60.0
"""How long a restarting weight store is waited for."""


def to_sample(traj: Trajectory, stream_seq: int, default_temperature: float) -> Sample:
    """The trainer's view of a ``Trajectory`` record (group = rollout + task), without the
    tokens after its last model token (``core.without_trailing_context``)."""
    sample = Sample(
        trajectory_id=traj.trajectory_id,
        group_id=f"{traj.rollout_id}/{traj.task_id}",
        sample_index=traj.sample,
        prompt_ids=tuple(traj.prompt_ids),
        response_ids=tuple(traj.response_ids),
        loss_mask=tuple(traj.loss_mask),
        rollout_logprobs=tuple(traj.logprobs),
        weight_versions=tuple(traj.weight_versions),
        reward=traj.reward,
        reward_failed=bool(traj.reward_error),
        temperature=float(getattr(traj, "temperature", default_temperature)),
        stream_seq=stream_seq,
        slot=traj.slot,
    )
    return without_trailing_context(sample)


def model_signature(manifest: WeightManifest) -> list[list[Any]]:
    return sorted([t.name, t.dtype, list(t.shape)] for t in manifest.tensors)


async def ack(msg: Msg, log: Any) -> None:
    try:
        await msg.ack()
    except nats.errors.Error as exc:  # redelivered later; dedup makes that harmless
        log.warning("ack_failed", error=repr(exc))


def subject_id(msg: Msg) -> str:
    """The trajectory id a record's subject names (its last token; empty when that is not a
    valid id)."""
    tid = msg.subject.rsplit(".", 1)[-1]
    return tid if re.fullmatch(ID_PATTERN, tid) else ""


async def copy_to_dead_letter(
    js: JetStreamContext, msg: Msg, seq: int, error: str, reason: str, log: Any
) -> bool:
    """Copy the record as received to ``belayer.deadletter.trajectories`` (stream
    ``DEADLETTER``) with why, where it came from, and a message id that makes a second copy
    of the same record a no-op; logged as ``trajectory_<reason>``. False when the copy
    failed."""
    headers = {
        "Nats-Msg-Id": f"trajectories-{seq}",
        "Belayer-Error": error[:500],
        "Belayer-Subject": msg.subject,
        "Belayer-Stream-Seq": str(seq),
    }
    try:
        await js.publish(
            subjects.dead_letter("trajectories"), msg.data, headers=headers, timeout=2.0
        )
    except (TimeoutError, nats.errors.Error) as err:
        log.warning("dead_letter_failed", stream_seq=seq, error=repr(err))
        return False
    log.error(f"trajectory_{reason}", stream_seq=seq, subject=msg.subject, error=error[:500])
    return True


def refusal(verdict: Verdict, s: Sample) -> str:
    if verdict is Verdict.STALE:
        return f"oldest weight version {s.oldest_version} is beyond the staleness bound"
    if verdict is Verdict.INVALID:
        return f"sample index {s.sample_index} outside the group"
    return f"group {s.group_id} already holds sample {s.sample_index}"


def stale(s: Sample, version: int) -> str:
    return f"oldest weight version {s.oldest_version} too old for version {version}"


def logprob_mismatch(result: UpdateMetrics, version: int, bound: float) -> LogprobMismatch | None:
    """The ``logprob_mismatch`` event of an update whose training and rollout log-probabilities
    (of weight ``version``) differ by more than ``bound``; None when they agree."""
    if result.logprob_diff_max <= bound:
        return None
    return LogprobMismatch(
        step=result.step, version=version, logprob_diff_max=result.logprob_diff_max,
        logprob_diff_mean=result.logprob_diff_mean, bound=bound,
    )  # fmt: skip


def train_step(
    metrics: UpdateMetrics,
    *,
    version: int,
    checkpoint_s: float,
    push_s: float,
    step_s: float,
    checkpointed: bool,
    replay: bool,
    weights_sha256: str,
    batch_sha256: str,
) -> TrainStep:
    """The ``train_step`` event of an update: its ``metrics`` as measured (the timings to
    0.1 ms), ``version`` the weights' number after the push (which may have renumbered them),
    then the checkpoint and the push."""
    measured = msgspec.structs.asdict(metrics)
    del measured["ts"], measured["source"]  # the event's own: built now, by the trainer
    measured |= {"version": version, "recompute_s": round(metrics.recompute_s, 4),
                 "train_s": round(metrics.train_s, 4)}  # fmt: skip
    return TrainStep(
        **measured, checkpoint_s=round(checkpoint_s, 4), push_s=round(push_s, 4),
        step_s=round(step_s, 4), checkpointed=checkpointed, replay=replay,
        weights_sha256=weights_sha256, batch_sha256=batch_sha256,
    )  # fmt: skip


TRAIN_STEP_META = "train_step"
"""The key of a step's checkpoint ``meta`` that holds its ``train_step`` event as known before
the checkpoint (``checkpoint_record``); a trainer resuming from that checkpoint publishes it
again (``republished``): the first publication may have been lost."""


def checkpoint_record(event: TrainStep) -> dict[str, Any]:
    """What a step's checkpoint records of its ``train_step`` event (plain JSON values; no
    ``ts`` or ``source``: a republication is built, and published by the trainer, anew)."""
    record: dict[str, Any] = msgspec.to_builtins(event)
    for key in ("ts", "source", "republished"):
        record.pop(key, None)
    return record


def republished(meta: dict[str, Any], version: int) -> TrainStep | None:
    """The ``train_step`` event of the step a checkpoint holds, from its ``meta``, marked
    ``republished``, ``version`` the checkpoint's weights' number at the resume; None when the
    checkpoint records none (step 0's, an older trainer's), an unreadable one, or another
    step's."""
    record = meta.get(TRAIN_STEP_META)
    if not isinstance(record, dict):
        return None
    try:
        event = msgspec.convert(record, TrainStep)
    except msgspec.ValidationError:
        return None
    if event.step != meta.get("step"):
        return None
    return msgspec.structs.replace(event, version=version, republished=True, ts=time.time())


def batch_sha256(batch: Sequence[Sample]) -> str:
    """The digest of what an update trains on, in its order (``TrainStep.batch_sha256``): two
    runs that train the same batches agree on it step for step, whatever their ids."""
    digest = hashlib.sha256()
    for s in batch:
        content = [s.slot, s.sample_index, s.prompt_ids, s.response_ids, s.loss_mask,
                   s.weight_versions, s.reward, s.temperature]  # fmt: skip
        digest.update(json.dumps(content).encode() + b"\n")
    return digest.hexdigest()


async def store_manifest(nc: NATS) -> WeightManifest:
    """The store's current manifest; a (re)starting store is waited for, up to
    ``STORE_WAIT_S``."""
    deadline = time.monotonic() + STORE_WAIT_S
    while True:
        try:
            return await fetch_manifest(nc, timeout=2.0)
        except (BusUnavailable, Timeout):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)  # the weight store is (re)starting: bounded wait


async def store_has(nc: NATS, version: int, ours: dict[str, torch.Tensor]) -> bool:
    """Whether the store's ``version`` is bitwise ``ours`` (unknown: True)."""
    try:
        theirs = map_weights(await fetch_manifest(nc, version, timeout=5.0))
    except NotFound:
        return True  # collected: trust the numbering (replay is deterministic)
    return await asyncio.to_thread(weights_equal, ours, theirs)


async def push_retrying(
    nc: NATS,
    weights: dict[str, torch.Tensor],
    base: int,
    run_id: str,
    stopping: asyncio.Event,
    log: Any,
) -> WeightManifest:
    """Push ``weights`` as ``base + 1``, retried while the store is unreachable (until
    ``stopping``); the store's manifest (it may have renumbered them)."""
    while True:
        try:
            return await push_weights(nc, weights, base, run_id)
        except (BusUnavailable, Timeout) as exc:
            if stopping.is_set():
                raise
            log.warning("push_retry", base_version=base, error=str(exc))
            await asyncio.sleep(0.5)  # the weight store is restarting: retry


async def generating_models(
    nc: NATS,
    cfg: ModelConfig | None,
    batch: Sequence[Sample],
    version: int,
    *,
    deterministic: bool,
    stopping: asyncio.Event,
) -> dict[int, Qwen3ForCausalLM | None]:
    """Inference models of the versions other than ``version`` the batch's tokens came from
    (from the weight store while it keeps them; None when gone); a restarting store is waited
    for, up to ``STORE_WAIT_S``."""
    out: dict[int, Qwen3ForCausalLM | None] = {}
    assert cfg is not None
    deadline = time.monotonic() + STORE_WAIT_S
    for v in sorted({x for s in batch for x in s.model_versions() if x != version}):
        while v not in out:
            try:
                tensors = map_weights(await fetch_manifest(nc, v, timeout=5.0))
                out[v] = build_model(cfg, tensors, deterministic=deterministic)
            except NotFound:
                out[v] = None
            except (BusUnavailable, Timeout):
                if time.monotonic() > deadline or stopping.is_set():
                    raise
                await asyncio.sleep(0.5)  # the weight store is restarting: bounded wait
    return out
