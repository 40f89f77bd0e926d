"""Element types on the wire, without torch: their byte sizes and safetensors' codes.

The weight store and the KV arena lay out and copy bytes; they never compute on a tensor, so
they need a dtype's size, not torch (whose import costs each of them ~2 s of CPU at start and
at every restart). The processes that do compute map the same bytes as torch tensors
(:mod:`common.tensors`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from common.errors import InvalidRequest

ITEMSIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}
"""Wire dtype name (``torch.<name>``) → bytes per element: the dtypes a weight version or a KV
arena may hold."""

SAFETENSORS: dict[str, str] = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}
"""A safetensors header's ``dtype`` code → the wire name."""


def itemsize(name: str) -> int:
    """Bytes per element of the wire dtype ``name``; ``InvalidRequest`` for any other name."""
    size = ITEMSIZE.get(name)
    if size is None:
        raise InvalidRequest("unknown dtype", dtype=name)
    return size


def nbytes(name: str, shape: Sequence[int]) -> int:
    """Bytes of a tensor of dtype ``name`` and ``shape``."""
    return math.prod(shape) * itemsize(name)
