"""The end of a service's connection (``common.service._disconnect``): a drain that finishes in
time closes quietly; one that hangs past ``DISCONNECT_TIMEOUT_S`` is cancelled, said in the log,
and the connection is closed. The stand-in mimics nats-py's ``drain``, which swallows its own
cancellation and closes the connection (so ``asyncio.wait_for`` would report it finished in
time); the time limit is shortened, and nothing here waits on a clock but that limit."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from common import service


class Conn:
    """The part of ``nats.aio.client.Client`` that ``_disconnect`` uses."""

    def __init__(self, hang: bool) -> None:
        self.hang = hang
        self.is_closed = False
        self.closes = 0

    async def drain(self) -> None:
        try:
            if self.hang:  # a subscription whose pending messages nobody reads
                await asyncio.Event().wait()
        except asyncio.CancelledError:
            pass  # as nats-py does: then flush and close
        self.is_closed = True

    async def close(self) -> None:
        self.closes += 1
        self.is_closed = True


class Log:
    def __init__(self) -> None:
        self.warnings: list[tuple[str, dict[str, Any]]] = []

    def warning(self, event: str, **fields: Any) -> None:
        self.warnings.append((event, fields))

    def debug(self, event: str, **fields: Any) -> None:
        pass


@pytest.fixture(autouse=True)
def short_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(service, "DISCONNECT_TIMEOUT_S", 0.05)


async def test_a_drain_in_time_closes_quietly() -> None:
    conn, log = Conn(hang=False), Log()
    await service._disconnect(conn, log)  # type: ignore[arg-type]
    assert conn.is_closed and log.warnings == []


async def test_a_hanging_drain_is_cut_said_and_the_connection_closed() -> None:
    conn, log = Conn(hang=True), Log()
    await service._disconnect(conn, log)  # type: ignore[arg-type]
    assert conn.is_closed
    assert log.warnings == [("disconnect_timeout", {"timeout": 0.05})]
