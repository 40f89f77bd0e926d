"""A worker following the weight store asks again when a refresh fails (``Worker._fetch_newer``):
the store killed between receiving the request and answering it left engines on the old
version for good (a training soak: the lane waited 60 s for a switch that never came)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from common.errors import NotFound, Timeout
from services.worker import service
from services.worker.config import WorkerConfig
from services.worker.service import Worker


def worker(own: int, wait_s: float = 30.0) -> Worker:
    w = Worker(WorkerConfig(owner_restart_wait_s=wait_s), None, None, None)  # type: ignore[arg-type]
    w.weight_version = own
    return w


def store(
    monkeypatch: pytest.MonkeyPatch, answers: list[Exception | None], current: list[int]
) -> list[int]:
    """``fetch_manifest`` answers in turn (an exception, or the asked version); the store's
    current version reads ``current`` in turn (the last one repeats). Returns the asked
    versions."""
    asked: list[int] = []

    async def fetch(nc: Any, version: int, **kw: Any) -> SimpleNamespace:
        asked.append(version)
        answer = answers.pop(0) if answers else None
        if answer is not None:
            raise answer
        return SimpleNamespace(version=version)

    async def now(js: Any) -> SimpleNamespace:
        return SimpleNamespace(version=current.pop(0) if len(current) > 1 else current[0])

    monkeypatch.setattr(service, "fetch_manifest", fetch)
    monkeypatch.setattr(service, "current_manifest", now)
    monkeypatch.setattr(service, "map_weights", lambda m: {"v": m.version})
    monkeypatch.setattr(service, "REFRESH_RETRY_S", 0.0)
    return asked


async def test_a_store_that_died_mid_request_is_asked_again(monkeypatch) -> None:
    asked = store(monkeypatch, [Timeout("no reply in time")], current=[6])
    got = await worker(own=5)._fetch_newer(6)
    assert got is not None and got[0].version == 6 and got[1] == {"v": 6}
    assert asked == [6, 6]


async def test_a_collected_version_gives_way_to_the_current_one(monkeypatch) -> None:
    asked = store(monkeypatch, [NotFound("version 6 not kept")], current=[7])
    got = await worker(own=5)._fetch_newer(6)
    assert got is not None and got[0].version == 7 and asked == [6, 7]


async def test_nothing_newer_than_the_engine_stops_asking(monkeypatch) -> None:
    asked = store(monkeypatch, [Timeout("no reply")], current=[5])
    assert await worker(own=5)._fetch_newer(6) is None
    assert asked == [6]


async def test_asking_stops_at_the_owner_restart_wait(monkeypatch) -> None:
    asked = store(monkeypatch, [Timeout("no reply")] * 1000, current=[6])
    assert await worker(own=5, wait_s=0.0)._fetch_newer(6) is None
    assert asked == [6]
