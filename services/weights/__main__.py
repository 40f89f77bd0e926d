"""``python -m services.weights``: run the weight store until SIGTERM."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from common.logging import configure
from common.service import run_main
from services.weights.config import WeightStoreConfig
from services.weights.service import run


def parse_args(argv: list[str] | None = None) -> WeightStoreConfig:
    """Command line → config."""
    parser = argparse.ArgumentParser(
        prog="python -m services.weights",
        description=(
            "Belayer weight store: loads a Hugging Face style model directory (config.json + "
            "safetensors) into shared memory as version 1, serves manifests on "
            "belayer.weights.get and accepts new versions on belayer.weights.push. Shared "
            "memory files are /dev/shm/belayer-<run-id>-weights-v<N>; SIGTERM removes them."
        ),
    )
    parser.add_argument("--nats-url", required=True, help="NATS server, e.g. nats://127.0.0.1:4222")
    parser.add_argument("--run-id", required=True, help="node run id; names the shm files")
    parser.add_argument(
        "--model-dir",
        required=True,
        type=Path,
        help="model directory (config.json + *.safetensors)",
    )
    parser.add_argument(
        "--keep-versions",
        type=int,
        default=WeightStoreConfig.keep_versions,
        help="newest versions kept in memory (default: %(default)s)",
    )
    parser.add_argument("--log-file", type=Path, default=None, help="append JSON log lines here")
    args = parser.parse_args(argv)
    return WeightStoreConfig(
        nats_url=args.nats_url,
        run_id=args.run_id,
        model_dir=args.model_dir,
        keep_versions=args.keep_versions,
        log_file=args.log_file,
    )


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    configure("weights", log_file=config.log_file)
    return run_main(lambda stop: run(config, stop=stop))


if __name__ == "__main__":
    sys.exit(main())
