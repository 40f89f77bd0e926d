"""``belayer bench train --trainer-procs N``: the time of one GRPO update on one process and on N
data-parallel ranks (``services/trainer/ranks.py``: real processes, a real gloo process group),
side by side, with the loss of both (equal within 1e-6).

The update is the trainer's own (``update.grpo_step`` and ``dp.dp_grpo_step``) on a synthetic
batch: ``groups`` groups of ``group_size`` trajectories of random (byte) tokens (a ``prompt``-token
prompt, a ``response``-token response, every response token a model token), rollout
log-probabilities those of the starting weights, on a tiny Qwen3 (``model.tiny``; ``--model``
for another), deterministic mode, one torch thread per rank. ``steps`` updates each; the median
step time is reported (the first step of each, warm-up, is left out). What N ranks buy depends
on free cores: on a machine whose cores are already busy the ranks share them.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.report import Row, machine_at_start, progress, publish, timestamp

NAME = "train"


def batch(model_dir: Path, groups: int, group_size: int, prompt: int, response: int) -> list[Any]:
    """Synthetic samples whose rollout log-probabilities are the starting weights'."""
    import torch

    from model.config import load_model_config
    from model.loader import load_safetensors
    from model.qwen3 import build_model
    from model.train_forward import token_logprobs
    from services.trainer.core import Sample

    cfg = load_model_config(model_dir)
    model = build_model(cfg, load_safetensors(model_dir), deterministic=True)
    gen = torch.Generator().manual_seed(7)
    out = []
    for g in range(groups):
        for i in range(group_size):
            ids = torch.randint(5, 256, (prompt + response,), generator=gen)  # byte tokens
            with torch.no_grad():
                lp = token_logprobs(model, ids[None])[0, prompt - 1 :].tolist()
            sample = Sample(
                trajectory_id=f"g{g}-{i}", group_id=f"g{g}", sample_index=i,
                prompt_ids=tuple(ids[:prompt].tolist()),
                response_ids=tuple(ids[prompt:].tolist()), loss_mask=(1,) * response,
                rollout_logprobs=tuple(lp), weight_versions=(1,) * response,
                reward=float(i % 2), slot=g * group_size + i,
            )  # fmt: skip
            out.append(sample)
    return out


def main(
    json_path: Path,
    *,
    procs: int,
    steps: int = 4,
    groups: int = 4,
    group_size: int = 4,
    prompt: int = 64,
    response: int = 192,
    model: Path | None = None,
) -> dict[str, Any]:
    """Both timings, the table and the JSON."""
    import torch

    from common.training_config import OptimConfig
    from model.config import load_model_config
    from model.loader import load_safetensors
    from model.tiny import init_tiny_model
    from services.trainer import journal
    from services.trainer.config import GrpoConfig, TrainerConfig
    from services.trainer.ranks import Ranks
    from services.trainer.update import grpo_step, new_state, save_state

    machine = machine_at_start(NAME)
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="belayer-bench-train-dp-"))
    model_dir = model or init_tiny_model(tmp / "tiny")
    cfg, base = load_model_config(model_dir), load_safetensors(model_dir)
    samples = batch(model_dir, groups, group_size, prompt, response)
    optim, grpo = OptimConfig(lr=1e-5, seed=0), GrpoConfig(micro_batch_size=2)
    kw: dict[str, Any] = {"group_size": group_size, "grpo": grpo, "optim": optim, "pad_id": 0}

    def timed(step: Any, state: Any) -> tuple[list[float], list[float]]:
        times, losses = [], []
        for _ in range(steps + 1):
            t0 = time.perf_counter()
            losses.append(step(state, samples, **kw).loss)
            times.append(time.perf_counter() - t0)
        return times[1:], losses

    progress(NAME, f"{steps + 1} updates on one process")
    single = new_state(cfg, base, 1, optim, deterministic=True)
    save_state(journal.checkpoint_path(tmp / "trainer", 0), single, {})
    one_t, one_loss = timed(grpo_step, single)
    progress(NAME, f"{steps + 1} updates on {procs} ranks")
    config = TrainerConfig(
        checkpoint_dir=tmp / "trainer", group_size=group_size, groups_per_step=groups,
        optim=optim, grpo=grpo, deterministic=True, procs=procs,
    )  # fmt: skip
    t0 = time.perf_counter()
    ranks = Ranks.spawn(config, cfg, tmp / "trainer")
    try:
        ranks.join()
        start_s = time.perf_counter() - t0
        dp_t, dp_loss = timed(ranks.grpo_step, new_state(cfg, base, 1, optim, deterministic=True))
    finally:
        ranks.close()
    result = {
        "bench": "train-dp", "timestamp": timestamp(), "machine": machine, "procs": procs,
        "batch": {"groups": groups, "group_size": group_size, "prompt": prompt,
                  "response": response, "micro_batch_size": grpo.micro_batch_size},
        "model": str(model) if model else "tiny (model.tiny defaults)",
        "step_s_one_process": statistics.median(one_t), "step_s_ranks": statistics.median(dp_t),
        "ranks_start_s": start_s, "speedup": statistics.median(one_t) / statistics.median(dp_t),
        "loss_max_abs_diff": max(abs(a - b) for a, b in zip(one_loss, dp_loss, strict=True)),
    }  # fmt: skip
    publish(
        NAME,
        f"GRPO update: 1 process vs {procs} ranks ({groups}×{group_size} trajectories)",
        [
            Row("step time, 1 process (median)", f"{result['step_s_one_process']:.3f} s"),
            Row(f"step time, {procs} ranks (median)", f"{result['step_s_ranks']:.3f} s"),
            Row("speed-up", f"{result['speedup']:.2f}×"),
            Row(f"{procs} ranks started in", f"{start_s:.1f} s"),
            Row("loss, max |1 process − ranks|", f"{result['loss_max_abs_diff']:.1e}"),
        ],
        json_path,
        result,
    )
    return result
