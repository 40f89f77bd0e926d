"""``belayer up --creds-dir DIR`` and ``--creds FILE`` name the same identities: a host's
directory, or one file of it (the issue's ``up --role env-host --join URL --creds FILE``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.cli.node import identity_dir


def test_a_directory_is_taken_as_is_and_a_file_names_its_directory(tmp_path: Path) -> None:
    host = tmp_path / "auth" / "ha"
    host.mkdir(parents=True)
    seed = host / "host.nk"
    seed.write_text("SU...")
    assert identity_dir(host) == str(host.resolve())
    assert identity_dir(seed) == str(host.resolve())
    assert identity_dir(None) == ""


def test_a_relative_path_is_made_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "ha").mkdir()
    monkeypatch.chdir(tmp_path)
    assert identity_dir(Path("ha")) == str((tmp_path / "ha").resolve())
