"""structlog, configured once per process: JSON lines to a file (production) and/or a console
renderer on a TTY. Event names are snake_case; context (service, engine, request…) is bound."""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any, TextIO

import structlog


def configure(
    service: str,
    *,
    log_file: Path | None = None,
    level: str = "info",
    console: bool | None = None,
) -> structlog.stdlib.BoundLogger:
    """Configure structlog for this process and return a logger bound to ``service``.

    ``log_file`` gets JSON lines. ``console`` (default: stderr is a TTY) adds a human renderer on
    stderr; when neither a file nor a TTY is present, JSON goes to stderr.
    """
    lvl = getattr(logging, level.upper(), logging.INFO)
    if console is None:
        console = sys.stderr.isatty()
    sinks: list[tuple[TextIO, bool]] = []
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        sinks.append((open(log_file, "a", buffering=1), False))
    if console or not sinks:
        sinks.append((sys.stderr, bool(console)))

    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
        structlog.processors.format_exc_info,
    ]
    json_renderer = structlog.processors.JSONRenderer()
    console_renderer = structlog.dev.ConsoleRenderer(colors=False)

    def fan_out(_logger: Any, _name: str, event: MutableMapping[str, Any]) -> str:
        for stream, human in sinks:
            line = (
                console_renderer(None, "", dict(event))
                if human
                else json_renderer(None, "", dict(event))
            )
            try:
                stream.write(str(line) + "\n")
                stream.flush()
            except (ValueError, OSError):
                pass  # a closed stream at shutdown must not crash the service
        raise structlog.DropEvent

    structlog.configure(
        processors=[*shared, fan_out],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.bind_contextvars(service=service)
    return structlog.get_logger()


def get_logger(**bound: Any) -> Any:
    """A lazy logger with bound context: it resolves the configuration at each use, so loggers
    made at import time follow ``configure`` called later in ``__main__``."""
    return structlog.get_logger(**bound)


# Until a service calls ``configure``: human-readable lines on stderr (never stdout, which CLI
# commands keep for their output).
structlog.configure(
    processors=[
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.dev.ConsoleRenderer(colors=False),
    ],
    wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
    logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    cache_logger_on_first_use=False,
)
