"""``belayer bench engine``: decode throughput of the engine alone, in-process (no bus).

Tokens/s at batch 1 and 8 (16-token prompts, greedy, ``ignore_eos``, prefill included), median
of ``repeats`` runs, on the tiny model (hidden 256, 4 layers, vocab 4096) unless a model
directory is given; the targets are the tiny model's. Both engine modes are measured in the same
run, interleaved: the fast default kernels (``deterministic=False``) and deterministic mode
(batch-invariant, ``EngineConfig.deterministic``), with the ratio at batch 8 judged against
``≥ 50 %``. Every verdict reads the value's 95 % bootstrap interval over the runs (the ratio's
over the interleaved pairs of runs). ``measure`` is also the first measurement of
``belayer bench serve``.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from bench import report
from bench.report import Row, Target, progress, ratio, target_text
from bench.stats import Interval, ci_text, judged_json, median_interval, paired_ratio
from model.config import load_model_config
from model.loader import load_safetensors
from model.qwen3 import kv_cache_shape
from services.worker.engine.config import EngineConfig
from services.worker.engine.llm_engine import LLMEngine
from services.worker.engine.sequence import SamplingParams

PROMPT_LEN = 16
BATCHES = (1, 8)
TINY_MODEL = {"hidden_size": 256, "num_layers": 4, "vocab_size": 4096}
"""The model the targets are for (``model.tiny.init_tiny_model``'s defaults)."""

MODES = ("fast", "deterministic")
"""Engine modes measured: ``EngineConfig.deterministic`` off and on."""

TARGETS: dict[str, Target] = {
    "engine_tok_s_b1": (">=", 150.0),
    "engine_tok_s_b8": (">=", 600.0),
    "engine_det_ratio_b8": (">=", 0.5),
}
"""Metric → (comparison, bound): tokens/s of the tiny model with one torch thread (fast mode);
deterministic over fast throughput at batch 8 (a fraction)."""


def prompts(batch: int, vocab: int) -> list[list[int]]:
    """``batch`` deterministic prompts of ``PROMPT_LEN`` tokens (the bus benchmark sends the same)."""
    return [[(7 * i + 13 * j + 1) % vocab for j in range(PROMPT_LEN)] for i in range(batch)]


def bench_llm_engine(
    model_dir: str | Path,
    new_tokens: int,
    max_batch: int,
    deterministic: bool,
    speculative_tokens: int = EngineConfig.speculative_tokens,
) -> LLMEngine:
    """The in-process engine the engine benchmarks time, warmed up: room for ``max_batch``
    prompts of ``PROMPT_LEN`` tokens generating ``new_tokens`` each (and the KV blocks their
    draft tokens may take)."""
    model_config = load_model_config(model_dir)
    config = EngineConfig(
        max_num_seqs=max(16, max_batch),
        block_size=16,
        num_blocks=max_batch * (-(-(PROMPT_LEN + new_tokens) // 16) + 1) + 1,
        max_model_len=PROMPT_LEN + new_tokens + 1,
        max_num_batched_tokens=max(4096, PROMPT_LEN * max_batch),
        deterministic=deterministic,
        speculative_tokens=speculative_tokens,
    )
    kv_cache = torch.zeros(
        kv_cache_shape(model_config, config.num_blocks, config.block_size),
        dtype=model_config.dtype,
    )
    engine = LLMEngine(model_config, load_safetensors(model_dir), kv_cache, config)
    engine.warmup()
    return engine


@contextlib.contextmanager
def model_or_tiny(model_dir: str | Path | None, prefix: str) -> Iterator[Path]:
    """``model_dir``; without one, a tiny model (``model.tiny.init_tiny_model``'s defaults:
    what the targets are for) written to a temporary directory (named ``prefix``…) that is
    removed on exit."""
    if model_dir is not None:
        yield Path(model_dir)
        return
    from model.tiny import init_tiny_model

    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        yield init_tiny_model(Path(tmp) / "model")


def bench_engine(
    model_dir: str | Path,
    batch_sizes: tuple[int, ...] = BATCHES,
    new_tokens: int = 128,
    *,
    num_threads: int | None = 1,
    deterministic: bool = False,
) -> dict[int, float]:
    """Generated tokens per second for each batch size (greedy, ``ignore_eos``).

    Each batch holds ``batch_size`` prompts of 16 tokens generating ``new_tokens`` each; the
    time includes the prefill step. ``num_threads`` (default 1, as on the 2-core CI machine)
    is set for the run and restored after; None leaves torch's setting alone.
    ``deterministic``: the engine's batch-invariant mode.
    """
    previous = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        engine = bench_llm_engine(model_dir, new_tokens, max(batch_sizes), deterministic)
        model_config = engine.model_config
        sampling = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        results: dict[int, float] = {}
        for batch in batch_sizes:
            batch_prompts = prompts(batch, model_config.vocab_size)
            start = time.perf_counter()
            outputs = engine.generate(batch_prompts, sampling)
            elapsed = time.perf_counter() - start
            results[batch] = sum(len(o.token_ids) for o in outputs) / elapsed
        return results
    finally:
        torch.set_num_threads(previous)


def measure(
    model_dir: Path,
    new_tokens: int,
    repeats: int,
    *,
    bench_name: str = "engine",
    num_threads: int | None = 1,
) -> dict[str, Any]:
    """Median tokens/s of the in-process engine at each of ``BATCHES`` over ``repeats`` runs,
    in both modes (interleaved run by run, so a slow spell of the machine hits both).

    Returns ``tok_s`` and ``runs`` (fast mode, batch → value / list), ``det_tok_s`` and
    ``det_runs`` (deterministic mode) and ``det_ratio`` (batch → deterministic / fast)."""
    runs: dict[str, dict[int, list[float]]] = {m: {b: [] for b in BATCHES} for m in MODES}
    for rep in range(repeats):
        for mode in MODES:
            result = bench_engine(
                model_dir,
                BATCHES,
                new_tokens,
                num_threads=num_threads,
                deterministic=mode == "deterministic",
            )
            for b in BATCHES:
                runs[mode][b].append(result[b])
            progress(
                bench_name,
                f"engine alone ({mode}) run {rep + 1}/{repeats}: "
                + ", ".join(f"batch {b} {result[b]:.0f} tok/s" for b in BATCHES),
            )
    med = {m: {b: statistics.median(v) for b, v in runs[m].items()} for m in MODES}
    return {
        "tok_s": med["fast"],
        "runs": runs["fast"],
        "det_tok_s": med["deterministic"],
        "det_runs": runs["deterministic"],
        "det_ratio": {b: ratio(med["deterministic"][b], med["fast"][b]) for b in BATCHES},
    }


def engine_intervals(
    runs: dict[Any, list[float]], det_runs: dict[Any, list[float]]
) -> dict[str, Interval | None]:
    """The targets' intervals: tokens/s (fast mode) over the runs, deterministic / fast over
    the pairs of runs (run i of each mode ran back to back)."""
    out: dict[str, Interval | None] = {}
    for b in runs:
        out[f"engine_tok_s_b{b}"] = median_interval(runs[b])
        out[f"engine_det_ratio_b{b}"] = paired_ratio(det_runs[b], runs[b])
    return out


def rows(result: dict[str, Any]) -> list[Row]:
    """Per batch size: fast mode, deterministic mode and their ratio; judged when the result
    has targets (the tiny model)."""

    def judged(key: str, unit: str) -> tuple[str, str]:
        target = TARGETS.get(key) if key in result["targets"] else None
        return (target_text(target, unit) if target else "", result["verdicts"].get(key, ""))

    def ci(key: str, show: Any) -> str:
        return ci_text(result["intervals"].get(key), show)

    out = []
    for b, value in result["tok_s"].items():
        key = f"engine_tok_s_b{b}"
        out.append(
            Row(
                f"engine alone, batch {b}",
                f"{value:.0f} tok/s" + ci(key, lambda x: f"{x:.0f}"),
                *judged(key, "tok/s"),
            )
        )
    for b, value in result["det_tok_s"].items():
        out.append(Row(f"engine alone, deterministic, batch {b}", f"{value:.0f} tok/s"))
    for b, value in result["det_ratio"].items():
        key = f"engine_det_ratio_b{b}"
        shown = "n/a" if value is None else f"{value * 100:.1f} %" + ci(key, _pct)
        out.append(Row(f"deterministic / fast, batch {b}", shown, *judged(key, "%")))
    return out


def _pct(x: float) -> str:
    return f"{x * 100:.1f} %"


def main(
    json_path: Path,
    model_dir: Path | None = None,
    *,
    new_tokens: int = 128,
    repeats: int = 3,
    num_threads: int | None = 1,
) -> dict[str, Any]:
    """Measure (seconds on the tiny model), print the table, write ``json_path``.

    Without ``model_dir`` a tiny model is written to a temporary directory; the targets are
    only judged then.
    """
    machine = report.machine_info()
    progress("engine", f"{machine['cpu_count']} CPUs, torch {machine['torch']}")
    tiny = model_dir is None
    with model_or_tiny(model_dir, "belayer-bench-engine-") as model_dir:
        progress(
            "engine",
            f"{repeats} runs of batch {' and '.join(map(str, BATCHES))}, {new_tokens} new tokens",
        )
        measured = measure(model_dir, new_tokens, repeats, num_threads=num_threads)
    tok_s = {str(b): v for b, v in measured["tok_s"].items()}
    det_tok_s = {str(b): v for b, v in measured["det_tok_s"].items()}
    det_ratio = {str(b): v for b, v in measured["det_ratio"].items()}
    # The ratio is judged on any model; absolute tokens/s only on the tiny one.
    targets = TARGETS if tiny else {"engine_det_ratio_b8": TARGETS["engine_det_ratio_b8"]}
    values = {f"engine_tok_s_b{b}": v for b, v in tok_s.items()}
    values.update({f"engine_det_ratio_b{b}": v for b, v in det_ratio.items()})
    intervals = engine_intervals(measured["runs"], measured["det_runs"])
    result: dict[str, Any] = {
        "bench": "engine",
        "timestamp": report.timestamp(),
        "unix_time": time.time(),
        "model": TINY_MODEL if tiny else str(model_dir),
        "new_tokens": new_tokens,
        "prompt_tokens": PROMPT_LEN,
        "repeats": repeats,
        "num_threads": num_threads,
        "tok_s": tok_s,
        "det_tok_s": det_tok_s,
        "det_ratio": det_ratio,
        "runs": {str(b): v for b, v in measured["runs"].items()},
        "det_runs": {str(b): v for b, v in measured["det_runs"].items()},
        **judged_json(targets, values, intervals),
        "machine": report.machine_after(machine),
    }
    title = "belayer bench engine (medians, 95 % intervals over the runs)"
    report.publish("engine", title, rows(result), json_path, result)
    return result


if __name__ == "__main__":
    main(
        Path("bench-results/engine.json"),
        Path(sys.argv[1]) if len(sys.argv) > 1 else None,
    )
