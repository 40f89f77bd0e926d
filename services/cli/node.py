"""``belayer up``, ``down``, ``status``, ``events``: the node's lifecycle."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, NoReturn, TypeGuard

import msgspec
import typer

from belayer.api import AsyncNode
from belayer.observe import UnknownEvent
from common import events as event_types
from common.auth import BusConfig
from common.config import RunPaths, config_argv
from common.device import DEVICE_CHOICES, DeviceChoice, resolve_device
from common.errors import BelayerError
from common.heartbeat import process_alive
from common.node import read_node
from services.cli.auth import preflight
from services.cli.shared import (
    check_model,
    fail,
    print_json,
    run,
    terminate_as_interrupt,
    with_bus,
)
from services.rl.node import NodeFailed, docker_usable, launch, shut_down
from services.rl.run import run_paths
from services.supervisor.config import SupervisorConfig, parse_engine_host
from services.worker.config import WorkerConfig
from services.worker.engine.backend import BACKENDS, EngineBackendName, check_backend
from workloads import plugins
from workloads.registry import load_workload
from workloads.rewards import load_reward_functions

NODE_DEFAULTS = SupervisorConfig()
"""``belayer up``'s defaults are the supervisor's (and its services') config defaults."""
CREDS_HELP = (
    "Credentials (nkey seed file) for an existing, secured deployment. Default: "
    "$BELAYER_CREDS, else the running node's client identity from its run dir."
)


# `belayer up`'s options (declared here, so that `up` reads as what it does)
UP_ENGINES = typer.Option(
    NODE_DEFAULTS.engines, "--engines", "-n", min=1, help="Rollout engines to start."
)
UP_DETACH = typer.Option(
    False,
    "--detach",
    "-d",
    help="Return once the node is ready; it keeps running in the background.",
)
UP_RECOVERY = typer.Option(
    NODE_DEFAULTS.recovery,
    help="belayer (shadow + token-level resume) or baseline (cold restart, regenerate).",
)
UP_MODEL = typer.Option(
    NODE_DEFAULTS.model_dir,
    "--model",
    help="Hugging Face style model dir (default: a tiny random Qwen3 under the run dir).",
)
UP_NATS_URL = typer.Option(
    NODE_DEFAULTS.nats_url,
    "--nats-url",
    "--join",
    help="Join an existing NATS server or cluster (comma-separated URLs) instead of "
    "starting one; with --creds-dir its services connect as the identities there.",
)
UP_CREDS_DIR = typer.Option(
    None,
    "--creds-dir",
    "--creds",
    help="Identity files of this node's services on an existing deployment "
    "(`belayer auth init`): their directory, or one file of it (e.g. --creds "
    "DIR/NAME/host.nk of a host). Default: generated under the run dir for a local NATS.",
)
UP_ROLE = typer.Option(
    NODE_DEFAULTS.role,
    "--role",
    help="node (every service), env-host (only the environment service) or engine-host "
    "(--engines rollout engines with this host's own weight store and KV arena); a host "
    "joins a deployment with --join.",
)
UP_HOST_NAME = typer.Option(
    NODE_DEFAULTS.host_name,
    "--host-name",
    help="--role engine-host: this host's name, as the node's --engine-host NAME:N gives it.",
)
UP_ENGINE_HOST = typer.Option(
    None,
    "--engine-host",
    help="NAME:N: an engine host that may join this node with N engines (NAME-e0 …), routed "
    "by its router; a local NATS makes its identities under <run dir>/auth/NAME (repeatable).",
)
UP_TLS_CERT = typer.Option(
    None,
    "--tls-cert",
    help="This host's TLS certificate (PEM): the local NATS serves "
    "TLS with it and every service presents it as its client certificate.",
)
UP_TLS_KEY = typer.Option(None, "--tls-key", help="The key of --tls-cert (PEM).")
UP_TLS_CA = typer.Option(
    None, "--tls-ca", help="CA (PEM) that signed every server's and client's certificate."
)
UP_REPLICAS = typer.Option(
    NODE_DEFAULTS.bus.replicas,
    "--replicas",
    min=1,
    max=5,
    help="JetStream replicas of every stream and KV bucket (3 on a three-server cluster).",
)
UP_RUN_DIR = typer.Option(
    None,
    "--run-dir",
    help="Run directory (node file, logs, NATS store). Default: $BELAYER_HOME or ./.belayer.",
)
UP_TRAINING = typer.Option(
    NODE_DEFAULTS.training,
    "--training/--no-training",
    help="Also run the GRPO trainer (consumes finished trajectories, pushes new weights); "
    "`belayer run` uses it.",
)
UP_TRAINER_PROCS = typer.Option(
    NODE_DEFAULTS.trainer.procs,
    "--trainer-procs",
    min=1,
    max=64,
    help="Data-parallel ranks of the trainer's update (torch.distributed, gloo on CPU): each "
    "computes its share of every micro-batch, gradients are summed, rank 0 checkpoints and "
    "pushes; a rank that dies restarts the trainer from its checkpoint. With --training.",
)
UP_ENVIRONMENT = typer.Option(
    None,
    "--environment/--no-environment",
    help="Run the sandbox service (needs dockerd + CRIU from deploy/setup.sh). Default: on "
    "when dockerd answers.",
)
UP_TOKEN_LOG_CHUNK = typer.Option(
    NODE_DEFAULTS.router.token_log_chunk,
    "--token-log-chunk",
    min=1,
    help="k: tokens per durable token-log chunk.",
)
UP_DEVICE = typer.Option(
    NODE_DEFAULTS.worker.device,
    "--device",
    help="Where the engines and the trainer compute: cpu, cuda (refused without a CUDA device; "
    "with the belayer engine add --no-deterministic) or auto (cuda when there is one).",
)
UP_ENGINE_BACKEND = typer.Option(
    NODE_DEFAULTS.worker.engine_backend,
    "--engine-backend",
    help="The engine behind each worker: belayer, or sglang (GPU nodes: --device cuda and the "
    "sglang package).",
)
UP_MAX_NUM_SEQS = typer.Option(
    NODE_DEFAULTS.worker.engine.max_num_seqs,
    "--max-num-seqs",
    min=1,
    help="Decode batch limit per engine.",
)
UP_DETERMINISTIC = typer.Option(
    NODE_DEFAULTS.worker.engine.deterministic,
    "--deterministic/--no-deterministic",
    help="Batch-invariant inference: a seeded request's tokens depend only on the weights, "
    "prompt, sampling and seed, so sampled requests resume exactly after a failure.",
)
UP_FAILURE_WINDOW = typer.Option(
    NODE_DEFAULTS.router.failure_window_s,
    "--failure-window",
    min=0.0,
    help="Seconds: a second failure of an engine inside this window marks it unhealthy.",
)
UP_HEARTBEAT_INTERVAL = typer.Option(
    NODE_DEFAULTS.router.heartbeat_interval_s,
    "--heartbeat-interval",
    min=0.01,
    help="Seconds between the router's remote heartbeat pings (the baseline's detector).",
)
UP_HANG_THRESHOLD = typer.Option(
    NODE_DEFAULTS.worker.hang_threshold_s,
    "--hang-threshold",
    min=0.01,
    help="Seconds: a main worker whose heartbeat is older than this counts as hung.",
)
UP_HANDOVER_TIMEOUT = typer.Option(
    NODE_DEFAULTS.handover_timeout_s,
    "--handover-timeout",
    min=0.0,
    help="Seconds a shadow's handover may take before the main worker is restarted cold.",
)
UP_REWARD_FUNCTION = typer.Option(
    None,
    "--reward-function",
    help="A reward function rollouts may name (belayer rollout --reward), as "
    "package.module:function (repeatable; importable like --workload-plugin).",
)
UP_METRICS_PORT = typer.Option(
    -1,
    "--metrics-port",
    min=-1,
    max=65535,
    help="Serve the node's Prometheus metrics at http://127.0.0.1:PORT/metrics (0: any free "
    "port, written to node.json as metrics_url; -1: off).",
)
UP_WORKLOAD_PLUGIN = typer.Option(
    None,
    "--workload-plugin",
    help="A workload plugin the node's controller may load, as package.module:factory "
    "(repeatable; the module must be importable: installed, or on PYTHONPATH). Installed "
    "packages' belayer.workloads entry points need no listing.",
)
UP_TIMEOUT = typer.Option(
    NODE_DEFAULTS.ready_timeout_s, help="Seconds to wait for the node to become ready."
)


def identity_dir(path: Path | None) -> str:
    """``--creds-dir DIR`` or ``--creds FILE``: the directory of a host's identity files (a
    file's own directory), absolute; "" when none was given."""
    if path is None:
        return ""
    path = path.resolve()
    return str(path.parent if path.is_file() else path)


def up(
    engines: int = UP_ENGINES,
    detach: bool = UP_DETACH,
    recovery: str = UP_RECOVERY,
    model: str = UP_MODEL,
    nats_url: str = UP_NATS_URL,
    creds_dir: Path | None = UP_CREDS_DIR,
    role: str = UP_ROLE,
    host_name: str = UP_HOST_NAME,
    engine_host: list[str] | None = UP_ENGINE_HOST,
    tls_cert: Path | None = UP_TLS_CERT,
    tls_key: Path | None = UP_TLS_KEY,
    tls_ca: Path | None = UP_TLS_CA,
    replicas: int = UP_REPLICAS,
    run_dir: Path | None = UP_RUN_DIR,
    training: bool = UP_TRAINING,
    trainer_procs: int = UP_TRAINER_PROCS,
    environment: bool | None = UP_ENVIRONMENT,
    token_log_chunk: int = UP_TOKEN_LOG_CHUNK,
    max_num_seqs: int = UP_MAX_NUM_SEQS,
    device: str = UP_DEVICE,
    engine_backend: str = UP_ENGINE_BACKEND,
    deterministic: bool = UP_DETERMINISTIC,
    failure_window: float = UP_FAILURE_WINDOW,
    heartbeat_interval: float = UP_HEARTBEAT_INTERVAL,
    hang_threshold: float = UP_HANG_THRESHOLD,
    handover_timeout: float = UP_HANDOVER_TIMEOUT,
    timeout: float = UP_TIMEOUT,
    workload_plugin: list[str] | None = UP_WORKLOAD_PLUGIN,
    metrics_port: int = UP_METRICS_PORT,
    reward_function: list[str] | None = UP_REWARD_FUNCTION,
) -> None:
    """Start a Belayer node: NATS (JetStream), weight store, KV arena, router, workers."""
    device_choice, backend = check_up_args(
        recovery, role, nats_url, host_name, device, engine_backend
    )
    if model:  # the router would fail reading it, after NATS had started
        check_model(Path(model), chat=False)
    paths = run_paths(run_dir)
    refuse_if_running(paths)
    bus = bus_config(tls_cert, tls_key, tls_ca, replicas)
    plugin_specs = check_plugins(workload_plugin or [])
    reward_specs = check_reward_functions(reward_function or [])
    config = dataclasses.replace(
        NODE_DEFAULTS,
        run_dir=str(paths.root),
        nats_url=nats_url,
        model_dir=str(Path(model).resolve()) if model else "",
        engines=engines,
        training=training,
        trainer=dataclasses.replace(
            NODE_DEFAULTS.trainer, procs=trainer_procs, device=device_choice
        ),
        environment=(
            True if role == "env-host" else docker_usable() if environment is None else environment
        ),
        creds_dir=identity_dir(creds_dir),
        role=node_role(role),
        host_name=host_name,
        engine_hosts=check_engine_hosts(engine_host or []),
        bus=bus,
        handover_timeout_s=handover_timeout,
        metrics_port=metrics_port,
        ready_timeout_s=timeout,
        router=dataclasses.replace(
            NODE_DEFAULTS.router,
            recovery="baseline" if recovery == "baseline" else "belayer",
            token_log_chunk=token_log_chunk,
            failure_window_s=failure_window,
            heartbeat_interval_s=heartbeat_interval,
        ),
        worker=worker_config(hang_threshold, max_num_seqs, deterministic, device_choice, backend),
        controller=dataclasses.replace(
            NODE_DEFAULTS.controller, workload_plugins=plugin_specs, reward_functions=reward_specs
        ),
    )
    preflight(config)  # bad credentials, TLS files or cluster URL: one line, nothing started
    if not detach:
        run_in_foreground(config, paths)
    start_detached(config, paths, timeout)


def refuse_if_running(paths: RunPaths) -> None:
    """One node per run directory: a live supervisor there is a clear error."""
    node = read_node(paths)
    if node is not None and process_alive(node.supervisor_pid):
        fail(
            f"a node is already running from {paths.root} (supervisor pid {node.supervisor_pid}); run `belayer down` first"
        )


def check_plugins(specs: list[str]) -> tuple[str, ...]:
    """Load every ``--workload-plugin`` here first (the controller loads it again)."""
    for spec in specs:
        if not plugins.is_spec(spec):
            fail(f"--workload-plugin {spec!r}: expected package.module:factory")
    return preload("--workload-plugin", specs, load_workload)


def check_reward_functions(specs: list[str]) -> tuple[str, ...]:
    """Import every ``--reward-function`` here first."""
    return preload("--reward-function", specs, lambda spec: load_reward_functions([spec]))


def preload(flag: str, specs: list[str], load: Callable[[str], object]) -> tuple[str, ...]:
    """``load`` each spec now, so one that cannot be imported (or whose factory raises) is one
    clear error naming ``flag`` before anything starts; the specs, each once."""
    for spec in specs:
        try:
            load(spec)
        except BelayerError as exc:
            fail(f"{flag} {spec!r}: {exc}")
    return tuple(dict.fromkeys(specs))


def check_up_args(
    recovery: str,
    role: str,
    nats_url: str,
    host_name: str = "",
    device: str = "cpu",
    engine_backend: str = "belayer",
) -> tuple[DeviceChoice, EngineBackendName]:
    """The choices of ``belayer up`` that typer does not check: one line, exit 2; the device
    and engine backend, typed."""
    checked = check_device_args(device, engine_backend)
    if recovery not in ("belayer", "baseline"):
        fail("--recovery must be 'belayer' or 'baseline'", 2)
    if role not in ("node", "env-host", "engine-host"):
        fail("--role must be 'node', 'env-host' or 'engine-host'", 2)
    if role != "node" and not nats_url:
        fail(f"--role {role} joins an existing deployment: give --join URL", 2)
    if role == "engine-host" and not host_name:
        fail("--role engine-host needs --host-name (the node's --engine-host NAME:N)", 2)
    if role == "engine-host" and recovery != "belayer":
        fail("--role engine-host runs --recovery belayer (its shadows map its own store)", 2)
    return checked


def check_engine_hosts(specs: list[str]) -> tuple[str, ...]:
    """``--engine-host NAME:N`` each checked: one line, exit 2."""
    for spec in specs:
        try:
            parse_engine_host(spec)
        except ValueError as exc:
            fail(f"--engine-host {spec!r}: {exc}", 2)
    return tuple(specs)


def bus_config(
    tls_cert: Path | None, tls_key: Path | None, tls_ca: Path | None, replicas: int
) -> BusConfig:
    """The node's bus settings (TLS files resolved); a bad combination is one line, exit 2."""
    try:
        return dataclasses.replace(
            NODE_DEFAULTS.bus,
            tls_cert=str(tls_cert.resolve()) if tls_cert else "",
            tls_key=str(tls_key.resolve()) if tls_key else "",
            tls_ca=str(tls_ca.resolve()) if tls_ca else "",
            replicas=replicas,
        )
    except ValueError as exc:  # e.g. a certificate without its key
        fail(str(exc), 2)


def check_device_args(device: str, engine_backend: str) -> tuple[DeviceChoice, EngineBackendName]:
    """``--device`` and ``--engine-backend``: one line, exit 2, for a bad choice or one this
    machine cannot run (torch is imported only when a GPU is asked for); both, typed."""
    if not is_device_choice(device):
        fail(f"--device must be one of {', '.join(DEVICE_CHOICES)}, got {device!r}", 2)
    if not is_backend_name(engine_backend):
        fail(f"--engine-backend must be one of {', '.join(BACKENDS)}, got {engine_backend!r}", 2)
    if device == "cpu" and engine_backend == "belayer":
        return device, engine_backend
    try:
        check_backend(engine_backend, resolve_device(device))
    except ValueError as exc:
        fail(str(exc), 2)
    return device, engine_backend


def is_device_choice(value: str) -> TypeGuard[DeviceChoice]:
    """Whether ``value`` is a ``--device`` choice (then typed as the configs' field)."""
    return value in DEVICE_CHOICES


def is_backend_name(value: str) -> TypeGuard[EngineBackendName]:
    """Whether ``value`` is an ``--engine-backend`` name (then typed as the worker's field)."""
    return value in BACKENDS


def node_role(role: str) -> Literal["node", "env-host", "engine-host"]:
    """``--role`` (checked by :func:`check_up_args`) as the supervisor's type."""
    return "env-host" if role == "env-host" else "engine-host" if role == "engine-host" else "node"


def worker_config(
    hang_threshold: float,
    max_num_seqs: int,
    deterministic: bool,
    device: DeviceChoice = "cpu",
    engine_backend: EngineBackendName = "belayer",
) -> WorkerConfig:
    """The node's workers: the defaults with ``belayer up``'s worker and engine options
    (``device`` and ``engine_backend`` checked by :func:`check_device_args`)."""
    d = NODE_DEFAULTS.worker
    return dataclasses.replace(
        d,
        hang_threshold_s=hang_threshold,
        device=device,
        engine_backend=engine_backend,
        engine=dataclasses.replace(
            d.engine, max_num_seqs=max_num_seqs, deterministic=deterministic
        ),
    )


def run_in_foreground(config: SupervisorConfig, paths: RunPaths) -> NoReturn:
    """The supervisor as a child in the foreground until it exits (its status is the
    command's). Ctrl-C or SIGTERM drains it, also where the shell started this command with
    SIGINT ignored; a SIGKILL of this CLI stops it too (it watches this process,
    ``owner_pid``)."""
    config = dataclasses.replace(config, owner_pid=os.getpid())
    argv = [sys.executable, "-m", "services.supervisor", *config_argv(config)]
    typer.echo(f"starting Belayer node in the foreground ({paths.root}); Ctrl-C stops it")
    terminate_as_interrupt()
    # Own session: a terminal's Ctrl-C reaches only this CLI, which forwards exactly one
    # SIGTERM (a second signal would make the supervisor cancel instead of drain).
    proc = subprocess.Popen(argv, start_new_session=True)
    try:
        raise typer.Exit(proc.wait())
    except KeyboardInterrupt:
        typer.echo("stopping the node (draining services)…")
        proc.terminate()
        raise typer.Exit(proc.wait()) from None


def start_detached(config: SupervisorConfig, paths: RunPaths, timeout: float) -> None:
    """``belayer up --detach``: the node started in the background, one line once ready."""
    t0 = time.monotonic()
    try:
        node = launch(config, paths, timeout)
    except NodeFailed as exc:
        fail(str(exc))
    typer.echo(
        f"belayer node ready in {time.monotonic() - t0:.1f}s: nats {node.nats_url}, "
        f"engines {', '.join(node.engines) or 'none'}, recovery {node.recovery}, "
        f"role {node.role}, run dir {paths.root}"
    )


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
    try:
        stopped = shut_down(run_paths(run_dir), timeout=timeout, keep=keep)
    except NodeFailed as exc:
        fail(str(exc))
    for line in stopped.lines() if stopped else ["no node is running here"]:
        typer.echo(line)


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

    async def query(nc: Any) -> dict[str, Any]:
        return await AsyncNode.over(nc, url=url, run_dir=paths.root).status()

    out = run(with_bus(url, query, creds=creds or None, paths=paths))
    rs_alive, router = out["state"] == "ready", out["router"]
    engines, procs = out["engines"], out["procs"]
    if json_out:
        print_json(out)
        return
    typer.echo(
        f"nats {url}  run {out['run_id']}  recovery {out['recovery']}  state {out['state']}  "
        f"inflight {out['inflight']}  finished {out['finished']}"
    )
    if not rs_alive:
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
        history = AsyncNode.over(nc).history(kind, follow=follow, duration=duration)
        async for ev in history:
            if isinstance(ev, UnknownEvent):  # an older or newer event type than this CLI knows
                typer.echo(f"? {ev.subject}: {ev.error}", err=True)
            elif json_out:
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
