"""Belayer rollout worker: serves one engine from weights and KV memory owned by the weight
store and KV arena services. ``--role main`` (the default) claims the engine and serves it;
``--role shadow`` is its prepared standby: everything slow done ahead of time (weights and
arena mapped, engine built and warmed), it watches the main worker and takes over when it
dies or hangs (``services/worker/shadow.py``)."""

import asyncio

from common.service import main
from services.worker.config import WorkerConfig


async def run(
    config: WorkerConfig, *, stop: asyncio.Event, ready: asyncio.Event | None = None
) -> None:
    """The main worker or the shadow, as ``config.role`` says."""
    if config.role == "shadow":
        from services.worker import shadow

        await shadow.run(config, stop=stop, ready=ready)
    else:
        from services.worker import service

        await service.run(config, stop=stop, ready=ready)


if __name__ == "__main__":
    raise SystemExit(
        main(
            WorkerConfig,
            run,
            name=lambda c: f"{'worker' if c.role == 'main' else 'shadow'}:{c.engine_id}",
            prog="python -m services.worker",
            description=__doc__,
        )
    )
