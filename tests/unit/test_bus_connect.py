"""A one-off bus connection to a server that refuses gives up by itself, within its timeout,
rather than counting on the timeout's cancellation (which nats-py's connect can swallow on
Python 3.11: a `belayer up --join` of a dead port once hung past 120 s)."""

from __future__ import annotations

import socket

import pytest

from common.bus import RECONNECT_WAIT_S, connect, connect_attempts
from common.errors import BusUnavailable
from common.natsserver import NatsServer


def test_a_one_off_connection_tries_as_often_as_fits_in_its_timeout() -> None:
    assert connect_attempts(5.0, reconnect=True) == -1  # a service keeps reconnecting
    assert connect_attempts(5.0, reconnect=False) == int(5.0 / RECONNECT_WAIT_S) - 1
    assert connect_attempts(0.1, reconnect=False) == 1  # 0 would mean "unbounded" to nats-py


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_refusing_server_ends_the_attempt_before_the_timeout() -> None:
    url = f"nats://127.0.0.1:{_closed_port()}"
    with pytest.raises(BusUnavailable) as caught:
        await connect(url, name="t", timeout=2.0, reconnect=False)
    message = str(caught.value)
    assert "cannot reach NATS" in message and url in message
    # the tries ran out ("no servers"), not the timeout ("TimeoutError")
    assert "no servers available" in message and "TimeoutError" not in message


async def test_a_service_connection_gives_up_by_itself_too_then_reconnects_without_bound(
    nats_server: NatsServer,
) -> None:
    """A service's connection (``reconnect=True``) bounds its first connect the same way; once
    it is up, nats-py's reconnection count is unbounded again."""
    url = f"nats://127.0.0.1:{_closed_port()}"
    with pytest.raises(BusUnavailable) as caught:
        await connect(url, name="t", timeout=2.0, reconnect=True)
    assert "no servers available" in str(caught.value)
    service = await connect(nats_server.url, name="t", timeout=2.0, reconnect=True)
    one_off = await connect(nats_server.url, name="t", timeout=2.0, reconnect=False)
    try:
        assert service.options["max_reconnect_attempts"] == -1
        assert one_off.options["max_reconnect_attempts"] == connect_attempts(2.0, reconnect=False)
    finally:
        await service.close()
        await one_off.close()
