"""``belayer bench train``: end-to-end time per training step (rollout → reward → train → push
weights) with Belayer against the baseline node — the paper's Figure 7 — and the time a worker
failure and a sandbox failure add to a step on each.

Two real nodes run side by side, each with the environment service, a trainer and the
warm-started tiny SWE model: **Belayer** (shadow workers, token-level resume, risk-aware sandbox
checkpoints at λ = ``FAILURE_RATE``) and the **baseline** (``belayer up --recovery baseline``:
no shadows, remote-heartbeat detection, cold restart and regeneration; policy ``never``: a
sandbox failure restarts its trajectory from scratch). Steps run interleaved, one on each node
in alternating order, each the RL loop's ``run_step`` as ``belayer run`` runs it
(``services/rl/loop.py``; no held-out tasks here, so its evaluation is empty).

Paired steps: both nodes run deterministically, every step rolls out the same tasks with the
same seed, and the learning rate is tiny (1e-12: the update's work is all done, the weights
do not move), so every step of both nodes generates the same tokens and the comparison is
step for step. Failure-free: ``pairs`` pairs; overhead = median over pairs of
t_belayer / t_baseline − 1 (target ≤ 1 %), with its 95 % bootstrap interval over the pairs;
the verdict reads the interval (``bench.stats``: PASS only when all of it meets the target).
Then on each node ``kills`` (default 5) steps with ``worker-kill`` (SIGKILL of the worker at
the first token of a response) and as many with ``sandbox-kill`` (the first ``kv_daemon``
trajectory, after its second action: Belayer can restore the checkpoint its policy took after
the first; the baseline restarts the trajectory from scratch), the two sides alternating; time
added = a step's time − the node's median failure-free step. Each side's mean added time has
its own 95 % bootstrap interval over its kills, shown as measured (a negative time added — a
failure step faster than the median failure-free one — is noise and stays negative, never
clamped to 0). Reported as baseline / Belayer ratios of the mean added time, with a bootstrap
interval over the kill pairs; where Belayer's added time is within the noise of its
failure-free steps (their median absolute deviation) the ratio uses that noise instead, is
marked a lower bound (``ratios_are_lower_bounds``), and the measured time is shown beside it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.report import (
    Row,
    Target,
    machine_at_start,
    progress,
    publish,
    target_text,
    targets_json,
    timestamp,
)
from bench.stats import Interval, bootstrap, interval_verdict

NAME = "train"
FAILURE_RATE = 0.02
"""λ (failures per second) the Belayer side's risk-aware policy plans for."""
ROLLOUT_SEED = 1234
TARGETS: dict[str, Target] = {"overhead": ("<=", 0.01)}
KILLS = 5
"""Failures of each kind per side (pairs of the failure-cost intervals)."""


@dataclass
class Side:
    """One node of the comparison."""

    name: str
    recovery: str
    policy: str
    root: Path
    node: Any = None
    nc: Any = None
    ctx: Any = None
    step: int = 0
    free: list[float] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)


def warm_model(out: Path) -> Path:
    from services.rl.warm import warm_start

    return warm_start("swe", out)[0]


def start(side: Side, model_dir: Path, tasks: int, n: int) -> None:
    from common.config import RunPaths
    from services.rl.node import NodeHandle, run_trainer_config, start_node

    paths = RunPaths(side.root / "node")
    trainer = run_trainer_config(
        group_size=n, groups_per_step=tasks, checkpoint_dir=side.root / "trainer", lr=1e-12
    )
    info = start_node(
        paths, model_dir=model_dir, environment=True, trainer=trainer, recovery=side.recovery,
        owner_pid=os.getpid(),  # a SIGKILLed benchmark leaves no node behind
    )  # fmt: skip
    side.node = NodeHandle(paths, info, ours=True)


async def connect(side: Side, model_dir: Path, tasks: int, n: int) -> None:
    from common.events import EventTail
    from model.chat import ChatFormat
    from model.tokenizer import load_tokenizer
    from services.rl.loop import RunContext
    from services.rl.node import open_bus, wait_trainer
    from services.rl.options import RunOptions, RunState, choose_tasks
    from workloads import load_workload

    side.nc = await open_bus(side.node)
    base = (await wait_trainer(side.nc)).step
    pool, _, _ = choose_tasks("swe", "", tasks, 1, 1, 0)
    state = RunState(
        run_id=f"bench{side.name}", workload="swe", dataset="", model_dir=str(model_dir),
        model_fingerprint="", tasks=tasks, n=n, seed=0, policy=side.policy, pool=pool,
        held_out=[], created_at=time.time(),
    )  # fmt: skip
    side.ctx = RunContext(
        opts=RunOptions(workload="swe", steps=10_000, policy=side.policy),
        state=state, run_dir=side.root, node=side.node, workload=load_workload("swe"),
        workload_name="swe", dataset="", held_out=[], chat=ChatFormat(load_tokenizer(model_dir)),
        specs=[], sandboxed=True, start_step=1, steps=10_000, deterministic=True,
        base_step=base, rollout_seed=ROLLOUT_SEED,
        failure_rate=FAILURE_RATE if side.policy == "risk-aware" else None, nc=side.nc,
    )  # fmt: skip
    side.ctx.events = await EventTail(side.nc).start(new_only=True)


async def one_step(side: Side, faults: Any, label: str) -> dict[str, Any]:
    """One step of the RL loop (``run_step``: rollout → reward → train → push weights, an
    empty held-out evaluation) on ``side``; its timings."""
    from services.rl.loop import run_step

    side.step += 1
    t0 = time.monotonic()
    done = await run_step(side.ctx, side.step, faults)
    s, times, trained = done.rollout.summary, done.times, done.trained
    row = {
        "node": side.name, "label": label, "step": side.step,
        "step_s": round(time.monotonic() - t0, 3), "rollout_s": round(times.rollout, 3),
        "train_s": round(times.train, 3), "push_s": round(times.push, 3),
        "failures_injected": s.failures_injected, "failures_recovered": s.failures_recovered,
        "env_checkpoints": s.checkpoints, "env_restores": s.env_restores,
        "restarts_from_scratch": s.restarts_from_scratch,
        "visible_checkpoint_s": s.visible_checkpoint_s, "handovers": s.engine_handovers,
        "logprob_diff_max": trained.logprob_diff_max,
    }  # fmt: skip
    side.steps.append(row)
    progress(NAME, f"{side.name} {label} step {side.step}: {row['step_s']:.2f} s")
    return row


async def measure(
    sides: list[Side], pairs: int, kills: int, model_dir: Path, tasks: int, n: int
) -> None:
    from schemas.rollout import FaultSpec
    from services.rl.options import StepFaults

    for side in sides:
        await connect(side, model_dir, tasks, n)
    none = StepFaults()
    try:
        for side in sides:
            await one_step(side, none, "warm-up")
        for i in range(pairs):
            for side in sides if i % 2 == 0 else sides[::-1]:
                side.free.append((await one_step(side, none, "failure-free"))["step_s"])
        worker = StepFaults(
            rollout=[FaultSpec(kind="worker-kill", trigger="turn", value=1, text="worker-kill")]
        )
        slot = sandbox_slot(sides[0].ctx.state.pool, tasks, n)
        sandbox = StepFaults(
            rollout=[
                FaultSpec(
                    kind="sandbox-kill", trigger="turn", value=2, target=slot, text="sandbox-kill"
                )
            ]
        )
        for label, faults in (("worker-kill", worker), ("sandbox-kill", sandbox)):
            for i in range(kills):  # kill i of each side forms pair i of the interval
                for side in sides if i % 2 == 0 else sides[::-1]:
                    await one_step(side, faults, label)
    finally:
        for side in sides:
            if side.ctx is not None and side.ctx.events is not None:
                await side.ctx.events.stop()
            if side.nc is not None:
                await side.nc.drain()


def sandbox_slot(pool: list[str], tasks: int, n: int) -> int:
    """A slot whose task takes several actions (``kv_daemon``: fix, start the server, store a
    value), so a kill after its second action can find a checkpoint taken after the first."""
    ids = pool[:tasks]
    return ids.index("kv_daemon") * n if "kv_daemon" in ids else 0


def noise_floor(side: Side) -> float:
    """The median absolute deviation of the side's failure-free steps (at least 0.1 s)."""
    if len(side.free) < 2:
        return 0.1
    med = statistics.median(side.free)
    return max(0.1, statistics.median(abs(t - med) for t in side.free))


def added(side: Side, label: str) -> list[float]:
    """The time each of the side's ``label`` steps (those whose injection fired) added to its
    median failure-free step, in the order they ran."""
    if not side.free:
        return []
    free = statistics.median(side.free)
    rows = [r for r in side.steps if r["label"] == label and r["failures_injected"]]
    return [round(r["step_s"] - free, 3) for r in rows]


def overhead_interval(belayer: list[float], baseline: list[float]) -> Interval | None:
    """Median over pairs of t_belayer / t_baseline − 1, with its bootstrap interval over pairs."""
    pairs = [(b, a) for b, a in zip(belayer, baseline, strict=False) if a]
    return bootstrap(pairs, lambda ps: statistics.median(b / a for b, a in ps) - 1)


def cost_interval(belayer: list[float], baseline: list[float], floor: float) -> Interval | None:
    """Baseline / Belayer ratio of the mean time a failure added, over pairs of kills (kill i
    of each side), Belayer's mean floored at its failure-free noise (``_ratio``)."""
    pairs = list(zip(belayer, baseline, strict=False))

    def stat(ps: Sequence[tuple[float, float]]) -> float | None:
        return _ratio(statistics.mean(a for _, a in ps), statistics.mean(b for b, _ in ps), floor)

    return bootstrap(pairs, stat)


def main(
    json_path: Path,
    *,
    pairs: int = 4,
    kills: int = KILLS,
    tasks: int = 4,
    n: int = 2,
    model: Path | None = None,
) -> dict[str, Any]:
    """Both nodes, interleaved steps, the table and the JSON."""
    from services.rl.node import stop_node

    machine = machine_at_start(NAME)
    tmp = Path(tempfile.mkdtemp(prefix="belayer-bench-train-"))
    belayer = Side("belayer", "belayer", "risk-aware", tmp / "belayer")
    baseline = Side("baseline", "baseline", "never", tmp / "baseline")
    sides = [belayer, baseline]
    try:
        model_dir = model or warm_model(tmp / "model")
        for side in sides:
            progress(NAME, f"starting the {side.name} node")
            start(side, model_dir, tasks, n)
        asyncio.run(measure(sides, pairs, kills, model_dir, tasks, n))
    finally:
        for side in sides:
            if side.node is not None:
                stop_node(side.node.paths)
        shutil.rmtree(tmp, ignore_errors=True)
    return report(belayer, baseline, pairs, kills, tasks, n, machine, json_path)


def report(
    belayer: Side,
    baseline: Side,
    pairs: int,
    kills: int,
    tasks: int,
    n: int,
    machine: dict[str, Any],
    json_path: Path,
) -> dict[str, Any]:
    """The result (every verdict from an interval), its table and its JSON file."""
    sides = [belayer, baseline]
    pair_ratios = [b / a for b, a in zip(belayer.free, baseline.free, strict=True) if a]
    floor = noise_floor(belayer)
    intervals = {
        "overhead": overhead_interval(belayer.free, baseline.free),
        "worker_ratio": cost_interval(
            added(belayer, "worker-kill"), added(baseline, "worker-kill"), floor
        ),
        "sandbox_ratio": cost_interval(
            added(belayer, "sandbox-kill"), added(baseline, "sandbox-kill"), floor
        ),
    }
    costs = {
        f"{kind}_added_{side.name}_s": added(side, f"{kind}-kill")
        for kind in ("worker", "sandbox")
        for side in sides
    }
    intervals.update({k: bootstrap(v, statistics.mean) for k, v in costs.items()})
    values: dict[str, float | None] = {
        "belayer_step_s": statistics.median(belayer.free) if belayer.free else None,
        "baseline_step_s": statistics.median(baseline.free) if baseline.free else None,
        **{k: (i.value if i else None) for k, i in intervals.items()},
        **{k: (statistics.mean(v) if v else None) for k, v in costs.items()},
    }
    noise = {s.name: round(max(s.free) - min(s.free), 3) if s.free else None for s in sides}
    result: dict[str, Any] = {
        "bench": NAME, "timestamp": timestamp(), "machine": machine, "pairs": pairs,
        "kills": kills, "tasks": tasks, "n": n, "failure_rate": FAILURE_RATE,
        "rollout_seed": ROLLOUT_SEED, "targets": targets_json(TARGETS),
        **{k: _round(v) for k, v in values.items()},
        "intervals": {k: i.as_json() if i else None for k, i in intervals.items()},
        "kill_costs_s": costs, "kills_landed": {k: len(v) for k, v in costs.items()},
        "pair_ratios": [round(r, 4) for r in pair_ratios],
        "free_spread_s": noise, "noise_floor_s": round(floor, 3),
        "ratios_are_lower_bounds": {
            k: (values[f"{k}_added_belayer_s"] or 0.0) < floor for k in ("worker", "sandbox")
        },
        "steps": belayer.steps + baseline.steps,
    }  # fmt: skip
    result["verdicts"] = {k: interval_verdict(intervals[k], *TARGETS[k]) for k in TARGETS}
    title = f"bench {NAME}: time per step, Belayer vs baseline"
    publish(NAME, title, rows(result, noise), json_path, result)
    return result


def _ratio(a: float | None, b: float | None, floor: float) -> float | None:
    """``a / b``, Belayer's added time ``b`` floored at the noise of its failure-free steps
    (it can measure ~0 or below: then the ratio is a lower bound)."""
    if a is None or b is None:
        return None
    return a / max(b, floor)


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 4)


def _s(v: Any) -> str:
    return "n/a" if v is None else f"{v:.2f} s"


def _x(v: Any, r: dict[str, Any], kind: str) -> str:
    if v is None:
        return "n/a"
    if r["ratios_are_lower_bounds"].get(kind):
        return f"≥ {v:.1f}x (Belayer's within ±{r['noise_floor_s']:.2f} s noise)"
    return f"{v:.1f}x"


def _ci(r: dict[str, Any], key: str, scale: float = 1.0, unit: str = "") -> str:
    """`` [low … high]`` of the key's 95 % interval (empty without one)."""
    i = r["intervals"].get(key)
    if not i:
        return ""
    lo, hi = (x * scale for x in i["ci95"])
    return f" [95 % CI {lo:+.2f} … {hi:+.2f}{unit}]" if unit else f" [95 % CI {lo:.1f} … {hi:.1f}]"


def _added(r: dict[str, Any], kind: str, side: str) -> Row:
    """Time a failure of ``kind`` added on ``side``: the mean as measured, its interval."""
    key = f"{kind}_added_{side}_s"
    n = r.get("kills_landed", {}).get(key, r["kills"])
    return Row(
        f"{kind} failure: time added, {side} (mean of {n})",
        _s(r[key]) + (_ci(r, key, 1.0, " s") if r[key] is not None else ""),
    )


def rows(r: dict[str, Any], noise: dict[str, Any]) -> list[Row]:
    ov = r["overhead"]
    return [
        Row("failure-free step, Belayer (median)", _s(r["belayer_step_s"])),
        Row("failure-free step, baseline (median)", _s(r["baseline_step_s"])),
        Row(
            f"overhead (median of {r['pairs']} paired steps)",
            "n/a" if ov is None else f"{ov * 100:+.2f} %" + _ci(r, "overhead", 100, " %"),
            target_text(TARGETS["overhead"], "%"),
            r["verdicts"].get("overhead", ""),
        ),
        Row(
            "spread of failure-free steps (max − min)",
            f"{noise.get('belayer')} s / {noise.get('baseline')} s",
        ),
        _added(r, "worker", "belayer"),
        _added(r, "worker", "baseline"),
        Row(
            "worker failure: baseline / Belayer",
            _x(r["worker_ratio"], r, "worker") + _ci(r, "worker_ratio"),
        ),
        _added(r, "sandbox", "belayer"),
        _added(r, "sandbox", "baseline"),
        Row(
            "sandbox failure: baseline / Belayer",
            _x(r["sandbox_ratio"], r, "sandbox") + _ci(r, "sandbox_ratio"),
        ),
    ]
