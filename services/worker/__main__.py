"""Belayer rollout worker: serves one engine from weights and KV memory owned by the weight
store and KV arena services. ``--role main`` (the default) claims the engine and serves it;
``--role shadow`` is its prepared standby: everything slow done ahead of time (weights and
arena mapped, engine built and warmed), it watches the main worker and takes over when it
dies or hangs (``services/worker/shadow.py``)."""

import asyncio

from common.service import exit_process, main, run_service
from services.worker.config import WorkerConfig
from services.worker.service import WorkerProcess, WorkerService
from services.worker.shadow import ShadowService


async def run(
    config: WorkerConfig, *, stop: asyncio.Event, ready: asyncio.Event | None = None
) -> None:
    """Run the main worker (``service.WorkerService``) or the shadow (``shadow.ShadowService``),
    as ``config.role`` says, until ``stop``."""
    process: WorkerProcess = (
        ShadowService(config) if config.role == "shadow" else WorkerService(config)
    )
    await run_service(process, stop=stop, ready=ready)


if __name__ == "__main__":
    exit_process(
        main(
            WorkerConfig,
            run,
            name=lambda c: f"{'worker' if c.role == 'main' else 'shadow'}:{c.engine_id}",
            prog="python -m services.worker",
            description=__doc__,
        )
    )
