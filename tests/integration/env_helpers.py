"""Fixtures and helpers for the environment-service tests (real dockerd, real CRIU).

If dockerd is not reachable the tests FAIL with a clear message (setup installs Docker + CRIU;
a silent skip would hide a broken setup)."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator
from pathlib import Path

import docker
import pytest
import pytest_asyncio

from schemas.env import CheckpointInfo
from services.environment.client import EnvClient
from services.environment.config import EnvConfig
from services.environment.docker_ops import LABEL_NODE
from services.environment.service import run

# A process with in-memory state and an open file: each SIGUSR1 bumps n and appends it. It
# creates /root/counter.ready once its handler is installed (a signal before that would kill it).
COUNTER = b"""
import signal
n = 0
f = open("/root/count.log", "a", buffering=1)
def bump(*_):
    global n
    n += 1
    f.write(f"{n}\\n")
signal.signal(signal.SIGUSR1, bump)
open("/root/counter.ready", "w").close()
while True:
    signal.pause()
"""


def sh_wait(condition: str, what: str, seconds: float = 10.0) -> str:
    """Shell (a ``{ ...; }`` group): poll ``condition`` every 50 ms inside the sandbox until it
    holds; after ``seconds`` print what was awaited to stderr and exit 1."""
    tries = int(seconds / 0.05)
    return (
        f"{{ i=0; until {condition}; do if [ $i -ge {tries} ]; then "
        f"echo 'timed out waiting for {what}' >&2; exit 1; fi; i=$((i+1)); sleep 0.05; done; }}"
    )


# A process holding 384 MB of touched memory, started in the background (a dump that takes a
# while, a death that takes some ms); the shell waits 2.5 s for the pages to be touched.
BIG_PROCESS = (
    'nohup python3 -c "import signal\n'
    "b=bytearray(384<<20)\nfor i in range(0,len(b),4096): b[i]=1\n"
    'signal.pause()" >/dev/null 2>&1 & sleep 2.5'
)
# Start the counter in the background and return once its SIGUSR1 handler is installed.
START_COUNTER = (
    "{ rm -f /root/counter.ready; nohup python3 /root/counter.py >/dev/null 2>&1 & } && "
    + sh_wait("[ -e /root/counter.ready ]", "the counter signal handler")
)
# Signal the counter and print the line it appended (waiting until the line is there).
BUMP = (
    "{ n=$(wc -l < /root/count.log) && pkill -USR1 -f '^python3 /root/counter.py' && "
    + sh_wait('[ "$(wc -l < /root/count.log)" -gt "$n" ]', "the next counter line")
    + " && tail -n1 /root/count.log; }"
)
# Hash of the sandbox's file tree outside the kernel file systems (paths, modes, contents).
TREE_HASH = (
    'python3 -c "import hashlib,os,stat\n'
    "h=hashlib.sha256()\n"
    "for top in ('/root','/etc','/tmp','/opt','/var/tmp','/home'):\n"
    "  for d,ds,fs in sorted(os.walk(top)):\n"
    "    ds.sort()\n"
    "    for n in sorted(fs):\n"
    "      p=os.path.join(d,n); st=os.lstat(p); h.update(p.encode()+str(stat.S_IMODE(st.st_mode)).encode())\n"
    "      if stat.S_ISREG(st.st_mode): h.update(open(p,'rb').read())\n"
    'print(h.hexdigest())"'
)


def require_docker() -> docker.DockerClient:
    try:
        client = docker.DockerClient(version="auto", timeout=10)
        client.ping()
    except Exception as exc:
        pytest.fail(
            f"dockerd is not reachable ({exc!r}): run deploy/setup.sh (installs Docker, CRIU and "
            "starts dockerd --experimental)"
        )
    return client


def leftover_containers(client: docker.DockerClient, node: str) -> list[str]:
    """Containers labelled ``belayer.node=<node>`` (one list call: no per-container lookup
    that a concurrent removal could fail)."""
    return [
        c["Id"] for c in client.api.containers(all=True, filters={"label": f"{LABEL_NODE}={node}"})
    ]


class EnvHarness:
    """An in-process environment service with its own node label and run dir."""

    def __init__(self, config: EnvConfig, client: EnvClient) -> None:
        self.config = config
        self.client = client
        self.stop = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        ready = asyncio.Event()
        self.stop = asyncio.Event()
        self.task = asyncio.create_task(run(self.config, stop=self.stop, ready=ready))
        done, _ = await asyncio.wait(
            {self.task, asyncio.create_task(ready.wait())},
            timeout=30,
            return_when=asyncio.FIRST_COMPLETED,
        )
        if self.task in done:
            self.task.result()
        assert ready.is_set(), "environment service did not become ready"

    async def shutdown(self) -> None:
        if self.task is not None:
            self.stop.set()
            await asyncio.wait_for(self.task, 60)
            self.task = None


async def versioned_checkpoints(c: EnvClient, sandbox_id: str, n: int) -> list[CheckpointInfo]:
    """For k = 1..n: write ``v<k>`` to /root/v, then checkpoint at prefix k."""
    out = []
    for k in range(1, n + 1):
        await c.exec(sandbox_id, f"echo v{k} > /root/v")
        out.append(await c.checkpoint(sandbox_id, k))
    return out


def make_config(tmp_path: Path, **kw: object) -> EnvConfig:
    """A test service's config. These tests exercise CRIU's checkpoints (tampered images,
    kills mid-dump), so a quiescent sandbox is dumped with CRIU too unless a test asks for
    the product default, ``layer_only_when_quiescent=True`` (``test_env_layer``)."""
    kw.setdefault("layer_only_when_quiescent", False)
    node = "test-" + secrets.token_hex(4)
    return EnvConfig(run_dir=tmp_path / "run", node=node, lock_wait_s=20.0, **kw)  # type: ignore[arg-type]  # kw: fields by name


@contextlib.asynccontextmanager
async def running_env(
    nc, nats_url: str, tmp_path: Path, **config: object
) -> AsyncIterator[EnvHarness]:
    """A running environment service (``make_config`` with ``config``); on exit every sandbox
    is destroyed and no container and no checkpoint directory may be left behind."""
    docker_client = require_docker()
    cfg = make_config(tmp_path, nats_url=nats_url, **config)
    harness = EnvHarness(cfg, EnvClient(nc, timeout=60))
    await harness.start()
    try:
        yield harness
    finally:
        with contextlib.suppress(Exception):
            for sb in (await harness.client.list()).sandboxes:
                with contextlib.suppress(Exception):
                    await harness.client.destroy(sb.id)
        await harness.shutdown()
        left = leftover_containers(docker_client, cfg.node)
        for cid in left:
            docker_client.api.remove_container(cid, force=True)
        leftover_dirs = [p for p in cfg.checkpoint_root.glob("*/*")]
        assert not left, f"containers left behind: {left}"
        assert not leftover_dirs, f"checkpoint dirs left behind: {leftover_dirs}"


@pytest_asyncio.fixture
async def env(nc, js, nats_server, tmp_path: Path) -> AsyncIterator[EnvHarness]:
    """A running environment service; teardown destroys every sandbox and checks that no
    container and no checkpoint directory is left behind."""
    async with running_env(nc, nats_server.url, tmp_path) as harness:
        yield harness


async def env_kill(env, sandbox_id: str) -> None:
    """SIGKILL the container of ``sandbox_id`` behind the environment service's back."""
    import docker

    listing = {s.id: s for s in (await env.client.list()).sandboxes}
    client = docker.DockerClient(version="auto")
    client.api.kill(listing[sandbox_id].container_id)
