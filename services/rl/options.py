"""A run (``belayer run``), before anything starts: the options checked, the model found (or warm
started), the tasks of every step chosen, the injections parsed and scheduled, the run
directory prepared (``run.json``). Every problem here is one ``InvalidRequest`` line; nothing
has been started yet.

The injection grammar is the rollout's (``services.controller.client.parse_inject``) extended
with the trigger ``step=S`` ("during training step S") and two kinds the run carries out itself:

    worker-kill@step=S      step S's rollout: the busiest engine's main worker is SIGKILLed at
                            the first token of a response (swe; math: at the rollout's start)
    sandbox-kill@step=S     step S's rollout, trajectory #0, right after its first action
    sandbox-pause@step=S    likewise, a hang
    controller-kill@step=S  step S's rollout (the controller kills itself; adopted on restart)
    shadow-kill@step=S      a shadow worker SIGKILLed while step S's rollout runs
    trainer-kill@step=S     the trainer SIGKILLed while it runs step S's update

Items with the rollout's own triggers (``turn=T[/i]``, ``p=P``, ``s=SECONDS``) apply to every
step's rollout, exactly as ``belayer rollout --inject`` would.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast, get_args

from common.errors import BelayerError, InvalidRequest
from schemas.rollout import FaultSpec
from services.controller.client import KINDS, TRIGGERS, Trigger, parse_inject, parse_policy
from services.trainer.client import GrpoConfig, LossType, TrainerConfig
from workloads import plugins
from workloads.table import dataset_workload

WORKLOADS = ("math", "swe")
"""The built-in workloads ``belayer run`` trains on (``--dataset`` swaps in the ``dapo`` /
``swe-gym`` loader); ``--workload SPEC`` names a plugin (``services/rl/run_workload.py``)."""
RUN_KINDS = ("trainer-kill", "shadow-kill")
"""Injection kinds the run carries out itself (only with ``step=S``)."""
SANDBOX_KINDS = ("sandbox-kill", "sandbox-pause")
RUN_FILE = "run.json"
DEFAULTS: dict[str, dict[str, int]] = {
    "math": {"tasks": 8, "n": 8, "held_out": 64, "eval_every": 1},
    "swe": {"tasks": 4, "n": 2, "held_out": 18, "eval_every": 5},
}
"""Per workload: tasks per step, samples per task (the GRPO group), held-out tasks, steps
between held-out evaluations — sized so 20 steps fit in about ten minutes on two CPU cores
(docs/training.md); swe's 18 held-out tasks are 12 held-out instances of the training
families and two tasks of each of the 3 held-out families (``workloads.swe``), evaluated at
steps 0, 5, 10, 15 and 20: about thirteen minutes for 20 steps."""
LR_DEFAULTS: dict[str, float] = {"math": 5e-5, "swe": 1e-4}
"""Per workload: the peak learning rate of a node the run starts (docs/training.md)."""
TEMPERATURE_DEFAULTS: dict[str, float] = {"math": 1.0, "swe": 0.7}
"""Per workload: the training rollouts' sampling temperature (docs/training.md: swe's name-free
fixes are long ``sed -E`` scripts that sampling at 1 garbles; at 0.7 more of them run)."""
LOSS_TYPES: tuple[str, ...] = get_args(LossType)
"""``--loss-type``: TRL's ``loss_type`` values (``GrpoConfig.loss_type``)."""
LR_SCHEDULES = ("cosine", "constant")
"""``--lr-schedule``: ``cosine`` falls from the peak to 0 over the run's steps (a node the run
starts), ``constant`` keeps the peak."""


@dataclass(frozen=True)
class RunOptions:
    """What ``belayer run`` was asked (the command line, before any defaulting)."""

    workload: str
    """``math``, ``swe``, or a plugin: ``package.module:factory`` or an installed package's
    ``belayer.workloads`` entry-point name (``belayer run --workload``)."""
    steps: int = 2
    """Training steps of this run (after resume: the total)."""
    tasks: int | None = None
    """Tasks per step (None: the workload's default, or the running trainer's)."""
    n: int | None = None
    """Samples per task (None: the workload's default, or the running trainer's group)."""
    model: str | None = None
    """``tiny`` (the warm-started tiny model of the workload), a model directory, or None
    (a running node's model, else ``tiny``)."""
    policy: str = "risk-aware"
    """Sandbox checkpoint policy of the rollouts."""
    inject: str = ""
    """Failures to inject (module doc)."""
    resume: bool = False
    """Continue the run in ``out`` (default: the newest run of the workload)."""
    out: Path | None = None
    """The run directory (default ``<node dir>/runs/<workload>-<time>``)."""
    node_dir: Path | None = None
    """Where a running node is looked for (``--run-dir``; default ``$BELAYER_HOME`` or
    ``./.belayer``)."""
    dataset: str = ""
    """A dataset (math: DAPO-style, swe: SWE-Gym instances): a ``.jsonl``, ``.json`` or
    ``.parquet`` file or a ``datasets`` ``save_to_disk`` directory."""
    prompt_column: str = ""
    """The math dataset's prompt column (set: read as a ``table``, ``workloads.table``)."""
    answer_column: str = ""
    """The math dataset's answer column (set: read as a ``table``)."""
    seed: int = 0
    """Root seed of the rollouts and the trainer."""
    lr: float | None = None
    """Peak learning rate (a node the run starts; None: the workload's default)."""
    lr_schedule: str = "cosine"
    """The learning rate over the run (``LR_SCHEDULES``; a node the run starts)."""
    held_out: int | None = None
    """Held-out tasks evaluated greedily before training and after every ``eval_every``-th
    step and the last."""
    eval_every: int | None = None
    """Evaluate the held-out tasks after every this many steps (and after the last; step 0
    always); None: the workload's default (``DEFAULTS``)."""
    temperature: float | None = None
    """Sampling temperature of the training rollouts (None: the workload's default,
    ``TEMPERATURE_DEFAULTS``, or a plugin's)."""
    loss_type: str = GrpoConfig.loss_type
    """How per-token losses are aggregated (TRL's ``loss_type``; a node the run starts)."""
    beta: float = GrpoConfig.beta
    """KL coefficient towards the weights the run started from (a node the run starts)."""
    minibatches: int = GrpoConfig.minibatches
    """Optimiser steps per rollout batch (a node the run starts)."""
    recovery: str = "belayer"
    """Recovery mode of a node the run starts (``baseline``: no shadows, cold restarts)."""
    keep_node: bool = False
    """Leave a node the run started running at the end."""
    hold_before_checkpoint_s: float = 0.0
    """Trainer: pause between an update and its checkpoint (a kill window; benchmarks)."""
    trainer_procs: int = TrainerConfig.procs
    """Data-parallel ranks of the trainer of a node the run starts (``belayer up
    --trainer-procs``)."""
    rewards: tuple[str, ...] = ()
    """Reward functions (``package.module:function`` or ``service:<name>``) scoring the
    rollouts instead of the workload's own reward; a node the run starts enables them."""
    reward_weights: tuple[float, ...] = ()
    """One weight per reward function (empty: all 1)."""


@dataclass(frozen=True)
class StepFaults:
    """What is injected during one step."""

    rollout: list[FaultSpec] = field(default_factory=list)
    """Specs for the step's rollout (the controller carries them out)."""
    trainer_kill: str = ""
    """The spec text of a trainer kill during the step's update (empty: none)."""
    shadow_kill: str = ""
    """The spec text of a shadow kill during the step's rollout (empty: none)."""


def step_trigger(text: str) -> tuple[float, int]:
    """``step=S``: a whole number S ≥ 1."""
    if not text.isdigit() or int(text) < 1:
        raise ValueError("step=S needs a whole number S ≥ 1")
    return float(int(text)), -1


RUN_TRIGGERS: dict[str, Trigger] = {
    **TRIGGERS,
    "step": Trigger(step_trigger, "step=S: during training step S"),
}


def parse_run_inject(text: str, *, steps: int, sandboxed: bool) -> list[FaultSpec]:
    """The run's injections; ``InvalidRequest`` naming the bad item."""
    try:
        specs = parse_inject(text, kinds=(*KINDS, *RUN_KINDS), triggers=RUN_TRIGGERS)
    except ValueError as exc:
        raise InvalidRequest(f"--inject: {exc}") from None
    for s in specs:
        if s.kind in RUN_KINDS and s.trigger != "step":
            raise InvalidRequest(f"--inject: {s.text!r}: {s.kind} takes only step=S")
        if s.trigger == "step" and s.value > steps:
            raise InvalidRequest(f"--inject: {s.text!r}: the run has {steps} steps")
        if s.kind in SANDBOX_KINDS and not sandboxed:
            raise InvalidRequest(f"--inject: {s.text!r}: this workload runs no sandbox")
    return specs


def faults_of(specs: list[FaultSpec], step: int, *, sandboxed: bool) -> StepFaults:
    """The injections of ``step`` (1-based): rollout specs (``step=S`` ones translated into the
    rollout grammar), and the kills the run does itself."""
    rollout: list[FaultSpec] = []
    trainer_kill = shadow_kill = ""
    for s in specs:
        if s.trigger != "step":
            rollout.append(s)
            continue
        if int(s.value) != step:
            continue
        if s.kind == "trainer-kill":
            trainer_kill = s.text
        elif s.kind == "shadow-kill":
            shadow_kill = s.text
        elif s.kind in SANDBOX_KINDS:
            rollout.append(FaultSpec(kind=s.kind, trigger="turn", value=1, target=0, text=s.text))
        elif sandboxed:  # worker-kill / controller-kill: at the first token of turn 2
            rollout.append(FaultSpec(kind=s.kind, trigger="turn", value=1, text=s.text))
        else:  # single-turn tasks have no action to fire after: at the rollout's start
            rollout.append(FaultSpec(kind=s.kind, trigger="s", value=0.0, text=s.text))
    return StepFaults(rollout=rollout, trainer_kill=trainer_kill, shadow_kill=shadow_kill)


# --- the model -------------------------------------------------------------------------------
def check_model_dir(path: Path, chat: bool = True) -> None:
    """``InvalidRequest`` unless ``path`` holds a checkpoint Belayer serves (a Qwen3 or Llama
    family, ``model.qwen3.FAMILIES``) with a tokenizer, a ChatML one unless ``chat`` is false
    (serving alone, ``belayer up``, needs no chat format)."""
    from model.config import load_model_config

    def bad(why: str) -> InvalidRequest:
        return InvalidRequest(f"--model {path} is not a Qwen3 or Llama checkpoint: {why}")

    if not path.is_dir():
        raise bad("no such directory")
    try:
        load_model_config(path)
    except FileNotFoundError:
        raise bad("no config.json") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise bad(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None
    if (
        not (path / "model.safetensors").exists()
        and not (path / "model.safetensors.index.json").exists()
    ):
        raise bad("no model.safetensors (or index)")
    if not (path / "tokenizer.json").exists():
        raise bad("no tokenizer.json")
    if not chat:
        return
    try:
        from model.chat import ChatFormat
        from model.tokenizer import load_tokenizer

        _ = ChatFormat(load_tokenizer(path)).im_end
    except (ValueError, OSError, Exception) as exc:
        raise bad(f"its tokenizer: {exc}") from None


def fingerprint(path: Path) -> str:
    """A digest of the model's config, tokenizer and weights (what ``--resume`` compares)."""
    h = hashlib.sha256()
    files = ["config.json", "tokenizer.json", *sorted(p.name for p in path.glob("*.safetensors"))]
    for name in files:
        f = path / name
        if not f.exists():
            continue
        h.update(name.encode())
        size = f.stat().st_size
        with f.open("rb") as fh:
            if size <= 512 * 1024 * 1024:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
            else:  # a big checkpoint: its header, its size and both ends
                h.update(fh.read(1 << 20))
                fh.seek(size - (1 << 20))
                h.update(fh.read(1 << 20))
                h.update(str(size).encode())
    return h.hexdigest()[:32]


def warm_model(workload: str, run_dir: Path, say: Any) -> Path:
    """The warm-started tiny model of ``workload`` (``belayer model init --tiny --warm-start``),
    installed under the run directory; trained once, then copied from the cache."""
    from services.rl.warm import warm_start

    out = run_dir / "model"
    t0 = time.monotonic()
    say(f"warm-started tiny {workload} model → {out} (trained once, then cached)")
    path, _, built = warm_start(workload, out)
    if built:
        say(f"warm start trained in {time.monotonic() - t0:.0f} s")
    return path


# --- tasks ------------------------------------------------------------------------------------
def workload_spec(
    workload: str, dataset: str, prompt_column: str = "", answer_column: str = ""
) -> tuple[str, dict[str, Any]]:
    """The registry name and options ``--dataset`` (and its columns) select: math's dataset is
    read by ``dapo``, or by ``table`` when columns are named; swe's by ``swe-gym``."""
    if not dataset:
        return dataset_workload(workload, dataset, prompt_column, answer_column)
    path = str(Path(dataset).resolve())
    name = {"math": "dapo", "swe": "swe-gym"}.get(workload, workload)  # a plugin: its own
    return dataset_workload(name, path, prompt_column, answer_column)


def choose_tasks(
    workload: str,
    dataset: str,
    tasks: int,
    steps: int,
    held_out: int,
    seed: int,
    columns: tuple[str, str] = ("", ""),
    held_out_is_default: bool = False,
) -> tuple[list[str], list[str], bool]:
    """(training pool of task ids, held-out task ids, sandboxed). The pool is cycled through,
    ``tasks`` per step; errors (no such dataset, no tasks, too many asked) are one line.
    ``columns``: the dataset's prompt and answer columns (empty: the loader's own);
    ``held_out_is_default``: a dataset holding fewer held-out tasks gives them all."""
    from workloads import load_workload

    name, options = workload_spec(workload, dataset, *columns)
    try:
        wl = load_workload(name, **options)
        first = wl.tasks(tasks, seed)
    except BelayerError as exc:
        where = f"dataset {dataset}" if dataset else f"workload {workload}"
        raise InvalidRequest(f"{where}: {exc}") from None
    except (OSError, ValueError) as exc:
        raise InvalidRequest(f"dataset {dataset}: {exc}") from None
    if not first:
        raise InvalidRequest(f"dataset {dataset or workload} holds no tasks")
    try:
        pool = wl.tasks(tasks * steps, seed)
    except BelayerError:
        pool = first  # a small task set: the same tasks every step
    try:
        evaluation = wl.held_out(held_out)
    except BelayerError as exc:
        available = exc.data.get("available") if held_out_is_default else None
        if not isinstance(available, int) or available < 1:
            raise InvalidRequest(f"--held-out: {exc}") from None
        evaluation = wl.held_out(available)
    sandboxed = any(t.sandbox is not None for t in first)
    return [t.id for t in pool], [t.id for t in evaluation], sandboxed


def step_tasks(pool: list[str], step: int, tasks: int) -> list[str]:
    """The task ids of ``step`` (1-based): the pool, cycled."""
    return [pool[((step - 1) * tasks + i) % len(pool)] for i in range(tasks)]


# --- the run directory ----------------------------------------------------------------------
@dataclass
class RunState:
    """``run.json``: what the run is, fixed at its start (``--resume`` checks against it)."""

    run_id: str
    workload: str
    dataset: str
    model_dir: str
    model_fingerprint: str
    tasks: int
    n: int
    seed: int
    policy: str
    pool: list[str]
    held_out: list[str]
    created_at: float
    trainer_base_step: int = 0
    """The trainer's step count when the run started (a running node may have trained)."""
    prompt_column: str = ""
    """``--prompt-column`` of the dataset (empty: the loader's own)."""
    answer_column: str = ""
    """``--answer-column`` of the dataset (empty: the loader's own)."""
    rewards: list[str] = field(default_factory=list)
    """``--reward`` functions scoring the rollouts (empty: the workload's reward)."""
    reward_weights: list[float] = field(default_factory=list)
    """``--reward-weights``."""
    incarnations: int = 1
    """Times the run was started (``--resume`` adds one; names its rollouts)."""

    def write(self, run_dir: Path) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        tmp = run_dir / f".{RUN_FILE}.tmp-{os.getpid()}"
        tmp.write_text(json.dumps(asdict(self), indent=2))
        tmp.replace(run_dir / RUN_FILE)


def read_state(run_dir: Path) -> RunState | None:
    try:
        data = json.loads((run_dir / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None
    known = set(RunState.__dataclass_fields__)
    try:
        return RunState(**{k: v for k, v in data.items() if k in known})
    except TypeError:
        return None


def default_out(node_root: Path, workload: str) -> Path:
    return node_root / "runs" / f"{workload}-{time.strftime('%Y%m%d-%H%M%S')}"


def latest_run(node_root: Path, workload: str) -> Path | None:
    runs = sorted((node_root / "runs").glob(f"{workload}-*"), key=lambda p: p.name)
    runs = [r for r in runs if (r / RUN_FILE).exists()]
    return runs[-1] if runs else None


def new_run_id(workload: str) -> str:
    return f"{workload}{uuid.uuid4().hex[:8]}"


def objective(o: RunOptions) -> GrpoConfig:
    """The GRPO objective of a node the run starts (``--loss-type``, ``--beta``,
    ``--minibatches``); ``ValueError`` for values it refuses."""
    if o.loss_type not in LOSS_TYPES:
        raise ValueError(f"loss type must be one of {', '.join(LOSS_TYPES)}, got {o.loss_type!r}")
    return GrpoConfig(
        loss_type=cast(LossType, o.loss_type),
        beta=o.beta,
        minibatches=o.minibatches,
    )


def check_options(o: RunOptions) -> None:
    """The checks that need nothing but the options."""
    if o.workload not in WORKLOADS and not (
        plugins.is_spec(o.workload) or o.workload in plugins.entry_points()
    ):
        raise InvalidRequest(
            f"unknown workload {o.workload!r} (one of {', '.join(WORKLOADS)}, or a plugin: "
            "--workload package.module:factory)"
        )
    if o.steps < 1:
        raise InvalidRequest(f"--steps must be at least 1, got {o.steps}")
    if o.recovery not in ("belayer", "baseline"):
        raise InvalidRequest("--recovery must be 'belayer' or 'baseline'")
    if o.lr_schedule not in LR_SCHEDULES:
        raise InvalidRequest(f"--lr-schedule must be one of {', '.join(LR_SCHEDULES)}")
    try:
        objective(o)
    except ValueError as exc:
        raise InvalidRequest(f"--loss-type/--beta/--minibatches: {exc}") from None
    try:
        parse_policy(o.policy)
    except ValueError as exc:
        raise InvalidRequest(f"--policy: {exc}") from None
    if o.dataset and not Path(o.dataset).exists():
        raise InvalidRequest(f"--dataset {o.dataset}: no such file or directory")
    try:
        workload_spec(o.workload, o.dataset, o.prompt_column, o.answer_column)
    except BelayerError as exc:
        raise InvalidRequest(str(exc)) from None
