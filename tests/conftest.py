"""Shared fixtures: a real nats-server per test (free port, temp JetStream dir), a connected
client, and a JetStream context with Belayer's streams declared."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from common.natsserver import NatsServer, start_nats_server
from tests.model_fixtures import warm_model  # noqa: F401  (a session fixture, used by name)


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    """A real nats-server with JetStream, stopped after the test."""
    server = start_nats_server(tmp_path / "nats")
    try:
        yield server
    finally:
        server.stop()


@pytest_asyncio.fixture
async def nc(nats_server: NatsServer) -> AsyncIterator[NATS]:
    """A client connected to ``nats_server``."""
    from common.bus import connect

    client = await connect(nats_server.url, name="test")
    try:
        yield client
    finally:
        await client.drain()


@pytest_asyncio.fixture
async def js(nc: NATS) -> JetStreamContext:
    """JetStream with Belayer's streams and KV buckets declared."""
    from common.bus import ensure_jetstream

    ctx = nc.jetstream()
    await ensure_jetstream(ctx)
    return ctx
