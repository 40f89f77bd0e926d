"""The RL loop driven step by step from outside ``belayer run`` (``belayer soak --train``'s
training lane): one ``RunContext`` for ``loop.run_step`` and its phases, built from the node's
model and the workload's tasks with the run's own helpers (``options.choose_tasks``,
``RunState``, ``RunOptions``), no run directory written, no held-out evaluation."""

from __future__ import annotations

import time
from pathlib import Path

from model.chat import ChatFormat
from model.tokenizer import load_tokenizer
from services.rl.loop import RunContext
from services.rl.node import NodeHandle
from services.rl.options import RunOptions, RunState, choose_tasks, new_run_id

POOL_STEPS = 16
"""Steps of distinct tasks in the lane's pool (then it cycles)."""


def lane_context(
    node: NodeHandle,
    workload: str,
    *,
    tasks: int,
    n: int,
    seed: int,
    policy: str,
    run_dir: Path,
    deterministic: bool,
    max_tokens: int = RunContext.max_tokens,
    max_turns: int | None = None,
) -> RunContext:
    """A context for ``run_step`` on ``node``: ``tasks`` × ``n`` trajectories of the built-in
    ``workload`` a step (its pool cycled), seeded from ``seed``, responses of ``max_tokens``,
    no held-out tasks; ``nc`` and ``events`` are the caller's to set. ``base_step`` is 0: set
    it to the trainer's step before the first (``trainer step = base + step``)."""
    from workloads import load_workload

    model_dir = Path(node.info.model_dir)
    pool, _, _ = choose_tasks(workload, "", tasks, POOL_STEPS, 1, seed)
    state = RunState(
        run_id=new_run_id(workload), workload=workload, dataset="", model_dir=str(model_dir),
        model_fingerprint="", tasks=tasks, n=n, seed=seed, policy=policy, pool=pool,
        held_out=[], created_at=time.time(),
    )  # fmt: skip
    return RunContext(
        opts=RunOptions(workload=workload, steps=10**9, policy=policy, seed=seed),
        state=state, run_dir=run_dir, node=node, workload=load_workload(workload),
        workload_name=workload, dataset="", held_out=[], chat=ChatFormat(load_tokenizer(model_dir)),
        specs=[], sandboxed=workload == "swe", start_step=1, steps=10**9,
        deterministic=deterministic, max_tokens=max_tokens, max_turns=max_turns,
    )  # fmt: skip
