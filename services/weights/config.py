"""Settings of the weight store service (loaded once in ``__main__``, passed down)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from common.auth import BusConfig


@dataclass(frozen=True)
class WeightStoreConfig:
    """How one node's weight store runs."""

    nats_url: str = "nats://127.0.0.1:4222"
    """NATS server to serve ``weights.get`` / ``weights.push`` on."""
    bus: BusConfig = field(default_factory=BusConfig)
    """Credentials and TLS for the bus (``--bus-creds`` …; the supervisor fills them in)."""
    run_id: str = "dev"
    """Names this node's shm files (``/dev/shm/belayer-<run_id>-weights-v<N>``)."""
    model_dir: Path = Path("model")
    """Hugging Face style directory (``config.json`` + safetensors) loaded as version 1."""
    keep_versions: int = 2
    """Newest versions kept in memory; older ones are unlinked after each push (readers
    that already mapped them keep their memory; new readers get ``NotFound``)."""
    log_file: Path | None = None
    """JSON log lines go here (stderr when unset)."""

    def __post_init__(self) -> None:
        if self.keep_versions < 1:
            raise ValueError(f"keep_versions must be >= 1, got {self.keep_versions}")
