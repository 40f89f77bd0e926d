"""Workload plugins (``workloads.plugins``): a user's ``module:factory`` and an installed
package's entry point load through ``load_workload`` like a built-in; every way a plugin can be
wrong is one ``InvalidRequest`` naming it, never a traceback; the controller's schema takes a
plugin spec, and only the specs a node enables are imported from a request."""

from __future__ import annotations

import asyncio
import textwrap
from pathlib import Path

import msgspec
import pytest

from common.errors import InvalidRequest, NotFound
from schemas.rollout import RolloutRequest
from workloads import load_workload, plugins
from workloads.registry import available, workload_names

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "plugin"


@pytest.fixture
def example_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLE))


def test_the_example_plugin_loads_by_spec_and_scores_a_correct_answer_1(example_path: None) -> None:
    wl = load_workload("belayer_example_tasks:make")
    assert wl.name == "capitals"
    tasks = wl.tasks(4, seed=3)
    assert tasks == wl.tasks(4, seed=3) and len(tasks) == 4
    held = {t.prompt[-1].content for t in wl.held_out(8)}
    assert not held & {t.prompt[-1].content for t in tasks}
    task = tasks[0]
    assert wl.task(task.id) == task
    word = task.prompt[-1].content
    right = asyncio.run(wl.reward(task, f"The word is {word}.\nAnswer: {word.upper()}"))
    wrong = asyncio.run(wl.reward(task, f"Answer: {word}"))
    assert (right, wrong) == (1.0, 0.0)


def test_options_reach_the_factory_and_unknown_ones_are_refused(example_path: None) -> None:
    assert len(load_workload("belayer_example_tasks:make", held_out_words=2).held_out(8)) == 2
    with pytest.raises(InvalidRequest, match="unknown workload option"):
        load_workload("belayer_example_tasks:make", words=3)


def _module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, body: str) -> None:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.mark.parametrize(
    ("spec", "body", "message"),
    [
        ("no_such_module_xyz:make", None, "cannot import the workload plugin's module"),
        ("bad_plugin_a:make", "raise RuntimeError('boom at import')\n", "raised while importing"),
        ("bad_plugin_b:make", "x = 1\n", "has no such callable"),
        ("bad_plugin_c:make", "def make():\n    raise ValueError('no data')\n", "factory raised"),
        ("bad_plugin_d:make", "def make():\n    return object()\n", "did not return a workload"),
        ("not a spec:", None, "package.module:attribute"),
    ],
)
def test_a_broken_plugin_is_one_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spec: str, body: str | None, message: str
) -> None:
    if body is not None:
        _module(tmp_path, monkeypatch, spec.split(":")[0], body)
    with pytest.raises(InvalidRequest, match=message) as info:
        load_workload(spec)
    assert info.value.data["plugin"] == spec
    assert "Traceback" not in str(info.value)


def test_an_installed_entry_point_is_found_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A distribution on sys.path (its dist-info, as pip writes it) declaring the example in
    the ``belayer.workloads`` group: loadable by the entry point's name, listed with its
    source."""
    (tmp_path / "belayer_example_tasks.py").write_text(
        (EXAMPLE / "belayer_example_tasks.py").read_text()
    )
    info = tmp_path / "belayer_example_tasks-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: belayer-example-tasks\nVersion: 0.1.0\n"
    )
    (info / "entry_points.txt").write_text(
        "[belayer.workloads]\ncapitals = belayer_example_tasks:make\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_workload("capitals").name == "capitals"
    assert "capitals" in workload_names()
    found = {f.name: f for f in available()}
    assert found["capitals"].target == "belayer_example_tasks:make"
    assert found["capitals"].source.startswith("entry point (belayer-example-tasks 0.1.0")
    assert found["math"].source == "built-in"


def test_an_unknown_name_is_not_found() -> None:
    with pytest.raises(NotFound, match="unknown workload"):
        load_workload("no-such-workload")


def test_the_rollout_request_takes_a_plugin_spec_and_refuses_other_shapes() -> None:
    ok = RolloutRequest(workload="my_pkg.tasks:make")
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(ok), type=RolloutRequest) == ok
    for bad in ("my_pkg.tasks:", ":make", "a b:make", "my_pkg/tasks:make", "x:y:z"):
        with pytest.raises(msgspec.ValidationError):
            msgspec.msgpack.decode(
                msgspec.msgpack.encode({"type": "RolloutRequest.v1", "workload": bad}),
                type=RolloutRequest,
            )
    assert plugins.is_spec("my_pkg.tasks:make") and not plugins.is_spec("math")


def test_the_controller_imports_only_the_plugins_its_node_enables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, example_path: None
) -> None:
    """A rollout request naming a plugin the node was not started with is ``unauthorized``
    before any import (the module below would fail loudly if imported); an enabled one loads."""
    from common.errors import Unauthorized
    from services.controller.config import ControllerConfig
    from services.controller.service import Controller

    _module(tmp_path, monkeypatch, "must_not_import", "raise SystemExit('imported!')\n")
    svc = Controller(ControllerConfig(workload_plugins=("belayer_example_tasks:make",)))
    svc.workloads = {}
    with pytest.raises(Unauthorized, match="does not run that workload plugin"):
        asyncio.run(svc.workload_of(RolloutRequest(workload="must_not_import:make")))
    wl = asyncio.run(svc.workload_of(RolloutRequest(workload="belayer_example_tasks:make")))
    assert wl.name == "capitals"


def test_workloads_ls_lists_built_ins_and_a_plugin_and_refuses_a_broken_one() -> None:
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(EXAMPLE)}
    argv = [sys.executable, "-m", "services.cli.main", "workloads", "ls", "--json"]
    out = subprocess.run([*argv, "--plugin", "belayer_example_tasks:make"], env=env,
                         capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    listed = {w["name"]: w for w in json.loads(out.stdout)["workloads"]}
    assert listed["math"] == {
        "name": "math",
        "source": "built-in",
        "target": "workloads.math_tasks:MathWorkload",
    }
    assert listed["capitals"]["target"] == "belayer_example_tasks:make"
    bad = subprocess.run([*argv, "--plugin", "no_such_module_xyz:make"], env=env,
                         capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert bad.returncode == 1 and bad.stdout == ""
    assert bad.stderr.startswith("error: --plugin 'no_such_module_xyz:make': cannot import")
    assert "Traceback" not in bad.stderr
