"""Router: adapts ``RouterCore`` to the bus.

Inputs: ``router.generate`` (callers), ``router.register`` (workers), ``router.tokens`` (step
batches), ``router.cancel``, ``router.status``. Outputs: replies streamed to callers' inboxes,
submits to ``engine.<id>.generate``, token-log chunks on JetStream (deterministic msg ids),
events. All core calls happen on the event loop thread, so the core needs no locks.
"""

from __future__ import annotations

import asyncio
import random
import secrets
import time
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import msgspec
from nats.aio.msg import Msg

from common import subjects
from common.bus import request
from common.codec import decode, encode
from common.epoch import current_epoch
from common.errors import (
    BelayerError,
    Conflict,
    EngineUnavailable,
    InvalidRequest,
    NotFound,
    Overloaded,
    ResourceLimit,
)
from common.guard import isolated
from common.service import Service, run_service
from common.tasks import keep
from model.tokenizer import load_tokenizer
from schemas.base import Ok
from schemas.events import RegistrationRejected, RequestsResumed, StaleFailureReport
from schemas.serving import (
    AcceptedRequest,
    CancelRequest,
    EngineAbort,
    EngineFailed,
    EngineSubmit,
    GenerateRequest,
    RegisterReply,
    RegisterWorker,
    RouterStatus,
    SamplingParams,
    StatusRequest,
    StepBatch,
)
from services.router.config import RouterConfig
from services.router.core import RouterCore
from services.router.liveness import ping_engine
from services.router.persist import Persistable, persist
from services.router.recovery import LiveEngine, held_requests, live_engines, restore_from_log
from services.router.resume_clock import ResumeClock
from services.router.state import (
    AbortOnEngine,
    Action,
    EmitEvent,
    EngineStatus,
    SendToCaller,
    SubmitToEngine,
    request_identity,
)

M = TypeVar("M")

GENERATE_OVERHEAD_BYTES = 64 * 1024
"""A ``GenerateRequest``'s bytes besides its prompt text (ids, sampling, token ids of a
``max_prompt_tokens`` prompt): ``router.generate`` refuses larger messages unread."""


class RouterService(Service[RouterConfig]):
    """The router process. ``setup``: restore from the durable logs, find the live workers and
    adopt what they still run, then serve. Loops: ``persist_loop`` (the ordered writer) and
    ``heartbeat_loop``. On stop the subjects drain, then queued token-log chunks reach
    JetStream (bounded) before the loops end."""

    name = "router"
    drain_timeout_s = 2.0
    persist_drain_s = 3.0
    """Longest wait for the persist queue when draining."""

    def __init__(self, config: RouterConfig) -> None:
        super().__init__(config)
        self.tokenizer = load_tokenizer(config.model_dir)
        self.core = RouterCore(config, decode=self.tokenizer.text, router_id=secrets.token_hex(6))
        self.persist_q: asyncio.Queue[Persistable] = asyncio.Queue()
        self.tasks: set[asyncio.Task[None]] = set()
        self.stash: list[StepBatch] | None = None
        """Step batches received while adopting a live worker's requests (None otherwise)."""
        self.silent: set[str] = set()
        """Engines with a claimed epoch whose worker has not answered a discovery ping yet."""
        self.resume_clock = ResumeClock()
        """Times each resumed request's first new token (``resumed_first_token``)."""

    async def setup(self) -> None:
        self.stash = []  # before the first step batch can arrive
        await self.nc.subscribe(subjects.router_tokens(), cb=self.on_tokens)
        await restore_from_log(
            self.js, self.core, timeout_s=self.config.restore_timeout_s, log=self.log
        )
        await self.discover(self.config.engine_ids)
        await self.server.serve(
            subjects.router_generate(),
            GenerateRequest,
            self.on_generate,
            max_bytes=self.config.limits.max_prompt_bytes + GENERATE_OVERHEAD_BYTES,
        )
        await self.server.serve(subjects.router_register(), RegisterWorker, self.on_register)
        await self.server.serve(subjects.router_cancel(), CancelRequest, self.on_cancel)
        await self.server.serve(subjects.router_status(), StatusRequest, self.on_status)
        await self.server.serve(
            subjects.router_engine_failed(), EngineFailed, self.on_engine_failed
        )
        self.log.info("router_ready", recovery=self.config.recovery, k=self.config.token_log_chunk)

    async def drain(self) -> None:
        await super().drain()
        # Let queued token-log chunks reach JetStream before leaving (bounded).
        try:
            await asyncio.wait_for(self.persist_q.join(), self.persist_drain_s)
        except TimeoutError:
            self.log.warning("persist_queue_not_drained", left=self.persist_q.qsize())

    # --- action execution -------------------------------------------------------------------
    async def execute(self, actions: list[Action]) -> None:
        for a in actions:
            if isinstance(a, SendToCaller):
                # Tokens and results reach callers in the order of the token log's writes (the
                # persist queue): a token goes out only after the chunks before its own are
                # durable, and a result only after its final chunk, so a restarted router
                # re-sends at most k tokens and never runs a request it has replied to again.
                self.persist_q.put_nowait(a)
            elif isinstance(a, SubmitToEngine):
                self._spawn(self._submit(a))
            elif isinstance(a, AbortOnEngine):
                msg = EngineAbort(engine_id=a.engine_id, epoch=a.epoch, request_ids=a.request_ids)
                await self.nc.publish(subjects.engine_abort(a.engine_id), encode(msg))
            else:
                if isinstance(a, EmitEvent):
                    self._time_resume(a)
                self.persist_q.put_nowait(a)

    def _time_resume(self, a: EmitEvent) -> None:
        held: dict[str, int] = {}
        if isinstance(a.event, RequestsResumed):
            active = self.core.active
            held = {r: len(active[r].tokens) for r in a.event.request_ids if r in active}
        self.resume_clock.on_event(a.event, time.monotonic(), held)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        async def guarded() -> None:
            with isolated(self.log, "router_task", task=getattr(coro, "__qualname__", "")):
                await coro

        keep(self.tasks, asyncio.create_task(guarded()))

    async def _submit(self, a: SubmitToEngine) -> None:
        msg = EngineSubmit(engine_id=a.engine_id, epoch=a.epoch, requests=a.requests)
        ids = [r.request_id for r in a.requests]
        try:
            await request(
                self.nc,
                subjects.engine_generate(a.engine_id),
                msg,
                Ok,
                timeout=self.config.submit_timeout_s,
            )
        except EngineUnavailable as exc:
            # Its queue is full (work that did not come from this router): place elsewhere.
            self.log.info("submit_refused", engine=a.engine_id, requests=len(ids), error=str(exc))
            await self.execute(self.core.submit_refused(a.engine_id, a.epoch, ids))
        except (ResourceLimit, InvalidRequest) as exc:
            # The worker refuses the requests themselves: they fail, the engine is fine.
            self.log.warning("submit_rejected", engine=a.engine_id, error=str(exc))
            await self.execute(self.core.submit_rejected(a.engine_id, ids, str(exc)))
        except BelayerError as exc:
            # The worker is gone or wedged: the engine is down until its next worker registers
            # (which resumes these requests) or it is marked unhealthy.
            self.log.warning("submit_failed", engine=a.engine_id, epoch=a.epoch, error=str(exc))
            eng = self.core.engines.get(a.engine_id)
            if eng is not None and eng.epoch == a.epoch:
                await self.execute(
                    self.core.engine_failed(a.engine_id, time.monotonic(), reason="submit failed")
                )

    async def persist_loop(self) -> None:
        """Accepted requests, token-log chunks, events, deltas and results, in order (``persist``)."""
        while True:
            item = await self.persist_q.get()
            try:
                with isolated(self.log, "persist_loop", item=type(item).__name__):
                    await persist(self.nc, self.js, item, self.log)  # a bad item is dropped
            finally:
                self.persist_q.task_done()

    # --- handlers ---------------------------------------------------------------------------
    async def on_generate(self, req: GenerateRequest, msg: Msg) -> None:
        if (req.prompt is None) == (req.prompt_token_ids is None):
            raise InvalidRequest("give exactly one of prompt / prompt_token_ids", field="$.prompt")
        limits = self.config.limits
        if req.prompt is not None and len(req.prompt) > limits.max_prompt_bytes // 4:
            size = len(req.prompt.encode("utf-8", "surrogatepass"))
            if size > limits.max_prompt_bytes:  # bounded before any tokenizing
                raise ResourceLimit(
                    "prompt too long", field="$.prompt", bytes=size, limit=limits.max_prompt_bytes
                )
        fresh_id = (
            req.request_id not in self.core.active and req.request_id not in self.core.finished
        )
        if fresh_id and len(self.core.active) >= self.config.max_requests:
            raise Overloaded(
                "the router holds its most requests; retry later", limit=self.config.max_requests
            )
        ids = (
            req.prompt_token_ids
            if req.prompt_token_ids is not None
            else self.tokenizer.encode(req.prompt or "")
        )
        vocab = self.tokenizer.vocab_size
        if any(t >= vocab for t in ids):
            raise InvalidRequest(
                "token id out of vocabulary", field="$.prompt_token_ids", vocab_size=vocab
            )
        fresh = req.request_id not in self.core.active and req.request_id not in self.core.finished
        sampling = req.sampling
        identity = request_identity(ids, req.sampling)
        if fresh:
            self.core.validate(ids, sampling, req.engine_id)
            if sampling.seed is None:
                # Every request gets a seed: token j then depends only on (seed, j, logits), so
                # any regeneration after a failure reproduces exactly what the caller saw.
                sampling = msgspec.structs.replace(sampling, seed=random.getrandbits(31))
            # Durable copy via the ordered persist queue: placement does not wait for the
            # JetStream ack, and the result cannot overtake it (same FIFO queue).
            self.persist_q.put_nowait(self._accepted(req, ids, sampling, msg.reply))
        await self.execute(
            self.core.submit(
                req.request_id,
                ids,
                sampling,
                inbox=msg.reply or None,
                stream=req.stream,
                engine_id=req.engine_id,
                identity=identity,
            )
        )
        return None

    def _accepted(
        self, req: GenerateRequest, ids: list[int], sampling: SamplingParams, reply: str
    ) -> AcceptedRequest:
        return AcceptedRequest(
            request_id=req.request_id,
            prompt_token_ids=ids,
            sampling=sampling,
            reply_to=reply or None,
            engine_id=req.engine_id,
            accepted_at=time.time(),
            seed_filled=req.sampling.seed is None,
        )

    async def on_register(self, req: RegisterWorker, _msg: Msg) -> RegisterReply:
        # Only one of the node's engines, only the worker that won the epoch compare-and-set,
        # and only a live process that answers the engine's ping as that worker.
        if req.engine_id not in self.config.engine_ids:
            raise NotFound(
                "not an engine of this node",
                engine_id=req.engine_id,
                engines=",".join(self.config.engine_ids),
            )
        claimed, _ = await current_epoch(self.js, req.engine_id)
        if req.epoch != claimed:
            rejected = RegistrationRejected(
                engine_id=req.engine_id, epoch=req.epoch, claimed_epoch=claimed, pid=req.pid
            )
            await self.execute([EmitEvent(rejected)])
            raise Conflict(
                "epoch was not claimed by this worker",
                engine_id=req.engine_id,
                epoch=req.epoch,
                claimed_epoch=claimed,
            )
        pong = await ping_engine(
            self.nc,
            req.engine_id,
            pid=req.pid,
            epoch=req.epoch,
            timeout=self.config.heartbeat_timeout_s,
        )
        if pong is None:
            raise Conflict(
                "the registering worker does not answer its engine's ping",
                engine_id=req.engine_id,
                epoch=req.epoch,
                pid=req.pid,
            )
        actions = self.core.register(
            req.engine_id,
            req.epoch,
            req.pid,
            device=req.device,
            max_num_seqs=req.max_num_seqs,
            weight_version=req.weight_version,
            now=time.monotonic(),
        )
        self.silent.discard(req.engine_id)
        await self.execute(actions)
        resumed = sum(len(a.requests) for a in actions if isinstance(a, SubmitToEngine))
        self.log.info(
            "engine_registered",
            engine=req.engine_id,
            epoch=req.epoch,
            pid=req.pid,
            resumed=resumed,
        )
        return RegisterReply(engine_id=req.engine_id, epoch=req.epoch, resumed_requests=resumed)

    async def on_engine_failed(self, req: EngineFailed, _msg: Msg) -> Ok:
        eng = self.core.engines.get(req.engine_id)
        if eng is None:
            raise NotFound("unknown engine", engine_id=req.engine_id)
        if req.epoch == eng.epoch and req.pid and req.pid != eng.worker_pid:
            raise Conflict(
                "failure report for a worker this engine does not run",
                engine_id=req.engine_id,
                epoch=req.epoch,
                pid=req.pid,
                worker_pid=eng.worker_pid,
            )
        if req.epoch > eng.epoch:
            raise Conflict(
                "failure report for an epoch the router never saw",
                engine_id=req.engine_id,
                epoch=req.epoch,
                current_epoch=eng.epoch,
            )
        if req.epoch < eng.epoch:
            stale = StaleFailureReport(
                engine_id=req.engine_id, epoch=req.epoch, current_epoch=eng.epoch, pid=req.pid
            )
            await self.execute([EmitEvent(stale)])
            return Ok(detail="stale epoch: already replaced")
        await self.execute(
            self.core.engine_failed(
                req.engine_id, time.monotonic(), reason=req.reason or "reported", epoch=req.epoch
            )
        )
        return Ok()

    async def on_tokens(self, msg: Msg) -> None:
        try:
            batch = decode(msg.data, StepBatch)
        except BelayerError as exc:
            self.log.warning("bad_step_batch", error=str(exc))
            return
        if self.stash is not None:
            self.stash.append(batch)  # adopting after a restart: replayed once adoption is done
            return
        with isolated(self.log, "on_tokens", engine=batch.engine_id, step=batch.step):
            actions = self.core.on_step(batch)
            first = self.resume_clock.on_step(batch, time.monotonic())
            await self.execute(actions + ([EmitEvent(first)] if first else []))

    async def on_cancel(self, req: CancelRequest, _msg: Msg) -> Ok:
        await self.execute(self.core.cancel(req.request_id))
        return Ok(detail=req.request_id)

    async def on_status(self, req: StatusRequest, _msg: Msg) -> RouterStatus:
        core = self.core
        return RouterStatus(
            engines=core.engine_infos(), inflight=len(core.active), finished=len(core.finished),
            token_log_chunk=self.config.token_log_chunk, metrics=core.metrics(),
            router_id=core.router_id,
            request=core.request_state(req.request_id) if req.request_id else "",
        )  # fmt: skip

    # --- discovery after a restart ----------------------------------------------------------
    async def discover(self, engine_ids: Sequence[str]) -> None:
        """Register the live workers of ``engine_ids`` (a worker registers only at its start, so
        a restarted router finds them through the epoch bucket and a ping) and adopt the
        restored requests they still run, so nothing is generated again while they live; then
        place what no worker holds. Step batches that arrive meanwhile are stashed and replayed
        after (placement by index drops what overlaps). A worker that does not answer is tried
        again by the heartbeat loop."""
        if self.stash is None:
            self.stash = []
        self.core.hold_pending = True
        try:
            live, silent = await live_engines(
                self.nc, self.js, engine_ids, timeout_s=self.config.heartbeat_timeout_s
            )
            self.silent.difference_update(engine_ids)
            self.silent.update(silent)
            for found in live:
                with isolated(self.log, "discover", engine=found.engine_id):
                    await self._adopt_engine(found)
        finally:
            stashed, self.stash = self.stash, None
            for batch in stashed or []:
                await self.execute(self.core.on_step(batch))
            await self.execute(self.core.release_pending())
        if silent or live:
            self.log.info(
                "engines_discovered",
                live=[f.engine_id for f in live],
                silent=silent,
                left_to_resubmit=len(self.core.pending),
            )

    async def _adopt_engine(self, found: LiveEngine) -> None:
        eng = self.core.engines.get(found.engine_id)
        if eng is not None and eng.epoch >= found.epoch:
            return  # its worker registered meanwhile
        pong = found.pong
        await self.execute(
            self.core.register(
                found.engine_id, found.epoch, pong.pid, weight_version=pong.weight_version
            )
        )
        await self.execute(
            self.core.report_load(
                found.engine_id, found.epoch, pong.pid, pong.running, pong.waiting
            )
        )
        self.log.info(
            "engine_rediscovered", engine=found.engine_id, epoch=found.epoch, pid=pong.pid
        )
        waiting = [r for r in self.core.pending if r in self.core.active]
        if not waiting:
            return
        try:
            reply = await held_requests(self.nc, found.engine_id, waiting, timeout_s=2.0)
        except BelayerError as exc:
            self.log.warning("engine_state_failed", engine=found.engine_id, error=str(exc))
            return
        if reply.epoch == found.epoch:
            await self.execute(
                self.core.adopt(found.engine_id, reply.requests, reply.weight_version)
            )

    # --- remote heartbeat -------------------------------------------------------------------
    async def heartbeat_loop(self) -> None:
        """Ping every engine's registered worker each interval. An up engine whose worker does
        not answer has failed (the baseline's detector); a down engine whose worker answers
        was a false alarm (say, a submit acknowledged too late on a loaded machine) and comes
        back up. The replies' counts keep placement on the workers' own view of their load."""
        cfg = self.config
        while True:
            await asyncio.sleep(cfg.heartbeat_interval_s)
            if self.silent:
                with isolated(self.log, "heartbeat_loop", engines=sorted(self.silent)):
                    await self.discover(sorted(self.silent))
            # One engine's failure is logged (loop_item_failed); the others are still pinged.
            for eng in list(self.core.engines.values()):
                with isolated(self.log, "heartbeat_loop", engine=eng.id):
                    if eng.status is EngineStatus.UNHEALTHY:
                        continue
                    epoch, pid = eng.epoch, eng.worker_pid
                    pong = await ping_engine(
                        self.nc, eng.id, pid=pid, epoch=epoch, timeout=cfg.heartbeat_timeout_s
                    )
                    if pong is None:
                        if eng.status is EngineStatus.UP and eng.epoch == epoch:
                            self.log.warning(
                                "heartbeat_missed", engine=eng.id, epoch=epoch, pid=pid
                            )
                            await self.execute(
                                self.core.engine_failed(
                                    eng.id, time.monotonic(), reason="heartbeat", epoch=epoch
                                )
                            )
                        continue
                    if eng.status is EngineStatus.DOWN:
                        await self.execute(self.core.engine_recovered(eng.id, pong.epoch, pong.pid))
                    await self.execute(
                        self.core.report_load(eng.id, epoch, pid, pong.running, pong.waiting)
                    )
                    await self._watch(eng.id)

    async def _watch(self, engine_id: str) -> None:
        """The stall watchdog (``watchdog.py``): ask the worker for its copies of the requests
        that got no token since the previous heartbeat, and let the core act on them."""
        stalled = self.core.stalled(engine_id)
        if not stalled:
            return
        try:
            reply = await held_requests(
                self.nc, engine_id, stalled, timeout_s=self.config.heartbeat_timeout_s
            )
        except BelayerError as exc:
            self.log.warning("engine_state_failed", engine=engine_id, error=str(exc))
            return
        await self.execute(
            self.core.reconcile(
                engine_id, reply.epoch, stalled, reply.requests, reply.weight_version
            )
        )


async def run(
    config: RouterConfig, *, stop: asyncio.Event, ready: asyncio.Event | None = None
) -> None:
    """Run the router until ``stop`` (see ``RouterService``)."""
    await run_service(RouterService(config), stop=stop, ready=ready)
