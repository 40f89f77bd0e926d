"""``python -m services.environment --nats-url URL [--run-dir DIR] [--log-file F]``."""

from __future__ import annotations

import argparse
from pathlib import Path

from common.logging import configure
from common.service import run_main
from services.environment.config import EnvConfig
from services.environment.service import run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m services.environment",
        description="Belayer environment service: Docker sandboxes with prefix-consistent "
        "full_checkpoint / full_restore (files + processes via CRIU), served on belayer.env.*.",
    )
    p.add_argument("--nats-url", default="nats://127.0.0.1:4222", help="NATS server URL")
    p.add_argument(
        "--run-dir",
        type=Path,
        default=Path(".belayer"),
        help="run directory: checkpoints and sandbox records live under <run-dir>/env",
    )
    p.add_argument("--log-file", type=Path, default=None, help="JSON log file (default: stderr)")
    p.add_argument("--image", default=EnvConfig.image, help="default sandbox image")
    p.add_argument(
        "--checkpoint-method",
        choices=["auto", "runc", "docker"],
        default="auto",
        help="auto: CRIU via runc on the Docker-managed container, Docker's API as fallback",
    )
    p.add_argument(
        "--node",
        default=None,
        help="belayer.node label: containers of this node are reaped at start (default: host name)",
    )
    p.add_argument(
        "--cooldown-s",
        type=float,
        default=EnvConfig.cooldown_s,
        help="seconds checkpointing stays disabled after a checkpoint timed out",
    )
    args = p.parse_args(argv)
    configure("environment", log_file=args.log_file)
    config = EnvConfig(
        nats_url=args.nats_url,
        run_dir=args.run_dir,
        image=args.image,
        checkpoint_method=args.checkpoint_method,
        cooldown_s=args.cooldown_s,
        **({"node": args.node} if args.node else {}),
    )
    return run_main(lambda stop: run(config, stop=stop))


if __name__ == "__main__":
    raise SystemExit(main())
