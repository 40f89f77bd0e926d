"""``belayer bench serve``: what the serving path costs on this machine.

Measures, with the tiny model (hidden 256, 4 layers, vocab 4096):

1. the engine alone, in-process (tokens/s at batch 1 and 8, greedy, ``ignore_eos``), measured
   *before* the node starts so nothing competes for the CPU, in both engine modes (fast and
   deterministic, interleaved);
2. the full bus path (client → router → worker → router → client) on a real node started with
   the CLI in a temporary run directory: batch 1 = one request, batch 8 = eight concurrent
   requests on the one engine; tokens/s = generated tokens / wall time from submit to the last
   result; the loss against the engine alone. Two nodes, one after the other: ``belayer up
   --deterministic`` and ``--no-deterministic``, so the cost of deterministic mode is measured
   end to end in the same run (target: at least 50 % of the fast throughput at batch 8);
3. attaching a worker to the weights and KV arena in shared memory (the ``attach_s`` the worker
   reports in its ``worker_ready`` event, and the same steps timed here) against a cold load
   from safetensors (read the file, build the engine);
4. ``belayer up`` to ready, wall time.

Every measurement is repeated ``REPEATS`` times and the median is reported; each verdict reads
its value's 95 % bootstrap interval (over the runs; the attach time and ``up`` over the two
nodes). Alongside the
numbers the bus runs record where the time went (engine steps, time to first token, CPU seconds
of each process), so a miss can be explained from the JSON alone. The node is always stopped
with ``belayer down``, whatever happens.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import engine as engine_bench
from bench.engine import BATCHES, PROMPT_LEN, prompts
from bench.node import belayer
from bench.report import (
    Row,
    Target,
    machine_after,
    machine_info,
    publish,
    ratio,
    target_text,
    targets_json,
    timestamp,
)
from bench.report import progress as report_progress
from bench.stats import (
    Interval,
    ci_text,
    intervals_json,
    judge_all,
    median_interval,
    median_ratio,
    two_sample,
)

REPEATS = 3
"""Runs per measurement; the median is reported."""
ENGINE_ID = "e0"

TARGETS: dict[str, Target] = {
    **engine_bench.TARGETS,
    "bus_loss_b8": ("<=", 0.05),
    "bus_det_ratio_b8": (">=", 0.5),
    "attach_s": ("<=", 0.2),
    "up_s": ("<=", 15.0),
}
"""Metric → (comparison, bound). ``bus_loss_b8`` (fast node vs fast engine: the bus path keeps
at least 95 % of the engine's throughput) and ``bus_det_ratio_b8`` (deterministic node vs fast
node) are fractions (0.05 = 5 %)."""


def progress(message: str) -> None:
    """One progress line on stderr, ``[bench serve] …``."""
    report_progress("serve", message)


# --- 1. engine alone ---------------------------------------------------------------------------
def measure_engine(model_dir: Path, new_tokens: int) -> dict[str, Any]:
    """Median tokens/s of the in-process engine at each batch size over ``REPEATS`` runs."""
    return engine_bench.measure(model_dir, new_tokens, REPEATS, bench_name="serve")


# --- 3b. cold load -----------------------------------------------------------------------------
def measure_cold_load(model_dir: Path) -> dict[str, Any]:
    """Time to read the safetensors file and build an engine on it (imports already paid), as
    a cold worker restart does. Median over ``REPEATS`` runs."""
    import torch

    from model.config import load_model_config
    from model.loader import load_safetensors
    from model.qwen3 import kv_cache_shape
    from services.worker.engine.config import EngineConfig
    from services.worker.engine.llm_engine import LLMEngine

    load, total = [], []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        model_config = load_model_config(model_dir)
        params = load_safetensors(model_dir)
        t1 = time.perf_counter()
        config = EngineConfig()
        kv = torch.zeros(
            kv_cache_shape(model_config, config.num_blocks, config.block_size),
            dtype=model_config.dtype,
        )
        LLMEngine(model_config, params, kv, config)
        t2 = time.perf_counter()
        load.append(t1 - t0)
        total.append(t2 - t0)
    return {
        "load_safetensors_s": statistics.median(load),
        "cold_load_s": statistics.median(total),
        "runs": total,
    }


# --- 4. the node ------------------------------------------------------------------------------
def start_node(run_dir: Path, model_dir: Path, *extra: str) -> dict[str, Any]:
    """``belayer up --detach`` (plus ``extra`` flags); returns the up times and the node file."""
    t0 = time.monotonic()
    proc = belayer(
        "up", "--detach", "--run-dir", str(run_dir), "--engines", "1", "--model", str(model_dir),
        "--no-environment", *extra, timeout=240,
    )  # fmt: skip
    outside = time.monotonic() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"belayer up failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    match = re.search(r"ready in ([0-9.]+)s", proc.stdout)
    node = json.loads((run_dir / "node.json").read_text())
    return {
        "up_s": outside,
        "up_reported_s": float(match.group(1)) if match else None,
        "node": node,
    }


def stop_node(run_dir: Path) -> None:
    """``belayer down`` (idempotent; safe when ``up`` failed half-way)."""
    proc = belayer("down", "--run-dir", str(run_dir), timeout=90)
    if proc.returncode != 0:
        progress(f"belayer down failed ({proc.returncode}): {proc.stderr.strip()}")


def node_pids(run_dir: Path, node: dict[str, Any]) -> dict[str, int]:
    """Process ids of the node's services (from ``belayer status --json``) and NATS."""
    proc = belayer("status", "--json", "--run-dir", str(run_dir), timeout=30)
    pids = {"client": os.getpid()}
    if node.get("nats_pid"):
        pids["nats"] = int(node["nats_pid"])
    if proc.returncode == 0:
        for p in json.loads(proc.stdout)["procs"]:
            if p["pid"] and p["name"] in ("router", f"worker-{ENGINE_ID}"):
                pids["worker" if p["name"].startswith("worker") else "router"] = int(p["pid"])
    return pids


# --- CPU accounting (Linux /proc) -------------------------------------------------------------
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of ``pid``; empty if unreadable."""
    out: dict[int, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / _TICK
    return out


def cpu_snapshot(pids: dict[str, int]) -> dict[str, dict[int, float]]:
    return {name: thread_cpu(pid) for name, pid in pids.items()}


def cpu_delta(
    pids: dict[str, int], before: dict[str, dict[int, float]], after: dict[str, dict[int, float]]
) -> dict[str, float]:
    """CPU seconds per process between two snapshots; the worker is split into its asyncio
    (main) thread and its other threads (the engine loop)."""
    out: dict[str, float] = {}
    for name, pid in pids.items():
        b, a = before.get(name, {}), after.get(name, {})
        per = {tid: a[tid] - b.get(tid, 0.0) for tid in a}
        out[name] = sum(per.values())
        if name == "worker":
            out["worker_asyncio_thread"] = per.get(pid, 0.0)
            out["worker_engine_thread"] = out[name] - per.get(pid, 0.0)
    return {k: round(v, 3) for k, v in out.items()}


# --- 2. the bus path --------------------------------------------------------------------------
async def engine_steps(nc: Any) -> int:
    from common import subjects
    from common.bus import request
    from schemas.serving import Ping, PingReply

    pong: PingReply = await request(
        nc, subjects.engine_ping(ENGINE_ID), Ping(), PingReply, timeout=5
    )
    return pong.steps


async def bus_run(nc: Any, probe: Any, batch: int, new_tokens: int, vocab: int) -> dict[str, Any]:
    """``batch`` concurrent requests through the router; tokens/s from submit to last result
    (``probe``: a connection allowed to ping the engine, for its step count)."""
    from schemas.serving import GenerateRequest, SamplingParams, TokenDelta
    from services.router.client import generate

    sampling = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    tag = uuid.uuid4().hex[:8]
    reqs = [
        GenerateRequest(
            request_id=f"bench-{tag}-{i}", prompt_token_ids=ids, sampling=sampling, stream=True
        )
        for i, ids in enumerate(prompts(batch, vocab))
    ]
    first: dict[str, float] = {}
    deltas: dict[str, int] = {r.request_id: 0 for r in reqs}
    steps0 = await engine_steps(probe)
    t0 = time.perf_counter()

    def on_delta_for(rid: str) -> Callable[[TokenDelta], None]:
        def on_delta(_d: TokenDelta) -> None:
            first.setdefault(rid, time.perf_counter() - t0)
            deltas[rid] += 1

        return on_delta

    async def one(req: GenerateRequest) -> tuple[int, float]:
        res = await generate(nc, req, timeout=120, on_delta=on_delta_for(req.request_id))
        return len(res.token_ids), time.perf_counter() - t0

    done = await asyncio.gather(*(one(r) for r in reqs))
    wall = time.perf_counter() - t0
    tokens = sum(n for n, _ in done)
    return {
        "tok_s": tokens / wall,
        "wall_s": wall,
        "tokens": tokens,
        "engine_steps": await engine_steps(probe) - steps0,
        "first_token_s": sorted(round(first.get(r.request_id, -1.0), 4) for r in reqs),
        "last_result_s": sorted(round(t, 4) for _, t in done),
        "deltas_per_request": statistics.median(deltas.values()),
    }


async def measure_bus(
    nc: Any, probe: Any, new_tokens: int, vocab: int, pids: dict[str, int]
) -> dict[str, Any]:
    """Warm the path, then ``REPEATS`` rounds of batch 1 and batch 8; medians per batch."""
    for b in BATCHES:  # first-call costs (tokenizer decode, JetStream consumers, allocations)
        await bus_run(nc, probe, b, min(8, new_tokens), vocab)
    runs: dict[int, list[dict[str, Any]]] = {b: [] for b in BATCHES}
    for rep in range(REPEATS):
        for b in BATCHES:
            before = cpu_snapshot(pids)
            run = await bus_run(nc, probe, b, new_tokens, vocab)
            run["cpu_s"] = cpu_delta(pids, before, cpu_snapshot(pids))
            runs[b].append(run)
            progress(
                f"bus path run {rep + 1}/{REPEATS} batch {b}: {run['tok_s']:.0f} tok/s "
                f"({run['wall_s']:.3f} s, {run['engine_steps']} engine steps)"
            )
    return {
        "tok_s": {b: statistics.median(r["tok_s"] for r in v) for b, v in runs.items()},
        "runs": runs,
    }


# --- 3a. attach ------------------------------------------------------------------------------
async def worker_reported_timings(nc: Any) -> dict[str, float]:
    """``attach_s`` / ``build_warm_s`` from the worker's last ``worker_ready`` event."""
    from common import subjects
    from common.codec import decode
    from schemas.events import WorkerReady

    js = nc.jetstream()
    msg = await js.get_last_msg(subjects.STREAM_EVENTS, subjects.event(WorkerReady.kind))
    ev = decode(msg.data, WorkerReady)
    return {"attach_s": ev.attach_s, "build_warm_s": ev.build_warm_s}


async def measure_attach(nc: Any) -> dict[str, Any]:
    """The worker's attach steps, timed here against the running node: fetch the weight
    manifest, map the weights, fetch the arena descriptor, map the arena. Median of runs."""
    from services.kv.client import fetch_arena, map_arena
    from services.weights.client import fetch_manifest, map_weights

    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        manifest = await fetch_manifest(nc, timeout=10.0)
        params = map_weights(manifest)
        arena = map_arena(await fetch_arena(nc, ENGINE_ID, timeout=10.0))
        times.append(time.perf_counter() - t0)
        del params, arena  # drop the mappings before the node removes its files
    return {"attach_inprocess_s": statistics.median(times), "runs": times}


async def measure_node(
    url: str,
    new_tokens: int,
    vocab: int,
    pids: dict[str, int],
    *,
    attach: bool = True,
    run_dir: Path | None = None,
) -> dict[str, Any]:
    from common.bus import connect
    from common.config import RunPaths
    from common.node import resolve_bus

    # The node's client identity from its run directory (authentication is on).
    paths = RunPaths(run_dir) if run_dir else None
    _, identity = resolve_bus(url, paths=paths)
    # Only the router may ping an engine: the step count uses the router's
    # identity of this private node (the bench started it), the requests the client's.
    _, control = resolve_bus(url, role="router", paths=paths)
    nc = await connect(url, name="bench-serve", bus=identity, reconnect=False)
    probe = await connect(url, name="bench-serve-probe", bus=control, reconnect=False)
    try:
        progress("bus path: warming up")
        bus = await measure_bus(nc, probe, new_tokens, vocab, pids)
        reported = await worker_reported_timings(nc)
        if not attach:
            return {"bus": bus, "worker_reported": reported}
        progress("attach: reading the worker's worker_ready event and timing attach here")
        # attaching is what a worker does: with the engine's identity
        _, engine = resolve_bus(url, role=f"engine-{ENGINE_ID}", paths=paths)
        worker_nc = await connect(url, name="bench-serve-attach", bus=engine, reconnect=False)
        try:
            attached = await measure_attach(worker_nc)
        finally:
            await worker_nc.drain()
        return {"bus": bus, "worker_reported": reported, "attach": attached}
    finally:
        await probe.drain()
        await nc.drain()


# --- report ------------------------------------------------------------------------------------
def shown(value: float | None, unit: str) -> str:
    """A value with its unit as the table shows it."""
    if value is None:
        return "n/a"
    if unit == "%":
        return f"{value * 100:.1f} %"
    if unit == "tok/s":
        return f"{value:.0f} tok/s"
    if unit == "x":
        return f"{value:.1f}x"
    return f"{value:.3f} s" if value < 10 else f"{value:.1f} s"


def build_rows(r: dict[str, Any]) -> list[Row]:
    def row(metric: str, value: float | None, unit: str, key: str | None = None) -> Row:
        """A table row; ``key`` names its target (None: informational), judged on its
        interval (shown)."""
        if key is None:
            return Row(metric, shown(value, unit))
        interval = r["intervals"].get(key)
        text = shown(value, unit)
        if value is not None:
            text += ci_text(interval, lambda x: shown(x, unit))
        return Row(metric, text, target_text(TARGETS[key], unit), r["verdicts"].get(key, ""))

    eng, bus = r["engine_tok_s"], r["bus_tok_s"]
    eng_det, bus_det = r["engine_det_tok_s"], r["bus_det_tok_s"]
    return [
        row("engine alone, batch 1", eng["1"], "tok/s", "engine_tok_s_b1"),
        row("engine alone, batch 8", eng["8"], "tok/s", "engine_tok_s_b8"),
        row("engine alone, deterministic, batch 1", eng_det["1"], "tok/s"),
        row("engine alone, deterministic, batch 8", eng_det["8"], "tok/s"),
        row(
            "engine deterministic / fast, batch 8",
            r["engine_det_ratio"]["8"],
            "%",
            "engine_det_ratio_b8",
        ),
        row("bus path, batch 1", bus["1"], "tok/s"),
        row("bus path, batch 8", bus["8"], "tok/s"),
        row("bus loss, batch 1", r["bus_loss"]["1"], "%"),
        row("bus loss, batch 8", r["bus_loss"]["8"], "%", "bus_loss_b8"),
        row("bus path, --deterministic, batch 1", bus_det["1"], "tok/s"),
        row("bus path, --deterministic, batch 8", bus_det["8"], "tok/s"),
        row("bus --deterministic / fast, batch 1", r["bus_det_ratio"]["1"], "%"),
        row(
            "bus --deterministic / fast, batch 8", r["bus_det_ratio"]["8"], "%", "bus_det_ratio_b8"
        ),
        row("attach from shm (worker_ready)", r["attach_s"], "s", "attach_s"),
        row("attach from shm (timed here)", r["attach_inprocess_s"], "s"),
        row("cold load (safetensors + build)", r["cold_load_s"], "s"),
        row("cold load / attach", r["cold_over_attach"], "x"),
        row("belayer up → ready (outside)", r["up_s"], "s", "up_s"),
        row("belayer up → ready (reported)", r["up_reported_s"], "s"),
    ]


def summarize(
    new_tokens: int,
    engine: dict[str, Any],
    cold: dict[str, Any],
    up: dict[str, Any],
    node: dict[str, Any],
    node_det: dict[str, Any],
    machine_before: dict[str, Any],
    up_det: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The result: ``node`` is the fast (``--no-deterministic``) node's measurements (bus path,
    attach), ``node_det`` the deterministic node's bus path (and its worker's attach time);
    ``up``/``up_det`` the two nodes' start times."""
    eng = {str(b): v for b, v in engine["tok_s"].items()}
    bus = {str(b): v for b, v in node["bus"]["tok_s"].items()}
    eng_det = {str(b): v for b, v in engine["det_tok_s"].items()}
    bus_det = {str(b): v for b, v in node_det["bus"]["tok_s"].items()}
    attach = node["worker_reported"].get("attach_s", node["attach"]["attach_inprocess_s"])
    result: dict[str, Any] = {
        "bench": "serve",
        "timestamp": timestamp(),
        "unix_time": time.time(),
        "new_tokens": new_tokens,
        "prompt_tokens": PROMPT_LEN,
        "repeats": REPEATS,
        "model": engine_bench.TINY_MODEL,
        "engine_tok_s": eng,
        "bus_tok_s": bus,
        "bus_over_engine": {b: ratio(bus[b], eng[b]) for b in eng},
        "bus_loss": {b: 1.0 - (ratio(bus[b], eng[b]) or 0.0) for b in eng},
        "engine_det_tok_s": eng_det,
        "engine_det_ratio": {b: ratio(eng_det[b], eng[b]) for b in eng},
        "bus_det_tok_s": bus_det,
        "bus_det_loss": {b: 1.0 - (ratio(bus_det[b], eng_det[b]) or 0.0) for b in eng},
        "bus_det_ratio": {b: ratio(bus_det[b], bus[b]) for b in eng},
        "attach_s": attach,
        "attach_inprocess_s": node["attach"]["attach_inprocess_s"],
        "worker_reported": node["worker_reported"],
        "load_safetensors_s": cold["load_safetensors_s"],
        "cold_load_s": cold["cold_load_s"],
        "cold_over_attach": ratio(cold["cold_load_s"], attach),
        "up_s": up["up_s"],
        "up_reported_s": up["up_reported_s"],
        "targets": targets_json(TARGETS),
        "runs": {
            "engine_tok_s": {str(b): v for b, v in engine["runs"].items()},
            "engine_det_tok_s": {str(b): v for b, v in engine["det_runs"].items()},
            "bus": {str(b): v for b, v in node["bus"]["runs"].items()},
            "bus_det": {str(b): v for b, v in node_det["bus"]["runs"].items()},
            "attach_inprocess_s": node["attach"]["runs"],
            "cold_load_s": cold["runs"],
        },
        "machine": machine_after(machine_before),
    }
    reports = [n["worker_reported"]["attach_s"] for n in (node, node_det)
               if n.get("worker_reported", {}).get("attach_s") is not None]  # fmt: skip
    ups = [u["up_s"] for u in (up, up_det) if u is not None]
    result["runs"]["attach_reported_s"] = reports
    result["runs"]["up_s"] = ups
    values = {
        "engine_tok_s_b1": eng["1"],
        "engine_tok_s_b8": eng["8"],
        "bus_loss_b8": result["bus_loss"]["8"],
        "engine_det_ratio_b8": result["engine_det_ratio"]["8"],
        "bus_det_ratio_b8": result["bus_det_ratio"]["8"],
        "attach_s": attach,
        "up_s": up["up_s"],
    }
    intervals = serve_intervals(result["runs"])
    result["intervals"] = intervals_json(intervals)
    result["verdicts"] = judge_all(TARGETS, values, intervals)
    return result


def serve_intervals(runs: dict[str, Any]) -> dict[str, Interval | None]:
    """Each target's 95 % bootstrap interval: the engine's over its runs (``bench.engine``),
    the bus loss and the deterministic node's ratio over two independent samples (different
    processes, different nodes), the attach and up times over the two nodes."""
    tok = {b: [r["tok_s"] for r in v] for b, v in runs["bus"].items()}
    tok_det = {b: [r["tok_s"] for r in v] for b, v in runs["bus_det"].items()}
    out = engine_bench.engine_intervals(runs["engine_tok_s"], runs["engine_det_tok_s"])
    out["bus_loss_b8"] = two_sample(
        tok["8"], runs["engine_tok_s"]["8"],
        lambda a, b: 1.0 - statistics.median(a) / statistics.median(b),
    )  # fmt: skip
    out["bus_det_ratio_b8"] = median_ratio(tok_det["8"], tok["8"])
    out["attach_s"] = median_interval(runs.get("attach_reported_s", []))
    out["up_s"] = median_interval(runs.get("up_s", []))
    return out


def main(json_path: Path, new_tokens: int = 128) -> dict[str, Any]:
    """Run the whole benchmark (two minutes or so), print the table, write ``json_path``."""
    from model.tiny import init_tiny_model

    machine = {**machine_info(), "torch_threads_engine_bench": 1}
    progress(
        f"{machine['cpu_count']} CPUs, torch {machine['torch']}, "
        f"load average {machine['loadavg'][0] if machine['loadavg'] else '?'}"
    )
    with tempfile.TemporaryDirectory(prefix="belayer-bench-") as tmp:
        model_dir = init_tiny_model(Path(tmp) / "model")
        progress(f"engine alone: {REPEATS} runs of batch 1 and 8 per mode, {new_tokens} new tokens")
        engine = measure_engine(model_dir, new_tokens)
        progress("cold load: safetensors + engine build")
        cold = measure_cold_load(model_dir)
        nodes: dict[str, Any] = {}
        ups: dict[str, Any] = {}
        for flag in ("--no-deterministic", "--deterministic"):
            run_dir = Path(tmp) / f"run{flag}"
            try:
                progress(f"starting a node: belayer up --detach --engines 1 {flag}")
                started = start_node(run_dir, model_dir, flag)
                progress(
                    f"node ready in {started['up_s']:.1f} s "
                    f"(up reported {started['up_reported_s']} s)"
                )
                pids = node_pids(run_dir, started["node"])
                url, fast = started["node"]["nats_url"], flag == "--no-deterministic"
                nodes[flag] = asyncio.run(
                    measure_node(url, new_tokens, 4096, pids, attach=fast, run_dir=run_dir)
                )
                ups[flag] = started
            finally:
                progress("stopping the node: belayer down")
                with contextlib.suppress(Exception):
                    stop_node(run_dir)
    result = summarize(
        new_tokens,
        engine,
        cold,
        ups["--no-deterministic"],
        nodes["--no-deterministic"],
        nodes["--deterministic"],
        machine,
        up_det=ups["--deterministic"],
    )
    publish("serve", "belayer bench serve", build_rows(result), json_path, result)
    return result


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("bench-results/serve.json"))
