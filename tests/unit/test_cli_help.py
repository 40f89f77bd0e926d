"""`belayer --help` and every command's help read as prose: a description is wrapped by the
terminal, not where its docstring's source line ended (typer's command lists keep those line
breaks, so a description came out as ragged fragments: "... actions in its" / "sandbox; ...")."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Any

import typer

from services.cli.main import app
from services.cli.shared import reflow, reflow_help


def test_reflow_joins_a_paragraph_s_lines_and_keeps_paragraphs_and_lists() -> None:
    text = """First line
    continues here.

    Second paragraph
    also continues:
    - an item
      that wraps
    - another item
    1. numbered

    \b
    kept
    as is
    \f
    after the cut
    stays"""
    assert reflow(text) == (
        "First line continues here.\n\n"
        "Second paragraph also continues:\n- an item that wraps\n- another item\n1. numbered\n\n"
        "\b\nkept\nas is\n\f\nafter the cut\nstays"
    )
    assert reflow("") == ""


def _commands(command: Any, path: str = "belayer") -> list[tuple[str, Any]]:
    found = [(path, command)]
    for name, sub in getattr(command, "commands", {}).items():
        found += _commands(sub, f"{path} {name}")
    return found


def test_no_command_s_help_breaks_a_sentence_where_its_source_line_ended() -> None:
    root = typer.main.get_command(app)
    reflow_help(root)
    commands = _commands(root)
    assert len(commands) > 30
    for path, command in commands:
        for paragraph in (command.help or "").split("\n\n"):
            if not paragraph.startswith("\b"):
                assert "\n" not in paragraph.rstrip("\n"), (path, paragraph)


def test_belayer_help_lists_each_command_on_whole_lines() -> None:
    env = {**os.environ, "COLUMNS": "100", "TERM": "dumb"}
    out = subprocess.run(
        [sys.executable, "-m", "services.cli.main", "--help"],
        capture_output=True, text=True, timeout=60, check=True, env=env,
    ).stdout  # fmt: skip
    # The rollout description used to break after "in its" and after "together".
    lines = [line.strip("│ ").rstrip() for line in out.splitlines()]
    rollout = next(i for i, line in enumerate(lines) if line.startswith("rollout "))
    assert not lines[rollout].endswith(" in its"), lines[rollout]
    assert lines[rollout + 1] != "in its"
    assert all(line not in ("together", "in its", "samples.jsonl,") for line in lines)


def test_progress_lines_stay_whole_in_a_log_file(monkeypatch: Any, tmp_path: Any) -> None:
    """`belayer run ... 2> run.log`: a progress line longer than 80 columns is one line of the
    log (Rich broke it at 80 columns, mid-phrase, so a grep found half of it)."""
    from services.cli.shared import progress_console

    line = "step 3: " + ", ".join(f"counter {i} {i * 7}" for i in range(20))
    assert len(line) > 200
    with open(tmp_path / "run.log", "w") as log:
        monkeypatch.setattr(sys, "stderr", log)
        progress_console().print(f"[bold]{line}[/]")
    assert (tmp_path / "run.log").read_text() == line + "\n"


def test_every_command_s_help_fits_80_columns_and_names_every_option_whole() -> None:
    """At 80 columns typer's Rich panels cut words longer than their narrow columns:
    `belayer up --help` showed `--creds-dir,--cr…` and `--heartbeat-inte…`; click's layout
    then broke lines after hyphens (`risk-` / `aware`)."""
    from typer.testing import CliRunner

    root = typer.main.get_command(app)
    runner = CliRunner()
    commands = _commands(root)
    for path, command in commands:
        args = [*path.split()[1:], "--help"]
        result = runner.invoke(app, args, terminal_width=80, env={"COLUMNS": "80"})
        assert result.exit_code == 0, (path, result.output)
        lines = result.output.splitlines()
        assert lines and lines[0].startswith(f"Usage: {path}"), (path, lines[:1])
        assert max(len(line) for line in lines) <= 80, path
        # A line never ends inside a hyphenated word (``worker-`` / ``kill@step=1`` could not
        # be copied): textwrap breaks after hyphens unless told not to.
        cut = [line for line in lines if re.search(r"\w-$", line)]
        assert not cut, (path, cut)
        for param in command.params:
            for opt in (*param.opts, *param.secondary_opts):
                if opt.startswith("-"):
                    assert opt in result.output, (path, opt)
        for name in getattr(command, "commands", {}):  # a group lists every command
            assert f"\n  {name} " in result.output, (path, name)
