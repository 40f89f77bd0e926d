"""The GRPO trainer on the bus: trajectories in (stream ``TRAJECTORIES``), weights out.

- **Consume.** A durable JetStream pull consumer (``consumer``) with explicit acks; every
  trajectory held — waiting for its group, or trained but not yet in a checkpoint — is marked
  ``in_progress`` every third of ``ack_wait_s``, so JetStream does not redeliver it while this
  trainer lives, and redelivers it to the next one if this one dies.
- **Batch.** ``core.Batcher``: whole groups, dedup by trajectory id (the ids a checkpoint
  records are never trained again), staleness. A malformed record is copied to the dead-letter
  subject (stream ``DEADLETTER``), acked and reported (``trajectory_refused``); training goes on.
- **Step.** ``train_step_started``, the batch's plan made durable (``journal``, with its
  count of tries), ``update.grpo_step`` in a thread (the event loop keeps heartbeating), a
  ``logprob_mismatch`` error event when training and inference disagree beyond the bound, the
  checkpoint every ``checkpoint_every`` steps (recording the step's ``train_step`` event as
  known before it), the push (version + 1, compare-and-set on the base), and only then the
  acks of every trajectory the checkpoint holds; ``train_step`` carries the step's metrics.
- **A failed update** (``_run_step``): trajectories failing on their own
  (``update.find_poison``) are dead-lettered with their groups, a one-off failure is retried, a
  batch failed ``step_attempts`` times is dead-lettered (``core.after_step_failure``); one that
  failed after moving the weights exits the trainer, which resumes from its checkpoint.
- **Ranks** (``--procs N``): the update runs data-parallel on N ranks (``ranks``, ``dp``); a
  rank lost stops the trainer (``RankLost``), and the restarted one resumes as below.
- **Resume.** From the latest checkpoint: its trained ids are dedup'd, a checkpoint whose push
  did not happen is pushed, planned steps after it are redone from the same trajectories
  (pushes the store already has are checked bit for bit, not repeated). The checkpoint's step's
  ``train_step`` is published again from its record (``republished``): a trainer killed after
  the checkpoint and before the event never published it, and has nothing left to redo.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import os
import time
from pathlib import Path
from typing import Any

import nats.errors
import torch
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from common import events, subjects
from common.codec import decode
from common.errors import (
    BelayerError,
    Conflict,
    FatalError,
    InvalidRequest,
)
from common.service import Service, run_service
from model.config import ModelConfig, load_model_config
from model.training import publishable_state_dict, read_meta, weights_sha256
from schemas.events import (
    EventBase,
    TrainerCheckpointed,
    TrainerResumed,
    TrainStepStarted,
    TrajectoryRefused,
)
from schemas.events_training import UpdateMetrics
from schemas.rollout import Trajectory
from schemas.trainer import TrainerStatus, TrainerStatusRequest
from schemas.weights import WeightManifest
from services.trainer import journal, records
from services.trainer.config import TrainerConfig
from services.trainer.core import (
    Batcher,
    FailureAction,
    Sample,
    StepFailure,
    Verdict,
    after_step_failure,
    validate_sample,
)
from services.trainer.journal import Plan
from services.trainer.ranks import RankLost, Ranks
from services.trainer.records import to_sample
from services.trainer.update import (
    TrainState,
    find_poison,
    grpo_step,
    load_state,
    load_weights_file,
    new_state,
    save_reference,
    save_state,
)
from services.weights.client import map_weights

FETCH_BATCH = 64
MAX_ACK_PENDING = 65_536
STEP_RETRY_S = 1.0
"""Pause before trying a failed update again (a one-off failure: the store restarting)."""


class _UpdateFailed(Exception):
    """A step's update failed before changing the train state (with the models it used)."""

    def __init__(self, error: Exception, generating: dict[int, Any]) -> None:
        super().__init__(f"{type(error).__name__}: {error}"[:500])
        self.generating = generating


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
        self.ranks: Ranks | None = None

    # --- start ----------------------------------------------------------------------------
    async def open(self) -> None:
        torch.set_num_threads(self.config.threads)
        self.device = self.config.resolved_device()  # cpu, or cuda (one line if unusable)
        self.dir.mkdir(parents=True, exist_ok=True)

    async def setup(self) -> None:
        manifest = await records.store_manifest(self.nc)
        self.model_cfg = await asyncio.to_thread(load_model_config, manifest.model_dir)
        self.signature = records.model_signature(manifest)
        await self._restore(manifest)
        if self.config.procs > 1:  # spawned from this (the main) thread: they die with it
            self.ranks = Ranks.spawn(self.config, self.model_cfg, self.dir)
            await asyncio.to_thread(self.ranks.join)
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

    async def _restore(self, manifest: WeightManifest) -> None:
        c, cfg = self.config, self.model_cfg
        assert cfg is not None
        ref_path = self.dir / journal.REFERENCE
        found = journal.latest_checkpoint(self.dir)
        if found is None:
            tensors = map_weights(manifest)
            state = await asyncio.to_thread(
                new_state, cfg, tensors, manifest.version, c.optim,
                deterministic=c.deterministic, with_reference=c.grpo.beta > 0, device=self.device,
            )  # fmt: skip
            if c.grpo.beta > 0:
                await asyncio.to_thread(save_reference, ref_path, state)
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
            load_state, path, cfg, c.optim, deterministic=c.deterministic,
            reference=self.reference, device=self.device,
        )  # fmt: skip
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
        # Killed between this checkpoint and the step's train_step, the trainer never published
        # it, and nothing is left to redo: publish it again (a duplicate when it was not lost).
        if (again := records.republished(meta, state.version)) is not None:
            self.log.info("train_step_republished", step=again.step, version=again.version)
            await self._publish(again)

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
        return await records.store_has(self.nc, version, publishable_state_dict(state.model))

    # --- consuming ----------------------------------------------------------------------------
    async def consume_loop(self) -> None:
        try:
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
        finally:
            await self._unsubscribe()

    async def _unsubscribe(self) -> None:
        """End the pull subscription when the loop ends (the durable consumer stays on the
        server; what this trainer held unacked is redelivered to the next one). A pull request
        left pending by a cancelled ``fetch`` is answered later, into a queue nobody reads: the
        connection's drain at exit would wait its whole timeout (5 s) on it."""
        with contextlib.suppress(nats.errors.Error, ValueError):
            await self.sub.unsubscribe()

    async def heartbeat_loop(self) -> None:
        """Keep every held trajectory from being redelivered while this trainer lives."""
        while True:
            await asyncio.sleep(self.config.ack_wait_s / 3)
            for msg in [*self.held.values(), *self.unacked.values()]:
                try:
                    await msg.in_progress()
                except nats.errors.Error as exc:
                    self.log.debug("in_progress_failed", error=repr(exc))

    async def ranks_loop(self) -> None:
        """With ``procs > 1``: a rank that exits stops the trainer (``RankLost``)."""
        if self.ranks is not None and (lost := await asyncio.to_thread(self.ranks.wait_lost)):
            raise RankLost(f"trainer {lost}: every rank stops, resume from the checkpoint")

    async def _on_message(self, msg: Msg) -> None:
        seq = msg.metadata.sequence.stream
        try:
            sample = to_sample(decode(msg.data, Trajectory), seq, self.config.temperature)
            assert self.model_cfg is not None
            validate_sample(sample, self.model_cfg.max_position_embeddings)
        except (BelayerError, ValueError) as exc:
            await self._dead_letter(msg, seq, str(exc))
            return
        state = self.state
        assert state is not None
        tid = sample.trajectory_id
        verdict = self.batcher.offer(sample, state.version)
        if verdict is Verdict.ACCEPTED:
            self.held[tid] = msg
        elif verdict is Verdict.TRAINED:
            if tid in self.durable:
                await records.ack(msg, self.log)
            else:
                self.unacked[tid] = msg
        elif verdict is Verdict.DUPLICATE and tid in self.held:
            self.held[tid] = msg  # a redelivery of a held one: keep the newest delivery
        else:
            await self._refuse(msg, tid, verdict.value, records.refusal(verdict, sample), seq)

    async def _dead_letter(self, msg: Msg, seq: int, error: str, reason: str = "malformed") -> None:
        """Copy the record to the dead-letter subject, then ack and refuse it (``reason``:
        ``malformed``, or why its update could not be trained — ``core.StepFailure``); a
        record whose copy failed is not acked: redelivered, it is tried again."""
        if await records.copy_to_dead_letter(self.js, msg, seq, error, reason, self.log):
            await self._refuse(msg, records.subject_id(msg), reason, error, seq)

    async def _refuse(self, msg: Msg, tid: str, reason: str, detail: str, seq: int) -> None:
        self.refused += 1
        await records.ack(msg, self.log)
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
                        msg, s.trajectory_id, "stale", records.stale(s, state.version), s.stream_seq
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
                replay = False
            await self._run_step(batch, plan, replay)

    async def _run_step(self, batch: list[Sample], plan: Plan, replay: bool) -> None:
        """The step, tried until it succeeds or ``core.after_step_failure`` drops what cannot be
        trained; tries are counted in the durable plan, so a batch trainers died on
        ``step_attempts`` times goes untried (looking for a culprit might kill this one too)."""
        c, state = self.config, self.state
        assert state is not None
        while True:
            plan = dataclasses.replace(plan, attempts=plan.attempts + 1)
            await asyncio.to_thread(journal.write_plan, self.dir, plan)
            failure, error = None, "the trainer exited during this batch's update"
            if plan.attempts > c.step_attempts:
                failure = after_step_failure(
                    batch, {}, attempts=plan.attempts - 1, max_attempts=c.step_attempts,
                    error=error,
                )  # fmt: skip
            else:
                try:
                    return await self._step(batch, plan, replay)
                except _UpdateFailed as failed:
                    error = str(failed)
                    culprits = await asyncio.to_thread(
                        find_poison, state, batch, group_size=c.group_size, grpo=c.grpo,
                        pad_id=c.pad_token_id, generating=failed.generating.get,
                    )  # fmt: skip
                    failure = after_step_failure(
                        batch, culprits, attempts=plan.attempts, max_attempts=c.step_attempts,
                        error=error,
                    )  # fmt: skip
                    self.log.error(
                        "train_step_failed", step=plan.step, attempt=plan.attempts, error=error,
                        step_attempts=c.step_attempts, action=failure.action.value,
                        culprits=culprits,
                    )  # fmt: skip
            if failure.action is not FailureAction.RETRY:
                return await self._drop(batch, plan, failure, error)
            if self.stop_requested.is_set():
                return  # the plan stays: the next trainer tries again
            await asyncio.sleep(STEP_RETRY_S)  # a one-off failure: try again shortly

    async def _drop(
        self, batch: list[Sample], plan: Plan, failure: StepFailure, error: str
    ) -> None:
        """Dead-letter what ``failure`` names, hold the rest again, and forget the step's
        plan (and any after it): the step is planned afresh with the next batch."""
        by_id = {s.trajectory_id: s for s in batch}
        for tid, reason, detail in failure.dead_letter:
            msg = self.held.pop(tid, None)
            if msg is not None:
                await self._dead_letter(msg, by_id[tid].stream_seq, detail, reason)
        self.batcher.give_back(by_id[t] for t in failure.keep)
        await asyncio.to_thread(journal.remove_plans_from, self.dir, plan.step)
        self.plans.clear()
        self.log.error(
            "batch_dropped", step=plan.step, attempts=plan.attempts, error=error,
            dead_lettered=len(failure.dead_letter), kept=len(failure.keep),
        )  # fmt: skip

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
            result = await self._update(batch, plan, state)
            for s in batch:
                msg = self.held.pop(s.trajectory_id, None)
                if msg is not None:
                    self.unacked[s.trajectory_id] = msg
            self.batcher.mark_trained(batch)
            # Deterministic mode promises bitwise agreement: any difference is an error.
            bound = 0.0 if c.deterministic else c.logprob_diff_bound
            if (mismatch := records.logprob_mismatch(result, plan.base_version, bound)) is not None:
                self.log.error("logprob_mismatch", step=result.step,
                               diff_max=result.logprob_diff_max, bound=bound)  # fmt: skip
                await self._publish(mismatch)
            if c.hold_before_checkpoint_s:
                await asyncio.sleep(c.hold_before_checkpoint_s)  # failure-injection window
            at_end = bool(c.max_steps) and state.step >= c.max_steps
            checkpointed = state.step % c.checkpoint_every == 0 or at_end
            digest = await asyncio.to_thread(weights_sha256, publishable_state_dict(state.model))
            event = functools.partial(
                records.train_step, result, checkpointed=checkpointed, replay=replay,
                weights_sha256=digest, batch_sha256=records.batch_sha256(batch),
            )  # fmt: skip
            checkpoint_s = push_s = 0.0
            if checkpointed:
                # The event as known now goes into the checkpoint: a trainer killed before
                # publishing it publishes it again when it resumes from there (``_restore``).
                known = event(version=state.version, checkpoint_s=0.0, push_s=0.0,
                              step_s=time.perf_counter() - t0)  # fmt: skip
                checkpoint_s = await self._checkpoint(records.checkpoint_record(known))
                if c.hold_after_checkpoint_s:
                    await asyncio.sleep(c.hold_after_checkpoint_s)  # failure-injection window
            t_push = time.perf_counter()
            await self._push_step(state)
            push_s = time.perf_counter() - t_push
            if checkpointed:
                await self._ack_durable()
        finally:
            self.idle.set()
        metrics = event(
            version=state.version, checkpoint_s=checkpoint_s, push_s=push_s,
            step_s=time.perf_counter() - t0,
        )  # fmt: skip
        self.log.info("train_step", **events.fields(metrics))
        await self._publish(metrics)

    async def _push_step(self, state: TrainState) -> None:
        """Push a step's weights; a redone step's version the store already has is checked bit
        for bit instead (pushed again, renumbered, if it differs)."""
        if state.version > self.store_version:
            await self._push(state)
        elif not await self._store_has(state.version, state):
            self.log.error("replay_diverged", step=state.step, version=state.version)
            await self._push(state, base=self.store_version)

    async def _update(self, batch: list[Sample], plan: Plan, state: TrainState) -> UpdateMetrics:
        """``update.grpo_step`` in a thread; ``_UpdateFailed`` if it fails before changing
        ``state`` (it can be tried again), ``FatalError`` after (exit, resume the checkpoint)."""
        c = self.config
        generating = await records.generating_models(
            self.nc, self.model_cfg, batch, state.version,
            deterministic=c.deterministic, stopping=self.stop_requested,
        )  # fmt: skip
        lr_steps, step = state.scheduler.last_epoch, state.step
        update = self.ranks.grpo_step if self.ranks is not None else grpo_step
        try:
            result: UpdateMetrics = await asyncio.to_thread(
                update, state, batch, group_size=c.group_size, grpo=c.grpo, optim=c.optim,
                pad_id=c.pad_token_id, generating=generating.get,
            )  # fmt: skip
        except FatalError:
            raise  # a rank lost: exit, the next trainer resumes from the checkpoint
        except Exception as exc:  # any failure of the update: core.after_step_failure decides
            if state.scheduler.last_epoch != lr_steps or state.step != step:
                raise FatalError(
                    f"step {plan.step}'s update failed after it moved the weights ({exc!r}); "
                    "resuming from the checkpoint",
                    step=plan.step,
                ) from exc
            raise _UpdateFailed(exc, generating) from exc
        return result

    async def _checkpoint(self, train_step: dict[str, Any] | None = None) -> float:
        """Write the checkpoint of the current step (with the record of its ``train_step``
        event, ``records.checkpoint_record``; none for step 0's); its seconds."""
        state = self.state
        assert state is not None
        t0 = time.perf_counter()
        meta: dict[str, Any] = {"run_id": self.config.run_id, "model": self.signature}
        if train_step is not None:
            meta[records.TRAIN_STEP_META] = train_step
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
            await records.ack(self.unacked.pop(tid), self.log)

    async def _push(self, state: TrainState, base: int | None = None) -> None:
        """Push the state's weights as ``base + 1`` (default: ``state.version - 1``); while the
        store is unreachable, retry; adopt the store's number if it renumbered."""
        base = state.version - 1 if base is None else base
        weights = publishable_state_dict(state.model)
        manifest = await records.push_retrying(
            self.nc, weights, base, self.config.run_id, self.stop_requested, self.log
        )
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

    async def close(self) -> None:
        if self.ranks is not None:
            await asyncio.to_thread(self.ranks.close)

    async def _publish(self, event: EventBase) -> None:
        await events.publish(self.js, event)


async def run(
    config: TrainerConfig, *, stop: asyncio.Event, ready: asyncio.Event | None = None
) -> None:
    """Run the trainer until ``stop`` (see ``TrainerService``)."""
    await run_service(TrainerService(config), stop=stop, ready=ready)
