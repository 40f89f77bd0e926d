"""The environment service's children (``criu_ops.run``) die with it: each starts with
SIGKILL as its parent-death signal, whether ``setpriv`` sets it (the fast spawn) or, where
``setpriv`` is missing, a ``prctl`` between fork and exec."""

from __future__ import annotations

import signal
import sys

import pytest

from common.errors import SandboxError, Timeout
from services.environment import criu_ops as ops

PDEATHSIG = (
    "import ctypes; s = ctypes.c_int(); "
    "assert ctypes.CDLL(None).prctl(2, ctypes.byref(s)) == 0; print(s.value)"  # PR_GET_PDEATHSIG
)


@pytest.mark.parametrize("setpriv", [True, False], ids=["setpriv", "prctl"])
async def test_children_get_sigkill_as_death_signal(
    setpriv: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if setpriv:
        assert ops.SETPRIV, "util-linux setpriv is part of the base system here"
    else:
        monkeypatch.setattr(ops, "SETPRIV", None)
    out = await ops.run([sys.executable, "-c", PDEATHSIG], timeout=30.0, what="probe")
    assert out.strip() == str(int(signal.SIGKILL))


async def test_failures_and_deadlines_are_typed_errors() -> None:
    with pytest.raises(SandboxError, match=r"probe failed \(exit 3\): boom"):
        await ops.run(
            [sys.executable, "-c", "import sys; print('boom', file=sys.stderr); sys.exit(3)"],
            timeout=30.0,
            what="probe",
        )
    with pytest.raises(Timeout, match="probe ran past its deadline"):
        await ops.run(
            [sys.executable, "-c", "import time; time.sleep(30)"], timeout=0.2, what="probe"
        )
