"""``belayer soak``'s ``nats-kill``: one server of a NATS cluster SIGKILLed and started again.

A node joined to a cluster (``belayer up --join URL,URL,...``, ``deploy/cluster/``) names its
servers in its bus URL. The soak can fault those of them that run on its own machine: a server
is found by the port it listens on (``/proc/net/tcp``, the socket's inode, the process holding
it), SIGKILLed, and started again exactly as it was started (the same argument vector in the
same working directory: its configuration file, its JetStream store, its log file), as a
service manager would. It is back when it answers a JetStream request through a connection to
it alone. Servers on other hosts are out of the soak's reach: a cluster with no local server
takes no ``nats-kill``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from common.auth import BusConfig
from common.bus import connect
from common.heartbeat import process_alive

LISTEN = "0A"
"""``/proc/net/tcp``'s state of a listening socket."""
GONE_TIMEOUT_S = 10.0
"""A killed server not gone this long: the restart is not attempted."""


@dataclass(frozen=True)
class LocalServer:
    """A NATS server of the cluster running on this machine."""

    url: str
    port: int
    pid: int
    argv: tuple[str, ...]
    cwd: str


def cluster_urls(nats_url: str) -> list[str]:
    """The servers a bus URL names (comma-separated); a cluster names more than one."""
    return [u.strip() for u in nats_url.split(",") if u.strip()]


def url_port(url: str) -> int:
    """The port of a NATS URL (4222 when it names none)."""
    return urlsplit(url if "://" in url else f"nats://{url}").port or 4222


def listening_inodes(table: str, port: int) -> set[int]:
    """Inodes of the sockets listening on ``port`` in a ``/proc/net/tcp`` (or ``tcp6``) table."""
    out = set()
    for line in table.splitlines()[1:]:
        cols = line.split()
        if len(cols) < 10 or cols[3] != LISTEN:
            continue
        local_port = int(cols[1].rsplit(":", 1)[1], 16)
        if local_port == port:
            out.add(int(cols[9]))
    return out


def listening_pid(port: int) -> int | None:
    """The live process listening on TCP ``port`` on this machine; None if none is found."""
    inodes: set[int] = set()
    for name in ("tcp", "tcp6"):
        try:
            inodes |= listening_inodes(Path(f"/proc/net/{name}").read_text(), port)
        except OSError:
            continue
    if not inodes:
        return None
    links = {f"socket:[{i}]" for i in inodes}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fds = list((proc / "fd").iterdir())
        except OSError:  # gone meanwhile, or not ours to read
            continue
        for fd in fds:
            try:
                if os.readlink(fd) in links and process_alive(int(proc.name)):
                    return int(proc.name)
            except OSError:
                continue
    return None


def _read_argv(pid: int) -> tuple[str, ...]:
    raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    return tuple(a.decode() for a in raw.split(b"\0") if a)


def local_servers(nats_url: str) -> list[LocalServer]:
    """The bus URL's servers that run here as ``nats-server`` processes (none for one URL: a
    single server is no cluster, and killing it is not a fault the node can survive)."""
    urls = cluster_urls(nats_url)
    if len(urls) < 2:
        return []
    out = []
    for url in urls:
        port = url_port(url)
        pid = listening_pid(port)
        if pid is None:
            continue
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            argv, cwd = _read_argv(pid), os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            continue
        if comm.startswith("nats-server") and argv:
            out.append(LocalServer(url=url, port=port, pid=pid, argv=argv, cwd=cwd))
    return out


def kill_and_restart(server: LocalServer) -> tuple[float, LocalServer]:
    """SIGKILL the server; once it is gone, start it again as it was started. The time of the
    kill and the server as restarted (its new pid). The new process is in a session of its
    own: it outlives the soak, as the one it replaces would have."""
    t = time.time()
    os.kill(server.pid, signal.SIGKILL)
    deadline = time.monotonic() + GONE_TIMEOUT_S
    while process_alive(server.pid) or listening_pid(server.port) == server.pid:
        if time.monotonic() > deadline:
            raise OSError(f"nats-server {server.pid} still runs {GONE_TIMEOUT_S:g} s after SIGKILL")
        time.sleep(0.02)  # bounded wait for the kernel to take the process down
    proc = subprocess.Popen(
        server.argv,
        cwd=server.cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    return t, LocalServer(server.url, server.port, proc.pid, server.argv, server.cwd)


async def answers(url: str, bus: BusConfig, timeout: float = 2.0) -> bool:
    """The server at ``url`` (alone: no fail-over to the others) answers a JetStream request."""
    try:
        nc = await connect(url, name="soak-probe", bus=bus, timeout=timeout, reconnect=False)
    except Exception:
        return False
    try:
        await asyncio.wait_for(nc.jetstream().account_info(), timeout)
        return True
    except Exception:
        return False
    finally:
        with contextlib.suppress(Exception):
            await nc.close()


class NatsFaults:
    """The soak's hands on the cluster: each ``nats-kill`` takes the next local server in turn."""

    def __init__(self, servers: list[LocalServer], bus: BusConfig) -> None:
        self.servers = list(servers)
        self.bus = bus
        self._next = 0

    async def inject(self) -> tuple[str, int, float]:
        """SIGKILL the next server and start it again; (``nats:<port>``, the killed pid, when)."""
        i = self._next % len(self.servers)
        self._next += 1
        server = self.servers[i]
        t, self.servers[i] = await asyncio.to_thread(kill_and_restart, server)
        return f"nats:{server.port}", server.pid, t

    async def back(self, target: str, timeout: float) -> float | None:
        """Unix time the server ``target`` (``nats:<port>``) answered again; None past
        ``timeout``."""
        port = int(target.removeprefix("nats:"))
        url = next(s.url for s in self.servers if s.port == port)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if await answers(url, self.bus):
                return time.time()
            await asyncio.sleep(0.05)  # the probe's pace, bounded by the timeout
        return None
