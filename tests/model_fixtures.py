"""``warm_model(kind)``: a warm-started tiny model directory (``math`` or ``swe``), made once
per test session by the real CLI (``belayer model init --tiny --warm-start KIND DIR``).

The CLI caches the trained directory under ``$BELAYER_CACHE_DIR`` (default
``~/.cache/belayer``), keyed by the demonstrations and the training settings, so only the
first session on a machine trains (a few minutes on 2 CPU cores; SWE demonstrations are
recorded in real sandboxes then); every later one copies the cached directory."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

WARM_START_TIMEOUT_S = 2400.0
"""Bound on one warm start (a cold cache on a busy 2-core machine: math trains ~13 minutes
alone on one thread)."""


def warm_start_cli(kind: str, out_dir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """Run ``belayer model init --tiny --warm-start KIND OUT_DIR`` and return the result."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli.main",
            "model",
            "init",
            "--tiny",
            "--warm-start",
            kind,
            str(out_dir),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=WARM_START_TIMEOUT_S,
        check=False,
    )


@pytest.fixture(scope="session")
def warm_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``warm_model("math" | "swe")`` → a model directory that acts (config.json,
    model.safetensors, tokenizer; loadable by ``model.loader`` and the weight store)."""
    made: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in made:
            out = tmp_path_factory.mktemp(f"warm-{kind}")
            result = warm_start_cli(kind, out)
            if result.returncode != 0:
                pytest.fail(
                    f"belayer model init --tiny --warm-start {kind} failed "
                    f"(exit {result.returncode}): {result.stderr[-2000:]}"
                )
            made[kind] = out
        return made[kind]

    return get
