"""Authentication and least privilege on a real node (`belayer up`): an unauthenticated or
unknown connection is refused; every identity may use only the subjects its role's code uses,
the server refuses the rest (for every control subject) and the client that tried logs one
``bus_permission_denied`` line; a service started with the wrong identity is refused and logs
it; no credential appears in any log, event, status output or error message."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from common import subjects
from common.auth import BusConfig, load_identities, new_seed
from common.bus import connect, request
from common.codec import encode
from common.errors import BelayerError, Unauthorized
from common.events import EventTail
from schemas.events import HandoverComplete, ShadowReady
from schemas.serving import EngineAbort
from schemas.weights import ArenaDesc, KvFlush, KvGet
from services.router.client import generate
from tests.integration.node_helpers import (
    Node,
    cli,
    greedy,
    main_pids,
    router_status,
    supervisor_pids,
    wait_until,
)

pytestmark = pytest.mark.timeout(240)
ROOT = Path(__file__).resolve().parents[2]

P = subjects.PREFIX
REFUSED: list[tuple[str, str]] = [
    # (identity, subject it may not publish to) — every control subject of the issue
    ("client", subjects.kv_flush()),
    ("client", subjects.engine_generate("e0")),
    ("client", subjects.engine_abort("e0")),
    ("client", subjects.engine_state("e0")),
    ("client", subjects.weights_push()),
    ("client", subjects.env("create")),
    ("client", subjects.env("exec")),
    ("client", subjects.env("destroy")),
    ("client", subjects.env("restore")),
    ("client", subjects.supervisor_stop()),
    ("client", subjects.router_register()),
    ("client", subjects.router_engine_failed()),
    ("client", subjects.router_tokens()),
    ("client", subjects.token_log("x")),
    ("client", subjects.request_log("x")),
    ("client", subjects.trajectory("r", "t")),
    ("client", subjects.dead_letter("trajectories")),
    ("client", subjects.event("handover_complete")),
    ("client", "$KV.engine_epochs.e0"),
    ("client", "$JS.API.STREAM.DELETE.TOKENS"),
    ("client", "$JS.API.STREAM.PURGE.EVENTS"),
    ("operator", subjects.kv_flush()),
    ("operator", subjects.weights_push()),
    ("operator", subjects.engine_generate("e0")),
    ("operator", subjects.event("engine_unhealthy")),
    ("engine-e0", subjects.engine_generate("e0")),
    ("engine-e0", subjects.engine_abort("e0")),
    ("engine-e0", subjects.weights_push()),
    ("engine-e0", subjects.env("destroy")),
    ("engine-e0", subjects.supervisor_stop()),
    ("engine-e0", "$KV.engine_epochs.e1"),  # another engine's epoch
    ("engine-e0", "$KV.weight_version.current"),
    ("router", subjects.kv_flush()),
    ("router", subjects.weights_push()),
    ("router", subjects.env("create")),
    ("router", "$KV.engine_epochs.e0"),
    ("controller", subjects.kv_flush()),
    ("controller", subjects.weights_push()),
    ("controller", subjects.engine_abort("e0")),
    ("trainer", subjects.env("create")),
    ("trainer", subjects.kv_flush()),
    ("trainer", subjects.engine_generate("e0")),
    ("environment", subjects.weights_push()),
    ("environment", subjects.kv_flush()),
    ("environment", subjects.router_generate()),
    ("weights", subjects.kv_flush()),
    ("kv", subjects.weights_push()),
    ("supervisor", subjects.kv_flush()),
    ("supervisor", subjects.weights_push()),
]
NO_SUBSCRIBE: list[tuple[str, str]] = [
    ("client", subjects.engine_generate("e0")),  # steal an engine's work
    ("client", subjects.router_generate()),  # read others' prompts
    ("client", "_INBOX.>"),  # read others' replies
    ("client", subjects.env("exec")),
    ("engine-e0", subjects.engine_generate("e1")),
    ("router", subjects.kv_flush()),
]


def denials(logs: Sequence[Mapping[str, Any]], operation: str) -> set[str]:
    """Subjects of the ``bus_permission_denied`` lines (lowercase: nats-py lowercases the
    server's message)."""
    return {
        str(e["subject"]).lower()
        for e in logs
        if e.get("event") == "bus_permission_denied" and e.get("operation") == operation
    }


def test_identities_are_private_files(node: Node) -> None:
    auth = node.run_dir / "auth"
    assert stat.S_IMODE(auth.stat().st_mode) == 0o700
    seeds = sorted(auth.glob("*.nk"))
    names = {p.stem for p in seeds}
    assert names >= {"supervisor", "weights", "kv", "router", "engine-e0", "controller"}
    assert names >= {"client", "operator", "environment", "trainer"}
    for p in seeds:
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
    roles = {i.name: i.role for i in load_identities(auth)}
    assert roles["engine-e0"] == "engine" and roles["client"] == "client"
    conf = node.run_dir / "nats" / "nats-server.conf"
    assert stat.S_IMODE(conf.stat().st_mode) == 0o600
    text = conf.read_text()
    assert "authorization" in text and "max_payload" in text
    for p in seeds:
        assert p.read_text().strip() not in text  # public keys only


async def test_unauthenticated_and_unknown_identities_are_refused(
    node: Node, tmp_path: Path
) -> None:
    with pytest.raises(Unauthorized, match="refused"):
        await connect(node.nats_url, name="anon", timeout=3, reconnect=False)
    stranger = tmp_path / "stranger.nk"
    stranger.write_bytes(new_seed())
    with pytest.raises(Unauthorized, match="refused"):
        await connect(node.nats_url, name="x", bus=BusConfig(creds=str(stranger)), reconnect=False)
    # ... and a raw client that skips authentication altogether
    host, port = node.nats_url.removeprefix("nats://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    await reader.readline()  # INFO
    writer.write(b'CONNECT {"verbose":false}\r\nPUB belayer.kv.flush 0\r\n\r\nPING\r\n')
    await writer.drain()
    reply = await asyncio.wait_for(reader.readline(), 5)
    assert b"Authorization Violation" in reply
    writer.close()


async def test_each_role_may_use_only_its_subjects(node: Node) -> None:
    """Every (identity, control subject) pair of ``REFUSED``: the server refuses the publish
    (nothing reaches a service, no reply), the client logs it; a request to a refused subject
    fails at once with ``Unauthorized`` instead of timing out; refused subscriptions too.
    The node serves as before."""
    by_identity: dict[str, list[str]] = {}
    for ident, subject in REFUSED:
        by_identity.setdefault(ident, []).append(subject)
    for ident, refused in by_identity.items():
        with capture_logs() as logs:
            nc = await node.connect(f"probe-{ident}", ident)
            try:
                inbox = nc.new_inbox()
                replies: list[Any] = []

                async def got(msg: Any, replies: list[Any] = replies) -> None:
                    replies.append(msg)

                await nc.subscribe(inbox, cb=got)
                for subject in refused:
                    await nc.publish(subject, b"\x80", reply=inbox)
                await nc.flush(timeout=5)
                await wait_until(
                    lambda refused=refused, logs=logs: (
                        denials(logs, "publish") >= {r.lower() for r in refused}
                    ),
                    timeout=5,
                    what=f"{ident}: every refused publish is reported",
                )
                assert not replies, (ident, [m.subject for m in replies])
            finally:
                await nc.drain()
    with capture_logs() as logs:
        nc = await node.connect("probe-request", "client")
        try:
            t0 = time.monotonic()
            with pytest.raises(Unauthorized):
                await request(nc, subjects.kv_flush(), KvFlush(engine_id="e0", epoch=1), ArenaDesc)
            assert time.monotonic() - t0 < 2.0  # the server said so: no time-out to wait for
        finally:
            await nc.drain()
    (line,) = [e for e in logs if e.get("event") == "bus_permission_denied"]
    assert (line["connection"], line["subject"]) == ("probe-request", subjects.kv_flush())
    for ident, subject in NO_SUBSCRIBE:
        with capture_logs() as logs:
            nc = await node.connect(f"sub-{ident}", ident)
            try:
                await nc.subscribe(subject)
                await nc.flush(timeout=5)
                await wait_until(
                    lambda logs=logs: denials(logs, "subscription"),
                    timeout=5,
                    what=f"{ident} may not subscribe to {subject}",
                )
            finally:
                await nc.close()
        assert denials(logs, "subscription") == {subject.lower()}
    # What the roles need still works.
    nc = await node.connect("user", "client")
    try:
        res = await generate(nc, greedy("auth-ok", n=6), timeout=60)
        assert len(res.token_ids) == 6
        assert (await router_status(nc)).engines
    finally:
        await nc.drain()
    eng = await node.connect("engine", "engine-e0")
    try:
        arena = await request(eng, subjects.kv_get(), KvGet(engine_id="e0"), ArenaDesc)
        assert arena.engine_id == "e0"
    finally:
        await eng.drain()


def test_a_service_with_the_wrong_identity_is_refused_and_logs_it(node: Node) -> None:
    """A KV arena started with the *client's* identity cannot take over ``kv.get`` /
    ``kv.flush``: the server refuses its subscriptions and the service logs each; the node's
    own arena still answers."""
    log = node.run_dir / "logs" / "rogue-kv.jsonl"
    argv = [
        sys.executable, "-m", "services.kv", f"--nats-url={node.nats_url}",
        f"--bus-creds={node.run_dir / 'auth' / 'client.nk'}", "--run-id=rogue" + node.run_id,
        f"--model-dir={node.run_dir / 'models' / 'tiny'}", "--engine-ids=zz",
        f"--log-file={log}",
    ]  # fmt: skip
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:

        def refused() -> set[str]:
            lines = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
            return denials(lines, "subscription")

        deadline = time.monotonic() + 60
        while refused() != {subjects.kv_get(), subjects.kv_flush()}:  # lowercase already
            assert proc.poll() is None or refused(), "the rogue arena exited without a word"
            assert time.monotonic() < deadline, f"no refusal logged: {refused()}"
            time.sleep(0.1)  # polling the rogue service's log file
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        for p in Path("/dev/shm").glob(f"belayer-rogue{node.run_id}-*"):
            p.unlink()

    async def node_arena() -> str:
        nc = await node.connect("engine", "engine-e0")
        try:
            return str(
                (await request(nc, subjects.kv_get(), KvGet(engine_id="e0"), ArenaDesc)).engine_id
            )
        finally:
            await nc.drain()

    assert asyncio.run(node_arena()) == "e0"


async def router_back(nc: Any, old_pid: int) -> bool:
    try:
        return (await supervisor_pids(nc)).get("router", old_pid) != old_pid and bool(
            (await router_status(nc, timeout=1)).engines
        )
    except BelayerError:
        return False


async def test_no_credential_in_logs_events_status_or_errors(node: Node, tmp_path: Path) -> None:
    """A full run — requests, refused publishes, a worker SIGKILLed and taken over, a router
    restart — then every log file, every event, `belayer status` / `events` output, the node
    file, the processes' command lines and the CLI's error messages are searched for every
    seed of the node: none appears."""
    nc = await node.connect("run", "client")
    log = await EventTail(nc).start()
    try:
        await generate(nc, greedy("secret-run-1", n=8), timeout=60)
        await log.wait_for(ShadowReady, "e0", timeout=90)
        pid = (await main_pids(nc))["e0"]
        os.kill(pid, signal.SIGKILL)
        done = await log.wait_for(HandoverComplete, "e0", old_pid=pid, timeout=30)
        await log.wait_for(ShadowReady, "e0", after=done.ts, timeout=90)
        abort = EngineAbort(engine_id="e0", epoch=1, request_ids=["x"])
        await nc.publish(subjects.engine_abort("e0"), encode(abort))  # refused
        router = (await supervisor_pids(nc))["router"]
        os.kill(router, signal.SIGKILL)  # the supervisor restarts it; it reads its logs back
        await wait_until(
            lambda: router_back(nc, router), timeout=60, what="the restarted router answers"
        )
        await generate(nc, greedy("secret-run-2", n=8), timeout=60)
        events = [json.dumps(str(e)) for e in log.events]
    finally:
        await log.stop()
        await nc.drain()
    outputs = [
        cli("status", "--json", run_dir=node.run_dir).stdout,
        cli("events", "--no-follow", "--json", run_dir=node.run_dir).stdout,
        cli("status", run_dir=node.run_dir).stdout,
    ]
    # Error messages about credentials name the file, never its content.
    other = tmp_path / "other.nk"
    other.write_bytes(new_seed())
    not_a_seed = tmp_path / "garbage.nk"
    not_a_seed.write_text("SUAM" + "X" * 60 + "\n")
    for creds in (other, not_a_seed, tmp_path / "missing.nk", tmp_path):
        r = cli("status", "--creds", str(creds), run_dir=node.run_dir, check=False)
        assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        outputs += [r.stdout, r.stderr]
    seeds = [p.read_text().strip() for p in (node.run_dir / "auth").glob("*.nk")]
    seeds += [other.read_text().strip(), not_a_seed.read_text().strip()]
    haystacks: dict[str, str] = {"events": "\n".join(events), "cli": "\n".join(outputs)}
    for f in (node.run_dir / "logs").iterdir():
        haystacks[f.name] = f.read_text(errors="replace")
    haystacks["node.json"] = (node.run_dir / "node.json").read_text()
    ps = await asyncio.to_thread(
        subprocess.run, ["ps", "-eo", "args"], capture_output=True, text=True
    )
    haystacks["ps"] = ps.stdout
    assert len(haystacks) > 8 and all(haystacks[f] for f in ("router.jsonl", "supervisor.jsonl"))
    for name, text in haystacks.items():
        for seed in seeds:
            assert seed not in text, f"a seed appears in {name}"
            assert seed[4:40] not in text, f"part of a seed appears in {name}"
