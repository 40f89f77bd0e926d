"""The bus against a real nats-server: streams declared idempotently, typed errors, malformed
messages answered with an error naming the field while the service keeps serving."""

from __future__ import annotations

import asyncio

import msgpack
import pytest

from common import subjects
from common.bus import Server, ensure_jetstream, request
from common.codec import decode, encode
from common.errors import BusUnavailable, InvalidRequest, NotFound
from schemas.base import ErrorReply, Ok
from schemas.serving import CancelRequest


async def test_streams_declared_idempotently(js) -> None:
    await ensure_jetstream(js)  # second time: no error
    names = {s.config.name for s in await js.streams_info()}
    assert {"TOKENS", "REQUESTS", "EVENTS", "TRAJECTORIES"} <= names
    kv = await js.key_value(subjects.BUCKET_ENGINE_EPOCHS)
    rev = await kv.create("e0", b"1")
    assert rev > 0


async def test_malformed_request_gets_error_and_service_keeps_serving(nc) -> None:
    server = Server(nc, service="t")

    async def handler(req: CancelRequest, _msg) -> Ok:
        if req.request_id == "missing":
            raise NotFound("unknown request", request_id=req.request_id)
        return Ok(detail=req.request_id)

    await server.serve("t.cancel", CancelRequest, handler)
    # wrong type for a field → error naming it
    bad = msgpack.packb({"type": "CancelRequest.v1", "request_id": 5})
    resp = await nc.request("t.cancel", bad, timeout=2)
    err = decode(resp.data, ErrorReply)
    assert err.code == "invalid_request" and "request_id" in err.data["field"]
    # garbage bytes → error
    resp = await nc.request("t.cancel", b"\xc1\xff", timeout=2)
    assert decode(resp.data, ErrorReply).code == "invalid_request"
    # typed error travels back as the same class
    with pytest.raises(NotFound):
        await request(nc, "t.cancel", CancelRequest(request_id="missing"), Ok, timeout=2)
    # and a good request still works
    ok = await request(nc, "t.cancel", CancelRequest(request_id="r1"), Ok, timeout=2)
    assert ok.detail == "r1"
    # an independent msgpack reader sees a plain map with the version tag
    raw = msgpack.unpackb(encode(ok))
    assert raw == {"type": "Ok.v1", "detail": "r1"}
    await server.drain()


async def test_no_responder_is_bus_unavailable(nc) -> None:
    with pytest.raises(BusUnavailable):
        await request(nc, "nobody.here", CancelRequest(request_id="x"), Ok, timeout=1)


async def test_a_restarting_service_is_asked_again_until_it_answers(nc) -> None:
    """``responder_wait_s``: no responder is asked again (a service the supervisor is
    restarting), and the reply of the service that came back is the result; with nobody
    for longer than the wait, ``BusUnavailable``."""
    ask = request(
        nc, "later.here", CancelRequest(request_id="r"), Ok, timeout=2, responder_wait_s=30
    )
    task = asyncio.ensure_future(ask)
    done, _ = await asyncio.wait({task}, timeout=0.3)
    assert not done  # nobody answers yet: still asking, not failed
    server = Server(nc, service="t")

    async def handler(req: CancelRequest, _msg) -> Ok:
        return Ok(detail=req.request_id)

    await server.serve("later.here", CancelRequest, handler)
    assert (await asyncio.wait_for(task, 10)).detail == "r"
    await server.drain()
    with pytest.raises(BusUnavailable):
        await request(
            nc, "nobody.here", CancelRequest(request_id="x"), Ok, timeout=1, responder_wait_s=0.2
        )


def test_invalid_request_field_path() -> None:
    with pytest.raises(InvalidRequest) as ei:
        decode(msgpack.packb({"type": "CancelRequest.v1", "request_id": "a b"}), CancelRequest)
    assert ei.value.data["field"] == "$.request_id"
