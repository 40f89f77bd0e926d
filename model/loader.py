"""Read a model's safetensors weights from disk, keeping Hugging Face parameter names.

:func:`load_safetensors` gives torch tensors (tests, the trainer, the cold-restart baseline);
:func:`read_raw` gives each tensor's bytes, mapped from the file without torch (the weight
store, which only copies them into shared memory). The engine itself never reads from disk.
"""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.dtypes import SAFETENSORS, nbytes

if TYPE_CHECKING:
    import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 2**20
"""Largest safetensors header read (the format's own reader refuses larger ones too)."""


def load_safetensors(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Load every tensor of ``model_dir`` on the CPU.

    Handles a single ``model.safetensors`` or shards listed in
    ``model.safetensors.index.json``. Names are kept as in the checkpoint
    (``model.embed_tokens.weight``, ``model.layers.0.self_attn.q_proj.weight``, …;
    ``lm_head.weight`` is absent when embeddings are tied).
    """
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in weight_files(model_dir):
        tensors.update(load_file(path, device="cpu"))
    return tensors


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of ``model_dir``: its shards (``model.safetensors.index.json``)
    or its one ``model.safetensors``; ``FileNotFoundError`` when it has neither."""
    root = Path(model_dir)
    index = root / INDEX_FILE
    if index.exists():
        with index.open() as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        return [root / shard for shard in sorted(set(weight_map.values()))]
    single = root / SINGLE_FILE
    if not single.exists():
        raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {root}")
    return [single]


@dataclass(frozen=True)
class RawTensor:
    """One tensor of a safetensors file as bytes: its wire dtype, shape and data (a read-only
    view of the mapped file, little-endian as the format stores it)."""

    dtype: str
    shape: list[int]
    data: memoryview


def read_raw(model_dir: str | Path) -> dict[str, RawTensor]:
    """Every tensor of ``model_dir`` (as :func:`load_safetensors` finds them) as bytes, without
    torch. ``ValueError`` names the file and what is wrong with a malformed one."""
    tensors: dict[str, RawTensor] = {}
    for path in weight_files(model_dir):
        tensors.update(_read_file(path))
    return tensors


def _read_file(path: Path) -> dict[str, RawTensor]:
    with path.open("rb") as f:
        size = path.stat().st_size
        if size < 8:
            raise ValueError(f"{path}: not a safetensors file ({size} bytes)")
        data = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
    (header_len,) = struct.unpack("<Q", data[:8])
    if header_len > min(MAX_HEADER_BYTES, size - 8):
        raise ValueError(f"{path}: not a safetensors file (header of {header_len} bytes)")
    try:
        header: Any = json.loads(bytes(data[8 : 8 + header_len]))
    except ValueError:
        raise ValueError(f"{path}: not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: not a safetensors file (its header is not an object)")
    body = data[8 + header_len :]
    out = {}
    for name, info in header.items():
        if name != "__metadata__":
            out[name] = _tensor(path, name, info, body)
    return out


def _tensor(path: Path, name: str, info: Any, body: memoryview) -> RawTensor:
    try:
        dtype = SAFETENSORS[info["dtype"]]
        shape = [int(n) for n in info["shape"]]
        start, end = (int(n) for n in info["data_offsets"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{path}: tensor {name!r} has no valid dtype, shape and offsets") from None
    if min(shape, default=0) < 0 or not 0 <= start <= end <= len(body):
        raise ValueError(f"{path}: tensor {name!r} lies outside the file")
    if end - start != nbytes(dtype, shape):
        raise ValueError(f"{path}: tensor {name!r} has {end - start} bytes for {dtype}{shape}")
    return RawTensor(dtype=dtype, shape=shape, data=body[start:end])
