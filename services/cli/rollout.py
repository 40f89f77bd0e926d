"""``belayer rollout``: run agentic trajectories of a workload on the running node's controller,
with optional failure injection; progress while it runs, a table (or a JSON summary) at the end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import typer
from rich.console import Console
from rich.table import Table

from belayer.api import AsyncNode
from common.errors import InvalidRequest
from schemas.rollout import RolloutAccepted, RolloutRequest, RolloutResult
from schemas.serving import SamplingParams
from services.cli.shared import (
    checked,
    fail,
    finite,
    print_json,
    progress_console,
    run,
    with_bus,
)
from services.controller.client import parse_inject, parse_policy
from workloads.table import dataset_workload


def summary_json(result: RolloutResult, request: RolloutRequest) -> dict[str, Any]:
    """What ``--json`` prints: the counts (``RolloutSummary``) and what was asked."""
    out: dict[str, Any] = {
        "rollout_id": result.rollout_id,
        "workload": result.workload,
        "policy": request.policy,
        "inject": [s.text for s in request.inject],
        "n": request.n,
    }
    out.update(msgspec.structs.asdict(result.summary))
    out["trajectories"] = [msgspec.structs.asdict(r) for r in result.rows]
    return out


def table(result: RolloutResult) -> Table:
    """One row per attempt (trajectory ``<rollout>-s<slot>-a<try>``)."""
    t = Table(title=f"rollout {result.rollout_id} ({result.workload})")
    left = ("slot", "task", "state", "finish")
    for col in ("slot", "try", "task", "state", "finish", "reward", "turns", "restores",
                "scratch", "ckpts", "fails"):  # fmt: skip
        t.add_column(col, justify="left" if col in left else "right")
    for r in result.rows:
        t.add_row(
            str(r.slot), str(r.attempt), r.task_id, r.state, r.finish_reason or "",
            f"{r.reward:.2f}", str(r.turns), str(r.restores), str(r.restarts_from_scratch),
            str(r.checkpoints), str(r.sandbox_failures),
        )  # fmt: skip
    return t


def checked_dataset(workload: str, dataset: str, prompt_column: str, answer_column: str) -> str:
    """``--dataset`` as the controller should read it (absolute: its working directory is not
    ours); columns without a dataset, or for a sandbox workload, are the one error line."""
    try:
        dataset_workload(workload, dataset, prompt_column, answer_column)
    except InvalidRequest as exc:
        fail(str(exc), 2)
    return str(Path(dataset).resolve()) if dataset and Path(dataset).exists() else dataset


# `belayer rollout`'s options (declared here, so that `rollout` reads as what it does)
ROLLOUT_WORKLOAD = typer.Argument(
    ..., help="Workload: math, swe (also dapo, table, swe-gym with --dataset)."
)
ROLLOUT_TASKS = typer.Option(4, "--tasks", min=1, max=100_000, help="How many tasks.")
ROLLOUT_N = typer.Option(1, "--n", min=1, max=1024, help="Samples per task (the GRPO group).")
ROLLOUT_POLICY = typer.Option(
    "risk-aware",
    "--policy",
    help="Checkpoints: never, always, risk-aware, interval:N, young-daly.",
)
ROLLOUT_INJECT = typer.Option(
    "",
    "--inject",
    help="Failures to inject, comma-separated KIND@WHEN: KIND sandbox-kill, sandbox-pause, "
    "worker-kill, controller-kill; WHEN turn=T (after the T-th action; turn=T/i: of "
    "trajectory #i), p=P (per environment step), s=SECONDS (into the rollout). "
    "E.g. sandbox-kill@turn=3,worker-kill@s=5.",
)
ROLLOUT_TASK_ID = typer.Option([], "--task-id", help="Run these tasks (repeatable).")
ROLLOUT_DATASET = typer.Option(
    "",
    "--dataset",
    help="Dataset for the workload's loader: a .jsonl, .json or .parquet file or a directory "
    "saved by datasets' save_to_disk.",
)
ROLLOUT_PROMPT_COLUMN = typer.Option(
    "",
    "--prompt-column",
    help="The dataset's prompt column (a string, asked with the math instruction, or a list of "
    "{role, content}); math/dapo datasets are then read as a prompt/answer table.",
)
ROLLOUT_ANSWER_COLUMN = typer.Option(
    "",
    "--answer-column",
    help="The dataset's answer column (a string or a number; a.b: key b of column a), matched "
    "against the response's last 'Answer:' line.",
)
ROLLOUT_MAX_TURNS = typer.Option(
    20, "--max-turns", min=1, max=1000, help="LLM turns per trajectory."
)
ROLLOUT_DEADLINE = typer.Option(
    900.0,
    "--deadline",
    min=0.001,
    max=86_400.0,
    callback=finite,
    help="Seconds one trajectory may take.",
)
ROLLOUT_TEMPERATURE = typer.Option(
    1.0, "--temperature", min=0.0, max=100.0, callback=finite, help="Sampling temperature."
)
ROLLOUT_MAX_TOKENS = typer.Option(
    256, "--max-tokens", min=1, max=100_000, help="Tokens per response."
)
ROLLOUT_SEED = typer.Option(0, "--seed", min=-(2**63), max=2**63 - 1, help="Root seed.")
ROLLOUT_FAILURE_RATE = typer.Option(
    None,
    "--failure-rate",
    min=0.0,
    callback=finite,
    help="λ for the policy (failures per second); default: estimated, or the injected p.",
)
ROLLOUT_CONCURRENCY = typer.Option(
    0,
    "--concurrency",
    min=0,
    max=4096,
    help="Trajectories at once (0: the controller's default).",
)
ROLLOUT_MAX_ATTEMPTS = typer.Option(3, "--max-attempts", min=1, max=100, help="Attempts per slot.")
ROLLOUT_ID = typer.Option(
    "", "--rollout-id", help="Caller-chosen id (resubmitting it is idempotent)."
)
ROLLOUT_TIMEOUT = typer.Option(
    3600.0, "--timeout", min=1.0, callback=finite, help="Seconds to wait for the rollout."
)
ROLLOUT_REWARD = typer.Option(
    [],
    "--reward",
    help="A reward function package.module:function scoring the trajectories instead of the "
    "workload's reward, TRL-shaped: fn(prompts, completions, **columns) -> list[float | None] "
    "(repeatable; each enabled on the node with belayer up --reward-function).",
)
ROLLOUT_REWARD_WEIGHTS = typer.Option(
    [], "--reward-weights", help="One weight per --reward, in order (default: all 1)."
)
ROLLOUT_JSON = typer.Option(False, "--json", help="Print a JSON summary on stdout.")
ROLLOUT_NATS_URL = typer.Option("", "--nats-url", help="NATS URL (default: the running node's).")


def rollout(
    workload: str = ROLLOUT_WORKLOAD,
    tasks: int = ROLLOUT_TASKS,
    n: int = ROLLOUT_N,
    policy: str = ROLLOUT_POLICY,
    inject: str = ROLLOUT_INJECT,
    task_id: list[str] = ROLLOUT_TASK_ID,
    dataset: str = ROLLOUT_DATASET,
    prompt_column: str = ROLLOUT_PROMPT_COLUMN,
    answer_column: str = ROLLOUT_ANSWER_COLUMN,
    max_turns: int = ROLLOUT_MAX_TURNS,
    deadline: float = ROLLOUT_DEADLINE,
    temperature: float = ROLLOUT_TEMPERATURE,
    max_tokens: int = ROLLOUT_MAX_TOKENS,
    seed: int = ROLLOUT_SEED,
    failure_rate: float | None = ROLLOUT_FAILURE_RATE,
    concurrency: int = ROLLOUT_CONCURRENCY,
    max_attempts: int = ROLLOUT_MAX_ATTEMPTS,
    rollout_id: str = ROLLOUT_ID,
    timeout: float = ROLLOUT_TIMEOUT,
    json_out: bool = ROLLOUT_JSON,
    nats_url: str = ROLLOUT_NATS_URL,
    reward: list[str] = ROLLOUT_REWARD,
    reward_weights: list[float] = ROLLOUT_REWARD_WEIGHTS,
) -> None:
    """Run agentic rollouts on the node: each trajectory alternates LLM turns with actions in its
    sandbox; sandbox failures are recovered by restoring the latest ready checkpoint together
    with the matching LLM context."""
    try:
        faults = parse_inject(inject)
    except ValueError as exc:
        fail(f"--inject: {exc}", 2)
    try:
        parse_policy(policy)
    except ValueError as exc:
        fail(f"--policy: {exc}", 2)
    dataset = checked_dataset(workload, dataset, prompt_column, answer_column)
    req = checked(
        RolloutRequest(
            workload=workload, rollout_id=rollout_id, task_ids=list(task_id), tasks=tasks,
            dataset=dataset, prompt_column=prompt_column, answer_column=answer_column, n=n,
            sampling=SamplingParams(temperature=temperature, max_tokens=max_tokens),
            seed=seed, max_turns=max_turns, deadline_s=deadline, policy=policy,
            failure_rate=failure_rate, inject=faults, concurrency=concurrency,
            max_attempts=max_attempts, rewards=list(reward), reward_weights=list(reward_weights),
        )
    )  # fmt: skip
    console = progress_console()
    shown: list[tuple[int, ...]] = []

    def progress(result: RolloutResult) -> None:
        s = result.summary
        counts = (s.trajectories_completed, s.trajectories_failed, s.restored, s.running)
        if shown and shown[-1] == counts:
            return
        shown.append(counts)
        console.print(
            f"[bold]{result.rollout_id}[/]: done {s.trajectories_completed}/{s.trajectories}, "
            f"failed attempts {s.trajectories_failed}, restored {s.restored}, running {s.running}, "
            f"sandbox failures {s.env_failures}, injected {s.failures_injected}"
        )

    def accepted(a: RolloutAccepted) -> None:
        console.print(
            f"rollout {a.rollout_id}: {a.trajectories} trajectories "
            f"({len(a.task_ids)} tasks × {req.n})" + (" (already submitted)" if a.existing else "")
        )

    async def go(nc: Any) -> RolloutResult:
        return await AsyncNode.over(nc).rollout_request(
            req, timeout=timeout, on_accepted=accepted, on_progress=progress
        )

    result = run(with_bus(nats_url or None, go, name="cli-rollout"))
    if json_out:
        print_json(summary_json(result, req))
    else:
        print_result(result)


def print_result(result: RolloutResult) -> None:
    """The per-attempt table and the rollout's counts in one line."""
    Console().print(table(result))
    s = result.summary
    typer.echo(
        f"completed {s.trajectories_completed}/{s.trajectories}, failed attempts "
        f"{s.trajectories_failed}, mean reward {'-' if s.mean_reward is None else format(s.mean_reward, '.3f')}, sandbox failures "
        f"{s.env_failures}, restores {s.env_restores}, restarts from scratch "
        f"{s.restarts_from_scratch}, checkpoints {s.checkpoints} (visible {s.visible_checkpoint_s:.2f} s "
        f"of {s.rollout_s:.1f} s), injected {s.failures_injected}, recovered {s.failures_recovered}"
    )
