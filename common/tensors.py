"""Dtype names on the wire and zero-copy views of tensors inside one flat byte buffer.

Shared by the weight store, the KV arena and every process that maps their memory.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from common.errors import InvalidRequest
from schemas.weights import TensorDesc


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` → ``"float32"`` (the wire form of a dtype)."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` → ``torch.bfloat16``; anything that is not a torch dtype is refused."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidRequest("unknown dtype", dtype=name)
    return dtype


def view_tensor(buf: torch.Tensor, desc: TensorDesc) -> torch.Tensor:
    """A zero-copy view of one tensor inside ``buf`` (a flat ``uint8`` tensor)."""
    raw = buf[desc.offset : desc.offset + desc.nbytes]
    return raw.view(parse_dtype(desc.dtype)).view(desc.shape)


def view_tensors(buf: torch.Tensor, tensors: Sequence[TensorDesc]) -> dict[str, torch.Tensor]:
    """Zero-copy views of every tensor of a layout, by name."""
    return {d.name: view_tensor(buf, d) for d in tensors}
