"""The ``belayer`` command line."""

from __future__ import annotations

import contextlib
import json
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from common.config import unmakeable_dir
from services.cli import auth as auth_cmds
from services.cli import generate as generate_cmd
from services.cli import model_cmd
from services.cli import node as node_cmds
from services.cli import rollout as rollout_cmd
from services.cli import run as run_cmd
from services.cli import soak as soak_cmd
from services.cli import top as top_cmd
from services.cli import workloads as workloads_cmds
from services.cli.shared import (
    HELP_MARKUP,
    OneLineErrors,
    check_model,
    exit_status,
    fail,
    terminate_as_interrupt,
)
from services.rl.node import NodeFailed

app = typer.Typer(
    cls=OneLineErrors,  # every error one line, never a traceback
    name="belayer",
    help="Belayer: failure-tolerant agentic RL rollout. Start a node with `belayer up`, send "
    "requests with `belayer generate`, watch recovery with `belayer events`, stop with `belayer down`.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=HELP_MARKUP,
)
app.command()(node_cmds.up)
app.command()(node_cmds.down)
app.command()(node_cmds.status)
app.command()(node_cmds.events)
app.command()(generate_cmd.generate)
app.command()(rollout_cmd.rollout)
app.command()(run_cmd.run)
app.command()(top_cmd.top)
app.command()(soak_cmd.soak)
app.add_typer(auth_cmds.auth_app, name="auth")
app.add_typer(workloads_cmds.workloads_app, name="workloads")

model_app = typer.Typer(
    help="Model directories (Hugging Face layout: config.json + safetensors + tokenizer).",
    no_args_is_help=True,
)
app.add_typer(model_app, name="model")


@model_app.command("init")
def model_init(
    out_dir: Path = typer.Argument(..., help="Directory to write."),
    tiny: bool = typer.Option(
        True, "--tiny/--no-tiny", help="A tiny random Qwen3 (the only kind made here)."
    ),
    hidden_size: int = typer.Option(256, help="Hidden size."),
    num_layers: int = typer.Option(4, help="Decoder layers."),
    vocab_size: int = typer.Option(4096, max=4096, help="Vocabulary size (≤ 4096)."),
    seed: int = typer.Option(0, help="Initialisation seed."),
    warm_start: str | None = typer.Option(
        None,
        "--warm-start",
        help="math|swe|swe-long: a short supervised warm start on demonstrations (CPU, "
        "cached; docs/workloads.md) so the model emits valid actions (swe-long: long "
        "episodes that reason before each action, as `bench policy` uses).",
    ),
    cache_dir: Path | None = typer.Option(
        None,
        "--cache-dir",
        help="Cache of demonstrations and warm-started models "
        "(default $BELAYER_CACHE_DIR or ~/.cache/belayer).",
    ),
) -> None:
    """Write a tiny random Qwen3 model with a local tokenizer (nothing is downloaded); with
    --warm-start, one that acts (trained on math or SWE demonstrations)."""
    if not tiny:
        typer.echo(
            "error: only --tiny models can be made here; point --model at an existing HF directory",
            err=True,
        )
        raise typer.Exit(2)
    why = unmakeable_dir(out_dir)
    if why is not None:
        fail(f"cannot write {out_dir} ({why})", 2)
    if warm_start is not None:
        from services.cli.model_cmd import init_warm_command

        init_warm_command(
            warm_start, out_dir, cache_dir, hidden_size=hidden_size, num_layers=num_layers,
            vocab_size=vocab_size, seed=seed,
        )  # fmt: skip
        return
    from model.tiny import init_tiny_model

    path = init_tiny_model(
        out_dir, hidden_size=hidden_size, num_layers=num_layers, vocab_size=vocab_size, seed=seed
    )
    typer.echo(f"wrote tiny Qwen3 model to {path}")


model_app.command("import")(model_cmd.model_import)
model_app.command("eval")(model_cmd.model_eval)

bench_app = typer.Typer(
    help="Benchmarks: each prints a table (PASS/MISS/UNSURE against its targets, each judged on "
    "its 95 % bootstrap interval over repeats or pairs) and writes JSON, stamped with the commit "
    "and date, to bench-results/<name>.json (--out; kept runs: docs/bench/<name>-<date>.json); "
    "with --json the JSON goes to stdout, the table to stderr.",
    no_args_is_help=True,
)
app.add_typer(bench_app, name="bench")


def _run_bench(fn: Callable[[Path], dict[str, Any]], out: Path, as_json: bool) -> None:
    """Run a benchmark's ``main(out, …)``; with ``--json`` its table goes to stderr and the
    JSON to stdout. A node of its own that fails to start or stop is one ``error:`` line; SIGTERM
    stops it as Ctrl-C does (what it started is stopped first)."""
    terminate_as_interrupt()
    try:
        if not as_json:
            fn(out)
            return
        with contextlib.redirect_stdout(sys.stderr):
            result = fn(out)
    except NodeFailed as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        raise typer.Exit(exit_status()) from None
    sys.stdout.write(json.dumps(result, indent=2, default=str) + "\n")


_BENCH_JSON = typer.Option(
    False, "--json", help="Print the results as JSON on stdout (the table goes to stderr)."
)


def _bench_out(name: str) -> Any:
    return typer.Option(
        Path(f"bench-results/{name}.json"), "--out", help="Where to write the JSON."
    )


@bench_app.command("serve")
def bench_serve(
    as_json: bool = _BENCH_JSON,
    out: Path = _bench_out("serve"),
    new_tokens: int = typer.Option(128, help="New tokens per request."),
) -> None:
    """Tokens/s at batch 1 and 8: engine alone vs the full bus path; attach vs cold load; up time.

    On the tiny model: the engine in-process (before a node starts), then a real node
    (`belayer up` in a temporary run directory) serving batch 1 and 8 through client → router →
    worker, the bus loss against an in-process engine run just before each bus run
    (interleaved pairs, so the machine's drift hits both), a worker's attach to the shared-memory
    weights and KV arena against a cold load from safetensors, and `belayer up` to ready.
    Medians of 3 runs, with CPU seconds per process in the JSON. About a minute; the node is
    always stopped.
    """
    from bench.serve import main as bench_main

    _run_bench(lambda path: bench_main(path, new_tokens=new_tokens), out, as_json)


@bench_app.command("handover")
def bench_handover(
    as_json: bool = _BENCH_JSON,
    out: Path = _bench_out("handover"),
    failures: int = typer.Option(10, min=1, help="Worker failures to inject in belayer mode."),
    heartbeat_s: float = typer.Option(
        5.0, "--heartbeat", help="Baseline: the router's remote heartbeat interval (seconds)."
    ),
    model: Path | None = typer.Option(
        None,
        "--model",
        help="Model directory, e.g. an imported SmolLM2 (default: a tiny model made for the "
        "run); shorter requests and fewer rounds.",
    ),
) -> None:
    """SIGKILL → detection / new worker ready / first resumed token, belayer vs baseline.

    On a real 1-engine node (tiny model, or `--model DIR`), a streaming request runs and the
    main worker is killed, `--failures` times with shadows (belayer) and up to 3 times in
    baseline mode (remote heartbeat, cold restart): time to detect, to a new worker ready and
    to the first resumed token; tokens regenerated; every resumed request checked against an
    uninterrupted run. Also the shadow's throughput cost (running vs paused, interleaved) and
    its idle CPU. A few minutes (on the tiny model).
    """
    from bench.handover import main as bench_main

    check_model(model)
    _run_bench(
        lambda path: bench_main(path, failures=failures, heartbeat_s=heartbeat_s, model=model),
        out,
        as_json,
    )


@bench_app.command("engine")
def bench_engine(
    as_json: bool = _BENCH_JSON,
    out: Path = _bench_out("engine"),
    model: Path | None = typer.Option(
        None, "--model", help="Model directory (default: a tiny model made for the run)."
    ),
    new_tokens: int = typer.Option(128, help="New tokens per request."),
    repeats: int = typer.Option(3, min=1, help="Runs per batch size (the median is reported)."),
    threads: int = typer.Option(1, min=1, help="torch threads for the run."),
    vs_hf: bool = typer.Option(
        False,
        "--vs-hf",
        help="Against Hugging Face transformers generate on the same model and threads "
        "(interleaved; ratios of CPU-time tokens/s).",
    ),
) -> None:
    """Decode tokens/s of the engine alone, in-process (no bus), at batch 1 and 8.

    16-token prompts, greedy, past EOS, prefill included; median of `--repeats` runs. The
    targets are judged on the tiny model only (without `--model`). Seconds on the tiny model.
    With `--vs-hf`: HF transformers `generate`, the engine's fast mode and its deterministic
    mode interleaved, with the ratios judged against ≥ 2× HF at batch 1, ≥ 1.5× at batch 8
    (deterministic mode) and deterministic ≥ 90 % of fast at batch 8, on any model.
    """
    check_model(model, chat=False)
    if vs_hf:
        from bench.engine_hf import main as hf_main

        _run_bench(
            lambda path: hf_main(
                path, model, new_tokens=new_tokens, repeats=repeats, num_threads=threads
            ),
            out,
            as_json,
        )
        return
    from bench.engine import main as bench_main

    _run_bench(
        lambda path: bench_main(
            path, model, new_tokens=new_tokens, repeats=repeats, num_threads=threads
        ),
        out,
        as_json,
    )


@bench_app.command("policy")
def bench_policy(
    as_json: bool = _BENCH_JSON,
    out: Path = _bench_out("policy"),
    repeats: int = typer.Option(3, min=1, help="Rollouts per (policy, p) configuration."),
    tasks: int = typer.Option(4, min=1, help="SWE tasks per rollout."),
    n: int = typer.Option(4, min=1, help="Samples per task."),
    model: Path | None = typer.Option(
        None,
        "--model",
        help="Warm-started model directory (default: `model init --tiny --warm-start "
        "swe-long`, cached).",
    ),
) -> None:
    """Checkpoint policies under injected sandbox failures (risk-aware, always, never).

    On a real node with the environment service and the tiny model warm-started on long SWE
    episodes (a thought before each of 8–10 actions, `--warm-start swe-long`): SWE
    rollouts with `sandbox-kill@p=P` for p = 0, 0.01, 0.05, `--repeats` times per policy;
    total rollout time and critical-path checkpoint time (mean and spread). `never` is the
    restart-from-scratch baseline. risk-aware estimates the failure rate from the failures it
    sees (not told p); risk-aware-oracle, told p, is reported beside it, with both
    probabilities. Targets (judged on risk-aware, on 95 % intervals over the repeats):
    risk-aware's visible checkpoint time ≤ 2 % of rollout time; its rollout-time increase at
    p = 0.05 ≤ ⅓ of restart-from-scratch's; no restart from scratch while a ready checkpoint
    existed. Many minutes.
    """
    check_model(model)
    from bench.policy import main as bench_main

    _run_bench(
        lambda path: bench_main(path, repeats=repeats, tasks=tasks, n=n, model=model),
        out,
        as_json,
    )


@bench_app.command("train")
def bench_train(
    as_json: bool = _BENCH_JSON,
    out: Path = _bench_out("train"),
    pairs: int = typer.Option(4, min=1, help="Failure-free step pairs (Belayer, baseline)."),
    kills: int = typer.Option(
        5,
        min=5,
        help="Steps with each failure kind per node (≥ 5: each failure cost's interval "
        "resamples them).",
    ),
    tasks: int = typer.Option(4, min=1, max=4, help="SWE tasks per step."),
    n: int = typer.Option(2, min=1, help="Samples per task."),
    model: Path | None = typer.Option(
        None, "--model", help="Warm-started SWE model directory (default: made for the run)."
    ),
    trainer_procs: int = typer.Option(
        1,
        "--trainer-procs",
        min=1,
        max=64,
        help="N > 1: instead, the GRPO update's step time on N data-parallel ranks beside one "
        "process (a synthetic batch, the tiny model or --model; a minute or two).",
    ),
) -> None:
    """End-to-end time per training step, Belayer vs the baseline node; time added by a worker
    and by a sandbox failure (with --trainer-procs N: the update on N ranks vs one process).

    Two real nodes side by side (environment service, trainer, warm-started tiny SWE model):
    Belayer (shadows, risk-aware sandbox checkpoints) and the baseline (`--recovery baseline`,
    policy never). Steps (rollout → reward → train → push weights) run interleaved with the
    same content on both (same tasks and seed each step, deterministic, lr 1e-12). Target:
    failure-free overhead ≤ 1 %, judged on its 95 % bootstrap interval over the pairs. Then
    --kills worker-kill steps and as many sandbox-kill steps per node: the time each adds on
    each node (as measured, with its 95 % interval over the kills), and baseline / Belayer
    ratios with 95 % intervals over the kill pairs. About 20 minutes.
    """
    check_model(model)
    if trainer_procs > 1:
        from bench.train_dp import main as dp_main

        _run_bench(lambda path: dp_main(path, procs=trainer_procs, model=model), out, as_json)
        return
    from bench.train import main as bench_main

    _run_bench(
        lambda path: bench_main(path, pairs=pairs, kills=kills, tasks=tasks, n=n, model=model),
        out,
        as_json,
    )


@bench_app.command("scale")
def bench_scale(
    as_json: bool = _BENCH_JSON,
    out: Path = _bench_out("scale"),
    seeds: int = typer.Option(
        3, min=2, max=100, help="Seeds (paired repeats; ≥ 2 for an interval)."
    ),
    first_seed: int = typer.Option(0, "--first-seed", min=0, help="The first seed."),
    jobs: int = typer.Option(2, min=1, max=64, help="Simulations run at once (processes)."),
    checkpoint_factor: float = typer.Option(
        4.0, min=0.0, help="Scales this machine's measured checkpoint cost (331 ms)."
    ),
    restore_factor: float = typer.Option(
        4.0, min=0.0, help="Scales this machine's measured restore cost (428 ms)."
    ),
    handover_factor: float = typer.Option(
        10.0, min=0.0, help="Scales this machine's measured handover (68 ms)."
    ),
) -> None:
    """A SIMULATION at the paper's scale: Fig. 7- and Fig. 12-style numbers.

    One GRPO step of 64 prompts × 8 samples on 32 engines and 512 sandboxes, SWE-length
    trajectories (up to 20 turns, 4k-token responses), on a simulated clock: the production
    router, trajectory (episode), checkpoint-policy and trainer-batch cores make every
    decision; engines, sandboxes and failures (Poisson per engine and per sandbox) are
    simulated; costs are this machine's measured ones scaled by the factors. Reports the
    failure-free step-time overhead, the rollout-time increase vs restart-from-scratch at
    sandbox failure probabilities 0.01, 0.02, 0.05, the step time with engine and sandbox
    failures, and the counts, each with a 95 % bootstrap interval over the seeds. About a
    minute.
    """
    from bench.scale import main as bench_main
    from bench.scale_sim import ScaleConfig

    cfg = ScaleConfig(
        checkpoint_factor=checkpoint_factor,
        restore_factor=restore_factor,
        handover_factor=handover_factor,
    )
    _run_bench(
        lambda path: bench_main(path, seeds=seeds, first_seed=first_seed, jobs=jobs, config=cfg),
        out,
        as_json,
    )


@bench_app.command("transparency")
def bench_transparency(
    as_json: bool = _BENCH_JSON,
    out: Path = _bench_out("transparency"),
    workload: str = typer.Option("math", "--workload", help="math or swe."),
    steps: int = typer.Option(3, "--steps", min=1, max=100, help="Training steps of each run."),
    inject: str | None = typer.Option(
        None,
        "--inject",
        help="The faulted run's failures (default: every kind, spread over "
        "the steps; `belayer run --inject` grammar).",
    ),
    model: Path | None = typer.Option(
        None, "--model", help="Model directory (default: the workload's warm-started tiny one)."
    ),
    tasks: int | None = typer.Option(None, "--tasks", min=1, help="Tasks per step."),
    n: int | None = typer.Option(None, "--n", min=1, help="Samples per task."),
    held_out: int | None = typer.Option(None, "--held-out", min=1, help="Held-out tasks."),
    seed: int | None = typer.Option(
        None,
        "--seed",
        min=0,
        help="Both runs' `belayer run --seed`: the tasks and sample seeds (default: the "
        "benchmark's fixed seed).",
    ),
) -> None:
    """Failure transparency: the same deterministic run twice (same seed, a fresh node each),
    without failures and with failures of every kind (worker, shadow, controller and trainer
    kills; on swe also sandbox kills at several turns and a sandbox pause). Per step: are the
    weights' sha256, the batch's sha256, the rewards and the loss equal? PASS when every step
    is, every injection fired and neither run had an error. Minutes (math), longer (swe)."""
    if workload not in ("math", "swe"):
        raise typer.BadParameter("math or swe", param_hint="--workload")
    check_model(model)
    from bench.transparency import main as bench_main

    _run_bench(
        lambda path: bench_main(
            path, workload=workload, steps=steps, inject=inject, model=model, tasks=tasks, n=n,
            held_out=held_out, seed=seed,
        ),
        out,
        as_json,
    )  # fmt: skip


@bench_app.command("learn")
def bench_learn(
    as_json: bool = _BENCH_JSON,
    out: Path = _bench_out("learn"),
    workload: str = typer.Option("math", "--workload", help="math or swe."),
    steps: int = typer.Option(20, "--steps", min=1, max=1000, help="Training steps of each run."),
    seeds: str = typer.Option("0,1,2", "--seeds", help="Comma-separated `belayer run --seed`s."),
    runs: str = typer.Option(
        "",
        "--runs",
        help="Judge these run directories (comma-separated, one per seed, in --seeds order) "
        "instead of running.",
    ),
    run_args: str = typer.Option(
        "",
        "--run-args",
        help="More `belayer run` options for every run, as one string (a variant of the "
        "defaults: '--lr 3e-5 --beta 0.04'); recorded in the JSON.",
    ),
) -> None:
    """Does the run learn in every seed? `belayer run WORKLOAD --steps N --seed S` with every
    other option at its default (or --run-args), a fresh node each: per seed the held-out greedy exact accuracy
    (swe: the share of held-out instances solved; held-out families reported apart)
    at step 0 and after the last step, the gain with its 95 % interval (paired bootstrap over
    the held-out problems) against +0.15, the held-out tasks solved at every evaluation, and
    one plot of every seed's curve (beside the JSON). Minutes per seed; SIGTERM or Ctrl-C
    stops the run and its node and removes the runs' directories."""
    try:
        seed_list = [int(s) for s in seeds.split(",") if s.strip()]
    except ValueError:
        raise typer.BadParameter("comma-separated integers", param_hint="--seeds") from None
    run_dirs = [Path(r) for r in runs.split(",") if r.strip()]
    if run_dirs and len(run_dirs) != len(seed_list):
        raise typer.BadParameter("one run directory per seed", param_hint="--runs")
    if workload not in ("math", "swe"):
        raise typer.BadParameter("math or swe", param_hint="--workload")
    try:
        extra = shlex.split(run_args)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--run-args") from None
    from bench.learn import main as bench_main

    _run_bench(
        lambda path: bench_main(
            path,
            workload=workload,
            steps=steps,
            seeds=seed_list,
            runs=run_dirs,
            run_args=extra,
        ),
        out,
        as_json,
    )


def bench_env(
    as_json: bool = _BENCH_JSON,
    out: Path = _bench_out("env"),
    repeats: int = typer.Option(5, min=1, help="Repetitions per configuration."),
    cycles: int = typer.Option(100, min=0, help="Kill/restore consistency cycles (0: skip)."),
    quick: bool = typer.Option(False, help="Small configurations only (no 256 MB, 100 MB layer)."),
) -> None:
    """full_checkpoint / full_restore latency against raw criu+tar and a fresh container.

    With a real nats-server and the real sandbox manager (needs dockerd and CRIU): for sandboxes
    of 0/64/256 MB process memory and a 2 or 100 MB writable layer, the checkpoint and restore
    medians next to `criu dump` + tar straight on the same container and untar + `runc restore`
    of the same checkpoint into a bare bundle (no Docker); a fresh container from
    the base image (the restart-from-scratch baseline); `--cycles` kill/restore rounds checked
    for consistency (files and process state equal the checkpoint's). Minutes.
    """
    from bench.env import main as bench_main

    _run_bench(
        lambda path: bench_main(path, repeats=repeats, cycles=cycles, quick=quick), out, as_json
    )


def _mount_environment() -> None:
    """The environment CLI and its benchmark need the docker SDK; mount them when importable."""
    try:
        from services.cli.env import env_app
    except ImportError:
        return
    app.add_typer(env_app, name="env")
    bench_app.command("env")(bench_env)


_mount_environment()

if __name__ == "__main__":
    app()
