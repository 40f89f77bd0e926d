"""Background tasks a component starts and must keep alive: asyncio holds only a weak reference
to a running task, so an unreferenced one can be garbage-collected mid-flight. ``keep`` puts the
task in its owner's set and takes it out once done — the one home of "create_task, add to a
set, discard on done" (the owner cancels or awaits what is left when it stops)."""

from __future__ import annotations

import asyncio
from typing import Any, TypeVar

T = TypeVar("T")


def keep(tasks: set[asyncio.Task[Any]], task: asyncio.Task[T]) -> asyncio.Task[T]:
    """Hold ``task`` in ``tasks`` until it is done; returns it."""
    tasks.add(task)
    task.add_done_callback(tasks.discard)
    return task
