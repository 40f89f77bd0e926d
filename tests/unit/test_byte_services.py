"""The weight store and the KV arena hold and copy bytes without torch: their safetensors
reader gives the bytes torch's loader gives, malformed files get a clear error, their shared
memory maps as bytes that the workers' tensor mappings see, and importing either service
loads no torch (checked in a fresh interpreter, as the supervisor starts them)."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from common import shm
from common.config import SHM_DIR
from common.errors import InvalidRequest, NotFound
from common.tensors import dtype_name
from model.loader import load_safetensors, read_raw

torch.set_num_threads(1)


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {
        "model.w": torch.randn(3, 5, generator=gen),
        "model.b": torch.randn(7, generator=gen).to(torch.bfloat16),
        "model.h": torch.randn(2, 2, generator=gen).to(torch.float16),
        "model.i": torch.arange(4, dtype=torch.int64),
        "model.s": torch.tensor(1.5),
    }


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_read_raw_gives_the_bytes_torch_s_loader_gives(tmp_path: Path) -> None:
    save_file(_tensors(), str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    raw, ref = read_raw(tmp_path), load_safetensors(tmp_path)
    assert sorted(raw) == sorted(ref)
    for name, t in ref.items():
        assert raw[name].dtype == dtype_name(t.dtype)
        assert raw[name].shape == list(t.shape)
        assert bytes(raw[name].data) == _bytes(t), name


def test_read_raw_reads_shards(tmp_path: Path) -> None:
    state = _tensors()
    names = sorted(state)
    weight_map = {}
    for i, part in enumerate((names[:2], names[2:])):
        shard = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: state[n] for n in part}, str(tmp_path / shard))
        weight_map.update(dict.fromkeys(part, shard))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    raw = read_raw(tmp_path)
    assert {n: bytes(t.data) for n, t in raw.items()} == {n: _bytes(t) for n, t in state.items()}


def _file(tmp_path: Path, header: bytes, body: bytes = b"", declared: int | None = None) -> None:
    """A ``model.safetensors`` of ``header`` then ``body``, its header length ``declared``."""
    length = len(header) if declared is None else declared
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", length) + header + body)


def _header(**tensor: object) -> bytes:
    return json.dumps(
        {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], **tensor}}
    ).encode()


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (lambda p: (p / "model.safetensors").write_bytes(b"abc"), "not a safetensors file"),
        (lambda p: _file(p, b"{}", declared=10**9), "header of"),
        (lambda p: _file(p, b"not json"), "not JSON"),
        (lambda p: _file(p, b"[1, 2]"), "not an object"),
        (lambda p: _file(p, _header(dtype="F99"), bytes(8)), "no valid dtype"),
        (lambda p: _file(p, _header(data_offsets=[0, 800]), bytes(8)), "outside the file"),
        (lambda p: _file(p, _header(shape=[3]), bytes(8)), r"8 bytes for float32\[3\]"),
    ],
)
def test_a_malformed_weights_file_is_refused_by_name(tmp_path: Path, content, reason) -> None:
    content(tmp_path)
    with pytest.raises(ValueError, match=reason) as ei:
        read_raw(tmp_path)
    assert "model.safetensors" in str(ei.value)


def test_byte_mappings_are_the_memory_the_workers_map() -> None:
    path = SHM_DIR / f"belayer-test-{uuid.uuid4().hex[:12]}"
    buf = shm.create_map(path, 4096)
    try:
        handle = shm.shm_handle(path, 4096)
        buf[:4] = b"\x01\x02\x03\x04"
        tensor = shm.attach(handle)  # as a worker maps it
        assert tensor[:4].tolist() == [1, 2, 3, 4]
        again = shm.attach_map(handle)
        again[4095] = 7
        assert int(tensor[4095]) == 7
        shm.zero(buf)
        assert int(tensor.sum()) == 0 and bytes(again) == bytes(4096)
        with pytest.raises(InvalidRequest, match="size differs"):
            shm.attach_map(shm.shm_handle(path, 8192))
        with pytest.raises(FileExistsError):
            shm.create_map(path, 4096)  # a published version is never rewritten
    finally:
        shm.unlink(path)
    with pytest.raises(NotFound, match="gone"):
        shm.attach_map(shm.shm_handle(path, 4096))


def test_the_weight_store_and_the_kv_arena_import_no_torch() -> None:
    modules = "services.weights.service, services.weights.mirror, services.kv.service"
    code = f"import sys, {modules}; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "False", out.stdout
