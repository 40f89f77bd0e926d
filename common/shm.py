"""Shared memory that other processes map without copying.

CPU: a file under ``/dev/shm`` (tmpfs), created here and mapped with ``torch.from_file(...,
shared=True)`` by the processes that compute on it (:func:`create`, :func:`attach`); attaching
costs ~0.3 ms per GB (measured on the project's machines) and the memory outlives any process
that merely maps it. The services that only hold and copy the bytes (the weight store, the KV
arena) map the same files with :mod:`mmap` (:func:`create_map`, :func:`attach_map`) and never
import torch. GPU: a CUDA IPC handle of a flat ``uint8`` device buffer, behind the same
:class:`~schemas.weights.MemoryHandle`; :func:`attach` hides which one it is.

Every file must be named through ``common.config.shm_path`` so ``belayer down`` removes it.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from common.config import SHM_DIR, shm_prefix
from common.errors import InvalidRequest, NotFound
from schemas.weights import MemoryHandle, TensorDesc

if TYPE_CHECKING:  # torch loads where a tensor is made: the byte-only services never do
    import torch


def create(path: Path, size: int) -> torch.Tensor:
    """Create a new zero-filled shm file of ``size`` bytes and map it as a flat ``uint8``
    tensor. Refuses to reuse an existing file: a published version is never rewritten."""
    fd = _create_fd(path, size)
    try:
        return _map_fd(fd, size)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def create_map(path: Path, size: int) -> mmap.mmap:
    """:func:`create`, mapped as bytes (:mod:`mmap`, shared, writable) instead of a tensor."""
    fd = _create_fd(path, size)
    try:
        return mmap.mmap(fd, size)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def _create_fd(path: Path, size: int) -> int:
    if size <= 0:
        raise ValueError(f"shared memory size must be positive, got {size}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)  # tmpfs pages read as zeros until written
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    return fd


def shm_handle(path: Path, size: int) -> MemoryHandle:
    """The wire handle of a file made by :func:`create`."""
    return MemoryHandle(kind="shm", path=str(path), size=size)


def attach(handle: MemoryHandle) -> torch.Tensor:
    """Map a handle's memory as a flat ``uint8`` tensor, zero copy.

    Raises ``NotFound`` when the memory is gone (e.g. an old version that was collected) and
    ``InvalidRequest`` when its size disagrees with the handle.
    """
    if handle.kind == "cuda_ipc":
        return _attach_cuda(handle)
    # Open first and map through /proc/self/fd: torch.from_file(shared=True) opens with
    # O_CREAT and grows short files, so mapping a path directly would silently create a
    # zero-filled file if the version was unlinked in between.
    fd = _open_fd(handle)
    try:
        return _map_fd(fd, handle.size)
    finally:
        os.close(fd)


def attach_map(handle: MemoryHandle) -> mmap.mmap:
    """:func:`attach` for shm files, mapped as bytes (:mod:`mmap`, shared, writable); the
    same ``NotFound``/``InvalidRequest``, and ``InvalidRequest`` for a CUDA handle."""
    if handle.kind != "shm":
        raise InvalidRequest("only shared-memory files map as bytes", kind=handle.kind)
    fd = _open_fd(handle)
    try:
        return mmap.mmap(fd, handle.size)
    finally:
        os.close(fd)


def _open_fd(handle: MemoryHandle) -> int:
    """The handle's file opened read-write, its size checked against the handle."""
    try:
        fd = os.open(handle.path, os.O_RDWR)
    except FileNotFoundError:
        raise NotFound("shared memory is gone", path=handle.path) from None
    actual = os.fstat(fd).st_size
    if actual != handle.size:
        os.close(fd)
        raise InvalidRequest(
            "shared memory size differs from its handle",
            path=handle.path,
            size=actual,
            expected=handle.size,
        )
    return fd


def zero(buf: mmap.mmap) -> None:
    """Set every byte of a mapping to 0 (one ``memset``; readers that map the same file see
    zeros)."""
    if not len(buf):
        return
    view = (ctypes.c_char * len(buf)).from_buffer(buf)
    try:
        ctypes.memset(view, 0, len(buf))
    finally:
        del view  # releases the export, so the mapping may be closed later


def map_tensors(handle: MemoryHandle, tensors: Sequence[TensorDesc]) -> dict[str, torch.Tensor]:
    """Zero-copy views of every tensor in a handle's memory, with their dtypes and shapes.

    The views keep the mapping alive; they must be treated as read-only for weights (a
    published version is immutable and shared by every reader)."""
    from common.tensors import view_tensors

    return view_tensors(attach(handle), tensors)


def unlink(path: str | Path) -> bool:
    """Remove a shm file; processes that mapped it keep their memory until they unmap.
    Returns False when it was already gone."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def list_files(run_id: str, name_prefix: str = "") -> list[Path]:
    """Shm files of a run whose name (after the run prefix) starts with ``name_prefix``."""
    prefix = shm_prefix(run_id) + name_prefix
    try:
        return sorted(p for p in SHM_DIR.iterdir() if p.name.startswith(prefix))
    except FileNotFoundError:
        return []


def _map_fd(fd: int, size: int) -> torch.Tensor:
    import torch

    # /proc/self/fd/N reopens the very inode behind fd, even if its name was unlinked.
    return torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=size, dtype=torch.uint8)


# --- CUDA IPC -----------------------------------------------------------------------------
# The same fields torch.multiprocessing sends for a CUDA tensor, encoded with msgpack instead
# of pickle so that nothing received from the bus is ever unpickled.
class _CudaIpc(msgspec.Struct, array_like=True):
    device: int
    handle: bytes
    size_bytes: int
    offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool


def export_cuda(buf: torch.Tensor) -> MemoryHandle:
    """A CUDA IPC handle for a flat ``uint8`` CUDA tensor. The exporter must keep ``buf``
    alive as long as any reader may map it. (Not exercised on the CPU-only test machine.)"""
    import torch

    if buf.device.type != "cuda" or buf.dtype != torch.uint8 or buf.dim() != 1:
        raise ValueError("export_cuda needs a flat uint8 CUDA tensor")
    if buf.storage_offset():
        raise ValueError("export_cuda needs a tensor at the start of its storage")
    ipc = _CudaIpc(*buf.untyped_storage()._share_cuda_())
    return MemoryHandle(kind="cuda_ipc", size=buf.numel(), ipc=msgspec.msgpack.encode(ipc))


def _attach_cuda(handle: MemoryHandle) -> torch.Tensor:
    import torch

    if not torch.cuda.is_available():
        raise InvalidRequest(
            "this handle is CUDA IPC memory but this process has no CUDA device",
            kind=handle.kind,
        )
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    ipc = msgspec.msgpack.decode(handle.ipc, type=_CudaIpc)
    return rebuild_cuda_tensor(
        torch.Tensor,
        (handle.size,),
        (1,),
        0,
        torch.UntypedStorage,
        torch.uint8,
        ipc.device,
        ipc.handle,
        ipc.size_bytes,
        ipc.offset_bytes,
        False,
        ipc.ref_counter_handle,
        ipc.ref_counter_offset,
        ipc.event_handle,
        ipc.event_sync_required,
    )
