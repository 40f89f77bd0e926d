"""A repeatedly failing engine, on its own real 2-engine node (deterministic mode, token-log
chunk k = 16): e0's main worker is killed, then its successor inside the failure window; e0 is
marked unhealthy with an alert, its requests move to e1 and complete with exactly the tokens of
an uninterrupted run, and the supervisor retires it. A node of its own, so no other test runs
on a node with a retired engine (the tests do not depend on their order)."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
from nats.aio.client import Client as NATS

from common.errors import EngineUnavailable
from common.events import EventTail
from schemas.events import (
    EngineRetired,
    EngineUnhealthy,
    HandoverComplete,
)
from services.router.client import generate
from tests.chaos.chaos_helpers import (
    check_all,
    launch,
    mark,
    prompt,
    references,
)
from tests.integration.node_helpers import (
    Node,
    greedy,
    main_pids,
    node_processes,
    sampled,
    wait_until,
)

pytestmark = pytest.mark.timeout(240)

K = 16
"""Token-log chunk: as ``test_router_chaos.py``."""
NODE_ARGS = ("--engines", "2", "--token-log-chunk", str(K), "--deterministic")
"""The module's node (``tests/node_fixtures.py``)."""


async def test_repeated_failure_marks_engine_unhealthy_and_retires_it(
    node: Node, bus: tuple[NATS, EventTail]
) -> None:
    """Kill e0's main worker, then its successor inside the failure window: e0 is marked
    unhealthy with an alert, its requests move to e1 and complete unchanged (the sampled one
    too: deterministic mode makes the continuation on another engine exact), `status --json`
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
