"""``belayer bench serve``: what the serving path costs on this machine.

Measures, with the tiny model (hidden 256, 4 layers, vocab 4096):

1. the engine alone, in-process (tokens/s at batch 1 and 8, greedy, ``ignore_eos``), measured
   *before* the node starts so nothing competes for the CPU, in both engine modes (fast and
   deterministic, interleaved);
2. the full bus path (client → router → worker → router → client) on a real node started with
   the CLI in a temporary run directory: batch 1 = one request, batch 8 = eight concurrent
   requests on the one engine; tokens/s = generated tokens / wall time from submit to the last
   result. Its loss is judged against an in-process engine of the node's mode that runs the
   same batch just before each bus run (``engine_alone_tok_s`` of each run): interleaved
   pairs, so a slow spell of the machine hits both sides (the engine-alone runs of 1. are
   minutes apart from the bus runs; the loss against them is ``bus_loss_unpaired``). Two
   nodes, one after the other: ``belayer up --deterministic`` and ``--no-deterministic``, so
   the cost of deterministic mode is measured end to end in the same run (target: at least
   50 % of the fast throughput at batch 8);
3. attaching a worker to the weights and KV arena in shared memory (the ``attach_s`` the worker
   reports in its ``worker_ready`` event, and the same steps timed here) against a cold load
   from safetensors (read the file, build the engine);
4. ``belayer up`` to ready, wall time.

Every measurement is repeated ``REPEATS`` times and the median is reported; each verdict reads
its value's 95 % bootstrap interval (over the runs; the attach time and ``up`` over the two
nodes). Alongside the
numbers the bus runs record where the time went (engine steps, time to first token, CPU seconds
of each process), so a miss can be explained from the JSON alone. The node is always stopped
with ``belayer down``, whatever happens. The result, its intervals and the table:
:mod:`bench.serve_report`.
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
from bench.engine import BATCHES, prompts
from bench.node import belayer
from bench.report import machine_info, publish
from bench.report import progress as report_progress
from bench.serve_report import REPEATS, build_rows, summarize

ENGINE_ID = "e0"


def progress(message: str) -> None:
    """One progress line on stderr, ``[bench serve] …``."""
    report_progress("serve", message)


# --- 1. engine alone ---------------------------------------------------------------------------
def measure_engine(model_dir: Path, new_tokens: int) -> dict[str, Any]:
    """Median tokens/s of the in-process engine at each batch size over ``REPEATS`` runs."""
    return engine_bench.measure(model_dir, new_tokens, REPEATS, bench_name="serve")


def engine_alone(model_dir: Path, new_tokens: int, deterministic: bool) -> Callable[[int], float]:
    """An in-process engine of one mode, built now (warmed up); the returned function runs one
    batch on it (one torch thread, greedy, ``ignore_eos``) and gives its tokens/s (wall)."""
    import torch

    from services.worker.engine.sequence import SamplingParams

    engine = engine_bench.bench_llm_engine(model_dir, new_tokens, max(BATCHES), deterministic)
    sampling = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)

    def run(batch: int) -> float:
        previous = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            start = time.perf_counter()
            out = engine.generate(prompts(batch, engine.model_config.vocab_size), sampling)
            return sum(len(o.token_ids) for o in out) / (time.perf_counter() - start)
        finally:
            torch.set_num_threads(previous)

    return run


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
    nc: Any,
    probe: Any,
    new_tokens: int,
    vocab: int,
    pids: dict[str, int],
    alone: Callable[[int], float] | None = None,
) -> dict[str, Any]:
    """Warm the path, then ``REPEATS`` rounds of batch 1 and batch 8; medians per batch.
    ``alone``: the same batch on an in-process engine of the node's mode (tokens/s), run just
    before each bus run (``engine_alone_tok_s`` of the run), so the bus loss is a ratio of
    interleaved pairs: a slow spell of the machine hits both sides."""
    for b in BATCHES:  # first-call costs (tokenizer decode, JetStream consumers, allocations)
        await bus_run(nc, probe, b, min(8, new_tokens), vocab)
    runs: dict[int, list[dict[str, Any]]] = {b: [] for b in BATCHES}
    for rep in range(REPEATS):
        for b in BATCHES:
            before_alone = alone(b) if alone is not None else None
            before = cpu_snapshot(pids)
            run = await bus_run(nc, probe, b, new_tokens, vocab)
            run["cpu_s"] = cpu_delta(pids, before, cpu_snapshot(pids))
            if before_alone is not None:
                run["engine_alone_tok_s"] = before_alone
            runs[b].append(run)
            paired = f", engine alone {before_alone:.0f}" if before_alone is not None else ""
            progress(
                f"bus path run {rep + 1}/{REPEATS} batch {b}: {run['tok_s']:.0f} tok/s "
                f"({run['wall_s']:.3f} s, {run['engine_steps']} engine steps){paired}"
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
    alone: Callable[[int], float] | None = None,
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
        bus = await measure_bus(nc, probe, new_tokens, vocab, pids, alone)
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
            alone = engine_alone(model_dir, new_tokens, flag == "--deterministic")
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
                    measure_node(
                        url, new_tokens, 4096, pids, attach=fast, run_dir=run_dir, alone=alone
                    )
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
