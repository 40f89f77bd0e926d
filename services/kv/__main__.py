"""``python -m services.kv``: run the KV arena service until SIGTERM."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from common.logging import configure
from common.service import run_main
from services.kv.config import KvArenaConfig
from services.kv.service import run


def parse_args(argv: list[str] | None = None) -> KvArenaConfig:
    """Command line → config."""
    parser = argparse.ArgumentParser(
        prog="python -m services.kv",
        description=(
            "Belayer KV arena: allocates one zero-filled paged KV block pool per engine in "
            "shared memory (/dev/shm/belayer-<run-id>-kv-<engine>), shaped from the model's "
            "config.json; serves belayer.kv.get and belayer.kv.flush. The arenas outlive any "
            "rollout worker; SIGTERM removes them."
        ),
    )
    parser.add_argument("--nats-url", required=True, help="NATS server, e.g. nats://127.0.0.1:4222")
    parser.add_argument("--run-id", required=True, help="node run id; names the shm files")
    parser.add_argument(
        "--model-dir",
        required=True,
        type=Path,
        help="model directory (its config.json sizes the arena)",
    )
    parser.add_argument(
        "--engines", required=True, help="comma-separated engine ids, one arena each (e.g. e0,e1)"
    )
    parser.add_argument(
        "--num-blocks",
        type=int,
        default=KvArenaConfig.num_blocks,
        help="KV blocks per arena (default: %(default)s)",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=KvArenaConfig.block_size,
        help="tokens per block (default: %(default)s)",
    )
    parser.add_argument(
        "--dtype", default=None, help="arena dtype, e.g. bfloat16 (default: the model's dtype)"
    )
    parser.add_argument("--log-file", type=Path, default=None, help="append JSON log lines here")
    args = parser.parse_args(argv)
    engines = tuple(e.strip() for e in args.engines.split(",") if e.strip())
    try:
        return KvArenaConfig(
            nats_url=args.nats_url,
            run_id=args.run_id,
            model_dir=args.model_dir,
            engine_ids=engines,
            num_blocks=args.num_blocks,
            block_size=args.block_size,
            dtype=args.dtype,
            log_file=args.log_file,
        )
    except ValueError as exc:
        parser.error(str(exc))


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    configure("kv", log_file=config.log_file)
    return run_main(lambda stop: run(config, stop=stop))


if __name__ == "__main__":
    sys.exit(main())
