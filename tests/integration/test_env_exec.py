"""An exec's output on real dockerd, whatever the timing of this side: Docker starts the command
as it answers the request that starts it, so a short command can print and exit before this
side has parsed that answer's headers. http.client parses them through a buffered reader,
which then holds the command's output too; reading only the raw socket under it lost the
output — an observation of nothing, exit code 0 (CI: ``cat`` of a repository's files came back
empty in one of two identical runs, and the two runs trained different batches)."""

from __future__ import annotations

import asyncio
import http.client
import threading
import time
from typing import Any

import pytest

from services.environment.docker_ops import DockerOps
from tests.integration.env_helpers import require_docker

pytestmark = [pytest.mark.docker]


def _parse_answers_late(monkeypatch: pytest.MonkeyPatch, ops: DockerOps) -> None:
    """Make the race certain: the answer to an exec's start is parsed only once Docker says
    the command ended, so its output is in the socket before the headers are read."""
    watcher = require_docker().api
    start, begin = ops.api.exec_start, http.client.HTTPResponse.begin
    pending: dict[int, str] = {}  # thread → the exec it is starting

    def exec_start(exec_id: str, **kw: Any) -> Any:
        pending[threading.get_ident()] = exec_id
        return start(exec_id, **kw)

    def parse_late(response: http.client.HTTPResponse) -> None:
        exec_id = pending.pop(threading.get_ident(), None)
        deadline = time.monotonic() + 30.0
        while exec_id and watcher.exec_inspect(exec_id).get("ExitCode") is None:
            assert time.monotonic() < deadline, f"exec {exec_id[:12]} never ended"
        begin(response)

    monkeypatch.setattr(ops.api, "exec_start", exec_start)
    monkeypatch.setattr(http.client.HTTPResponse, "begin", parse_late)


@pytest.mark.timeout(120)
async def test_a_commands_output_that_beat_the_answers_headers_is_kept(
    env, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = env.client
    sid = (await c.create()).sandbox_id
    (sb,) = [s for s in (await c.list()).sandboxes if s.id == sid]
    assert (await c.exec(sid, "printf 'def f():\\n    return 1\\n' > /root/m.py")).exit_code == 0
    ops = DockerOps(env.config)
    _parse_answers_late(monkeypatch, ops)
    for command, stdout, stderr in [
        ("echo hello", b"hello\n", b""),
        ("cat $(find /root -name '*.py' | sort)", b"def f():\n    return 1\n", b""),
        ("echo out; echo err >&2; exit 3", b"out\n", b"err\n"),
        ("head -c 100000 /dev/zero | tr '\\0' x", b"x" * 100_000, b""),  # more than the buffer
    ]:
        out = await asyncio.to_thread(ops.exec, sb.container_id, command, timeout_s=20, cap=1 << 20)
        assert (out.stdout, out.stderr) == (stdout, stderr), command
        assert out.exit_code == (3 if "exit 3" in command else 0), command
    await c.destroy(sid)
