"""``belayer bench handover``: what a rollout-worker failure costs, Belayer vs the baseline.

On a real 1-engine node (the tiny model, or ``--model DIR``: a pretrained one, with shorter
requests and fewer rounds, ``PRETRAINED``), for each failure: a streaming greedy request is running,
the main worker gets SIGKILL, and we time from the kill to

(a) detection — ``t_detect`` of the shadow's ``handover_detected`` (belayer), the router's
    ``engine_failed`` event (baseline: remote heartbeat every ``heartbeat_s``);
(b) a new worker ready — ``t_ready`` of ``handover_ready`` (belayer), the cold-started worker's
    ``worker_ready`` event (baseline);
(c) the first resumed token the streaming client sees (client clock, first new token after the
    kill);

plus tokens regenerated per failure (the router's ``requests_resumed`` event: ``held_tokens``
are handed to the new worker as prompt in belayer mode — 0 regenerated — and recomputed from
the prompt in baseline mode) and a correctness check (the caller's tokens equal an
uninterrupted run, each delivered once). Also: failure-free throughput at batch 8 with the
shadow running vs SIGSTOPped on the same node, interleaved (the target), and against a baseline
node (informational: separate runs), and the idle shadow's CPU share (/proc utime + stime over
a few idle seconds). Finally sampled-resume exactness in both engine modes: seeded sampled
requests, each with a greedy neighbour in flight, through a SIGKILL of the main worker, counted
exact when they end with the tokens of an uninterrupted run (made alone) — on the belayer node
(``--deterministic``) and on a second belayer node with ``--no-deterministic``. Every node is
stopped with ``belayer down``, whatever happens.

Each verdict reads a 95 % bootstrap interval (``bench.stats``): the latencies' percentiles over
the failures, the speed-up over the two modes' failures (independent samples), the shadow's
overhead over the interleaved pairs. Regenerated tokens and sampled-resume exactness are
invariants (every failure counted: one violation is a MISS), their intervals stated.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.node import belayer
from bench.report import (
    Row,
    Target,
    machine_after,
    machine_at_start,
    percentile,
    publish,
    target_text,
    targets_json,
    timestamp,
)
from bench.report import progress as report_progress
from bench.serve import stop_node
from bench.stats import (
    Interval,
    bootstrap,
    ci_text,
    intervals_json,
    judge_all,
    quantile_interval,
    two_sample,
)

if TYPE_CHECKING:
    from common.events import EventTail

ENGINE = "e0"
IDLE_WINDOW_S = 5.0


@dataclass(frozen=True)
class Sizes:
    """How long the requests are and how many rounds each measurement takes."""

    stream_tokens: int = 400
    """Tokens of the request that is interrupted (outlives a baseline recovery's start)."""
    kill_after: int = 24  # tokens the client holds when the worker is killed
    throughput_tokens: int = 128
    throughput_repeats: int = 3
    ab_tokens: int = 384  # per request in the shadow on/off pairs (long batches: less noise)
    ab_pairs: int = 7
    sampled_rounds: int = 5  # sampled requests put through a SIGKILL per engine mode
    sampled_tokens: int = 160
    hang_threshold_s: float = 2.0
    """``belayer up --hang-threshold``: a pretrained model's engine step on two loaded cores can
    take longer than 2 s, and its shadow would take over a main worker that is only slow."""


TINY = Sizes()  # the tiny model's: a few minutes
PRETRAINED = Sizes(
    stream_tokens=64, kill_after=16, throughput_tokens=32, throughput_repeats=2, ab_tokens=8,
    ab_pairs=3, sampled_rounds=2, sampled_tokens=48, hang_threshold_s=30.0,
)  # fmt: skip
"""``--model DIR``'s: a pretrained model is some thirty times slower a token than the tiny one
(SmolLM2-135M: docs/real-model.md); shorter requests and fewer rounds keep to minutes."""
BATCH = 8
_TICK = os.sysconf("SC_CLK_TCK")

TARGETS: dict[str, Target] = {
    "detect_p50_s": ("<=", 0.1),
    "detect_p99_s": ("<=", 0.2),
    "first_token_p50_s": ("<=", 1.0),
    "speedup_first_token": (">=", 10.0),
    "regenerated_tokens": ("<=", 0.0),
    "throughput_overhead": ("<=", 0.02),
    "sampled_exact_det": (">=", 1.0),
}
"""Metric → (comparison, bound); fractions for the overhead (0.02 = 2 %) and for the share of
sampled resumes that are exact in deterministic mode (1.0: all of them)."""
INVARIANTS = ("regenerated_tokens", "sampled_exact_det")
"""Targets judged on every trial (one violation is a MISS), not on an interval."""


def progress(message: str) -> None:
    """One progress line on stderr, ``[bench handover] …``."""
    report_progress("handover", message)


# --- node ---------------------------------------------------------------------------------------
def up(run_dir: Path, model_dir: Path, *args: str) -> dict[str, Any]:
    proc = belayer(
        "up", "--detach", "--run-dir", str(run_dir), "--engines", "1", "--model", str(model_dir),
        "--failure-window", "0", "--no-environment", *args, timeout=240,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"belayer up failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return json.loads((run_dir / "node.json").read_text())


def last_handover(events: Any) -> float:
    """Unix time of the last ``handover_complete`` (a newer ``shadow_ready`` means warm again)."""
    from schemas.events import HandoverComplete

    return max((e.ts for e in events.matching(HandoverComplete)), default=0.0)


async def main_pid(nc: Any) -> int:
    from services.router.client import router_status

    st = await router_status(nc, timeout=5)
    return next(e.worker_pid for e in st.engines if e.id == ENGINE)


def request(rid: str, n: int, offset: int = 0, seed: int | None = None) -> Any:
    """Greedy, or sampled at temperature 1 with ``seed``; exactly ``n`` tokens."""
    from schemas.serving import GenerateRequest, SamplingParams

    temperature = 0.0 if seed is None else 1.0
    return GenerateRequest(
        request_id=rid,
        prompt_token_ids=[(11 * j + 7 * offset + 3) % 4096 for j in range(16)],
        sampling=SamplingParams(temperature=temperature, seed=seed, max_tokens=n, ignore_eos=True),
    )


# --- measurements -----------------------------------------------------------------------------
async def batch_tok_s(nc: Any, n: int) -> float:
    """One batch of BATCH greedy requests of ``n`` tokens: tokens/s from submit to last result."""
    from services.router.client import generate

    tag = uuid.uuid4().hex[:8]
    t0 = time.perf_counter()
    done = await asyncio.gather(
        *(generate(nc, request(f"tp-{tag}-{i}", n, i), timeout=120) for i in range(BATCH))
    )
    return sum(len(r.token_ids) for r in done) / (time.perf_counter() - t0)


async def throughput(nc: Any, sizes: Sizes) -> dict[str, Any]:
    """Batch 8 of greedy requests, tokens/s from submit to the last result; median of runs."""
    await batch_tok_s(nc, 8)  # warm-up
    runs = [await batch_tok_s(nc, sizes.throughput_tokens) for _ in range(sizes.throughput_repeats)]
    return {"tok_s": statistics.median(runs), "runs": runs}


async def shadow_ab(nc: Any, sizes: Sizes) -> dict[str, Any]:
    """The shadow's cost on the same node, interleaved: batches with the shadow running vs
    SIGSTOPped (a stopped process uses no CPU: as if there were no shadow). Separate nodes
    measured minutes apart differ by more than the effect itself on this 2-core machine. A
    shadow paused past NATS's write deadline (10 s) can be replaced: keep pauses short."""
    with_s: list[float] = []
    without: list[float] = []
    for i in range(sizes.ab_pairs):
        pid = await shadow_pid(nc)
        for paused in (False, True) if i % 2 == 0 else (True, False):
            if paused:
                os.kill(pid, signal.SIGSTOP)
            try:
                tok_s = await batch_tok_s(nc, sizes.ab_tokens)
            finally:
                if paused:
                    with contextlib.suppress(ProcessLookupError):  # replaced meanwhile
                        os.kill(pid, signal.SIGCONT)
            (without if paused else with_s).append(tok_s)
    # Per-pair ratios cancel slow drifts of the machine; their median resists outliers.
    ratios = [w / wo for w, wo in zip(with_s, without, strict=True)]
    return {
        "with_shadow": with_s,
        "shadow_paused": without,
        "pair_ratios": ratios,
        "overhead": 1.0 - statistics.median(ratios),
    }


def proc_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


async def shadow_pid(nc: Any) -> int:
    from services.supervisor.client import supervisor_status

    st = await supervisor_status(nc, timeout=5)
    pid = next(p.pid for p in st.procs if p.name == f"shadow-{ENGINE}" and p.alive)
    assert pid is not None
    return pid


async def shadow_idle_cpu(nc: Any) -> dict[str, Any]:
    pid = await shadow_pid(nc)
    c0, t0 = proc_cpu_s(pid), time.monotonic()
    await asyncio.sleep(IDLE_WINDOW_S)  # the measurement window itself, not synchronisation
    c1, t1 = proc_cpu_s(pid), time.monotonic()
    return {"pid": pid, "cpu_s": c1 - c0, "window_s": t1 - t0, "share": (c1 - c0) / (t1 - t0)}


async def one_failure(
    nc: Any, events: EventTail, reference: list[int], i: int, *, baseline: bool, sizes: Sizes
) -> dict[str, Any]:
    """Kill the main worker while a request streams; time detection, ready, first token."""
    from schemas import events as ev
    from services.router.client import generate

    if not baseline:  # the shadow must be warm (it was respawned after the previous handover)
        await events.wait_for(ev.ShadowReady, after=last_handover(events), timeout=60)
    pid = await main_pid(nc)
    times: list[float] = []
    held = asyncio.Event()

    def on_delta(d: Any) -> None:
        times.extend([time.time()] * len(d.token_ids))
        if len(times) >= sizes.kill_after:
            held.set()

    task = asyncio.create_task(
        generate(nc, request(f"ho-{uuid.uuid4().hex[:8]}", sizes.stream_tokens), on_delta=on_delta,
                 timeout=180)
    )  # fmt: skip
    await asyncio.wait_for(held.wait(), 60)
    t_kill = time.time()
    os.kill(pid, signal.SIGKILL)
    if baseline:
        failed = await events.wait_for(ev.EngineFailedEvent, after=t_kill, timeout=60, pid=pid)
        t_detect = failed.ts
        ready = await events.wait_for(ev.WorkerReady, after=t_kill, timeout=120)
        t_ready = ready.ts
    else:
        done = await events.wait_for(ev.HandoverComplete, after=t_kill, timeout=60, old_pid=pid)
        t_detect, t_ready = done.t_detect, done.t_ready
    result = await task
    resumed = await events.wait_for(ev.RequestsResumed, after=t_kill, timeout=30)
    after_kill = [t for t in times if t > t_kill]
    held_tokens = resumed.held_tokens
    row = {
        "detect_s": t_detect - t_kill,
        "ready_s": t_ready - t_kill,
        "first_token_s": (after_kill[0] - t_kill) if after_kill else None,
        "held_tokens": held_tokens,
        "regenerated_tokens": held_tokens if baseline else 0,
        "correct": result.token_ids == reference and len(times) == sizes.stream_tokens,
        "resumes": result.resumes,
    }
    progress(
        f"{'baseline' if baseline else 'belayer'} failure {i + 1}: detect {row['detect_s']:.3f} s, "
        f"ready {row['ready_s']:.3f} s, first token {row['first_token_s'] or float('nan'):.3f} s, "
        f"regenerated {row['regenerated_tokens']}, correct {row['correct']}"
    )
    return row


async def one_sampled_resume(nc: Any, events: EventTail, i: int, sizes: Sizes) -> dict[str, Any]:
    """One seeded sampled request streaming next to a longer greedy neighbour, the main worker
    SIGKILLed once the client holds ``sizes.kill_after`` tokens, against the request run alone."""
    from schemas import events as ev
    from services.router.client import generate

    tag, seed, n = uuid.uuid4().hex[:8], 1000 + i, sizes.sampled_tokens
    reference = await generate(nc, request(f"sr-ref-{tag}", n, i, seed), timeout=120)
    await events.wait_for(ev.ShadowReady, after=last_handover(events), timeout=60)
    pid = await main_pid(nc)
    count = 0
    held = asyncio.Event()

    def on_delta(d: Any) -> None:
        nonlocal count
        count += len(d.token_ids)
        if count >= sizes.kill_after:
            held.set()

    neighbour = asyncio.create_task(
        generate(nc, request(f"sr-n-{tag}", n + 40, i + 50), timeout=180)
    )
    task = asyncio.create_task(
        generate(nc, request(f"sr-{tag}", n, i, seed), on_delta=on_delta, timeout=180)
    )
    await asyncio.wait_for(held.wait(), 60)
    t_kill = time.time()
    os.kill(pid, signal.SIGKILL)
    await events.wait_for(ev.HandoverComplete, after=t_kill, timeout=60, old_pid=pid)
    result, _ = await asyncio.gather(task, neighbour)
    pairs = zip(result.token_ids, reference.token_ids, strict=False)
    diff = next((j for j, (a, b) in enumerate(pairs) if a != b), None)
    return {
        "exact": result.token_ids == reference.token_ids,
        # Bitwise-equal logprobs: the logits were the same, not merely close enough to sample
        # the same token (a far more sensitive test of the continuation).
        "logprobs_exact": result.logprobs == reference.logprobs,
        "first_diff": diff,
        "resumes": result.resumes,
    }


async def sampled_resumes(nc: Any, events: EventTail, sizes: Sizes) -> dict[str, Any]:
    """``rounds`` of :func:`one_sampled_resume`: how many end exactly as the request alone."""
    rows, rounds = [], sizes.sampled_rounds
    for i in range(rounds):
        row = await one_sampled_resume(nc, events, i, sizes)
        diff = row["first_diff"]
        progress(
            f"  sampled resume {i + 1}/{rounds}: tokens exact {row['exact']}, "
            f"logprobs exact {row['logprobs_exact']}"
            + (f" (first difference at token {diff})" if diff is not None else "")
        )
        rows.append(row)
    exact = sum(r["exact"] for r in rows)
    share = exact / rounds if rounds else None
    lp_exact = sum(r["logprobs_exact"] for r in rows)
    return {"exact": exact, "logprobs_exact": lp_exact, "total": rounds, "share": share,
            "rounds": rows}  # fmt: skip


async def measure_sampled(url: str, sizes: Sizes, run_dir: Path) -> dict[str, Any]:
    """Sampled-resume exactness alone (the ``--no-deterministic`` node)."""
    from common.bus import connect
    from common.events import EventTail
    from schemas import events as ev

    nc = await connect(url, name="bench-handover", bus=_client_bus(url, run_dir))
    try:
        events = await EventTail(nc).start()
        await events.wait_for(ev.ShadowReady, after=0, timeout=60)
        return await sampled_resumes(nc, events, sizes)
    finally:
        await nc.drain()


def _client_bus(url: str, run_dir: Path) -> Any:
    """The node's client identity from its run directory (authentication is on)."""
    from common.config import RunPaths
    from common.node import resolve_bus

    return resolve_bus(url, paths=RunPaths(run_dir))[1]


async def measure(
    url: str, failures: int, *, baseline: bool, run_dir: Path, sizes: Sizes
) -> dict[str, Any]:
    from common.bus import connect
    from common.events import EventTail
    from schemas import events as ev
    from services.router.client import generate

    nc = await connect(url, name="bench-handover", bus=_client_bus(url, run_dir))
    try:
        events = await EventTail(nc).start()
        if not baseline:
            await events.wait_for(ev.ShadowReady, after=0, timeout=60)
        progress(f"{'baseline' if baseline else 'belayer'}: failure-free throughput, batch {BATCH}")
        tp = await throughput(nc, sizes)
        progress(f"  {tp['tok_s']:.0f} tok/s (runs {[round(x) for x in tp['runs']]})")
        idle = ab = None
        if not baseline:
            progress(f"belayer: idle shadow CPU over {IDLE_WINDOW_S:.0f} s")
            idle = await shadow_idle_cpu(nc)
            progress(f"  {idle['share'] * 100:.2f} % of one core")
            progress("belayer: throughput with the shadow running vs paused, interleaved")
            ab = await shadow_ab(nc, sizes)
            progress(f"  overhead {ab['overhead'] * 100:.1f} %")
        reference = (
            await generate(nc, request("ho-reference", sizes.stream_tokens), timeout=120)
        ).token_ids
        rows = [
            await one_failure(nc, events, reference, i, baseline=baseline, sizes=sizes)
            for i in range(failures)
        ]
        sampled = None
        if not baseline:
            progress(f"belayer: {sizes.sampled_rounds} sampled resumes, --deterministic")
            sampled = await sampled_resumes(nc, events, sizes)
        return {"throughput": tp, "idle_shadow": idle, "shadow_ab": ab, "failures": rows,
                "sampled_resumes": sampled}  # fmt: skip
    finally:
        await nc.drain()


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"n": len(rows)}
    for key in ("detect_s", "ready_s", "first_token_s"):
        vals = [r[key] for r in rows if r[key] is not None]
        out[key] = {"p50": percentile(vals, 50), "p99": percentile(vals, 99), "all": vals}
    out["regenerated_tokens"] = {
        "mean": statistics.mean(r["regenerated_tokens"] for r in rows) if rows else None,
        "max": max((r["regenerated_tokens"] for r in rows), default=None),
    }
    out["all_correct"] = all(r["correct"] for r in rows)
    return out


def intervals_of(result: dict[str, Any]) -> dict[str, Interval | None]:
    """Each target's 95 % bootstrap interval (``bench.stats``)."""
    b, base = result["belayer"]["summary"], result["baseline"]["summary"]
    rows = result["belayer"]["failures"]
    det = result["belayer"]["sampled_resumes"]["rounds"]
    ratios = result["belayer"]["shadow_ab"]["pair_ratios"]

    def speedup(a: Any, c: Any) -> float | None:
        pa, pc = percentile(list(a), 50), percentile(list(c), 50)
        return pa / pc if pa and pc else None

    return {
        "detect_p50_s": quantile_interval(b["detect_s"]["all"], 50),
        "detect_p99_s": quantile_interval(b["detect_s"]["all"], 99),
        "first_token_p50_s": quantile_interval(b["first_token_s"]["all"], 50),
        "speedup_first_token": two_sample(
            base["first_token_s"]["all"], b["first_token_s"]["all"], speedup
        ),
        "regenerated_tokens": bootstrap(
            [r["regenerated_tokens"] for r in rows], lambda v: float(max(v))
        ),
        "throughput_overhead": bootstrap(ratios, lambda v: 1.0 - statistics.median(v)),
        "sampled_exact_det": bootstrap([float(r["exact"]) for r in det], lambda v: sum(v) / len(v)),
    }


def report(result: dict[str, Any]) -> list[Row]:
    b, base = result["belayer"], result["baseline"]
    rows: list[Row] = []

    def target_row(metric: str, value: float | None, shown: str, key: str, unit: str) -> Row:
        """A row judged against ``TARGETS[key]``, its interval shown."""
        if value is not None:
            fmt = {"s": lambda x: f"{x:.3f} s", "x": lambda x: f"{x:.1f}x",
                   "%": lambda x: f"{x * 100:.1f} %"}.get(unit, lambda x: f"{x:g}")  # fmt: skip
            shown += ci_text(result["intervals"].get(key), fmt)
        return Row(metric, shown, target_text(TARGETS[key], unit), result["verdicts"][key])

    def s(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.3f} s"

    for label, key in (("detect", "detect_s"), ("new worker ready", "ready_s"),
                       ("first resumed token", "first_token_s")):  # fmt: skip
        for name, summary in (("belayer", b["summary"]), ("baseline", base["summary"])):
            for q in ("p50", "p99"):
                v = summary[key][q]
                metric = f"SIGKILL → {label}, {name} {q}"
                tkey = {"detect_s": "detect", "first_token_s": "first_token"}.get(key)
                target = f"{tkey}_{q}_s" if tkey else ""
                if name == "belayer" and target in TARGETS:
                    rows.append(target_row(metric, v, s(v), target, "s"))
                else:
                    rows.append(Row(metric, s(v)))
    sp = result["speedup_first_token"]
    rows.append(target_row("first resumed token: baseline / belayer (p50)", sp,
                           "n/a" if sp is None else f"{sp:.1f}x", "speedup_first_token", "x"))  # fmt: skip
    for name, summary in (("belayer", b["summary"]), ("baseline", base["summary"])):
        rg = summary["regenerated_tokens"]["max"]
        metric = f"tokens regenerated per failure, {name} (max)"
        if name == "belayer":
            rows.append(target_row(metric, rg, str(rg), "regenerated_tokens", ""))
        else:
            rows.append(Row(metric, str(rg)))
        rows.append(Row(f"every resumed request correct, {name}", str(summary["all_correct"])))
    rows.append(Row("throughput batch 8, with shadows", f"{b['throughput']['tok_s']:.0f} tok/s"))
    rows.append(Row("throughput batch 8, without (baseline)", f"{base['throughput']['tok_s']:.0f} tok/s"))  # fmt: skip
    rows.append(Row("vs baseline node (separate run)", f"{result['throughput_vs_baseline_node'] * 100:.1f} %"))  # fmt: skip
    ov = result["throughput_overhead"]
    rows.append(target_row("shadow overhead (same node, interleaved)", ov, f"{ov * 100:.1f} %",
                           "throughput_overhead", "%"))  # fmt: skip
    idle = b["idle_shadow"]
    rows.append(Row("idle shadow CPU share", f"{idle['share'] * 100:.2f} %"))
    det, fast = b["sampled_resumes"], result["nondeterministic"]["sampled_resumes"]
    rows.append(target_row("sampled resumes exact, --deterministic", det["share"],
                           f"{det['exact']}/{det['total']}", "sampled_exact_det", "%"))  # fmt: skip
    rows.append(
        Row("sampled resumes exact, --no-deterministic", f"{fast['exact']}/{fast['total']}")
    )
    for name, sr in (("--deterministic", det), ("--no-deterministic", fast)):
        rows.append(Row(f"  … with bitwise-equal logprobs, {name}",
                        f"{sr['logprobs_exact']}/{sr['total']}"))  # fmt: skip
    return rows


def nondeterministic_resumes(run_dir: Path, model_dir: Path, sizes: Sizes) -> dict[str, Any]:
    """Sampled resumes on a node started with ``--no-deterministic`` (what holds without it)."""
    try:
        progress("starting a belayer node with --no-deterministic (1 engine)")
        node = up(run_dir, model_dir, "--recovery", "belayer", "--no-deterministic",
                  "--hang-threshold", str(sizes.hang_threshold_s))  # fmt: skip
        progress(f"belayer: {sizes.sampled_rounds} sampled resumes, --no-deterministic")
        return asyncio.run(measure_sampled(node["nats_url"], sizes, run_dir))
    finally:
        progress("stopping the --no-deterministic node: belayer down")
        with contextlib.suppress(Exception):
            stop_node(run_dir)


def main(
    json_path: Path, *, failures: int = 10, heartbeat_s: float = 5.0, model: Path | None = None
) -> dict[str, Any]:
    """Run both modes (a few minutes), print the table, write ``json_path``; on the tiny model,
    or on ``model`` (a model directory: ``PRETRAINED`` sizes)."""
    from model.tiny import init_tiny_model

    sizes = TINY if model is None else PRETRAINED
    hang = str(sizes.hang_threshold_s)
    machine = machine_at_start("handover")
    baseline_failures = max(1, min(3, failures))
    result: dict[str, Any] = {
        "bench": "handover",
        "timestamp": timestamp(),
        "model": "tiny" if model is None else model.resolve().name,
        "stream_tokens": sizes.stream_tokens,
        "kill_after_tokens": sizes.kill_after,
        "sizes": asdict(sizes),
        "heartbeat_s": heartbeat_s,
        "machine": machine,
        "targets": targets_json(TARGETS),
    }
    with tempfile.TemporaryDirectory(prefix="belayer-bench-handover-") as tmp:
        model_dir = init_tiny_model(Path(tmp) / "model") if model is None else model.resolve()
        for mode, n in (("belayer", failures), ("baseline", baseline_failures)):
            run_dir = Path(tmp) / mode
            try:
                progress(f"starting a {mode} node (1 engine)")
                extra = ["--recovery", mode, "--deterministic", "--hang-threshold", hang]
                if mode == "baseline":
                    extra += ["--heartbeat-interval", str(heartbeat_s)]
                node = up(run_dir, model_dir, *extra)
                measured = asyncio.run(
                    measure(
                        node["nats_url"],
                        n,
                        baseline=mode == "baseline",
                        run_dir=run_dir,
                        sizes=sizes,
                    )
                )
            finally:
                progress(f"stopping the {mode} node: belayer down")
                with contextlib.suppress(Exception):
                    stop_node(run_dir)
            measured["summary"] = summarize(measured["failures"])
            result[mode] = measured
        sampled = nondeterministic_resumes(Path(tmp) / "nondeterministic", model_dir, sizes)
        result["nondeterministic"] = {"sampled_resumes": sampled}
    b, base = result["belayer"]["summary"], result["baseline"]["summary"]
    bf, basef = b["first_token_s"]["p50"], base["first_token_s"]["p50"]
    result["speedup_first_token"] = basef / bf if bf and basef else None
    tok_s = {mode: result[mode]["throughput"]["tok_s"] for mode in ("belayer", "baseline")}
    result["throughput_vs_baseline_node"] = 1.0 - tok_s["belayer"] / tok_s["baseline"]
    result["throughput_overhead"] = result["belayer"]["shadow_ab"]["overhead"]
    values = {
        "detect_p50_s": b["detect_s"]["p50"],
        "detect_p99_s": b["detect_s"]["p99"],
        "first_token_p50_s": bf,
        "speedup_first_token": result["speedup_first_token"],
        "regenerated_tokens": b["regenerated_tokens"]["max"],
        "throughput_overhead": result["throughput_overhead"],
        "sampled_exact_det": result["belayer"]["sampled_resumes"]["share"],
    }
    intervals = intervals_of(result)
    result["intervals"] = intervals_json(intervals)
    result["verdicts"] = judge_all(TARGETS, values, intervals, INVARIANTS)
    result["machine"] = machine_after(machine)
    publish("handover", "belayer bench handover", report(result), json_path, result)
    return result


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("bench-results/handover.json"))
