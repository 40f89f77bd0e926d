"""Node supervisor: starts NATS (unless given one) and the services in dependency order, waits
until each answers on the bus, restarts any that exits unexpectedly (with backoff), and on
stop tears everything down: processes, NATS, shared-memory files, the node file."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shutil
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from common import events, subjects
from common.auth import (
    BusConfig,
    Identity,
    authorization_conf,
    engine_host_identities,
    ensure_identities,
    node_identities,
    read_seed,
    redact,
    seed_file,
)
from common.bus import request
from common.config import RunPaths, config_argv
from common.errors import BelayerError, NotFound, Timeout
from common.guard import isolated
from common.heartbeat import PidWatch
from common.logging import get_logger
from common.natsserver import NatsServer, TlsFiles, start_nats_server
from common.node import NodeInfo
from common.service import Service, run_service
from common.tasks import gather_all
from schemas.base import Ok
from schemas.events import EventBase, NodeReady, ServiceExited, ServiceRestarted
from schemas.node import ProcInfo, StopNode, SupervisorStatus, SupervisorStatusRequest
from schemas.trainer import TrainerStatus, TrainerStatusRequest
from schemas.weights import ArenaDesc, KvGet, WeightManifest, WeightsGet
from services.environment.client import node_label, remove_node_sandboxes
from services.router.client import router_status
from services.supervisor.backoff import Backoff
from services.supervisor.client import node_identity_names, remove_shm_files
from services.supervisor.config import SupervisorConfig, host_engine_ids, parse_engine_host
from services.supervisor.engines import Engines
from services.supervisor.metrics import MetricsEndpoint
from services.supervisor.procs import Child
from services.trainer.client import TrainerConfig

ENV_STOP_TIMEOUT_S = 30.0
"""The environment service's graceful stop destroys every sandbox: it gets longer than the
others before SIGKILL (whatever it leaves then is removed by ``remove_node_sandboxes``)."""
TRAINER_STOP_TIMEOUT_S = 60.0
"""A stopping trainer first finishes the update it is running (checkpoint and acks included)."""

log = get_logger(service="supervisor")


def ensure_model(config: SupervisorConfig, paths: RunPaths) -> Path:
    """The configured model directory, or a tiny random Qwen3 made once under the run dir; on
    an engine host, where its weight store mirrors the node's model (``config.json``)."""
    if config.role == "engine-host":
        return (paths.models / "mirror").resolve()
    if config.model_dir:
        return Path(config.model_dir).resolve()
    tiny = paths.models / "tiny"
    if not (tiny / "config.json").exists():
        from model.tiny import init_tiny_model

        init_tiny_model(tiny)
    return tiny.resolve()


class Supervisor(Service[SupervisorConfig]):
    """The node as one service: ``open`` starts nats-server (unless given one) and makes the
    model, ``setup`` starts the children and waits until each answers, ``stop_requested`` is
    set by ``supervisor.stop``; ``close`` stops the children, then NATS, and removes what the
    node leaves in shared memory and the run directory."""

    name = "supervisor"
    owns_jetstream = True

    def __init__(self, config: SupervisorConfig) -> None:
        super().__init__(config)
        self.paths = RunPaths(Path(config.run_dir).resolve())
        self.run_id = config.run_id or uuid.uuid4().hex[:8]
        self.nats: NatsServer | None = None
        self.nats_url = config.nats_url
        self.children: dict[str, Child] = {}
        self.ready = False
        self.model_dir = Path()
        self.engine_ids = (
            host_engine_ids(config.host_name, config.engines)
            if config.role == "engine-host"
            else [f"e{i}" for i in range(config.engines)]
        )
        self.watchers: list[asyncio.Task[None]] = []
        self.owner_watch: tuple[PidWatch, asyncio.AbstractEventLoop] | None = None
        """``owner_pid``'s pidfd and the loop it is registered with (``_watch_owner``)."""
        self.engines = Engines(self)
        self.metrics: MetricsEndpoint | None = None
        self.metrics_url = ""
        """Where the node's Prometheus metrics are served (``metrics_port``; empty: off)."""
        self.creds_dir: Path | None = Path(config.creds_dir) if config.creds_dir else None
        # A joined env host declares nothing: the deployment's node owns the streams.
        self.owns_jetstream = config.role == "node"

    # --- specs ------------------------------------------------------------------------------
    def _py(self, module: str, config: Any) -> list[str]:
        """The command line that runs ``module`` with ``config`` on this node's bus, as the
        identity of its role (``bus_for``)."""
        config = dataclasses.replace(
            config, nats_url=self.nats_url, bus=self.bus_for(identity_of(module, config))
        )
        return [sys.executable, "-m", module, *config_argv(config)]

    def bus_for(self, identity: str) -> BusConfig:
        """The node's bus settings with ``identity``'s credentials (none without auth)."""
        creds = str(seed_file(self.creds_dir, identity)) if self.creds_dir else ""
        return dataclasses.replace(self.config.bus, creds=creds)

    def child(self, name: str, argv: list[str], stop_timeout: float = 5.0) -> Child:
        c = self.config
        child = Child(
            name=name,
            argv=argv,
            log_path=self.paths.logs / f"{name}.out",
            backoff=Backoff(c.restart_backoff_s, c.restart_backoff_max_s, c.stable_after_s),
            env={"OMP_NUM_THREADS": "1", "BELAYER_RUN_ID": self.run_id},
            stop_timeout=stop_timeout,
        )
        self.children[name] = child
        return child

    def _log_file(self, name: str) -> Path:
        return self.paths.logs / f"{name}.jsonl"

    def worker_argv(self, engine_id: str, role: str = "main", *, cold: bool = False) -> list[str]:
        """A main worker's (``role="main"``) or shadow's command line; ``cold`` loads the
        weights from the model directory instead of the weight store (baseline restarts)."""
        kind = "worker" if role == "main" else "shadow"
        config = dataclasses.replace(
            self.config.worker,
            engine_id=engine_id,
            role="main" if role == "main" else "shadow",
            heartbeat_file=str(self.paths.heartbeat_file(engine_id)),
            log_file=str(self._log_file(f"{kind}-{engine_id}")),
            cold_load_dir=str(self.model_dir) if cold else "",
            host=self.config.host_name if self.config.role == "engine-host" else "",
            limits=self.config.router.limits,  # one set of limits: the router's
        )
        return self._py("services.worker", config)

    def trainer_config(self) -> TrainerConfig:
        """The trainer's config with what only the node knows filled in."""
        c = self.config
        default_dir = c.trainer.checkpoint_dir == TrainerConfig().checkpoint_dir
        return dataclasses.replace(
            c.trainer,
            run_id=self.run_id,
            checkpoint_dir=self.paths.root / "trainer" if default_dir else c.trainer.checkpoint_dir,
            deterministic=c.trainer.deterministic or c.worker.engine.deterministic,
            log_file=str(self._log_file("trainer")),
        )

    # --- start ------------------------------------------------------------------------------
    async def open(self) -> None:
        self.paths.logs.mkdir(parents=True, exist_ok=True)
        # Heartbeat files of a previous (crashed) node must not look like dead main workers.
        shutil.rmtree(self.paths.heartbeats, ignore_errors=True)
        self.paths.heartbeats.mkdir(parents=True, exist_ok=True)
        if not self.nats_url:
            # Authentication on: one identity per role (and engine), the server built with
            # their permissions; an unauthenticated connection is refused.
            self.creds_dir = self.paths.auth
            identities = await asyncio.to_thread(
                ensure_identities, self.creds_dir, node_identities(self.engine_ids)
            )
            identities += await asyncio.to_thread(engine_host_auth, self.config, self.creds_dir)
            bus = self.config.bus
            tls = TlsFiles(bus.tls_cert, bus.tls_key, bus.tls_ca) if bus.tls_cert else None
            self.nats = await asyncio.to_thread(
                start_nats_server,
                self.paths.nats_store,
                log_file=self.paths.logs / "nats-server.log",
                authorization=authorization_conf(identities),
                tls=tls,
            )
            self.nats_url = self.nats.url
        # Every identity this node uses must be readable before anything starts (one clear
        # error instead of services failing one by one).
        own = "supervisor" if self.config.role == "node" else "host"
        if self.creds_dir:
            for name in self.identities():
                read_seed(seed_file(self.creds_dir, name))
        self.bus = self.bus_for(own)
        self.model_dir = await asyncio.to_thread(ensure_model, self.config, self.paths)
        self._write_node()

    async def setup(self) -> None:
        c = self.config
        server = self.server
        if c.role == "env-host":
            await self._setup_env_host()
            return
        if c.role == "engine-host":
            await self._setup_engine_host()
            return
        await server.serve(subjects.supervisor_status(), SupervisorStatusRequest, self._on_status)
        await server.serve(subjects.supervisor_stop(), StopNode, self._on_stop)
        self._watch_owner()
        model, rid = self.model_dir, self.run_id
        # The services that need only the bus start together (the weight store, the KV arena,
        # the router and the environment service; none imports torch, each starts in ~0.5 s);
        # the workers need the first three, so they start after.
        env = [self._start_environment()] if c.environment else []
        await gather_all(
            self._start_and_wait(
                self.child("weights", self._py("services.weights", dataclasses.replace(
                    c.weights, run_id=rid, model_dir=model, log_file=str(self._log_file("weights"))))),
                lambda nc: request(nc, subjects.weights_get(), WeightsGet(), WeightManifest, timeout=1),
            ),
            self._start_and_wait(
                self.child("kv", self._py("services.kv", dataclasses.replace(
                    c.kv, run_id=rid, model_dir=model, engine_ids=tuple(self.engine_ids),
                    log_file=str(self._log_file("kv"))))),
                lambda nc: request(nc, subjects.kv_get(), KvGet(engine_id=self.engine_ids[0]), ArenaDesc, timeout=1),
            ),
            self._start_and_wait(
                self.child("router", self._py("services.router", dataclasses.replace(
                    c.router, model_dir=str(model),
                    engine_ids=(*self.engine_ids, *c.remote_engine_ids),
                    log_file=str(self._log_file("router"))))),
                lambda nc: router_status(nc, timeout=1),
            ),
            *env,
        )  # fmt: skip
        # The engines, then the controller (it routes to them), beside the trainer: it needs
        # only the weight store, and a worker that is still preparing when the trainer pushes
        # reads the store's current version once it follows the store (``watch_weights``).
        await self.engines.start_all()
        await gather_all(self._start_controller(), *([self._start_trainer()] if c.training else []))
        await self._watch_children()
        if c.metrics_port >= 0:
            self.metrics = MetricsEndpoint(c.metrics_port, c.metrics_addr, log)
            self.metrics_url = await self.metrics.start(self.nc)
        self.ready = True
        self._write_node()
        await self.publish(NodeReady(engines=self.engine_ids, run_id=self.run_id))
        log.info("node_ready", nats_url=self.nats_url, engines=self.engine_ids, run_id=self.run_id)

    async def _start_controller(self) -> None:
        """Start the controller once every engine answers (it adopts a previous incarnation's
        rollouts at start and routes them to the engines) and wait until it answers."""
        c = self.config
        await self._wait_engines()
        await self._start_and_wait(
            self.child("controller", self._py("services.controller", dataclasses.replace(
                c.controller, model_dir=str(self.model_dir),
                log_file=str(self._log_file("controller")),
                max_prompt_tokens=c.router.limits.max_prompt_tokens))),
            self._controller_probe,
        )  # fmt: skip

    async def _start_trainer(self) -> None:
        """Start the trainer and wait until it answers its status request; it needs only the
        weight store, so it starts beside the engines."""
        await self._start_and_wait(
            self.child("trainer", self._py("services.trainer", self.trainer_config()),
                stop_timeout=TRAINER_STOP_TIMEOUT_S),
            lambda nc: request(nc, subjects.trainer_status(), TrainerStatusRequest(), TrainerStatus, timeout=1),
        )  # fmt: skip

    async def _watch_children(self) -> None:
        """Watch every child: the engines' workers and shadows through ``self.engines`` (with
        the handover events it follows), the others here."""
        self.watchers = [
            asyncio.create_task(self.watch(child), name=f"watch_{child.name}")
            for child in self.children.values()
            if not child.name.startswith(("worker-", "shadow-"))
        ]
        self.engines.watch_all()
        await self.engines.subscribe()

    def _watch_owner(self) -> None:
        """With ``owner_pid``: stop the node the moment that process exits (its pidfd turns
        readable), or at once if it is gone already."""
        pid = self.config.owner_pid
        if pid <= 0:
            return
        watch = PidWatch(pid)
        fd = watch.fd
        if fd is None:
            self._owner_gone(pid)
            return
        loop = asyncio.get_running_loop()

        def gone() -> None:
            loop.remove_reader(fd)
            watch.close()
            self._owner_gone(pid)

        loop.add_reader(fd, gone)
        self.owner_watch = (watch, loop)

    def _owner_gone(self, pid: int) -> None:
        log.warning("owner_exited", owner_pid=pid)
        self.stop_requested.set()

    async def _setup_env_host(self) -> None:
        """A host that joined a deployment to run only its sandboxes: the environment service
        (the deployment's controller calls it). This supervisor serves no ``supervisor.*``
        subject — those are the deployment's node's; ``belayer down`` here signals it."""
        await self._start_environment()
        self.watchers = [
            asyncio.create_task(self.watch(child), name=f"watch_{child.name}")
            for child in self.children.values()
        ]
        self.engine_ids = []
        self.ready = True
        self._write_node()
        log.info("env_host_ready", nats_url=redact(self.nats_url), run_id=self.run_id)

    async def _setup_engine_host(self) -> None:
        """A host that joined a deployment to run rollout engines: its own weight store (a
        mirror of the node's versions) and KV arena on ``belayer.host.<host>.*``, then a
        worker and a shadow per engine, registered with the deployment's router. Like an
        env host it serves no ``supervisor.*`` subject."""
        c, host, model = self.config, self.config.host_name, self.model_dir
        await self._start_and_wait(
            self.child("weights", self._py("services.weights", dataclasses.replace(
                c.weights, run_id=self.run_id, model_dir=model, host=host,
                log_file=str(self._log_file("weights"))))),
            lambda nc: request(nc, subjects.weights_get(host), WeightsGet(), WeightManifest, timeout=1),
        )  # fmt: skip
        await self._start_and_wait(
            self.child("kv", self._py("services.kv", dataclasses.replace(
                c.kv, run_id=self.run_id, model_dir=model, engine_ids=tuple(self.engine_ids),
                host=host, log_file=str(self._log_file("kv"))))),
            lambda nc: request(nc, subjects.kv_get(host), KvGet(engine_id=self.engine_ids[0]), ArenaDesc, timeout=1),
        )  # fmt: skip
        await self.engines.start_all()
        await self._wait_engines()
        await self._watch_children()
        self.ready = True
        self._write_node()
        log.info("engine_host_ready", nats_url=redact(self.nats_url), engines=self.engine_ids)

    async def _start_environment(self) -> None:
        """The environment service of this host, started, registered and answering its ping. In a
        deployment (``--join``) its ready checkpoints also go to the object store, so that
        another host can restore its sandboxes when it dies."""
        store = self.config.env.checkpoint_store or bool(self.config.nats_url)
        await self._start_and_wait(
            self.child("environment", self._py("services.environment", dataclasses.replace(
                self.config.env, run_dir=self.paths.root, node=node_label(self.run_id),
                log_file=str(self._log_file("environment")), checkpoint_store=store)),
                stop_timeout=ENV_STOP_TIMEOUT_S),
            self._env_probe,
        )  # fmt: skip

    async def _env_probe(self, nc: NATS) -> Any:
        """This host's own environment service answers its ping (served once it registered):
        ``env.list`` would be answered by any host of a deployment."""
        from schemas.env import EnvHostInfo, EnvPing

        ping = subjects.env_host(node_label(self.run_id), "ping")
        return await request(nc, ping, EnvPing(), EnvHostInfo, timeout=2)

    async def _controller_probe(self, nc: NATS) -> Any:
        """The controller answers ``rollout.status`` (``not_found`` for a probe id: it is up)."""
        from schemas.rollout import RolloutResult, RolloutStatusRequest

        try:
            return await request(
                nc, subjects.rollout_status(), RolloutStatusRequest(rollout_id="probe"),
                RolloutResult, timeout=2,
            )  # fmt: skip
        except NotFound:
            return None

    async def _start_and_wait(self, child: Child, probe: Callable[[NATS], Awaitable[Any]]) -> None:
        await child.start()
        deadline = time.monotonic() + self.config.ready_timeout_s
        assert self.nc is not None
        while True:
            if not child.alive:
                raise BelayerError(f"{child.name} exited at start; see {child.log_path}")
            try:
                await probe(self.nc)
                log.info("service_ready", name=child.name, pid=child.pid)
                return
            except BelayerError:
                if time.monotonic() > deadline:
                    raise Timeout(f"{child.name} not ready", log=str(child.log_path)) from None
                await asyncio.sleep(0.05)  # bounded readiness poll of a starting process

    async def _wait_engines(self) -> None:
        assert self.nc is not None
        deadline = time.monotonic() + self.config.ready_timeout_s
        while True:
            for eid in self.engine_ids:
                child = self.children[f"worker-{eid}"]
                if not child.alive:
                    raise BelayerError(f"{child.name} exited at start; see {child.log_path}")
            try:
                st = await router_status(self.nc, timeout=1)
                if {e.id for e in st.engines} >= set(self.engine_ids):
                    return
            except BelayerError:
                pass
            if time.monotonic() > deadline:
                raise Timeout("engines did not register", engines=self.engine_ids)
            await asyncio.sleep(0.05)  # bounded readiness poll

    # --- supervision ------------------------------------------------------------------------
    async def watch(self, child: Child) -> None:
        """Restart ``child`` whenever it exits unexpectedly."""
        while True:
            assert child.proc is not None
            code = await child.proc.wait()
            if child.stopping or self.stop_requested.is_set():
                return
            ran = time.monotonic() - child.started_at
            delay = child.backoff.next_delay(ran)
            log.warning(
                "service_exited",
                name=child.name,
                code=code,
                ran_s=round(ran, 2),
                restart_in_s=delay,
            )
            await self.publish(
                ServiceExited(name=child.name, code=code, pid=child.pid, ran_s=round(ran, 3))
            )
            try:
                await asyncio.wait_for(self.stop_requested.wait(), delay)
                return
            except TimeoutError:
                pass
            child.started_at = time.monotonic()  # a start that fails counts as a crash at once
            with isolated(log, "watch", name=child.name):  # retried after the next backoff
                await child.start()
                log.info(
                    "service_restarted",
                    name=child.name,
                    pid=child.pid,
                    restarts=child.backoff.restarts,
                )
                await self.publish(
                    ServiceRestarted(
                        name=child.name, pid=child.pid, restarts=child.backoff.restarts
                    )
                )

    async def publish(self, event: EventBase) -> None:
        """Best effort: an event that cannot be published is logged, never raised into a
        watcher (a lost event must not stop the restarts)."""
        if self.nc is not None:
            with isolated(log, "publish", kind=event.kind):
                await events.publish(self.nc.jetstream(), event)

    async def _on_status(self, _req: SupervisorStatusRequest, _msg: Msg) -> SupervisorStatus:
        now = time.monotonic()
        procs = [
            ProcInfo(
                name=c.name,
                pid=c.pid,
                alive=c.alive,
                restarts=c.backoff.restarts,
                uptime_s=round(now - c.started_at, 3) if c.alive else 0.0,
            )
            for c in self.children.values()
        ]
        return SupervisorStatus(run_id=self.run_id, pid=os.getpid(), ready=self.ready, procs=procs)

    async def _on_stop(self, req: StopNode, _msg: Msg) -> Ok:
        log.info("stop_requested", reason=req.reason)
        self.stop_requested.set()
        return Ok(detail="stopping")

    async def metrics_loop(self) -> None:
        """Read the router's status for the metrics endpoint (nothing when it is off)."""
        if self.metrics is not None:
            await self.metrics.poll_loop()

    # --- stop -------------------------------------------------------------------------------
    async def close(self) -> None:
        """Stop services in reverse start order, then NATS; remove shm files and node file.
        (The supervisor's own connection is already drained; the children drain theirs.)"""
        self.stop_requested.set()
        if self.owner_watch is not None and (fd := self.owner_watch[0].fd) is not None:
            self.owner_watch[1].remove_reader(fd)
            self.owner_watch[0].close()
        for w in [*self.watchers, *self.engines.tasks]:
            w.cancel()
        if self.metrics is not None:
            self.metrics.close()
        for child in reversed(list(self.children.values())):
            await child.stop()
        if self.config.environment:  # whatever a killed environment service left behind
            cleanup = await asyncio.to_thread(
                remove_node_sandboxes, node_label(self.run_id), self.paths.root
            )
            if cleanup.containers or cleanup.checkpoint_dirs or cleanup.error:
                log.warning(
                    "sandbox_leftovers_removed",
                    containers=cleanup.containers,
                    checkpoint_dirs=cleanup.checkpoint_dirs,
                    error=cleanup.error,
                )
        if self.nats is not None:
            await asyncio.to_thread(self.nats.stop)
        removed = remove_shm_files(self.run_id)
        shutil.rmtree(self.paths.heartbeats, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            self.paths.node_file.unlink()
        log.info("node_stopped", removed_shm_files=removed)

    def _write_node(self) -> None:
        NodeInfo(
            nats_url=self.nats_url,
            run_id=self.run_id,
            supervisor_pid=os.getpid(),
            nats_pid=self.nats.pid if self.nats else None,
            model_dir=str(self.model_dir),
            engines=self.engine_ids,
            recovery=self.config.recovery,
            started_at=time.time(),
            ready=self.ready,
            creds_dir=str(self.creds_dir or ""),
            tls_ca=self.config.bus.tls_ca,
            tls_cert=self.config.bus.tls_cert,
            tls_key=self.config.bus.tls_key,
            role=self.config.role,
            metrics_url=self.metrics_url,
            owner_pid=self.config.owner_pid,
        ).write(self.paths)

    def identities(self) -> list[str]:
        """The identity names this node's processes connect as."""
        return node_identity_names(self.config)


def identity_of(module: str, config: Any) -> str:
    """The identity a service module runs as: its role, one per engine for the rollout
    workers, main and shadow alike (``engine-<id>``)."""
    role = module.rsplit(".", 1)[-1]
    if role == "worker":
        return f"engine-{config.engine_id}"
    return role


async def run(
    config: SupervisorConfig, *, stop: asyncio.Event, ready: asyncio.Event | None = None
) -> None:
    """Run the node until ``stop`` or a ``supervisor.stop`` request (see ``Supervisor``)."""
    await run_service(Supervisor(config), stop=stop, ready=ready)


def engine_host_auth(config: SupervisorConfig, auth_dir: Path) -> list[Identity]:
    """The identities of every declared engine host, each under ``<auth_dir>/<name>`` (the
    directory that host's ``belayer up --creds-dir`` is given)."""
    out: list[Identity] = []
    for spec in config.engine_hosts:
        name, engines = parse_engine_host(spec)
        ids = host_engine_ids(name, engines)
        out += ensure_identities(auth_dir / name, engine_host_identities(name, ids))
    return out
