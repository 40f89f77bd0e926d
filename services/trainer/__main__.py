"""Belayer GRPO trainer: consumes finished trajectories from JetStream stream TRAJECTORIES
(durable consumer, explicit acks), runs one GRPO update per batch of groups on its own copy of
the current weights, checkpoints (model, optimiser, scheduler, RNG, trained trajectory ids)
under --checkpoint-dir and pushes each new version to the weight store; a restarted trainer
resumes from its latest checkpoint and trains every trajectory exactly once."""

from common.service import exit_process, main
from services.trainer.config import TrainerConfig
from services.trainer.service import run

if __name__ == "__main__":
    exit_process(
        main(
            TrainerConfig,
            run,
            name="trainer",
            prog="python -m services.trainer",
            description=__doc__,
        )
    )
