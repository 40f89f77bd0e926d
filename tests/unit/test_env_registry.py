"""The placed environment client's view of the environment hosts (KV ``env_hosts``)."""

from __future__ import annotations

import asyncio
import time

import pytest

from schemas.env import EnvHostInfo
from services.environment import client as env_client
from services.environment.client import PlacedEnvClient


async def test_a_registry_read_that_never_ends_keeps_the_last_view(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A read of the registrations that hangs (seen after an environment service was killed
    and restarted: every trajectory's sandbox call waited ~150 s behind it) is cut at
    ``REGISTRY_READ_S``: the callers get the last view, and the next read is tried again."""
    client = PlacedEnvClient(None)  # type: ignore[arg-type]  # hosts() reaches the bus only through _registry
    client._hosts = {"h": EnvHostInfo(host="h", capacity=4, sandboxes=1, ts=time.time())}
    reads = 0

    async def never() -> dict[str, EnvHostInfo]:
        nonlocal reads
        reads += 1
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    monkeypatch.setattr(client, "_registry", never)
    monkeypatch.setattr(env_client, "REGISTRY_READ_S", 0.05)
    callers = [client.hosts(now=True) for _ in range(3)]  # they queue behind one lock
    views = await asyncio.wait_for(asyncio.gather(*callers), timeout=5.0)
    assert [[h.host for h in v] for v in views] == [["h"]] * 3
    assert reads >= 1
