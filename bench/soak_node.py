"""``belayer soak``'s hands on the node: the fault kinds (what each one does to which real
process), whether the node is whole again after one, and what a node left behind.

Pids come from where the rest of Belayer takes them: a main worker's from ``router.status``
(as the controller's ``worker-kill``), every other process's from the supervisor's table
(``supervisor.status``, as ``belayer top``). A worker hang is a SIGSTOP: the shadow sees its
heartbeat go stale and takes over (and SIGKILLs it); every other fault is a SIGKILL.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.config import SHM_DIR, shm_prefix
from common.errors import BelayerError
from common.heartbeat import process_alive
from schemas import events as ev
from services.router.client import router_status
from services.supervisor.client import supervisor_status

WORKER_KINDS = ("worker-kill", "worker-hang", "shadow-kill")
"""Faults aimed at one engine (its main worker, or its shadow)."""
SERVICE_KINDS = {
    "router-kill": "router",
    "weights-kill": "weights",
    "kv-kill": "kv",
    "controller-kill": "controller",
    "trainer-kill": "trainer",
    "environment-kill": "environment",
}
"""Faults aimed at a supervised service (the supervisor restarts it) → its process name."""
SANDBOX_KINDS = ("sandbox-kill", "sandbox-pause", "checkpoint-interrupt")
"""Faults aimed at the soak's sandbox lane (``bench/soak_work.py``): ``docker kill`` and
``docker pause`` of its container, the environment service SIGKILLed mid-checkpoint."""
CLUSTER_KINDS = ("nats-kill",)
"""Faults aimed at the bus of a node joined to a NATS cluster: one of the cluster's servers
that run on this machine SIGKILLed and started again (``bench/soak_cluster.py``)."""
ALL_KINDS = (*WORKER_KINDS, *SERVICE_KINDS, *SANDBOX_KINDS, *CLUSTER_KINDS)
READ_S = 10.0
"""How long a fault tries to read the node's status (each try 1 s per service) before it
counts as not injected: a busy machine's supervisor or router may miss one deadline."""


def kinds_for(
    procs: set[str], recovery: str, sandboxes: bool = False, cluster: bool = False
) -> tuple[str, ...]:
    """The kinds a node of these processes takes: the service kinds of the services it runs;
    the shadow kinds only with shadows (belayer recovery); the sandbox kinds with a sandbox
    lane (the swe workload, on a node running the environment service); ``nats-kill`` on a
    cluster with a server on this machine."""
    out = [k for k in WORKER_KINDS if recovery == "belayer" or k == "worker-kill"]
    out += [k for k, name in SERVICE_KINDS.items() if name in procs]
    if sandboxes and "environment" in procs:
        out += SANDBOX_KINDS
    if cluster:
        out += CLUSTER_KINDS
    return tuple(out)


@dataclass
class Injected:
    """A fault as injected: ``pid`` got ``signal`` at ``t``."""

    kind: str
    target: str
    """The engine id (worker kinds) or the process name (service kinds)."""
    pid: int
    t: float


@dataclass
class NodeView:
    """What ``whole`` needs of the node, read over the bus."""

    procs: dict[str, tuple[int, bool]]
    """Supervisor process name → (pid, alive)."""
    engines: dict[str, tuple[bool, int]]
    """Engine id → (up, worker pid) as the router sees it."""
    retired: tuple[str, ...] = ()
    """Engines the router holds unhealthy (retired from placement for good)."""


async def view(nc: Any) -> NodeView | None:
    """The supervisor's table and the router's engines; None while either does not answer."""
    try:
        sup = await supervisor_status(nc, timeout=1.0)
        st = await router_status(nc, timeout=1.0)
    except BelayerError:
        return None
    return NodeView(
        procs={p.name: (p.pid or 0, p.alive) for p in sup.procs},
        engines={e.id: (e.healthy and e.state in ("", "up"), e.worker_pid) for e in st.engines},
        retired=tuple(e.id for e in st.engines if e.state == "unhealthy"),
    )


async def view_within(nc: Any, budget_s: float = READ_S) -> NodeView | None:
    """``view``, tried again (every 0.2 s) until it answers or ``budget_s`` is gone."""
    deadline = time.monotonic() + budget_s
    while True:
        v = await view(nc)
        if v is not None or time.monotonic() > deadline:
            return v
        await asyncio.sleep(0.2)  # the status read missed its deadline: a bounded retry


@dataclass
class Target:
    """Aims faults at the node's processes (what is whole after one: ``bench/soak_faults.py``)."""

    names: frozenset[str]
    """Every supervised process the node runs at the start."""
    engines: tuple[str, ...]
    shadows: bool
    events: Any
    """An ``EventTail`` of the node (for the shadows' ``shadow_ready``)."""
    stopped: set[int] = field(default_factory=set)
    """Pids this soak SIGSTOPped (resumed with SIGCONT if still there at the end)."""

    def shadow_warm(self, pid: int) -> bool:
        return any(e.pid == pid for e in self.events.matching(ev.ShadowReady))

    @staticmethod
    def is_back(v: NodeView, inj: Injected) -> bool:
        """The faulted part works again: the engine up under another worker (worker kinds),
        the process restarted (the others)."""
        if inj.kind in ("worker-kill", "worker-hang"):
            up, pid = v.engines.get(inj.target, (False, 0))
            return up and pid not in (0, inj.pid)
        name = f"shadow-{inj.target}" if inj.kind == "shadow-kill" else inj.target
        pid, alive = v.procs.get(name, (0, False))
        return alive and pid not in (0, inj.pid)

    async def inject(self, nc: Any, kind: str, engine: str) -> Injected:
        """Do ``kind`` to its process (``engine``: the engine a worker kind aims at)."""
        v = await view_within(nc)
        if v is None:
            raise BelayerError(f"{kind}: the node's status did not answer for {READ_S:g} s")
        if kind in WORKER_KINDS:
            target = engine
            name = f"shadow-{engine}" if kind == "shadow-kill" else f"worker-{engine}"
            pid = v.engines[engine][1] if kind != "shadow-kill" else v.procs[name][0]
        else:
            target = name = SERVICE_KINDS[kind]
            pid = v.procs[name][0]
        if not pid:
            raise BelayerError(f"{kind}: {name} has no pid")
        sig = signal.SIGSTOP if kind == "worker-hang" else signal.SIGKILL
        t = time.time()
        os.kill(pid, sig)
        if sig == signal.SIGSTOP:
            self.stopped.add(pid)
        return Injected(kind, target, pid, t)

    def resume_stopped(self) -> None:
        """SIGCONT every process this soak stopped that still runs (the soak was interrupted
        before the shadow took over)."""
        for pid in self.stopped:
            if process_alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:160]
    except OSError:
        return ""


def run_processes(run_id: str) -> list[int]:
    """Live pids whose environment carries ``BELAYER_RUN_ID=<run_id>``, in order (every process
    the supervisor starts, and what those start in turn: CRIU, runc, tar). The integration
    tests' leftover check uses it too."""
    needle = f"BELAYER_RUN_ID={run_id}".encode()
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            tagged = needle in (proc / "environ").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if tagged and process_alive(int(proc.name)):
            out.append(int(proc.name))
    return sorted(out)


def orphans(run_id: str, supervisor_pid: int | None, faulted: set[int]) -> list[str]:
    """Processes of the run that are nobody's: a faulted pid still alive, or a process of
    the run whose ancestors do not include the live supervisor (every process when the node
    was stopped). ``pid command`` each."""
    bad = {p for p in faulted if process_alive(p)}
    for pid in run_processes(run_id):
        p, seen = pid, 0
        while p > 1 and p != supervisor_pid and seen < 64:
            p, seen = _parent(p), seen + 1
        if not supervisor_pid or p != supervisor_pid:
            bad.add(pid)
    return [f"{pid} {_cmdline(pid)}" for pid in sorted(bad)]


def shm_files(run_id: str) -> set[str]:
    return {str(p) for p in SHM_DIR.glob(f"{shm_prefix(run_id)}*")}


def mapped_files() -> set[str]:
    """Every file some live process maps (``/proc/*/maps``)."""
    out: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for line in (proc / "maps").read_text().splitlines():
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[5].startswith(str(SHM_DIR)):
                    out.add(parts[5].removesuffix(" (deleted)"))
    return out


def leftover_shm(run_id: str, before: set[str], *, stopped: bool) -> list[str]:
    """The node's ``/dev/shm`` files that are nobody's: every one once the node was stopped;
    on a node left running, those made during the soak that no process maps."""
    now = shm_files(run_id)
    if stopped:
        return sorted(now)
    return sorted((now - before) - mapped_files())


def leftover_containers(run_id: str) -> list[str]:
    """Sandbox containers of the node (after it was stopped); none when dockerd is not there."""
    try:
        import docker

        from services.environment.client import node_label

        client = docker.DockerClient(version="auto", timeout=5)
    except Exception:  # no SDK or no daemon: no sandbox could have been made
        return []
    try:
        found = client.containers.list(
            all=True, filters={"label": f"belayer.node={node_label(run_id)}"}
        )
        return [c.id[:12] for c in found]
    except Exception:
        return []
    finally:
        client.close()
