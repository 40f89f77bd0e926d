"""One bad item must not kill a long-running loop.

A service's background loops (a router's heartbeat and persist loops, a supervisor's watchers,
the environment's reconnect loop…) handle one item at a time: an engine to ping, a chunk to
persist, a child that exited. ``isolated`` wraps the handling of one item: an exception is
logged as one structured line (``loop_item_failed`` with the loop's name, the item and the
error) and dropped, and the loop goes on with the next item. Cancellation is not an error and
passes through (``CancelledError`` is not an ``Exception``), so stopping a service still works.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def isolated(log: Any, loop: str, **item: Any) -> Iterator[None]:
    """Run one item of ``loop``; an exception is logged (``loop_item_failed``) and swallowed.
    ``item`` names the item in the log line (``engine="e0"``)."""
    try:
        yield
    except Exception as exc:
        log.error(
            "loop_item_failed",
            loop=loop,
            error=f"{type(exc).__name__}: {exc}",
            **{
                k: v if isinstance(v, (str, int, float, bool, type(None))) else repr(v)
                for k, v in item.items()
            },
        )
