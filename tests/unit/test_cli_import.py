"""`belayer --help` (and every command's parsing) loads no torch: the CLI imports the model
package's config and tokenizer only, and the commands that run a model import it when they
run. Checked in a fresh interpreter, as a user's shell starts it."""

from __future__ import annotations

import subprocess
import sys


def test_the_cli_imports_no_torch() -> None:
    code = "import sys, services.cli.main; print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout
