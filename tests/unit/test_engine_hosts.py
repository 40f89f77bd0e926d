"""Engine hosts' pure parts: their engine ids, their subjects, their identities' permissions,
and the supervisor config that refuses a bad declaration."""

from __future__ import annotations

import pytest

from common import subjects
from common.auth import engine_host_identities, grant
from services.supervisor.config import SupervisorConfig, host_engine_ids, parse_engine_host


def test_an_engine_host_declaration_names_its_engines() -> None:
    assert parse_engine_host("h1:2") == ("h1", 2)
    assert parse_engine_host("gpu-a") == ("gpu-a", 1)
    assert host_engine_ids("h1", 2) == ["h1-e0", "h1-e1"]
    node = SupervisorConfig(engine_hosts=("h1:2", "h2:1"))
    assert node.remote_engine_ids == ["h1-e0", "h1-e1", "h2-e0"]
    for bad in ("h1:0", "h1:x", "a.b:1", "node:1", ":1"):
        with pytest.raises(ValueError):
            parse_engine_host(bad)


def test_an_engine_host_joins_a_deployment_by_name() -> None:
    with pytest.raises(ValueError, match="nats_url"):
        SupervisorConfig(role="engine-host", host_name="h1")
    with pytest.raises(ValueError, match="host name"):
        SupervisorConfig(role="engine-host", nats_url="nats://x:4222")
    ok = SupervisorConfig(role="engine-host", host_name="h1", nats_url="nats://x:4222")
    assert ok.host_name == "h1"


def test_host_scoped_subjects_leave_the_nodes_unchanged() -> None:
    assert subjects.weights_get() == "belayer.weights.get"
    assert subjects.weights_get("h1") == "belayer.host.h1.weights.get"
    assert subjects.kv_get("h1") == "belayer.host.h1.kv.get"
    assert subjects.kv_flush("h1") == "belayer.host.h1.kv.flush"
    with pytest.raises(ValueError):
        subjects.weights_get("h1.>")


def test_an_engine_host_serves_only_its_own_subjects_and_pushes_nothing() -> None:
    names = {(n, r, s) for n, r, s in engine_host_identities("h1", ["h1-e0"])}
    assert names == {
        ("host", "engine-host", "h1"),
        ("weights", "engine-host", "h1"),
        ("kv", "engine-host", "h1"),
        ("engine-h1-e0", "engine", "h1-e0"),
    }
    g = grant("engine-host", public_key="UKEY", scope="h1")
    assert "belayer.host.h1.>" in g.subscribe
    assert not any(
        s.startswith(("belayer.weights", "belayer.kv", "belayer.engine")) for s in g.subscribe
    )
    assert subjects.weights_push() not in g.publish
    assert subjects.weights_export() in g.publish
    assert not any(p.startswith(("$KV.", "$O.", "$JS.API.STREAM.CREATE")) for p in g.publish)
    # The node's weight store alone answers exports and writes the weight objects.
    weights = grant("weights", public_key="UKEY")
    assert subjects.weights_export() in weights.subscribe
    assert f"$O.{subjects.BUCKET_WEIGHT_OBJECTS}.>" in weights.publish
