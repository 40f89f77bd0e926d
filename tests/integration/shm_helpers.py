"""Shared by the weight-store and KV-arena tests: a small model, a per-test run id whose
/dev/shm files never leak, and a service run as a task that must clean up its files."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from common import shm
from model.tiny import init_tiny_model

WAIT = 20.0


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return init_tiny_model(
        tmp_path / "tiny",
        hidden_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        intermediate_size=128,
        vocab_size=512,
    )


@pytest.fixture
def run_id() -> Iterator[str]:
    rid = f"t{uuid.uuid4().hex[:8]}"
    yield rid
    for path in shm.list_files(rid):  # never leak /dev/shm, even when a test fails
        shm.unlink(path)


@asynccontextmanager
async def running_service(
    run: Callable[..., Coroutine[Any, Any, None]], config: Any, *, what: str
) -> AsyncIterator[None]:
    """Run ``run(config, stop=…, ready=…)`` as a task; on exit stop it and check it removed
    every shm file of ``config.run_id``."""
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(run(config, stop=stop, ready=ready))
    ready_task = asyncio.create_task(ready.wait())
    done, _ = await asyncio.wait({task, ready_task}, timeout=WAIT, return_when="FIRST_COMPLETED")
    if task in done:
        ready_task.cancel()
        task.result()  # raises the startup error
    assert ready_task in done, f"{what} did not become ready"
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait_for(task, WAIT)
        assert shm.list_files(config.run_id) == []
