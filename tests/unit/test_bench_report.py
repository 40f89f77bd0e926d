"""The benchmarks' shared report: verdicts, targets, the table, the JSON file."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from bench.report import (
    MISS,
    PASS,
    Row,
    cpu_model,
    machine_info,
    percentile,
    print_table,
    progress,
    ratio,
    target_text,
    targets_json,
    verdict,
    verdicts,
    write_json,
)


def test_verdict_compares_either_way_and_misses_an_unmeasured_value() -> None:
    assert verdict(150.0, (">=", 150.0)) == PASS
    assert verdict(149.9, (">=", 150.0)) == MISS
    assert verdict(0.1, ("<=", 0.1)) == PASS
    assert verdict(0.11, ("<=", 0.1)) == MISS
    assert verdict(None, ("<=", 0.1)) == MISS
    with pytest.raises(ValueError, match="comparison"):
        verdict(1.0, ("==", 1.0))


def test_targets_and_verdicts_shape_the_json_entries() -> None:
    targets = {"a_s": ("<=", 0.2), "b_tok_s": (">=", 600.0)}
    assert targets_json(targets) == {
        "a_s": {"op": "<=", "bound": 0.2},
        "b_tok_s": {"op": ">=", "bound": 600.0},
    }
    # A target whose value was not measured at all is left out; a None value is a miss.
    assert verdicts(targets, {"a_s": 0.1}) == {"a_s": PASS}
    assert verdicts(targets, {"a_s": None, "b_tok_s": 700.0}) == {"a_s": MISS, "b_tok_s": PASS}


def test_target_text_shows_units_percent_and_factors() -> None:
    assert target_text((">=", 150.0), "tok/s") == "≥ 150 tok/s"
    assert target_text(("<=", 0.02), "%") == "≤ 2 %"
    assert target_text((">=", 10.0), "x") == "≥ 10x"
    assert target_text(("<=", 0.0)) == "≤ 0"


def test_print_table_writes_every_row_to_the_current_stdout() -> None:
    rows = [
        Row("engine alone, batch 1", "160 tok/s", "≥ 150 tok/s", PASS),
        Row("attach from shm", "0.300 s", "≤ 0.2 s", MISS),
        Row("cold load", "1.200 s"),
    ]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_table("belayer bench test", rows)
    text = out.getvalue()
    assert "belayer bench test" in text
    for row in rows:
        for cell in (row.metric, row.value, row.target, row.verdict):
            assert cell in text
    assert "[" not in text  # rich markup was rendered, not printed


def test_progress_goes_to_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    progress("test", "step one")
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == "[bench test] step one\n"


def test_write_json_creates_parents_and_indents(tmp_path: Path) -> None:
    result = {"bench": "test", "machine": machine_info(), "path": tmp_path, "n": [1, 2]}
    path = write_json(tmp_path / "a" / "b" / "test.json", result)
    assert path == tmp_path / "a" / "b" / "test.json"
    text = path.read_text()
    assert text.endswith("}\n")
    assert '\n  "bench": "test",' in text  # indent 2
    loaded = json.loads(text)
    assert loaded["path"] == str(tmp_path)  # non-JSON values become strings
    assert loaded["n"] == [1, 2]
    assert loaded["machine"]["cpu_count"] >= 1
    assert {"sched_cpus", "loadavg", "torch", "python", "platform"} <= set(loaded["machine"])
    assert {"cpu_model", "cpu_flags"} <= set(loaded["machine"])


def test_cpu_model_reads_the_first_processor_and_the_kernels_flags() -> None:
    info = (
        "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Processor\n"
        "flags\t\t: fpu sse avx2 avx512f avx512bw amx_tile\n\n"
        "processor\t: 1\nmodel name\t: other\nflags\t\t: fpu\n"
    )
    assert cpu_model(info) == ("Intel(R) Xeon(R) Processor", ["avx2", "avx512f", "amx_tile"])
    amd = "model name\t: AMD EPYC 7B13\nflags\t\t: fpu avx avx2 fma\n"
    assert cpu_model(amd) == ("AMD EPYC 7B13", ["avx2"])
    assert cpu_model("") == (None, [])


def test_percentile_is_nearest_rank_and_ratio_guards_missing_values() -> None:
    values = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 99) == 5.0
    assert percentile(values, 0) == 1.0
    assert percentile([], 50) is None
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(None, 2.0) is None
    assert ratio(3.0, None) is None
    assert ratio(3.0, 0.0) is None


def test_every_result_is_stamped_with_its_commit_and_date(tmp_path: Path) -> None:
    import re
    import subprocess
    import time

    from bench.report import git_commit

    result: dict[str, object] = {"bench": "test"}
    loaded = json.loads(write_json(tmp_path / "r.json", result).read_text())
    assert loaded["date"] == time.strftime("%Y-%m-%d") == result["date"]
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:  # a checkout: the commit it measured
        assert loaded["commit"] == head.stdout.strip() == result["commit"]
        assert re.fullmatch("[0-9a-f]{40}", str(loaded["commit"]))
    # Outside a git checkout (an installed package) there is no commit: null, not an error.
    assert git_commit(tmp_path) is None
    # A result that already says which commit it measured keeps it.
    kept = json.loads(write_json(tmp_path / "k.json", {"commit": None}).read_text())
    assert kept["commit"] is None and "date" in kept


def test_publish_prints_the_table_writes_the_json_and_says_where(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from bench.report import machine_after, publish

    result = {"bench": "test", "machine": machine_after({"cpu_count": 2})}
    path = publish("test", "belayer bench test", [Row("a", "1 s")], tmp_path / "r.json", result)
    captured = capsys.readouterr()
    assert "belayer bench test" in captured.out
    assert captured.err == f"[bench test] wrote {path}\n"
    written = json.loads(path.read_text())
    assert list(written)[:2] == ["bench", "machine"]
    assert set(written["machine"]) == {"cpu_count", "loadavg_after"}
    assert {"commit", "date"} <= set(written)


def test_judged_json_is_targets_intervals_and_verdicts_in_that_order() -> None:
    from bench.stats import bootstrap, judged_json

    targets = {"a_s": ("<=", 1.0)}
    interval = bootstrap([0.1, 0.2, 0.15, 0.12], lambda v: sorted(v)[len(v) // 2])
    judged = judged_json(targets, {"a_s": 0.15}, {"a_s": interval})
    assert list(judged) == ["targets", "intervals", "verdicts"]
    assert judged["targets"] == targets_json(targets)
    assert judged["verdicts"] == {"a_s": PASS}
