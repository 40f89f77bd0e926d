"""Sandbox hardening, proven from inside a sandbox on the real environment service and dockerd:
no network but loopback (not the NATS port, not the Docker socket, no route anywhere), the
host's files, the checkpoint store and other sandboxes invisible, no capability to gain, a
fork bomb and a memory hog stopped by their limits without touching another sandbox, and an
exec's time-out killing its whole process tree. (No packet is sent off this machine: an
external address is shown unreachable by the absence of any interface and route but `lo`.)"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from pathlib import Path

import docker
import pytest

from common.errors import Timeout
from schemas.env import SandboxLimits
from tests.integration.node_helpers import wait_until

pytestmark = [pytest.mark.docker, pytest.mark.timeout(240)]


async def sh(env, sandbox_id: str, command: str, timeout: float = 30.0):
    return await env.client.exec(sandbox_id, command, timeout)


async def test_no_network_but_loopback(env, nats_server) -> None:
    sb = (await env.client.create()).sandbox_id
    nics = await sh(env, sb, "ls /sys/class/net")
    assert nics.stdout.split() == ["lo"]
    routes = await sh(
        env, sb, "tail -n +2 /proc/net/route; awk '$10 != \"lo\"' /proc/net/ipv6_route"
    )
    assert routes.exit_code == 0 and routes.stdout.strip() == "", routes.stdout
    probe = (
        'python3 -c "import socket,sys\n'
        "s=socket.socket()\ns.settimeout(3)\n"
        f"try:\n s.connect(('127.0.0.1',{nats_server.port}))\n print('connected')\n"
        'except OSError as e:\n print(type(e).__name__)"'
    )
    nats = await sh(env, sb, probe)
    assert nats.stdout.strip() == "ConnectionRefusedError", nats  # the sandbox's own loopback
    sock = await sh(
        env, sb, "ls -la /var/run/docker.sock /run/docker.sock /run/containerd 2>&1; true"
    )
    assert sock.stdout.count("No such file") == 3, sock.stdout


async def test_host_store_and_other_sandboxes_are_invisible(env, tmp_path: Path) -> None:
    marker = f"host-marker-{secrets.token_hex(6)}"
    (tmp_path / marker).write_text("host secret")
    secret = f"secret-{secrets.token_hex(6)}"
    other = (await env.client.create(files={f"/root/{secret}": b"other sandbox"})).sandbox_id
    sb = (await env.client.create()).sandbox_id
    assert (await sh(env, other, f"cat /root/{secret}")).stdout == "other sandbox"
    # a ready checkpoint exists in the store while we look for it
    await env.client.checkpoint(other, 1)
    store = env.config.checkpoint_root
    assert any(store.rglob("*")), "the checkpoint store holds a checkpoint"
    found = await sh(
        env, sb, f"find / -xdev \\( -name '{marker}' -o -name '{secret}' \\) 2>/dev/null; true", 60
    )
    assert found.stdout.strip() == "", found.stdout
    paths = [tmp_path, store, env.config.run_dir, Path.cwd()]
    for p in paths:
        r = await sh(env, sb, f"test -e '{p}' && echo visible || echo absent")
        assert r.stdout.strip() == "absent", p
    mounts = await sh(env, sb, "cat /proc/self/mountinfo")
    for p in paths:
        assert str(p) not in mounts.stdout
    procs = await sh(env, sb, "cat /proc/[0-9]*/cmdline | tr '\\0' ' '")
    assert "pytest" not in procs.stdout and "nats-server" not in procs.stdout
    mine = await sh(env, sb, "ls -d /proc/[0-9]* | wc -l")
    assert int(mine.stdout) < 10  # its own init and this exec, not the host's processes


async def test_no_capability_can_be_gained(env) -> None:
    sb = (await env.client.create()).sandbox_id
    status = (await sh(env, sb, "cat /proc/self/status")).stdout
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(fields[cap].strip(), 16) == 0, (cap, fields[cap])
    assert fields["NoNewPrivs"].strip() == "1"
    assert fields["Seccomp"].strip() == "2"  # Docker's default seccomp filter
    for attempt in (
        "mount -t tmpfs none /mnt",
        "mknod /tmp/mem c 1 1",
        "chroot / true",
        "chown 1234 /root",
        "echo evil > /etc/hostname",  # the one host file Docker bind-mounts here: read-only
        "chmod 666 /etc/hostname",
        "python3 -c 'import os; os.nice(-5)'",
        "unshare --user --map-root-user true",
        "python3 -c \"import ctypes; ctypes.CDLL(None).sethostname(b'x', 1) == 0 or exit(1)\"",
    ):
        r = await sh(env, sb, attempt)
        assert r.exit_code != 0, (attempt, r.stdout, r.stderr)
    # a setuid-root binary gains nothing either (no-new-privileges, no capabilities)
    r = await sh(
        env, sb, "cp /bin/cat /tmp/suid && chmod u+s /tmp/suid && /tmp/suid /proc/self/status"
    )
    assert "CapEff:\t0000000000000000" in r.stdout


async def test_fork_bomb_and_memory_hog_stop_at_their_limits(env) -> None:
    bomb = (await env.client.create(limits=SandboxLimits(memory_mb=96, pids=32))).sandbox_id
    bystander = (await env.client.create()).sandbox_id
    fork_bomb = (
        'python3 -c "import os,time\n'
        "n=0\n"
        "while True:\n"
        " try:\n  pid=os.fork()\n"
        " except OSError:\n  print('fork refused after', n, flush=True); time.sleep(30)\n"
        " if pid==0:\n  time.sleep(30); os._exit(0)\n"
        ' n+=1"'
    )

    async def bystander_latency() -> float:
        t0 = time.monotonic()
        r = await sh(env, bystander, "echo alive")
        assert r.stdout.strip() == "alive"
        return time.monotonic() - t0

    bombing = asyncio.create_task(sh(env, bomb, fork_bomb, timeout=6))
    listing = {s.id: s for s in (await env.client.list()).sandboxes}
    api = docker.APIClient()

    async def at_its_limit() -> bool:  # the bomb's processes, as the host sees them
        top = await asyncio.to_thread(api.top, listing[bomb].container_id)
        return len(top["Processes"]) >= 24

    await wait_until(at_its_limit, timeout=5, what="the fork bomb reaches its pids limit")
    assert await bystander_latency() < 5.0
    with pytest.raises(Timeout) as stopped:
        await bombing
    tail = str(stopped.value.data["stdout_tail"])
    assert "fork refused after" in tail and int(tail.split()[-1]) < 32
    # the whole bomb went with the time-out: the sandbox works again
    assert (await sh(env, bomb, "echo back")).stdout.strip() == "back"
    hog = await sh(env, bomb, "python3 -c 'b = bytearray(512 << 20); print(len(b))'")
    assert hog.exit_code == 137 and hog.stdout == ""  # OOM-killed inside its own cgroup
    assert await bystander_latency() < 5.0
    assert (await sh(env, bomb, "echo survived")).stdout.strip() == "survived"


async def test_an_exec_time_out_kills_its_whole_process_tree(env) -> None:
    sb = (await env.client.create()).sandbox_id
    tree = (
        "sleep 301 & sleep 302 & (sleep 303 &) ; "
        "sh -c 'sleep 304 & wait' & nohup sleep 305 >/dev/null 2>&1 & "
        "setsid sleep 306 & setsid sh -c 'sleep 307 & wait' & wait"
    )
    keep = await sh(env, sb, "nohup sleep 308 >/dev/null 2>&1 & echo started")
    assert keep.stdout.strip() == "started"  # an earlier action's background process
    t0 = time.monotonic()
    with pytest.raises(Timeout):
        await sh(env, sb, tree, timeout=1.5)
    assert time.monotonic() - t0 < 15
    left = await sh(env, sb, "ps -eo args | grep '^sleep 30' ; true")
    assert left.stdout.split() == ["sleep", "308"], left.stdout  # only the earlier action's
    assert os.environ.get("PYTEST_CURRENT_TEST")  # ran under pytest, against real dockerd
