"""Belayer controller: agentic rollouts (the agent loop of every trajectory, its sandbox, the
checkpoint policy and recovery aligned with the LLM context), served on belayer.rollout.*."""

from common.service import exit_process, main
from services.controller.config import ControllerConfig
from services.controller.service import run

if __name__ == "__main__":
    exit_process(
        main(
            ControllerConfig,
            run,
            name="controller",
            prog="python -m services.controller",
            description=__doc__,
        )
    )
