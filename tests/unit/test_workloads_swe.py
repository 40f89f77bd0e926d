"""The SWE workloads without a sandbox: the bundled tasks' shape, the SWE-Gym loader (list vs
JSON-string test fields, local git checkouts, missing repository/column → clear errors), the
test-patch applier and the pytest summary parser."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from common.errors import InvalidRequest, NotFound
from workloads import HiddenTests, load_workload
from workloads.patch import apply_patch
from workloads.scoring import command_for_tests, parse_test_results, write_file_commands
from workloads.swe import BUNDLED_DIR

DATA = Path(__file__).resolve().parents[2] / "workloads" / "data"
CALC = BUNDLED_DIR / "calc_clamp" / "repo"


def _swe():
    return load_workload("swe-bundled", check_image=False)


def test_bundled_tasks_are_complete_and_hide_their_tests() -> None:
    w = _swe()
    train, held = w.tasks(4), w.held_out(2)
    assert len(train) == 4 and len(held) == 2 and not {t.id for t in train} & {t.id for t in held}
    assert "kv_daemon" in {t.id for t in train}
    with pytest.raises(InvalidRequest, match="only 4 available"):
        w.tasks(5)
    for t in train + held:
        assert w.task(t.id) is t
        assert t.sandbox is not None and t.sandbox.image == "belayer-swe:1"
        assert t.reference_actions and t.reward.fail_to_pass and t.prompt[-1].role == "user"
        hidden = set(t.reward.files) - set(t.sandbox.files)
        assert hidden, t.id  # the fail-to-pass tests are not in the agent's repository
        assert all(f.split("::")[0] in hidden for f in t.reward.fail_to_pass if "test_live" in f)
        assert set(t.sandbox.absolute_files()) == {f"/root/repo/{p}" for p in t.sandbox.files}
    assert w.tasks(4, seed=1) == w.tasks(4, seed=1)
    with pytest.raises(NotFound, match="unknown task id"):
        w.task("nope")


def test_bundled_tasks_dir_errors(tmp_path: Path) -> None:
    with pytest.raises(NotFound):
        load_workload("swe", check_image=False, tasks_dir=tmp_path / "absent")
    with pytest.raises(NotFound, match="no tasks"):
        load_workload("swe", check_image=False, tasks_dir=tmp_path)
    bad = tmp_path / "t1"
    (bad / "repo").mkdir(parents=True)
    (bad / "task.toml").write_text(
        'problem_statement = "x"\nfail_to_pass = ["tests/test_a.py::t"]\n'
    )
    with pytest.raises(InvalidRequest, match=r"task\.toml keys") as exc:
        load_workload("swe", check_image=False, tasks_dir=tmp_path)
    assert exc.value.data["missing"] == ["pass_to_pass"]


def _instance(**over: object) -> dict[str, object]:
    row = json.loads((DATA / "swe_gym_sample.jsonl").read_text().splitlines()[0])
    row["repo_path"] = str(CALC)
    row.update(over)
    return row


def _write(tmp_path: Path, *rows: dict[str, object]) -> Path:
    path = tmp_path / "instances.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_swe_gym_sample_points_at_a_bundled_repo() -> None:
    w = load_workload("swe-gym", path=DATA / "swe_gym_sample.jsonl", check_images=False)
    (t,) = w.tasks(1)
    bundled = _swe().task("calc_clamp")
    assert t.id == "belayer__calc-1" and w.task("belayer__calc-1") is t
    assert t.sandbox is not None and bundled.sandbox is not None
    assert t.sandbox.files == bundled.sandbox.files and t.sandbox.image == "belayer-swe:1"
    assert isinstance(t.reward, HiddenTests) and isinstance(bundled.reward, HiddenTests)
    assert t.reward.files == bundled.reward.files  # test_patch applied here
    assert t.reward.fail_to_pass == bundled.reward.fail_to_pass
    assert t.metadata["instance_id"] == "belayer__calc-1"


def test_swe_gym_test_fields_as_list_or_json_string(tmp_path: Path) -> None:
    f2p = ["tests/test_clamp.py::test_clamp_above"]
    p2p = ["tests/test_calc.py::test_add"]
    as_list = _instance(instance_id="a__b-1", FAIL_TO_PASS=f2p, PASS_TO_PASS=p2p)
    as_str = _instance(
        instance_id="a__b-2", FAIL_TO_PASS=json.dumps(f2p), PASS_TO_PASS=json.dumps(p2p)
    )
    w = load_workload(
        "swe-gym", path=_write(tmp_path, as_list, as_str), check_images=False, held_out=0
    )
    a, b = w.task("a__b-1"), w.task("a__b-2")
    assert a.reward == b.reward and isinstance(a.reward, HiddenTests)
    assert a.reward.fail_to_pass == f2p and a.reward.pass_to_pass == p2p
    bad = _instance(FAIL_TO_PASS="not json")
    with pytest.raises(InvalidRequest, match="FAIL_TO_PASS is not a JSON list"):
        load_workload("swe-gym", path=_write(tmp_path, bad), check_images=False)
    with pytest.raises(InvalidRequest, match="FAIL_TO_PASS is empty"):
        load_workload(
            "swe-gym", path=_write(tmp_path, _instance(FAIL_TO_PASS="[]")), check_images=False
        )


def test_swe_gym_missing_repository_or_column_is_a_clear_error(tmp_path: Path) -> None:
    missing = _instance(repo_path=str(tmp_path / "nowhere"))
    with pytest.raises(NotFound, match="repository not found") as exc:
        load_workload("swe-gym", path=_write(tmp_path, missing), check_images=False)
    assert exc.value.data["repo"] == str(tmp_path / "nowhere")
    no_source = _instance()
    del no_source["repo_path"]
    with pytest.raises(NotFound, match="no repository for the instance"):
        load_workload("swe-gym", path=_write(tmp_path, no_source), check_images=False)
    with pytest.raises(NotFound, match="repository not found"):
        load_workload(
            "swe-gym", path=_write(tmp_path, no_source), repos_dir=tmp_path, check_images=False
        )
    no_column = _instance()
    del no_column["base_commit"]
    with pytest.raises(InvalidRequest, match="base_commit") as refused:
        load_workload("swe-gym", path=_write(tmp_path, no_column), check_images=False)
    assert refused.value.data["missing"] == ["base_commit"]


def test_swe_gym_git_checkout_at_base_commit_and_image_mode(tmp_path: Path) -> None:
    repo = tmp_path / "repos" / "belayer__calc"
    repo.mkdir(parents=True)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "calc.py").write_bytes((CALC / "calc.py").read_bytes())
    (repo / "tests").mkdir()
    (repo / "tests" / "test_calc.py").write_bytes((CALC / "tests" / "test_calc.py").read_bytes())
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "base"], check=True)
    base = subprocess.run(
        [*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True
    ).stdout.strip()
    (repo / "calc.py").write_text("fixed later\n")
    subprocess.run([*git, "commit", "-qam", "later"], check=True)
    row = _instance(base_commit=base)
    del row["repo_path"]
    w = load_workload(
        "swe-gym", path=_write(tmp_path, row), repos_dir=tmp_path / "repos", check_images=False
    )
    t = w.tasks(1)[0]
    assert t.sandbox is not None and t.sandbox.files["calc.py"] == (CALC / "calc.py").read_bytes()
    with pytest.raises(NotFound, match="base_commit not found"):
        load_workload(
            "swe-gym",
            path=_write(tmp_path, dict(row, base_commit="0" * 40)),
            repos_dir=tmp_path / "repos",
            check_images=False,
        )
    imaged = dict(row, instance_id="org__proj-7")
    w = load_workload(
        "swe-gym",
        path=_write(tmp_path, imaged),
        image_template="sweb.eval.x86_64.{instance_key}:latest",
        check_images=False,
    )
    t = w.tasks(1)[0]
    assert t.sandbox is not None and t.sandbox.image == "sweb.eval.x86_64.org_1776_proj-7:latest"
    assert t.sandbox.workdir == "/testbed" and not t.sandbox.files
    assert isinstance(t.reward, HiddenTests)
    assert t.reward.test_patch == row["test_patch"] and not t.reward.files


def test_patch_applier() -> None:
    files = {"a.py": b"one\ntwo\nthree\nfour\n"}
    patch = (
        "diff --git a/a.py b/a.py\n--- a/a.py\n+++ b/a.py\n@@ -2,2 +2,3 @@\n two\n-three\n+THREE\n+3.5\n"
        "--- /dev/null\n+++ b/tests/test_new.py\n@@ -0,0 +1,2 @@\n+def test_x():\n+    pass\n"
    )
    out = apply_patch(files, patch)
    assert out == {
        "a.py": b"one\ntwo\nTHREE\n3.5\nfour\n",
        "tests/test_new.py": b"def test_x():\n    pass\n",
    }
    shifted = {"a.py": b"zero\none\ntwo\nthree\nfour\n"}  # the hunk moved by a line: still exact
    assert apply_patch(shifted, patch)["a.py"] == b"zero\none\ntwo\nTHREE\n3.5\nfour\n"
    with pytest.raises(InvalidRequest, match="does not apply"):
        apply_patch({"a.py": b"other\n"}, patch)
    with pytest.raises(InvalidRequest, match="lacks"):
        apply_patch({}, patch)
    with pytest.raises(InvalidRequest, match="no file diff"):
        apply_patch(files, "just text\n")


def test_pytest_summary_parser_and_commands() -> None:
    out = (
        "..F\nPASSED tests/test_a.py::test_one\nFAILED tests/test_a.py::test_two - assert 1 == 2\n"
        "PASSED tests/test_b.py::test_three\nERROR tests/test_b.py::test_three - teardown\n"
        "SKIPPED [1] tests/test_c.py:3: no\n"
    )
    assert parse_test_results(out) == {
        "tests/test_a.py::test_one": "PASSED",
        "tests/test_a.py::test_two": "FAILED",
        "tests/test_b.py::test_three": "ERROR",
    }
    check = HiddenTests(fail_to_pass=["t.py::a b"], pass_to_pass=["t.py::c"])
    assert command_for_tests(check).endswith("-rfEsp 't.py::a b' t.py::c")
    assert (
        command_for_tests(HiddenTests(fail_to_pass=["x"], pass_to_pass=[], command="run"))
        == "run x"
    )
    commands = write_file_commands({"d/e.txt": b"x" * 100_000, "f": b""})
    assert commands[0].startswith("mkdir -p d && printf %s '") and " > d/e.txt" in commands[0]
    assert all(len(c) < 128 * 1024 for c in commands) and " >> d/e.txt" in commands[2]
    assert commands[-1] == "printf %s '' | base64 -d > f"
