"""Every benchmark's verdict reads an interval: the intervals each benchmark computes from its
own samples (hand-made here), and the invariants it judges on every trial instead."""

from __future__ import annotations

from typing import Any

import pytest


def test_engine_and_serve_intervals_come_from_their_runs() -> None:
    from bench.engine import engine_intervals
    from bench.serve_report import serve_intervals

    fast = {"1": [160.0, 170.0, 165.0], "8": [700.0, 720.0, 680.0]}
    det = {"1": [100.0, 110.0, 105.0], "8": [420.0, 430.0, 410.0]}
    got = engine_intervals(fast, det)
    tok = got["engine_tok_s_b8"]
    assert tok is not None and tok.value == 700.0 and tok.n == 3
    ratio = got["engine_det_ratio_b8"]
    assert ratio is not None and ratio.value == pytest.approx(420.0 / 700.0)

    def bus(xs: list[float]) -> list[dict[str, Any]]:
        return [{"tok_s": x} for x in xs]

    runs = {
        "engine_tok_s": fast, "engine_det_tok_s": det,
        "bus": {"1": bus([150.0, 151.0, 149.0]), "8": bus([650.0, 640.0, 660.0])},
        "bus_det": {"1": bus([90.0, 91.0, 92.0]), "8": bus([400.0, 390.0, 410.0])},
        "attach_reported_s": [0.05, 0.07], "up_s": [6.0],
    }  # fmt: skip
    s = serve_intervals(runs)
    loss = s["bus_loss_b8"]
    assert loss is not None and loss.value == pytest.approx(1 - 650.0 / 700.0)
    assert loss.low <= loss.value <= loss.high
    det_ratio = s["bus_det_ratio_b8"]
    assert det_ratio is not None and det_ratio.value == pytest.approx(400.0 / 650.0)
    attach = s["attach_s"]
    assert attach is not None and (attach.low, attach.high) == (0.05, 0.07)
    assert s["up_s"] is None  # one node start: no interval (the verdict is UNSURE)


def test_the_bus_loss_is_judged_over_interleaved_pairs_where_the_runs_have_them() -> None:
    """A slow spell that hits the bus run and the engine run beside it equally is no loss;
    against the engine-alone runs measured before the node (700 tok/s) it would look like
    one."""
    from bench.serve_report import bus_loss, paired_alone, serve_intervals

    bus8 = [{"tok_s": t, "engine_alone_tok_s": a} for t, a in ((600, 606), (500, 505), (640, 640))]
    fast = {"1": [160.0, 170.0, 165.0], "8": [700.0, 720.0, 680.0]}
    runs = {
        "engine_tok_s": fast, "engine_det_tok_s": fast,
        "bus": {"1": [{"tok_s": 150.0}] * 3, "8": bus8}, "bus_det": {"1": [], "8": bus8},
    }  # fmt: skip
    loss = serve_intervals(runs)["bus_loss_b8"]
    assert loss is not None and loss.n == 3
    assert loss.value == pytest.approx(1 - 600 / 606)
    assert loss.low <= loss.value <= loss.high < 0.05
    assert bus_loss(bus8, 700.0) == pytest.approx(1 - 600 / 606)
    assert paired_alone({8: bus8, 1: [{"tok_s": 150.0}]}) == {"8": 606.0, "1": None}
    # without interleaved runs: against the engine measured before the node, as before
    assert bus_loss([{"tok_s": 650.0}], 700.0) == pytest.approx(1 - 650 / 700)


def test_handover_intervals_and_invariants() -> None:
    from bench.handover import INVARIANTS, TARGETS, intervals_of
    from bench.stats import judge_all

    def failure(detect: float, first: float, regenerated: int = 0) -> dict[str, Any]:
        return {"detect_s": detect, "first_token_s": first, "regenerated_tokens": regenerated}

    bel = [failure(0.05 + 0.005 * i, 0.1 + 0.01 * i) for i in range(10)]
    base = [failure(5.0, 6.0 + i, 24) for i in range(3)]

    def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
        return {k: {"all": [r[k] for r in rows]} for k in ("detect_s", "first_token_s")}

    result = {
        "belayer": {
            "failures": bel, "summary": summary(bel),
            "shadow_ab": {"pair_ratios": [0.99, 1.0, 0.995, 1.01, 0.99, 1.0, 0.985]},
            "sampled_resumes": {"rounds": [{"exact": True}] * 4 + [{"exact": False}]},
        },
        "baseline": {"failures": base, "summary": summary(base)},
    }  # fmt: skip
    iv = intervals_of(result)
    assert all(iv[k] is not None for k in TARGETS)
    speedup = iv["speedup_first_token"]
    assert speedup is not None and speedup.value == pytest.approx(7.0 / 0.15)  # nearest rank
    values = {"detect_p50_s": 0.07, "detect_p99_s": 0.095, "first_token_p50_s": 0.15,
              "speedup_first_token": speedup.value, "regenerated_tokens": 0.0,
              "throughput_overhead": 0.005, "sampled_exact_det": 0.8}  # fmt: skip
    verdicts = judge_all(TARGETS, values, iv, INVARIANTS)
    assert verdicts["detect_p50_s"] == "PASS"
    assert verdicts["regenerated_tokens"] == "PASS"
    # one inexact sampled resume in five: a MISS, although its interval reaches 1.0
    assert iv["sampled_exact_det"] is not None and iv["sampled_exact_det"].high == 1.0
    assert verdicts["sampled_exact_det"] == "MISS"


def test_env_intervals_pair_each_repeat_with_its_raw_run() -> None:
    from bench.env import INVARIANTS, TARGETS, env_intervals, judged
    from bench.stats import judge_all

    def row(mem: int, layer: int, ck: list[float], raw: list[float]) -> dict[str, Any]:
        med = sorted(ck)[len(ck) // 2]
        return {
            "memory_mb": mem, "layer_mb": layer, "checkpoint_ms": med, "restore_ms": med * 2,
            "checkpoint_over_raw": 1.2, "restore_over_raw": 1.5,
            "runs_ms": {"checkpoint": ck, "restore": [x * 2 for x in ck], "raw_criu_tar": raw,
                        "raw_restore_untar": raw},
        }  # fmt: skip

    measured = {
        "rows": [row(0, 2, [100.0, 110.0, 105.0, 120.0, 95.0], [80.0] * 5),
                 row(256, 2, [900.0, 950.0, 1000.0, 920.0, 940.0], [800.0] * 5)],
        "consistency": {"cycles": 4, "inconsistent": 1, "outcomes": [0, 0, 1, 0]},
    }  # fmt: skip
    iv = env_intervals(measured)
    small = iv["checkpoint_small_ms"]
    assert small is not None and small.value == 105.0 and small.n == 5
    over = iv["checkpoint_over_raw"]
    assert over is not None and over.value == pytest.approx(940.0 / 800.0)
    verdicts = judge_all(TARGETS, judged(measured), iv, INVARIANTS)
    assert verdicts["checkpoint_small_ms"] == "PASS"
    assert verdicts["inconsistent_restores"] == "MISS"  # one inconsistent cycle
