"""Pure layout logic of the weight store: one version = one flat byte buffer.

A state dict is packed into a single contiguous buffer, each tensor at a 64-byte aligned
offset (so a ``uint8`` slice can be viewed as any dtype, and vectorised kernels see aligned
rows). The buffer's layout is a list of :class:`~schemas.weights.TensorDesc`; its sha256 is
the version's checksum. Nothing here touches NATS, the file system or torch: the store only
lays out and copies bytes.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.dtypes import itemsize, nbytes
from common.errors import InvalidRequest
from schemas.weights import TensorDesc

if TYPE_CHECKING:
    from typing_extensions import Buffer  # anything with the buffer protocol (PEP 688)

ALIGN = 64
"""Byte alignment of every tensor's offset and of the buffer's total size."""

_MAX_REPORTED = 5  # names listed in an error; a 300-tensor model must not flood the reply


@dataclass(frozen=True)
class Layout:
    """Where every tensor lives in one version's buffer."""

    tensors: list[TensorDesc]
    """One descriptor per tensor, sorted by name (offsets increase in that order)."""
    size: int
    """Total bytes of the buffer (a multiple of ``ALIGN``, at least ``ALIGN``)."""


def align_up(n: int, align: int = ALIGN) -> int:
    """Smallest multiple of ``align`` that is ``>= n``."""
    return (n + align - 1) // align * align


def plan_layout(specs: Mapping[str, tuple[str, Sequence[int]]]) -> Layout:
    """Assign every tensor (name → wire dtype and shape) an aligned offset; names are sorted
    so that the same set of tensors always gets the same layout, whatever order the caller's
    dict has."""
    descs: list[TensorDesc] = []
    offset = 0
    for name in sorted(specs):
        dtype, shape = specs[name]
        size = nbytes(dtype, shape)
        descs.append(
            TensorDesc(name=name, dtype=dtype, shape=list(shape), offset=offset, nbytes=size)
        )
        offset = align_up(offset + size)
    return Layout(tensors=descs, size=max(offset, ALIGN))


def pack(data: Mapping[str, Buffer], layout: Layout, buf: Buffer) -> None:
    """Copy every tensor's bytes (``data``, by name) into ``buf`` at its place in ``layout``.

    ``buf`` must be zero-filled beforehand (fresh shared memory is): padding bytes are part
    of the checksum, so they must be the same on every side.
    """
    out = memoryview(buf)
    if len(out) < layout.size:
        raise ValueError(f"a buffer of {len(out)} bytes cannot hold {layout.size}")
    for desc in layout.tensors:
        out[desc.offset : desc.offset + desc.nbytes] = data[desc.name]


def repack(
    src: Buffer, src_tensors: Sequence[TensorDesc], dst: Buffer, dst_tensors: Sequence[TensorDesc]
) -> None:
    """Copy tensors by name from one layout into another (same names, shapes and dtypes)."""
    by_name = {d.name: d for d in src_tensors}
    a, b = memoryview(src), memoryview(dst)
    for desc in dst_tensors:
        s = by_name[desc.name]
        b[desc.offset : desc.offset + desc.nbytes] = a[s.offset : s.offset + s.nbytes]


def checksum(buf: Buffer) -> str:
    """sha256 (hex) of a flat buffer; hashlib reads the memory in place."""
    return hashlib.sha256(buf).hexdigest()


def validate_layout(tensors: Sequence[TensorDesc], size: int) -> None:
    """Refuse a layout that is not self-consistent: duplicate names, unknown dtypes,
    ``nbytes`` that disagrees with the shape, misaligned, out-of-bounds or overlapping
    tensors. Raises ``InvalidRequest`` naming the tensor."""
    seen: set[str] = set()
    spans: list[tuple[int, int, str]] = []
    for d in tensors:
        if d.name in seen:
            raise InvalidRequest("duplicate tensor name", tensor=d.name)
        seen.add(d.name)
        width = itemsize(d.dtype)
        if any(n < 0 for n in d.shape):
            raise InvalidRequest("negative dimension", tensor=d.name, shape=str(d.shape))
        expected = math.prod(d.shape) * width
        if d.nbytes != expected:
            raise InvalidRequest(
                "nbytes does not match shape and dtype",
                tensor=d.name,
                nbytes=d.nbytes,
                expected=expected,
            )
        if d.offset < 0 or d.offset % ALIGN:
            raise InvalidRequest("offset is not 64-byte aligned", tensor=d.name, offset=d.offset)
        if d.offset + d.nbytes > size:
            raise InvalidRequest(
                "tensor extends past the end of the buffer",
                tensor=d.name,
                end=d.offset + d.nbytes,
                size=size,
            )
        spans.append((d.offset, d.offset + d.nbytes, d.name))
    spans.sort()
    for (_, end, name), (start, _, nxt) in itertools.pairwise(spans):
        if start < end:
            raise InvalidRequest("tensors overlap", tensor=nxt, overlaps=name)


def validate_push(current: Sequence[TensorDesc], pushed: Sequence[TensorDesc]) -> None:
    """Refuse pushed weights whose tensors differ from the current version's in name,
    dtype or shape (offsets may differ: the store repacks). Raises ``InvalidRequest``."""
    cur = {d.name: d for d in current}
    new = {d.name: d for d in pushed}
    missing = sorted(cur.keys() - new.keys())
    extra = sorted(new.keys() - cur.keys())
    if missing or extra:
        raise InvalidRequest(
            "pushed tensor names differ from the current version",
            missing=", ".join(missing[:_MAX_REPORTED]),
            extra=", ".join(extra[:_MAX_REPORTED]),
            missing_count=len(missing),
            extra_count=len(extra),
        )
    for name, d in cur.items():
        p = new[name]
        if p.dtype != d.dtype or list(p.shape) != list(d.shape):
            raise InvalidRequest(
                "pushed tensor differs in dtype or shape",
                tensor=name,
                expected=f"{d.dtype}{list(d.shape)}",
                got=f"{p.dtype}{list(p.shape)}",
            )


def same_placement(a: Sequence[TensorDesc], b: Sequence[TensorDesc]) -> bool:
    """True when both layouts put every tensor at the same offset (one bulk copy suffices)."""
    offsets = {d.name: (d.offset, d.nbytes) for d in a}
    return len(a) == len(b) and all(offsets.get(d.name) == (d.offset, d.nbytes) for d in b)
