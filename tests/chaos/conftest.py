"""Fixtures of the chaos tests: the shared node fixture (``tests/node_fixtures.py``; each module
sets ``NODE_ARGS``) and ``bus``, a client of it once every engine has a warm shadow."""

from collections.abc import AsyncIterator

import pytest_asyncio
from nats.aio.client import Client as NATS

from common.events import EventTail
from schemas.events import ShadowReady
from tests.integration.node_helpers import Node
from tests.node_fixtures import node

__all__ = ["bus", "node"]


@pytest_asyncio.fixture
async def bus(node: Node) -> AsyncIterator[tuple[NATS, EventTail]]:
    """A client of the module's node and its event log, once e0's and e1's shadows are ready."""
    from common.bus import connect

    nc = await connect(node.nats_url, name="chaos", bus=node.bus())
    events = await EventTail(nc).start()
    try:
        for eid in ("e0", "e1"):
            await events.wait_for(ShadowReady, eid, timeout=60)
        yield nc, events
    finally:
        await events.stop()
        await nc.drain()
