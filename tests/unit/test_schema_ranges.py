"""Every id and every bounded number is checked by the schema on decode: a hostile value is
``invalid_request`` naming the field, before any handler sees it.

The id check walks ``schemas/`` generically: every field named ``id``, ``kind``, ``*_id`` or
``*_ids`` that holds strings must refuse ``""`` (unless its empty value means "none"), ``*``,
``>``, ``a.b``, ``../..`` and a trailing newline."""

from __future__ import annotations

import importlib
import inspect
import math
import pkgutil
import typing
from collections.abc import Iterator
from typing import Any

import msgpack
import msgspec
import pytest

import schemas
from common.codec import decode
from common.errors import InvalidRequest
from schemas.env import EnvCheckpoint, EnvCreate, EnvExec, SandboxLimits
from schemas.serving import MAX_TOKENS, GenerateRequest, RegisterWorker, SamplingParams

HOSTILE = ["*", ">", "a.b", "../..", "a b", "e0\n", "x" * 161, "sb/1", "é"]
"""Values no id field may hold (``""`` and 129 characters are checked separately)."""


def structs() -> Iterator[type[msgspec.Struct]]:
    for info in pkgutil.iter_modules(schemas.__path__):
        module = importlib.import_module(f"schemas.{info.name}")
        for name, cls in inspect.getmembers(module, inspect.isclass):
            if (
                issubclass(cls, msgspec.Struct)
                and cls.__module__ == module.__name__
                and not name.startswith("_")
            ):
                yield cls


def _is_id_name(name: str) -> bool:
    return name in ("id", "kind") or name.endswith(("_id", "_ids"))


def _holds_str(tp: Any) -> bool:
    """Whether ``tp`` is (an optional / a list of) a string type."""
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    origin = typing.get_origin(tp)
    if origin in (list, typing.Union) or str(origin) == "<class 'types.UnionType'>":
        return any(_holds_str(a) for a in typing.get_args(tp) if a is not type(None))
    if origin is typing.Literal:
        return True
    return tp is str


def id_fields() -> list[tuple[type[msgspec.Struct], msgspec.structs.FieldInfo]]:
    out = []
    for cls in structs():
        hints = typing.get_type_hints(cls, include_extras=True)
        for f in msgspec.structs.fields(cls):
            if _is_id_name(f.name) and _holds_str(hints[f.name]):
                out.append((cls, f))
    return out


def _payload(cls: type[msgspec.Struct], name: str, value: Any) -> bytes:
    """The message holding just ``name = value`` (with its tag): decoding reaches the field
    before it checks for missing ones."""
    is_list = typing.get_origin(_unwrap(typing.get_type_hints(cls)[name])) is list
    raw: dict[str, Any] = {name: [value] if is_list else value}
    tag = cls.__struct_config__.tag
    if isinstance(tag, str):
        raw = {"type": tag, **raw}
    return msgpack.packb(raw)


def _unwrap(tp: Any) -> Any:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if str(typing.get_origin(tp)) == "<class 'types.UnionType'>" and len(args) == 1:
        return args[0]
    return tp


def _refused(cls: type[msgspec.Struct], name: str, value: Any) -> str:
    with pytest.raises(InvalidRequest) as err:
        decode(_payload(cls, name, value), cls)
    return str(err.value.data["field"])


ID_FIELDS = id_fields()


def test_the_walk_finds_the_id_fields() -> None:
    names = {(c.__name__, f.name) for c, f in ID_FIELDS}
    for must in [
        ("RegisterWorker", "engine_id"),
        ("GenerateRequest", "request_id"),
        ("GenerateRequest", "engine_id"),
        ("EngineAbort", "request_ids"),
        ("EnvExec", "sandbox_id"),
        ("EnvRestore", "checkpoint_id"),
        ("EnvGc", "trajectory_id"),
        ("KvFlush", "engine_id"),
        ("SupervisorStatus", "run_id"),
        ("NodeReady", "run_id"),
        ("EngineUnhealthy", "request_ids"),
        ("MemoryHandle", "kind"),
    ]:
        assert must in names, must
    assert len(ID_FIELDS) > 60


@pytest.mark.parametrize(
    ("cls", "info"), ID_FIELDS, ids=[f"{c.__name__}.{f.name}" for c, f in ID_FIELDS]
)
def test_every_id_field_refuses_hostile_values(
    cls: type[msgspec.Struct], info: msgspec.structs.FieldInfo
) -> None:
    for value in HOSTILE:
        field = _refused(cls, info.name, value)
        assert field.startswith(f"$.{info.name}"), (value, field)
    if "checkpoint" not in info.name:  # checkpoint ids are longer: <sandbox_id>-k<k>-<hex>
        assert _refused(cls, info.name, "x" * 129).startswith(f"$.{info.name}")
    if not _may_be_empty(cls, info.name):
        assert _refused(cls, info.name, "").startswith(f"$.{info.name}")


def _may_be_empty(cls: type[msgspec.Struct], name: str) -> bool:
    """Only the ``…OrEmpty`` id types take ``""`` (it means "none" or "pick one")."""
    pattern = _pattern(typing.get_type_hints(cls, include_extras=True)[name])
    return pattern is not None and "{0," in pattern


def _pattern(tp: Any) -> str | None:
    if typing.get_origin(tp) is typing.Annotated:
        for meta in typing.get_args(tp)[1:]:
            if isinstance(meta, msgspec.Meta) and meta.pattern:
                return meta.pattern
    for arg in typing.get_args(tp):
        found = _pattern(arg)
        if found:
            return found
    return None


@pytest.mark.parametrize(
    ("cls", "info"),
    [(c, f) for c, f in ID_FIELDS if f.name != "kind"],
    ids=[f"{c.__name__}.{f.name}" for c, f in ID_FIELDS if f.name != "kind"],
)
def test_every_id_field_takes_a_plain_id(
    cls: type[msgspec.Struct], info: msgspec.structs.FieldInfo
) -> None:
    try:
        decode(_payload(cls, info.name, "sb-1_A9"), cls)
    except InvalidRequest as exc:  # another (missing) field, never this one
        assert not str(exc.data["field"]).startswith(f"$.{info.name}"), exc


def test_register_worker_with_a_dotted_engine_id_names_the_field() -> None:
    raw = {"type": "RegisterWorker.v1", "engine_id": "a.b", "epoch": 1, "pid": 1}
    with pytest.raises(InvalidRequest) as err:
        decode(msgpack.packb(raw), RegisterWorker)
    assert err.value.data["field"] == "$.engine_id"


# --- numbers ---------------------------------------------------------------------------------
NON_FINITE = [math.nan, math.inf, -math.inf]

FINITE_FIELDS: list[tuple[type[msgspec.Struct], str]] = [
    (SamplingParams, "temperature"),
    (SamplingParams, "top_p"),
    (SandboxLimits, "cpus"),
    (EnvExec, "timeout_s"),
    (EnvCheckpoint, "timeout_s"),
]


@pytest.mark.parametrize(("cls", "name"), FINITE_FIELDS, ids=[n for _, n in FINITE_FIELDS])
def test_float_fields_refuse_nan_and_infinity(cls: type[msgspec.Struct], name: str) -> None:
    for value in NON_FINITE:
        assert _refused(cls, name, value) == f"$.{name}", value


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("memory_mb", 0),
        ("memory_mb", -1),
        ("memory_mb", 2**63 - 1),
        ("memory_mb", 2**64 - 1),
        ("cpus", 0.0),
        ("cpus", -1.0),
        ("cpus", 1e-12),
        ("cpus", 1e6),
        ("pids", 0),
        ("pids", -1),
        ("pids", 2**40),
    ],
)
def test_sandbox_limits_cannot_be_switched_off(name: str, value: object) -> None:
    assert _refused(SandboxLimits, name, value) == f"$.{name}"


def test_sandbox_limits_in_range_decode() -> None:
    raw = msgpack.packb({"memory_mb": 64, "cpus": 0.5, "pids": 32})
    assert decode(raw, SandboxLimits) == SandboxLimits(memory_mb=64, cpus=0.5, pids=32)
    create = {"type": "EnvCreate.v1", "limits": {"memory_mb": 6, "cpus": 0.01, "pids": 1}}
    assert decode(msgpack.packb(create), EnvCreate).limits.cpus == 0.01


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("max_tokens", MAX_TOKENS + 1),
        ("max_tokens", 2**64 - 1),
        ("max_tokens", 2.0**70),
        ("seed", 2**64 - 1),
    ],
)
def test_sampling_integers_are_bounded(name: str, value: object) -> None:
    raw = {
        "type": "GenerateRequest.v1",
        "request_id": "r",
        "prompt": "x",
        "sampling": {name: value},
    }
    with pytest.raises(InvalidRequest) as err:
        decode(msgpack.packb(raw), GenerateRequest)
    assert err.value.data["field"] == f"$.sampling.{name}"


def test_prefix_and_token_ids_are_bounded() -> None:
    assert _refused(EnvCheckpoint, "prefix", -1) == "$.prefix"
    assert _refused(EnvCheckpoint, "prefix", 2**40) == "$.prefix"
    raw = {"type": "GenerateRequest.v1", "request_id": "r", "prompt_token_ids": [2**40]}
    with pytest.raises(InvalidRequest) as err:
        decode(msgpack.packb(raw), GenerateRequest)
    assert err.value.data["field"] == "$.prompt_token_ids[0]"
