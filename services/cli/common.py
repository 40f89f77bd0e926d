"""Helpers shared by the CLI commands: running coroutines, error reporting, bus access."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import typer

from common.bus import connect
from common.errors import BelayerError, InvalidRequest
from common.node import resolve_nats_url

T = TypeVar("T")


def fail(message: str, code: int = 1) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine; Belayer errors become a clear message and a non-zero exit."""
    try:
        return asyncio.run(coro)
    except BelayerError as exc:
        fail(str(exc), 2 if isinstance(exc, InvalidRequest) else 1)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    raise AssertionError("unreachable")


async def with_bus(
    nats_url: str | None, fn: Callable[[Any], Awaitable[T]], *, name: str = "cli"
) -> T:
    """Connect (no reconnect loops: a CLI should fail fast), run ``fn(nc)``, close."""
    url = resolve_nats_url(nats_url)
    nc = await connect(url, name=name, timeout=3.0, reconnect=False)
    try:
        return await fn(nc)
    finally:
        await nc.drain()


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")
