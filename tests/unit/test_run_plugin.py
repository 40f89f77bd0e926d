"""``belayer run --workload SPEC`` before anything starts: a plugin that does not import, an
import or a factory that raises, a factory that returns no workload, a reward function that
cannot be imported — each is one ``error:`` line, exit 2, and no node, no run directory; the
defaults a workload declares (``run_defaults``) and the generic ones; the model a plugin's run
needs; ``--resume`` of a run of another workload or other reward functions is refused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.errors import InvalidRequest
from services.rl.options import RunOptions, RunState
from services.rl.run_workload import PLUGIN_DEFAULTS, PLUGIN_LR, resolve

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "plugin"
SPEC = "belayer_example_tasks:make"
PLUGINS = """
from belayer_example_tasks import Capitals, make as _make
import msgspec
from workloads import TaskLimits

raise_on_import = None

def raising():
    raise RuntimeError("boom in the factory")

class Plain(Capitals):
    run_defaults = None

def plain():
    return Plain()

def not_a_workload():
    return 42

def declared():
    wl = _make()
    wl.run_defaults = {"tasks": 3, "n": 5, "lr": 3e-4}
    return wl

def bad_defaults():
    wl = _make()
    wl.run_defaults = {"tasks": 0}
    return wl

def bad_rewards():
    wl = _make()
    wl.rewards = ["my_plugins:raising"]
    return wl

class MultiTurn(Capitals):
    def _task(self, tag, word):
        task = super()._task(tag, word)
        return msgspec.structs.replace(task, limits=TaskLimits(max_turns=2))

def multi_turn():
    return MultiTurn()
"""


@pytest.fixture
def plugin_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory with ``my_plugins.py`` (the cases above) and ``broken_import.py``, put on
    ``sys.path`` with the example plugin, as PYTHONPATH would."""
    root = tmp_path / "plugins"
    root.mkdir()
    (root / "my_plugins.py").write_text(PLUGINS)
    (root / "broken_import.py").write_text("raise ValueError('broken at import')\n")
    monkeypatch.syspath_prepend(str(EXAMPLE))
    monkeypatch.syspath_prepend(str(root))
    return root


def belayer_run(plugin_path: Path, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugin_path), str(EXAMPLE)])}
    return subprocess.run(
        [sys.executable, "-m", "services.cli.main", "run", *args, "--out", str(tmp_path / "r"),
         "--run-dir", str(tmp_path / "node")],
        capture_output=True, text=True, timeout=60, env=env, check=False,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--workload", "no_such_module:make"], "cannot import the workload plugin's module"),
        (["--workload", "broken_import:make"], "ValueError: broken at import"),
        (["--workload", "my_plugins:raising"], "RuntimeError: boom in the factory"),
        (["--workload", "my_plugins:not_a_workload"], "did not return a workload"),
        (["--workload", "my_plugins:nothing_here"], "no such callable"),
        (["--workload", "my_plugins:bad_defaults"], "run_defaults tasks must be a whole number"),
        (["--workload", "my_plugins:bad_rewards"], "rewards must be a list of 'service:<name>'"),
        (["--workload", "my_plugins:multi_turn"], "pass --model DIR"),
        (["--workload", SPEC, "--reward", "no_such_module:fn"], "--reward 'no_such_module:fn'"),
        (["--workload", SPEC, "--reward-weights", "2"], "--reward-weights weighs --reward"),
        (["math", "--workload", SPEC], "give the workload once"),
        ([], "missing the workload"),
        (["--workload", "dapo"], "unknown workload 'dapo'"),
    ],
)
def test_a_bad_plugin_is_one_line_before_anything_starts(
    plugin_path: Path, tmp_path: Path, args: list[str], words: str
) -> None:
    proc = belayer_run(plugin_path, tmp_path, *args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], lines
    assert not (tmp_path / "r").exists() and not (tmp_path / "node").exists()  # nothing started


def test_a_workload_declares_its_run_defaults(plugin_path: Path) -> None:
    rw = resolve(RunOptions(workload="my_plugins:declared"))
    assert rw.defaults == {**PLUGIN_DEFAULTS, "tasks": 3, "n": 5} and rw.lr == 3e-4
    assert rw.plugin and rw.single_turn and not rw.sandboxed
    assert rw.label == "capitals" and rw.node_plugins == ("my_plugins:declared",)


def test_a_plugin_without_run_defaults_gets_the_generic_ones(plugin_path: Path) -> None:
    rw = resolve(RunOptions(workload="my_plugins:plain"))
    assert rw.defaults == PLUGIN_DEFAULTS and rw.lr == PLUGIN_LR


def test_the_example_declares_its_defaults(plugin_path: Path) -> None:
    rw = resolve(RunOptions(workload=SPEC))
    assert rw.defaults == {"tasks": 4, "n": 4, "held_out": 8, "eval_every": 1} and rw.lr == 2e-4


def test_the_built_in_workloads_keep_their_defaults() -> None:
    rw = resolve(RunOptions(workload="math"))
    assert (rw.defaults["tasks"], rw.defaults["n"], rw.lr) == (8, 8, 5e-5) and not rw.plugin
    assert rw.node_plugins == () and rw.label == "math"


def test_reward_functions_are_refused_on_swe() -> None:
    with pytest.raises(InvalidRequest, match="not swe's sandboxes"):
        resolve(RunOptions(workload="swe", rewards=("belayer_example_rewards:brevity",)))


@pytest.mark.parametrize(
    ("prior", "args", "words"),
    [
        ("math", [], "is a math run"),
        (SPEC, ["--reward", "belayer_example_rewards:brevity"], "--reward none"),
    ],
)
def test_resume_checks_the_workload_spec_and_its_rewards(
    plugin_path: Path, tmp_path: Path, prior: str, args: list[str], words: str
) -> None:
    RunState(
        run_id="r1234", workload=prior, dataset="", model_dir="/elsewhere/model", model_fingerprint="0" * 32,
        tasks=4, n=4, seed=0, policy="risk-aware", pool=["a"], held_out=["b"], created_at=0.0,
    ).write(tmp_path / "r")  # fmt: skip
    proc = belayer_run(plugin_path, tmp_path, "--workload", SPEC, "--resume", *args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --resume") and words in lines[0], lines
    assert not (tmp_path / "node").exists()
