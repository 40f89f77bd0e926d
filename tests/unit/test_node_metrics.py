"""The node's Prometheus metrics: which event feeds which metric (``event_samples``, pure) and
what a scrape of the registry then shows, in Prometheus's names and units."""

from __future__ import annotations

from prometheus_client import generate_latest

from schemas.env import CheckpointInfo
from schemas.events import (
    CheckpointReady,
    EngineRegistered,
    RequestsResumed,
    ResumedFirstToken,
    SandboxRestored,
)
from schemas.events_training import FailureRecovered
from services.supervisor.metrics import SPECS, NodeMetrics, Sample, event_samples


def restored(method: str = "runtime", seconds: float = 0.8, size: int = 3 << 20) -> SandboxRestored:
    return SandboxRestored(
        source="environment:n0", sandbox_id="sb1", checkpoint_id="ck1", prefix=3,
        seconds=seconds, bytes=size, method=method,
    )  # fmt: skip


def test_event_samples_map_events_to_metrics() -> None:
    first = ResumedFirstToken(engine_id="e0", epoch=2, request_ids=["a", "b"], seconds=[0.3, 0.4])
    assert event_samples(first) == [
        Sample("belayer_resumed_first_token_seconds", ("e0",), 0.3),
        Sample("belayer_resumed_first_token_seconds", ("e0",), 0.4),
    ]
    assert event_samples(restored()) == [
        Sample("belayer_sandbox_restores", ("runtime",), 1),
        Sample("belayer_sandbox_restore_seconds", (), 0.8),
        Sample("belayer_sandbox_restore_bytes", (), 3 << 20),
    ]
    resumed = RequestsResumed(engine_id="e1", epoch=3, count=2, held_tokens=40, request_ids=[])
    assert event_samples(resumed) == [
        Sample("belayer_requests_resumed", ("e1",), 2),
        Sample("belayer_resumed_held_tokens", ("e1",), 40),
    ]
    recovered = FailureRecovered(
        rollout_id="r", injection="sandbox-kill@turn=3", trajectory_id="t", seconds=1.5
    )
    assert event_samples(recovered) == [  # the fault is the injection's kind
        Sample("belayer_failures_recovered", ("sandbox-kill",), 1),
        Sample("belayer_failure_recovery_seconds", ("sandbox-kill",), 1.5),
    ]
    assert event_samples(EngineRegistered(engine_id="e0", epoch=1, pid=7)) == []


def test_every_sample_names_a_declared_metric_with_its_labels() -> None:
    specs = {s.name: s for s in SPECS}
    info = CheckpointInfo(
        sandbox_id="sb1", trajectory_id="t", prefix=1, checkpoint_id="ck", fs_bytes=10,
        criu_bytes=20, freeze_s=0.1, fs_s=0.1, dump_s=0.1, total_s=0.4,
    )  # fmt: skip
    evs = [
        ResumedFirstToken(engine_id="e0", epoch=2, request_ids=["a"], seconds=[0.3]),
        restored(),
        CheckpointReady(source="environment:n0", checkpoint=info),
    ]
    for ev in evs:
        for name, labels, _ in event_samples(ev):
            assert len(labels) == len(specs[name].labels), name


def test_a_scrape_shows_the_new_series() -> None:
    m = NodeMetrics()
    m.observe(
        ResumedFirstToken(engine_id="e0", epoch=2, request_ids=["a", "b"], seconds=[0.3, 2.0])
    )
    m.observe(restored("runtime", 0.8, 3 << 20))
    m.observe(restored("layer", 0.2, 1 << 10))
    get = m.registry.get_sample_value
    assert get("belayer_resumed_first_token_seconds_count", {"engine": "e0"}) == 2
    assert get("belayer_resumed_first_token_seconds_sum", {"engine": "e0"}) == 2.3
    assert get("belayer_resumed_first_token_seconds_bucket", {"engine": "e0", "le": "0.5"}) == 1
    assert get("belayer_sandbox_restores_total", {"method": "runtime"}) == 1
    assert get("belayer_sandbox_restores_total", {"method": "layer"}) == 1
    assert get("belayer_sandbox_restore_seconds_sum") == 1.0
    assert get("belayer_sandbox_restore_bytes_sum") == (3 << 20) + (1 << 10)
    text = generate_latest(m.registry).decode()
    assert "# TYPE belayer_sandbox_restores_total counter" in text
    assert "belayer_router_up 0.0" in text  # no router status read yet
