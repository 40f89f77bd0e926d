"""Read a model's safetensors weights from disk, keeping Hugging Face parameter names.

Used by the weight store (which then moves them into shared memory) and by tests and the
cold-restart baseline. The engine itself never reads from disk.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def load_safetensors(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Load every tensor of ``model_dir`` on the CPU.

    Handles a single ``model.safetensors`` or shards listed in
    ``model.safetensors.index.json``. Names are kept as in the checkpoint
    (``model.embed_tokens.weight``, ``model.layers.0.self_attn.q_proj.weight``, …;
    ``lm_head.weight`` is absent when embeddings are tied).
    """
    root = Path(model_dir)
    index = root / INDEX_FILE
    if index.exists():
        with index.open() as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        tensors: dict[str, torch.Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            tensors.update(load_file(root / shard, device="cpu"))
        return tensors
    single = root / SINGLE_FILE
    if not single.exists():
        raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {root}")
    return load_file(single, device="cpu")
