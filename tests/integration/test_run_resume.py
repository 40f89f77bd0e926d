"""``belayer run --resume`` after a run stopped between its trainer's checkpoint of a step and
the step's record (SIGTERM during the step's push or evaluation leaves exactly that): the step
is run again from the checkpoint before it, so the metrics hold every step once, and in
deterministic mode the redone step is the step the stopped run trained — the same weights
bit for bit and the same record (reward, tokens, held-out accuracy), only the timings differ."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from model.training import load_weights
from services.rl.report import read_metrics, rewrite_metrics
from services.trainer import journal
from services.trainer.update import weights_equal

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SAME = (
    "reward_mean",
    "tokens",
    "heldout_reward",
    "heldout_rewards",
    "logprob_diff_max",
    "weight_version",
    "weights_sha256",
)
"""Fields of a step's record that a deterministic redo reproduces exactly."""

DOCS = Path(__file__).resolve().parents[2] / "docs" / "training.md"


def documented_metrics() -> set[str]:
    """The names docs/training.md gives in its ``metrics.jsonl`` section."""
    text = DOCS.read_text()
    section = text[text.index("**`metrics.jsonl`**") : text.index("**What is scored**")]
    return set(re.findall(r"`([a-z0-9_]+)`", section))


def belayer_run(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "BELAYER_HOME": str(home)}
    return subprocess.run(
        [sys.executable, "-m", "services.cli.main", "run", "math", *args],
        capture_output=True, text=True, timeout=240, env=env, check=False,
    )  # fmt: skip


def test_a_step_trained_but_not_recorded_is_run_again_bit_for_bit(
    warm_model: Callable[[str], Path], tmp_path: Path
) -> None:
    out = tmp_path / "run"
    args = ("--steps", "2", "--model", str(warm_model("math")), "--out", str(out),
            "--held-out", "8", "--json")  # fmt: skip
    first = belayer_run(tmp_path / "home", *args)
    assert first.returncode == 0, first.stderr[-4000:]
    ckpt = out / "trainer"
    trained = load_weights(journal.checkpoint_path(ckpt, 2))
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    # the state a stop after step 2's checkpoint and before its record leaves
    rewrite_metrics(out / "metrics.jsonl", records[:2])

    again = belayer_run(tmp_path / "home", *args, "--resume")
    assert again.returncode == 0, again.stderr[-4000:]
    assert "step 2 was trained but not recorded: it is run again" in again.stderr
    assert "not checkpointed" not in again.stderr  # one reason per step
    redone = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in redone] == [0, 1, 2]
    assert {k: redone[2].get(k) for k in SAME} == {k: records[2].get(k) for k in SAME}
    assert redone[2]["rollout_id"] != records[2]["rollout_id"]  # it did run again
    assert weights_equal(load_weights(journal.checkpoint_path(ckpt, 2)), trained)
    report = json.loads(again.stdout)
    assert report["steps"] == 2 and [r["step"] for r in report["per_step"]] == [0, 1, 2]
    assert report["invocations"] == 2  # report.md says the time is this invocation's
    # the totals are the whole run's: step 1's checkpoint (the first invocation) and the redone
    # step 2's (this one; the first invocation's step 2 was dropped with its record)
    assert report["checkpoints"] == 2 and report["trainer_restarts"] == 0
    assert [r.get("checkpoints") for r in report["per_step"]] == [None, 1, 1]
    gain = report["heldout_gain"]  # step 0 against step 2, over the 8 held-out tasks
    assert gain["n"] == 8 and gain["ci95"][0] <= gain["value"] <= gain["ci95"][1]
    start, last = redone[0]["heldout_rewards"], redone[2]["heldout_rewards"]
    assert gain["value"] == pytest.approx(
        sum(last.values()) / 8 - sum(start.values()) / 8, abs=1e-4
    )
    # every field a step's record has is explained in the docs (users parse these lines)
    assert set().union(*redone) - documented_metrics() == set()
    assert "Resumed: this is the run's invocation 2" in (out / "report.md").read_text()
