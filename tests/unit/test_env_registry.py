"""The placed environment client's view of the environment hosts (KV ``env_hosts``)."""

from __future__ import annotations

import asyncio
import time

import pytest

from common.errors import Timeout
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


def _answer(boot: str) -> EnvHostInfo:
    return EnvHostInfo(host="h", capacity=4, sandboxes=1, ts=time.time(), boot=boot)


@pytest.mark.parametrize(
    ("known", "answers", "gone"),
    [
        ("", ["a", "a", "a"], False),  # the same process all along: only the deadline
        ("", ["a", "a", "b"], True),  # restarted between two probes
        ("", ["a", None], True),  # no responder
        ("a", [Timeout, "b"], True),  # the first ping went to the dying process too
        ("b", [Timeout, "b", "b"], False),  # slow, not restarted: the process heard from before
        ("a", ["b", "b"], False),  # restarted before the operation was sent: it went to "b"
    ],
)
async def test_an_operation_fails_when_another_process_answers_its_hosts_ping(
    known: str, answers: list[object], gone: bool
) -> None:
    """``PlacedEnvClient._gone`` (the watch of every operation on a host) returns, failing the
    operation, once the host has no responder or a ping is answered by another process
    (``EnvHostInfo.boot``) than the one the operation went to."""
    client = PlacedEnvClient(None, probe_every_s=0.0)  # type: ignore[arg-type]  # pings are scripted
    if known:
        client.boots["h"] = known
    script = list(answers)
    exhausted = asyncio.Event()

    async def ping(host: str) -> EnvHostInfo | None:
        assert host == "h"
        if not script:
            exhausted.set()
            await asyncio.Event().wait()  # silent from here: only a return can end the watch
        step = script.pop(0)
        if step is Timeout:
            raise Timeout("no answer")
        return None if step is None else _answer(str(step))

    client.ping = ping  # type: ignore[method-assign]
    watch = asyncio.ensure_future(client._gone("h"))
    ended = asyncio.ensure_future(exhausted.wait())
    await asyncio.wait({watch, ended}, timeout=5.0, return_when=asyncio.FIRST_COMPLETED)
    assert watch.done() is gone, (known, answers)
    if gone:
        assert not script, "the watch returned before its host's last answer"
    for task in (watch, ended):
        task.cancel()
