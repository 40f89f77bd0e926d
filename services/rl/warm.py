"""The warm-started tiny models (``belayer model init --tiny --warm-start math|swe|swe-long``,
and the ``tiny`` model of ``belayer run`` and the benchmarks).

The warm start: demonstrations (:mod:`services.rl.demonstrations`, cached), a tiny model
whose tokenizer is trained on their text, a short supervised training (:mod:`model.warm_start`,
CPU), the directory cached under ``<cache>/models/<key>`` — key = the demonstrations, the
training settings and the tiny model's shape — and copied to the output directory. A second
run with the same inputs copies the cached directory (or leaves the output alone when it
already holds it).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.errors import InvalidRequest
from common.logging import get_logger

if TYPE_CHECKING:
    from model.warm_start import SftConfig

log = get_logger(component="warm_start")

KINDS = ("math", "swe", "swe-long")

SFT: dict[str, dict[str, Any]] = {
    "math": {
        "steps": 1000,
        "batch_size": 32,
        "lr": 3e-3,
        "warmup_steps": 20,
        "decay": "cosine",
        "min_lr_ratio": 0.1,
        "threads": 1,
    },
    "swe": {
        "steps": 300,
        "batch_size": 16,
        "lr": 2e-3,
        "warmup_steps": 10,
        "decay": "cosine",
        "min_lr_ratio": 0.1,
    },
    "swe-long": {"steps": 160, "batch_size": 4, "lr": 2e-3, "warmup_steps": 10},
}
"""The warm start's training per kind (``model.warm_start.SftConfig`` fields; measured on 2
CPU threads in docs/workloads.md). Math: 1,000 steps × 32, 2.5 passes over its 12,800
demonstrations — a policy that answers at once when greedy (right 14 % of the time) and can
work the sum out (right 83 % of the time when it does): held-out greedy exact 0.26, sampled
pass@1 0.38 (600 steps: 0.18 / 0.16; 1,600: 0.91 / 0.76, nothing left to learn;
docs/training.md). Swe: 300 steps × 16 over 352 demonstrations (~14 passes), enough for the
name-free fix scripts to come out exactly (120 steps over 176: garbled; docs/workloads.md)."""


def unmerged_words(kind: str) -> tuple[str, ...]:
    """The words the ``kind`` model's tokenizer learns no merge from
    (``model.warm_start.train_chat_tokenizer``): for ``swe``, every name a generated task can
    draw, held-out ones included — a held-out name then splits into pieces like any training
    name, instead of a training name being one token the model learns by heart."""
    if kind != "swe":
        return ()
    from workloads.swe_families import MADE_UP_NOUNS, MADE_UP_WORDS, NOUNS, WORDS

    return (*NOUNS, *WORDS, *MADE_UP_NOUNS, *MADE_UP_WORDS)


def tiny_settings(hidden_size: int, num_layers: int, vocab_size: int, seed: int) -> dict[str, Any]:
    """The ``model.tiny.init_tiny_model`` keywords of a CLI call."""
    return {
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "vocab_size": vocab_size,
        "seed": seed,
    }


def warm_start(
    kind: str,
    out_dir: Path,
    *,
    tiny: dict[str, Any] | None = None,
    sft: SftConfig | None = None,
    cache: Path | None = None,
    refresh_demonstrations: bool = False,
    progress: Callable[[int, float], None] | None = None,
) -> tuple[Path, dict[str, Any], bool]:
    """Make (or reuse) the warm-started ``kind`` model and install it at ``out_dir``.
    Returns (``out_dir``, its stamp, whether it was trained now)."""
    if kind not in KINDS:
        raise InvalidRequest("unknown warm-start kind", kind=kind, known=list(KINDS))
    from model.warm_start import (
        SftConfig,
        cache_key,
        cached_model_dir,
        init_base_model,
        install,
        read_stamp,
        train_model_dir,
    )
    from services.rl.demonstrations import cache_root, demonstrations

    root = cache_root(cache)
    base = tiny or tiny_settings(256, 4, 4096, 0)
    cfg = sft or SftConfig(**SFT[kind])
    demos = demonstrations(kind, root, refresh=refresh_demonstrations)
    unmerged = unmerged_words(kind)
    extra = {"unmerged": hashlib.sha256(" ".join(unmerged).encode()).hexdigest()[:16]}
    key = cache_key(demos, cfg, {"tiny": base, "kind": kind, **(extra if unmerged else {})})
    have = read_stamp(out_dir)
    if have is not None and have.get("key") == key:
        return Path(out_dir), have, False

    def build(tmp: Path) -> None:
        t0 = time.perf_counter()
        result = train_model_dir(
            tmp,
            demos,
            cfg,
            lambda p: init_base_model(p, demos, base, unmerged),
            key=key,
            info={"kind": kind, "tiny": base},
            progress=progress,
        )
        log.info(
            "warm_start_trained",
            kind=kind,
            key=key,
            steps=result.steps,
            final_loss=round(result.final_loss, 4),
            seconds=round(time.perf_counter() - t0, 1),
        )

    cached, built = cached_model_dir(root / "models", key, build)
    install(cached, out_dir)
    return Path(out_dir), read_stamp(out_dir) or {}, built
