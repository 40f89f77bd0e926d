"""Well-formed but hostile input on a real node: ids that would break a subject or a path,
NaN, integers past 64 bits, deep nesting. Each gets a typed ``invalid_request`` naming the
field — from the bus and from the CLI (one line, no traceback) — and nothing dies: the router
keeps its pid and keeps serving."""

from __future__ import annotations

import asyncio
import math

import msgpack
import pytest
from nats.aio.client import Client as NATS

from common import subjects
from common.bus import connect
from common.codec import decode
from schemas.base import ErrorReply
from services.router.client import generate
from tests.integration.node_helpers import Node, cli, greedy

pytestmark = pytest.mark.timeout(240)
NODE_ARGS = ("--engines", "1", "--heartbeat-interval", "0.5")
"""The module's node (``tests/node_fixtures.py``): a fast router heartbeat, so a record that
would break its loop does so within a second."""

BAD_IDS = ["a.b", "", "*", ">", "../..", "e0\n"]


async def _ask(nc: NATS, subject: str, raw: object) -> ErrorReply:
    data = raw if isinstance(raw, bytes) else msgpack.packb(raw)
    msg = await nc.request(subject, data, timeout=10)
    return decode(msg.data, ErrorReply)


async def test_bad_engine_ids_are_refused_and_the_router_keeps_serving(node: Node) -> None:
    router_pid = node.pids()["router"]
    nc = await connect(node.nats_url, name="t", bus=node.bus())
    # Registrations, failure reports and flushes come only from engines: a rogue engine
    # process (e0's identity) sends the bad ones. (It may not write another engine's epoch
    # key, such as the dotted id's: the server refuses that outright.)
    peer = await connect(node.nats_url, name="peer", bus=node.bus("engine-e0"))
    try:
        # Watch the router's heartbeat pings: two rounds after the bad registrations prove its
        # loop went past them (a bad engine in its registry used to end the router process).
        pings: asyncio.Queue[None] = asyncio.Queue()

        async def seen(_msg: object) -> None:
            pings.put_nowait(None)

        sub = await peer.subscribe(subjects.engine_ping("e0"), cb=seen)
        for bad in BAD_IDS:
            raw = {"type": "RegisterWorker.v1", "engine_id": bad, "epoch": 1, "pid": 1}
            err = await _ask(peer, subjects.router_register(), raw)
            assert err.code == "invalid_request", (bad, err)
            assert err.data["field"] == "$.engine_id", (bad, err)
            raw = {"type": "EngineFailed.v1", "engine_id": bad, "epoch": 1}
            err = await _ask(peer, subjects.router_engine_failed(), raw)
            assert (err.code, err.data["field"]) == ("invalid_request", "$.engine_id"), bad
            raw = {"type": "CancelRequest.v1", "request_id": bad}
            err = await _ask(nc, subjects.router_cancel(), raw)
            assert (err.code, err.data["field"]) == ("invalid_request", "$.request_id"), bad
            raw = {"type": "KvFlush.v1", "engine_id": bad, "epoch": 1}
            err = await _ask(peer, subjects.kv_flush(), raw)
            assert (err.code, err.data["field"]) == ("invalid_request", "$.engine_id"), bad
        while not pings.empty():
            pings.get_nowait()
        for _ in range(2):
            await asyncio.wait_for(pings.get(), 30)
        await sub.unsubscribe()
        res = await asyncio.wait_for(generate(nc, greedy("after-bad-ids", n=8)), 60)
        assert len(res.token_ids) == 8
        assert node.pids()["router"] == router_pid
    finally:
        await peer.drain()
        await nc.drain()


def _deep(depth: int) -> bytes:
    return b"\x91" * depth + b"\x90"


async def test_nan_huge_integers_and_deep_nesting_get_typed_errors(node: Node) -> None:
    nc = await connect(node.nats_url, name="t", bus=node.bus())
    try:
        base = {"type": "GenerateRequest.v1", "request_id": "hostile", "prompt": "hi"}
        cases = [
            ({**base, "sampling": {"temperature": math.nan}}, "$.sampling.temperature"),
            ({**base, "sampling": {"top_p": math.inf}}, "$.sampling.top_p"),
            ({**base, "sampling": {"max_tokens": 2**64 - 1}}, "$.sampling.max_tokens"),
            ({**base, "sampling": {"max_tokens": 2.0**70}}, "$.sampling.max_tokens"),
            ({**base, "sampling": {"seed": 2**64 - 1}}, "$.sampling.seed"),
            ({**base, "request_id": "a.b"}, "$.request_id"),
            ({**base, "engine_id": "../.."}, "$.engine_id"),
        ]
        for raw, field in cases:
            err = await _ask(nc, subjects.router_generate(), raw)
            assert (err.code, err.data.get("field")) == ("invalid_request", field), (raw, err)
        head = msgpack.packb(base)  # a map of 3 entries: make it 4, the 4th nested 10 000 deep
        for key, field in (("junk", "$"), ("sampling", "$.sampling")):
            raw = b"\x84" + head[1:] + msgpack.packb(key) + _deep(10_000)
            err = await _ask(nc, subjects.router_generate(), raw)
            assert (err.code, err.data.get("field")) == ("invalid_request", field), err
        res = await asyncio.wait_for(generate(nc, greedy("after-hostile", n=4)), 60)
        assert len(res.token_ids) == 4
    finally:
        await nc.drain()


HUGE = str(2**70)


@pytest.mark.parametrize(
    "args",
    [
        ("generate", "--prompt", "x", "--max-tokens", HUGE),
        ("generate", "--prompt", "x", "--seed", HUGE),
        ("generate", "--prompt", "x", "--temperature", "nan"),
        ("generate", "--prompt", "x", "--top-p", "nan"),
        ("generate", "--prompt", "x", "--timeout", "nan"),
        ("generate", "--prompt", "x", "--request-id", "a.b"),
        ("generate", "--prompt", "x", "--engine", "../.."),
        ("generate", "--prompt", "x", "--no-such-option"),
        ("env", "create", "--memory-mb", HUGE),
    ],
    ids=lambda a: " ".join(a)[:40],
)
def test_cli_errors_are_one_line_without_traceback(node: Node, args: tuple[str, ...]) -> None:
    r = cli(*args, run_dir=node.run_dir, check=False, timeout=60)
    assert r.returncode != 0, r
    assert "Traceback" not in r.stderr + r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
