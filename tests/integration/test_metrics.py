"""The node's Prometheus metrics, scraped by a real Prometheus (Debian's ``prometheus``, which
the setup installs): ``belayer up --metrics-port 0`` serves ``/metrics`` (the port it took is in
``node.json``); the engines' gauges come from the router's status; a worker SIGKILL later the
handover histogram, read back through Prometheus's HTTP query API, holds that handover, and the
first-resumed-token histogram holds the request the handover resumed."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.node_helpers import (
    Node,
    StreamRecord,
    greedy,
    start_node,
    stop_node,
    stream_generate,
)

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def metrics_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    node = start_node(tmp_path_factory.mktemp("metrics"), "--metrics-port", "0")
    try:
        yield node
    finally:
        stop_node(node)


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:  # a local test server
        return str(r.read().decode())


def _until(what: str, timeout: float, probe):
    """``probe()`` until it returns something truthy (bounded), polling once a second."""
    deadline = time.monotonic() + timeout
    while True:
        got = probe()
        if got:
            return got
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f} s"
        time.sleep(1.0)  # Prometheus scrapes once a second: nothing to wait on but its clock


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def prometheus(metrics_node: Node, tmp_path: Path) -> Iterator[str]:
    binary = shutil.which("prometheus")
    assert binary, "prometheus is not installed (deploy/install_env.sh installs it)"
    target = urllib.parse.urlsplit(
        json.loads((metrics_node.run_dir / "node.json").read_text())["metrics_url"]
    )
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        f"scrape_configs:\n  - job_name: belayer\n    static_configs:\n      - targets: ['{target.netloc}']\n"
    )
    port = _free_port()
    log = (tmp_path / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:

        def ready() -> bool:
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]
            try:
                return "Ready" in _get(f"{base}/-/ready")
            except OSError:
                return False

        _until("ready Prometheus", 60, ready)
        yield base
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _query(base: str, expr: str) -> list[dict]:
    body = json.loads(_get(f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})))
    assert body["status"] == "success", body
    return list(body["data"]["result"])


def test_metrics_endpoint_serves_the_engines_and_router(metrics_node: Node) -> None:
    url = json.loads((metrics_node.run_dir / "node.json").read_text())["metrics_url"]
    assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")

    def scraped() -> str:
        text = _get(url)
        return text if 'belayer_engine_up{engine="e0"} 1.0' in text else ""

    text = _until("engine gauges", 30, scraped)
    assert "belayer_router_up 1.0" in text
    assert "# TYPE belayer_handover_seconds histogram" in text
    assert "# TYPE belayer_router_requests_total counter" in text


async def _kill_worker_mid_request(node: Node, worker: int) -> None:
    """A long greedy request streaming on e0 when its worker is SIGKILLed: it finishes on the
    shadow that takes over (resumed from the tokens it held)."""
    nc = await node.connect("metrics-test")
    try:
        rec = StreamRecord("metrics-resumed")
        req = greedy(rec.request_id, n=600, engine_id="e0")
        task = asyncio.create_task(stream_generate(nc, req, timeout=60, record=rec))
        await rec.wait_tokens(8, timeout=60)
        assert rec.result is None, "the request finished before the kill: make it longer"
        os.kill(worker, signal.SIGKILL)
        await task
        assert rec.result is not None and len(rec.tokens) == 600
    finally:
        await nc.drain()


def test_prometheus_scrapes_a_handover(metrics_node: Node, prometheus: str) -> None:
    _until(
        "a scrape of the node",
        60,
        lambda: _query(prometheus, 'belayer_engine_up{engine="e0"} == 1'),
    )
    epoch = float(_query(prometheus, 'belayer_engine_epoch{engine="e0"}')[0]["value"][1])
    asyncio.run(_kill_worker_mid_request(metrics_node, metrics_node.pids()["worker-e0"]))
    count = _until(
        "the handover in Prometheus", 90,
        lambda: _query(prometheus, 'belayer_handover_seconds_count{engine="e0"} >= 1'),
    )  # fmt: skip
    assert float(count[0]["value"][1]) == 1.0
    took = float(_query(prometheus, 'belayer_handover_seconds_sum{engine="e0"}')[0]["value"][1])
    assert 0.0 < took < 30.0  # detected to registered, measured by the shadow
    first = _until(
        "the resumed request's first token in Prometheus", 30,
        lambda: _query(prometheus, 'belayer_resumed_first_token_seconds_count{engine="e0"} >= 1'),
    )  # fmt: skip
    assert float(first[0]["value"][1]) == 1.0
    _until("the new epoch scraped", 30,
           lambda: _query(prometheus, f'belayer_engine_epoch{{engine="e0"}} > {epoch}'))  # fmt: skip
