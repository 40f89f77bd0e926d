"""``python -m services.supervisor``: the node supervisor (``belayer up`` runs this)."""

from __future__ import annotations

import argparse
from pathlib import Path

from common.config import RunPaths
from common.logging import configure
from common.service import run_main
from services.supervisor.config import SupervisorConfig


def parse(argv: list[str] | None = None) -> SupervisorConfig:
    p = argparse.ArgumentParser(
        prog="python -m services.supervisor",
        description="Belayer node supervisor: starts NATS and the services, restarts crashed ones.",
    )
    p.add_argument("--run-dir", default=".belayer", help="run directory")
    p.add_argument("--nats-url", default="", help="existing NATS server (default: start one)")
    p.add_argument("--model-dir", default="", help="model directory (default: tiny random model)")
    p.add_argument("--engines", type=int, default=1, help="number of rollout engines")
    p.add_argument("--recovery", choices=["belayer", "baseline"], default="belayer")
    p.add_argument("--token-log-chunk", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--environment", action="store_true", help="also run the sandbox service")
    p.add_argument("--run-id", default="")
    p.add_argument(
        "--failure-window",
        type=float,
        default=60.0,
        help="seconds: a second failure of an engine inside it marks the engine unhealthy",
    )
    p.add_argument(
        "--heartbeat-interval",
        type=float,
        default=5.0,
        help="seconds between the router's remote heartbeat pings (the baseline detector)",
    )
    p.add_argument(
        "--hang-threshold",
        type=float,
        default=2.0,
        help="seconds: a main worker whose heartbeat is older than this (alive) counts as hung",
    )
    p.add_argument(
        "--handover-timeout",
        type=float,
        default=15.0,
        help="seconds a dead main worker waits for its shadow's handover before a cold restart",
    )
    a = p.parse_args(argv)
    return SupervisorConfig(
        run_dir=a.run_dir,
        nats_url=a.nats_url,
        model_dir=a.model_dir,
        engines=a.engines,
        recovery=a.recovery,
        token_log_chunk=a.token_log_chunk,
        max_num_seqs=a.max_num_seqs,
        environment=a.environment,
        run_id=a.run_id,
        failure_window_s=a.failure_window,
        heartbeat_interval_s=a.heartbeat_interval,
        hang_threshold_s=a.hang_threshold,
        handover_timeout_s=a.handover_timeout,
    )


def main(argv: list[str] | None = None) -> int:
    config = parse(argv)
    paths = RunPaths(Path(config.run_dir).resolve())
    configure("supervisor", log_file=paths.logs / "supervisor.jsonl")
    from services.supervisor.service import run

    return run_main(lambda stop: run(config, stop=stop))


if __name__ == "__main__":
    raise SystemExit(main())
