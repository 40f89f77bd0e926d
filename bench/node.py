"""The ``belayer`` CLI as the benchmarks run it: a child process of this interpreter, so a
benchmark drives a node (``up``, ``down``, ``status``, ``model init``) the way a user does, from
a checkout or an install alike."""

from __future__ import annotations

import subprocess
import sys


def belayer(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``belayer *args`` with this interpreter; its output captured as text, its exit status
    left to the caller (``check=False``)."""
    return subprocess.run(
        [sys.executable, "-m", "services.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
