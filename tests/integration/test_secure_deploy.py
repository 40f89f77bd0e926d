"""Deploying securely: a node whose own NATS serves TLS (`--tls-cert/--tls-key/--tls-ca`), and
bad deployment input — a cluster URL that does not answer, missing credential files, a TLS
certificate that does not match its key — each one clear line, a non-zero exit and nothing
left running."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from common.auth import BusConfig
from common.bus import connect
from common.errors import BelayerError
from common.natsserver import free_port
from services.router.client import generate
from tests.integration.node_helpers import Node, cli, greedy, start_node, stop_node
from tests.integration.tls_helpers import make_pki

pytestmark = pytest.mark.timeout(240)


def assert_nothing_started(run_dir: Path, r: subprocess.CompletedProcess[str]) -> None:
    assert r.returncode != 0, r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.stderr
    assert not (run_dir / "node.json").exists()
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(run_dir) not in ps, "a process of the failed node is left"


def test_bad_deployment_input_is_one_line_and_starts_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    dead = f"nats://127.0.0.1:{free_port()}"
    r = cli("up", "--detach", "--no-environment", "--join", dead, run_dir=run_dir, check=False)
    assert_nothing_started(run_dir, r)
    assert "cannot reach NATS" in r.stderr
    empty = tmp_path / "creds"
    empty.mkdir()
    r = cli(
        "up", "--detach", "--no-environment", "--join", dead, "--creds-dir", str(empty),
        run_dir=run_dir, check=False,
    )  # fmt: skip
    assert_nothing_started(run_dir, r)
    assert "supervisor.nk does not exist" in r.stderr
    a, b = make_pki(tmp_path / "a"), make_pki(tmp_path / "b")
    r = cli(
        "up", "--detach", "--no-environment", "--tls-cert", str(a.cert), "--tls-key",
        str(b.key), "--tls-ca", str(a.ca), run_dir=run_dir, check=False,
    )  # fmt: skip
    assert_nothing_started(run_dir, r)
    assert "TLS files" in r.stderr and "not usable" in r.stderr
    r = cli("up", "--detach", "--tls-cert", str(a.cert), run_dir=run_dir, check=False)
    assert_nothing_started(run_dir, r)
    assert "go together" in r.stderr
    r = cli("up", "--detach", "--role", "env-host", run_dir=run_dir, check=False)
    assert_nothing_started(run_dir, r)
    assert "--join" in r.stderr


async def test_a_node_serves_its_bus_over_tls(tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "tls")
    node: Node = start_node(
        tmp_path / "run", "--tls-cert", str(pki.cert), "--tls-key", str(pki.key),
        "--tls-ca", str(pki.ca),
    )  # fmt: skip
    try:
        assert node.nats_url.startswith("tls://")
        st = json.loads(cli("status", "--json", run_dir=node.run_dir).stdout)
        assert st["state"] == "ready"
        out = cli(
            "generate", "--prompt", "over tls", "--max-tokens", "4", "--json", run_dir=node.run_dir
        )
        assert len(json.loads(out.stdout)["token_ids"]) == 4
        creds = node.bus().creds
        tls = BusConfig(
            creds=creds, tls_ca=str(pki.ca), tls_cert=str(pki.cert), tls_key=str(pki.key)
        )
        nc = await connect(node.nats_url, name="t", bus=tls)
        try:
            res = await generate(nc, greedy("tls-1", n=4), timeout=60)
            assert len(res.token_ids) == 4
        finally:
            await nc.drain()
        # The right identity but no client certificate, or no TLS at all: refused.
        for bus in (BusConfig(creds=creds, tls_ca=str(pki.ca)), BusConfig(creds=creds)):
            with pytest.raises(BelayerError):
                await connect(node.nats_url, name="x", bus=bus, timeout=3, reconnect=False)
        plain = node.nats_url.replace("tls://", "nats://")
        with pytest.raises(BelayerError):
            await connect(plain, name="x", bus=BusConfig(creds=creds), timeout=3, reconnect=False)
    finally:
        stop_node(node)
