"""Well-formed messages that should not be trusted, on one real 2-engine node (real nats-server,
real processes): a registration must prove it is a live worker of one of the node's engines,
no message can push an engine's epoch out of reach, an event commands nothing, `status` never
shows a dead pid as healthy, and a worker takes no more than the router would give it.

Each test leaves the node as it found it: both engines up, each with a warm shadow.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from common import events, subjects
from common.bus import connect, request
from common.codec import encode
from common.epoch import claim_epoch, current_epoch
from common.errors import Conflict, EngineUnavailable, NotFound, ResourceLimit
from common.events import EventTail
from common.limits import ServingLimits
from schemas.base import Ok
from schemas.events import (
    EngineRetired,
    EngineUnhealthy,
    HandoverComplete,
    KvFlushed,
    ResidualKilled,
    ShadowReady,
    WeightsUpdated,
    WorkerWeightsSwapped,
)
from schemas.serving import (
    EngineAbort,
    EngineRequest,
    EngineSubmit,
    RegisterReply,
    RegisterWorker,
    SamplingParams,
)
from services.kv.client import flush_arena
from services.router.client import generate
from services.weights.client import fetch_manifest
from services.worker.config import WorkerConfig
from tests.integration.node_helpers import (
    Node,
    greedy,
    log_lines,
    main_pids,
    pid_gone,
    router_status,
    supervisor_pids,
    wait_until,
)

pytestmark = pytest.mark.timeout(300)
NODE_ARGS = ("--engines", "2", "--failure-window", "0")
"""The module's node (``tests/node_fixtures.py``): two engines; no failure window, so the
handovers here are independent failures (the unhealthy path is in the router chaos tests)."""

LIMITS = ServingLimits()
CAPACITY = WorkerConfig().engine.max_num_seqs + LIMITS.max_queued
"""Most requests one worker holds (the node runs with the default limits)."""


@pytest_asyncio.fixture
async def bus(node: Node) -> AsyncIterator[tuple[Any, EventTail]]:
    """A client and the node's event log, once every engine has a warm shadow. (A forgery
    below comes from a peer holding the identity the server requires for that subject — a
    rogue process of an engine, of the router — since the server refuses it from anyone
    else: these tests show what each service checks on top of that.)"""
    nc = await connect(node.nats_url, name="untrusted", bus=node.bus())
    log = await EventTail(nc).start()
    try:
        for eid in ("e0", "e1"):
            await log.wait_for(ShadowReady, eid, timeout=90)
        yield nc, log
    finally:
        await log.stop()
        await nc.drain()


async def all_finish(nc: Any, tag: str, n: int = 4) -> None:
    """``n`` unpinned requests all complete (none is placed on an engine that does not work)."""
    results = await asyncio.gather(
        *(generate(nc, greedy(f"{tag}-{i}", f"prompt {i}", 12), timeout=60) for i in range(n))
    )
    assert all(len(r.token_ids) == 12 for r in results)


async def hand_over(nc: Any, log: EventTail, engine_id: str) -> HandoverComplete:
    """SIGKILL the engine's main worker; its shadow takes over; a fresh shadow warms up."""
    pid = (await main_pids(nc))[engine_id]
    os.kill(pid, signal.SIGKILL)
    done = await log.wait_for(HandoverComplete, engine_id, old_pid=pid, timeout=30)
    await log.wait_for(ShadowReady, engine_id, after=done.ts, timeout=90)
    return done


async def test_a_registration_must_be_a_live_worker_of_a_node_engine(
    node: Node, bus: tuple[Any, EventTail]
) -> None:
    """A phantom engine (an id the supervisor never started) and a phantom worker (a pid that
    does not answer the engine's ping, even under an epoch it claimed by compare-and-set) are
    refused, typed; they never become placement targets. The phantom holds e1's identity."""
    nc, _ = bus
    phantom = await connect(node.nats_url, name="phantom", bus=node.bus("engine-e1"))
    before = {e.id: e.worker_pid for e in (await router_status(nc)).engines}
    with pytest.raises(NotFound):
        await request(
            phantom,
            subjects.router_register(),
            RegisterWorker(engine_id="e7", epoch=0, pid=os.getpid()),
            RegisterReply,
        )
    js = phantom.jetstream()
    old, _ = await current_epoch(js, "e1")
    claimed = await claim_epoch(js, "e1", expected=old)  # what a phantom could do on the bus
    try:
        with pytest.raises(Conflict) as err:
            await request(
                phantom,
                subjects.router_register(),
                RegisterWorker(engine_id="e1", epoch=claimed, pid=999_999),
                RegisterReply,
            )
        assert "ping" in err.value.message
    finally:  # put the epoch back where the live worker has it
        kv = await js.key_value(subjects.BUCKET_ENGINE_EPOCHS)
        _, rev = await current_epoch(js, "e1")
        await kv.update("e1", str(old).encode(), last=rev)
        await phantom.drain()
    st = await router_status(nc)
    assert {e.id: e.worker_pid for e in st.engines} == before
    assert all(e.healthy for e in st.engines)
    await all_finish(nc, "after-phantoms")


async def test_no_flush_can_push_an_epoch_out_of_reach(
    node: Node, bus: tuple[Any, EventTail]
) -> None:
    """A flush under a made-up epoch, under the live epoch (already flushed by its worker) or
    under the next one (not claimed yet) is refused and zeroes nothing; the next handover of
    that engine still works and flushes exactly once, under the epoch it claimed. The forger
    holds e0's identity (only engines may flush)."""
    nc, log = bus
    forger = await connect(node.nats_url, name="forger", bus=node.bus("engine-e0"))
    epoch, _ = await current_epoch(forger.jetstream(), "e0")
    t0 = time.time()
    for forged in (10**12, epoch, epoch + 1):
        with pytest.raises(Conflict):
            await flush_arena(forger, "e0", forged)
    await forger.drain()
    done = await hand_over(nc, log, "e0")
    assert (done.old_epoch, done.epoch) == (epoch, epoch + 1)
    flushes = log.matching(KvFlushed, "e0", after=t0)
    assert [f.epoch for f in flushes] == [epoch + 1]
    st = await router_status(nc)
    e0 = next(e for e in st.engines if e.id == "e0")
    assert (e0.epoch, e0.worker_pid, e0.healthy) == (epoch + 1, done.pid, True)
    res = await generate(nc, greedy("after-flushes", n=8, engine_id="e0"), timeout=60)
    assert len(res.token_ids) == 8


async def test_events_inform_and_command_nothing(node: Node, bus: tuple[Any, EventTail]) -> None:
    """Forged `engine_unhealthy`, `handover_complete` and `weights_updated` events: the
    supervisor checks them with the router and the epoch bucket and does nothing (no engine
    retired, no shadow promoted, no worker killed); no worker switches weights."""
    nc, log = bus
    forger = await connect(node.nats_url, name="forger", bus=node.bus("engine-e0"))
    js = forger.jetstream()  # any service may publish events; e0's identity forges these
    procs = await supervisor_pids(nc)
    main, shadow = procs["worker-e1"], procs["shadow-e1"]
    epoch, _ = await current_epoch(js, "e1")
    current = await fetch_manifest(forger)
    seen = len(log_lines(node, "supervisor", "event_not_confirmed"))
    t0 = time.time()
    await events.publish(
        js,
        EngineUnhealthy(engine_id="e1", reason="forged", moved_requests=0, request_ids=[]),
    )
    await events.publish(
        js,
        HandoverComplete(
            source="shadow:e1", engine_id="e1", epoch=epoch + 1, pid=shadow, old_pid=main,
            old_epoch=epoch, detect_to_registered_s=0.1, t_detect=t0, t_health=t0,
            t_flush=t0, t_ready=t0, t_registered=t0,
        ),
    )  # fmt: skip
    await events.publish(
        js,
        WeightsUpdated(
            version=current.version + 5, base_version=current.version, checksum="00",
            bytes=1, seconds=0.0,
        ),
    )  # fmt: skip
    await wait_until(
        lambda: len(log_lines(node, "supervisor", "event_not_confirmed")) >= seen + 2,
        timeout=15,
        what="the supervisor checked both forged events and refused to act",
    )
    await wait_until(
        lambda: log_lines(node, "worker-e1", "weights_event_not_current"),
        timeout=15,
        what="the worker checked the forged weights event against the weight_version bucket",
    )
    await forger.drain()
    actions = {r["action"] for r in log_lines(node, "supervisor", "event_not_confirmed")[seen:]}
    assert actions == {"retire", "promote"}
    for kind in (EngineRetired, ResidualKilled, WorkerWeightsSwapped):
        assert not log.matching(kind, after=t0), kind.kind
    now = await supervisor_pids(nc)
    assert (now["worker-e1"], now["shadow-e1"]) == (main, shadow)
    st = await router_status(nc)
    e1 = next(e for e in st.engines if e.id == "e1")
    assert (e1.worker_pid, e1.healthy, e1.weight_version) == (main, True, current.version)
    res = await generate(nc, greedy("after-forged-events", n=8, engine_id="e1"), timeout=60)
    assert len(res.token_ids) == 8 and res.engine_ids == ["e1"]


async def test_status_never_shows_a_dead_worker_as_healthy(
    node: Node, bus: tuple[Any, EventTail]
) -> None:
    """The main worker dies while its shadow is stopped (no handover yet): `belayer status`
    shows the engine down with the dead pid; once the shadow runs again it takes over and the
    engine is healthy under the shadow's pid."""
    nc, log = bus
    procs = await supervisor_pids(nc)
    main, shadow = procs["worker-e0"], procs["shadow-e0"]
    os.kill(shadow, signal.SIGSTOP)
    try:
        os.kill(main, signal.SIGKILL)
        await wait_until(lambda: pid_gone(main), timeout=10, what="the main worker is gone")

        shown: dict[str, Any] = {}

        def dead_worker_not_healthy() -> bool:
            shown.update(next(e for e in node.status()["engines"] if e["id"] == "e0"))
            return shown["worker_pid"] != main or not shown["healthy"]

        await wait_until(
            dead_worker_not_healthy,
            timeout=10,
            what="status stops showing the dead worker as healthy",
        )
        assert shown["worker_pid"] == main and shown["healthy"] is False
    finally:
        os.kill(shadow, signal.SIGCONT)
    done = await log.wait_for(HandoverComplete, "e0", old_pid=main, timeout=30)
    assert done.pid == shadow
    await log.wait_for(ShadowReady, "e0", after=done.ts, timeout=90)
    shown = next(e for e in node.status()["engines"] if e["id"] == "e0")
    assert (shown["worker_pid"], shown["healthy"]) == (shadow, True)


async def test_a_worker_takes_only_what_the_router_would(
    node: Node, bus: tuple[Any, EventTail]
) -> None:
    """Direct submits to a worker, past the router: over the limits they are refused
    (`resource_limit`); 300 long ones fill the worker's bounded queue and the rest get the
    retryable `engine_unavailable`; the router sees the flood in the worker's own counts and
    sends a normal request to the other engine, which finishes at once. The submits come
    with the router's identity (only the router may submit to engines): a second, rogue
    router process."""
    nc, _ = bus
    rogue = await connect(node.nats_url, name="rogue-router", bus=node.bus("router"))
    eng = next(e for e in (await router_status(nc)).engines if e.id == "e0")

    def submit(rid: str, tokens: list[int], max_tokens: int) -> EngineSubmit:
        sampling = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        req = EngineRequest(request_id=rid, token_ids=tokens, sampling=sampling)
        return EngineSubmit(engine_id="e0", epoch=eng.epoch, requests=[req])

    subject = subjects.engine_generate("e0")
    with pytest.raises(ResourceLimit):
        await request(rogue, subject, submit("long-prompt", [5] * 2000, 4), Ok)
    with pytest.raises(ResourceLimit):
        await request(rogue, subject, submit("many-tokens", [5, 6], LIMITS.max_new_tokens + 1), Ok)
    flood = [f"flood-{i}" for i in range(300)]
    accepted, refused = 0, 0
    try:
        for rid in flood:
            try:
                await request(rogue, subject, submit(rid, [5, 6, 7], LIMITS.max_new_tokens), Ok)
                accepted += 1
            except EngineUnavailable as exc:
                assert exc.retryable
                refused += 1
        assert accepted <= CAPACITY and accepted + refused == len(flood)

        async def e0_full() -> bool:
            e0 = next(e for e in (await router_status(nc)).engines if e.id == "e0")
            return e0.holding >= accepted

        await wait_until(e0_full, timeout=15, what="the router sees the worker's own counts")
        t0 = time.monotonic()
        res = await generate(nc, greedy("bystander", n=16), timeout=30)
        assert res.engine_ids == ["e1"] and len(res.token_ids) == 16
        assert time.monotonic() - t0 < 15
    finally:
        abort = EngineAbort(engine_id="e0", epoch=eng.epoch, request_ids=flood)
        await rogue.publish(subjects.engine_abort("e0"), encode(abort))
        await rogue.drain()

    async def e0_empty() -> bool:
        e0 = next(e for e in (await router_status(nc)).engines if e.id == "e0")
        return e0.holding == 0

    await wait_until(e0_empty, timeout=30, what="the flood is gone from the worker's counts")
    res = await generate(nc, greedy("after-flood", n=8, engine_id="e0"), timeout=60)
    assert len(res.token_ids) == 8
