"""The GRPO trainer on the bus: trajectories in (stream ``TRAJECTORIES``), weights out.

- **Consume.** A durable JetStream pull consumer (``consumer``) with explicit acks; every
  trajectory held — waiting for its group, or trained but not yet in a checkpoint — is marked
  ``in_progress`` every third of ``ack_wait_s``, so JetStream does not redeliver it while this
  trainer lives, and redelivers it to the next one if this one dies.
- **Batch.** ``core.Batcher``: whole groups, dedup by trajectory id (the ids a checkpoint
  records are never trained again), staleness. A malformed record is copied to the dead-letter
  subject (stream ``DEADLETTER``), acked and reported (``trajectory_refused``); training goes on.
- **Step.** The batch's plan is made durable (``journal``), ``train_step_started``, then
  ``update.grpo_step`` in a thread (the event loop keeps heartbeating and answering), a
  ``logprob_mismatch`` error event when training and inference disagree beyond the bound, the
  checkpoint every ``checkpoint_every`` steps, the push (version + 1, compare-and-set on the
  base), and only then the acks of every trajectory the checkpoint holds; ``train_step``
  carries the step's metrics.
- **Resume.** From the latest checkpoint: its trained ids are dedup'd, a checkpoint whose push
  did not happen is pushed, planned steps after it are redone from the same trajectories
  (pushes the store already has are checked bit for bit, not repeated).
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from pathlib import Path
from typing import Any

import nats.errors
import torch
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from common import events, subjects
from common.codec import decode
from common.errors import BelayerError, BusUnavailable, Conflict, InvalidRequest, NotFound, Timeout
from common.service import Service, run_service
from model.config import ModelConfig, load_model_config
from model.qwen3 import Qwen3ForCausalLM, build_model
from model.training import publishable_state_dict, read_meta
from schemas.base import ID_PATTERN
from schemas.events import (
    EventBase,
    LogprobMismatch,
    TrainerCheckpointed,
    TrainerResumed,
    TrainStep,
    TrainStepStarted,
    TrajectoryRefused,
)
from schemas.rollout import Trajectory
from schemas.trainer import TrainerStatus, TrainerStatusRequest
from schemas.weights import WeightManifest
from services.trainer import journal
from services.trainer.config import TrainerConfig
from services.trainer.core import (
    Batcher,
    Sample,
    Verdict,
    validate_sample,
    without_trailing_context,
)
from services.trainer.journal import Plan
from services.trainer.update import (
    StepResult,
    TrainState,
    grpo_step,
    load_state,
    new_state,
    save_state,
    weights_equal,
)
from services.weights.client import fetch_manifest, map_weights, push_weights

FETCH_BATCH = 64
MAX_ACK_PENDING = 65_536
STORE_WAIT_S = 60.0


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
        temperature=float(getattr(traj, "temperature", default_temperature)),
        stream_seq=stream_seq,
    )
    return without_trailing_context(sample)


def model_signature(manifest: WeightManifest) -> list[list[Any]]:
    return sorted([t.name, t.dtype, list(t.shape)] for t in manifest.tensors)


class TrainerService(Service[TrainerConfig]):
    """See the module doc."""

    name = "trainer"
    drain_timeout_s = 60.0

    def __init__(self, config: TrainerConfig) -> None:
        super().__init__(config)
        self.dir = Path(config.checkpoint_dir).resolve()
        self.batcher = Batcher(config.group_size, config.groups_per_step, config.max_staleness)
        self.held: dict[str, Msg] = {}
        """Trajectory id → its latest delivery, for held (untrained) samples."""
        self.unacked: dict[str, Msg] = {}
        """Trained since the latest checkpoint: acked once a checkpoint holds them."""
        self.durable: set[str] = set()
        self.plans: list[Plan] = []
        self.state: TrainState | None = None
        self.model_cfg: ModelConfig | None = None
        self.store_version = 0
        self.checkpoint_step = 0
        self.refused = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self.reference: dict[str, torch.Tensor] | None = None
        self.sub: Any = None
        self.signature: list[list[Any]] = []
        """Names, dtypes and shapes of the served model's tensors (stamped on checkpoints)."""

    # --- start ----------------------------------------------------------------------------
    async def open(self) -> None:
        torch.set_num_threads(self.config.threads)
        self.dir.mkdir(parents=True, exist_ok=True)

    async def setup(self) -> None:
        manifest = await self._store_manifest()
        self.model_cfg = await asyncio.to_thread(load_model_config, manifest.model_dir)
        self.signature = model_signature(manifest)
        await self._restore(manifest)
        filt = self.config.subject_filter or subjects.TRAJECTORIES_ALL
        self.sub = await self.js.pull_subscribe(
            filt,
            durable=subjects.check_token(self.config.consumer, "consumer"),
            stream=subjects.STREAM_TRAJECTORIES,
            config=ConsumerConfig(
                ack_policy=AckPolicy.EXPLICIT,
                deliver_policy=DeliverPolicy.ALL,
                ack_wait=self.config.ack_wait_s,
                max_ack_pending=MAX_ACK_PENDING,
                max_deliver=-1,
            ),
        )
        await self.server.serve(subjects.trainer_status(), TrainerStatusRequest, self._on_status)

    async def _store_manifest(self) -> WeightManifest:
        deadline = time.monotonic() + STORE_WAIT_S
        while True:
            try:
                return await fetch_manifest(self.nc, timeout=2.0)
            except (BusUnavailable, Timeout):
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)  # the weight store is (re)starting: bounded wait

    async def _restore(self, manifest: WeightManifest) -> None:
        c, cfg = self.config, self.model_cfg
        assert cfg is not None
        ref_path = self.dir / journal.REFERENCE
        found = journal.latest_checkpoint(self.dir)
        if found is None:
            tensors = map_weights(manifest)
            state = await asyncio.to_thread(
                new_state, cfg, tensors, manifest.version, c.optim,
                deterministic=c.deterministic, with_reference=c.grpo.beta > 0,
            )  # fmt: skip
            if c.grpo.beta > 0:
                await asyncio.to_thread(_save_reference, ref_path, state)
            self.state, self.store_version = state, manifest.version
            await self._checkpoint()
            self.log.info("trainer_started", version=manifest.version, model=manifest.model_dir)
            return
        step, path = found
        meta = read_meta(path)
        if meta.get("run_id") != c.run_id and not c.resume:
            raise InvalidRequest(
                f"{self.dir} holds a training run of node run {meta.get('run_id')!r}; pass "
                "--resume to continue it, or choose another --checkpoint-dir",
                checkpoint=str(path),
            )
        if meta.get("model") != self.signature:
            raise InvalidRequest(
                f"checkpoint {path} is for another model than the weight store serves "
                f"({manifest.model_dir})",
                checkpoint=str(path),
            )
        if c.grpo.beta > 0:
            self.reference = await asyncio.to_thread(load_weights_file, ref_path)
        state, _ = await asyncio.to_thread(
            load_state, path, cfg, c.optim, deterministic=c.deterministic, reference=self.reference
        )
        self.state = state
        self.checkpoint_step = step
        self.durable = set(state.trained)
        self.batcher.trained = set(state.trained)
        self.plans = journal.plans_after(self.dir, step)
        self.store_version = manifest.version
        pushed = await self._reconcile(manifest)
        await self._publish(
            TrainerResumed(
                step=state.step,
                version=state.version,
                store_version=manifest.version,
                trained=len(self.durable),
                replay_steps=len(self.plans),
                pushed=pushed,
            )
        )
        self.log.info(
            "trainer_resumed", step=step, version=state.version,
            store_version=manifest.version, replay_steps=len(self.plans), pushed=pushed,
        )  # fmt: skip

    async def _reconcile(self, manifest: WeightManifest) -> bool:
        """Make the store hold this checkpoint's weights (or plan to reach its version by
        replay); True when it pushed them."""
        state = self.state
        assert state is not None
        s, v = manifest.version, state.version
        if s == v and await self._store_has(v, state):
            return False
        if s == v - 1:
            await self._push(state)
            return True
        if s > v and self.plans and self.plans[-1].base_version + 1 >= s:
            return False  # the planned steps reach the store's version: redo them
        self.log.warning("weights_repushed", store_version=s, checkpoint_version=v)
        await self._push(state, base=s)
        return True

    async def _store_has(self, version: int, state: TrainState) -> bool:
        """Whether the store's ``version`` is bitwise this state's weights (unknown: True)."""
        try:
            manifest = await fetch_manifest(self.nc, version, timeout=5.0)
            theirs = map_weights(manifest)
        except NotFound:
            return True  # collected: trust the numbering (replay is deterministic)
        ours = publishable_state_dict(state.model)
        return await asyncio.to_thread(weights_equal, ours, theirs)

    # --- consuming ----------------------------------------------------------------------------
    async def consume_loop(self) -> None:
        while not self.stop_requested.is_set():
            try:
                msgs = await self.sub.fetch(FETCH_BATCH, timeout=0.5)
            except TimeoutError:
                msgs = []
            except nats.errors.Error as exc:
                self.log.warning("fetch_failed", error=repr(exc))
                await asyncio.sleep(0.2)  # the bus is reconnecting: retry shortly
                continue
            for msg in msgs:
                await self._on_message(msg)
            await self._train_ready()

    async def heartbeat_loop(self) -> None:
        """Keep every held trajectory from being redelivered while this trainer lives."""
        while True:
            await asyncio.sleep(self.config.ack_wait_s / 3)
            for msg in [*self.held.values(), *self.unacked.values()]:
                try:
                    await msg.in_progress()
                except nats.errors.Error as exc:
                    self.log.debug("in_progress_failed", error=repr(exc))

    async def _on_message(self, msg: Msg) -> None:
        seq = msg.metadata.sequence.stream
        try:
            sample = to_sample(decode(msg.data, Trajectory), seq, self.config.temperature)
            assert self.model_cfg is not None
            validate_sample(sample, self.model_cfg.max_position_embeddings)
        except (BelayerError, ValueError) as exc:
            await self._dead_letter(msg, seq, exc)
            return
        state = self.state
        assert state is not None
        tid = sample.trajectory_id
        verdict = self.batcher.offer(sample, state.version)
        if verdict is Verdict.ACCEPTED:
            self.held[tid] = msg
        elif verdict is Verdict.TRAINED:
            if tid in self.durable:
                await _ack(msg, self.log)
            else:
                self.unacked[tid] = msg
        elif verdict is Verdict.DUPLICATE and tid in self.held:
            self.held[tid] = msg  # a redelivery of a held one: keep the newest delivery
        else:
            await self._refuse(msg, tid, verdict.value, _refusal(verdict, sample), seq)

    async def _dead_letter(self, msg: Msg, seq: int, exc: Exception) -> None:
        tid = msg.subject.rsplit(".", 1)[-1]
        tid = tid if re.fullmatch(ID_PATTERN, tid) else ""
        headers = {
            "Nats-Msg-Id": f"trajectories-{seq}",
            "Belayer-Error": str(exc)[:500],
            "Belayer-Subject": msg.subject,
            "Belayer-Stream-Seq": str(seq),
        }
        try:
            await self.js.publish(
                subjects.dead_letter("trajectories"), msg.data, headers=headers, timeout=2.0
            )
        except (TimeoutError, nats.errors.Error) as err:
            self.log.warning("dead_letter_failed", stream_seq=seq, error=repr(err))
            return  # not acked: redelivered and tried again
        self.log.error("trajectory_malformed", stream_seq=seq, subject=msg.subject, error=str(exc))
        await self._refuse(msg, tid, "malformed", str(exc), seq)

    async def _refuse(self, msg: Msg, tid: str, reason: str, detail: str, seq: int) -> None:
        self.refused += 1
        await _ack(msg, self.log)
        self.log.warning("trajectory_refused", trajectory_id=tid, reason=reason, detail=detail)
        await self._publish(
            TrajectoryRefused(trajectory_id=tid, reason=reason, detail=detail[:500], stream_seq=seq)
        )

    # --- training -------------------------------------------------------------------------------
    async def _train_ready(self) -> None:
        """Run every step whose batch is complete."""
        state = self.state
        assert state is not None
        while not self.stop_requested.is_set():
            for s in self.batcher.expire(state.version):
                msg = self.held.pop(s.trajectory_id, None)
                if msg is not None:
                    await self._refuse(
                        msg, s.trajectory_id, "stale", _stale(s, state.version), s.stream_seq
                    )
            if self.plans:
                plan = self.plans[0]
                batch = self.batcher.planned_batch(plan.trajectory_ids)
                if batch is None:
                    return  # its trajectories are still to be redelivered
                self.plans.pop(0)
                replay = True
            else:
                if self.config.max_steps and state.step >= self.config.max_steps:
                    return
                batch = self.batcher.next_batch(state.version)
                if batch is None:
                    return
                plan = Plan(state.step + 1, state.version, tuple(s.trajectory_id for s in batch))
                await asyncio.to_thread(journal.write_plan, self.dir, plan)
                replay = False
            await self._step(batch, plan, replay)

    async def _step(self, batch: list[Sample], plan: Plan, replay: bool) -> None:
        state, c = self.state, self.config
        assert state is not None and self.model_cfg is not None
        if plan.step != state.step + 1:
            raise Conflict(f"plan of step {plan.step} does not follow step {state.step}")
        if plan.base_version != state.version:  # the store renumbered meanwhile
            self.log.warning(
                "plan_version_moved", step=plan.step, planned=plan.base_version, now=state.version
            )
        self.idle.clear()
        t0 = time.perf_counter()
        try:
            await self._publish(
                TrainStepStarted(
                    step=plan.step,
                    base_version=plan.base_version,
                    samples=len(batch),
                    replay=replay,
                )
            )
            generating = await self._generating_models(batch, state)
            result: StepResult = await asyncio.to_thread(
                grpo_step, state, batch, group_size=c.group_size, grpo=c.grpo, optim=c.optim,
                pad_id=c.pad_token_id, generating=generating.get,
            )  # fmt: skip
            for s in batch:
                msg = self.held.pop(s.trajectory_id, None)
                if msg is not None:
                    self.unacked[s.trajectory_id] = msg
            self.batcher.mark_trained(batch)
            # Deterministic mode promises bitwise agreement: any difference is an error.
            bound = 0.0 if c.deterministic else c.logprob_diff_bound
            if result.logprob_diff_max > bound:
                self.log.error(
                    "logprob_mismatch", step=result.step, diff_max=result.logprob_diff_max,
                    bound=bound,
                )  # fmt: skip
                await self._publish(
                    LogprobMismatch(
                        step=result.step,
                        version=plan.base_version,
                        logprob_diff_max=result.logprob_diff_max,
                        logprob_diff_mean=result.logprob_diff_mean,
                        bound=bound,
                    )
                )
            if c.hold_before_checkpoint_s:
                await asyncio.sleep(c.hold_before_checkpoint_s)  # failure-injection window
            checkpoint_s = 0.0
            at_end = bool(c.max_steps) and state.step >= c.max_steps
            checkpointed = state.step % c.checkpoint_every == 0 or at_end
            if checkpointed:
                checkpoint_s = await self._checkpoint()
            t_push = time.perf_counter()
            if state.version > self.store_version:
                await self._push(state)
            elif not await self._store_has(state.version, state):
                self.log.error("replay_diverged", step=state.step, version=state.version)
                await self._push(state, base=self.store_version)
            push_s = time.perf_counter() - t_push
            if checkpointed:
                await self._ack_durable()
        finally:
            self.idle.set()
        metrics = TrainStep(
            step=result.step, version=state.version, loss=result.loss,
            reward_mean=result.reward_mean, reward_std=result.reward_std,
            samples=result.samples, groups=result.groups, tokens=result.model_tokens,
            logprob_diff_max=result.logprob_diff_max, logprob_diff_mean=result.logprob_diff_mean,
            unchecked_tokens=result.unchecked_tokens, clip_low=result.clip_low,
            clip_high=result.clip_high, kl=result.kl, grad_norm=result.grad_norm, lr=result.lr,
            recompute_s=round(result.recompute_s, 4), train_s=round(result.train_s, 4),
            checkpoint_s=round(checkpoint_s, 4), push_s=round(push_s, 4),
            step_s=round(time.perf_counter() - t0, 4), checkpointed=checkpointed, replay=replay,
        )  # fmt: skip
        self.log.info("train_step", **events.fields(metrics))
        await self._publish(metrics)

    async def _generating_models(
        self, batch: list[Sample], state: TrainState
    ) -> dict[int, Qwen3ForCausalLM | None]:
        """Inference models of the older versions the batch's tokens came from (from the weight
        store while it keeps them; None when gone)."""
        out: dict[int, Qwen3ForCausalLM | None] = {}
        cfg = self.model_cfg
        assert cfg is not None
        for v in sorted({x for s in batch for x in s.model_versions() if x != state.version}):
            try:
                tensors = map_weights(await fetch_manifest(self.nc, v, timeout=5.0))
                out[v] = build_model(cfg, tensors, deterministic=self.config.deterministic)
            except NotFound:
                out[v] = None
        return out

    async def _checkpoint(self) -> float:
        state = self.state
        assert state is not None
        t0 = time.perf_counter()
        meta = {"run_id": self.config.run_id, "model": self.signature}
        path = journal.checkpoint_path(self.dir, state.step)
        await asyncio.to_thread(save_state, path, state, meta)
        await asyncio.to_thread(journal.prune, self.dir, self.config.keep_checkpoints)
        seconds = time.perf_counter() - t0
        self.checkpoint_step = state.step
        self.durable = set(state.trained)
        await self._publish(
            TrainerCheckpointed(
                step=state.step, version=state.version, trajectories=len(state.trained),
                seconds=round(seconds, 4), path=str(path),
            )
        )  # fmt: skip
        return seconds

    async def _ack_durable(self) -> None:
        for tid in [t for t in self.unacked if t in self.durable]:
            await _ack(self.unacked.pop(tid), self.log)

    async def _push(self, state: TrainState, base: int | None = None) -> None:
        """Push the state's weights as ``base + 1`` (default: ``state.version - 1``); while the
        store is unreachable, retry; adopt the store's number if it renumbered."""
        base = state.version - 1 if base is None else base
        weights = publishable_state_dict(state.model)
        while True:
            try:
                manifest = await push_weights(self.nc, weights, base, self.config.run_id)
                break
            except (BusUnavailable, Timeout) as exc:
                if self.stop_requested.is_set():
                    raise
                self.log.warning("push_retry", base_version=base, error=str(exc))
                await asyncio.sleep(0.5)  # the weight store is restarting: retry
        self.store_version = manifest.version
        if manifest.version != state.version:
            self.log.warning("version_renumbered", ours=state.version, store=manifest.version)
            state.version = manifest.version

    # --- status and stop ----------------------------------------------------------------------
    async def _on_status(self, _req: TrainerStatusRequest, _msg: Msg) -> TrainerStatus:
        state = self.state
        assert state is not None
        return TrainerStatus(
            step=state.step,
            version=state.version,
            checkpoint_step=self.checkpoint_step,
            trained=len(state.trained),
            held=len(self.held),
            refused=self.refused,
            group_size=self.config.group_size,
            batch_size=self.config.batch_size,
            replaying=len(self.plans),
            pid=os.getpid(),
            busy=not self.idle.is_set(),
        )

    async def drain(self) -> None:
        """Let a running step finish (its checkpoint and acks included), then stop serving."""
        try:
            await asyncio.wait_for(self.idle.wait(), self.drain_timeout_s)
        except TimeoutError:
            self.log.warning("drain_timeout", busy=True)
        await super().drain()

    async def _publish(self, event: EventBase) -> None:
        await events.publish(self.js, event)


def load_weights_file(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path), device="cpu")


def _save_reference(path: Path, state: TrainState) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_file(publishable_state_dict(state.model), str(tmp))
    os.replace(tmp, path)


async def _ack(msg: Msg, log: Any) -> None:
    try:
        await msg.ack()
    except nats.errors.Error as exc:  # redelivered later; dedup makes that harmless
        log.warning("ack_failed", error=repr(exc))


def _refusal(verdict: Verdict, s: Sample) -> str:
    if verdict is Verdict.STALE:
        return f"oldest weight version {s.oldest_version} is beyond the staleness bound"
    if verdict is Verdict.INVALID:
        return f"sample index {s.sample_index} outside the group"
    return f"group {s.group_id} already holds sample {s.sample_index}"


def _stale(s: Sample, version: int) -> str:
    return f"oldest weight version {s.oldest_version} too old for version {version}"


async def run(
    config: TrainerConfig, *, stop: asyncio.Event, ready: asyncio.Event | None = None
) -> None:
    """Run the trainer until ``stop`` (see ``TrainerService``)."""
    await run_service(TrainerService(config), stop=stop, ready=ready)
