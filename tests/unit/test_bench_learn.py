"""``belayer bench learn``'s judgement (``bench.learn``): the gain per seed from the held-out
problems' own results, its paired interval, the verdict, and reading runs made before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.learn import gain, main
from workloads.swe_gen import held_out_ids

IDS = [f"math-chain_sum-h-{i}" for i in range(64)]


def record(step: int, solved: int) -> dict:
    """A metrics line: the first ``solved`` held-out problems right (reward 1.0), the rest
    wrong with partial credit (which is not exact)."""
    rewards = {t: 1.0 if i < solved else 0.09 for i, t in enumerate(IDS)}
    return {"step": step, "heldout_rewards": rewards, "heldout_exact": solved / len(IDS)}


def test_gain_is_computed_from_the_problems() -> None:
    g = gain([record(0, 32), record(1, 40), record(2, 48)])
    assert (g["start"], g["last"], g["gain"], g["last_step"]) == (0.5, 0.75, 0.25, 2)
    assert g["problems"] == 64
    assert 0 < g["interval"].low < 0.25 < g["interval"].high


def test_no_step_0_is_no_gain() -> None:
    assert gain([record(1, 40), record(2, 48)])["gain"] is None
    assert gain([record(0, 40)])["gain"] is None


def swe_record(step: int, instances: int, families: int) -> dict:
    """A swe metrics line: 12 held-out instances (the first ``instances`` solved) and 6
    held-out-family tasks (the first ``families`` solved); no exact match (tests score)."""
    ids = held_out_ids(18)
    inst = [t for t in ids if "-i-" in t]
    fam = [t for t in ids if "-f-" in t]
    rewards = {t: float(i < instances) for i, t in enumerate(inst)}
    rewards |= {t: float(i < families) for i, t in enumerate(fam)}
    return {"step": step, "heldout_rewards": rewards, "heldout_exact": None}


def test_swe_gain_counts_held_out_instances_and_reports_families_apart(tmp_path: Path) -> None:
    records = [swe_record(0, 3, 0), swe_record(1, 6, 0), swe_record(2, 9, 3)]
    g = gain(records)
    assert (g["start"], g["last"], g["gain"], g["problems"]) == (0.25, 0.75, 0.5, 12)
    write_run(tmp_path / "a", records)
    (seed,) = main(tmp_path / "learn.json", seeds=(0,), runs=(tmp_path / "a",))["seeds"]
    assert seed["curve"] == [(0, 0.25), (1, 0.5), (2, 0.75)]
    assert seed["family_gain"] == {"start": 0.0, "last": 0.5, "gain": 0.5, "problems": 6}
    ids = held_out_ids(18)
    inst, fam = [t for t in ids if "-i-" in t], [t for t in ids if "-f-" in t]
    assert seed["solved"]["0"] == sorted(inst[:3])
    assert seed["solved"]["2"] == sorted(inst[:9] + fam[:3])


def write_run(run_dir: Path, records: list[dict]) -> None:
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run_dir / "report.json").write_text(json.dumps({"wall_seconds": 100.0, "errors": []}))


def test_runs_are_judged_per_seed(tmp_path: Path) -> None:
    write_run(tmp_path / "a", [record(0, 16), *(record(s, 64) for s in range(1, 21))])
    write_run(tmp_path / "b", [record(0, 40), record(20, 41)])
    out = tmp_path / "learn.json"
    result = main(out, seeds=(0, 1), runs=(tmp_path / "a", tmp_path / "b"))
    a, b = result["seeds"]
    assert a["gain"] == 0.75 and a["verdict"] == "PASS" and a["curve"][0] == (0, 0.25)
    assert b["gain"] == 1 / 64 and b["verdict"] == "MISS"
    assert result["verdict"] == "MISS" and json.loads(out.read_text())["verdict"] == "MISS"


def test_a_run_without_metrics_is_a_problem(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    result = main(tmp_path / "learn.json", seeds=(0,), runs=(tmp_path / "empty",))
    assert result["verdict"] == "MISS" and "no held-out evaluation" in result["problems"][0]


def test_run_args_reach_every_run_and_the_json(tmp_path: Path, monkeypatch) -> None:
    """``--run-args``: each seed's ``belayer run`` gets them, the JSON records them."""
    import bench.learn as learn

    calls = []

    def fake_run(root, label, workload, model, steps, inject, options, seed, bench):
        assert bench == "learn"  # its progress lines say whose run it is
        calls.append((seed, options))
        write_run(root / label, [record(0, 16), record(steps, 32)])
        return {"wall_seconds": 1.0, "errors": []}

    monkeypatch.setattr(learn, "warm_model", lambda workload, path: path)
    monkeypatch.setattr(learn, "belayer_run", fake_run)
    out = tmp_path / "learn.json"
    result = main(out, seeds=(0, 1), steps=2, run_args=["--beta", "0.04"])
    assert calls == [(0, ["--beta", "0.04"]), (1, ["--beta", "0.04"])]
    assert json.loads(out.read_text())["run_args"] == ["--beta", "0.04"]
    assert [s["gain"] for s in result["seeds"]] == [0.25, 0.25]


def test_a_stopped_bench_leaves_no_run_directory(tmp_path: Path, monkeypatch) -> None:
    """Ctrl-C or SIGTERM (the CLI raises ``KeyboardInterrupt``) during a seed's run: the
    bench's temporary directory — model, run directories, node homes — is removed."""
    import tempfile

    import bench.learn as learn

    def stopped_run(root, label, *args):
        write_run(root / label, [record(0, 16)])
        raise KeyboardInterrupt

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(learn, "warm_model", lambda workload, path: path)
    monkeypatch.setattr(learn, "belayer_run", stopped_run)
    with pytest.raises(KeyboardInterrupt):  # not swallowed: the CLI exits 143 / 130
        main(tmp_path / "learn.json", seeds=(0,), steps=2)
    assert list(tmp_path.glob("belayer-bench-learn-*")) == []
