"""A real Belayer node for integration tests: started with the CLI (`belayer up --detach`) in a
temporary run directory, stopped with `belayer down`, checked for leftovers."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.soak_node import run_processes as run_id_processes
from common import subjects
from common.auth import BusConfig
from common.bus import connect
from common.codec import decode, encode, raise_error
from common.config import SHM_DIR, shm_prefix
from common.errors import BusUnavailable
from common.heartbeat import process_alive
from schemas.base import ErrorReply
from schemas.serving import (
    GenerateReply,
    GenerateRequest,
    GenerateResult,
    RouterStatus,
    SamplingParams,
    TokenDelta,
)

BELAYER = [sys.executable, "-m", "services.cli.main"]


def cli(
    *args: str, run_dir: Path, timeout: float = 120.0, check: bool = True
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "BELAYER_HOME": str(run_dir)}
    proc = subprocess.run(
        [*BELAYER, *args], capture_output=True, text=True, timeout=timeout, env=env, check=False
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"belayer {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
        )
    return proc


@dataclass
class Node:
    run_dir: Path
    nats_url: str
    run_id: str

    def bus(self, identity: str = "client") -> BusConfig:
        """Credentials of one of the node's identities (``client``, ``operator``, a service
        role, ``engine-e0``…) from its run directory, for a test's own connection."""
        return BusConfig(creds=str(self.run_dir / "auth" / f"{identity}.nk"))

    async def connect(self, name: str = "t", identity: str = "client") -> Any:
        """A connection to the node's bus as ``identity``."""
        return await connect(self.nats_url, name=name, bus=self.bus(identity))

    def status(self) -> dict:
        return json.loads(cli("status", "--json", run_dir=self.run_dir).stdout)

    def pids(self) -> dict[str, int]:
        return {p["name"]: p["pid"] for p in self.status()["procs"]}


def start_node(run_dir: Path, *args: str) -> Node:
    if "--environment" not in args and "--no-environment" not in args:
        args = (*args, "--no-environment")  # `up` runs it whenever dockerd answers: ask for it
    cli("up", "--detach", *args, run_dir=run_dir, timeout=180)
    info = json.loads((run_dir / "node.json").read_text())
    return Node(run_dir=run_dir, nats_url=info["nats_url"], run_id=info["run_id"])


def stop_node(node: Node) -> None:
    """`belayer down`, then prove nothing is left: no process of the node, no shm file."""
    cli("down", run_dir=node.run_dir, timeout=60)
    leftovers = list(SHM_DIR.glob(f"{shm_prefix(node.run_id)}*"))
    assert not leftovers, f"shared-memory files left behind: {leftovers}"
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    mine = [
        line
        for line in ps.splitlines()
        if str(node.run_dir) in line or node.nats_url.rsplit(":", 1)[1] in line
    ]
    assert not mine, f"processes left behind: {mine}"
    tagged = run_id_processes(node.run_id)
    assert not tagged, f"processes of run {node.run_id} left behind: {tagged}"


# --- chaos helpers: events as they happen, strict token streams, processes --------------------


@dataclass
class StreamRecord:
    """What one caller saw: every delta as sent, and the checks on it."""

    request_id: str
    tokens: list[int] = field(default_factory=list)
    """Tokens in order, each exactly once."""
    delta_times: list[float] = field(default_factory=list)
    """Unix time each delta carrying new tokens arrived."""
    overlaps: list[int] = field(default_factory=list)
    """Tokens re-sent (delta.start < tokens held), each time it happened."""
    result: GenerateResult | None = None
    mark: int | None = None
    """Tokens the caller held when a failure was injected (set by the test)."""
    _waiters: list[tuple[int, asyncio.Future[None]]] = field(default_factory=list)

    async def wait_tokens(self, n: int, timeout: float = 30.0) -> None:
        """Until the caller holds ≥ ``n`` tokens (or the request finished)."""
        if len(self.tokens) >= n or self.result is not None:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((n, fut))
        await asyncio.wait_for(fut, timeout)

    def _wake(self, finished: bool = False) -> None:
        keep = []
        for n, fut in self._waiters:
            if finished or len(self.tokens) >= n:
                if not fut.done():
                    fut.set_result(None)
            else:
                keep.append((n, fut))
        self._waiters = keep


async def stream_generate(
    nc: Any, req: GenerateRequest, *, timeout: float = 120.0, record: StreamRecord | None = None
) -> StreamRecord:
    """Like ``services.router.client.generate`` but strict about what the router sends: a gap
    fails, and a re-sent token (overlap) must equal the one already delivered — it is counted
    in ``overlaps`` so a test can bound (or forbid) it.

    ``timeout`` bounds the wait for *progress*, not the whole request: it fails once
    ``timeout`` seconds pass with no new token and no result, so a long request on a slow
    machine finishes as long as tokens keep arriving, and a stuck one still fails (naming how
    many tokens it held). The test's own timeout bounds the total."""
    rec = record or StreamRecord(req.request_id)
    inbox = nc.new_inbox()
    queue: asyncio.Queue[Any] = asyncio.Queue()

    async def cb(msg: Any) -> None:
        queue.put_nowait(msg)

    sub = await nc.subscribe(inbox, cb=cb)
    try:
        await nc.publish(subjects.router_generate(), encode(req), reply=inbox)
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(
                    f"{req.request_id}: no new token or result for {timeout} s "
                    f"(holding {len(rec.tokens)} of {req.sampling.max_tokens})"
                )
            try:
                msg = await asyncio.wait_for(queue.get(), remaining)
            except TimeoutError:
                continue
            if msg.headers and msg.headers.get("Status") == "503":
                raise BusUnavailable("no router is serving router.generate")
            reply = decode(msg.data, GenerateReply)
            if isinstance(reply, ErrorReply):
                raise_error(reply)
            elif isinstance(reply, TokenDelta):
                held = len(rec.tokens)
                assert reply.start <= held, f"{req.request_id}: gap {held} → {reply.start}"
                overlap = min(held - reply.start, len(reply.token_ids))
                if overlap:
                    rec.overlaps.append(overlap)
                    again = rec.tokens[reply.start : reply.start + overlap]
                    assert reply.token_ids[:overlap] == again, (
                        f"{req.request_id}: re-sent tokens differ from the delivered ones: "
                        f"start {reply.start}, held {held}, re-sent {reply.token_ids[:overlap]}, "
                        f"delivered {again}"
                    )
                fresh = reply.token_ids[overlap:]
                if fresh:
                    rec.tokens += fresh
                    rec.delta_times.append(time.time())
                    rec._wake()
                    deadline = time.monotonic() + timeout  # progress: the wait starts over
            else:
                assert isinstance(reply, GenerateResult)
                rec.result = reply
                rec._wake(finished=True)
                return rec
    finally:
        await sub.unsubscribe()


def node_processes(node: Node, needle: str = "") -> list[str]:
    """``pid args`` lines of this node's processes (optionally only those containing needle)."""
    ps = subprocess.run(["ps", "-eo", "pid,stat,args"], capture_output=True, text=True).stdout
    out = []
    for line in ps.splitlines()[1:]:
        pid, stat, args = line.split(None, 2)
        if str(node.run_dir) in args and needle in args and not stat.startswith("Z"):
            out.append(f"{pid} {args}")
    return out


def pid_gone(pid: int) -> bool:
    """True once ``pid`` no longer runs (gone, or a zombie waiting to be reaped)."""
    return not process_alive(pid)


def greedy(
    rid: str, prompt: str = "the quick brown fox", n: int = 24, **kw: Any
) -> GenerateRequest:
    """A greedy request of exactly ``n`` tokens."""
    return GenerateRequest(
        request_id=rid,
        prompt=prompt,
        sampling=SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
        **kw,
    )


def sampled(rid: str, prompt: str, n: int, seed: int, **kw: Any) -> GenerateRequest:
    """A sampled (temperature 1) request with an explicit seed, exactly ``n`` tokens."""
    return GenerateRequest(
        request_id=rid,
        prompt=prompt,
        sampling=SamplingParams(temperature=1.0, seed=seed, max_tokens=n, ignore_eos=True),
        **kw,
    )


async def router_status(nc: Any, timeout: float = 3.0) -> RouterStatus:
    """The router's status over the bus (faster than the CLI), through the router's client."""
    from services.router.client import router_status as status

    return await status(nc, timeout=timeout)


async def main_pids(nc: Any) -> dict[str, int]:
    """engine id → the pid of its current main worker, as the router knows it."""
    return {e.id: e.worker_pid for e in (await router_status(nc)).engines}


async def supervisor_pids(nc: Any) -> dict[str, int]:
    """process name → pid, from the supervisor."""
    from services.supervisor.client import supervisor_status

    st = await supervisor_status(nc, timeout=3)
    return {p.name: p.pid for p in st.procs if p.alive and p.pid}


async def wait_until(cond: Any, *, timeout: float, what: str, every: float = 0.05) -> None:
    """Poll the (sync or async) predicate ``cond`` until true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if asyncio.iscoroutine(got):
            got = await got
        if got:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting until {what}")
        await asyncio.sleep(every)  # bounded poll of an outside condition (a process, a status)


def log_lines(node: Node, name: str, event: str) -> list[dict[str, Any]]:
    """The JSON log lines named ``event`` in ``<run dir>/logs/<name>.jsonl``."""
    path = node.run_dir / "logs" / f"{name}.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("event") == event:
            out.append(rec)
    return out
