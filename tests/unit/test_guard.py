"""``common.guard.isolated``: one failing item is one structured log line, and the loop goes on;
cancellation still stops it."""

from __future__ import annotations

import asyncio

import pytest
import structlog
from structlog.testing import capture_logs

from common.guard import isolated


async def test_a_failing_item_is_logged_and_the_loop_goes_on() -> None:
    log = structlog.get_logger()
    done: list[str] = []
    with capture_logs() as logs:
        for item in ["e0", "a.b", "e1"]:
            with isolated(log, "heartbeat_loop", engine=item):
                if "." in item:
                    raise ValueError(f"engine id {item!r} is not a valid subject token")
                done.append(item)
    assert done == ["e0", "e1"]
    [line] = [e for e in logs if e["event"] == "loop_item_failed"]
    assert line["loop"] == "heartbeat_loop" and line["engine"] == "a.b"
    assert line["log_level"] == "error" and "ValueError" in line["error"]


async def test_cancellation_passes_through() -> None:
    inside = asyncio.Event()

    async def loop() -> None:
        while True:
            with isolated(structlog.get_logger(), "loop"):
                inside.set()
                await asyncio.Event().wait()

    task = asyncio.create_task(loop())
    await asyncio.wait_for(inside.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)
