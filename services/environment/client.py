"""Typed client of the environment service (used by the CLI, the benchmark, the controller),
the node-side cleanup ``belayer down`` and the supervisor run after the service stopped, and
a private environment service for a caller without a node (``with_private_env``: the warm
start's demonstrations, ``belayer model eval``)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import secrets
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS

from common import subjects
from common.bus import request
from common.codec import decode
from common.errors import BusUnavailable, InvalidRequest, ResourceLimit, Timeout
from common.tasks import keep
from schemas.base import Message, Ok
from schemas.env import (
    CheckpointInfo,
    EnvCheckpoint,
    EnvCreate,
    EnvCreated,
    EnvDestroy,
    EnvExec,
    EnvExecResult,
    EnvGc,
    EnvHostInfo,
    EnvList,
    EnvListing,
    EnvPing,
    EnvRestore,
    EnvRestored,
    SandboxInfo,
    SandboxLimits,
    TaskFile,
)
from services.environment import placement
from services.environment.config import EnvConfig

T = TypeVar("T")
R = TypeVar("R")


class EnvClient:
    """One method per ``belayer.env.<op>``; errors arrive as typed ``common.errors``. This
    reaches any one environment host; ``PlacedEnvClient`` places sandboxes across hosts."""

    def __init__(self, nc: NATS, *, timeout: float = 60.0) -> None:
        self.nc = nc
        self.timeout = timeout

    async def call(
        self, sandbox_id: str, op: str, msg: Message, reply_type: type[R], timeout: float
    ) -> R:
        """Send one operation on the sandbox ``sandbox_id`` (empty: none in particular)."""
        del sandbox_id
        return await request(self.nc, subjects.env(op), msg, reply_type, timeout=timeout)

    async def create(
        self,
        *,
        image: str = "",
        files: dict[str, bytes] | None = None,
        limits: SandboxLimits | None = None,
        trajectory_id: str = "",
        sandbox_id: str = "",
    ) -> EnvCreated:
        msg = EnvCreate(
            image=image,
            files=[TaskFile(path=p, content=c) for p, c in (files or {}).items()],
            limits=limits or SandboxLimits(),
            trajectory_id=trajectory_id,
            sandbox_id=sandbox_id,
        )
        return await self.call(sandbox_id, "create", msg, EnvCreated, self.timeout)

    async def exec(self, sandbox_id: str, command: str, timeout_s: float = 30.0) -> EnvExecResult:
        msg = EnvExec(sandbox_id=sandbox_id, command=command, timeout_s=timeout_s)
        return await self.call(sandbox_id, "exec", msg, EnvExecResult, timeout_s + self.timeout)

    async def checkpoint(
        self, sandbox_id: str, prefix: int, trajectory_id: str = "", timeout_s: float = 0.0
    ) -> CheckpointInfo:
        msg = EnvCheckpoint(
            sandbox_id=sandbox_id, prefix=prefix, trajectory_id=trajectory_id, timeout_s=timeout_s
        )
        return await self.call(
            sandbox_id, "checkpoint", msg, CheckpointInfo, self.timeout + timeout_s
        )

    async def restore(
        self,
        sandbox_id: str,
        checkpoint_id: str = "",
        *,
        image: str = "",
        limits: SandboxLimits | None = None,
        trajectory_id: str = "",
    ) -> EnvRestored:
        """``image``, ``limits``, ``trajectory_id``: what the sandbox was created with, for a
        host that takes it over when its own host died (``PlacedEnvClient``)."""
        msg = EnvRestore(
            sandbox_id=sandbox_id, checkpoint_id=checkpoint_id, image=image, limits=limits,
            trajectory_id=trajectory_id,
        )  # fmt: skip
        return await self.call(sandbox_id, "restore", msg, EnvRestored, self.timeout * 2)

    async def destroy(self, sandbox_id: str) -> Ok:
        msg = EnvDestroy(sandbox_id=sandbox_id)
        return await self.call(sandbox_id, "destroy", msg, Ok, self.timeout)

    async def list(self) -> EnvListing:
        return await self.call("", "list", EnvList(), EnvListing, self.timeout)

    async def gc(self, trajectory_id: str) -> Ok:
        return await self.call("", "gc", EnvGc(trajectory_id=trajectory_id), Ok, self.timeout)


REGISTRY_READ_S = 5.0
"""Longest a read of the host registrations (KV ``env_hosts``) may take before the client
keeps its last view."""


class PlacedEnvClient(EnvClient):
    """Places each new sandbox on the registered environment host with the most free
    capacity (KV ``env_hosts``, ``placement.choose_host``) and sends that sandbox's operations
    to its host (``belayer.envhost.<host>.<op>``). While an operation waits, its host is
    pinged: a host with no responder fails the operation at once (``BusUnavailable``) instead
    of at its deadline. A restore whose host is gone goes to the host with the most free capacity,
    which takes the sandbox over from the checkpoint object store (``EnvRestore.from_store``).
    With no host registered it is an ``EnvClient``."""

    def __init__(
        self, nc: NATS, *, timeout: float = 60.0, probe_every_s: float = 1.0, refresh_s: float = 1.0
    ) -> None:
        super().__init__(nc, timeout=timeout)
        self.probe_every_s = probe_every_s
        self.refresh_s = refresh_s
        self.where: dict[str, str] = {}
        """Sandbox id → the host it lives on (as far as this client knows)."""
        self._hosts: dict[str, EnvHostInfo] = {}
        self._pending: dict[str, set[str]] = {}
        """Host → sandboxes placed on it that its registration does not list yet."""
        self.boots: dict[str, str] = {}
        """Host → the ``boot`` of its last answer to a ping from this client."""
        self._read_at = -math.inf
        self._reading = asyncio.Lock()
        self._left: set[asyncio.Task[Any]] = set()
        """Registry reads cut at ``REGISTRY_READ_S``, cancelled, until they end."""

    async def hosts(self, *, now: bool = False) -> list[EnvHostInfo]:
        """The fresh registrations (read again at most every ``refresh_s``, or ``now``)."""
        asked = time.monotonic()
        async with self._reading:  # concurrent callers share one read
            if (now and self._read_at < asked) or asked - self._read_at >= self.refresh_s:
                self._read_at = time.monotonic()
                # A watch that never ends must not hold every caller behind this lock, nor
                # its clean-up (``wait_for`` would wait for the cancelled read to finish): a
                # read past its bound is cancelled and left behind; the last view stays.
                read = asyncio.ensure_future(self._registry())
                done, _ = await asyncio.wait({read}, timeout=REGISTRY_READ_S)
                if done:
                    self._hosts = read.result()
                else:
                    read.cancel()  # held until it ends (asyncio keeps tasks weakly)
                    keep(self._left, read)
                for name, h in self._hosts.items():  # what a registration lists, it counts
                    self._pending.get(name, set()).difference_update(h.sandbox_ids)
        return placement.fresh(self._hosts.values(), time.time())

    async def _registry(self) -> dict[str, EnvHostInfo]:
        out: dict[str, EnvHostInfo] = {}
        try:
            kv = await self.nc.jetstream().key_value(subjects.BUCKET_ENV_HOSTS)
            watcher = await kv.watchall(ignore_deletes=True)
            try:
                async for entry in watcher:
                    if entry is None:
                        break
                    with contextlib.suppress(InvalidRequest):
                        info = decode(entry.value or b"", EnvHostInfo)
                        if info.host == entry.key:
                            out[info.host] = info
            finally:
                await watcher.stop()
        except nats.js.errors.BucketNotFoundError:
            return {}
        except (TimeoutError, nats.errors.Error):
            return dict(self._hosts)  # keep the last view through a bus hiccup
        return out

    async def host_of(self, sandbox_id: str) -> str | None:
        """The sandbox's host: known here, else the registration that lists it."""
        if sandbox_id in self.where:
            return self.where[sandbox_id]
        for h in await self.hosts(now=True) + list(self._hosts.values()):
            if sandbox_id in h.sandbox_ids:
                self.where[sandbox_id] = h.host
                return h.host
        return None

    async def call(
        self, sandbox_id: str, op: str, msg: Message, reply_type: type[R], timeout: float
    ) -> R:
        if isinstance(msg, EnvCreate):
            return await self._create(msg, reply_type, timeout)
        if isinstance(msg, EnvRestore):
            return await self._restore(msg, reply_type, timeout)
        host = await self.host_of(sandbox_id) if sandbox_id else None
        if host is None:
            return await super().call(sandbox_id, op, msg, reply_type, timeout)
        out = await self.on_host(host, op, msg, reply_type, timeout)
        if op == "destroy":
            self.where.pop(sandbox_id, None)
            for ids in self._pending.values():
                ids.discard(sandbox_id)
        return out

    async def _create(self, msg: EnvCreate, reply_type: type[R], timeout: float) -> R:
        hosts = await self.hosts()
        if not hosts:
            return await super().call(msg.sandbox_id, "create", msg, reply_type, timeout)
        gone: set[str] = set()
        while True:
            host = placement.choose_host(hosts, placed=self._placed(), exclude=gone)
            if host is None:
                raise ResourceLimit("no environment host has room", hosts=len(hosts))
            key = msg.sandbox_id or secrets.token_hex(8)
            self._pending.setdefault(host, set()).add(key)
            try:
                out = await self.on_host(host, "create", msg, reply_type, timeout)
            except BaseException as exc:
                self._pending[host].discard(key)
                if not isinstance(exc, BusUnavailable):
                    raise
                gone.add(host)  # gone since it registered: the next one
                continue
            if isinstance(out, EnvCreated):
                self.where[out.sandbox_id] = host
            return out

    async def _restore(self, msg: EnvRestore, reply_type: type[R], timeout: float) -> R:
        sid = msg.sandbox_id
        host = await self.host_of(sid)
        hosts = await self.hosts()
        if host is None and not hosts:
            return await super().call(sid, "restore", msg, reply_type, timeout)
        msg = msgspec.structs.replace(msg, from_store=True)
        if host is not None and await self.alive(host):
            return await self.on_host(host, "restore", msg, reply_type, timeout)
        target = placement.choose_host(hosts, placed=self._placed(), exclude={host or ""})
        if target is None:
            raise BusUnavailable("no environment host to restore the sandbox on", sandbox_id=sid)
        self.where[sid] = target
        self._pending.setdefault(target, set()).add(sid)
        return await self.on_host(target, "restore", msg, reply_type, timeout)

    def _placed(self) -> dict[str, int]:
        return {host: len(ids) for host, ids in self._pending.items()}

    async def alive(self, host: str) -> bool:
        """Whether ``host`` answers a ping (no responder: gone; silence raises ``Timeout``)."""
        return await self.ping(host) is not None

    async def ping(self, host: str) -> EnvHostInfo | None:
        """``host``'s answer to a ping; ``None`` when it has no responder (silence raises
        ``Timeout``)."""
        try:
            info = await request(
                self.nc, subjects.env_host(host, "ping"), EnvPing(), EnvHostInfo,
                timeout=max(self.probe_every_s * 3, 1.0),
            )  # fmt: skip
        except BusUnavailable:
            return None
        self.boots[host] = info.boot
        return info

    async def on_host(
        self, host: str, op: str, msg: Message, reply_type: type[R], timeout: float
    ) -> R:
        """One operation on ``host``, failed at once (``BusUnavailable``) if the host goes."""
        subject = subjects.env_host(host, op)
        call = asyncio.ensure_future(request(self.nc, subject, msg, reply_type, timeout=timeout))
        watch = asyncio.ensure_future(self._gone(host))
        try:
            await asyncio.wait({call, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (call, watch):
                if not t.done():
                    t.cancel()
        if call.done() and not call.cancelled():
            return call.result()
        raise BusUnavailable("the environment host is gone", host=host, op=op)

    async def _gone(self, host: str) -> None:
        """Returns once ``host`` has no responder (its service died: its subscriptions went
        with its connection) or answers from another process than at the operation's start
        (``EnvHostInfo.boot``: it died and was restarted between two probes, and the dead
        process will never answer). A slow answer is not a death: the operation's own
        deadline covers a host that hangs."""
        known, boot = self.boots.get(host, ""), ""
        while True:
            try:
                info = await self.ping(host)
            except Timeout:
                # Unanswered before any answer: the operation went where this ping went, to
                # a process that did not answer; the one this client heard from before.
                boot = boot or known
            else:
                if info is None or (boot and info.boot != boot):
                    return
                boot = boot or info.boot
            await asyncio.sleep(self.probe_every_s)  # the probe's period

    async def list(self) -> EnvListing:
        hosts = await self.hosts()
        if not hosts:
            return await super().list()
        out: list[SandboxInfo] = []
        for h in hosts:
            with contextlib.suppress(BusUnavailable):
                got = await self.on_host(h.host, "list", EnvList(), EnvListing, self.timeout)
                out += got.sandboxes
        return EnvListing(sandboxes=out)


def node_label(run_id: str) -> str:
    """The ``belayer.node`` container label of the sandboxes of the node with this run id: the
    supervisor starts the environment service with it, ``belayer down`` finds leftovers by it
    (the run id is in the node file, so this works even after the service died). Ownership
    across runs is the run directory's ``belayer.run`` label (``EnvConfig.run_key``)."""
    return f"node-{run_id}"


def keep_sandboxes(run_dir: Path, keep: bool) -> bool:
    """Before a node stops: with ``keep``, mark the run directory so that its sandboxes (and
    their checkpoints and records) survive the stop and the next ``belayer up`` of this run
    directory adopts them; without, clear any such mark (the stop destroys them). Returns
    whether the run directory has an environment at all (nothing to keep otherwise)."""
    config = EnvConfig(run_dir=run_dir)
    if not config.env_dir.is_dir():
        return False
    if keep:
        config.keep_marker.write_text("kept by belayer down --keep-sandboxes\n")
    else:
        config.keep_marker.unlink(missing_ok=True)
    return True


@dataclass(frozen=True)
class SandboxCleanup:
    """What ``remove_node_sandboxes`` removed."""

    containers: int = 0
    """Sandbox containers of the node removed."""
    checkpoint_dirs: int = 0
    """Sandbox checkpoint directories removed (with the sandbox records)."""
    error: str = ""
    """Why the node's containers could not be listed (dockerd unreachable), else empty."""
    kept: int = 0
    """Sandboxes left in place for the next start (``keep_sandboxes``): nothing was removed."""


def remove_node_sandboxes(node: str, run_dir: Path) -> SandboxCleanup:
    """Blocking. Remove every container labelled ``belayer.node=<node>`` or
    ``belayer.run=<run_dir's key>``, then every sandbox's checkpoint directory and record under
    ``run_dir`` (sandboxes do not outlive their node). Call it only once the node's environment
    service has stopped. A run directory where no environment service ever ran is left alone
    (no Docker call), and so is one marked by ``keep_sandboxes`` (``kept`` counts its
    sandboxes); with dockerd unreachable nothing is removed and ``error`` says why."""
    config = EnvConfig(run_dir=run_dir, node=node)
    if not config.env_dir.is_dir():
        return SandboxCleanup()
    if config.keep_marker.exists():
        return SandboxCleanup(kept=len(list(config.records_dir.glob("*.json"))))
    from common.errors import SandboxError
    from services.environment.docker_ops import DockerOps

    containers = 0
    docker = DockerOps(config)
    try:
        for cid, _sid in docker.labelled():
            docker.remove(cid)
            containers += 1
    except SandboxError as exc:  # keep the records: a retry once dockerd answers finds them
        return SandboxCleanup(containers=containers, error=str(exc))
    dirs = [p for p in _entries(config.checkpoint_root) if p.is_dir()]
    for p in dirs:
        shutil.rmtree(p, ignore_errors=True)
    for p in _entries(config.records_dir):
        p.unlink(missing_ok=True)
    return SandboxCleanup(containers=containers, checkpoint_dirs=len(dirs))


def _entries(directory: Path) -> list[Path]:
    return list(directory.iterdir()) if directory.is_dir() else []


async def with_private_env(fn: Callable[[EnvClient], Awaitable[T]]) -> T:
    """Run ``fn(ops)`` against a private environment service (its own nats-server, run
    directory and node label, so no other node's sandboxes are touched); every sandbox it
    made is destroyed before it stops."""
    from common.bus import connect, ensure_jetstream
    from common.errors import SandboxError
    from common.natsserver import start_nats_server
    from services.environment.service import run as run_env

    with tempfile.TemporaryDirectory(prefix="belayer-warm-") as tmp:
        server = start_nats_server(Path(tmp) / "nats")
        try:
            nc = await connect(server.url, name="warm-start", timeout=5.0, reconnect=False)
            try:
                await ensure_jetstream(nc.jetstream())
                config = EnvConfig(
                    nats_url=server.url,
                    run_dir=Path(tmp) / "run",
                    node=f"warm-{secrets.token_hex(4)}",
                )
                stop, ready = asyncio.Event(), asyncio.Event()
                service = asyncio.create_task(run_env(config, stop=stop, ready=ready))
                waiter = asyncio.create_task(ready.wait())
                done, _ = await asyncio.wait(
                    {service, waiter}, timeout=60, return_when=asyncio.FIRST_COMPLETED
                )
                waiter.cancel()
                if service in done:
                    service.result()
                if not ready.is_set():
                    raise SandboxError("the environment service did not become ready in 60 s")
                client = EnvClient(nc, timeout=60)
                try:
                    return await fn(client)
                finally:
                    with contextlib.suppress(Exception):
                        for sb in (await client.list()).sandboxes:
                            with contextlib.suppress(Exception):
                                await client.destroy(sb.id)
                    stop.set()
                    await asyncio.wait_for(service, 60)
            finally:
                await nc.close()
        finally:
            server.stop()
