"""``belayer up``, ``down``, ``status``, ``events``: the node's lifecycle."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import typer

from common import subjects
from common.bus import request
from common.codec import decode
from common.config import RunPaths
from common.errors import BelayerError
from common.node import read_node
from schemas.base import Ok
from schemas.events import Event
from schemas.node import StopNode, SupervisorStatus, SupervisorStatusRequest
from schemas.serving import RouterStatus, StatusRequest
from services.cli.common import fail, print_json, run, with_bus
from services.supervisor.service import remove_shm_files


def run_paths(run_dir: Path | None) -> RunPaths:
    """``--run-dir`` if given, else ``$BELAYER_HOME``, else ``./.belayer``."""
    return RunPaths(run_dir.resolve()) if run_dir else RunPaths.default()


def pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of ours counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def up(
    engines: int = typer.Option(1, "--engines", "-n", min=1, help="Rollout engines to start."),
    detach: bool = typer.Option(
        False,
        "--detach",
        "-d",
        help="Return once the node is ready; it keeps running in the background.",
    ),
    recovery: str = typer.Option(
        "belayer",
        help="belayer (shadow + token-level resume) or baseline (cold restart, regenerate).",
    ),
    model: str = typer.Option(
        "",
        "--model",
        help="Hugging Face style model dir (default: a tiny random Qwen3 under the run dir).",
    ),
    nats_url: str = typer.Option(
        "", "--nats-url", help="Use an existing NATS server instead of starting one."
    ),
    run_dir: Path | None = typer.Option(
        None,
        "--run-dir",
        help="Run directory (node file, logs, NATS store). Default: $BELAYER_HOME or ./.belayer.",
    ),
    environment: bool = typer.Option(
        False,
        "--environment/--no-environment",
        help="Also run the sandbox service (needs dockerd + CRIU from deploy/setup.sh).",
    ),
    token_log_chunk: int = typer.Option(
        256, "--token-log-chunk", min=1, help="k: tokens per durable token-log chunk."
    ),
    max_num_seqs: int = typer.Option(
        16, "--max-num-seqs", min=1, help="Decode batch limit per engine."
    ),
    failure_window: float = typer.Option(
        60.0,
        "--failure-window",
        min=0.0,
        help="Seconds: a second failure of an engine inside this window marks it unhealthy.",
    ),
    heartbeat_interval: float = typer.Option(
        5.0,
        "--heartbeat-interval",
        min=0.01,
        help="Seconds between the router's remote heartbeat pings (the baseline's detector).",
    ),
    hang_threshold: float = typer.Option(
        2.0,
        "--hang-threshold",
        min=0.01,
        help="Seconds: a main worker whose heartbeat is older than this counts as hung.",
    ),
    handover_timeout: float = typer.Option(
        15.0,
        "--handover-timeout",
        min=0.0,
        help="Seconds a dead main worker waits for its shadow's handover before a cold restart.",
    ),
    timeout: float = typer.Option(120.0, help="Seconds to wait for the node to become ready."),
) -> None:
    """Start a Belayer node: NATS (JetStream), weight store, KV arena, router, workers."""
    if recovery not in ("belayer", "baseline"):
        fail("--recovery must be 'belayer' or 'baseline'", 2)
    paths = run_paths(run_dir)
    node = read_node(paths)
    if node is not None and pid_alive(node.supervisor_pid):
        fail(
            f"a node is already running from {paths.root} (supervisor pid {node.supervisor_pid}); run `belayer down` first"
        )
    argv = [
        sys.executable, "-m", "services.supervisor", "--run-dir", str(paths.root),
        "--engines", str(engines), "--recovery", recovery, "--token-log-chunk", str(token_log_chunk),
        "--max-num-seqs", str(max_num_seqs), "--failure-window", str(failure_window),
        "--heartbeat-interval", str(heartbeat_interval), "--hang-threshold", str(hang_threshold),
        "--handover-timeout", str(handover_timeout),
    ]  # fmt: skip
    if model:
        argv += ["--model-dir", str(Path(model).resolve())]
    if nats_url:
        argv += ["--nats-url", nats_url]
    if environment:
        argv.append("--environment")
    if not detach:
        typer.echo(f"starting Belayer node in the foreground ({paths.root}); Ctrl-C stops it")
        # Own session: a terminal's Ctrl-C reaches only this CLI, which forwards exactly one
        # SIGTERM (a second signal would make the supervisor cancel instead of drain).
        proc = subprocess.Popen(argv, start_new_session=True)
        try:
            raise typer.Exit(proc.wait())
        except KeyboardInterrupt:
            typer.echo("stopping the node (draining services)…")
            proc.terminate()
            raise typer.Exit(proc.wait()) from None
    paths.logs.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        paths.node_file.unlink()
    t0 = time.monotonic()
    out_log = paths.logs / "supervisor.out"
    offset = out_log.stat().st_size if out_log.exists() else 0
    with open(out_log, "ab") as out:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True, close_fds=True,
        )  # fmt: skip
    while True:
        node = read_node(paths)
        if node is not None and node.ready and node.supervisor_pid == proc.pid:
            break
        if proc.poll() is not None:
            with open(out_log, "rb") as f:
                f.seek(offset)
                tail = f.read().decode(errors="replace")[-3000:]
            fail(f"the node failed to start (exit {proc.returncode}):\n{tail}")
        if time.monotonic() - t0 > timeout:
            proc.terminate()
            fail(f"the node was not ready after {timeout:.0f} s; logs in {paths.logs}")
        time.sleep(0.05)  # polling the node file the supervisor writes when ready
    typer.echo(
        f"belayer node ready in {time.monotonic() - t0:.1f}s: nats {node.nats_url}, "
        f"engines {', '.join(node.engines)}, recovery {node.recovery}, run dir {paths.root}"
    )


def down(
    run_dir: Path | None = typer.Option(
        None, "--run-dir", help="Run directory of the node. Default: $BELAYER_HOME or ./.belayer."
    ),
    timeout: float = typer.Option(30.0, help="Seconds to wait for a graceful stop before killing."),
) -> None:
    """Stop the node: every service, NATS, shared-memory files. Idempotent."""
    paths = run_paths(run_dir)
    node = read_node(paths)
    if node is None:
        typer.echo("no node is running here")
        return
    pid = node.supervisor_pid

    async def ask_stop(nc: Any) -> None:
        await request(
            nc,
            subjects.supervisor_stop(),
            StopNode(reason="belayer down"),
            Ok,
            timeout=3,
        )

    if pid_alive(pid):
        try:
            asyncio.run(with_bus(node.nats_url, ask_stop))
        except Exception:  # fall back to a signal if the bus is gone
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)  # waiting for the supervisor process to exit
        if pid_alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
    removed = remove_shm_files(node.run_id)
    with contextlib.suppress(FileNotFoundError):
        paths.node_file.unlink()
    typer.echo(f"belayer node stopped (run {node.run_id}; {removed} leftover shm files removed)")


def status(
    json_out: bool = typer.Option(False, "--json", help="Machine-readable output."),
    nats_url: str = typer.Option("", "--nats-url", help="NATS URL (default: the running node's)."),
    run_dir: Path | None = typer.Option(
        None, "--run-dir", help="Run directory of the node. Default: $BELAYER_HOME or ./.belayer."
    ),
) -> None:
    """Show engines (id, epoch, worker pid, health), requests and services."""
    paths = run_paths(run_dir)
    node = read_node(paths)
    url = nats_url or (node.nats_url if node else "")
    if not url:
        fail("no Belayer node is running here: start one with `belayer up` or pass --nats-url")

    async def query(nc: Any) -> tuple[RouterStatus, SupervisorStatus | None]:
        rs = await request(nc, subjects.router_status(), StatusRequest(), RouterStatus, timeout=3)
        try:
            ss = await request(
                nc,
                subjects.supervisor_status(),
                SupervisorStatusRequest(),
                SupervisorStatus,
                timeout=2,
            )
        except BelayerError:
            ss = None
        return rs, ss

    rs, ss = run(with_bus(url, query))
    procs: list[dict[str, Any]] = [msgspec.to_builtins(p) for p in ss.procs] if ss else []
    out = {
        "nats_url": url,
        "run_id": node.run_id if node else None,
        "recovery": node.recovery if node else None,
        "engines": [msgspec.to_builtins(e) for e in rs.engines],
        "inflight": rs.inflight,
        "finished": rs.finished,
        "token_log_chunk": rs.token_log_chunk,
        "metrics": rs.metrics,
        "procs": procs,
    }
    if json_out:
        print_json(out)
        return
    typer.echo(
        f"nats {url}  run {out['run_id']}  recovery {out['recovery']}  inflight {rs.inflight}  finished {rs.finished}"
    )
    typer.echo(f"{'engine':8} {'epoch':>5} {'pid':>8} {'healthy':>7} {'running':>7} {'weights':>7}")
    for e in rs.engines:
        typer.echo(
            f"{e.id:8} {e.epoch:>5} {e.worker_pid:>8} {e.healthy!s:>7} {e.running:>7} {e.weight_version:>7}"
        )
    for p in procs:
        typer.echo(f"  {p['name']:14} pid {p['pid']}  alive {p['alive']}  restarts {p['restarts']}")


def events(
    follow: bool = typer.Option(True, "--follow/--no-follow", help="Keep printing new events."),
    json_out: bool = typer.Option(False, "--json", help="One JSON object per line."),
    kind: str = typer.Option("", "--kind", help="Only this event kind (e.g. handover_ready)."),
    nats_url: str = typer.Option("", "--nats-url", help="NATS URL (default: the running node's)."),
    duration: float = typer.Option(
        0.0, "--for", help="Stop following after this many seconds (0: until Ctrl-C)."
    ),
) -> None:
    """Print lifecycle and recovery events (from the start of the EVENTS stream)."""

    async def tail(nc: Any) -> None:
        js = nc.jetstream()
        subject = subjects.event(kind) if kind else subjects.EVENTS_ALL
        sub = await js.subscribe(subject, ordered_consumer=True)
        info = await js.stream_info(subjects.STREAM_EVENTS)
        pending = info.state.messages
        seen = 0
        deadline = time.monotonic() + duration if duration else None
        while True:
            if not follow and seen >= pending:
                return
            wait = 1.0 if deadline is None else max(0.0, deadline - time.monotonic())
            if deadline is not None and wait == 0.0:
                return
            try:
                msg = await sub.next_msg(timeout=min(wait, 1.0) if follow else 1.0)
            except TimeoutError:  # nats' TimeoutError subclasses the builtin one
                if not follow:
                    return
                continue
            seen += 1
            ev = decode(msg.data, Event)
            if json_out:
                print_json_line(msgspec.to_builtins(ev))
            else:
                stamp = (
                    time.strftime("%H:%M:%S", time.localtime(ev.ts))
                    + f".{int(ev.ts * 1000) % 1000:03d}"
                )
                extra = " ".join(f"{k}={v}" for k, v in ev.data.items())
                typer.echo(
                    f"{stamp} {ev.kind:24} {ev.source:14} {ev.engine_id or '':4} {ev.request_id or ''} {extra}"
                )

    run(with_bus(nats_url or None, tail))


def print_json_line(obj: Any) -> None:
    import json

    sys.stdout.write(json.dumps(obj, default=str) + "\n")
    sys.stdout.flush()
