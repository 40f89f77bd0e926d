"""Limits before work, on a real node: an oversized message is refused unread, a long prompt
before it is tokenized, a request with no reply subject is dropped without work, and a flood
of requests on one subject is shed with the retryable ``overloaded`` while another caller is
still served at once."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from common import subjects
from common.codec import decode, encode
from common.errors import ResourceLimit
from common.limits import ServingLimits
from common.natsserver import MAX_PAYLOAD
from schemas.base import ErrorReply
from schemas.serving import GenerateReply, GenerateRequest, GenerateResult, SamplingParams
from services.router.client import generate
from tests.integration.node_helpers import Node, greedy, router_status, wait_until

pytestmark = pytest.mark.timeout(240)
LIMITS = ServingLimits()


def log_events(node: Node, name: str, event: str) -> list[dict[str, Any]]:
    path = node.run_dir / "logs" / f"{name}.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.startswith("{")]
    return [r for r in lines if r.get("event") == event]


async def test_sizes_are_checked_before_any_work(node: Node) -> None:
    nc = await node.connect("limits")
    try:
        # 2 MiB of prompt: refused by size before a byte is decoded, let alone tokenized.
        t0 = time.monotonic()
        with pytest.raises(ResourceLimit, match="request too large") as big:
            await generate(nc, greedy("huge-prompt", prompt="x" * (2 << 20)), timeout=10)
        assert time.monotonic() - t0 < 1.0 and big.value.data["bytes"] > 2 << 20
        # Over the prompt's byte bound but a small message: refused by length in bytes, before
        # tokenizing (a tokens-based refusal would name `tokens`).
        text = "é" * (LIMITS.max_prompt_bytes // 2 + 1)
        with pytest.raises(ResourceLimit, match="prompt too long") as long:
            await generate(nc, greedy("long-prompt", prompt=text), timeout=10)
        assert long.value.data["limit"] == LIMITS.max_prompt_bytes
        assert long.value.data["bytes"] == len(text.encode()) and "tokens" not in long.value.data
        # Beyond the server's max_payload nothing even reaches the server.
        with pytest.raises(Exception, match=r"(?i)payload"):
            await nc.publish(subjects.router_generate(), b"\x00" * (MAX_PAYLOAD + 1))
        res = await generate(nc, greedy("after-sizes", n=4), timeout=60)
        assert len(res.token_ids) == 4
    finally:
        await nc.drain()


async def test_a_request_without_a_reply_subject_does_no_work(node: Node) -> None:
    nc = await node.connect("no-reply")
    try:
        before = (await router_status(nc)).metrics.get("requests", 0)
        seen = len(log_events(node, "router", "request_shed"))
        for i in range(3):
            await nc.publish(subjects.router_generate(), encode(greedy(f"no-reply-{i}", n=4)))
        await nc.flush()
        await wait_until(
            lambda: len(log_events(node, "router", "request_shed")) > seen,
            timeout=10,
            what="the router logs the requests it dropped",
        )
        shed = log_events(node, "router", "request_shed")[-1]
        assert (shed["subject"], shed["reason"]) == (subjects.router_generate(), "no_reply_subject")
        assert (await router_status(nc)).metrics.get("requests", 0) == before
    finally:
        await nc.drain()


async def test_a_flood_is_shed_and_another_caller_is_still_served(node: Node) -> None:
    """3000 requests published at once on ``router.generate``: those beyond the subject's
    bounded queue are answered ``overloaded`` (retryable) at once, every one gets an answer,
    and meanwhile another caller's ``router.status`` is answered within a second."""
    flood = await node.connect("flood")
    other = await node.connect("bystander")
    replies: dict[str, Any] = {}
    done = asyncio.Event()
    n = 3000

    async def on_reply(msg: Any) -> None:
        reply = decode(msg.data, GenerateReply)
        if isinstance(reply, ErrorReply | GenerateResult):
            key = reply.request_id if isinstance(reply, GenerateResult) else msg.subject
            replies[key if isinstance(reply, GenerateResult) else f"{key}:{len(replies)}"] = reply
            if len(replies) >= n:
                done.set()

    inbox = flood.new_inbox()
    await flood.subscribe(f"{inbox}.*", cb=on_reply)
    sampling = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    try:
        for i in range(n):
            req = GenerateRequest(
                request_id=f"flood-{i}", prompt_token_ids=[5, 6, 7], sampling=sampling, stream=False
            )
            await flood.publish(subjects.router_generate(), encode(req), reply=f"{inbox}.{i}")
        latencies = []
        for _ in range(5):  # while the flood is handled
            t0 = time.monotonic()
            await router_status(other, timeout=5)
            latencies.append(time.monotonic() - t0)
        assert max(latencies) < 1.0, latencies
        await asyncio.wait_for(done.wait(), 180)
        shed = [r for r in replies.values() if isinstance(r, ErrorReply)]
        assert shed and all(r.code == "overloaded" and r.retryable for r in shed), {
            r.code for r in shed
        }
        served = [r for r in replies.values() if isinstance(r, GenerateResult)]
        assert served and all(len(r.token_ids) == 1 for r in served)
        assert len(shed) + len(served) == n
        res = await generate(other, greedy("after-flood", n=4), timeout=60)
        assert len(res.token_ids) == 4
    finally:
        await flood.drain()
        await other.drain()
