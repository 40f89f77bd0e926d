"""``belayer run`` before anything starts: the injection grammar (the rollout's, extended with
``step=S``, ``trainer-kill`` and ``shadow-kill``), the bad inputs refused in one line, and the
run's writers, which log a failure and never raise into training."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from common.errors import InvalidRequest
from services.rl.options import (
    check_model_dir,
    choose_tasks,
    faults_of,
    parse_run_inject,
    step_tasks,
)
from services.rl.report import RunLogs, make_plots, read_metrics


def test_step_items_fire_once_in_their_step_and_others_every_step() -> None:
    specs = parse_run_inject(
        "worker-kill@step=1,sandbox-kill@turn=2,trainer-kill@step=2,shadow-kill@step=1,"
        "sandbox-kill@step=2",
        steps=2,
        sandboxed=True,
    )
    one, two = faults_of(specs, 1, sandboxed=True), faults_of(specs, 2, sandboxed=True)
    assert [(s.kind, s.trigger, s.value, s.target) for s in one.rollout] == [
        ("worker-kill", "turn", 1, -1),
        ("sandbox-kill", "turn", 2, -1),
    ]
    assert one.shadow_kill == "shadow-kill@step=1" and not one.trainer_kill
    assert [(s.kind, s.trigger, s.value, s.target) for s in two.rollout] == [
        ("sandbox-kill", "turn", 2, -1),
        ("sandbox-kill", "turn", 1, 0),  # step=S: trajectory #0, after its first action
    ]
    assert two.trainer_kill == "trainer-kill@step=2" and not two.shadow_kill
    assert all(s.text for s in one.rollout + two.rollout)  # events name the spec as written


def test_single_turn_tasks_kill_the_worker_at_the_rollout_start() -> None:
    specs = parse_run_inject("worker-kill@step=1", steps=1, sandboxed=False)
    (spec,) = faults_of(specs, 1, sandboxed=False).rollout
    assert (spec.kind, spec.trigger, spec.value) == ("worker-kill", "s", 0.0)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("trainer-kill@turn=1", "takes only step=S"),
        ("shadow-kill@p=0.1", "takes only step=S"),
        ("worker-kill@step=3", "the run has 2 steps"),
        ("worker-kill@step=0", "step=S needs a whole number"),
        ("worker-kill@step=x", "step=S needs a whole number"),
        ("disk-kill@step=1", "unknown kind"),
        ("worker-kill@when=1", "unknown trigger"),
        ("sandbox-kill@step=1", "runs no sandbox"),
        ("worker-kill@step=1,", "empty item"),
    ],
)
def test_bad_injections_are_refused(text: str, words: str) -> None:
    with pytest.raises(InvalidRequest, match=words):
        parse_run_inject(text, steps=2, sandboxed="sandbox" not in text)


def test_a_directory_that_is_not_a_checkpoint_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match=r"not a Qwen3 or Llama checkpoint: no config\.json"):
        check_model_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(InvalidRequest, match="not a Qwen3 or Llama checkpoint"):
        check_model_dir(tmp_path)


def test_a_dataset_with_no_tasks_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(InvalidRequest, match=re.escape(f"dataset {empty}")):
        choose_tasks("math", str(empty), 4, 2, 1, 0)


def test_tasks_cycle_through_the_pool() -> None:
    pool = ["a", "b", "c"]
    assert [step_tasks(pool, s, 2) for s in (1, 2, 3)] == [["a", "b"], ["c", "a"], ["b", "c"]]


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--steps", "0"], "--steps"),
        (["--inject", "trainer-kill@turn=2"], "takes only step=S"),
        (["--model", "/nonexistent-model-dir"], "not a Qwen3 or Llama checkpoint"),
    ],
)
def test_bad_input_is_one_line_before_anything_starts(
    tmp_path: Path, args: list[str], words: str
) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli.main", "run", "swe", "--out", str(tmp_path / "r"),
         "--run-dir", str(tmp_path / "node"), *args],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], lines
    assert not (tmp_path / "r").exists() and not (tmp_path / "node").exists()  # nothing started


def test_a_writer_failure_is_logged_and_training_goes_on(tmp_path: Path) -> None:
    logs = RunLogs(tmp_path)
    (tmp_path / "samples.jsonl").mkdir()  # not a file: every append fails
    record = {"step": 1, "reward_mean": 0.5, "loss": float("nan")}
    with capture_logs() as logged:
        logs.step(record, [{"step": 1, "reward": 0.5}])
        logs.step({**record, "step": 2}, [{"step": 2, "reward": 0.5}])
        logs.close()
    assert "samples.jsonl" in logs.failed and "metrics.jsonl" not in logs.failed
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))  # NaN skipped, the rest kept
    failed = [e for e in logged if e["event"] == "metrics_write_failed"]
    assert [e["writer"] for e in failed] == ["samples.jsonl"]  # logged once per writer


def test_plots_are_written(tmp_path: Path) -> None:
    records = [
        {"step": 0, "heldout_reward": 0.2},
        {"step": 1, "reward_mean": 0.4, "heldout_reward": 0.3, "rollout_s": 3.0,
         "train_s": 2.0, "push_s": 0.1, "eval_s": 1.0, "t_start": 1.0, "t_end": 7.0},
    ]  # fmt: skip
    timeline = [{"t": 2.0, "type": "injected", "what": "worker-kill injected", "detail": ""}]
    paths = make_plots(tmp_path, records, timeline)
    assert [Path(p).name for p in paths] == ["reward.png", "time.png", "failures.png"]
    assert all(Path(p).read_bytes()[:4] == b"\x89PNG" for p in paths)


def test_a_resume_directory_of_another_model_is_refused(tmp_path: Path) -> None:
    from model.tiny import init_tiny_model
    from services.rl.options import RunState

    model = init_tiny_model(tmp_path / "model", hidden_size=64, num_layers=1, vocab_size=512)
    out = tmp_path / "run"
    RunState(
        run_id="math1234", workload="math", dataset="", model_dir="/elsewhere/model",
        model_fingerprint="0" * 32, tasks=4, n=4, seed=0, policy="risk-aware", pool=["a"],
        held_out=["b"], created_at=0.0,
    ).write(out)  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli.main", "run", "math", "--resume", "--out", str(out),
         "--model", str(model), "--run-dir", str(tmp_path / "node")],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "trained from another model (/elsewhere/model)" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (out / "node").exists()  # nothing started


def test_the_report_of_a_stopped_run_says_how_many_steps_were_asked_for() -> None:
    from services.rl.report import markdown

    report = {"workload": "math", "run_id": "math1", "tasks": 8, "n": 8, "model_dir": "m",
              "recovery": "belayer", "deterministic": True, "wall_seconds": 57.0}  # fmt: skip
    stopped = markdown({**report, "steps": 14, "steps_planned": 20}, [])
    assert "\n14 of 20 steps, 8 tasks × 8 samples per step" in stopped
    done = markdown({**report, "steps": 20, "steps_planned": 20}, [])
    assert "\n20 steps, 8 tasks × 8 samples per step" in done
    assert "Resumed" not in done


def test_the_report_says_which_cpu_the_run_ran_on() -> None:
    from common.machine import cpu_model, cpu_text, machine_info
    from services.rl.report import markdown

    report = {"workload": "math", "run_id": "math1", "tasks": 8, "n": 8, "model_dir": "m",
              "recovery": "belayer", "deterministic": True, "wall_seconds": 57.0, "steps": 20,
              "steps_planned": 20}  # fmt: skip
    epyc = {"cpu_model": "AMD EPYC", "cpu_flags": ["avx2"], "torch": "2.13.0+cpu"}
    assert "\nMachine: AMD EPYC (avx2), torch 2.13.0+cpu.\n" in markdown(
        {**report, "machine": epyc}, []
    )
    none = {"cpu_model": "Old CPU", "cpu_flags": [], "torch": "2.13.0+cpu"}
    assert "Machine: Old CPU (no avx2/avx512f/amx_tile)" in markdown(
        {**report, "machine": none}, []
    )
    assert "Machine:" not in markdown(report, [])  # a report written before it said
    name, flags = cpu_model()
    here = machine_info()
    assert (here["cpu_model"], here["cpu_flags"]) == (name, flags)
    assert f"Machine: {cpu_text(here)}, torch " in markdown({**report, "machine": here}, [])


def test_the_report_of_a_resumed_run_says_that_only_its_time_is_this_invocations() -> None:
    from services.rl.report import markdown

    report = {"workload": "math", "run_id": "math1", "tasks": 8, "n": 8, "model_dir": "m",
              "recovery": "belayer", "deterministic": True, "wall_seconds": 57.0, "steps": 20,
              "steps_planned": 20, "invocations": 3}  # fmt: skip
    text = markdown(report, [])
    assert (
        "inference; 57 s. Resumed: this is the run's invocation 3; the time counts this "
        "invocation, the totals and the table the whole run." in text
    )


def test_the_held_out_change_comes_with_its_paired_interval() -> None:
    from services.rl.records import heldout_gain
    from services.rl.report import markdown

    tasks = [f"t{i}" for i in range(10)]
    before = {"step": 0, "heldout_rewards": {t: float(i < 2) for i, t in enumerate(tasks)}}
    after = {"step": 5, "heldout_rewards": {t: float(i < 7) for i, t in enumerate(tasks)}}
    gain = heldout_gain([before, {"step": 2, "heldout_rewards": {}}, after])
    assert gain is not None and gain["value"] == 0.5 and gain["n"] == 10
    low, high = gain["ci95"]
    assert 0.1 < low < 0.5 < high <= 0.8  # five of ten tasks changed, all the same way
    assert heldout_gain([after]) is None  # nothing to compare with
    assert heldout_gain([{**before, "step": 1}, after]) is None  # no evaluation before training
    one = {"step": 0, "heldout_rewards": {"t0": 0.0}}
    assert heldout_gain([one, {"step": 1, "heldout_rewards": {"t0": 1.0}}]) is None  # n < 2
    report = {"workload": "math", "run_id": "math1", "tasks": 8, "n": 8, "model_dir": "m",
              "recovery": "belayer", "deterministic": True, "wall_seconds": 57.0, "steps": 5,
              "heldout_reward_start": 0.2, "heldout_reward_last": 0.7, "heldout_gain": gain}  # fmt: skip
    text = markdown(report, [])
    assert (
        f"Held-out reward 0.200 → 0.700: +0.500 (95 % CI {low:+.3f} … {high:+.3f}, paired " in text
    )
