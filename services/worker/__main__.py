"""Belayer rollout worker: serves one engine from weights and KV memory owned by the weight
store and KV arena services (main role; a shadow runs as ``python -m services.shadow``)."""

from common.service import main
from services.worker.config import WorkerConfig
from services.worker.service import run

if __name__ == "__main__":
    raise SystemExit(
        main(
            WorkerConfig,
            run,
            name=lambda c: f"worker:{c.engine_id}",
            prog="python -m services.worker",
            description=__doc__,
        )
    )
