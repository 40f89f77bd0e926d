"""``belayer run math|swe``: a GRPO training run on a node — rollout → reward → train → push
weights → eval, step after step (the RL loop of ``services/rl/loop.py``) — through injected
failures, with progress bars, a per-step table and a report under the run directory
(``services/rl/report.py``). Everything is checked first (``services/rl/options.py``): a bad
option, model, dataset, injection or resume directory is one ``error:`` line before anything
starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from belayer.api import train
from common.errors import BelayerError, InvalidRequest
from services.cli.shared import (
    exit_status,
    fail,
    finite,
    one_line,
    print_json,
    progress_console,
    terminate_as_interrupt,
)
from services.rl.node import (
    NodeFailed,
)
from services.rl.options import (
    DEFAULTS,
    LOSS_TYPES,
    LR_DEFAULTS,
    TEMPERATURE_DEFAULTS,
    RunOptions,
)
from services.rl.report import step_table, summary_line
from services.rl.run_workload import PLUGIN_DEFAULTS, PLUGIN_LR, PLUGIN_TEMPERATURE

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
        self.steps = 0
        self.step_seconds: list[float] = []

    def __enter__(self) -> Ui:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def begin_step(self, step: int, steps: int) -> None:
        self.step, self.steps = step, steps
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
        held = f"held-out {r['heldout_reward']:.3f}" if "heldout_reward" in r else "held-out -"
        held += f" (exact {exact:.3f})" if isinstance(exact, float) else ""
        diff = r["logprob_diff_max"]
        self.console.print(
            f"  step {r['step']}: reward {r['reward_mean']:.3f}, {held}, "
            f"{r['tokens']} tokens, rollout {r['rollout_s']:.1f} s, train {r['train_s']:.1f} s, "
            f"push {r['push_s']:.2f} s, eval {r['eval_s']:.1f} s, injected "
            f"{r['failures_injected']}, recovered {r['failures_recovered']}, logprob diff "
            f"{'none compared' if diff is None else format(diff, '.2g')}, "
            f"weights v{r['weight_version']}{self._time_left(r)}"
        )

    def _time_left(self, r: dict[str, Any]) -> str:
        """``, about N s left``: the steps still to run at this invocation's mean step time."""
        self.step_seconds.append(float(r.get("step_s", 0.0)))
        left = self.steps - int(r["step"])
        if left <= 0:
            return ""
        return f", about {left * sum(self.step_seconds) / len(self.step_seconds):.0f} s left"


def per_workload(knob: str) -> str:
    """``math 8, swe 4, a plugin its run_defaults or 4``: a knob's per-workload default, as
    ``services/rl/options.py`` and ``services/rl/run_workload.py`` have it."""
    builtin = ", ".join(f"{w} {d[knob]}" for w, d in DEFAULTS.items())
    return f"{builtin}, a plugin its run_defaults or {PLUGIN_DEFAULTS[knob]}"


# `belayer run`'s options (declared here, so that `run` reads as what it does). Each default is
# RunOptions' (services/rl/options.py), the one place it is stated.
RUN_WORKLOAD = typer.Argument(
    None, help="math or swe (or, instead, --workload for your own workload)."
)
RUN_WORKLOAD_SPEC = typer.Option(
    None,
    "--workload",
    help="Your own workload: a plugin package.module:factory (importable: installed, or on "
    "PYTHONPATH) or an installed package's belayer.workloads entry point; the node the run "
    "starts loads it (docs/workloads.md).",
)
RUN_REWARD = typer.Option(
    [],
    "--reward",
    help="A reward function package.module:function (or service:NAME) scoring the rollouts "
    "instead of the workload's reward, TRL-shaped: fn(prompts, completions, **columns) -> "
    "list[float | None] (repeatable; the node the run starts enables each).",
)
RUN_REWARD_WEIGHTS = typer.Option(
    [], "--reward-weights", help="One weight per --reward, in order (default: all 1)."
)
RUN_STEPS = typer.Option(RunOptions.steps, "--steps", min=1, max=100_000, help="Training steps.")
RUN_TASKS = typer.Option(
    RunOptions.tasks, "--tasks", min=1, max=4096,
    help=f"Tasks per step (default: {per_workload('tasks')}).",
)  # fmt: skip
RUN_N = typer.Option(
    RunOptions.n, "--n", min=1, max=1024,
    help=f"Samples per task, the GRPO group (default: {per_workload('n')}).",
)  # fmt: skip
RUN_MODEL = typer.Option(
    RunOptions.model,
    "--model",
    help="tiny (the warm-started tiny model of the workload, made once and cached) or a "
    "Qwen3 or Llama model directory (HF layout). Default: a running node's model, else tiny.",
)
RUN_POLICY = typer.Option(
    RunOptions.policy,
    "--policy",
    help="Sandbox checkpoints: never, always, risk-aware, interval:N, young-daly.",
)
RUN_INJECT = typer.Option(
    RunOptions.inject,
    "--inject",
    help="Failures, comma-separated KIND@WHEN: the rollout's kinds and triggers (every "
    "step's rollout) and WHEN step=S (once, during step S) with KIND worker-kill, "
    "sandbox-kill, sandbox-pause, controller-kill, shadow-kill, trainer-kill. E.g. "
    "worker-kill@step=1,trainer-kill@step=2 or sandbox-kill@turn=2.",
)
RUN_RESUME = typer.Option(
    RunOptions.resume,
    "--resume",
    help="Continue the run in --out (default: the newest of the workload).",
)
RUN_JSON = typer.Option(False, "--json", help="Print the final report as JSON.")
RUN_OUT = typer.Option(
    RunOptions.out, "--out", help="Run directory (default: <node run dir>/runs/<workload>-<time>)."
)
RUN_NODE_DIR = typer.Option(
    RunOptions.node_dir,
    "--run-dir",
    help="Where a running node is looked for (default $BELAYER_HOME or "
    "./.belayer); without one the run starts its own under --out.",
)
RUN_DATASET = typer.Option(
    RunOptions.dataset,
    "--dataset",
    help="Dataset: DAPO-style for math, SWE-Gym instances for swe; a .jsonl, .json or .parquet "
    "file or a directory saved by datasets' save_to_disk.",
)
RUN_PROMPT_COLUMN = typer.Option(
    RunOptions.prompt_column,
    "--prompt-column",
    help="math --dataset: the prompt column (a string, asked with the math instruction, or a "
    "list of {role, content}); reads the dataset as a prompt/answer table.",
)
RUN_ANSWER_COLUMN = typer.Option(
    RunOptions.answer_column,
    "--answer-column",
    help="math --dataset: the answer column (a string or a number; a.b: key b of column a), "
    "matched against the response's last 'Answer:' line.",
)
RUN_SEED = typer.Option(RunOptions.seed, "--seed", min=0, max=2**62, help="Root seed.")
RUN_LR = typer.Option(
    RunOptions.lr,
    "--lr",
    min=1e-9,
    max=1.0,
    callback=finite,
    help="Peak learning rate (AdamW; default: "
    + ", ".join(f"{w} {lr:.0e}".replace("e-0", "e-") for w, lr in LR_DEFAULTS.items())
    + f", a plugin its run_defaults or {PLUGIN_LR:.0e}".replace("e-0", "e-")
    + ").",
)
RUN_LR_SCHEDULE = typer.Option(
    RunOptions.lr_schedule, "--lr-schedule",
    help="The learning rate over the run: cosine (from the peak to 0 over --steps) or "
    "constant (a node the run starts).",
)  # fmt: skip
RUN_HELD_OUT = typer.Option(
    RunOptions.held_out, "--held-out", min=1, max=4096,
    help=f"Held-out tasks (default: {per_workload('held_out')}; with --dataset at most its "
    "held-out rows).",
)  # fmt: skip
RUN_EVAL_EVERY = typer.Option(
    RunOptions.eval_every, "--eval-every", min=1,
    help="Evaluate the held-out tasks after every this many steps and after the last (always "
    f"before training; default: {per_workload('eval_every')}).",
)  # fmt: skip
RUN_TEMPERATURE = typer.Option(
    RunOptions.temperature,
    "--temperature",
    min=0.01,
    max=10.0,
    callback=finite,
    help="Rollout temperature (default: "
    + ", ".join(f"{w} {t:g}" for w, t in TEMPERATURE_DEFAULTS.items())
    + f", a plugin {PLUGIN_TEMPERATURE:g}).",
)
RUN_LOSS_TYPE = typer.Option(
    RunOptions.loss_type, "--loss-type",
    help="How per-token losses are aggregated, as TRL's loss_type: " + ", ".join(LOSS_TYPES)
    + " (a node the run starts).",
)  # fmt: skip
RUN_BETA = typer.Option(
    RunOptions.beta, "--beta", min=0.0, max=100.0, callback=finite,
    help="KL coefficient towards the weights the run started from (TRL's beta; 0: no KL, no "
    "reference model).",
)  # fmt: skip
RUN_MINIBATCHES = typer.Option(
    RunOptions.minibatches, "--minibatches", min=1, max=64,
    help="Optimiser steps per rollout batch (the batch split in order; 1: one update a step).",
)  # fmt: skip
RUN_RECOVERY = typer.Option(
    RunOptions.recovery, "--recovery", help="A started node's recovery: belayer or baseline."
)
RUN_TRAINER_PROCS = typer.Option(
    RunOptions.trainer_procs, "--trainer-procs", min=1, max=64,
    help="Data-parallel ranks of the trainer of a node the run starts (belayer up "
    "--trainer-procs).",
)  # fmt: skip
RUN_KEEP_NODE = typer.Option(
    RunOptions.keep_node, "--keep-node", help="Leave the node the run started running."
)


def run(
    workload: str | None = RUN_WORKLOAD,
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
    prompt_column: str = RUN_PROMPT_COLUMN,
    answer_column: str = RUN_ANSWER_COLUMN,
    seed: int = RUN_SEED,
    lr: float | None = RUN_LR,
    lr_schedule: str = RUN_LR_SCHEDULE,
    held_out: int | None = RUN_HELD_OUT,
    eval_every: int | None = RUN_EVAL_EVERY,
    temperature: float | None = RUN_TEMPERATURE,
    loss_type: str = RUN_LOSS_TYPE,
    beta: float = RUN_BETA,
    minibatches: int = RUN_MINIBATCHES,
    recovery: str = RUN_RECOVERY,
    keep_node: bool = RUN_KEEP_NODE,
    trainer_procs: int = RUN_TRAINER_PROCS,
    workload_spec: str | None = RUN_WORKLOAD_SPEC,
    reward: list[str] = RUN_REWARD,
    reward_weights: list[float] = RUN_REWARD_WEIGHTS,
) -> None:
    """Train with GRPO on a node through injected failures: each step rolls out tasks × n
    trajectories, reads their rewards, trains one update, pushes the weights to every engine and
    evaluates the held-out tasks greedily. Writes metrics.jsonl, TensorBoard files, samples.jsonl,
    report.json/.md and plots under the run directory."""
    workload = one_workload(workload, workload_spec)
    opts = RunOptions(
        workload=workload, steps=steps, tasks=tasks, n=n, model=model, policy=policy,
        inject=inject, resume=resume, out=out, node_dir=run_dir, dataset=dataset, seed=seed,
        lr=lr, lr_schedule=lr_schedule, held_out=held_out, eval_every=eval_every, temperature=temperature, recovery=recovery,
        keep_node=keep_node, prompt_column=prompt_column, answer_column=answer_column,
        rewards=tuple(reward), reward_weights=tuple(reward_weights),
        trainer_procs=trainer_procs, loss_type=loss_type, beta=beta, minibatches=minibatches,
    )  # fmt: skip
    console = progress_console()
    terminate_as_interrupt()
    try:
        report, records = train(opts, say=console.print, ui=Ui(console))
    except NodeFailed as exc:  # the node's own lines, as `belayer up` and `down` print them
        fail(str(exc))
    except BelayerError as exc:
        fail(one_line(str(exc)), 2 if isinstance(exc, InvalidRequest) else 1)
    except KeyboardInterrupt:
        raise typer.Exit(exit_status()) from None
    if json_out:
        print_json(report)
    else:
        print_summary(report, records, workload)


def one_workload(positional: str | None, spec: str | None) -> str:
    """The run's workload: ``math``/``swe`` as the argument, or ``--workload SPEC``."""
    if positional and spec:
        fail("give the workload once: math or swe, or --workload package.module:factory", 2)
    if spec:
        return spec  # checked with the other options (services/rl/options.check_options)
    if not positional:
        fail("missing the workload: math, swe, or --workload package.module:factory", 2)
    return positional


def print_summary(report: dict[str, Any], records: list[dict[str, Any]], workload: str) -> None:
    """The per-step table, the run's totals in one line, its errors, where the report is."""
    out_console = Console()
    if not out_console.is_terminal:
        out_console = Console(width=120)  # a pipe or a file: the table at full width
    out_console.print(step_table(records, f"belayer run {workload} ({report['run_id']})"))
    typer.echo(summary_line(report))
    for e in report["errors"]:
        typer.echo(f"error: {e}", err=True)
    typer.echo(f"report: {report['run_dir']}/report.md; plots: {', '.join(report['plots'])}")
