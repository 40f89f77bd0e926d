"""Chaos on the control plane and on a repeatedly failing engine, on one real 2-engine node with
a small token-log chunk (k = 16) so the durable log is what a restarted router resumes from.

Order matters (module-scoped node): the router is killed first; the repeated-failure test
retires engine e0 and so runs last.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from common.errors import EngineUnavailable
from schemas.events import (
    EngineRetired,
    EngineUnhealthy,
    HandoverComplete,
    ServiceRestarted,
    ShadowReady,
)
from services.router.client import generate
from tests.chaos.test_worker_chaos import (
    check,
    check_all,
    launch,
    mark,
    prompt,
    references,
)
from tests.integration.node_helpers import (
    EventLog,
    Node,
    greedy,
    main_pids,
    node_processes,
    router_status,
    sampled,
    supervisor_pids,
    wait_until,
)

pytestmark = pytest.mark.timeout(240)

K = 16
"""Token-log chunk: a restarted router regenerates fewer than k tokens per request."""
NODE_ARGS = ("--engines", "2", "--token-log-chunk", str(K))
"""The module's node (``tests/node_fixtures.py``)."""


@pytest_asyncio.fixture
async def bus(node: Node) -> AsyncIterator[tuple[object, EventLog]]:
    from common.bus import connect

    nc = await connect(node.nats_url, name="chaos")
    events = await EventLog(nc).start()
    try:
        for eid in ("e0", "e1"):
            await events.wait_for(ShadowReady, eid, timeout=60)
        yield nc, events
    finally:
        await events.stop()
        await nc.drain()


@pytest.mark.parametrize(
    ("n", "kinds"),
    [
        pytest.param(160, "gs", id="mixed-workers-finish-while-router-down"),
        pytest.param(1200, "gg", id="greedy-workers-still-generating-when-router-returns"),
        pytest.param(1200, "ss", id="sampled-long"),
    ],
)
async def test_router_killed_mid_stream_resumes_from_the_token_log(
    bus: tuple[object, EventLog], n: int, kinds: str
) -> None:
    """SIGKILL the router while 4 requests stream; the supervisor restarts it, it rebuilds them
    from REQUESTS + TOKENS and the callers' streams carry on: same tokens as the reference, at
    most k tokens re-sent (identical ones), one result each. With 160 tokens the workers finish
    while the router is down (its restart takes seconds); with 1200 they are still generating
    the old copies when the new router resubmits the requests."""
    nc, events = bus
    reqs = []
    for i in range(4):
        rid = f"rk{n}{kinds}-{i}"
        kind = kinds[i % 2]
        reqs.append(
            greedy(rid, prompt(70 + i), n)
            if kind == "g"
            else sampled(rid, prompt(70 + i), n, seed=11 + i)
        )
    ref = await references(nc, reqs)
    router_pid = (await supervisor_pids(nc))["router"]
    finished0 = (await router_status(nc)).finished
    recs, tasks = launch(nc, reqs)
    await asyncio.gather(*(r.wait_tokens(2 * K + 5) for r in recs))
    t_kill = time.time()
    os.kill(router_pid, signal.SIGKILL)
    await events.wait_for(ServiceRestarted, after=t_kill, name="router", timeout=30)
    results = list(await asyncio.gather(*tasks))
    # The restarted router adopts what the live workers hold: nothing is generated again, so
    # even sampled requests match the uninterrupted run exactly.
    for rec, q in zip(results, reqs, strict=True):
        check(rec, ref[q.request_id], exact=True, resent_ok=True)
    for rec in results:
        assert all(n <= K for n in rec.overlaps), f"{rec.request_id} re-sent {rec.overlaps}"
        assert sum(rec.overlaps) <= K
    st = await router_status(nc)
    assert st.inflight == 0
    # The restarted router rebuilt its finished set from the log: each request counts once.
    assert st.finished >= len(reqs) and st.finished <= finished0 + len(reqs)
    # Resubmitting a finished id replays the result; nothing runs again.
    again = await generate(nc, reqs[0], timeout=30)
    assert again.token_ids == results[0].tokens


async def test_repeated_failure_marks_engine_unhealthy_and_retires_it(
    node: Node, bus: tuple[object, EventLog]
) -> None:
    """Kill e0's main worker, then its successor inside the failure window: e0 is marked
    unhealthy with an alert, its requests move to e1 and complete unchanged, `status --json`
    shows it unhealthy, the supervisor retires it (no process left), and e1 keeps serving."""
    nc, events = bus
    reqs = [
        greedy("uh-g0", prompt(80), 200, engine_id="e0"),
        sampled("uh-s0", prompt(81), 200, seed=21, engine_id="e0"),
        greedy("uh-g1", prompt(82), 200, engine_id="e0"),
        greedy("uh-o", prompt(83), 200, engine_id="e1"),
    ]
    ref = await references(nc, reqs)
    first = (await main_pids(nc))["e0"]
    recs, tasks = launch(nc, reqs)
    await recs[0].wait_tokens(5)
    mark(recs)
    os.kill(first, signal.SIGKILL)
    done = await events.wait_for(HandoverComplete, "e0", old_pid=first, timeout=30)
    second = done.pid
    held = len(recs[0].tokens)
    await recs[0].wait_tokens(held + 3)  # the resumed requests run on the successor
    os.kill(second, signal.SIGKILL)
    unhealthy = await events.wait_for(EngineUnhealthy, "e0", timeout=30)
    assert unhealthy.alert is True
    retired = await events.wait_for(EngineRetired, "e0", timeout=30)
    assert retired.engine_id == "e0"
    results = list(await asyncio.gather(*tasks))
    check_all(results, reqs, ref)
    for rec in results:
        assert rec.result is not None
        if rec.request_id != "uh-o":
            assert rec.result.engine_ids[-1] == "e1", rec.result.engine_ids
    # The CLI's view: e0 unhealthy; no process of e0 left; e1 keeps serving.
    st = node.status()
    health = {e["id"]: e["healthy"] for e in st["engines"]}
    assert health == {"e0": False, "e1": True}
    await wait_until(
        lambda: not node_processes(node, "--engine-id e0"),
        timeout=10,
        what="engine e0 has no worker or shadow process",
    )
    procs = node.status()["procs"]
    assert not [p for p in procs if p["name"].endswith("-e0") and p["alive"]], procs
    after = await generate(nc, greedy("uh-after", prompt(84), 16), timeout=30)
    assert after.engine_ids == ["e1"] and len(after.token_ids) == 16
    with pytest.raises(EngineUnavailable):
        await generate(nc, greedy("uh-pinned", prompt(85), 8, engine_id="e0"), timeout=10)
