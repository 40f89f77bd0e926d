"""``belayer up``, ``down``, ``status``, ``events``: the node's lifecycle."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import typer

from common import events as event_types
from common import subjects
from common.auth import redact
from common.bus import js_call
from common.codec import decode
from common.config import RunPaths, config_argv
from common.errors import BelayerError, BusUnavailable, Timeout
from common.node import NodeInfo, read_node
from schemas.events import AnyEvent
from schemas.node import SupervisorStatus
from schemas.serving import RouterStatus
from services.cli.auth import preflight
from services.cli.common import fail, print_json, run, with_bus
from services.environment.client import keep_sandboxes, node_label, remove_node_sandboxes
from services.router.client import router_status
from services.supervisor.client import remove_shm_files, stop_node, supervisor_status
from services.supervisor.config import SupervisorConfig

NODE_DEFAULTS = SupervisorConfig()
"""``belayer up``'s defaults are the supervisor's (and its services') config defaults."""
CREDS_HELP = (
    "Credentials (nkey seed file) for an existing, secured deployment. Default: "
    "$BELAYER_CREDS, else the running node's client identity from its run dir."
)


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


def docker_usable(timeout: float = 3.0) -> bool:
    """Whether dockerd answers on its socket (then ``up`` runs the environment service)."""
    try:
        import docker

        client = docker.DockerClient(version="auto", timeout=int(max(1, timeout)))
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:  # no SDK, no socket, no daemon: no sandboxes
        return False


def up(
    engines: int = typer.Option(
        NODE_DEFAULTS.engines, "--engines", "-n", min=1, help="Rollout engines to start."
    ),
    detach: bool = typer.Option(
        False,
        "--detach",
        "-d",
        help="Return once the node is ready; it keeps running in the background.",
    ),
    recovery: str = typer.Option(
        NODE_DEFAULTS.recovery,
        help="belayer (shadow + token-level resume) or baseline (cold restart, regenerate).",
    ),
    model: str = typer.Option(
        NODE_DEFAULTS.model_dir,
        "--model",
        help="Hugging Face style model dir (default: a tiny random Qwen3 under the run dir).",
    ),
    nats_url: str = typer.Option(
        NODE_DEFAULTS.nats_url,
        "--nats-url",
        "--join",
        help="Join an existing NATS server or cluster (comma-separated URLs) instead of "
        "starting one; with --creds-dir its services connect as the identities there.",
    ),
    creds_dir: Path | None = typer.Option(
        None,
        "--creds-dir",
        help="Identity files of this node's services on an existing deployment "
        "(`belayer auth init`). Default: generated under the run dir for a local NATS.",
    ),
    role: str = typer.Option(
        NODE_DEFAULTS.role,
        "--role",
        help="node (every service) or env-host (only the environment service, joining a "
        "deployment with --join).",
    ),
    tls_cert: Path | None = typer.Option(
        None,
        "--tls-cert",
        help="This host's TLS certificate (PEM): the local NATS serves "
        "TLS with it and every service presents it as its client certificate.",
    ),
    tls_key: Path | None = typer.Option(None, "--tls-key", help="The key of --tls-cert (PEM)."),
    tls_ca: Path | None = typer.Option(
        None, "--tls-ca", help="CA (PEM) that signed every server's and client's certificate."
    ),
    replicas: int = typer.Option(
        NODE_DEFAULTS.bus.replicas,
        "--replicas",
        min=1,
        max=5,
        help="JetStream replicas of every stream and KV bucket (3 on a three-server cluster).",
    ),
    run_dir: Path | None = typer.Option(
        None,
        "--run-dir",
        help="Run directory (node file, logs, NATS store). Default: $BELAYER_HOME or ./.belayer.",
    ),
    training: bool = typer.Option(
        NODE_DEFAULTS.training,
        "--training/--no-training",
        help="Also run the GRPO trainer (consumes finished trajectories, pushes new weights); "
        "`belayer run` uses it.",
    ),
    environment: bool | None = typer.Option(
        None,
        "--environment/--no-environment",
        help="Run the sandbox service (needs dockerd + CRIU from deploy/setup.sh). Default: on "
        "when dockerd answers.",
    ),
    token_log_chunk: int = typer.Option(
        NODE_DEFAULTS.router.token_log_chunk,
        "--token-log-chunk",
        min=1,
        help="k: tokens per durable token-log chunk.",
    ),
    max_num_seqs: int = typer.Option(
        NODE_DEFAULTS.worker.engine.max_num_seqs,
        "--max-num-seqs",
        min=1,
        help="Decode batch limit per engine.",
    ),
    deterministic: bool = typer.Option(
        NODE_DEFAULTS.worker.engine.deterministic,
        "--deterministic/--no-deterministic",
        help="Batch-invariant inference: a seeded request's tokens depend only on the weights, "
        "prompt, sampling and seed, so sampled requests resume exactly after a failure.",
    ),
    failure_window: float = typer.Option(
        NODE_DEFAULTS.router.failure_window_s,
        "--failure-window",
        min=0.0,
        help="Seconds: a second failure of an engine inside this window marks it unhealthy.",
    ),
    heartbeat_interval: float = typer.Option(
        NODE_DEFAULTS.router.heartbeat_interval_s,
        "--heartbeat-interval",
        min=0.01,
        help="Seconds between the router's remote heartbeat pings (the baseline's detector).",
    ),
    hang_threshold: float = typer.Option(
        NODE_DEFAULTS.worker.hang_threshold_s,
        "--hang-threshold",
        min=0.01,
        help="Seconds: a main worker whose heartbeat is older than this counts as hung.",
    ),
    handover_timeout: float = typer.Option(
        NODE_DEFAULTS.handover_timeout_s,
        "--handover-timeout",
        min=0.0,
        help="Seconds a shadow's handover may take before the main worker is restarted cold.",
    ),
    timeout: float = typer.Option(
        NODE_DEFAULTS.ready_timeout_s, help="Seconds to wait for the node to become ready."
    ),
) -> None:
    """Start a Belayer node: NATS (JetStream), weight store, KV arena, router, workers."""
    if recovery not in ("belayer", "baseline"):
        fail("--recovery must be 'belayer' or 'baseline'", 2)
    if role not in ("node", "env-host"):
        fail("--role must be 'node' or 'env-host'", 2)
    if role == "env-host" and not nats_url:
        fail("--role env-host joins an existing deployment: give --join URL", 2)
    paths = run_paths(run_dir)
    node = read_node(paths)
    if node is not None and pid_alive(node.supervisor_pid):
        fail(
            f"a node is already running from {paths.root} (supervisor pid {node.supervisor_pid}); run `belayer down` first"
        )
    d = NODE_DEFAULTS
    try:
        bus = dataclasses.replace(
            d.bus,
            tls_cert=str(tls_cert.resolve()) if tls_cert else "",
            tls_key=str(tls_key.resolve()) if tls_key else "",
            tls_ca=str(tls_ca.resolve()) if tls_ca else "",
            replicas=replicas,
        )
    except ValueError as exc:  # e.g. a certificate without its key
        fail(str(exc), 2)
    config = dataclasses.replace(
        d,
        run_dir=str(paths.root),
        nats_url=nats_url,
        model_dir=str(Path(model).resolve()) if model else "",
        engines=engines,
        training=training,
        environment=(
            True if role == "env-host" else docker_usable() if environment is None else environment
        ),
        creds_dir=str(creds_dir.resolve()) if creds_dir else "",
        role="env-host" if role == "env-host" else "node",
        bus=bus,
        handover_timeout_s=handover_timeout,
        ready_timeout_s=timeout,
        router=dataclasses.replace(
            d.router,
            recovery="baseline" if recovery == "baseline" else "belayer",
            token_log_chunk=token_log_chunk,
            failure_window_s=failure_window,
            heartbeat_interval_s=heartbeat_interval,
        ),
        worker=dataclasses.replace(
            d.worker,
            hang_threshold_s=hang_threshold,
            engine=dataclasses.replace(
                d.worker.engine, max_num_seqs=max_num_seqs, deterministic=deterministic
            ),
        ),
    )
    preflight(config)  # bad credentials, TLS files or cluster URL: one line, nothing started
    argv = [sys.executable, "-m", "services.supervisor", *config_argv(config)]
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
    t0 = time.monotonic()
    node = launch(config, paths, timeout)
    typer.echo(
        f"belayer node ready in {time.monotonic() - t0:.1f}s: nats {node.nats_url}, "
        f"engines {', '.join(node.engines) or 'none'}, recovery {node.recovery}, "
        f"role {node.role}, run dir {paths.root}"
    )


def launch(config: SupervisorConfig, paths: RunPaths, timeout: float) -> NodeInfo:
    """Start the supervisor of ``config`` in its own session (``belayer up --detach``) and
    wait until its node file says ready; a start that fails or times out is one ``error:``
    line and exit 1 (``belayer run`` starts its node with this too)."""
    argv = [sys.executable, "-m", "services.supervisor", *config_argv(config)]
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
                tail = redact(f.read().decode(errors="replace")[-3000:])
            reason = [ln for ln in tail.splitlines() if ln.startswith("error: ")]
            if reason:  # the supervisor's own one-line reason
                fail(f"the node failed to start: {reason[-1].removeprefix('error: ')}")
            fail(f"the node failed to start (exit {proc.returncode}):\n{tail}")
        if time.monotonic() - t0 > timeout:
            proc.terminate()
            fail(f"the node was not ready after {timeout:.0f} s; logs in {paths.logs}")
        time.sleep(0.05)  # polling the node file the supervisor writes when ready
    assert node is not None
    return node


def down(
    run_dir: Path | None = typer.Option(
        None, "--run-dir", help="Run directory of the node. Default: $BELAYER_HOME or ./.belayer."
    ),
    timeout: float = typer.Option(30.0, help="Seconds to wait for a graceful stop before killing."),
    keep: bool = typer.Option(
        False,
        "--keep-sandboxes",
        help="Keep the sandboxes (containers, checkpoints) for the next `belayer up` of this "
        "run directory to adopt.",
    ),
) -> None:
    """Stop the node: every service, NATS, shared-memory files, sandbox containers and their
    checkpoints (unless --keep-sandboxes). Idempotent."""
    paths = run_paths(run_dir)
    node = read_node(paths)
    if node is None:
        typer.echo("no node is running here")
        return
    keep_sandboxes(paths.root, keep)
    pid = node.supervisor_pid

    async def ask_stop(nc: Any) -> None:
        await stop_node(nc, "belayer down", timeout=3)

    if pid_alive(pid):
        try:
            if node.role != "node":  # a joined host: supervisor.stop is the deployment node's
                raise BusUnavailable("stopped by signal")
            asyncio.run(with_bus(node.nats_url, ask_stop, role="operator", paths=paths))
        except Exception:  # fall back to a signal if the bus is gone
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)  # waiting for the supervisor process to exit
        if pid_alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
    # A supervisor that died without its shutdown leaves the NATS server it started (its own
    # session's other processes die with it: PR_SET_PDEATHSIG).
    if node.nats_pid is not None and is_nats_server(node.nats_pid):
        stop_process(node.nats_pid, timeout=5.0)
    removed = remove_shm_files(node.run_id)
    # Sandboxes do not outlive their node; a killed environment service left them behind.
    cleanup = remove_node_sandboxes(node_label(node.run_id), paths.root)
    if cleanup.error:
        fail(
            f"could not remove the node's sandbox containers ({cleanup.error}); "
            "run `belayer down` again once dockerd answers"
        )
    with contextlib.suppress(FileNotFoundError):
        paths.node_file.unlink()
    sandboxes = (
        f", {cleanup.containers} sandbox containers and {cleanup.checkpoint_dirs} sandbox "
        "checkpoint dirs"
        if cleanup.containers or cleanup.checkpoint_dirs
        else ""
    )
    typer.echo(
        f"belayer node stopped (run {node.run_id}; {removed} leftover shm files{sandboxes} removed)"
    )
    if cleanup.kept:
        typer.echo(f"{cleanup.kept} sandboxes kept for the next `belayer up` of {paths.root}")


def stop_process(pid: int, timeout: float) -> None:
    """SIGTERM ``pid``, then SIGKILL if it still runs after ``timeout`` seconds."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)  # waiting for the process to exit
    if pid_alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def is_nats_server(pid: int) -> bool:
    """``pid`` is alive and runs nats-server (not some process that reused the pid)."""
    if not pid_alive(pid):
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"nats-server" in f.read()
    except OSError:
        return False


def status(
    json_out: bool = typer.Option(False, "--json", help="Machine-readable output."),
    nats_url: str = typer.Option("", "--nats-url", help="NATS URL (default: the running node's)."),
    run_dir: Path | None = typer.Option(
        None, "--run-dir", help="Run directory of the node. Default: $BELAYER_HOME or ./.belayer."
    ),
    creds: str = typer.Option("", "--creds", help=CREDS_HELP),
) -> None:
    """Show engines (id, epoch, worker pid, health), requests and services. While the router
    is restarting the node shows as degraded: engines as last known, never an error."""
    paths = run_paths(run_dir)
    node = read_node(paths)
    url = nats_url or (node.nats_url if node else "")
    if not url:
        fail("no Belayer node is running here: start one with `belayer up` or pass --nats-url")

    async def query(nc: Any) -> tuple[RouterStatus | None, SupervisorStatus | None, dict[str, int]]:
        try:
            rs: RouterStatus | None = await router_status(nc, timeout=3)
        except (BusUnavailable, Timeout):
            rs = None
        try:
            ss: SupervisorStatus | None = await supervisor_status(nc, timeout=2)
        except BelayerError:
            ss = None
        epochs = {} if rs is not None else await engine_epochs(nc)
        return rs, ss, epochs

    rs, ss, epochs = run(with_bus(url, query, creds=creds or None, paths=paths))
    procs: list[dict[str, Any]] = [msgspec.to_builtins(p) for p in ss.procs] if ss else []
    router_proc = next((p for p in procs if p["name"] == "router"), None)
    router = {
        "alive": rs is not None,
        "restarts": router_proc["restarts"] if router_proc else 0,
    }
    if rs is not None:
        engines = [msgspec.to_builtins(e) for e in rs.engines]
        mark_dead_workers(engines, procs if ss else None, local=node is not None)
    else:
        # Last known: epochs from the engine_epochs bucket, pids from the supervisor.
        pids = {p["name"]: p["pid"] for p in procs}
        engines = [
            {"id": eid, "epoch": ep, "worker_pid": pids.get(f"worker-{eid}"), "healthy": None}
            for eid, ep in sorted(epochs.items())
        ]
    out = {
        "nats_url": redact(url),
        "run_id": node.run_id if node else None,
        "recovery": node.recovery if node else None,
        "state": "ready" if rs is not None else "degraded",
        "router": router,
        "engines": engines,
        "inflight": rs.inflight if rs else None,
        "finished": rs.finished if rs else None,
        "token_log_chunk": rs.token_log_chunk if rs else None,
        "metrics": rs.metrics if rs else {},
        "procs": procs,
    }
    if json_out:
        print_json(out)
        return
    typer.echo(
        f"nats {url}  run {out['run_id']}  recovery {out['recovery']}  state {out['state']}  "
        f"inflight {out['inflight']}  finished {out['finished']}"
    )
    if rs is None:
        typer.echo(
            f"router restarting (restarts so far: {router['restarts']}): engines as last known; "
            "requests in flight resume when it is back"
        )
    typer.echo(f"{'engine':8} {'epoch':>5} {'pid':>8} {'healthy':>7} {'running':>7} {'weights':>7}")
    for e in engines:
        typer.echo(
            f"{e['id']:8} {e['epoch']:>5} {e['worker_pid']!s:>8} {e['healthy']!s:>7} "
            f"{e.get('running', '-')!s:>7} {e.get('weight_version', '-')!s:>7}"
        )
    for p in procs:
        typer.echo(f"  {p['name']:14} pid {p['pid']}  alive {p['alive']}  restarts {p['restarts']}")


def mark_dead_workers(
    engines: list[dict[str, Any]], procs: list[dict[str, Any]] | None, *, local: bool
) -> None:
    """Never show a dead pid as healthy: an engine whose worker pid is not a live process of
    the node (the supervisor's table; without it, this host's, for a local node) is shown
    down, whatever the router last heard."""
    if procs is not None:
        live = {p["pid"] for p in procs if p["alive"]}
        gone = [e for e in engines if e["worker_pid"] not in live]
    elif local:
        gone = [e for e in engines if not pid_alive(e["worker_pid"])]
    else:
        return
    for e in gone:
        if e["healthy"]:
            e["healthy"], e["state"] = False, "down"


async def engine_epochs(nc: Any) -> dict[str, int]:
    """Every engine's epoch from the ``engine_epochs`` KV bucket ({} if unreadable)."""
    try:
        kv = await nc.jetstream().key_value(subjects.BUCKET_ENGINE_EPOCHS)
        keys = await kv.keys()
    except Exception:  # no bucket yet, or JetStream unavailable: nothing is known
        return {}
    out: dict[str, int] = {}
    for key in keys:
        with contextlib.suppress(Exception):
            entry = await kv.get(key)
            out[key] = int(entry.value or b"0")
    return out


def events(
    follow: bool = typer.Option(True, "--follow/--no-follow", help="Keep printing new events."),
    json_out: bool = typer.Option(False, "--json", help="One JSON object per line."),
    kind: str = typer.Option("", "--kind", help="Only this event kind (e.g. handover_ready)."),
    nats_url: str = typer.Option("", "--nats-url", help="NATS URL (default: the running node's)."),
    duration: float = typer.Option(
        0.0, "--for", help="Stop following after this many seconds (0: until Ctrl-C)."
    ),
    creds: str = typer.Option("", "--creds", help=CREDS_HELP),
) -> None:
    """Print lifecycle and recovery events (from the start of the EVENTS stream)."""

    async def tail(nc: Any) -> None:
        js = nc.jetstream()
        subject = subjects.event(kind) if kind else subjects.EVENTS_ALL
        what = "cannot read EVENTS"
        sub = await js_call(lambda: js.subscribe(subject, ordered_consumer=True), what=what)
        info = await js_call(lambda: js.stream_info(subjects.STREAM_EVENTS), what=what)
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
            try:
                ev = decode(msg.data, AnyEvent)
            except BelayerError as exc:  # an older or newer event type than this CLI knows
                typer.echo(f"? {msg.subject}: {exc}", err=True)
                continue
            if json_out:
                print_json_line({"kind": ev.kind, **msgspec.to_builtins(ev)})
            else:
                stamp = (
                    time.strftime("%H:%M:%S", time.localtime(ev.ts))
                    + f".{int(ev.ts * 1000) % 1000:03d}"
                )
                typer.echo(f"{stamp} {event_types.describe(ev)}")

    run(with_bus(nats_url or None, tail, creds=creds or None))


def print_json_line(obj: Any) -> None:
    import json

    sys.stdout.write(json.dumps(obj, default=str) + "\n")
    sys.stdout.flush()
