"""Chaos on rollout workers, on one real 2-engine node (real nats-server, real processes): kill
main workers at random points (prefill included, several requests in flight), hang one with
SIGSTOP, kill both engines at once, forge stale-epoch output. Every caller must get exactly the
tokens of an uninterrupted run — greedy and seeded sampled alike, since the node runs in
deterministic mode (a request's tokens depend only on weights, prompt, sampling and seed, not on
the batch or on prefill- vs decode-built KV) — each once, all from one weight version.

The node runs with a 1 s failure window so that the repeated kills here (seconds apart, each
after the previous handover finished and a fresh shadow is warm) are independent failures; the
repeated-failure path (unhealthy engine) is in ``test_router_chaos.py``.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from nats.aio.client import Client as NATS

from common import subjects
from common.bus import connect
from common.codec import encode
from common.events import EventTail
from schemas.events import (
    HandoverComplete,
    HandoverDetected,
    HandoverHealthOk,
    ResidualKilled,
    ShadowReady,
    StaleOutputRejected,
)
from schemas.serving import GenerateRequest, SeqDelta, StepBatch
from tests.chaos.chaos_helpers import SEED, check, check_all, launch, mark, prompt, references
from tests.integration.node_helpers import (
    Node,
    greedy,
    main_pids,
    pid_gone,
    router_status,
    sampled,
    wait_until,
)

pytestmark = pytest.mark.timeout(240)

ENGINES = ("e0", "e1")
N = 192
"""Tokens per request: long enough that kills land mid-stream (a kill after at most
``KILL_BY`` tokens leaves ~150 to go, so a test process descheduled on a loaded machine still
kills before the end), short enough for 2 CPUs."""
KILL_BY = 48
"""Random kills land after 1 … ``KILL_BY - 1`` tokens of the victim's greedy request."""
NODE_ARGS = ("--engines", "2", "--failure-window", "1", "--deterministic")
"""The module's node (``tests/node_fixtures.py``): two engines, a 1 s failure window,
deterministic mode (sampled requests are then compared exactly too)."""


@pytest_asyncio.fixture
async def bus(node: Node) -> AsyncIterator[tuple[NATS, EventTail]]:
    """A client and the node's event log; waits until every engine has a warm shadow."""
    nc = await connect(node.nats_url, name="chaos", bus=node.bus())
    events = await EventTail(nc).start()
    try:
        await settle(events)
        yield nc, events
    finally:
        await events.stop()
        await nc.drain()


async def settle(events: EventTail, *, after: float = 0.0, timeout: float = 60.0) -> None:
    """Wait until each engine's newest shadow announced ``shadow_ready`` (after ``after``)."""
    for eid in ENGINES:
        await events.wait_for(ShadowReady, eid, after=after, timeout=timeout)


async def test_sigkill_at_random_points_resumes_every_request_exactly(
    bus: tuple[NATS, EventTail],
) -> None:
    """≥ 20 requests over 6 kill rounds, alternating engines: round 0 kills right after submit
    (before any token: prefill), the others after a random number of tokens, with 4 requests in
    flight (2 on the victim — one greedy, one seeded sampled — 1 on the other engine, 1
    unpinned). Between kills: handover_complete and a new warm shadow. Every request, sampled
    ones included, equals its reference (run 8 at a time: other batches than the real run)."""
    nc, events = bus
    rng = random.Random(SEED)
    rounds = 6
    plan: list[list[GenerateRequest]] = []
    for r in range(rounds):
        victim, other = ENGINES[r % 2], ENGINES[1 - r % 2]
        plan.append([
            greedy(f"k{r}-g", prompt(4 * r), N, engine_id=victim),
            sampled(f"k{r}-s", prompt(4 * r + 1), N, seed=rng.randrange(1 << 30), engine_id=victim),
            greedy(f"k{r}-o", prompt(4 * r + 2), N, engine_id=other),
            sampled(f"k{r}-u", prompt(4 * r + 3), N, seed=rng.randrange(1 << 30)),
        ])  # fmt: skip
    ref = await references(nc, [q for rnd in plan for q in rnd])
    finished0 = (await router_status(nc)).finished
    kill_after = [0] + [rng.randrange(1, KILL_BY) for _ in range(rounds - 1)]
    for r, reqs in enumerate(plan):
        victim = ENGINES[r % 2]
        pid = (await main_pids(nc))[victim]
        recs, tasks = launch(nc, reqs)
        if kill_after[r] == 0:
            await nc.flush()  # the submits reached NATS; the worker dies during placement/prefill
        else:
            await recs[0].wait_tokens(kill_after[r])
        t_kill = time.time()
        mark(recs)
        os.kill(pid, signal.SIGKILL)
        done = await events.wait_for(HandoverComplete, victim, old_pid=pid, timeout=30)
        check_all(list(await asyncio.gather(*tasks)), reqs, ref)
        if kill_after[r] == 0:
            assert all(t > t_kill for t in recs[0].delta_times + recs[1].delta_times)
        else:
            assert recs[0].result is not None and recs[0].result.resumes >= 1
            assert recs[0].result.engine_ids == [victim]
        await events.wait_for(ShadowReady, victim, after=done.ts, timeout=60)
    st = await router_status(nc)
    assert st.inflight == 0
    assert st.finished - finished0 == rounds * 4, "a request finished more or less than once"
    assert all(e.healthy for e in st.engines)


async def test_sigstop_hang_is_taken_over_and_the_residual_is_fenced_and_killed(
    bus: tuple[NATS, EventTail],
) -> None:
    """SIGSTOP the main worker: the shadow sees the stale heartbeat and takes over; the old pid
    gets SIGCONT right after detection, so it runs again while the engine has moved on — none
    of its output may reach a caller, and the control plane kills it."""
    nc, events = bus
    reqs = [
        greedy("hang-g", prompt(40), 160, engine_id="e0"),
        sampled("hang-s", prompt(41), 160, seed=SEED, engine_id="e0"),
    ]
    ref = await references(nc, reqs)
    pid = (await main_pids(nc))["e0"]
    recs, tasks = launch(nc, reqs)
    await recs[0].wait_tokens(8)
    t_stop = time.time()
    mark(recs)
    os.kill(pid, signal.SIGSTOP)
    try:
        detected = await events.wait_for(HandoverDetected, "e0", old_pid=pid, timeout=15)
    finally:
        os.kill(pid, signal.SIGCONT)  # the residual worker wakes up with its old epoch
    assert detected.verdict == "hung"
    assert detected.t_detect - t_stop >= 1.5, "a hang was declared before the threshold"
    done = await events.wait_for(HandoverComplete, "e0", old_pid=pid, timeout=15)
    await wait_until(lambda: pid_gone(pid), timeout=5, what=f"residual worker {pid} is dead")
    health = events.matching(HandoverHealthOk, "e0", after=detected.ts - 1e-3)
    killed_by_supervisor = events.matching(ResidualKilled, "e0", pid=pid)
    assert (health and health[0].residual_killed) or killed_by_supervisor
    check_all(list(await asyncio.gather(*tasks)), reqs, ref)
    # Whatever the woken worker published after the engine went down was rejected, not relayed
    # (how much it managed to publish before the shadow's SIGKILL depends on timing).
    for ev in events.matching(StaleOutputRejected, "e0", pid=pid):
        assert ev.epoch == done.old_epoch
    await events.wait_for(ShadowReady, "e0", after=done.ts, timeout=60)


async def test_both_engines_killed_at_once_both_hand_over(bus: tuple[NATS, EventTail]) -> None:
    nc, events = bus
    reqs = [
        greedy("both-e0-g", prompt(50), N, engine_id="e0"),
        sampled("both-e0-s", prompt(51), N, seed=SEED + 1, engine_id="e0"),
        greedy("both-e1-g", prompt(52), N, engine_id="e1"),
        sampled("both-e1-s", prompt(53), N, seed=SEED + 2, engine_id="e1"),
    ]
    ref = await references(nc, reqs)
    pids = await main_pids(nc)
    recs, tasks = launch(nc, reqs)
    await asyncio.gather(recs[0].wait_tokens(6), recs[2].wait_tokens(6))
    mark(recs)
    for eid in ENGINES:
        os.kill(pids[eid], signal.SIGKILL)
    done = [
        await events.wait_for(HandoverComplete, eid, old_pid=pids[eid], timeout=30)
        for eid in ENGINES
    ]
    results = list(await asyncio.gather(*tasks))
    check_all(results, reqs, ref)
    assert all(rec.result is not None and rec.result.resumes >= 1 for rec in results)
    for d in done:  # each engine's replacement shadow is warm again
        await events.wait_for(ShadowReady, d.engine_id, after=d.ts, timeout=60)
    assert all(e.healthy for e in (await router_status(nc)).engines)


async def test_stale_epoch_output_never_reaches_the_caller(
    node: Node, bus: tuple[NATS, EventTail]
) -> None:
    """A forged StepBatch from an old epoch of the request's engine (bogus tokens, even a
    'finished') is rejected with an event; the caller sees only the real tokens. The old epoch
    is made here (one handover from whatever epoch the test finds), so the test stands alone.
    The forger holds e0's own identity (only engines may publish step batches): a stale
    process of the engine, not any client."""
    nc, events = bus
    forger = await node.connect("forger", "engine-e0")
    req = greedy("stale-victim", prompt(60), 160, engine_id="e0")
    ref = await references(nc, [req])
    start = next(e for e in (await router_status(nc)).engines if e.id == "e0").epoch
    pid = (await main_pids(nc))["e0"]
    os.kill(pid, signal.SIGKILL)
    done = await events.wait_for(HandoverComplete, "e0", old_pid=pid, timeout=30)
    assert (done.old_epoch, done.epoch) == (start, start + 1)
    await events.wait_for(ShadowReady, "e0", after=done.ts, timeout=60)
    eng = next(e for e in (await router_status(nc)).engines if e.id == "e0")
    assert eng.epoch == start + 1, "the handover advanced e0's epoch by one"
    recs, tasks = launch(nc, [req])
    await recs[0].wait_tokens(4)
    forged_pid = 999_999
    t0 = time.time()
    for epoch in (eng.epoch - 1, 0):
        forged = StepBatch(
            engine_id="e0",
            epoch=epoch,
            worker_pid=forged_pid,
            step=10**6,
            weight_version=eng.weight_version,
            deltas=[
                SeqDelta(
                    request_id=req.request_id,
                    token_ids=[1, 2, 3],
                    logprobs=[0.0, 0.0, 0.0],
                    finished=True,
                    finish_reason="stop",
                )
            ],
        )
        await forger.publish(subjects.router_tokens(), encode(forged))
    await forger.drain()
    for epoch in (eng.epoch - 1, 0):
        await events.wait_for(
            StaleOutputRejected, "e0", after=t0, epoch=epoch, pid=forged_pid, timeout=10
        )
    rec = await tasks[0]
    check(rec, ref[req.request_id])
    assert rec.result is not None and rec.result.finish_reason == "length"
