"""Draining against a real nats-server: a request whose handler is still running when the drain
starts is finished and answered (``Server.drain`` drains its subscriptions instead of
unsubscribing, which would cancel the handler and drop the request), new requests find no
responder, and the service lifecycle (``common.service``) goes READY → DRAINING → STOPPED with
its loops cancelled and ``close`` run."""

from __future__ import annotations

import asyncio

import pytest
from nats.aio.client import Client as NATS

from common.bus import Server, connect, request
from common.errors import BusUnavailable
from common.natsserver import NatsServer
from common.service import Service, ServiceConfig, Status, run_service
from schemas.base import Ok
from schemas.serving import CancelRequest

WAIT = 10.0


async def call(nc: NATS, request_id: str) -> Ok:
    """``t.slow`` from another connection. nats-server can answer "no responders" to a request
    published right after the server's SUB was acknowledged (seen under CPU load, ~1 in 1000
    with plain nats-py): retried, bounded — this file tests draining, not that race."""
    deadline = asyncio.get_running_loop().time() + WAIT
    while True:
        try:
            reply: Ok = await request(
                nc, "t.slow", CancelRequest(request_id=request_id), Ok, timeout=WAIT
            )
            return reply
        except BusUnavailable:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.05)  # bounded retry until the subscription is seen


class Gate:
    """A handler that answers only once released, telling when it started."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def handle(self, req: CancelRequest, _msg: object) -> Ok:
        self.entered.set()
        await asyncio.wait_for(self.release.wait(), WAIT)
        return Ok(detail=f"done {req.request_id}")


@pytest.mark.parametrize("concurrent", [False, True])
async def test_handler_in_flight_at_drain_finishes_and_replies(
    nats_server: NatsServer, nc: NATS, concurrent: bool
) -> None:
    server_nc = await connect(nats_server.url, name="drain-server")
    try:
        server = Server(server_nc, service="drain-test")
        gate = Gate()
        await server.serve("t.slow", CancelRequest, gate.handle, concurrent=concurrent)
        caller = asyncio.create_task(call(nc, "r1"))
        await asyncio.wait_for(gate.entered.wait(), WAIT)
        drain = asyncio.create_task(server.drain(timeout=WAIT))
        # The drain waits for the handler: it is still running while the request is unanswered.
        done, _ = await asyncio.wait({drain, caller}, timeout=0.2)
        assert not done, "drain returned (or the request was answered) before the handler did"
        gate.release.set()
        reply = await asyncio.wait_for(caller, WAIT)
        assert reply.detail == "done r1"
        await asyncio.wait_for(drain, WAIT)
        with pytest.raises(BusUnavailable):  # drained: nobody serves the subject any more
            await request(nc, "t.slow", CancelRequest(request_id="r2"), Ok, timeout=2)
        await server.drain()  # idempotent
    finally:
        await server_nc.drain()


_Config = ServiceConfig
"""The base every service config extends (the bus URL is all these services need)."""


class SlowService(Service[_Config]):
    """Serves ``t.slow`` through a gate and runs one loop that only ends by cancellation."""

    name = "slow"

    def __init__(self, config: _Config) -> None:
        super().__init__(config)
        self.gate = Gate()
        self.draining = asyncio.Event()
        self.loop_cancelled = asyncio.Event()
        self.closed_with: Status | None = None

    async def setup(self) -> None:
        await self.server.serve("t.slow", CancelRequest, self.gate.handle)

    async def idle_loop(self) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.loop_cancelled.set()
            raise

    async def drain(self) -> None:
        self.draining.set()
        await super().drain()

    async def close(self) -> None:
        self.closed_with = self.status


async def test_service_lifecycle_drains_in_flight_request(
    nats_server: NatsServer, nc: NATS
) -> None:
    service = SlowService(_Config(nats_url=nats_server.url))
    assert list(service.loops()) == ["idle_loop"]
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(run_service(service, stop=stop, ready=ready))
    await asyncio.wait_for(ready.wait(), WAIT)
    assert service.status is Status.READY
    caller = asyncio.create_task(call(nc, "r1"))
    await asyncio.wait_for(service.gate.entered.wait(), WAIT)
    stop.set()  # what SIGTERM does
    await asyncio.wait_for(service.draining.wait(), WAIT)
    assert service.status is Status.DRAINING and not caller.done()
    service.gate.release.set()
    reply = await asyncio.wait_for(caller, WAIT)
    assert reply.detail == "done r1"
    await asyncio.wait_for(task, WAIT)
    assert service.loop_cancelled.is_set()
    assert service.closed_with is Status.DRAINING  # close ran after the drain
    assert service.status is Status.STOPPED
    assert service.nc.is_closed


async def test_failing_loop_stops_the_service_with_its_error(nats_server: NatsServer) -> None:
    class Failing(Service[_Config]):
        closed = False

        async def broken_loop(self) -> None:
            raise RuntimeError("loop broke")

        async def close(self) -> None:
            self.closed = True

    service = Failing(_Config(nats_url=nats_server.url))
    with pytest.raises(RuntimeError, match="loop broke"):  # the error itself, not a group
        await asyncio.wait_for(run_service(service, stop=asyncio.Event()), WAIT)
    assert service.closed and service.status is Status.STOPPED
