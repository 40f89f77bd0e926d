"""A bad path on the command line is one `error:` line with a non-zero exit, never an
"internal error" naming a Python exception: a benchmark's --model that is not a checkpoint
(checked before anything starts, as `belayer run --model` is), and an auth directory that
cannot be written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from common.config import unmakeable_dir


def belayer(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli.main", *args],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "internal error" not in lines[0] and "Error:" not in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize(
    "command",
    [["engine"], ["engine", "--vs-hf"], ["handover"], ["policy"], ["train"], ["transparency"]],
)
def test_a_benchmark_s_model_that_is_not_a_checkpoint(tmp_path: Path, command: list[str]) -> None:
    out = tmp_path / "bench.json"
    missing = belayer("bench", *command, "--model", str(tmp_path / "none"), "--out", str(out))
    assert missing.returncode == 2
    assert one_error_line(missing).endswith("is not a Qwen3 or Llama checkpoint: no such directory")
    no_config = belayer("bench", *command, "--model", str(tmp_path), "--out", str(out))
    assert no_config.returncode == 2
    assert one_error_line(no_config).endswith("no config.json")
    assert missing.stdout == no_config.stdout == "" and not out.exists()  # nothing ran


def test_auth_init_into_a_directory_that_cannot_be_made(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    proc = belayer("auth", "init", str(blocker / "auth"))
    assert proc.returncode == 1
    assert one_error_line(proc).startswith(f"error: cannot write {blocker / 'auth'}: ")


def test_unmakeable_dir_says_why_and_leaves_nothing_behind(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert unmakeable_dir(blocker / "a" / "b") == f"{blocker} is not a directory"
    assert unmakeable_dir(blocker) == f"{blocker} is not a directory"
    assert unmakeable_dir(Path("/proc/belayer-none/run")) is not None  # proc makes no dirs
    assert unmakeable_dir(tmp_path / "new" / "deeper") is None
    assert unmakeable_dir(tmp_path) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # the probe removed its dirs


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["run", "math", "--steps", "1", "--out"], "--out {}: cannot write a run there ("),
        (["model", "init", "--tiny"], "cannot write {} ("),
        (["model", "init", "--tiny", "--warm-start", "math"], "cannot write {} ("),
    ],
)
def test_an_output_directory_that_cannot_be_made(
    tmp_path: Path, args: list[str], words: str
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    target = blocker / "out"
    proc = belayer(
        *args, str(target), *(["--run-dir", str(tmp_path / "node")] if args[0] == "run" else [])
    )
    assert proc.returncode == 2
    assert one_error_line(proc).startswith("error: " + words.format(target)), proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # nothing started


def test_up_with_a_model_that_is_not_a_checkpoint_starts_nothing(tmp_path: Path) -> None:
    node = tmp_path / "node"
    proc = belayer("up", "--model", str(tmp_path / "none"), "--run-dir", str(node), "--detach")
    assert proc.returncode == 2
    assert one_error_line(proc).endswith("is not a Qwen3 or Llama checkpoint: no such directory")
    assert not node.exists()  # no NATS, no router: the router used to fail reading it
