"""Wire compatibility: golden MessagePack bytes of v1 messages keep decoding to the same values,
today's encoder still produces them, and an independent reader (``msgpack``) sees plain maps.

The fixture is frozen: it stands for payloads written by earlier releases. Regenerate it only
for a deliberate, versioned (``.v2``) change:
    .venv/bin/python tests/unit/test_schemas_golden.py --regen
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgpack
import msgspec
import pytest

from common.codec import decode, encode
from schemas.base import ErrorReply, Ok
from schemas.env import CheckpointInfo
from schemas.events import (
    AnyEvent,
    CheckpointReady,
    EngineUnhealthy,
    HandoverComplete,
    RequestsResumed,
    WeightsUpdated,
)
from schemas.reward import ChatTurn, RewardRequest
from schemas.serving import (
    EngineFailed,
    EngineRequest,
    EngineSubmit,
    GenerateReply,
    GenerateRequest,
    GenerateResult,
    RegisterWorker,
    SamplingParams,
    SeqDelta,
    StepBatch,
    TokenDelta,
    TokenLogChunk,
)
from schemas.weights import ArenaDesc, MemoryHandle, TensorDesc, WeightManifest

FIXTURE = Path(__file__).parent / "golden" / "messages_v1.json"

EXAMPLES: dict[str, msgspec.Struct] = {
    "generate_request": GenerateRequest(
        request_id="req-1",
        prompt="Hello",
        sampling=SamplingParams(temperature=0.0, seed=7, max_tokens=16),
    ),
    "token_delta": TokenDelta(
        request_id="req-1", start=3, token_ids=[5, 6], logprobs=[-0.5, -1.25], weight_version=2
    ),
    "generate_result": GenerateResult(
        request_id="req-1",
        token_ids=[5, 6],
        text="ab",
        logprobs=[-0.5, -1.25],
        weight_version=2,
        finish_reason="length",
        prompt_token_ids=[1, 2],
        token_weight_versions=[2, 2],
        engine_ids=["e0", "e1"],
        resumes=1,
    ),
    "error_reply": ErrorReply(code="invalid_request", message="bad", data={"field": "$.prompt"}),
    "ok": Ok(detail="queued 1"),
    "engine_submit": EngineSubmit(
        engine_id="e0",
        epoch=3,
        requests=[
            EngineRequest(
                request_id="req-1",
                token_ids=[1, 2, 5],
                generated_offset=1,
                sampling=SamplingParams(max_tokens=15),
            )
        ],
    ),
    "step_batch": StepBatch(
        engine_id="e0",
        epoch=3,
        worker_pid=42,
        step=9,
        weight_version=2,
        deltas=[
            SeqDelta(
                request_id="req-1",
                token_ids=[6],
                logprobs=[-1.25],
                finished=True,
                finish_reason="length",
            )
        ],
    ),
    "register_worker": RegisterWorker(engine_id="e0", epoch=3, pid=42, weight_version=2),
    "engine_failed": EngineFailed(
        engine_id="e0", epoch=3, pid=42, reason="exited", detected_at=1.5
    ),
    "token_log_chunk": TokenLogChunk(
        request_id="req-1",
        chunk_index=0,
        start=0,
        token_ids=[5, 6],
        logprobs=[-0.5, -1.25],
        weight_versions=[2, 2],
        final=True,
        finish_reason="length",
    ),
    "event_handover_complete": HandoverComplete(
        ts=1.25,
        source="shadow:e0",
        engine_id="e0",
        epoch=4,
        pid=43,
        old_pid=42,
        old_epoch=3,
        detect_to_registered_s=0.5,
        t_detect=1.0,
        t_health=1.125,
        t_flush=1.25,
        t_ready=1.375,
        t_registered=1.5,
    ),
    "event_requests_resumed": RequestsResumed(
        ts=1.5, engine_id="e0", epoch=4, count=2, held_tokens=7, request_ids=["req-1", "req-2"]
    ),
    "event_engine_unhealthy": EngineUnhealthy(
        ts=2.5, engine_id="e1", reason="repeated failure", moved_requests=1, request_ids=["req-3"]
    ),
    "event_weights_updated": WeightsUpdated(
        ts=3.0, version=3, base_version=2, checksum="cd" * 32, bytes=128, seconds=0.25
    ),
    "event_checkpoint_ready": CheckpointReady(
        ts=4.0,
        source="environment:node-a",
        checkpoint=CheckpointInfo(
            sandbox_id="sb-1",
            trajectory_id="traj-1",
            prefix=1,
            checkpoint_id="ck-1",
            fs_bytes=10,
            criu_bytes=20,
            freeze_s=0.5,
            fs_s=0.25,
            dump_s=0.125,
            total_s=1.0,
        ),
    ),
    "weight_manifest": WeightManifest(
        version=2,
        handle=MemoryHandle(kind="shm", path="/dev/shm/belayer-x-weights-v2", size=128),
        tensors=[
            TensorDesc(name="lm_head.weight", dtype="float32", shape=[4, 8], offset=0, nbytes=128)
        ],
        checksum="ab" * 32,
        model_dir="/m",
    ),
    "reward_request": RewardRequest(  # as v1 first shipped: no token ids, no sandbox id
        trajectory_id="r1-s0-a0",
        workload="math",
        task_id="t1",
        prompt=[ChatTurn(role="user", content="1+1?")],
        response="Answer: 2",
        answer="2",
        metadata={"source": "gen"},
    ),
    "arena_desc": ArenaDesc(
        engine_id="e0",
        handle=MemoryHandle(path="/dev/shm/belayer-x-kv-e0", size=64),
        shape=[1, 2, 2, 2, 1, 2],
        dtype="float32",
        block_size=2,
        num_blocks=2,
        generation=1,
    ),
}


def load_fixture() -> dict[str, str]:
    return json.loads(FIXTURE.read_text())


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_golden_bytes_decode_and_match(name: str) -> None:
    golden = bytes.fromhex(load_fixture()[name])
    msg = EXAMPLES[name]
    assert decode(golden, type(msg)) == msg  # old payloads keep decoding (new fields: defaults)
    raw = msgpack.unpackb(golden)  # an independent reader sees a plain map with the version tag
    assert isinstance(raw, dict) and raw["type"] == type(msg).__struct_config__.tag
    # Fields only ever get added: every v1 key is still written, with the same value.
    assert still_contains(msgpack.unpackb(encode(msg)), raw)


def still_contains(now: object, old: object) -> bool:
    """``now`` has every key of ``old`` (recursively) with equal values; extra keys allowed."""
    if isinstance(old, dict):
        return isinstance(now, dict) and all(
            k in now and still_contains(now[k], v) for k, v in old.items()
        )
    if isinstance(old, list):
        return isinstance(now, list) and len(now) == len(old) and all(map(still_contains, now, old))
    return now == old


def test_reply_union_dispatches_on_tag() -> None:
    fx = load_fixture()
    assert isinstance(decode(bytes.fromhex(fx["token_delta"]), GenerateReply), TokenDelta)
    assert isinstance(decode(bytes.fromhex(fx["generate_result"]), GenerateReply), GenerateResult)
    assert isinstance(decode(bytes.fromhex(fx["error_reply"]), GenerateReply), ErrorReply)


def test_event_union_dispatches_on_tag() -> None:
    fx = load_fixture()
    for name, msg in EXAMPLES.items():
        if name.startswith("event_"):
            assert decode(bytes.fromhex(fx[name]), AnyEvent) == msg


def test_a_field_added_later_is_ignored_by_v1_readers() -> None:
    raw = msgpack.unpackb(bytes.fromhex(load_fixture()["register_worker"]))
    raw["added_in_future"] = [1, 2, 3]
    assert decode(msgpack.packb(raw), RegisterWorker) == EXAMPLES["register_worker"]


if __name__ == "__main__" and "--regen" in sys.argv:
    FIXTURE.write_text(
        json.dumps({k: encode(v).hex() for k, v in sorted(EXAMPLES.items())}, indent=1) + "\n"
    )
    print(f"wrote {FIXTURE}")
