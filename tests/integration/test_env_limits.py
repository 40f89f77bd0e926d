"""Sandbox limits cannot be switched off, on the real environment service and dockerd: a zero,
negative, NaN, past-the-cap or past-64-bit limit, a hostile sandbox id or deep nesting is a
typed ``invalid_request`` naming the field; a valid request still works and its container
really has the limits."""

from __future__ import annotations

import math

import docker
import msgpack
import pytest
from nats.aio.client import Client as NATS

from common import subjects
from common.codec import decode
from schemas.base import ErrorReply
from schemas.env import SandboxLimits

pytestmark = [pytest.mark.docker, pytest.mark.timeout(180)]


async def _ask(nc: NATS, op: str, raw: object) -> ErrorReply:
    data = raw if isinstance(raw, bytes) else msgpack.packb(raw)
    msg = await nc.request(subjects.env(op), data, timeout=30)
    return decode(msg.data, ErrorReply)


async def test_limits_out_of_range_are_refused_and_valid_ones_apply(env, nc) -> None:
    cfg = env.config
    bad = [
        ("memory_mb", 0),
        ("memory_mb", -1),
        ("memory_mb", 2**64 - 1),
        ("memory_mb", cfg.max_memory_mb + 1),
        ("cpus", 0.0),
        ("cpus", -1.0),
        ("cpus", math.nan),
        ("cpus", math.inf),
        ("cpus", cfg.max_cpus + 1.0),
        ("pids", 0),
        ("pids", -1),
        ("pids", cfg.max_pids + 1),
    ]
    for name, value in bad:
        err = await _ask(nc, "create", {"type": "EnvCreate.v1", "limits": {name: value}})
        assert err.code == "invalid_request", (name, value, err)
        assert err.data["field"] == f"$.limits.{name}", (name, value, err)
    assert (await env.client.list()).sandboxes == []  # nothing was created
    # a valid request still works, and Docker holds exactly these limits
    limits = SandboxLimits(memory_mb=96, cpus=0.5, pids=48)
    sb = await env.client.create(limits=limits)
    host = docker.APIClient(version="auto").inspect_container(sb.container_id)["HostConfig"]
    assert host["Memory"] == 96 * 2**20 and host["MemorySwap"] == 96 * 2**20
    assert host["NanoCpus"] == 500_000_000
    assert host["PidsLimit"] == 48
    assert (await env.client.exec(sb.sandbox_id, "echo ok")).stdout.strip() == "ok"


async def test_hostile_ids_nan_and_nesting_are_typed_errors(env, nc) -> None:
    for bad in ["a.b", "*", ">", "../..", "sb/1", "x\n"]:
        cases: list[tuple[str, dict[str, object]]] = [
            ("create", {"type": "EnvCreate.v1", "sandbox_id": bad}),
            ("exec", {"type": "EnvExec.v1", "sandbox_id": bad, "command": "true"}),
            ("checkpoint", {"type": "EnvCheckpoint.v1", "sandbox_id": bad, "prefix": 1}),
            ("restore", {"type": "EnvRestore.v1", "sandbox_id": "sb-1", "checkpoint_id": bad}),
            ("destroy", {"type": "EnvDestroy.v1", "sandbox_id": bad}),
            ("gc", {"type": "EnvGc.v1", "trajectory_id": bad}),
        ]
        for op, raw in cases:
            err = await _ask(nc, op, raw)
            field = next(k for k in raw if k.endswith("_id") and raw[k] == bad)
            assert (err.code, err.data["field"]) == ("invalid_request", f"$.{field}"), (op, bad)
    sid = (await env.client.create()).sandbox_id
    for raw, field in [
        ({"type": "EnvExec.v1", "sandbox_id": sid, "command": "true", "timeout_s": math.nan}, "$.timeout_s"),
        ({"type": "EnvCheckpoint.v1", "sandbox_id": sid, "prefix": 1, "timeout_s": math.inf}, "$.timeout_s"),
        ({"type": "EnvCheckpoint.v1", "sandbox_id": sid, "prefix": 2**64 - 1}, "$.prefix"),
        ({"type": "EnvGc.v1", "trajectory_id": ""}, "$.trajectory_id"),
    ]:  # fmt: skip
        op_of = {"EnvExec.v1": "exec", "EnvCheckpoint.v1": "checkpoint", "EnvGc.v1": "gc"}
        err = await _ask(nc, op_of[str(raw["type"])], raw)
        assert (err.code, err.data["field"]) == ("invalid_request", field), (raw, err)
    head = msgpack.packb({"type": "EnvCreate.v1"})  # one entry: make it two, nested 10 000 deep
    for key, field in (("junk", "$"), ("limits", "$.limits")):
        blob = b"\x82" + head[1:] + msgpack.packb(key) + b"\x91" * 10_000 + b"\x90"
        err = await _ask(nc, "create", blob)
        assert (err.code, err.data["field"]) == ("invalid_request", field), err
    assert (await env.client.exec(sid, "echo fine")).stdout.strip() == "fine"
