"""``belayer bench transparency``: failures leave no trace in what training learns.

The same deterministic run (``belayer run``, same model, seed, tasks and options, a fresh node
each) twice: once without failures, once with failures of every kind the run knows — on math
``worker-kill``, ``shadow-kill``, ``controller-kill`` and ``trainer-kill``; on swe also
``sandbox-kill`` (trajectories #1–#3 after their first action, every trajectory after its
second, every step) and ``sandbox-pause``. Per step it compares what the trainer
reports (``metrics.jsonl``): the sha256 of the weights after the update, the sha256 of the
batch it trained on (tokens, masks, rewards, in training order), every trajectory's reward by
slot, and the loss, bit for bit. PASS: every step agrees, every injection fired in the faulted
run (and none in the clean one), neither run reported an error, and some step had a gradient
(weights that never moved would agree whatever happened).

The runs are the ``belayer run`` command itself (a subprocess each, ``$BELAYER_HOME`` pointing at
an empty directory so no running node is used): what is compared is what a user runs.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.report import MISS, PASS, Row, machine_at_start, progress, publish, timestamp

NAME = "transparency"
SEED = 7
RUN_TIMEOUT_S = 3600.0
"""Bound on one ``belayer run`` (a 3-step swe run takes minutes on a busy 2-core machine)."""
STOP_GRACE_S = 120.0
"""How long a stopped ``belayer run`` may take to stop its node and write its report."""
COMPARED = ("weights_sha256", "batch_sha256", "rewards", "loss")
"""What must be equal in every step's record (``metrics.jsonl``)."""

FAULTS: dict[str, list[list[str]]] = {
    "math": [["worker-kill"], ["controller-kill", "shadow-kill"], ["trainer-kill"]],
    "swe": [
        ["worker-kill"],
        ["controller-kill", "shadow-kill"],
        ["trainer-kill", "sandbox-pause"],
    ],
}
"""Kinds per step (with fewer steps, the last step takes the groups past it). A worker kill and
a shadow kill of the same step would leave the engine no shadow to hand over to (a cold
restart instead): they go to different steps."""
EVERY_STEP: dict[str, list[str]] = {
    "math": [],
    "swe": [*(f"sandbox-kill@turn=1/{i}" for i in (1, 2, 3)), "sandbox-kill@turn=2"],
}
"""Rollout injections of every step: on swe the sandboxes of trajectories #1–#3 killed after
their first action and every trajectory's after its second (#0's first action is left to
``sandbox-pause@step=S``: a container killed at the same point cannot be paused)."""


def default_inject(workload: str, steps: int) -> str:
    """Every kind of failure of ``workload``, spread over ``steps`` steps."""
    items = list(EVERY_STEP[workload])
    for i, kinds in enumerate(FAULTS[workload]):
        items += [f"{kind}@step={min(i + 1, steps)}" for kind in kinds]
    return ",".join(items)


def warm_model(workload: str, out: Path) -> Path:
    from services.rl.warm import warm_start

    return warm_start(workload, out)[0]


def belayer_run(
    root: Path,
    label: str,
    workload: str,
    model: Path,
    steps: int,
    inject: str,
    options: list[str],
    seed: int = SEED,
    bench: str = NAME,
) -> dict[str, Any]:
    """One ``belayer run`` on a fresh node under ``root/label``; its ``--json`` report."""
    out = root / label
    home = root / f"{label}-home"
    home.mkdir(parents=True)
    cmd = [sys.executable, "-m", "services.cli.main", "run", workload, "--steps", str(steps),
           "--model", str(model), "--seed", str(seed), "--out", str(out), "--json", *options]  # fmt: skip
    if inject:
        cmd += ["--inject", inject]
    progress(bench, f"{label} run: belayer run {workload} --steps {steps} --inject {inject!r}")
    t0 = time.monotonic()
    env = {**os.environ, "BELAYER_HOME": str(home)}
    code, stdout, stderr = run_bounded(cmd, env, RUN_TIMEOUT_S)
    seconds = time.monotonic() - t0
    (root / f"{label}.stderr").write_text(stderr)
    try:
        report: dict[str, Any] = json.loads(stdout)
    except json.JSONDecodeError:
        report = {}
    if code != 0 or not report:
        tail = stderr.strip().splitlines()[-3:]
        report.setdefault("errors", []).append(f"belayer run exited {code}: {' / '.join(tail)}")
    report["bench_seconds"] = round(seconds, 2)
    progress(bench, f"{label} run: {seconds:.0f} s, exit {code}")
    return report


def run_bounded(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[int, str, str]:
    """Run ``cmd``; past ``timeout`` — or when this process is interrupted (Ctrl-C, SIGTERM) —
    stop it (``interrupt``). Its own session: a terminal's Ctrl-C reaches it once, through this
    process."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out, err = interrupt(proc)
        err += f"\nstopped after {timeout:g} s"
    except KeyboardInterrupt:
        interrupt(proc)
        raise
    return proc.returncode, out, err


def interrupt(proc: subprocess.Popen[str], grace_s: float = STOP_GRACE_S) -> tuple[str, str]:
    """SIGTERM for ``proc`` (``belayer run`` takes it as Ctrl-C: it stops the node it started
    and writes its report); SIGKILL if it has not ended ``grace_s`` later. Its output. Not
    SIGINT: a process started in a shell's background inherits SIGINT ignored, and then a
    killed run would leave its node running (seen: a bench stopped by SIGTERM did)."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.communicate(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()


def steps_of(report: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {r["step"]: r for r in report.get("per_step", []) if r.get("step", 0) >= 1}


def compare(clean: dict[str, Any], faulted: dict[str, Any], steps: int) -> list[dict[str, Any]]:
    """Per step: each compared value of both runs and whether they are equal (a value missing
    on either side, or an empty digest, compares unequal: nothing compared is no match)."""
    a, b = steps_of(clean), steps_of(faulted)
    out = []
    for step in range(1, steps + 1):
        row: dict[str, Any] = {"step": step}
        for key in COMPARED:
            x, y = a.get(step, {}).get(key), b.get(step, {}).get(key)
            row[key] = {"clean": x, "faulted": y, "equal": x == y and x not in (None, "", [])}
        row["equal"] = all(row[k]["equal"] for k in COMPARED)
        row["inject"] = b.get(step, {}).get("inject", [])
        row["grad_norm"] = a.get(step, {}).get("grad_norm")
        out.append(row)
    return out


def problems_of(
    clean: dict[str, Any], faulted: dict[str, Any], per_step: list[dict[str, Any]]
) -> list[str]:
    """Why the verdict is MISS (empty: PASS)."""
    out = [f"clean run: {e}" for e in clean.get("errors", [])]
    out += [f"faulted run: {e}" for e in faulted.get("errors", [])]
    if clean.get("failures_injected"):
        out.append(f"the clean run injected {clean['failures_injected']} failures")
    if not faulted.get("failures_injected"):
        out.append("no failure fired in the faulted run: nothing was compared")
    fired = {e["detail"].partition("@")[0] for e in faulted.get("timeline", [])
             if e.get("type") == "injected"}  # fmt: skip
    wanted = {i.partition("@")[0] for i in faulted.get("inject", [])}
    if wanted - fired:
        out.append(f"no {', '.join(sorted(wanted - fired))} fired in the faulted run")
    if not any(r.get("grad_norm") for r in steps_of(clean).values()):
        out.append("no step of the clean run had a gradient: the weights never moved")
    for r in per_step:
        differ = [k for k in COMPARED if not r[k]["equal"]]
        if differ:
            out.append(f"step {r['step']}: {', '.join(differ)} differ")
    return out


def main(
    json_path: Path,
    *,
    workload: str = "math",
    steps: int = 3,
    inject: str | None = None,
    model: Path | None = None,
    tasks: int | None = None,
    n: int | None = None,
    held_out: int | None = None,
    seed: int | None = None,
) -> dict[str, Any]:
    """Both runs, the per-step comparison, the table and the JSON. ``seed`` is both runs'
    ``belayer run --seed`` (which tasks each step rolls out, and every sample's seed; default
    :data:`SEED`)."""
    seed = SEED if seed is None else seed
    if workload not in FAULTS:
        raise ValueError(f"workload must be math or swe, got {workload!r}")
    machine = machine_at_start(NAME)
    inject = default_inject(workload, steps) if inject is None else inject
    options = [f"--{k.replace('_', '-')}={v}" for k, v in
               (("tasks", tasks), ("n", n), ("held_out", held_out)) if v is not None]  # fmt: skip
    tmp = Path(tempfile.mkdtemp(prefix="belayer-bench-transparency-"))
    try:
        model_dir = model or warm_model(workload, tmp / "model")
        clean = belayer_run(tmp, "clean", workload, model_dir, steps, "", options, seed)
        faulted = belayer_run(tmp, "faulted", workload, model_dir, steps, inject, options, seed)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    per_step = compare(clean, faulted, steps)
    problems = problems_of(clean, faulted, per_step)
    if problems:  # the runs' directories (logs, metrics, trainer checkpoints) say why
        progress(NAME, f"MISS: the runs are kept in {tmp}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    first = next((r["step"] for r in per_step if not r["equal"]), None)
    result: dict[str, Any] = {
        "bench": NAME, "timestamp": timestamp(), "machine": machine, "workload": workload,
        "steps": steps, "seed": seed, "inject": inject, "options": options,
        "per_step": per_step, "first_divergence": first,
        "weights_sha256": {"clean": clean.get("weights_sha256"),
                           "faulted": faulted.get("weights_sha256")},
        "runs": {label: summary(r) for label, r in (("clean", clean), ("faulted", faulted))},
        "problems": problems, "verdict": PASS if not problems else MISS,
        "verdict_basis": VERDICT_BASIS,
    }  # fmt: skip
    title = f"bench {NAME}: {workload}, {steps} steps, with and without failures"
    publish(NAME, title, rows(result), json_path, result)
    return result


VERDICT_BASIS = (
    "exact: every step's weights, batch, rewards and loss compared bit for bit (a comparison, "
    "not a sample: no interval)"
)
"""What the verdict rests on (every other benchmark's verdict reads a bootstrap interval)."""


def summary(report: dict[str, Any]) -> dict[str, Any]:
    keys = ("run_id", "steps", "failures_injected", "failures_recovered", "handovers",
            "trainer_restarts", "env_restores", "restarts_from_scratch", "weight_version",
            "deterministic", "wall_seconds", "bench_seconds", "errors")  # fmt: skip
    out = {k: report.get(k) for k in keys}
    out["fired"] = sorted(
        {e["detail"] for e in report.get("timeline", []) if e.get("type") == "injected"}
    )
    return out


def _same(cell: dict[str, Any]) -> str:
    return "equal" if cell["equal"] else "DIFFER"


def rows(r: dict[str, Any]) -> list[Row]:
    out = []
    for s in r["per_step"]:
        faults = ", ".join(s["inject"]) or "none"
        value = " / ".join(_same(s[k]) for k in COMPARED)
        out.append(Row(f"step {s['step']} ({faults})", value, "all equal",
                       PASS if s["equal"] else MISS))  # fmt: skip
    runs = r["runs"]
    out.append(Row("compared per step", "weights sha256 / batch sha256 / rewards / loss"))
    for label in ("clean", "faulted"):
        x = runs[label]
        out.append(
            Row(
                f"{label} run: injected / recovered, handovers, trainer restarts",
                f"{x['failures_injected']} / {x['failures_recovered']}, {x['handovers']}, "
                f"{x['trainer_restarts']} ({x['bench_seconds']} s)",
            )
        )
    w = r["weights_sha256"]
    out.append(Row("final weights sha256, clean", str(w["clean"])[:16]))
    out.append(Row("final weights sha256, faulted", str(w["faulted"])[:16]))
    out.extend(Row("problem", p) for p in r["problems"])
    out.append(Row("verdict (exact comparison: no interval)", r["verdict"], "no trace of failures",
                   r["verdict"]))  # fmt: skip
    return out
