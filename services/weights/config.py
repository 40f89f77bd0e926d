"""Settings of the weight store service (loaded once in ``__main__``, passed down)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from common.service import ServiceConfig


@dataclass(frozen=True)
class WeightStoreConfig(ServiceConfig):
    """How one node's weight store runs."""

    run_id: str = "dev"
    """Names this node's shm files (``/dev/shm/belayer-<run_id>-weights-v<N>``)."""
    model_dir: Path = Path("model")
    """Hugging Face style directory (``config.json`` + safetensors) loaded as version
    ``first_version``."""
    first_version: int = 1
    """The version number the model directory is loaded as on a fresh bus. A resumed
    ``belayer run`` starts its new node one below its trainer checkpoint's version, so the
    trainer pushes the checkpoint as that version and the run's numbering goes on."""
    keep_versions: int = 2
    """Newest versions kept in memory; older ones are unlinked after each push (readers
    that already mapped them keep their memory; new readers get ``NotFound``)."""

    host: str = ""
    """Engine-host mode: the name of the engine host this store serves. It then loads no
    model directory: it mirrors the node's versions over the bus (``weights.export``, the
    ``weight_objects`` Object Store) into this host's shared memory and serves them on
    ``belayer.host.<host>.weights.get``; ``model_dir`` is where it writes ``config.json``."""

    def __post_init__(self) -> None:
        if self.keep_versions < 1 or self.first_version < 1:
            raise ValueError(
                f"keep_versions and first_version must be >= 1, got {self.keep_versions}, "
                f"{self.first_version}"
            )
