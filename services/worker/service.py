"""Rollout worker: the engine on mapped weights + arena, adapted to the bus.

Start-up is split so a shadow can do the slow part ahead of time:
``prepare`` (map weights and arena from their services, build and warm the engine), then
``claim`` (claim the engine epoch by compare-and-set, then flush the KV arena under exactly
that epoch) and ``serve_engine`` (start the scheduling loop, serve the engine's subjects,
register with the router); ``activate`` is the two together.

The worker trusts no submit on its own: it applies the node's ``ServingLimits`` (the router's)
to every request and bounds what it holds, so work that bypassed the router can neither exceed
the limits nor queue without end; its step batches report its own counts, by which the router
places.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import torch
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from common import events, subjects
from common.bus import Server, request
from common.codec import decode, encode
from common.device import resolve_device
from common.epoch import claim_epoch
from common.errors import (
    BelayerError,
    Conflict,
    EngineUnavailable,
    FatalError,
    InvalidRequest,
    Timeout,
)
from common.fastpub import FastPublisher
from common.heartbeat import Identity, write_identity
from common.limits import check_request
from common.logging import get_logger
from common.service import Service
from model.config import load_model_config
from model.loader import load_safetensors
from schemas.base import Ok
from schemas.events import WeightsUpdated, WorkerReady, WorkerWeightsSwapped
from schemas.serving import (
    EngineAbort,
    EngineStateReply,
    EngineStateRequest,
    EngineSubmit,
    HeldRequest,
    Ping,
    PingReply,
    RegisterReply,
    RegisterWorker,
    SeqDelta,
    StepBatch,
)
from schemas.weights import WeightManifest
from services.kv.client import fetch_arena, flush_arena, map_arena
from services.weights.client import current_manifest, fetch_manifest, map_weights
from services.worker.backends import build_engine
from services.worker.config import WorkerConfig
from services.worker.engine.backend import EngineBackend, check_backend
from services.worker.runtime import Abort, EngineLoop, Snapshot, Submit, SwapWeights

MIRROR_TIMEOUT_S = 120.0
"""How long an engine host's weight store may take to mirror a version a worker asks for."""
REFRESH_RETRY_S = 1.0
"""Pause before a failed weight refresh asks again (``Worker._fetch_newer``)."""


class Worker:
    """What a rollout worker process does with its engine — prepare, claim, serve, follow the
    weights — whether it runs as the main worker (``WorkerService``) or as the standby that
    takes over (``services/worker/shadow.py``). It serves on its service's ``server``."""

    def __init__(
        self, config: WorkerConfig, nc: NATS, js: JetStreamContext, server: Server
    ) -> None:
        self.config = config
        self.nc = nc
        self.js = js
        self.engine_id = config.engine_id
        self.pid = os.getpid()
        self.epoch = 0
        self.weight_version = 0
        self.engine: EngineBackend | None = None
        self.device = "cpu"
        """The resolved ``config.device`` (``cpu`` or ``cuda``)."""
        self.loop: EngineLoop | None = None
        self.server = server
        self.timings: dict[str, float] = {}
        self.publisher: FastPublisher | None = None
        self.role: str = config.role
        """``shadow`` until this process takes over its engine, then ``main``."""
        self.log = get_logger(engine=config.engine_id, pid=self.pid, role=config.role)

    # --- phase 1: prepare (slow; a shadow does it ahead of time) -----------------------------
    async def prepare(self) -> None:
        try:  # a device or backend this machine lacks: one line, before anything is mapped
            self.device = resolve_device(self.config.device)
            check_backend(self.config.engine_backend, self.device)
        except ValueError as exc:
            raise FatalError(str(exc)) from None
        t0 = time.perf_counter()
        wait = self.config.owner_restart_wait_s
        manifest = await fetch_manifest(
            self.nc, timeout=10.0, host=self.config.host, restart_wait_s=wait
        )
        if self.config.cold_load_dir:
            # Baseline: a cold restart reads the weights from disk, as engines do today.
            params = load_safetensors(self.config.cold_load_dir)
        else:
            params = map_weights(manifest)
        arena_desc = await fetch_arena(
            self.nc, self.engine_id, timeout=10.0, host=self.config.host, restart_wait_s=wait
        )
        kv_cache = map_arena(arena_desc)
        t_attach = time.perf_counter()
        model_config = load_model_config(manifest.model_dir)
        # The arena owns the KV geometry; every other engine knob is the worker's config.
        engine_config = dataclasses.replace(
            self.config.engine,
            block_size=arena_desc.block_size,
            num_blocks=arena_desc.num_blocks,
        )
        try:
            self.engine = build_engine(
                self.config.engine_backend,
                model_config,
                params,
                kv_cache,
                engine_config,
                device=self.device,
                model_dir=manifest.model_dir,
            )
        except ValueError as exc:  # e.g. deterministic mode asked of the engine on cuda
            raise FatalError(str(exc)) from None
        self.engine.warmup()
        self.weight_version = manifest.version
        t_ready = time.perf_counter()
        self.timings = {"attach_s": t_attach - t0, "build_warm_s": t_ready - t_attach}
        self.log.info("worker_prepared", weight_version=manifest.version, **self.timings)

    # --- phase 2: claim, then serve (fast) --------------------------------------------------
    async def activate(
        self, *, expected_epoch: int | None = None, on_ready: Callable[[], None] | None = None
    ) -> int:
        """Claim the engine, start serving and register. Returns the new epoch."""
        epoch = await self.claim(expected_epoch=expected_epoch, flush_timeout=10.0)
        await self.serve_engine(on_ready=on_ready)
        return epoch

    async def claim(self, *, expected_epoch: int | None = None, flush_timeout: float) -> int:
        """Advance the engine's epoch by compare-and-set (``Conflict`` if it is not
        ``expected_epoch`` or another worker wins), then zero the KV arena under exactly that
        epoch: the arena takes one flush per epoch, only the claimed one, so once this worker
        uses it nobody can wipe it. Returns the new epoch."""
        assert self.engine is not None, "prepare() first"
        self.epoch = await claim_epoch(self.js, self.engine_id, expected=expected_epoch)
        self.role = "main"
        self.log = self.log.bind(epoch=self.epoch, role="main")
        await flush_arena(
            self.nc, self.engine_id, self.epoch, timeout=flush_timeout, host=self.config.host
        )
        return self.epoch

    async def serve_engine(self, *, on_ready: Callable[[], None] | None = None) -> None:
        """Start the scheduling loop under the claimed epoch, serve the engine's subjects and
        register with the router. ``on_ready`` is called once the loop runs and the subjects
        are served (before registering)."""
        assert self.engine is not None and self.epoch, "claim() first"
        hb = Path(self.config.heartbeat_file) if self.config.heartbeat_file else None
        if hb is not None:
            write_identity(hb, Identity(self.pid, self.epoch, self.engine_id))
        # Step batches leave from the engine thread itself over a publish-only connection: no
        # thread hop and no event-loop turns per step (see common/fastpub.py).
        self.publisher = FastPublisher(
            self.config.nats_url, name=f"worker-{self.engine_id}-steps", bus=self.config.bus
        )
        subject = subjects.router_tokens()
        publisher = self.publisher

        def on_batch(step: int, deltas: list[SeqDelta]) -> None:
            running, waiting = self.loop.load if self.loop is not None else (-1, -1)
            batch = StepBatch(
                engine_id=self.engine_id,
                epoch=self.epoch,
                worker_pid=self.pid,
                step=step,
                weight_version=self.weight_version,
                deltas=deltas,
                running=running,
                waiting=waiting,
            )
            publisher.publish(subject, encode(batch))

        self.loop = EngineLoop(
            self.engine,
            on_batch=on_batch,
            heartbeat_file=hb,
            idle_turn_s=self.config.idle_turn_s,
            on_turn=publisher.poll,
        )
        self.loop.start()
        await self.server.serve(
            subjects.engine_generate(self.engine_id), EngineSubmit, self._on_submit
        )
        await self.server.serve(  # the router publishes aborts without waiting for a reply
            subjects.engine_abort(self.engine_id), EngineAbort, self._on_abort, reply_required=False
        )
        await self.server.serve(subjects.engine_ping(self.engine_id), Ping, self._on_ping)
        await self.server.serve(
            subjects.engine_state(self.engine_id), EngineStateRequest, self._on_state
        )
        if on_ready is not None:
            on_ready()
        await self.register()

    # --- weight refresh ---------------------------------------------------------------------
    async def watch_weights(self) -> None:
        """Follow the weight store: on each ``weights_updated`` event — a hint, which anyone
        may publish — read the version the store itself marks current (KV ``weight_version``)
        and switch to it between steps if it is newer (a shadow's idle engine switches at
        once), so the trainer's pushes reach every worker without a restart."""

        async def on_event(msg: Msg) -> None:
            try:
                hinted = decode(msg.data, WeightsUpdated).version
            except BelayerError:
                return
            current = await current_manifest(self.js)
            if current is None or current.version != hinted:
                self.log.warning(
                    "weights_event_not_current",
                    version=hinted,
                    current=current.version if current else None,
                )
            if current is not None and current.version > self.weight_version:
                await self.refresh_weights(current.version)

        await self.nc.subscribe(events.subject(WeightsUpdated), cb=on_event)
        # A push may have landed while this worker prepared (on an engine host: the node's
        # current version, which its local store mirrors when asked for it).
        if self.config.host:
            node_current = await current_manifest(self.js)
            latest_version = node_current.version if node_current is not None else 0
        else:
            wait = self.config.owner_restart_wait_s
            latest_version = (
                await fetch_manifest(self.nc, timeout=5.0, restart_wait_s=wait)
            ).version
        if latest_version > self.weight_version:
            await self.refresh_weights(latest_version)

    async def refresh_weights(self, version: int) -> None:
        assert self.engine is not None
        fetched = await self._fetch_newer(version)
        if fetched is None:
            return
        manifest, params = fetched
        t0 = time.perf_counter()

        def swapped() -> None:
            self.weight_version = manifest.version

        if self.loop is None:  # shadow: the engine is idle, switch now
            self.engine.load_weights(params)
            swapped()
        else:
            fut: Future[None] = Future()
            self.loop.submit(SwapWeights(params, swapped, fut))
            await asyncio.wait_for(asyncio.wrap_future(fut), 30.0)
        self.log.info(
            "weights_swapped", version=manifest.version, seconds=round(time.perf_counter() - t0, 4)
        )
        await events.publish(
            self.js,
            WorkerWeightsSwapped(
                source=f"{'shadow' if self.role == 'shadow' else 'worker'}:{self.engine_id}",
                engine_id=self.engine_id,
                version=manifest.version,
                pid=self.pid,
                role=self.role,
            ),
        )

    async def _fetch_newer(
        self, version: int
    ) -> tuple[WeightManifest, dict[str, torch.Tensor]] | None:
        """The manifest of ``version`` and its tensors, asked again while that fails — a store
        killed between receiving the request and answering it, a version collected meanwhile
        — for the store's current version, as long as that is newer than this engine's, for
        at most ``owner_restart_wait_s``; None when there is nothing newer or the time is up."""
        deadline = time.monotonic() + self.config.owner_restart_wait_s
        while True:
            try:
                # An engine host's store first mirrors a version it lacks: it may take longer.
                manifest = await fetch_manifest(
                    self.nc,
                    version=version,
                    timeout=MIRROR_TIMEOUT_S if self.config.host else 5.0,
                    host=self.config.host,
                    restart_wait_s=self.config.owner_restart_wait_s,
                )
                return manifest, map_weights(manifest)
            except BelayerError as exc:
                self.log.warning("weights_refresh_failed", version=version, error=str(exc))
            if time.monotonic() > deadline:
                return None
            await asyncio.sleep(REFRESH_RETRY_S)  # a restarting store: not a tight loop
            current = await current_manifest(self.js)
            if current is None or current.version <= self.weight_version:
                return None
            version = current.version

    def health_check(self) -> float:
        """A tiny forward pass on the engine's scratch cache; returns its duration."""
        assert self.engine is not None
        t0 = time.perf_counter()
        self.engine.warmup()
        return time.perf_counter() - t0

    async def register(self) -> RegisterReply:
        msg = RegisterWorker(
            engine_id=self.engine_id,
            epoch=self.epoch,
            pid=self.pid,
            device=self.device,
            weight_version=self.weight_version,
            max_num_seqs=self.config.engine.max_num_seqs,
        )
        deadline = time.monotonic() + self.config.register_timeout_s
        while True:
            try:
                reply: RegisterReply = await request(
                    self.nc, subjects.router_register(), msg, RegisterReply, timeout=2.0
                )
                self.log.info("worker_registered", resumed=reply.resumed_requests)
                return reply
            except Conflict:
                raise
            except BelayerError as exc:
                if time.monotonic() > deadline:
                    raise Timeout(
                        "router did not accept the registration", error=str(exc)
                    ) from None
                await asyncio.sleep(0.1)  # bounded retry while the router starts

    # --- handlers ---------------------------------------------------------------------------
    def _check_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            raise Conflict(
                "submit for another epoch", engine_id=self.engine_id, epoch=epoch, mine=self.epoch
            )

    async def _on_submit(self, req: EngineSubmit, _msg: Msg) -> Ok:
        self._check_epoch(req.epoch)
        assert self.loop is not None
        limits = self.config.limits
        for i, r in enumerate(req.requests):
            held = r.generated_offset
            if not 0 <= held < len(r.token_ids):
                raise InvalidRequest(
                    "generated_offset must leave a prompt",
                    field=f"$.requests[{i}].generated_offset",
                )
            check_request(
                limits,
                prompt_tokens=len(r.token_ids) - held,
                max_tokens=r.sampling.max_tokens,
                held_tokens=held,
                prompt_field=f"$.requests[{i}].token_ids",
                tokens_field=f"$.requests[{i}].sampling.max_tokens",
            )
        running, waiting = self.loop.load
        fresh = sum(1 for r in req.requests if not self.loop.holds(r.request_id))
        capacity = self.config.engine.max_num_seqs + limits.max_queued
        if fresh and running + waiting + fresh > capacity:
            raise EngineUnavailable(
                "engine queue is full",
                engine_id=self.engine_id,
                running=running,
                waiting=waiting,
                capacity=capacity,
            )
        self.loop.submit(Submit(req.requests))
        return Ok(detail=f"queued {len(req.requests)}")

    async def _on_abort(self, req: EngineAbort, _msg: Msg) -> Ok:
        self._check_epoch(req.epoch)
        assert self.loop is not None
        self.loop.submit(Abort(req.request_ids))
        return Ok()

    async def _on_state(self, req: EngineStateRequest, _msg: Msg) -> EngineStateReply:
        assert self.loop is not None
        fut: Future[list[HeldRequest]] = Future()
        self.loop.submit(Snapshot(list(req.request_ids), fut))
        try:
            held = await asyncio.wait_for(asyncio.wrap_future(fut), 5.0)
        except TimeoutError:
            raise Timeout("engine loop did not answer", engine_id=self.engine_id) from None
        return EngineStateReply(
            engine_id=self.engine_id,
            epoch=self.epoch,
            weight_version=self.weight_version,
            requests=held,
        )

    async def _on_ping(self, _req: Ping, _msg: Msg) -> PingReply:
        running, waiting = self.loop.load if self.loop else (0, 0)
        return PingReply(
            engine_id=self.engine_id,
            epoch=self.epoch,
            pid=self.pid,
            running=running,
            waiting=waiting,
            weight_version=self.weight_version,
            steps=self.loop.steps if self.loop else 0,
        )

    async def close(self) -> None:
        """Stop the engine thread and the step publisher (once ``server`` was drained)."""
        if self.loop is not None:
            self.loop.stop()
        if self.publisher is not None:
            self.publisher.close()


class WorkerProcess(Service[WorkerConfig]):
    """What a main worker and a shadow (``shadow.ShadowService``) share as services: the torch
    threads set before anything runs, one ``Worker``, its engine stopped on close (once the
    engine's subjects drained)."""

    drain_timeout_s = 2.0

    def __init__(self, config: WorkerConfig, *, name: str) -> None:
        super().__init__(config, name=name)
        self.worker: Worker | None = None

    async def open(self) -> None:
        torch.set_num_threads(self.config.torch_threads)

    async def close(self) -> None:
        if self.worker is not None:
            await self.worker.close()


class WorkerService(WorkerProcess):
    """A main worker: prepare, claim the engine, serve it and register (``Worker``); on stop
    the engine's subjects drain, then the engine thread stops."""

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config, name=f"worker:{config.engine_id}")

    async def setup(self) -> None:
        config, js = self.config, self.js
        self.worker = worker = Worker(config, self.nc, js, self.server)
        await worker.prepare()
        epoch = await worker.activate()
        await worker.watch_weights()
        await events.publish(
            js,
            WorkerReady(
                source=f"worker:{config.engine_id}",
                engine_id=config.engine_id,
                epoch=epoch,
                pid=worker.pid,
                attach_s=worker.timings.get("attach_s", 0.0),
                build_warm_s=worker.timings.get("build_warm_s", 0.0),
            ),
        )
