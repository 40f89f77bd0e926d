"""Background tasks a component starts and must keep alive: asyncio holds only a weak reference
to a running task, so an unreferenced one can be garbage-collected mid-flight. ``keep`` puts the
task in its owner's set and takes it out once done — the one home of "create_task, add to a
set, discard on done" (the owner cancels or awaits what is left when it stops). ``gather_all``
runs steps that must all succeed and, unlike ``asyncio.gather``, leaves none running when one
fails."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

T = TypeVar("T")


def keep(tasks: set[asyncio.Task[Any]], task: asyncio.Task[T]) -> asyncio.Task[T]:
    """Hold ``task`` in ``tasks`` until it is done; returns it."""
    tasks.add(task)
    task.add_done_callback(tasks.discard)
    return task


async def gather_all(*steps: Awaitable[Any]) -> None:
    """Await ``steps`` together. The first to fail cancels the others, which are awaited until
    they have stopped, and its exception is raised as it is (not wrapped in an
    ``ExceptionGroup``, so callers keep catching the error types they know). Cancelling the
    caller cancels every step the same way."""
    tasks = [asyncio.ensure_future(step) for step in steps]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
