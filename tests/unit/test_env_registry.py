"""The placed environment client's view of the environment hosts (KV ``env_hosts``)."""

from __future__ import annotations

import asyncio
import time

import pytest

from schemas.env import EnvHostInfo
from services.environment import client as env_client
from services.environment.client import PlacedEnvClient


@pytest.mark.parametrize("cleanup_hangs", [False, True])
async def test_a_registry_read_that_never_ends_keeps_the_last_view(
    monkeypatch: pytest.MonkeyPatch, cleanup_hangs: bool
) -> None:
    """A read of the registrations that hangs is cut at ``REGISTRY_READ_S``, even when its
    clean-up hangs too (the watch's ``stop``): the callers get the last view, and the next
    read is tried again. One shared lock orders every sandbox call's read, so one hung read
    would otherwise hold them all."""
    client = PlacedEnvClient(None)  # type: ignore[arg-type]  # hosts() reaches the bus only through _registry
    client._hosts = {"h": EnvHostInfo(host="h", capacity=4, sandboxes=1, ts=time.time())}
    reads = 0

    async def never() -> dict[str, EnvHostInfo]:
        nonlocal reads
        reads += 1
        try:
            await asyncio.Event().wait()
        finally:
            if cleanup_hangs:  # the cancelled read's clean-up never ends either
                await asyncio.shield(asyncio.Event().wait())
        raise AssertionError("unreachable")

    monkeypatch.setattr(client, "_registry", never)
    monkeypatch.setattr(env_client, "REGISTRY_READ_S", 0.05)
    callers = [client.hosts(now=True) for _ in range(3)]  # they queue behind one lock
    views = await asyncio.wait_for(asyncio.gather(*callers), timeout=5.0)
    assert [[h.host for h in v] for v in views] == [["h"]] * 3
    assert reads >= 1
