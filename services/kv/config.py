"""Settings of the KV arena service (loaded once in ``__main__``, passed down)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from common.service import ServiceConfig
from common.subjects import check_token


@dataclass(frozen=True)
class KvArenaConfig(ServiceConfig):
    """How one node's KV arena service runs."""

    run_id: str = "dev"
    """Names this node's shm files (``/dev/shm/belayer-<run_id>-kv-<engine>``)."""
    model_dir: Path = Path("model")
    """Model directory whose ``config.json`` gives layers, KV heads, head_dim and dtype."""
    engine_ids: tuple[str, ...] = ("e0",)
    """One arena per engine id."""
    num_blocks: int = 512
    """KV blocks per arena (each holds ``block_size`` tokens of every layer's K and V)."""
    block_size: int = 16
    """Tokens per KV block."""
    dtype: str | None = None
    """Element dtype of the arena (``float32``, ``bfloat16``…); default: the model's."""
    host: str = ""
    """Engine-host mode: serve this engine host's arenas on ``belayer.host.<host>.kv.*``
    (its workers ask there, not the node's arena service)."""

    def __post_init__(self) -> None:
        if not self.engine_ids:
            raise ValueError("at least one engine id is needed")
        if len(set(self.engine_ids)) != len(self.engine_ids):
            raise ValueError(f"duplicate engine ids in {self.engine_ids}")
        for engine_id in self.engine_ids:
            check_token(engine_id, "engine id")
        if self.num_blocks < 1 or self.block_size < 1:
            raise ValueError(
                f"num_blocks and block_size must be >= 1 (got {self.num_blocks}, {self.block_size})"
            )
