"""Baseline mode on a real node: a forged `engine_failed` event does not make the supervisor
restart a healthy worker cold (it asks the router first), while a real failure still does."""

from __future__ import annotations

import os
import signal
import time

import pytest

from common import events
from common.bus import connect
from common.events import EventTail
from schemas.events import EngineFailedEvent, EngineRegistered, ServiceRestarted
from services.router.client import generate
from tests.integration.node_helpers import (
    Node,
    greedy,
    log_lines,
    router_status,
    supervisor_pids,
    wait_until,
)

pytestmark = pytest.mark.timeout(240)
NODE_ARGS = ("--recovery", "baseline", "--heartbeat-interval", "1", "--failure-window", "0")
"""The module's node (``tests/node_fixtures.py``): baseline recovery, a 1 s remote heartbeat."""


async def test_a_forged_failure_event_restarts_nothing(node: Node) -> None:
    nc = await connect(node.nats_url, name="client", bus=node.bus())
    forger = await connect(node.nats_url, name="forger", bus=node.bus("engine-e0"))
    log = await EventTail(nc).start()
    try:
        main = (await supervisor_pids(nc))["worker-e0"]
        e0 = next(e for e in (await router_status(nc)).engines if e.id == "e0")
        seen = len(log_lines(node, "supervisor", "event_not_confirmed"))
        t0 = time.time()
        forged = EngineFailedEvent(
            engine_id="e0", epoch=e0.epoch, pid=main, reason="forged", request_ids=[]
        )
        await events.publish(forger.jetstream(), forged)  # any service may publish events
        await wait_until(
            lambda: len(log_lines(node, "supervisor", "event_not_confirmed")) > seen,
            timeout=15,
            what="the supervisor asked the router before restarting anything",
        )
        (checked,) = log_lines(node, "supervisor", "event_not_confirmed")[seen:]
        assert (checked["action"], checked["router_state"]) == ("cold_restart", "up")
        assert not log.matching(ServiceRestarted, after=t0)
        assert (await supervisor_pids(nc))["worker-e0"] == main
        res = await generate(nc, greedy("after-forged", n=8), timeout=60)
        assert len(res.token_ids) == 8
        # A real failure, seen by the router's heartbeat, is still restarted cold.
        os.kill(main, signal.SIGKILL)
        await log.wait_for(EngineFailedEvent, "e0", pid=main, reason="heartbeat", timeout=30)
        restarted = await log.wait_for(EngineRegistered, "e0", old_pid=main, timeout=90)
        assert restarted.pid != main
        res = await generate(nc, greedy("after-restart", n=8), timeout=60)
        assert len(res.token_ids) == 8
    finally:
        await log.stop()
        await forger.drain()
        await nc.drain()
