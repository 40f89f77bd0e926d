"""The one service shape: status enum, signal handling (SIGTERM → drain, second signal →
cancel), and a readiness flag the supervisor can observe."""

from __future__ import annotations

import asyncio
import enum
import signal
import sys
from collections.abc import Callable

from common.errors import BelayerError
from common.logging import get_logger


class Status(enum.Enum):
    """Lifecycle of every service."""

    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"


def install_signal_handlers(stop: asyncio.Event, on_second: Callable[[], None]) -> None:
    """First SIGTERM/SIGINT sets ``stop`` (graceful drain); a second calls ``on_second``
    (usually: cancel the main task)."""
    loop = asyncio.get_running_loop()

    def handler() -> None:
        if stop.is_set():
            on_second()
        else:
            stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, handler)
        except (NotImplementedError, RuntimeError):  # not the main thread (tests)
            pass


def run_main(coro_factory: Callable[[asyncio.Event], object]) -> int:
    """Run a service's ``run(config, stop=...)`` coroutine with signal handling; return an exit
    code (0 on graceful stop)."""

    async def main() -> int:
        stop = asyncio.Event()
        task = asyncio.current_task()
        assert task is not None

        def cancel() -> None:
            task.cancel()

        install_signal_handlers(stop, cancel)
        await coro_factory(stop)  # type: ignore[misc]
        return 0

    try:
        return asyncio.run(main())
    except (KeyboardInterrupt, asyncio.CancelledError):
        return 130
    except BelayerError as exc:
        # A fatal error: one clear line (structured in the log file), a non-zero exit, and the
        # supervisor restarts the service.
        get_logger().error("service_failed", code=exc.code, error=str(exc))
        print(f"error: {exc}", file=sys.stderr)
        return 1
