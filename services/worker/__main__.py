"""``python -m services.worker``: one rollout worker process."""

from __future__ import annotations

import argparse
from pathlib import Path

from common.logging import configure
from common.service import run_main
from services.worker.config import WorkerConfig
from services.worker.engine.config import EngineConfig


def parse(argv: list[str] | None = None) -> WorkerConfig:
    p = argparse.ArgumentParser(
        prog="python -m services.worker",
        description="Belayer rollout worker: serves one engine from weights and KV memory owned "
        "by the weight store and KV arena services.",
    )
    p.add_argument("--nats-url", required=True, help="NATS server URL")
    p.add_argument("--engine-id", default="e0", help="engine this worker serves")
    p.add_argument(
        "--role",
        choices=["main", "shadow"],
        default="main",
        help="main claims the engine now; shadow prepares and waits to take over",
    )
    p.add_argument(
        "--heartbeat-file", default="", help="file whose mtime is refreshed every loop turn"
    )
    p.add_argument("--max-num-seqs", type=int, default=16, help="decode batch size limit")
    p.add_argument("--max-model-len", type=int, default=2048, help="longest prompt+output")
    p.add_argument(
        "--cold-load",
        default="",
        metavar="MODEL_DIR",
        help="baseline: load weights from this directory instead of shared memory",
    )
    p.add_argument(
        "--hang-threshold",
        type=float,
        default=2.0,
        help="shadow: seconds of stale heartbeat (process alive) that count as a hang",
    )
    p.add_argument("--log-file", default="", help="JSON log file (default: stderr)")
    a = p.parse_args(argv)
    return WorkerConfig(
        nats_url=a.nats_url,
        engine_id=a.engine_id,
        role=a.role,
        heartbeat_file=a.heartbeat_file,
        engine=EngineConfig(
            max_num_seqs=a.max_num_seqs,
            max_model_len=a.max_model_len,
            max_num_batched_tokens=max(4096, a.max_model_len),
        ),
        log_file=a.log_file,
        cold_load_dir=a.cold_load,
        hang_threshold_s=a.hang_threshold,
    )


def main(argv: list[str] | None = None) -> int:
    config = parse(argv)
    configure(
        f"worker:{config.engine_id}", log_file=Path(config.log_file) if config.log_file else None
    )
    if config.role == "shadow":
        raise SystemExit("a shadow runs as `python -m services.shadow`")
    from services.worker.service import run

    return run_main(lambda stop: run(config, stop=stop))


if __name__ == "__main__":
    raise SystemExit(main())
