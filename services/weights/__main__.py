"""Belayer weight store: loads a Hugging Face style model directory (config.json + safetensors)
into shared memory as version 1, serves manifests on belayer.weights.get and accepts new
versions on belayer.weights.push. Shared-memory files are
/dev/shm/belayer-<run-id>-weights-v<N>; SIGTERM removes them."""

from common.service import exit_process, main
from services.weights.config import WeightStoreConfig
from services.weights.service import run

if __name__ == "__main__":
    exit_process(
        main(
            WeightStoreConfig,
            run,
            name="weights",
            prog="python -m services.weights",
            description=__doc__,
        )
    )
