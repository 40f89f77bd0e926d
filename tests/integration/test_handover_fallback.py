"""A failed handover does not leave the engine down (real node: nats-server, weight store, KV
arena, router, worker, shadow, supervisor — all real processes).

The failure seen under load, made deterministic: the main worker stalls (SIGSTOP), the shadow
finds it hung and reports it to the router — which takes the engine down for good — but the
shadow's post-takeover health check times out (the weight store is frozen with SIGSTOP, so
``weights.get`` gets no answer) and the shadow exits. The stalled worker then resumes, and the
restarted shadow sees it alive: before the fix nothing ever started a worker the router would
take again. Now the supervisor sees the takeover fail (``handover_failed``), kills the stalled
worker, starts the main worker cold, and the engine serves again.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from common.events import EventTail
from schemas.events import (
    HandoverDetected,
    HandoverFailed,
    ServiceExited,
    ServiceRestarted,
    ShadowReady,
)
from tests.integration.node_helpers import (
    Node,
    greedy,
    pid_gone,
    router_status,
    stream_generate,
    supervisor_pids,
    wait_until,
)

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

NODE_ARGS = ("--engines", "1", "--handover-timeout", "10")
"""One engine with a shadow (belayer mode)."""


@pytest_asyncio.fixture
async def bus(node: Node) -> AsyncIterator[tuple[object, EventTail]]:
    """A client and the node's event log, once e0's shadow is warm."""
    nc = await node.connect("handover-fallback")
    events = await EventTail(nc).start()
    try:
        await events.wait_for(ShadowReady, "e0", timeout=120)
        yield nc, events
    finally:
        await events.stop()
        await nc.drain()


def signal_quietly(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


async def test_a_shadow_that_dies_during_the_takeover_leads_to_a_cold_restart(
    bus: tuple[object, EventTail],
) -> None:
    nc, events = bus
    procs = await supervisor_pids(nc)
    main, shadow, weights = procs["worker-e0"], procs["shadow-e0"], procs["weights"]
    before = next(e for e in (await router_status(nc)).engines if e.id == "e0")
    assert before.state == "up" and before.worker_pid == main

    signal_quietly(weights, signal.SIGSTOP)  # the shadow's health check will time out
    try:
        signal_quietly(main, signal.SIGSTOP)  # the main worker stalls
        try:
            detected = await events.wait_for(HandoverDetected, "e0", old_pid=main, timeout=30)
        finally:
            signal_quietly(main, signal.SIGCONT)  # ... and resumes: alive, heartbeating again
        assert detected.verdict == "hung"
        await events.wait_for(ServiceExited, name="shadow-e0", pid=shadow, timeout=30)
    finally:
        signal_quietly(weights, signal.SIGCONT)

    failed = await events.wait_for(HandoverFailed, "e0", old_pid=main, timeout=30)
    assert failed.reason == "shadow_exited" and failed.shadow_pid == shadow
    restarted = await events.wait_for(
        ServiceRestarted, name="worker-e0", mode="cold", after=detected.ts, timeout=30
    )
    assert restarted.pid not in (None, main, shadow)
    await wait_until(lambda: pid_gone(main), timeout=10, what=f"stalled worker {main} is killed")

    async def serves_again() -> bool:
        eng = next(e for e in (await router_status(nc)).engines if e.id == "e0")
        return eng.state == "up" and eng.healthy and eng.worker_pid == restarted.pid

    await wait_until(serves_again, timeout=120, what="e0 is up on the cold-restarted worker")
    assert len(events.matching(HandoverFailed, "e0")) == 1, "one fallback, not two"
    rec = await stream_generate(nc, greedy("after-fallback", n=16, engine_id="e0"), timeout=60)
    assert rec.result is not None and len(rec.tokens) == 16
    # and the engine has a warm standby again
    await events.wait_for(ShadowReady, "e0", after=failed.ts, timeout=120)
