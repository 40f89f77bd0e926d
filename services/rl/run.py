"""One ``belayer run``, as a library call: check every option, find the running node or start
one for the run, train step after step (``services/rl/loop.py``), write the report
(``services/rl/report.py``). The CLI (``services/cli/run.py``) and the Python API
(``belayer.Node.run``) both call ``execute``."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from common.config import RunPaths, unmakeable_dir
from common.errors import InvalidRequest
from common.heartbeat import process_alive
from common.machine import machine_info
from common.node import read_node
from model.chat import ChatFormat
from model.tokenizer import load_tokenizer
from services.rl.loop import Quiet, RunContext, train_loop
from services.rl.node import (
    NodeHandle,
    docker_usable,
    open_bus,
    run_trainer_config,
    running_node,
    start_node,
    stop_node,
    wait_trainer,
)
from services.rl.options import (
    RunOptions,
    RunState,
    check_model_dir,
    check_options,
    choose_tasks,
    default_out,
    fingerprint,
    latest_run,
    new_run_id,
    objective,
    parse_run_inject,
    read_state,
    warm_model,
    workload_spec,
)
from services.rl.records import totals
from services.rl.report import last_step, read_metrics, rewrite_metrics, write_report
from services.rl.run_workload import (
    RunWorkload,
    node_reward_functions,
    resolve,
    scored_by_rewards,
)
from services.trainer.client import checkpoint_version, roll_back_to
from services.trainer.client import drop_unreplayable_plans as drop_plans


def run_paths(run_dir: Path | None) -> RunPaths:
    """``run_dir`` if given, else ``$BELAYER_HOME``, else ``./.belayer``."""
    return RunPaths(run_dir.resolve()) if run_dir else RunPaths.default()


def execute(
    opts: RunOptions, *, say: Callable[[str], object] = print, ui: Any = None
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Check everything, find or start the node, train, write the report; the report and
    every step's record (earlier invocations' included). ``say`` takes the progress lines,
    ``ui`` (a context manager with ``begin_step``/``phase``/``end_step``; default: none) the
    per-phase progress."""
    t_wall = time.monotonic()
    check_options(opts)
    rw = resolve(opts)  # a plugin and the reward functions loaded here: one line if they fail
    node_paths = run_paths(opts.node_dir)
    running = running_node(node_paths)
    sandboxed = rw.sandboxed
    specs = checked_inject(opts, running, sandboxed)
    out, prior = run_directory(opts, node_paths.root, rw.label)
    n, tasks = group_shape(opts, running, node_paths, prior, rw.defaults)
    seed = prior.seed if prior else opts.seed
    held_out = opts.held_out or rw.defaults["held_out"]
    opts = replace(
        opts,
        eval_every=opts.eval_every or int(rw.defaults.get("eval_every", 1)),
        temperature=rw.temperature if opts.temperature is None else opts.temperature,
    )
    pool, held_ids, _ = choose_tasks(
        opts.workload, opts.dataset, tasks, opts.steps, held_out, seed,
        columns=(opts.prompt_column, opts.answer_column),
        held_out_is_default=opts.held_out is None and (bool(opts.dataset) or rw.plugin),
    )  # fmt: skip
    model_dir = model_for(opts, running, prior, out, say, rw)
    fp = fingerprint(model_dir)
    if prior and prior.model_fingerprint != fp:
        raise InvalidRequest(
            f"--resume: {out} was trained from another model ({prior.model_dir}), not {model_dir}"
        )
    if sandboxed and running is None and not docker_usable():
        raise InvalidRequest(
            f"{opts.workload} runs sandboxes: Docker + CRIU are needed (deploy/setup.sh)"
        )
    state = prior or RunState(
        run_id=new_run_id(rw.label), workload=opts.workload, dataset=opts.dataset,
        prompt_column=opts.prompt_column, answer_column=opts.answer_column,
        model_dir=str(model_dir), model_fingerprint=fp, tasks=tasks, n=n, seed=seed,
        policy=opts.policy, pool=pool, held_out=held_ids, created_at=time.time(),
        rewards=list(opts.rewards), reward_weights=list(opts.reward_weights),
    )  # fmt: skip
    if prior:
        state.incarnations += 1
    if running is not None:
        node = NodeHandle(node_paths, running, ours=False)
        say(f"using the running node in {node_paths.root} (run {running.run_id})")
    else:
        node = start_run_node(opts, state, out, model_dir, rw, resumed=prior is not None, say=say)
    try:
        return asyncio.run(train(opts, state, out, node, model_dir, specs, sandboxed, say,
                                 ui or Quiet(), t_wall))  # fmt: skip
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


def run_directory(
    opts: RunOptions, root: Path, label: str | None = None
) -> tuple[Path, RunState | None]:
    """The run directory (resolved) and, with ``--resume``, the run it holds; a fresh run's
    directory must hold none. ``label`` names the default directory (default: the
    workload)."""
    label = label or opts.workload
    if opts.resume:
        out = opts.out or latest_run(root, label)
        if out is None:
            raise InvalidRequest(f"--resume: no {opts.workload} run under {root}/runs")
        prior = read_state(out)
        if prior is None:
            raise InvalidRequest(f"--resume: {out} holds no run (no readable run.json)")
        was = (prior.workload, prior.dataset, prior.prompt_column, prior.answer_column)
        if was != (opts.workload, opts.dataset, opts.prompt_column, opts.answer_column):
            raise InvalidRequest(
                f"--resume: {out} is a {prior.workload} run"
                + (f" on {prior.dataset}" if prior.dataset else "")
                + (f" (columns {was[2]!r}, {was[3]!r})" if any(was[2:]) else "")
            )
        if (prior.rewards, prior.reward_weights) != (
            list(opts.rewards),
            list(opts.reward_weights),
        ):
            raise InvalidRequest(
                f"--resume: {out} was scored by --reward {prior.rewards or 'none'} "
                f"(weights {prior.reward_weights or 'all 1'}): pass the same"
            )
    else:
        out = opts.out or default_out(root, label)
        prior = None
        if read_state(out) is not None:
            raise InvalidRequest(f"{out} already holds a run: pass --resume, or another --out")
        why = unmakeable_dir(out)
        if why is not None:
            raise InvalidRequest(f"--out {out}: cannot write a run there ({why})")
    return out.resolve(), prior


def group_shape(
    opts: RunOptions,
    running: Any,
    node_paths: Any,
    prior: RunState | None,
    defaults: dict[str, int],
) -> tuple[int, int]:
    """(samples per task, tasks per step): a resumed run's, else a running trainer's, else the
    options' or the workload's ``defaults``; a mismatch with the running trainer is an
    error."""
    shape = asyncio.run(trainer_shape(running, node_paths)) if running else None
    d = defaults
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
    opts: RunOptions,
    state: RunState,
    out: Path,
    model_dir: Path,
    rw: RunWorkload,
    *,
    resumed: bool,
    say: Any,
) -> NodeHandle:
    """A node of the run's own under ``<run dir>/node``, its trainer checkpointing into
    ``<run dir>/trainer`` (resuming from it when the run is resumed); its controller enables
    the run's plugin and reward functions (as ``belayer up --workload-plugin
    --reward-function`` would)."""
    paths = run_paths(out / "node")
    left = read_node(paths)
    if left is not None and process_alive(left.supervisor_pid):
        if left.owner_pid and process_alive(left.owner_pid):
            raise InvalidRequest(
                f"{out} is being trained by another `belayer run` (pid {left.owner_pid}): "
                "stop it first (Ctrl-C or SIGTERM), then --resume"
            )
        say(f"stopping the node an earlier invocation left running in {paths.root} …")
        stop_node(paths)  # --keep-node's, or one whose run is gone and is stopping itself
    first_version = 1
    if resumed:
        restart_point(out, state.trainer_base_step, say)
        # The trainer pushes its checkpoint as the version after the one the store starts at,
        # so the run's weight versions go on where its checkpoint left them.
        first_version = max(1, checkpoint_version(out / "trainer") - 1)
    say(f"starting a node for the run in {paths.root} …")
    t0 = time.monotonic()
    trainer = run_trainer_config(
        group_size=state.n, groups_per_step=state.tasks, checkpoint_dir=out / "trainer",
        resume=resumed, seed=state.seed, lr=opts.lr or rw.lr,
        decay_steps=opts.steps if opts.lr_schedule == "cosine" else 0,
        hold_before_checkpoint_s=opts.hold_before_checkpoint_s, procs=opts.trainer_procs,
        objective=objective(opts),
    )  # fmt: skip
    info = start_node(
        paths, model_dir=model_dir, environment=rw.sandboxed, trainer=trainer,
        recovery=opts.recovery, workload_plugins=rw.node_plugins,
        reward_functions=node_reward_functions(opts),
        owner_pid=0 if opts.keep_node else os.getpid(), first_version=first_version,
    )  # fmt: skip
    node = NodeHandle(paths, info, ours=True)
    say(f"node ready in {time.monotonic() - t0:.1f} s (run {info.run_id}, {info.recovery})")
    return node


def restart_point(out: Path, base_step: int, say: Callable[[str], object]) -> None:
    """Where a resumed run's trainer restarts: its latest checkpoint of a step the run recorded.

    A run stopped between its trainer's checkpoint of a step and the step's record (the
    weights pushed and evaluated, the metrics written) drops that checkpoint and runs the step
    again, so every step trained is a step recorded (deterministic mode redoes it bit for bit:
    the same weights, tasks and seeds). A fresh node's bus has none of the old trajectories, so
    a step planned after the checkpoint cannot be redone from its plan either: the plan goes
    and the step is run again with a new rollout."""
    recorded = last_step(read_metrics(out / "metrics.jsonl"))
    unrecorded = roll_back_to(out / "trainer", base_step + recorded)
    for step in unrecorded:
        say(f"step {step - base_step} was trained but not recorded: it is run again")
    for step in drop_plans(out / "trainer"):
        if step not in unrecorded:
            say(f"step {step - base_step} was not checkpointed: it is run again")


async def trainer_shape(node: Any, paths: Any) -> tuple[int, int]:
    """(group size, tasks per step) of the running node's trainer."""
    handle = NodeHandle(paths, node, ours=False)
    nc = await open_bus(handle)
    try:
        st = await wait_trainer(nc, timeout=10.0)
    finally:
        await nc.drain()
    return st.group_size, st.batch_size // st.group_size


def model_for(
    opts: RunOptions,
    running: Any,
    prior: RunState | None,
    out: Path,
    say: Any,
    rw: RunWorkload | None = None,
) -> Path:
    """The model the run starts from (checked: a Qwen3 or Llama checkpoint). A plugin's run without
    ``--model DIR`` starts from the tiny math model when its tasks are single-turn answer
    tasks; a plugin with sandbox or multi-turn tasks needs ``--model DIR``."""
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
    warm = opts.workload
    if rw is not None and rw.plugin:
        if not rw.single_turn:
            raise InvalidRequest(
                f"--workload {opts.workload}: its tasks are multi-turn or run sandboxes; "
                "pass --model DIR (no tiny model is warm-started for them)"
            )
        warm = "math"  # one-turn answer tasks: the tiny math model answers in that format
    path = warm_model(warm, out, say).resolve()
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
    say: Callable[[str], object],
    ui: Any,
    t_wall: float,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    from services.supervisor.client import SupervisorConfig
    from workloads import load_workload

    name, options = workload_spec(
        opts.workload, opts.dataset, opts.prompt_column, opts.answer_column
    )
    nc = await open_bus(node)
    wl = scored_by_rewards(load_workload(name, **options), opts, nc)
    records: list[dict[str, Any]] = []
    earlier = read_metrics(out / "metrics.jsonl") if opts.resume else []
    ctx: RunContext | None = None
    stopped = False
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
            eval_every=opts.eval_every or 1, temperature=opts.temperature or 1.0,
            deterministic=node.ours and SupervisorConfig().worker.engine.deterministic,
        )  # fmt: skip
        say(
            f"run {state.run_id}: {opts.workload}, steps {ctx.start_step}..{opts.steps}, "
            f"{state.tasks} tasks × {state.n} samples at temperature {ctx.temperature:g}, "
            f"{len(ctx.held_out)} held-out, model "
            f"{model_dir}, run dir {out}"
        )
        with ui:
            records = await train_loop(nc, ctx, ui)
    except (KeyboardInterrupt, asyncio.CancelledError):
        stopped = True
        raise
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
                tensorboard=str(out / "tb"), machine=machine_info(),
            )  # fmt: skip
            write_report(out, report, all_records)
            if stopped:
                last = last_step(all_records)
                say(
                    f"stopped after step {last} of {opts.steps}: the report of the steps "
                    f"recorded is {out / 'report.md'}; the same command with --resume goes on"
                )
        await nc.drain()
    return report, all_records
