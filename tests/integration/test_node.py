"""A whole node on real parts (nats-server, services as processes, a torch model):
up → generate → status → kill things → down, through the bus and the CLI."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import msgpack
import pytest
import structlog
from msgspec.structs import replace

from common import subjects
from common.bus import connect, request
from common.codec import decode
from common.errors import BusUnavailable, Conflict, NotFound, ResourceLimit, Timeout
from schemas.base import ErrorReply, Ok
from schemas.events import WorkerWeightsSwapped
from schemas.serving import (
    EngineFailed,
    GenerateRequest,
    RegisterReply,
    RegisterWorker,
    RouterStatus,
    SamplingParams,
    StatusRequest,
    TokenDelta,
    TokenLogChunk,
)
from services.router import client as router_client
from services.router.client import generate, router_status
from tests.integration.node_helpers import Node, cli, greedy

pytestmark = pytest.mark.timeout(300)
NODE_ARGS = ("--engines", "2")
"""The module's node (``tests/node_fixtures.py``)."""


async def test_generate_streams_logs_and_replays(node: Node) -> None:
    nc = await connect(node.nats_url, name="t", bus=node.bus("operator"))  # reads TOKENS too
    try:
        deltas: list[TokenDelta] = []
        res = await generate(nc, greedy("g1", n=40), on_delta=deltas.append)
        assert len(res.token_ids) == 40 and res.finish_reason == "length"
        assert res.weight_version == 1 and res.token_weight_versions == [1] * 40
        assert [t for d in deltas for t in d.token_ids] == res.token_ids  # each token exactly once
        assert len(res.logprobs) == 40 and all(lp <= 0 for lp in res.logprobs)
        # the token log holds the tokens durably under a deterministic message id
        js = nc.jetstream()
        msg = await js.get_last_msg(subjects.STREAM_TOKENS, subjects.token_log("g1"))
        assert msg.data is not None
        chunk = decode(msg.data, TokenLogChunk)
        assert chunk.final and chunk.token_ids == res.token_ids
        # resubmitting the id replays the result; nothing is generated twice
        st0: RouterStatus = await request(
            nc, subjects.router_status(), StatusRequest(), RouterStatus
        )
        again = await generate(nc, greedy("g1", n=40))
        st1: RouterStatus = await request(
            nc, subjects.router_status(), StatusRequest(), RouterStatus
        )
        assert again.token_ids == res.token_ids and st1.finished == st0.finished
        assert st1.metrics["tokens"] >= 40 and st1.metrics["requests"] >= 1
        assert st1.metrics["requests"] == st0.metrics["requests"]  # the replay is not a request
    finally:
        await nc.drain()


async def test_a_long_quiet_request_is_not_taken_for_a_dead_router(node: Node) -> None:
    """A non-streamed request sends nothing until its result. Silence alone must not make the
    client re-submit: it asks the router about the request id, and waits while the router
    holds it as active (here: silence every 0.2 s over a request of several seconds)."""
    nc = await node.connect("t-quiet")
    try:
        req = replace(greedy("quiet-long", n=400), stream=False)
        with structlog.testing.capture_logs() as logs:
            res = await generate(nc, req, silence_s=0.2)
        assert len(res.token_ids) == 400 and res.router_restarts == 0
        reattached = [e for e in logs if e.get("event") == "router_reattach"]
        assert reattached == [], reattached
        done = await router_status(nc, request_id="quiet-long")
        assert done.request == "finished" and done.router_id
        assert (await router_status(nc, request_id="never-sent")).request == "unknown"
        assert (await router_status(nc)).request == ""
        # The control: without the probe the same silence re-submits (and re-attaches).
        with structlog.testing.capture_logs() as logs:
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(router_client, "_still_working", _never_working)
                again = await generate(nc, replace(req, request_id="quiet-2"), silence_s=0.2)
        assert again.token_ids == res.token_ids  # re-attaching loses and repeats nothing
        assert [e for e in logs if e.get("event") == "router_reattach"]
    finally:
        await nc.drain()


async def _never_working(*_: object) -> bool:
    return False


async def test_concurrent_requests_match_solo_runs(node: Node) -> None:
    nc = await connect(node.nats_url, name="t", bus=node.bus())
    try:
        solo_a = await generate(nc, greedy("solo-a", "alpha beta"))
        solo_b = await generate(nc, greedy("solo-b", "one two three four"))
        a, b = await asyncio.gather(
            generate(nc, greedy("both-a", "alpha beta", engine_id="e0")),
            generate(nc, greedy("both-b", "one two three four", engine_id="e0")),
        )
        assert a.token_ids == solo_a.token_ids and b.token_ids == solo_b.token_ids
        # seeded sampling is reproducible too
        s1, s2 = await asyncio.gather(*[
            generate(nc, GenerateRequest(request_id=f"seed-{i}", prompt="hi", sampling=SamplingParams(seed=7, max_tokens=16, ignore_eos=True)))
            for i in range(2)
        ])  # fmt: skip
        assert s1.token_ids == s2.token_ids
    finally:
        await nc.drain()


async def test_bad_input_gets_typed_errors_and_others_continue(node: Node) -> None:
    nc = await connect(node.nats_url, name="t", bus=node.bus())
    # Registrations and failure reports may come only from engines: a stale one forges them.
    peer = await connect(node.nats_url, name="peer", bus=node.bus("engine-e0"))
    try:
        other = asyncio.create_task(generate(nc, greedy("bystander", n=64)))
        bad = msgpack.packb(
            {
                "type": "GenerateRequest.v1",
                "request_id": "x",
                "prompt": "hi",
                "sampling": {"max_tokens": "many"},
            }
        )
        err = decode(
            (await nc.request(subjects.router_generate(), bad, timeout=5)).data, ErrorReply
        )
        assert err.code == "invalid_request" and err.data["field"] == "$.sampling.max_tokens"
        with pytest.raises(ResourceLimit):
            await generate(nc, greedy("huge", prompt="word " * 5000))
        with pytest.raises(NotFound):
            await generate(nc, greedy("pinned", engine_id="e9"))
        # a worker that did not win the epoch compare-and-set cannot register
        with pytest.raises(Conflict):
            await request(
                peer,
                subjects.router_register(),
                RegisterWorker(engine_id="e0", epoch=99, pid=1),
                RegisterReply,
            )
        # a failure report for an unknown engine, or for an epoch never seen, is refused
        with pytest.raises(NotFound):
            await request(
                peer, subjects.router_engine_failed(), EngineFailed(engine_id="e9", epoch=1), Ok
            )
        with pytest.raises(Conflict):
            await request(
                peer, subjects.router_engine_failed(), EngineFailed(engine_id="e0", epoch=99), Ok
            )
        assert len((await other).token_ids) == 64
        st = node.status()
        assert all(e["healthy"] for e in st["engines"])
    finally:
        await peer.drain()
        await nc.drain()


async def test_killed_services_are_restarted_and_requests_resume(node: Node) -> None:
    nc = await connect(node.nats_url, name="t", bus=node.bus())
    try:
        reference = await generate(nc, greedy("ref", "resume me", n=300, engine_id="e1"))
        pid = {e["id"]: e["worker_pid"] for e in node.status()["engines"]}["e1"]
        first = asyncio.Event()
        task = asyncio.create_task(
            generate(
                nc,
                greedy("victim", "resume me", n=300, engine_id="e1"),
                on_delta=lambda d: first.set(),
            )
        )
        await asyncio.wait_for(first.wait(), 30)
        os.kill(pid, signal.SIGKILL)
        res = await asyncio.wait_for(task, 120)
        assert res.token_ids == reference.token_ids  # no token lost, duplicated or changed
        assert res.resumes >= 1
        # the router too: the supervisor restarts it and it finds the live workers again
        os.kill(node.pids()["router"], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while True:
            try:
                st: RouterStatus = await request(
                    nc, subjects.router_status(), StatusRequest(), RouterStatus, timeout=1
                )
                if len(st.engines) == 2:
                    break
            except (BusUnavailable, Timeout):
                pass  # restarting
            assert time.monotonic() < deadline, "router was not restarted"
            await asyncio.sleep(0.1)  # polling a restarting process
        again = await generate(nc, greedy("after-router-restart", n=8))
        assert len(again.token_ids) == 8
    finally:
        await nc.drain()


def test_cli_json_contracts(node: Node) -> None:
    out = json.loads(
        cli(
            "generate",
            "--prompt",
            "hello",
            "--max-tokens",
            "5",
            "--temperature",
            "0",
            "--json",
            run_dir=node.run_dir,
        ).stdout
    )
    for key in ("request_id", "token_ids", "text", "logprobs", "weight_version", "finish_reason"):
        assert key in out
    st = node.status()
    assert st["nats_url"] == node.nats_url
    for e in st["engines"]:
        assert {"id", "epoch", "worker_pid", "healthy"} <= e.keys()
    bad = cli("generate", "--prompt", "x", "--engine", "nope", run_dir=node.run_dir, check=False)
    assert bad.returncode != 0 and "unknown engine" in bad.stderr


def test_cli_without_node_fails_clearly(tmp_path: Path) -> None:
    r = cli("status", run_dir=tmp_path, check=False)
    assert r.returncode != 0 and "belayer up" in r.stderr
    r = cli(
        "generate",
        "--prompt",
        "x",
        "--nats-url",
        "nats://127.0.0.1:1",
        run_dir=tmp_path,
        check=False,
    )
    assert r.returncode != 0 and "cannot reach NATS" in r.stderr


async def test_pushed_weights_reach_every_worker(node: Node) -> None:
    """The trainer's path: push a new version to the weight store; every worker and shadow
    switches to it between steps, and new tokens carry the new version."""
    import torch

    from services.weights.client import fetch_manifest, map_weights, push_weights

    nc = await connect(node.nats_url, name="t", bus=node.bus())
    trainer = await connect(node.nats_url, name="t-trainer", bus=node.bus("trainer"))
    try:
        before = await generate(nc, greedy("w-before", "weights change this", n=16, engine_id="e0"))
        swapped: list[WorkerWeightsSwapped] = []
        all_swapped = asyncio.Event()

        async def on_swap(msg) -> None:
            swapped.append(decode(msg.data, WorkerWeightsSwapped))
            if len(swapped) >= 4:  # two engines: main + shadow each
                all_swapped.set()

        await nc.subscribe(subjects.event(WorkerWeightsSwapped.kind), cb=on_swap)
        current = await fetch_manifest(trainer)
        gen = torch.Generator().manual_seed(0)
        new = {
            k: v + 0.05 * torch.randn(v.shape, generator=gen)
            for k, v in map_weights(current).items()
        }
        pushed = await push_weights(trainer, new, base_version=current.version, run_id=node.run_id)
        assert pushed.version == current.version + 1
        await asyncio.wait_for(all_swapped.wait(), 60)
        assert {(e.engine_id, e.role) for e in swapped} == {
            ("e0", "main"),
            ("e0", "shadow"),
            ("e1", "main"),
            ("e1", "shadow"),
        }
        assert all(e.version == pushed.version for e in swapped)
        after = await generate(nc, greedy("w-after", "weights change this", n=16, engine_id="e0"))
        assert after.weight_version == pushed.version
        assert set(after.token_weight_versions) == {pushed.version}
        assert after.token_ids != before.token_ids
    finally:
        await trainer.drain()
        await nc.drain()
