"""What ``belayer run`` trains on, resolved before anything starts: a built-in workload
(``math``, ``swe``: the per-workload defaults of ``services/rl/options.py``) or a plugin
(``--workload package.module:factory``, or an installed package's ``belayer.workloads``
entry point), loaded here once — a module that does not import, a factory that raises or
returns no workload, or a bad ``run_defaults`` is one ``InvalidRequest`` line — with the
reward functions of ``--reward`` imported alike.

A plugin's workload may declare its run's defaults as an attribute ``run_defaults``, a dict
with any of ``tasks``, ``n``, ``held_out`` (whole numbers ≥ 1) and ``lr`` (a number in
(0, 1]); what it leaves out comes from ``PLUGIN_DEFAULTS`` / ``PLUGIN_LR`` (docs/workloads.md,
"Training on your own workload").
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from common.errors import BelayerError, InvalidRequest
from services.rl.options import (
    DEFAULTS,
    LR_DEFAULTS,
    TEMPERATURE_DEFAULTS,
    WORKLOADS,
    RunOptions,
    workload_spec,
)
from workloads import Outcome, Task, Workload, plugins
from workloads.rewards import (
    RewardFunctions,
    check_weights,
    declared_rewards,
    load_reward_functions,
    service_name,
)

PLUGIN_DEFAULTS: dict[str, int] = {"tasks": 4, "n": 4, "held_out": 8, "eval_every": 1}
"""A plugin's run where its workload declares no ``run_defaults``: tasks per step, samples per
task, held-out tasks (at most what the workload holds out), steps between held-out
evaluations."""
PLUGIN_LR = 1e-4
"""A plugin's peak learning rate where its workload declares none."""
PLUGIN_TEMPERATURE = 1.0
"""A plugin's rollout temperature where ``--temperature`` gives none."""
DEFAULT_KEYS = ("tasks", "n", "held_out", "eval_every", "lr")
"""The keys a workload's ``run_defaults`` may set."""


@dataclass(frozen=True)
class RunWorkload:
    """The run's workload, decided before anything starts."""

    spec: str
    """What the run names (``math``, ``swe`` or the plugin's spec); ``run.json`` records it."""
    label: str
    """Names the run's directory and id: the workload's own name, file-name safe."""
    defaults: dict[str, int]
    """``tasks``, ``n``, ``held_out`` where the options give none."""
    lr: float
    """The peak learning rate where ``--lr`` gives none."""
    temperature: float
    """The rollouts' temperature where ``--temperature`` gives none."""
    sandboxed: bool
    """Its tasks run in sandboxes (the node starts its environment service)."""
    single_turn: bool
    """Its tasks are answered in one response (no sandbox, one turn)."""
    plugin: bool
    """A plugin (enabled on the node the run starts, ``--workload-plugin``)."""

    @property
    def node_plugins(self) -> tuple[str, ...]:
        """What the node the run starts enables as ``--workload-plugin``."""
        return (self.spec,) if plugins.is_spec(self.spec) else ()


def is_plugin(workload: str) -> bool:
    """Whether ``belayer run`` reads ``workload`` as a plugin (not ``math``/``swe``)."""
    return workload not in WORKLOADS


def resolve(opts: RunOptions) -> RunWorkload:
    """The run's workload (a plugin loaded here: every failure one line) with its reward
    functions checked."""
    check_rewards(opts)
    if not is_plugin(opts.workload):
        return RunWorkload(
            spec=opts.workload, label=opts.workload, defaults=DEFAULTS[opts.workload],
            lr=LR_DEFAULTS[opts.workload], temperature=TEMPERATURE_DEFAULTS[opts.workload],
            sandboxed=opts.workload == "swe",
            single_turn=opts.workload == "math", plugin=False,
        )  # fmt: skip
    from workloads import load_workload

    where = f"--workload {opts.workload!r}"
    try:
        name, options = workload_spec(
            opts.workload, opts.dataset, opts.prompt_column, opts.answer_column
        )
        wl = load_workload(name, **options)
        first = wl.tasks(1, opts.seed)
    except BelayerError as exc:
        raise InvalidRequest(f"{where}: {exc}") from None
    except Exception as exc:  # the plugin's own tasks() failed: its code, one line
        raise InvalidRequest(
            f"{where}: the workload's tasks() raised: {type(exc).__name__}: {exc}"
        ) from None
    if not first:
        raise InvalidRequest(f"{where}: the workload gave no tasks")
    declared = run_defaults(where, getattr(wl, "run_defaults", None))
    try:
        declared_rewards(wl)
    except BelayerError as exc:
        raise InvalidRequest(f"{where}: {exc}") from None
    lr = declared.pop("lr", PLUGIN_LR)
    sandboxed = any(t.sandbox is not None for t in first)
    if sandboxed and any(not service_name(s) for s in opts.rewards):
        raise InvalidRequest(
            "--reward: reward functions score answer tasks (no sandbox); reward services may"
        )
    return RunWorkload(
        spec=opts.workload, label=label_of(str(wl.name)),
        defaults={**PLUGIN_DEFAULTS, **{k: int(v) for k, v in declared.items()}}, lr=float(lr),
        temperature=PLUGIN_TEMPERATURE, sandboxed=sandboxed,
        single_turn=not sandboxed and all(t.limits.max_turns == 1 for t in first), plugin=True,
    )  # fmt: skip


def check_rewards(opts: RunOptions) -> None:
    """Import every ``--reward`` now and check ``--reward-weights`` against them."""
    if opts.reward_weights and not opts.rewards:
        raise InvalidRequest("--reward-weights weighs --reward functions: give them")
    if opts.rewards and opts.workload == "swe":
        raise InvalidRequest("--reward: reward functions score answer tasks, not swe's sandboxes")
    for spec in opts.rewards:
        if service_name(spec):
            continue
        try:
            load_reward_functions([spec])
        except BelayerError as exc:
            raise InvalidRequest(f"--reward {spec!r}: {exc}") from None
    try:
        check_weights(opts.rewards, opts.reward_weights)
    except BelayerError as exc:
        raise InvalidRequest(f"--reward-weights: {exc}") from None


def node_reward_functions(opts: RunOptions) -> tuple[str, ...]:
    """What the node the run starts enables as ``--reward-function`` (a ``service:<name>``
    one needs no enabling)."""
    return tuple(dict.fromkeys(s for s in opts.rewards if not service_name(s)))


def run_defaults(where: str, declared: Any) -> dict[str, float]:
    """A workload's ``run_defaults``, checked (None: it declares none)."""
    if declared is None:
        return {}
    if not isinstance(declared, dict):
        raise InvalidRequest(f"{where}: run_defaults must be a dict, not {type(declared).__name__}")
    out: dict[str, float] = {}
    for key, value in declared.items():
        if key not in DEFAULT_KEYS:
            raise InvalidRequest(
                f"{where}: run_defaults has {key!r}; it takes {', '.join(DEFAULT_KEYS)}"
            )
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if key == "lr":
            if not number or not math.isfinite(value) or not 0 < value <= 1:
                raise InvalidRequest(f"{where}: run_defaults lr must be a number in (0, 1]")
        elif not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InvalidRequest(f"{where}: run_defaults {key} must be a whole number ≥ 1")
        out[key] = value
    return out


def label_of(name: str) -> str:
    """A workload's name as a run directory and run id prefix (letters, digits, ``_``)."""
    return re.sub(r"[^A-Za-z0-9_]", "_", name).strip("_")[:32] or "plugin"


def scored_by_rewards(wl: Workload, opts: RunOptions, nc: Any) -> Workload:
    """``wl`` scored by the run's ``--reward`` functions, else by the reward services the
    workload declares (as the controller scores the rollouts), so the held-out evaluation
    reads the same reward; ``wl`` itself without either."""
    specs = list(opts.rewards) or declared_rewards(wl)
    if not specs:
        return wl
    from services.controller.client import ControllerConfig, ask_reward_service

    cfg = ControllerConfig()

    async def ask(name: str, task: Task, outcome: Outcome) -> float | None:
        return await ask_reward_service(
            nc, name, task, outcome, timeout_s=cfg.reward_timeout_s,
            attempts=cfg.reward_attempts,
        )  # fmt: skip

    weights = check_weights(specs, opts.reward_weights if opts.rewards else [])
    return RewardFunctions(wl, load_reward_functions(specs), weights, ask)
