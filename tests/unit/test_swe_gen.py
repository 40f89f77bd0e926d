"""The generated SWE tasks (``workloads.swe_gen``) without a sandbox: for every family, on
several instances, the unfixed repository fails its fail-to-pass tests and passes its
pass-to-pass ones, and the reference ``sed`` (run for real, here) makes every hidden test pass
— checked with the scoring command and its summary parser in a temporary directory. Ids
round-trip, instances are deterministic, and no held-out instance shares a name or a bug
constant with a training one."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from common.errors import InvalidRequest, NotFound
from workloads import HiddenTests, load_workload
from workloads.scoring import command_for_tests, parse_test_results
from workloads.swe_families import (
    HELD_OUT_FAMILIES,
    HELD_OUT_POOLS,
    MADE_UP_NOUNS,
    MADE_UP_WORDS,
    TRAIN_FAMILIES,
)
from workloads.swe_gen import (
    FAMILIES,
    Instance,
    held_out_ids,
    instance,
    instance_id,
    mean_by_split,
    parse_instance_id,
    pattern_fix,
    sed_fix,
    training_ids,
)

pytestmark = [pytest.mark.timeout(300)]

CASES = [(f, "train", i) for f in TRAIN_FAMILIES for i in (0, 7)]
CASES += [(f, "heldout-instance", 3) for f in TRAIN_FAMILIES]
CASES += [(f, "heldout-family", i) for f in HELD_OUT_FAMILIES for i in (0, 5, 11)]


def _write(root: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)


def _run_tests(root: Path, inst: Instance) -> tuple[dict[str, str], int]:
    """The hidden tests (and the repository's restored test files) run as scoring runs
    them: the results by test id and the exit code."""
    _write(root, {**{p: inst.files[p] for p in inst.files if "test" in p}, **inst.hidden})
    check = HiddenTests(fail_to_pass=inst.fail_to_pass, pass_to_pass=inst.pass_to_pass)
    command = shlex.split(command_for_tests(check))
    command[0] = sys.executable
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    r = subprocess.run(command, cwd=root, capture_output=True, text=True, env=env, timeout=60)
    return parse_test_results(r.stdout), r.returncode


@pytest.mark.parametrize(("family", "split", "index"), CASES)
def test_unfixed_fails_and_the_reference_fix_passes_every_hidden_test(
    family: str, split: str, index: int, tmp_path: Path
) -> None:
    inst = instance(family, split, index)
    _write(tmp_path, inst.files)
    assert not set(inst.hidden) & set(inst.files)  # the agent never sees the hidden file
    before, code = _run_tests(tmp_path, inst)
    assert code != 0
    assert all(before.get(t) == "FAILED" for t in inst.fail_to_pass), (inst.id, before)
    assert all(before.get(t) == "PASSED" for t in inst.pass_to_pass), (inst.id, before)
    # The agent's own test run shows exactly one failure: the visible failing test.
    visible = {t: s for t, s in before.items() if t.split("::")[0] in inst.files}
    assert [t for t, s in visible.items() if s == "FAILED"] == inst.fail_to_pass[:1]

    fix = subprocess.run(["sh", "-c", inst.fix], cwd=tmp_path, capture_output=True, timeout=30)
    assert fix.returncode == 0, fix.stderr
    assert (tmp_path / inst.module).read_bytes() == inst.fixed != inst.files[inst.module]
    after, code = _run_tests(tmp_path, inst)
    assert code == 0 and all(after.get(t) == "PASSED" for t in [*inst.fail_to_pass, *inst.pass_to_pass]), (inst.id, after)  # fmt: skip


def test_instances_are_small_and_their_statement_names_the_module() -> None:
    for family, split, index in CASES:
        inst = instance(family, split, index)
        source = inst.files[inst.module].decode()
        assert 5 <= len(source.splitlines()) <= 30, inst.id
        assert inst.statement.endswith(f"Fix {inst.module}.") and len(inst.statement) < 300
        assert inst.fix.startswith("sed -i '") and inst.fix.endswith(f" {inst.module}")
        assert len(inst.fail_to_pass) >= 1 and len(inst.pass_to_pass) >= 1


def test_ids_round_trip_and_instances_are_deterministic() -> None:
    ids = training_ids(40, seed=0) + training_ids(12, seed=3) + held_out_ids(96)
    assert len(set(ids)) == len(ids)
    for tid in ids:
        found = parse_instance_id(tid)
        assert found is not None and instance_id(*found) == tid
        assert instance(*found) == instance(*found) and instance(*found).id == tid
    swe = load_workload("swe", check_image=False)
    for t in swe.tasks(11) + swe.held_out(6):
        again = swe.task(t.id)
        assert again == t and t.metadata["family"] == parse_instance_id(t.id)[0]  # type: ignore[index]  # None only for foreign ids
    assert swe.tasks(22, seed=1) == swe.tasks(22, seed=1) != swe.tasks(22, seed=2)
    assert swe.task("calc_clamp").metadata["source"] == "bundled"  # bundled ids still load
    for bad in ("gen-wrong_init-t-0", "gen-off_by_one-f-0", "gen-nope-t-0", "gen-off_by_one-t-01"):
        assert parse_instance_id(bad) is None
        with pytest.raises(NotFound, match="unknown task id"):
            swe.task(bad)
    with pytest.raises(InvalidRequest):
        instance("off_by_one", "heldout-family", 0)


def test_the_workload_splits_training_held_out_instances_and_held_out_families() -> None:
    swe = load_workload("swe", check_image=False)
    train = swe.tasks(11)
    assert sorted(t.metadata["family"] for t in train) == sorted(TRAIN_FAMILIES)
    assert all(t.metadata["split"] == "train" and t.metadata["held_out"] == "false" for t in train)
    held = swe.held_out(12)
    splits = [t.metadata["split"] for t in held]
    assert splits.count("heldout-instance") == 8 and splits.count("heldout-family") == 4
    assert {t.metadata["family"] for t in held if t.metadata["split"] == "heldout-family"} == set(
        HELD_OUT_FAMILIES
    )
    assert all(t.metadata["held_out"] == "true" for t in held)
    assert swe.held_out(5) == held[:5]  # a fixed list
    rewards = {t.id: float(k % 2) for k, t in enumerate(held)} | {"calc_clamp": 1.0}
    assert mean_by_split(rewards) == {"heldout-family": 0.5, "heldout-instance": 0.5}
    bundled = load_workload("swe-bundled", check_image=False)
    assert len(bundled.tasks(4)) == 4 and "kv_daemon" in {t.id for t in bundled.tasks(4)}
    with pytest.raises(InvalidRequest, match="unknown workload option"):
        load_workload("swe-bundled", check_image=False, generated=True)


def test_no_held_out_name_or_constant_appears_in_training() -> None:
    train = [instance(*parse_instance_id(t)) for t in training_ids(330) + training_ids(44, 1000)]  # type: ignore[misc]  # ids it made: never None
    held = [instance(*parse_instance_id(t)) for t in held_out_ids(96)]  # type: ignore[misc]  # ids it made: never None
    assert not {i.family for i in train} & set(HELD_OUT_FAMILIES)
    names = {n for i in train for n in i.names}
    values = {v for i in train for v in i.values}
    for inst in held:
        assert not set(inst.names) & names, inst.id
        assert not set(inst.values) & values, inst.id
        assert not any(n in t.statement for t in train[:50] for n in inst.names if "_" in n)
    assert len(FAMILIES) == len(TRAIN_FAMILIES) + len(HELD_OUT_FAMILIES) >= 13
    layouts = {(("/" in i.module), any(p.startswith("tests/") for p in i.files)) for i in train}
    assert layouts == {(False, False), (False, True), (True, False), (True, True)}
    # So many training names that a model cannot learn them by heart: 330 instances name
    # their modules in well over 250 ways, and training names share no word with held-out ones.
    assert len({i.module.rsplit("/", 1)[-1] for i in train[:330]}) > 250
    assert not (set(MADE_UP_NOUNS) | set(MADE_UP_WORDS)) & set(
        HELD_OUT_POOLS.nouns + HELD_OUT_POOLS.words
    )


def test_sed_fix_escapes_the_fragments(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text("x = a[1] * b / c & d\n")
    cmd = sed_fix("a[1] * b / c & d", "a[0] & b/c", "m.py")
    subprocess.run(["sh", "-c", cmd], cwd=tmp_path, check=True, timeout=30)
    assert (tmp_path / "m.py").read_text() == "x = a[0] & b/c\n"
    with pytest.raises(InvalidRequest):
        sed_fix("it's", "x", "m.py")


PATTERN_CASES = [(f, "train", i) for f in TRAIN_FAMILIES for i in range(12)]
PATTERN_CASES += [(f, "heldout-instance", i) for f in TRAIN_FAMILIES for i in range(12)]
PATTERN_CASES += [(f, "heldout-family", i) for f in HELD_OUT_FAMILIES for i in range(12)]


def test_the_name_free_fix_makes_exactly_the_reference_fix(tmp_path: Path) -> None:
    """The family's ``sed -E`` script, run by the real GNU sed on the whole repository, turns
    the buggy module into the fixed one and leaves every other file alone — on training and
    held-out instances alike (it names nothing of any of them)."""
    scripts: dict[str, set[str]] = {}
    for k, (family, split, index) in enumerate(PATTERN_CASES):
        inst = instance(family, split, index)
        root = tmp_path / str(k)
        _write(root, inst.files)
        r = subprocess.run(
            ["sh", "-c", inst.pattern_fix], cwd=root, capture_output=True, timeout=30
        )
        assert r.returncode == 0 and not r.stderr, (inst.id, r.stderr)
        for rel, data in inst.files.items():
            want = inst.fixed if rel == inst.module else data
            assert (root / rel).read_bytes() == want, (inst.id, rel)
        words = set(re.findall(r"[A-Za-z_]+", inst.pattern_fix))
        assert not words & {*inst.names, *(n.upper() for n in inst.names)}, inst.id
        scripts.setdefault(family, set()).add(inst.pattern_fix)
    # One script per family, but for what the statement says (the operator, the constant).
    assert {f for f, s in scripts.items() if len(s) > 1} == {
        "wrong_operator",
        "wrong_constant",
        "wrong_default",
    }
    with pytest.raises(InvalidRequest):
        pattern_fix("s/it's/x/")
