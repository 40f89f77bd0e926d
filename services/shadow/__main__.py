"""Belayer shadow: the prepared standby of one engine. It maps the weights and the arena,
builds and warms the engine, then watches the main worker and takes over when it dies or
hangs. Its flags are the rollout worker's (``WorkerConfig``)."""

from common.service import main
from services.shadow.service import run
from services.worker.client import WorkerConfig

if __name__ == "__main__":
    raise SystemExit(
        main(
            WorkerConfig,
            run,
            name=lambda c: f"shadow:{c.engine_id}",
            prog="python -m services.shadow",
            description=__doc__,
        )
    )
