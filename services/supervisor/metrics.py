"""The node's Prometheus metrics (``belayer up --metrics-port P``): ``/metrics`` in the
Prometheus text format, served by the supervisor from what the node's services say on the bus.

Two sources, each stated as what it is:

- **the router's own counters and gauges**, read from ``router.status`` every
  ``POLL_S`` (requests, resumes, regenerated tokens… as ``belayer_router_<name>_total``;
  engines' state, epoch, queue and weight version as gauges labelled by engine). A router
  restart starts its counters again, which Prometheus's ``rate()`` reads as a counter reset;
- **events as they are published** (``belayer.events.>``): every handover's detection and
  detected-to-registered time, requests resumed, the tokens they held and the time to each one's
  first new token, sandbox checkpoints and restores (duration, bytes), failures injected and
  recovered (time to recover), and each training step (duration, loss, reward,
  log-probability difference). Which event feeds which metric is ``event_samples`` (pure).

Names and units follow Prometheus conventions (``_seconds``, ``_bytes``, ``_total``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from common import subjects
from common.codec import decode
from common.errors import BelayerError
from schemas.events import (
    AnyEvent,
    CheckpointReady,
    EventBase,
    HandoverComplete,
    HandoverDetected,
    RequestsResumed,
    ResumedFirstToken,
    SandboxRestored,
)
from schemas.events_training import FailureInjected, FailureRecovered, TrainStep
from schemas.serving import RouterStatus
from services.router.client import router_status

POLL_S = 1.0
"""How often the router's status is read."""

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""Histogram buckets of the recovery latencies, in seconds."""
STEP_BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
"""Histogram buckets of durations of a training step's phases, in seconds."""
BYTES_BUCKETS = tuple(float(2**k) for k in range(10, 34, 2))
"""Histogram buckets of checkpoint sizes: 1 KiB … 8 GiB."""


Kind = Literal["counter", "histogram", "gauge"]


@dataclass(frozen=True)
class MetricSpec:
    """One metric fed by events (a counter's exposed name gains ``_total``)."""

    kind: Kind
    name: str
    doc: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = LATENCY_BUCKETS


SPECS: tuple[MetricSpec, ...] = (
    MetricSpec("histogram", "belayer_handover_seconds",
               "Shadow handover: the main worker's failure detected to the shadow registered.",
               ("engine",)),
    MetricSpec("histogram", "belayer_handover_detection_heartbeat_age_seconds",
               "Age of the failed worker's heartbeat when its shadow detected the failure.",
               ("engine", "verdict")),
    MetricSpec("counter", "belayer_requests_resumed",
               "Requests resumed at token level on another worker.", ("engine",)),
    MetricSpec("counter", "belayer_resumed_held_tokens",
               "Tokens the resumed requests already held (not generated again).", ("engine",)),
    MetricSpec("histogram", "belayer_resumed_first_token_seconds",
               "The router taking a worker down to a resumed request's first new token from "
               "the engine's next worker.", ("engine",)),
    MetricSpec("histogram", "belayer_sandbox_checkpoint_seconds",
               "Sandbox checkpoint time (freeze to ready)."),
    MetricSpec("histogram", "belayer_sandbox_checkpoint_bytes",
               "Sandbox checkpoint size (files and processes).", buckets=BYTES_BUCKETS),
    MetricSpec("counter", "belayer_sandbox_restores",
               "Sandboxes restored to a ready checkpoint, by restore method.", ("method",)),
    MetricSpec("histogram", "belayer_sandbox_restore_seconds",
               "Sandbox restore time (every candidate checkpoint tried)."),
    MetricSpec("histogram", "belayer_sandbox_restore_bytes",
               "Size of the checkpoints restored (files and processes).", buckets=BYTES_BUCKETS),
    MetricSpec("counter", "belayer_failures_injected", "Failures injected, by kind.", ("fault",)),
    MetricSpec("counter", "belayer_failures_recovered", "Injected failures recovered, by kind.",
               ("fault",)),
    MetricSpec("histogram", "belayer_failure_recovery_seconds",
               "Injected failure to recovered, by kind.", ("fault",)),
    MetricSpec("counter", "belayer_trainer_steps", "Training steps done."),
    MetricSpec("histogram", "belayer_trainer_step_seconds",
               "A training step's update time (recompute and train).", buckets=STEP_BUCKETS),
    MetricSpec("gauge", "belayer_trainer_loss", "The last step's loss."),
    MetricSpec("gauge", "belayer_trainer_reward_mean", "The last step's mean reward."),
    MetricSpec("gauge", "belayer_trainer_logprob_diff_max",
               "The last step's largest |training - engine| log-probability difference."),
)  # fmt: skip
"""Every event-fed metric; ``event_samples`` says which event feeds which."""


class Sample(NamedTuple):
    """One update of one metric: a counter's increment, a histogram's observation or a
    gauge's new value."""

    name: str
    labels: tuple[str, ...]
    value: float


def event_samples(ev: EventBase) -> list[Sample]:
    """What one event adds to the metrics (pure; events that feed none give ``[]``)."""
    if isinstance(ev, HandoverComplete):
        return [Sample("belayer_handover_seconds", (ev.engine_id,), ev.detect_to_registered_s)]
    if isinstance(ev, HandoverDetected):
        age = "belayer_handover_detection_heartbeat_age_seconds"
        return [Sample(age, (ev.engine_id, ev.verdict), ev.heartbeat_age_s)]
    if isinstance(ev, RequestsResumed):
        return [
            Sample("belayer_requests_resumed", (ev.engine_id,), ev.count),
            Sample("belayer_resumed_held_tokens", (ev.engine_id,), ev.held_tokens),
        ]
    if isinstance(ev, ResumedFirstToken):
        name = "belayer_resumed_first_token_seconds"
        return [Sample(name, (ev.engine_id,), s) for s in ev.seconds]
    if isinstance(ev, CheckpointReady):
        info = ev.checkpoint
        return [
            Sample("belayer_sandbox_checkpoint_seconds", (), info.total_s),
            Sample("belayer_sandbox_checkpoint_bytes", (), info.fs_bytes + info.criu_bytes),
        ]
    if isinstance(ev, SandboxRestored):
        return [
            Sample("belayer_sandbox_restores", (ev.method,), 1),
            Sample("belayer_sandbox_restore_seconds", (), ev.seconds),
            Sample("belayer_sandbox_restore_bytes", (), ev.bytes),
        ]
    if isinstance(ev, FailureInjected):
        return [Sample("belayer_failures_injected", (ev.fault,), 1)]
    if isinstance(ev, FailureRecovered):
        fault = ev.injection.split("@", 1)[0]
        return [
            Sample("belayer_failures_recovered", (fault,), 1),
            Sample("belayer_failure_recovery_seconds", (fault,), ev.seconds),
        ]
    if isinstance(ev, TrainStep):
        gauges = [
            Sample("belayer_trainer_loss", (), ev.loss),
            Sample("belayer_trainer_reward_mean", (), ev.reward_mean),
            Sample("belayer_trainer_logprob_diff_max", (), ev.logprob_diff_max),
        ]
        if ev.republished:  # its first publication may have been counted: the gauges only
            return gauges
        return [
            Sample("belayer_trainer_steps", (), 1),
            Sample("belayer_trainer_step_seconds", (), ev.recompute_s + ev.train_s),
            *gauges,
        ]
    return []


class NodeMetrics:
    """Every metric of the node, in one registry; ``observe`` takes an event, ``router`` holds
    the router's latest status."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.router: RouterStatus | None = None
        self.by_name: dict[str, Any] = {}
        for spec in SPECS:
            if spec.kind == "histogram":
                m: Any = Histogram(
                    spec.name, spec.doc, spec.labels, buckets=spec.buckets, registry=r
                )
            elif spec.kind == "counter":
                m = Counter(spec.name, spec.doc, spec.labels, registry=r)
            else:
                m = Gauge(spec.name, spec.doc, spec.labels, registry=r)
            self.by_name[spec.name] = m
        r.register(_RouterCollector(self))

    def observe(self, ev: EventBase) -> None:
        """Count, time or set what one event says (``event_samples``)."""
        for name, labels, value in event_samples(ev):
            metric = self.by_name[name]
            child = metric.labels(*labels) if labels else metric
            if isinstance(metric, Counter):
                child.inc(value)
            elif isinstance(metric, Histogram):
                child.observe(value)
            else:
                child.set(value)


class _RouterCollector(Collector):
    """The router's latest status as metric families, built at scrape time."""

    def __init__(self, owner: NodeMetrics) -> None:
        self.owner = owner

    def collect(self) -> Iterator[Metric]:
        st = self.owner.router
        up = GaugeMetricFamily("belayer_router_up", "1 while the router answers its status.")
        up.add_metric([], 0.0 if st is None else 1.0)
        yield up
        if st is None:
            return
        inflight = GaugeMetricFamily("belayer_router_inflight_requests", "Unfinished requests.")
        inflight.add_metric([], float(st.inflight))
        yield inflight
        for name, value in sorted(st.metrics.items()):
            c = CounterMetricFamily(f"belayer_router_{name}", f"The router's {name} counter.")
            c.add_metric([], float(value))
            yield c
        yield from _engine_gauges(st)


def _engine_gauges(st: RouterStatus) -> Iterable[Metric]:
    fields: list[tuple[str, str, Any]] = [
        (
            "up",
            "1 while a live worker of the current epoch serves the engine.",
            lambda e: e.healthy,
        ),
        ("epoch", "The engine's epoch (one per worker that claimed it).", lambda e: e.epoch),
        ("requests", "Requests the router has on the engine.", lambda e: e.running),
        ("held_requests", "Requests the worker holds (running and queued).", lambda e: e.holding),
        ("weight_version", "The weight version the engine serves.", lambda e: e.weight_version),
        ("failures", "Failures of the engine inside the failure window.", lambda e: e.failures),
    ]
    for name, doc, get in fields:
        g = GaugeMetricFamily(f"belayer_engine_{name}", doc, labels=["engine"])
        for e in st.engines:
            g.add_metric([e.id], float(get(e)))
        yield g


class MetricsEndpoint:
    """``/metrics`` over HTTP (``prometheus_client``'s server, a daemon thread), fed on the
    event loop: every event from ``belayer.events.>`` and the router's status every
    ``POLL_S`` (``poll_loop``)."""

    def __init__(self, port: int, addr: str, log: Any) -> None:
        self.port, self.addr, self.log = port, addr, log
        self.metrics = NodeMetrics()
        self.server: Any = None
        self.nc: NATS | None = None

    async def start(self, nc: NATS) -> str:
        """Subscribe and serve; returns the endpoint's URL (the port actually bound)."""
        self.nc = nc
        await nc.subscribe(subjects.EVENTS_ALL, cb=self._on_event)
        self.server, _ = start_http_server(
            self.port, addr=self.addr, registry=self.metrics.registry
        )
        url = f"http://{self.addr}:{self.server.server_port}/metrics"
        self.log.info("metrics_serving", url=url)
        return url

    async def _on_event(self, msg: Msg) -> None:
        try:
            ev: EventBase = decode(msg.data, AnyEvent)
        except BelayerError:
            return  # a kind this node does not know, or not an event: nothing to count
        self.metrics.observe(ev)

    async def poll_loop(self) -> None:
        assert self.nc is not None
        while True:
            try:
                self.metrics.router = await router_status(self.nc, timeout=POLL_S)
            except BelayerError:
                self.metrics.router = None  # belayer_router_up 0 while it does not answer
            await asyncio.sleep(POLL_S)

    def close(self) -> None:
        if self.server is not None:
            with contextlib.suppress(Exception):
                self.server.shutdown()
                self.server.server_close()
