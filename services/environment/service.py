"""The environment service on the bus: ``belayer.env.<op>`` request handlers around the
``SandboxManager``; ready pointers in the ``sandbox_prefix`` KV bucket (compare-and-set);
``checkpoint_ready`` events on the EVENTS stream."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from common import events, subjects
from common.bus import Handler
from common.codec import encode
from common.errors import BusUnavailable, Conflict, SandboxError
from common.guard import isolated
from common.logging import get_logger
from common.service import Service, run_service
from schemas import env as wire
from schemas.base import Ok
from schemas.events import CheckpointReady, SandboxRestored
from services.environment import core
from services.environment.config import EnvConfig
from services.environment.core import SandboxRecord, SandboxState
from services.environment.manager import SandboxManager
from services.environment.objects import CheckpointObjects

log = get_logger(service="environment")


class KvReadyStore:
    """Ready pointers in JetStream KV: key = sandbox id, value = msgpack ``ReadyPointer``."""

    def __init__(self, js: JetStreamContext, source: str) -> None:
        self.js = js
        self.source = source
        self._kv: KeyValue | None = None

    async def kv(self) -> KeyValue:
        if self._kv is None:
            self._kv = await self.js.key_value(subjects.BUCKET_SANDBOX_PREFIX)
        return self._kv

    async def get(self, sandbox_id: str) -> tuple[wire.ReadyPointer | None, int]:
        kv = await self.kv()
        try:
            entry = await kv.get(sandbox_id)
        except nats.js.errors.KeyNotFoundError:
            return None, 0
        except (TimeoutError, nats.errors.Error) as exc:
            raise BusUnavailable(f"cannot read the ready pointer: {exc!r}") from None
        if not entry.value:
            return None, int(entry.revision or 0)
        try:
            pointer = msgspec.msgpack.decode(entry.value, type=wire.ReadyPointer)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            # Not ours to trust (anyone on the bus can write the bucket): no ready pointer; the
            # next checkpoint replaces it (compare-and-set on this revision).
            log.warning("bad_ready_pointer", sandbox_id=sandbox_id, error=str(exc))
            return None, int(entry.revision or 0)
        return pointer, int(entry.revision or 0)

    async def advance(self, pointer: wire.ReadyPointer, expected_rev: int) -> int:
        """Compare-and-set: succeeds only if the key is still at ``expected_rev``."""
        kv = await self.kv()
        value = msgspec.msgpack.encode(pointer)
        try:
            if expected_rev == 0:
                return int(await kv.create(pointer.sandbox_id, value))
            return int(await kv.update(pointer.sandbox_id, value, last=expected_rev))
        except nats.js.errors.KeyWrongLastSequenceError:
            raise Conflict(
                "ready pointer moved concurrently", sandbox_id=pointer.sandbox_id
            ) from None
        except (TimeoutError, nats.errors.Error) as exc:
            if "wrong last sequence" in str(exc):
                raise Conflict(
                    "ready pointer moved concurrently", sandbox_id=pointer.sandbox_id
                ) from None
            raise BusUnavailable(f"cannot publish the ready pointer: {exc!r}") from None

    async def delete(self, sandbox_id: str) -> None:
        kv = await self.kv()
        try:
            await kv.purge(sandbox_id)
        except (TimeoutError, nats.errors.Error) as exc:
            log.warning("ready_pointer_delete_failed", sandbox_id=sandbox_id, error=repr(exc))

    async def announce(self, info: wire.CheckpointInfo) -> None:
        event = CheckpointReady(source=self.source, checkpoint=info)
        await events.publish(self.js, event, msg_id=f"checkpoint_ready-{info.checkpoint_id}")


class EnvHandlers:
    """The environment's request handlers, one per op (``EnvService`` below is the process
    that serves them). With ``js``, each restore also publishes
    ``sandbox_restored``."""

    def __init__(
        self, config: EnvConfig, manager: SandboxManager, js: JetStreamContext | None = None
    ) -> None:
        self.config = config
        self.manager = manager
        self.js = js
        self.changed = asyncio.Event()
        """Set when the number of sandboxes changed (the registration is refreshed)."""
        self.boot = secrets.token_hex(8)
        """This process's start (``EnvHostInfo.boot``)."""

    def info(self) -> wire.EnvHostInfo:
        live = sum(
            1 for r in self.manager.records.values() if r.status is not SandboxState.DESTROYED
        )
        return wire.EnvHostInfo(
            host=self.config.node, capacity=self.config.max_sandboxes, sandboxes=live,
            ts=time.time(), boot=self.boot,
        )  # fmt: skip

    async def on_ping(self, _req: wire.EnvPing, _msg: Msg) -> wire.EnvHostInfo:
        return self.info()

    def limits(self, lim: wire.SandboxLimits) -> core.Limits:
        cfg = self.config
        return core.check_limits(
            core.Limits(memory_mb=lim.memory_mb, cpus=lim.cpus, pids=lim.pids),
            core.Limits(memory_mb=cfg.max_memory_mb, cpus=cfg.max_cpus, pids=cfg.max_pids),
        )

    async def on_create(self, req: wire.EnvCreate, _msg: Msg) -> wire.EnvCreated:
        start = time.monotonic()
        limits = self.limits(req.limits)
        rec = await self.manager.create(
            image=req.image,
            files=[(f.path, f.content, f.mode) for f in req.files],
            limits=limits,
            trajectory_id=req.trajectory_id,
            sandbox_id=req.sandbox_id,
        )
        self.changed.set()
        return wire.EnvCreated(
            sandbox_id=rec.id,
            container_id=rec.container_id,
            image=rec.image,
            duration_s=time.monotonic() - start,
        )

    async def on_exec(self, req: wire.EnvExec, _msg: Msg) -> wire.EnvExecResult:
        out = await self.manager.exec(
            req.sandbox_id, req.command, req.timeout_s or self.config.exec_timeout_s, req.workdir
        )
        return wire.EnvExecResult(
            sandbox_id=req.sandbox_id,
            stdout=out.stdout.decode(errors="replace"),
            stderr=out.stderr.decode(errors="replace"),
            exit_code=out.exit_code,
            duration_s=out.duration_s,
            truncated=out.truncated,
            timed_out=out.timed_out,
        )

    async def on_checkpoint(self, req: wire.EnvCheckpoint, _msg: Msg) -> wire.CheckpointInfo:
        return await self.manager.checkpoint(
            req.sandbox_id, req.prefix, req.trajectory_id, req.timeout_s
        )

    async def on_restore(self, req: wire.EnvRestore, _msg: Msg) -> wire.EnvRestored:
        taken = None
        if req.from_store:  # the sandbox's host died: take it over from the checkpoint store
            taken = SandboxRecord(
                id=core.validate_sandbox_id(req.sandbox_id), image=req.image or self.config.image,
                container_id="", limits=self.limits(req.limits or wire.SandboxLimits()),
                trajectory_id=req.trajectory_id, state=SandboxState.FAILED.value,
                created_at=time.time(),
            )  # fmt: skip
            self.changed.set()
        r = await self.manager.restore(req.sandbox_id, req.checkpoint_id, taken)
        if self.js is not None:
            m = r.manifest
            event = SandboxRestored(
                source=f"environment:{self.config.node}", sandbox_id=r.record.id,
                checkpoint_id=m.checkpoint_id, prefix=m.prefix, seconds=r.seconds,
                bytes=m.fs_bytes + m.criu_bytes, method=r.method,
            )  # fmt: skip
            msg_id = f"sandbox_restored-{r.record.id}-{r.record.container_id}"
            await events.publish(self.js, event, msg_id=msg_id)
        return wire.EnvRestored(
            sandbox_id=r.record.id,
            container_id=r.record.container_id,
            checkpoint_id=r.manifest.checkpoint_id,
            prefix=r.manifest.prefix,
            duration_s=r.seconds,
            method=r.method,
            fallback_from=r.fallback_from,
            candidates=r.attempts,
        )

    async def on_destroy(self, req: wire.EnvDestroy, _msg: Msg) -> Ok:
        await self.manager.destroy(req.sandbox_id)
        self.changed.set()
        return Ok(detail=f"destroyed {req.sandbox_id}")

    async def on_list(self, _req: wire.EnvList, _msg: Msg) -> wire.EnvListing:
        return wire.EnvListing(sandboxes=self.manager.sandboxes())

    async def on_gc(self, req: wire.EnvGc, _msg: Msg) -> Ok:
        n = await self.manager.gc_trajectory(req.trajectory_id)
        return Ok(detail=f"removed {n} checkpoints")


async def adopt_when_reachable(manager: SandboxManager, stop: asyncio.Event) -> None:
    """Retry (every 2 s, until ``stop``) to reach dockerd, then adopt the previous sandboxes."""
    while not stop.is_set():
        with isolated(log, "adopt_when_reachable"):  # any other failure: log it, retry later
            try:
                await asyncio.to_thread(manager.docker.ping)
                await manager.adopt()
                log.info("dockerd_reachable_again")
                return
            except SandboxError:
                pass
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 2.0)


async def register(
    svc: EnvHandlers, js: JetStreamContext, stop: asyncio.Event, tried: asyncio.Event
) -> None:
    """Keep this host's registration (KV ``env_hosts``) fresh: every ``register_every_s`` and
    whenever its number of sandboxes changed; deleted on a graceful stop. ``tried`` is set
    once the first registration was written (or failed: the next round retries)."""
    kv: KeyValue | None = None
    host = svc.config.node
    try:
        while not stop.is_set():
            svc.changed.clear()
            with isolated(log, "env_host_register"):  # a bus hiccup: the next round retries
                kv = kv or await js.key_value(subjects.BUCKET_ENV_HOSTS)
                await kv.put(host, encode(svc.info()))
            tried.set()
            with contextlib.suppress(TimeoutError):
                changed = asyncio.ensure_future(svc.changed.wait())
                stopped = asyncio.ensure_future(stop.wait())
                try:
                    await asyncio.wait(
                        {changed, stopped}, timeout=svc.config.register_every_s,
                        return_when=asyncio.FIRST_COMPLETED,
                    )  # fmt: skip
                finally:
                    changed.cancel()
                    stopped.cancel()
    finally:
        if kv is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(kv.delete(host), 2.0)


REGISTER_WAIT_S = 10.0
"""How long the service's start waits for its first registration before it answers pings
anyway (a bus that refuses the write: the registration loop keeps retrying)."""


class EnvService(Service[EnvConfig]):
    """The environment process: adopt the sandboxes of a previous run (or keep retrying while
    dockerd is unreachable), serve ``belayer.env.<op>`` with concurrent handlers; on stop the
    handlers finish (bounded by ``lock_wait_s``), then every sandbox is destroyed."""

    name = "environment"

    def __init__(self, config: EnvConfig) -> None:
        super().__init__(config)
        self.drain_timeout_s = config.lock_wait_s
        self.manager: SandboxManager | None = None
        self.adopting: asyncio.Task[None] | None = None
        self.registering: asyncio.Task[None] | None = None

    async def setup(self) -> None:
        config = self.config
        manager = SandboxManager(
            config,
            KvReadyStore(self.js, source=f"environment:{config.node}"),
            objects=CheckpointObjects(self.js),
        )
        self.manager = manager
        try:
            await asyncio.to_thread(manager.docker.ping)
            await manager.adopt()
        except SandboxError as exc:
            # Serve anyway: every request gets a clear "dockerd is not reachable" error until
            # dockerd answers, then the sandboxes of a previous run are adopted.
            log.warning("dockerd_unreachable", error=str(exc))
            self.adopting = asyncio.create_task(adopt_when_reachable(manager, self.stop_requested))
        svc = EnvHandlers(config, manager, self.js)
        routes: list[tuple[str, Any, Handler]] = [
            ("create", wire.EnvCreate, svc.on_create),
            ("exec", wire.EnvExec, svc.on_exec),
            ("checkpoint", wire.EnvCheckpoint, svc.on_checkpoint),
            ("restore", wire.EnvRestore, svc.on_restore),
            ("destroy", wire.EnvDestroy, svc.on_destroy),
            ("list", wire.EnvList, svc.on_list),
            ("gc", wire.EnvGc, svc.on_gc),
        ]
        for op, typ, handler in routes:  # any one host (a queue group), and this host
            await self.server.serve(
                subjects.env(op), typ, handler, concurrent=True, queue="environment"
            )
            await self.server.serve(
                subjects.env_host(config.node, op), typ, handler, concurrent=True
            )
        # Registered (placeable) before this host answers its ping, the probe its supervisor
        # waits on: a `belayer up --role env-host` that has returned can be placed on.
        tried = asyncio.Event()
        self.registering = asyncio.create_task(register(svc, self.js, self.stop_requested, tried))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(tried.wait(), REGISTER_WAIT_S)
        await self.server.serve(
            subjects.env_host(config.node, "ping"), wire.EnvPing, svc.on_ping, concurrent=True
        )
        log.info("sandboxes_adopted", node=config.node, sandboxes=len(manager.records))

    async def drain(self) -> None:
        if self.adopting is not None:
            self.adopting.cancel()
        if self.registering is not None:  # deregisters (stop_requested is set)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.registering, 5.0)
        await super().drain()
        if self.manager is not None:
            await self.manager.close()


async def run(
    config: EnvConfig, *, stop: asyncio.Event, ready: asyncio.Event | None = None
) -> None:
    """Run the environment service until ``stop`` (see ``EnvService``)."""
    await run_service(EnvService(config), stop=stop, ready=ready)
