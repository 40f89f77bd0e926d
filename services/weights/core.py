"""Pure layout logic of the weight store: one version = one flat byte buffer.

A state dict is packed into a single contiguous buffer, each tensor at a 64-byte aligned
offset (so a ``uint8`` slice can be viewed as any dtype, and vectorised kernels see aligned
rows). The buffer's layout is a list of :class:`~schemas.weights.TensorDesc`; its sha256 is
the version's checksum. Nothing here touches NATS or the file system.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from common.errors import InvalidRequest
from common.tensors import dtype_name, parse_dtype, view_tensor
from schemas.weights import TensorDesc

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


def plan_layout(state_dict: Mapping[str, torch.Tensor]) -> Layout:
    """Assign every tensor an aligned offset; names are sorted so that the same set of
    tensors always gets the same layout, whatever order the caller's dict has."""
    descs: list[TensorDesc] = []
    offset = 0
    for name in sorted(state_dict):
        t = state_dict[name]
        nbytes = t.numel() * t.element_size()
        descs.append(
            TensorDesc(
                name=name,
                dtype=dtype_name(t.dtype),
                shape=list(t.shape),
                offset=offset,
                nbytes=nbytes,
            )
        )
        offset = align_up(offset + nbytes)
    return Layout(tensors=descs, size=max(offset, ALIGN))


def pack(state_dict: Mapping[str, torch.Tensor], layout: Layout, buf: torch.Tensor) -> None:
    """Copy every tensor of ``state_dict`` into ``buf`` at its place in ``layout``.

    ``buf`` must be zero-filled beforehand (fresh shared memory is): padding bytes are part
    of the checksum, so they must be the same on every side.
    """
    if buf.numel() < layout.size or buf.dtype != torch.uint8:
        raise ValueError(f"buffer of {buf.numel()} {buf.dtype} cannot hold {layout.size} bytes")
    for desc in layout.tensors:
        view_tensor(buf, desc).copy_(state_dict[desc.name])


def repack(
    src: torch.Tensor,
    src_tensors: Sequence[TensorDesc],
    dst: torch.Tensor,
    dst_tensors: Sequence[TensorDesc],
) -> None:
    """Copy tensors by name from one layout into another (same names, shapes and dtypes)."""
    by_name = {d.name: d for d in src_tensors}
    for desc in dst_tensors:
        view_tensor(dst, desc).copy_(view_tensor(src, by_name[desc.name]))


def checksum(buf: torch.Tensor) -> str:
    """sha256 (hex) of a flat ``uint8`` buffer; hashlib reads the memory in place."""
    data = buf if buf.device.type == "cpu" else buf.cpu()
    return hashlib.sha256(data.contiguous().numpy().data).hexdigest()


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
        dtype = parse_dtype(d.dtype)
        if any(n < 0 for n in d.shape):
            raise InvalidRequest("negative dimension", tensor=d.name, shape=str(d.shape))
        expected = math.prod(d.shape) * dtype.itemsize
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
