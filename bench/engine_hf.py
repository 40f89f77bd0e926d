"""``belayer bench engine --vs-hf``: the engine against Hugging Face transformers ``generate``.

The same model directory, the same torch thread count, greedy, the same prompts (16 tokens,
:func:`bench.engine.prompts`), ``new_tokens`` each past EOS (``min_new_tokens`` for HF,
``ignore_eos`` for the engine), prefill included. Each repeat runs, per batch size, HF, the
engine in fast mode and the engine in deterministic mode (the default) back to back, so a
slow spell of a shared machine hits all three; the ratios are over those pairs of runs.

Tokens/s are reported by wall clock and by the process's CPU time (one thread: CPU time is
what the run itself cost, robust to other processes sharing the cores); the targets are judged
on CPU time. Also reported: whether each engine mode's greedy tokens equal HF's.

Deterministic mode verifies prompt-lookup draft tokens in its decode steps
(``EngineConfig.speculative_tokens``; exact: the tokens are one-token decoding's). What that
buys depends on how often the text repeats itself, so the run also reports the share of draft
tokens kept and two more runners beside the three judged: deterministic mode without drafts
(``det-no-drafts``) and, at batch 1, HF's own prompt lookup (``generate``'s
``prompt_lookup_num_tokens``, ``hf-lookup``; HF runs it at batch 1 only).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench import report
from bench.engine import BATCHES, PROMPT_LEN, TINY_MODEL, bench_llm_engine, model_or_tiny, prompts
from bench.report import Row, Target, progress, target_text
from bench.stats import Interval, ci_text, judged_json, paired_ratio
from model.batch_invariant import bucket
from model.config import load_model_config
from services.worker.engine.sequence import SamplingParams

RUNNERS = ("hf", "fast", "deterministic")
"""HF ``generate``, then the engine with ``EngineConfig.deterministic`` off and on."""
EXTRA_RUNNERS = ("det-no-drafts", "hf-lookup")
"""Measured beside them, not judged: deterministic mode with ``speculative_tokens=0``, and
HF ``generate`` with prompt lookup (batch 1 only)."""
HF_LOOKUP_TOKENS = 7
"""``prompt_lookup_num_tokens`` of ``hf-lookup``: as many as the engine's
``EngineConfig.speculative_tokens``."""

TARGETS: dict[str, Target] = {
    "det_vs_hf_b1": (">=", 2.0),
    "det_vs_hf_b8": (">=", 1.5),
    "det_vs_fast_b8": (">=", 0.9),
}
"""Deterministic mode's tokens/s over HF's at batch 1 and 8, and over fast mode's at batch 8
(CPU time, one thread; the tiny model and SmolLM2-135M alike)."""


class _Runners:
    """HF's model and the two engines, built once; ``run`` times one batch of one of them."""

    def __init__(self, model_dir: Path, new_tokens: int) -> None:
        from transformers import AutoModelForCausalLM

        self.new_tokens = new_tokens
        config = load_model_config(model_dir)
        self.vocab = config.vocab_size
        self.hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=config.dtype).eval()
        self.engines = {
            "fast": bench_llm_engine(model_dir, new_tokens, max(BATCHES), False),
            "deterministic": bench_llm_engine(model_dir, new_tokens, max(BATCHES), True),
            "det-no-drafts": bench_llm_engine(model_dir, new_tokens, max(BATCHES), True, 0),
        }
        self.sampling = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)

    def run(self, runner: str, batch: int) -> tuple[float, float, list[list[int]]]:
        """(wall s, CPU s, generated tokens per prompt) of one batch."""
        batch_prompts = prompts(batch, self.vocab)
        wall, cpu = time.perf_counter(), time.process_time()
        if runner in ("hf", "hf-lookup"):
            ids = torch.tensor(batch_prompts)
            lookup = {"prompt_lookup_num_tokens": HF_LOOKUP_TOKENS} if runner == "hf-lookup" else {}
            with torch.inference_mode():
                out = self.hf.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=self.new_tokens,
                    min_new_tokens=self.new_tokens,
                    do_sample=False,
                    pad_token_id=0,
                    **lookup,
                )
            tokens = out[:, ids.shape[1] :].tolist()
        else:
            results = self.engines[runner].generate(batch_prompts, self.sampling)
            tokens = [r.token_ids for r in results]
        return time.perf_counter() - wall, time.process_time() - cpu, tokens


def measure(model_dir: Path, new_tokens: int, repeats: int, num_threads: int = 1) -> dict[str, Any]:
    """Interleaved runs of the three runners at each batch size; tokens/s per run (wall and
    CPU) and whether each engine mode's tokens equalled HF's in every run."""
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        runners = _Runners(model_dir, new_tokens)
        every = RUNNERS + EXTRA_RUNNERS
        for r in every:  # first-call costs out of the way
            runners.run(r, 1)
        det = runners.engines["deterministic"]
        drafts = det.draft_tokens_proposed, det.draft_tokens_accepted
        wall: dict[str, dict[int, list[float]]] = {r: {b: [] for b in BATCHES} for r in every}
        cpu: dict[str, dict[int, list[float]]] = {r: {b: [] for b in BATCHES} for r in every}
        same = {r: True for r in every if r != "hf"}
        for rep in range(repeats):
            for b in BATCHES:
                hf_tokens: list[list[int]] = []
                for r in _runners_at(b):
                    w, c, tokens = runners.run(r, b)
                    wall[r][b].append(b * new_tokens / w)
                    cpu[r][b].append(b * new_tokens / c)
                    if r == "hf":
                        hf_tokens = tokens
                    else:
                        same[r] = same[r] and tokens == hf_tokens
                progress(
                    "engine",
                    f"vs HF run {rep + 1}/{repeats}, batch {b} (CPU tok/s): "
                    + ", ".join(f"{r} {cpu[r][b][-1]:.0f}" for r in _runners_at(b)),
                )
    finally:
        torch.set_num_threads(previous)
    proposed = det.draft_tokens_proposed - drafts[0]
    accepted = det.draft_tokens_accepted - drafts[1]
    return {
        "wall": wall,
        "cpu": cpu,
        "greedy_equal_to_hf": same,
        "draft_tokens": {"proposed": proposed, "accepted": accepted},
        "det_step_rows": det_step_rows(det.model.det_min_rows()),
    }


def det_step_rows(floor: int) -> dict[str, int]:
    """Rows a deterministic decode step's products run with at each batch size (no drafts):
    the batch padded to the bucket this machine's GEMM needs to be row-invariant
    (``floor``: ``Qwen3ForCausalLM.det_min_rows``; 4 on the AMD EPYC these docs were first
    measured on, 16 on an AVX-512 Xeon for ``F.linear``, 1 there for the packed products a
    model up to ``model.fused.PREPARE_MAX_BYTES`` runs)."""
    return {str(b): bucket(b, floor) for b in BATCHES}


def _runners_at(batch: int) -> tuple[str, ...]:
    """Every runner measured at ``batch`` (HF's prompt lookup runs at batch 1 only)."""
    return RUNNERS + tuple(r for r in EXTRA_RUNNERS if r != "hf-lookup" or batch == 1)


_PAIRS = {
    "fast_vs_hf": ("fast", "hf"),
    "det_vs_hf": ("deterministic", "hf"),
    "det_vs_fast": ("deterministic", "fast"),
    "det_vs_det_no_drafts": ("deterministic", "det-no-drafts"),
    "det_vs_hf_lookup": ("deterministic", "hf-lookup"),
}


def _ratios(
    runs: dict[str, dict[int, list[float]]],
) -> tuple[dict[str, float | None], dict[str, Interval | None]]:
    """Median over median of each pair of runners per batch size, and its interval over the
    interleaved pairs of runs (none from a single repeat)."""
    values: dict[str, float | None] = {}
    intervals: dict[str, Interval | None] = {}
    for b in BATCHES:
        for name, (num, den) in _PAIRS.items():
            if not (runs.get(num, {}).get(b) and runs.get(den, {}).get(b)):
                continue  # a runner not measured (at this batch size)
            key = f"{name}_b{b}"
            values[key] = statistics.median(runs[num][b]) / statistics.median(runs[den][b])
            intervals[key] = paired_ratio(runs[num][b], runs[den][b])
    return values, intervals


def rows(result: dict[str, Any]) -> list[Row]:
    """Tokens/s of each runner, then the ratios (CPU time) with their targets."""
    out = []
    for r in RUNNERS + EXTRA_RUNNERS:
        for b in BATCHES:
            key = str(b)
            if key not in result["cpu_tok_s"].get(r, {}):
                continue
            out.append(
                Row(
                    f"{r}, batch {b}",
                    f"{result['cpu_tok_s'][r][key]:.0f} tok/s CPU, "
                    f"{result['wall_tok_s'][r][key]:.0f} wall",
                )
            )
    step_rows = result["det_step_rows"]
    out.append(
        Row(
            "rows of a deterministic step",
            " / ".join(map(str, step_rows.values())) + f" (batch {' / '.join(step_rows)})",
        )
    )
    drafts = result["draft_tokens"]
    kept = drafts["accepted"] / drafts["proposed"] if drafts["proposed"] else 0.0
    out.append(
        Row(
            "draft tokens kept (deterministic)",
            f"{drafts['accepted']} of {drafts['proposed']} ({kept:.0%})",
        )
    )
    for key, value in result["ratios"].items():
        target = TARGETS.get(key)
        shown = "n/a" if value is None else f"{value:.2f}×"
        shown += ci_text(result["intervals"].get(key), lambda x: f"{x:.2f}")
        out.append(
            Row(
                key,
                shown,
                target_text(target, "×") if target else "",
                result["verdicts"].get(key, ""),
            )
        )
    return out


def main(
    json_path: Path,
    model_dir: Path | None = None,
    *,
    new_tokens: int = 128,
    repeats: int = 3,
    num_threads: int = 1,
) -> dict[str, Any]:
    """Measure, print the table, write ``json_path``. Without ``model_dir`` a tiny model is
    written to a temporary directory."""
    machine = report.machine_info()
    progress("engine", f"vs HF: {machine['cpu_count']} CPUs, torch {machine['torch']}")
    tiny = model_dir is None
    with model_or_tiny(model_dir, "belayer-bench-engine-hf-") as model_dir:
        measured = measure(model_dir, new_tokens, repeats, num_threads)
    med = {
        kind: {
            r: {str(b): statistics.median(v) for b, v in measured[kind][r].items() if v}
            for r in RUNNERS + EXTRA_RUNNERS
        }
        for kind in ("wall", "cpu")
    }
    ratios, intervals = _ratios(measured["cpu"])
    wall_ratios = _ratios(measured["wall"])[0]
    result: dict[str, Any] = {
        "bench": "engine-vs-hf",
        "timestamp": report.timestamp(),
        "unix_time": time.time(),
        "model": TINY_MODEL if tiny else Path(model_dir).name,
        "new_tokens": new_tokens,
        "prompt_tokens": PROMPT_LEN,
        "repeats": repeats,
        "num_threads": num_threads,
        "cpu_tok_s": med["cpu"],
        "wall_tok_s": med["wall"],
        "ratios": ratios,
        "wall_ratios": wall_ratios,
        "greedy_equal_to_hf": measured["greedy_equal_to_hf"],
        "draft_tokens": measured["draft_tokens"],
        "det_step_rows": measured["det_step_rows"],
        "runs": {
            kind: {
                r: {str(b): v for b, v in runs.items() if v} for r, runs in measured[kind].items()
            }
            for kind in ("wall", "cpu")
        },
        **judged_json(TARGETS, ratios, intervals),
        "machine": report.machine_after(machine),
    }
    title = "belayer bench engine --vs-hf (CPU-time medians; ratios over interleaved pairs)"
    report.publish("engine", title, rows(result), json_path, result)
    return result
