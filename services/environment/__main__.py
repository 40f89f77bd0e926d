"""Belayer environment service: Docker sandboxes with prefix-consistent full_checkpoint /
full_restore (files + processes via CRIU), served on belayer.env.*."""

from common.service import exit_process, main
from services.environment.config import EnvConfig
from services.environment.service import run

if __name__ == "__main__":
    exit_process(
        main(
            EnvConfig,
            run,
            name="environment",
            prog="python -m services.environment",
            description=__doc__,
        )
    )
