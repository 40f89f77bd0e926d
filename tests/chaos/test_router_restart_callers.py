"""Callers ride through a router restart: the router is SIGKILLed (the supervisor restarts it)
while a caller streams a long request through the Python client or the `belayer generate` CLI.
Every caller finishes with exactly the reference tokens, each delivered once and in order, and
the result says how many router restarts it rode through. `belayer status` answers while the
router is gone, showing the node degraded."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from common import subjects
from schemas.serving import GenerateRequest, TokenDelta
from services.router.client import generate
from tests.integration.node_helpers import (
    BELAYER,
    Node,
    cli,
    greedy,
    main_pids,
    sampled,
    supervisor_pids,
    wait_until,
)

pytestmark = pytest.mark.timeout(240)

K = 16
N = 600
NODE_ARGS = ("--engines", "1", "--token-log-chunk", str(K))
"""The module's node (``tests/node_fixtures.py``)."""
PROMPT = "a caller that outlives its router"


@pytest_asyncio.fixture
async def nc(node: Node) -> AsyncIterator[Any]:
    from common.bus import connect

    conn = await connect(node.nats_url, name="chaos-callers", bus=node.bus("operator"))
    try:
        yield conn
    finally:
        await conn.drain()


class Caller:
    """Collects deltas strictly: each must start exactly where the previous ended."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.changed = asyncio.Event()

    def on_delta(self, d: TokenDelta) -> None:
        assert d.start == len(self.tokens), f"delta at {d.start}, caller holds {len(self.tokens)}"
        self.tokens += d.token_ids
        self.changed.set()

    async def wait_tokens(self, n: int, timeout: float = 60.0) -> None:
        async def reach() -> None:
            while len(self.tokens) < n:
                self.changed.clear()
                await self.changed.wait()

        await asyncio.wait_for(reach(), timeout)


async def reference(nc: Any, req: GenerateRequest) -> list[int]:
    ref = GenerateRequest(
        request_id=f"{req.request_id}-ref", prompt=req.prompt, sampling=req.sampling
    )
    return list((await generate(nc, ref, timeout=120)).token_ids)


async def kill_router(nc: Any) -> int:
    """SIGKILL the router; returns once the supervisor runs a new one (its new pid)."""
    old = (await supervisor_pids(nc))["router"]
    os.kill(old, signal.SIGKILL)
    new: dict[str, int] = {}

    async def restarted() -> bool:
        try:
            pid = (await supervisor_pids(nc)).get("router")
        except Exception:
            return False
        new["pid"] = pid or 0
        return bool(pid) and pid != old

    await wait_until(restarted, timeout=30, what="the supervisor restarted the router")
    return new["pid"]


async def accepted(nc: Any, request_id: str) -> asyncio.Event:
    """Set once the router has accepted ``request_id`` (its AcceptedRequest is published)."""
    seen = asyncio.Event()

    async def cb(_msg: Any) -> None:
        seen.set()

    await nc.subscribe(subjects.request_log(request_id), cb=cb)
    await nc.flush()
    return seen


@pytest.mark.parametrize("when", ["prefill", "middle", "last-tokens"])
async def test_python_client_rides_through_a_router_kill(nc: Any, when: str) -> None:
    req = greedy(f"rc-{when}", PROMPT, N)
    ref = await reference(nc, req)
    caller = Caller()
    got_accepted = await accepted(nc, req.request_id)
    task = asyncio.create_task(generate(nc, req, timeout=180, on_delta=caller.on_delta))
    if when == "prefill":
        await asyncio.wait_for(got_accepted.wait(), 30)
    else:
        await caller.wait_tokens(N // 2 if when == "middle" else N - 3)
    await kill_router(nc)
    result = await task
    assert result.token_ids == ref
    assert caller.tokens == ref, "each token must reach the caller exactly once, in order"
    if when != "last-tokens":  # there the old router may have sent the result before dying
        assert result.router_restarts >= 1


async def test_router_killed_twice_in_a_row(nc: Any) -> None:
    req = sampled("rc-twice", PROMPT, N, seed=7)
    ref = await reference(nc, req)
    caller = Caller()
    task = asyncio.create_task(generate(nc, req, timeout=180, on_delta=caller.on_delta))
    await caller.wait_tokens(N // 4)
    await kill_router(nc)
    await kill_router(nc)  # the new one dies too, as soon as it runs
    result = await task
    # The restarted router adopts the worker's own copy: sampled tokens are exact too.
    assert caller.tokens == ref and result.token_ids == ref
    assert result.router_restarts >= 1


async def test_router_killed_during_a_worker_handover(nc: Any) -> None:
    req = greedy("rc-handover", PROMPT, N)
    ref = await reference(nc, req)
    caller = Caller()
    task = asyncio.create_task(generate(nc, req, timeout=180, on_delta=caller.on_delta))
    await caller.wait_tokens(N // 3)
    worker = (await main_pids(nc))["e0"]
    os.kill(worker, signal.SIGKILL)
    await kill_router(nc)
    result = await task
    assert caller.tokens == ref and result.token_ids == ref


async def test_cli_generate_rides_through_a_router_kill(node: Node, nc: Any) -> None:
    req = greedy("rc-cli", PROMPT, 1200)
    ref = await reference(nc, req)
    first_chunk = asyncio.Event()

    async def on_chunk(_msg: Any) -> None:
        first_chunk.set()

    await nc.subscribe(subjects.token_log(req.request_id), cb=on_chunk)
    await nc.flush()
    argv = [*BELAYER, "generate", "--prompt", PROMPT, "--max-tokens", "1200"]
    argv += ["--temperature", "0", "--ignore-eos", "--json", "--timeout", "150"]
    argv += ["--request-id", req.request_id]
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "BELAYER_HOME": str(node.run_dir)},
    )
    try:
        await asyncio.wait_for(first_chunk.wait(), 60)
        await kill_router(nc)
        out, err = await asyncio.wait_for(proc.communicate(), 170)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err.decode()
    result = json.loads(out)
    assert result["token_ids"] == ref
    assert result["router_restarts"] >= 1


async def test_status_shows_a_degraded_node_while_the_router_is_gone(node: Node, nc: Any) -> None:
    pid = (await supervisor_pids(nc))["router"]
    os.kill(pid, signal.SIGSTOP)  # the router is silent (as while restarting), not yet replaced
    try:
        out = await asyncio.to_thread(cli, "status", "--json", run_dir=node.run_dir, timeout=60)
        st = json.loads(out.stdout)
        assert st["state"] == "degraded"
        assert st["router"]["alive"] is False
        assert [e["id"] for e in st["engines"]] == ["e0"] and st["engines"][0]["epoch"] >= 1
        text = (await asyncio.to_thread(cli, "status", run_dir=node.run_dir, timeout=60)).stdout
        assert "router restarting" in text
    finally:
        os.kill(pid, signal.SIGCONT)
    st = node.status()
    assert st["state"] == "ready" and st["router"]["alive"] is True
