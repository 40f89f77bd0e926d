"""``common.tasks.gather_all``: steps run together; the first failure stops the others and is
raised as it is."""

from __future__ import annotations

import asyncio

import pytest

from common.errors import Timeout
from common.tasks import gather_all


async def test_all_steps_complete() -> None:
    done: list[str] = []

    async def step(name: str) -> None:
        await asyncio.sleep(0)
        done.append(name)

    await gather_all(step("a"), step("b"), step("c"))
    assert sorted(done) == ["a", "b", "c"]


async def test_a_failure_cancels_the_others_and_is_raised_unwrapped() -> None:
    started = asyncio.Event()
    stopped: list[str] = []

    async def slow() -> None:
        started.set()
        try:
            await asyncio.Event().wait()  # never set: only a cancel ends it
        finally:
            stopped.append("slow")

    async def failing() -> None:
        await started.wait()
        raise Timeout("trainer did not answer")

    with pytest.raises(Timeout, match="trainer did not answer"):
        await gather_all(slow(), failing())
    # The sibling was cancelled and had finished its cleanup before gather_all raised.
    assert stopped == ["slow"]


async def test_cancelling_the_caller_cancels_every_step() -> None:
    running = asyncio.Event()
    stopped: list[int] = []

    async def forever(i: int) -> None:
        try:
            if i == 1:
                running.set()
            await asyncio.Event().wait()
        finally:
            stopped.append(i)

    outer = asyncio.create_task(gather_all(forever(0), forever(1)))
    await running.wait()
    outer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await outer
    assert sorted(stopped) == [0, 1]
