"""The weight store's pure layout logic: aligned packing, zero-copy views, checksums and
the validation of pushed layouts."""

from __future__ import annotations

import pytest
import torch

from common import dtypes, tensors
from common.errors import InvalidRequest
from schemas.weights import TensorDesc
from services.weights import core

torch.set_num_threads(1)


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "b.weight": torch.randn(3, 5, generator=gen),  # 60 bytes: next offset must pad
        "a.bias": torch.randn(7, generator=gen).to(torch.bfloat16),
        "c.scalar": torch.tensor(2.5, dtype=torch.float16),
        "d.index": torch.arange(11, dtype=torch.int64),
        "e.empty": torch.zeros(0, 4),
        "f.strided": torch.randn(4, 6, generator=gen).t(),  # non-contiguous source
    }


def _specs(state: dict[str, torch.Tensor]) -> dict[str, tuple[str, list[int]]]:
    return {k: (tensors.dtype_name(t.dtype), list(t.shape)) for k, t in state.items()}


def _bytes(state: dict[str, torch.Tensor]) -> dict[str, memoryview]:
    """Each tensor's bytes, as the store reads them from a safetensors file."""
    return {k: t.contiguous().reshape(-1).view(torch.uint8).numpy().data for k, t in state.items()}


def test_layout_is_aligned_sorted_and_deterministic() -> None:
    state = _state()
    layout = core.plan_layout(_specs(state))
    names = [d.name for d in layout.tensors]
    assert names == sorted(state)
    assert all(d.offset % core.ALIGN == 0 for d in layout.tensors)
    assert layout.size % core.ALIGN == 0
    reordered = dict(reversed(list(state.items())))
    assert core.plan_layout(_specs(reordered)) == layout
    core.validate_layout(layout.tensors, layout.size)


def test_pack_then_view_round_trips_bit_exactly() -> None:
    state = _state()
    layout = core.plan_layout(_specs(state))
    buf = torch.zeros(layout.size, dtype=torch.uint8)
    core.pack(_bytes(state), layout, buf.numpy().data)
    views = tensors.view_tensors(buf, layout.tensors)
    for name, t in state.items():
        assert views[name].dtype == t.dtype and views[name].shape == t.shape
        assert torch.equal(views[name], t)
    # views are zero copy: they alias the buffer
    views["d.index"][0] = 99
    assert tensors.view_tensors(buf, layout.tensors)["d.index"][0] == 99


def test_checksum_covers_every_byte() -> None:
    buf = bytearray(256)
    before = core.checksum(buf)
    assert before == core.checksum(bytes(buf))
    assert before == core.checksum(torch.zeros(256, dtype=torch.uint8).numpy().data)
    buf[255] = 1
    assert core.checksum(buf) != before


def test_repack_between_layouts() -> None:
    state = _state()
    layout = core.plan_layout(_specs(state))
    src = torch.zeros(layout.size + 128, dtype=torch.uint8)
    shifted = [
        TensorDesc(
            name=d.name, dtype=d.dtype, shape=d.shape, offset=d.offset + 128, nbytes=d.nbytes
        )
        for d in layout.tensors
    ]
    for d in shifted:
        tensors.view_tensor(src, d).copy_(state[d.name])
    assert not core.same_placement(layout.tensors, shifted)
    dst = torch.zeros(layout.size, dtype=torch.uint8)
    core.repack(src.numpy().data, shifted, dst.numpy().data, layout.tensors)
    ref = torch.zeros(layout.size, dtype=torch.uint8)
    core.pack(_bytes(state), layout, ref.numpy().data)
    assert torch.equal(dst, ref)
    assert core.same_placement(layout.tensors, list(layout.tensors))


def _desc(name: str = "w", dtype: str = "float32", shape=(2, 2), offset: int = 0, nbytes=16):
    return TensorDesc(name=name, dtype=dtype, shape=list(shape), offset=offset, nbytes=nbytes)


@pytest.mark.parametrize(
    ("tensors", "size", "reason"),
    [
        ([_desc(), _desc()], 64, "duplicate"),
        ([_desc(dtype="float99")], 64, "unknown dtype"),
        ([_desc(dtype="Tensor")], 64, "unknown dtype"),
        ([_desc(nbytes=12)], 64, "nbytes"),
        ([_desc(offset=8)], 128, "aligned"),
        ([_desc(offset=64)], 64, "past the end"),
        ([_desc(shape=(-1, 2), nbytes=-8)], 64, "negative"),
        ([_desc(shape=(20,), nbytes=80), _desc(name="v", offset=64)], 256, "overlap"),
    ],
)
def test_validate_layout_refuses(tensors, size, reason) -> None:
    with pytest.raises(InvalidRequest) as ei:
        core.validate_layout(tensors, size)
    assert reason in str(ei.value)


def test_validate_push_checks_names_dtypes_shapes() -> None:
    layout = core.plan_layout(_specs(_state()))
    core.validate_push(layout.tensors, layout.tensors)
    with pytest.raises(InvalidRequest, match="names differ") as ei:
        core.validate_push(layout.tensors, layout.tensors[1:])
    assert ei.value.data["missing"] == layout.tensors[0].name
    other = dict(_state())
    other["b.weight"] = torch.zeros(5, 3)
    with pytest.raises(InvalidRequest, match="dtype or shape") as ei:
        core.validate_push(layout.tensors, core.plan_layout(_specs(other)).tensors)
    assert ei.value.data["tensor"] == "b.weight"
    other["b.weight"] = torch.zeros(3, 5, dtype=torch.float64)
    with pytest.raises(InvalidRequest, match="dtype or shape"):
        core.validate_push(layout.tensors, core.plan_layout(_specs(other)).tensors)


def test_dtype_names_round_trip() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8):
        assert tensors.parse_dtype(tensors.dtype_name(dtype)) is dtype


def test_the_byte_sizes_the_store_uses_are_torch_s() -> None:
    for name, size in dtypes.ITEMSIZE.items():
        assert tensors.parse_dtype(name).itemsize == size, name
    with pytest.raises(InvalidRequest, match="unknown dtype"):
        dtypes.itemsize("float99")
