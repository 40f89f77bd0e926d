"""``python -m services.environment --nats-url URL [--run-dir DIR] [--log-file F]``."""

from __future__ import annotations

import argparse
from pathlib import Path

from common.logging import configure
from common.service import run_main
from services.environment.config import EnvConfig
from services.environment.service import run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.environment")
    p.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    p.add_argument("--run-dir", type=Path, default=Path(".belayer"))
    p.add_argument("--log-file", type=Path, default=None)
    p.add_argument("--image", default=EnvConfig.image)
    p.add_argument("--checkpoint-method", choices=["auto", "runc", "docker"], default="auto")
    p.add_argument("--node", default=None, help="belayer.node label (default: host name)")
    p.add_argument("--cooldown-s", type=float, default=EnvConfig.cooldown_s)
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
