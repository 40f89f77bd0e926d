"""``python -m services.router``: the router process."""

from __future__ import annotations

import argparse
from pathlib import Path

from common.logging import configure
from common.service import run_main
from services.router.config import RouterConfig


def parse(argv: list[str] | None = None) -> RouterConfig:
    p = argparse.ArgumentParser(
        prog="python -m services.router",
        description="Belayer router: places generation requests on engines, streams tokens to "
        "callers, keeps the JetStream token log and resumes interrupted requests.",
    )
    p.add_argument("--nats-url", required=True, help="NATS server URL")
    p.add_argument("--model-dir", required=True, help="model directory (for its tokenizer)")
    p.add_argument("--token-log-chunk", type=int, default=256, help="k: tokens per log chunk")
    p.add_argument(
        "--recovery",
        choices=["belayer", "baseline"],
        default="belayer",
        help="token-level resume (belayer) or regenerate from scratch (baseline)",
    )
    p.add_argument(
        "--failure-window",
        type=float,
        default=60.0,
        help="seconds: a second failure of an engine inside it marks it unhealthy",
    )
    p.add_argument(
        "--heartbeat-interval",
        type=float,
        default=5.0,
        help="seconds between remote heartbeat pings of each engine",
    )
    p.add_argument("--log-file", default="", help="JSON log file (default: stderr)")
    a = p.parse_args(argv)
    return RouterConfig(
        nats_url=a.nats_url,
        model_dir=a.model_dir,
        token_log_chunk=a.token_log_chunk,
        recovery=a.recovery,
        failure_window_s=a.failure_window,
        heartbeat_interval_s=a.heartbeat_interval,
        log_file=a.log_file,
    )


def main(argv: list[str] | None = None) -> int:
    config = parse(argv)
    configure("router", log_file=Path(config.log_file) if config.log_file else None)
    from services.router.service import run

    return run_main(lambda stop: run(config, stop=stop))


if __name__ == "__main__":
    raise SystemExit(main())
