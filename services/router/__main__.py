"""Belayer router: places generation requests on engines, streams tokens to callers, keeps the
JetStream token log and resumes interrupted requests."""

from common.service import exit_process, main
from services.router.config import RouterConfig
from services.router.service import run

if __name__ == "__main__":
    exit_process(
        main(
            RouterConfig, run, name="router", prog="python -m services.router", description=__doc__
        )
    )
