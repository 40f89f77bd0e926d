"""``belayer run math|swe``: a GRPO training run on a node — rollout → reward → train → push
weights → eval, step after step (the RL loop of ``services/rl/loop.py``) — through injected
failures, with progress bars, a per-step table and a report under the run directory
(``services/rl/report.py``). Everything is checked first (``services/rl/options.py``): a bad
option, model, dataset, injection or resume directory is one ``error:`` line before anything
starts."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from common.errors import BelayerError, InvalidRequest
from model.chat import ChatFormat
from model.tokenizer import load_tokenizer
from services.cli.node import docker_usable, run_paths
from services.cli.shared import fail, finite, one_line, print_json
from services.rl.loop import RunContext, train_loop
from services.rl.node import (
    NodeFailed,
    NodeHandle,
    open_bus,
    run_trainer_config,
    running_node,
    start_node,
    stop_node,
    wait_trainer,
)
from services.rl.options import (
    DEFAULTS,
    LR_DEFAULTS,
    RunOptions,
    RunState,
    check_model_dir,
    check_options,
    choose_tasks,
    default_out,
    fingerprint,
    latest_run,
    new_run_id,
    parse_run_inject,
    read_state,
    warm_model,
    workload_spec,
)
from services.rl.records import totals
from services.rl.report import read_metrics, rewrite_metrics, step_table, write_report

PHASES = ("rollout", "reward", "train", "push", "eval")


class Ui:
    """Progress bars on stderr (one per phase, reset each step); plain lines when stderr is
    not a terminal."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.live = console.is_terminal
        self.progress = Progress(
            TextColumn("{task.description:>8}"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), console=console, transient=False, disable=not self.live,
        )  # fmt: skip
        self.tasks: dict[str, Any] = {}
        self.shown: dict[str, tuple[int, int]] = {}
        self.step = 0

    def __enter__(self) -> Ui:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def begin_step(self, step: int, steps: int) -> None:
        self.step = step
        for t in self.tasks.values():
            self.progress.remove_task(t)
        self.tasks = {p: self.progress.add_task(p, total=None) for p in PHASES}
        self.shown = {}
        self.console.print(f"[bold]step {step}/{steps}[/]")

    def phase(self, name: str, done: int, total: int) -> None:
        if name not in self.tasks:
            self.tasks[name] = self.progress.add_task(name, total=None)
        self.progress.update(self.tasks[name], completed=done, total=max(total, 1))
        if not self.live and self.shown.get(name) != (done, total) and done in (0, total):
            self.shown[name] = (done, total)
            self.console.print(f"  step {self.step} {name}: {done}/{total}")

    def end_step(self, r: dict[str, Any]) -> None:
        exact = r.get("heldout_exact")
        held = f"held-out {r['heldout_reward']:.3f}"
        held += f" (exact {exact:.3f})" if isinstance(exact, float) else ""
        diff = r["logprob_diff_max"]
        self.console.print(
            f"  step {r['step']}: reward {r['reward_mean']:.3f}, {held}, "
            f"{r['tokens']} tokens, rollout {r['rollout_s']:.1f} s, train {r['train_s']:.1f} s, "
            f"push {r['push_s']:.2f} s, eval {r['eval_s']:.1f} s, injected "
            f"{r['failures_injected']}, recovered {r['failures_recovered']}, logprob diff "
            f"{'none compared' if diff is None else format(diff, '.2g')}, "
            f"weights v{r['weight_version']}"
        )


# `belayer run`'s options (declared here, so that `run` reads as what it does)
RUN_WORKLOAD = typer.Argument(..., help="math or swe.")
RUN_STEPS = typer.Option(2, "--steps", min=1, max=100_000, help="Training steps.")
RUN_TASKS = typer.Option(
    None, "--tasks", min=1, max=4096, help="Tasks per step (default: math 8, swe 4)."
)
RUN_N = typer.Option(
    None, "--n", min=1, max=1024, help="Samples per task, the GRPO group (math 8, swe 2)."
)
RUN_MODEL = typer.Option(
    None,
    "--model",
    help="tiny (the warm-started tiny model of the workload, made once and cached) or a "
    "Qwen3 model directory. Default: a running node's model, else tiny.",
)
RUN_POLICY = typer.Option(
    "risk-aware",
    "--policy",
    help="Sandbox checkpoints: never, always, risk-aware, interval:N, young-daly.",
)
RUN_INJECT = typer.Option(
    "",
    "--inject",
    help="Failures, comma-separated KIND@WHEN: the rollout's kinds and triggers (every "
    "step's rollout) and WHEN step=S (once, during step S) with KIND worker-kill, "
    "sandbox-kill, sandbox-pause, controller-kill, shadow-kill, trainer-kill. E.g. "
    "worker-kill@step=1,sandbox-kill@turn=2,trainer-kill@step=2.",
)
RUN_RESUME = typer.Option(
    False, "--resume", help="Continue the run in --out (default: the newest of the workload)."
)
RUN_JSON = typer.Option(False, "--json", help="Print the final report as JSON.")
RUN_OUT = typer.Option(
    None, "--out", help="Run directory (default: <node run dir>/runs/<workload>-<time>)."
)
RUN_NODE_DIR = typer.Option(
    None,
    "--run-dir",
    help="Where a running node is looked for (default $BELAYER_HOME or "
    "./.belayer); without one the run starts its own under --out.",
)
RUN_DATASET = typer.Option(
    "", "--dataset", help="Dataset file: DAPO-style for math, SWE-Gym instances for swe."
)
RUN_SEED = typer.Option(0, "--seed", min=0, max=2**62, help="Root seed.")
RUN_LR = typer.Option(
    None,
    "--lr",
    min=1e-9,
    max=1.0,
    callback=finite,
    help="Peak learning rate (AdamW; default: math 2e-4, swe 1e-4).",
)
RUN_HELD_OUT = typer.Option(
    None, "--held-out", min=1, max=4096, help="Held-out tasks (default: math 64, swe 2)."
)
RUN_TEMPERATURE = typer.Option(
    1.0, "--temperature", min=0.01, max=10.0, callback=finite, help="Rollout temperature."
)
RUN_RECOVERY = typer.Option(
    "belayer", "--recovery", help="A started node's recovery: belayer or baseline."
)
RUN_KEEP_NODE = typer.Option(False, "--keep-node", help="Leave the node the run started running.")


def run(
    workload: str = RUN_WORKLOAD,
    steps: int = RUN_STEPS,
    tasks: int | None = RUN_TASKS,
    n: int | None = RUN_N,
    model: str | None = RUN_MODEL,
    policy: str = RUN_POLICY,
    inject: str = RUN_INJECT,
    resume: bool = RUN_RESUME,
    json_out: bool = RUN_JSON,
    out: Path | None = RUN_OUT,
    run_dir: Path | None = RUN_NODE_DIR,
    dataset: str = RUN_DATASET,
    seed: int = RUN_SEED,
    lr: float | None = RUN_LR,
    held_out: int | None = RUN_HELD_OUT,
    temperature: float = RUN_TEMPERATURE,
    recovery: str = RUN_RECOVERY,
    keep_node: bool = RUN_KEEP_NODE,
) -> None:
    """Train with GRPO on a node through injected failures: each step rolls out tasks × n
    trajectories, reads their rewards, trains one update, pushes the weights to every engine and
    evaluates the held-out tasks greedily. Writes metrics.jsonl, TensorBoard files, samples.jsonl,
    report.json/.md and plots under the run directory."""
    opts = RunOptions(
        workload=workload, steps=steps, tasks=tasks, n=n, model=model, policy=policy,
        inject=inject, resume=resume, out=out, node_dir=run_dir, dataset=dataset, seed=seed,
        lr=lr, held_out=held_out, temperature=temperature, recovery=recovery,
        keep_node=keep_node,
    )  # fmt: skip
    console = Console(file=sys.stderr)
    try:
        report, records = execute(opts, console)
    except NodeFailed as exc:  # the node's own lines, as `belayer up` and `down` print them
        fail(str(exc))
    except BelayerError as exc:
        fail(one_line(str(exc)), 2 if isinstance(exc, InvalidRequest) else 1)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    if json_out:
        print_json(report)
    else:
        print_summary(report, records, workload)


def print_summary(report: dict[str, Any], records: list[dict[str, Any]], workload: str) -> None:
    """The per-step table, the run's totals in one line, its errors, where the report is."""
    out_console = Console()
    if not out_console.is_terminal:
        out_console = Console(width=120)  # a pipe or a file: the table at full width
    out_console.print(step_table(records, f"belayer run {workload} ({report['run_id']})"))
    typer.echo(
        f"steps {report['steps']}, trajectories {report['trajectories_completed']} "
        f"(lost {report['trajectories_lost']}), injected {report['failures_injected']}, "
        f"recovered {report['failures_recovered']}, env restores {report['env_restores']}, "
        f"handovers {report['handovers']}, trainer restarts {report['trainer_restarts']}, "
        f"weights v{report['weight_version']}, reward {report['reward_first_step']} → "
        f"{report['reward_last_step']}, held-out {report['heldout_reward_start']} → "
        f"{report['heldout_reward_last']}, logprob diff max {report['logprob_diff_max']}, "
        f"{report['wall_seconds']:.0f} s"
    )
    for e in report["errors"]:
        typer.echo(f"error: {e}", err=True)
    typer.echo(f"report: {report['run_dir']}/report.md; plots: {', '.join(report['plots'])}")


def execute(opts: RunOptions, console: Console) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Check everything, find or start the node, train, write the report; the report and
    every step's record (earlier invocations' included)."""
    t_wall = time.monotonic()
    say = console.print
    check_options(opts)
    node_paths = run_paths(opts.node_dir)
    running = running_node(node_paths)
    sandboxed = opts.workload == "swe"
    specs = checked_inject(opts, running, sandboxed)
    out, prior = run_directory(opts, node_paths.root)
    n, tasks = group_shape(opts, running, node_paths, prior)
    seed = prior.seed if prior else opts.seed
    held_out = opts.held_out or DEFAULTS[opts.workload]["held_out"]
    pool, held_ids, _ = choose_tasks(opts.workload, opts.dataset, tasks, opts.steps, held_out, seed)
    model_dir = model_for(opts, running, prior, out, say)
    fp = fingerprint(model_dir)
    if prior and prior.model_fingerprint != fp:
        raise InvalidRequest(
            f"--resume: {out} was trained from another model ({prior.model_dir}), not {model_dir}"
        )
    if sandboxed and running is None and not docker_usable():
        raise InvalidRequest("swe runs sandboxes: Docker + CRIU are needed (deploy/setup.sh)")
    state = prior or RunState(
        run_id=new_run_id(opts.workload), workload=opts.workload, dataset=opts.dataset,
        model_dir=str(model_dir), model_fingerprint=fp, tasks=tasks, n=n, seed=seed,
        policy=opts.policy, pool=pool, held_out=held_ids, created_at=time.time(),
    )  # fmt: skip
    if prior:
        state.incarnations += 1
    if running is not None:
        node = NodeHandle(node_paths, running, ours=False)
        say(f"using the running node in {node_paths.root} (run {running.run_id})")
    else:
        node = start_run_node(opts, state, out, model_dir, resumed=prior is not None, say=say)
    try:
        return asyncio.run(train(opts, state, out, node, model_dir, specs, sandboxed, console,
                                 t_wall))  # fmt: skip
    finally:
        if node.ours and not opts.keep_node:
            stop_node(node.paths)


def checked_inject(opts: RunOptions, running: Any, sandboxed: bool) -> list[Any]:
    """The ``--inject`` specs, parsed and checked against the node they will run on."""
    specs = parse_run_inject(opts.inject, steps=opts.steps, sandboxed=sandboxed)
    if any(s.kind == "shadow-kill" for s in specs) and (
        (running.recovery if running else opts.recovery) == "baseline"
    ):
        raise InvalidRequest("--inject: shadow-kill needs shadows (a baseline node has none)")
    return specs


def run_directory(opts: RunOptions, root: Path) -> tuple[Path, RunState | None]:
    """The run directory (resolved) and, with ``--resume``, the run it holds; a fresh run's
    directory must hold none."""
    if opts.resume:
        out = opts.out or latest_run(root, opts.workload)
        if out is None:
            raise InvalidRequest(f"--resume: no {opts.workload} run under {root}/runs")
        prior = read_state(out)
        if prior is None:
            raise InvalidRequest(f"--resume: {out} holds no run (no readable run.json)")
        if prior.workload != opts.workload or prior.dataset != opts.dataset:
            raise InvalidRequest(
                f"--resume: {out} is a {prior.workload} run"
                + (f" on {prior.dataset}" if prior.dataset else "")
            )
    else:
        out = opts.out or default_out(root, opts.workload)
        prior = None
        if read_state(out) is not None:
            raise InvalidRequest(f"{out} already holds a run: pass --resume, or another --out")
    return out.resolve(), prior


def group_shape(
    opts: RunOptions, running: Any, node_paths: Any, prior: RunState | None
) -> tuple[int, int]:
    """(samples per task, tasks per step): a resumed run's, else a running trainer's, else the
    options' or the workload's defaults; a mismatch with the running trainer is an error."""
    shape = asyncio.run(trainer_shape(running, node_paths)) if running else None
    d = DEFAULTS[opts.workload]
    n = prior.n if prior else opts.n or (shape[0] if shape else d["n"])
    tasks = prior.tasks if prior else opts.tasks or (shape[1] if shape else d["tasks"])
    if shape and (n, tasks) != shape:
        raise InvalidRequest(
            f"the running node's trainer trains {shape[1]} tasks × {shape[0]} samples per step; "
            f"pass --tasks {shape[1]} --n {shape[0]} or stop the node (`belayer down`)"
        )
    if prior and ((opts.n and opts.n != n) or (opts.tasks and opts.tasks != tasks)):
        raise InvalidRequest(f"--resume: the run trains {tasks} tasks × {n} samples per step")
    return n, tasks


def start_run_node(
    opts: RunOptions, state: RunState, out: Path, model_dir: Path, *, resumed: bool, say: Any
) -> NodeHandle:
    """A node of the run's own under ``<run dir>/node``, its trainer checkpointing into
    ``<run dir>/trainer`` (resuming from it when the run is resumed)."""
    paths = run_paths(out / "node")
    if resumed:
        drop_unreplayable_plans(out / "trainer", say)
    say(f"starting a node for the run in {paths.root} …")
    t0 = time.monotonic()
    trainer = run_trainer_config(
        group_size=state.n, groups_per_step=state.tasks, checkpoint_dir=out / "trainer",
        resume=resumed, seed=state.seed, lr=opts.lr or LR_DEFAULTS[opts.workload],
        hold_before_checkpoint_s=opts.hold_before_checkpoint_s,
    )  # fmt: skip
    info = start_node(
        paths, model_dir=model_dir, environment=opts.workload == "swe", trainer=trainer,
        recovery=opts.recovery,
    )  # fmt: skip
    node = NodeHandle(paths, info, ours=True)
    say(f"node ready in {time.monotonic() - t0:.1f} s (run {info.run_id}, {info.recovery})")
    return node


def drop_unreplayable_plans(checkpoint_dir: Path, say: Any) -> None:
    """A fresh node's bus has none of the old trajectories: a step planned after the latest
    checkpoint cannot be redone from them, so its plan goes and the run redoes the step with a
    new rollout."""
    from services.trainer import journal

    latest = journal.latest_checkpoint(checkpoint_dir)
    step = latest[0] if latest else 0
    for plan in journal.plans_after(checkpoint_dir, step):
        journal.plan_path(checkpoint_dir, plan.step).unlink(missing_ok=True)
        say(f"step {plan.step} was not checkpointed: it is run again")


async def trainer_shape(node: Any, paths: Any) -> tuple[int, int]:
    """(group size, tasks per step) of the running node's trainer."""
    handle = NodeHandle(paths, node, ours=False)
    nc = await open_bus(handle)
    try:
        st = await wait_trainer(nc, timeout=10.0)
    finally:
        await nc.drain()
    return st.group_size, st.batch_size // st.group_size


def model_for(opts: RunOptions, running: Any, prior: RunState | None, out: Path, say: Any) -> Path:
    """The model the run starts from (checked: a Qwen3 checkpoint)."""
    explicit = opts.model not in (None, "tiny")
    if running is not None:
        have = Path(running.model_dir).resolve()
        if explicit and Path(str(opts.model)).resolve() != have:
            raise InvalidRequest(
                f"the running node serves {have}, not --model {opts.model}: stop it first"
            )
        return have
    if explicit:
        path = Path(str(opts.model)).resolve()
        check_model_dir(path)
        return path
    if prior is not None and Path(prior.model_dir).is_dir():
        return Path(prior.model_dir)
    path = warm_model(opts.workload, out, say).resolve()
    check_model_dir(path)
    return path


async def train(
    opts: RunOptions,
    state: RunState,
    out: Path,
    node: NodeHandle,
    model_dir: Path,
    specs: list[Any],
    sandboxed: bool,
    console: Console,
    t_wall: float,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    from services.supervisor.config import SupervisorConfig
    from workloads import load_workload

    name, options = workload_spec(opts.workload, opts.dataset)
    wl = load_workload(name, **options)
    nc = await open_bus(node)
    records: list[dict[str, Any]] = []
    earlier = [r for r in read_metrics(out / "metrics.jsonl")] if opts.resume else []
    ctx: RunContext | None = None
    try:
        trainer = await wait_trainer(nc)
        if opts.resume:
            done = trainer.step - state.trainer_base_step
            earlier = [r for r in earlier if r.get("step", 0) <= done]
            rewrite_metrics(out / "metrics.jsonl", earlier)  # steps after it are run again
        else:
            state.trainer_base_step, done = trainer.step, 0
        state.write(out)
        if done >= opts.steps:
            raise InvalidRequest(f"--resume: {out} already has {done} of {opts.steps} steps")
        ctx = RunContext(
            opts=opts, state=state, run_dir=out, node=node, workload=wl, workload_name=name,
            dataset=options.get("path", ""), held_out=[wl.task(t) for t in state.held_out],
            chat=ChatFormat(load_tokenizer(model_dir)), specs=specs, sandboxed=sandboxed,
            start_step=done + 1, steps=opts.steps, base_step=state.trainer_base_step,
            deterministic=node.ours and SupervisorConfig().worker.engine.deterministic,
        )  # fmt: skip
        console.print(
            f"run {state.run_id}: {opts.workload}, steps {ctx.start_step}..{opts.steps}, "
            f"{state.tasks} tasks × {state.n} samples, {len(ctx.held_out)} held-out, model "
            f"{model_dir}, run dir {out}"
        )
        with Ui(console) as ui:
            records = await train_loop(nc, ctx, ui)
    finally:  # metrics.jsonl holds every step recorded, also when the loop was interrupted
        all_records = read_metrics(out / "metrics.jsonl") or earlier + records
        report: dict[str, Any] = {}
        if ctx is not None and ctx.events is not None:
            report = totals(ctx, all_records, time.monotonic() - t_wall)
            report.update(
                run_id=state.run_id, workload=opts.workload, tasks=state.tasks, n=state.n,
                model_dir=str(model_dir), run_dir=str(out), node_dir=str(node.paths.root),
                recovery=node.info.recovery, deterministic=ctx.deterministic,
                inject=[s.text for s in specs], seed=state.seed, per_step=all_records,
                metrics=str(out / "metrics.jsonl"), samples=str(out / "samples.jsonl"),
                tensorboard=str(out / "tb"),
            )  # fmt: skip
            write_report(out, report, all_records)
        await nc.drain()
    return report, all_records
