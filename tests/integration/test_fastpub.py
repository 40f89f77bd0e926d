"""FastPublisher against a real nats-server: messages arrive intact and in order, and a
connection the server dropped is re-established on the next publish."""

from __future__ import annotations

import asyncio

import pytest

from common.errors import BusUnavailable
from common.fastpub import FastPublisher


async def test_publishes_in_order(nats_server, nc) -> None:
    got: list[bytes] = []
    done = asyncio.Event()
    after = asyncio.Event()

    async def cb(msg) -> None:
        got.append(msg.data)
        if len(got) == 200:
            done.set()
        if msg.data == b"after":
            after.set()

    await nc.subscribe("fp.test", cb=cb)
    await nc.flush()
    pub = FastPublisher(nats_server.url, name="t")
    payloads = [bytes([i % 256]) * (i * 37) for i in range(200)]
    for p in payloads:
        pub.publish("fp.test", p)
    pub.poll()
    await asyncio.wait_for(done.wait(), 10)
    assert got == payloads
    # a broken socket is replaced on the next publish
    assert pub.sock is not None
    pub.sock.close()
    pub.publish("fp.test", b"after")
    try:
        await asyncio.wait_for(after.wait(), 10)  # the message sent after the reconnect arrives
    finally:
        pub.close()
    assert got[200:] == [b"after"]


def test_unreachable_is_bus_unavailable() -> None:
    with pytest.raises(BusUnavailable):
        FastPublisher("nats://127.0.0.1:1", name="t", timeout=1)
