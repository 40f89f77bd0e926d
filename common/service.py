"""The one service shape: every service process runs the same lifecycle.

A service is a ``Service`` subclass (what it serves, its loops, what it releases) run by
``run_service``:

1. STARTING — ``open()``: local resources that need no bus (shared memory, a nats-server);
2. connect to ``nats_url`` as the config's ``bus`` says (credentials, TLS), declare every stream and KV bucket (``ensure_jetstream``), make
   ``server``;
3. ``setup()``: serve subjects (each is live on the server when ``serve`` returns), claim state;
4. every ``*_loop`` coroutine method runs as a task of that name in one ``asyncio.TaskGroup``;
5. READY — ``ready`` is set (in-process callers); the supervisor sees readiness by probing the
   service with a real request, which answers from this point on;
6. DRAINING — on ``stop`` (SIGTERM) or ``stop_requested``: ``drain()`` stops taking requests and
   lets in-flight handlers finish and reply (``Server.drain``), then the loops are cancelled and
   the connection is drained;
7. STOPPED — ``close()`` always runs, after a failed start too: release local resources.

``main`` is the whole of a service's ``__main__``: flags from the config dataclass, logging,
signals (SIGTERM → drain, a second signal → cancel), an exit code.
"""

from __future__ import annotations

import asyncio
import enum
import inspect
import os
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, NoReturn, Protocol, TypeVar

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from common.auth import BusConfig
from common.bus import Server, connect, ensure_jetstream
from common.config import parse_config
from common.errors import BelayerError
from common.logging import configure, get_logger


@dataclass(frozen=True)
class ServiceConfig:
    """What every service's config holds; each service's frozen config extends it (its own
    fields follow these three)."""

    nats_url: str = "nats://127.0.0.1:4222"
    """The bus."""
    bus: BusConfig = field(default_factory=BusConfig)
    """Credentials and TLS for the bus (``--bus-creds`` …; the supervisor fills them in)."""
    log_file: str = ""
    """JSON log file (empty: stderr)."""


class BusClientConfig(Protocol):
    """What the lifecycle reads of a config: a ``ServiceConfig``, or the supervisor's (whose
    log file is derived from its run directory)."""

    @property
    def nats_url(self) -> str: ...

    @property
    def bus(self) -> BusConfig: ...

    @property
    def log_file(self) -> str | Path: ...


C = TypeVar("C", bound=BusClientConfig)

DISCONNECT_TIMEOUT_S = 5.0
"""Longest wait for the connection's own drain (flushing what was published) at the end."""


class Status(enum.Enum):
    """Lifecycle of every service."""

    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"


class Service(Generic[C]):
    """Base of every service; subclasses override the hooks they need (all default to nothing,
    ``drain`` to draining ``server``). ``nc``, ``js`` and ``server`` exist from ``setup`` on."""

    name: str = "service"
    """Logger ``service`` field and NATS connection name."""
    drain_timeout_s: float = 10.0
    """Longest wait for in-flight handlers when draining."""
    owns_jetstream: bool = False
    """Whether this service updates stream declarations that differ (the supervisor: its
    identity may); others only create what is missing."""

    nc: NATS
    js: JetStreamContext
    server: Server

    def __init__(self, config: C, *, name: str | None = None) -> None:
        self.config = config
        if name is not None:
            self.name = name
        self.nats_url: str = config.nats_url
        """The bus ``run_service`` connects to (``open`` may set it, e.g. to a server it started)."""
        self.bus: BusConfig = config.bus
        """Credentials, TLS and replica count for that connection (the config's ``bus``)."""
        self.status = Status.STARTING
        self.stop_requested = asyncio.Event()
        """Set to stop the service from inside (a stop request); set by the lifecycle as soon as
        it starts draining, so loops and watchers can tell the service is stopping."""
        self.log = get_logger(service=self.name)

    async def open(self) -> None:
        """Before connecting: local resources."""

    async def setup(self) -> None:
        """Connected: serve subjects, claim state. The service is READY when this returns."""

    def loops(self) -> dict[str, Callable[[], Coroutine[Any, Any, None]]]:
        """The long-running tasks, by name: every coroutine method named ``*_loop``."""
        return {
            name: getattr(self, name)
            for name in sorted(dir(type(self)))
            if name.endswith("_loop") and inspect.iscoroutinefunction(getattr(type(self), name))
        }

    async def drain(self) -> None:
        """Still connected, loops still running: stop taking requests and finish the ones in
        flight (their replies are sent)."""
        await self.server.drain(timeout=self.drain_timeout_s)

    async def close(self) -> None:
        """Disconnected: release local resources. Runs after a failed start too, so it must
        cope with whatever ``open``/``setup`` got to."""

    def set_status(self, status: Status, **fields: Any) -> None:
        self.status = status
        self.log.info("service_status", status=status.value, **fields)


async def run_service(
    service: Service[Any], *, stop: asyncio.Event, ready: asyncio.Event | None = None
) -> None:
    """Run ``service`` through the lifecycle above until ``stop`` (or ``stop_requested``) is set
    and it has drained. A failing loop stops the service and its error is raised (not an
    exception group)."""
    nc: NATS | None = None
    service.set_status(Status.STARTING)
    try:
        await service.open()
        nc = await connect(service.nats_url, name=service.name, bus=service.bus)
        service.nc, service.js = nc, nc.jetstream()
        await ensure_jetstream(
            service.js, replicas=service.bus.replicas, update=service.owns_jetstream
        )
        service.server = Server(nc, service=service.name)
        await service.setup()
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(loop(), name=n) for n, loop in service.loops().items()]
                service.set_status(Status.READY)
                if ready is not None:
                    ready.set()
                await _first_of(stop, service.stop_requested)
                service.stop_requested.set()
                service.set_status(Status.DRAINING)
                await service.drain()
                for task in tasks:
                    task.cancel()
        except BaseExceptionGroup as group:
            raise _first_error(group) from None
    finally:
        service.stop_requested.set()
        try:
            if nc is not None:
                await _disconnect(nc, service.log)
        finally:
            await service.close()
            service.set_status(Status.STOPPED)


async def _first_of(*events: asyncio.Event) -> None:
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()


def _first_error(group: BaseExceptionGroup[Any]) -> BaseException:
    exc = group.exceptions[0]
    return _first_error(exc) if isinstance(exc, BaseExceptionGroup) else exc


async def _disconnect(nc: NATS, log: Any) -> None:
    """Drain the connection (what was published is flushed), within ``DISCONNECT_TIMEOUT_S``;
    past it, say so and close it: a subscription whose messages nobody reads holds a drain.
    (nats-py's ``drain`` swallows its cancellation and closes the connection, so ``wait_for``
    would return as if it had finished in time.)"""
    if nc.is_closed:
        return
    drain = asyncio.ensure_future(nc.drain())
    done, _ = await asyncio.wait({drain}, timeout=DISCONNECT_TIMEOUT_S)
    if not done:
        log.warning("disconnect_timeout", timeout=DISCONNECT_TIMEOUT_S)
        drain.cancel()
        await asyncio.wait({drain})
    if not drain.cancelled() and drain.exception() is not None:
        log.debug("disconnect_failed", error=repr(drain.exception()))
    if not nc.is_closed:
        await nc.close()


def install_signal_handlers(stop: asyncio.Event, on_second: Callable[[], None]) -> None:
    """First SIGTERM/SIGINT sets ``stop`` (graceful drain); a second calls ``on_second``
    (usually: cancel the main task)."""
    loop = asyncio.get_running_loop()

    def handler() -> None:
        if stop.is_set():
            on_second()
        else:
            stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, handler)
        except (NotImplementedError, RuntimeError):  # not the main thread (tests)
            pass


def run_main(coro_factory: Callable[[asyncio.Event], Coroutine[Any, Any, None]]) -> int:
    """Run a service's ``run(config, stop=...)`` coroutine with signal handling; return an exit
    code (0 on graceful stop)."""

    async def main() -> int:
        stop = asyncio.Event()
        task = asyncio.current_task()
        assert task is not None

        def cancel() -> None:
            task.cancel()

        install_signal_handlers(stop, cancel)
        await coro_factory(stop)
        return 0

    try:
        return asyncio.run(main())
    except (KeyboardInterrupt, asyncio.CancelledError):
        return 130
    except BelayerError as exc:
        # A fatal error: one clear line (structured in the log file), a non-zero exit, and the
        # supervisor restarts the service.
        get_logger().error("service_failed", code=exc.code, error=str(exc))
        print(f"error: {exc}", file=sys.stderr)
        return 1


def main(
    config_cls: type[C],
    run: Callable[..., Coroutine[Any, Any, None]],
    argv: Sequence[str] | None = None,
    *,
    name: str | Callable[[C], str],
    prog: str | None = None,
    description: str | None = None,
) -> int:
    """A service's ``__main__``: flags → ``config_cls`` (``common.config.parse_config``), logging
    (to the config's ``log_file`` when it has one), then ``run(config, stop=...)`` until SIGTERM.
    ``name`` is the service's log name, or makes it from the config."""
    config = parse_config(config_cls, argv, prog=prog, description=description)
    log_file = config.log_file
    configure(
        name if isinstance(name, str) else name(config),
        log_file=Path(log_file) if log_file else None,
    )
    return run_main(lambda stop: run(config, stop=stop))


def exit_process(code: int) -> NoReturn:
    """End a service's process with ``code`` once its ``main`` has returned: flush the
    standard streams (the log file is line-buffered), then ``os._exit``, skipping the
    interpreter's teardown. With torch imported that teardown is ~0.6 s of garbage collection
    on two cores, and a node pays it once per service, one after another, at every stop.
    Nothing is left to it: the service's ``close`` has run, its connection is drained and its
    executor threads are joined (``asyncio.run``)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can be said
            pass
    os._exit(code)
