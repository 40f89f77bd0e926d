"""Baseline mode (`belayer up --recovery baseline`), the comparison the benchmarks use: no
shadow; the router's remote heartbeat finds the dead worker; the supervisor restarts it cold
(weights read from disk); interrupted requests are regenerated from the prompt — and the
caller still sees each token once."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from common.bus import connect
from common.events import EventTail
from schemas.events import EngineFailedEvent, EngineRegistered
from tests.integration.node_helpers import (
    Node,
    StreamRecord,
    greedy,
    main_pids,
    stream_generate,
)

pytestmark = pytest.mark.timeout(180)
NODE_ARGS = ("--recovery", "baseline", "--heartbeat-interval", "1")
"""The module's node (``tests/node_fixtures.py``): baseline recovery, a 1 s remote heartbeat."""


async def test_baseline_detects_by_heartbeat_restarts_cold_and_regenerates(node: Node) -> None:
    nc = await connect(node.nats_url, name="baseline", bus=node.bus())
    events = await EventTail(nc).start()
    try:
        st = node.status()
        assert not [p for p in st["procs"] if p["name"].startswith("shadow-")], (
            "baseline has no shadow"
        )
        req = greedy("bl-victim", "the baseline restarts cold", 200)
        reference = (
            await stream_generate(nc, greedy("bl-ref", "the baseline restarts cold", 200))
        ).tokens
        pid = (await main_pids(nc))["e0"]
        rec = StreamRecord(req.request_id)
        task = asyncio.create_task(stream_generate(nc, req, record=rec, timeout=120))
        await rec.wait_tokens(40)
        os.kill(pid, signal.SIGKILL)
        failed = await events.wait_for(EngineFailedEvent, "e0", pid=pid, timeout=30)
        assert failed.reason == "heartbeat"
        restarted = await events.wait_for(EngineRegistered, "e0", old_pid=pid, timeout=60)
        await task
        assert rec.result is not None
        assert rec.tokens == reference  # greedy: the regenerated prefix is identical
        assert rec.overlaps == []  # the caller never saw a token twice
        assert rec.result.regenerated > 0  # the baseline's cost, reported
        assert rec.result.resumes >= 1 and restarted.pid != pid
    finally:
        await events.stop()
        await nc.drain()
