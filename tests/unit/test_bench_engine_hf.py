"""``belayer bench engine --vs-hf``'s ratios and verdicts, on made-up runs (the measurement
itself is the benchmark's, not a test's: no wall-clock asserts here)."""

from __future__ import annotations

from bench.engine_hf import RUNNERS, TARGETS, _ratios, det_step_rows
from bench.report import MISS, PASS
from bench.stats import judge_all


def runs(hf: float, fast: float, det: float) -> dict[str, dict[int, list[float]]]:
    """Three interleaved repeats per runner at batch 1 and 8, with a little spread."""
    base = {"hf": hf, "fast": fast, "deterministic": det}
    return {
        r: {b: [base[r] * b * (1 + d) for d in (-0.01, 0.0, 0.01)] for b in (1, 8)} for r in RUNNERS
    }


def test_ratios_pair_the_runners_at_each_batch_size() -> None:
    values, intervals = _ratios(runs(100.0, 150.0, 120.0))
    assert set(values) == {
        f"{n}_b{b}" for n in ("fast_vs_hf", "det_vs_hf", "det_vs_fast") for b in (1, 8)
    }
    det_vs_hf, det_vs_fast = values["det_vs_hf_b1"], values["det_vs_fast_b8"]
    assert det_vs_hf is not None and abs(det_vs_hf - 1.2) < 1e-9
    assert det_vs_fast is not None and abs(det_vs_fast - 0.8) < 1e-9
    interval = intervals["det_vs_hf_b8"]
    assert interval is not None and interval.low <= 1.2 <= interval.high and interval.n == 3


def test_the_targets_are_the_issues_and_read_the_intervals() -> None:
    assert TARGETS == {
        "det_vs_hf_b1": (">=", 2.0),
        "det_vs_hf_b8": (">=", 1.5),
        "det_vs_fast_b8": (">=", 0.9),
    }
    slow, slow_iv = _ratios(runs(100.0, 150.0, 120.0))
    assert set(judge_all(TARGETS, dict(slow), slow_iv).values()) == {MISS}
    fast, fast_iv = _ratios(runs(100.0, 220.0, 210.0))
    assert set(judge_all(TARGETS, dict(fast), fast_iv).values()) == {PASS}


def test_the_extra_runners_are_compared_where_they_ran() -> None:
    """Deterministic mode without drafts at both batch sizes; HF's prompt lookup at batch 1
    only (HF runs it at batch 1 only): no ratio is made up for a batch it did not run."""
    measured = runs(100.0, 150.0, 240.0)
    measured["det-no-drafts"] = {b: [120.0 * b] * 3 for b in (1, 8)}
    measured["hf-lookup"] = {1: [200.0] * 3, 8: []}
    values, _ = _ratios(measured)
    assert values["det_vs_det_no_drafts_b1"] == 2.0
    assert values["det_vs_det_no_drafts_b8"] == 2.0
    assert values["det_vs_hf_lookup_b1"] == 1.2
    assert "det_vs_hf_lookup_b8" not in values


def test_det_step_rows_pads_each_batch_to_the_machines_bucket() -> None:
    """The rows a deterministic decode step's products run with: the batch padded to the
    bucket from this machine's GEMM floor (4 on AVX2, 16 on AVX-512: twice HF's rows at 8)."""
    assert det_step_rows(4) == {"1": 4, "8": 8}
    assert det_step_rows(16) == {"1": 16, "8": 16}
    assert det_step_rows(1) == {"1": 1, "8": 8}
