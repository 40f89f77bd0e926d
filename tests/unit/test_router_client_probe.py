"""The router client's silence probe (``_still_working``), decided from what the router says:
active in the same incarnation waits; finished waits once (the router marks a request finished
before its result, queued behind the last token-log write, reaches the inbox) and re-attaches
the second time; unknown, another incarnation or no answer re-attach at once."""

from __future__ import annotations

import asyncio

import pytest

from common.errors import BusUnavailable
from schemas.serving import RequestPhase, RouterStatus
from services.router import client


def _status(request: RequestPhase, router_id: str = "r1") -> RouterStatus:
    return RouterStatus(
        engines=[], inflight=0, finished=0, token_log_chunk=16, router_id=router_id, request=request
    )


def _probe(monkeypatch: pytest.MonkeyPatch, answers: list[RouterStatus | Exception]) -> list[bool]:
    replies = iter(answers)

    async def fake_status(*_: object, **__: object) -> RouterStatus:
        reply = next(replies)
        if isinstance(reply, Exception):
            raise reply
        return reply

    monkeypatch.setattr(client, "router_status", fake_status)
    stream = client._Stream(None)
    return [asyncio.run(client._still_working(None, "q", stream)) for _ in answers]  # type: ignore[arg-type]  # nc=None: router_status is faked


def test_active_waits_and_finished_waits_once(monkeypatch: pytest.MonkeyPatch) -> None:
    got = _probe(monkeypatch, [_status("active"), _status("finished"), _status("finished")])
    assert got == [True, True, False]


def test_unknown_another_router_or_silence_reattach(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _probe(monkeypatch, [_status("unknown")]) == [False]
    assert _probe(monkeypatch, [_status("active", "r1"), _status("active", "r2")]) == [True, False]
    assert _probe(monkeypatch, [BusUnavailable("no responders")]) == [False]
