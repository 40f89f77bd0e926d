"""Decode errors name the field's path, untagged or too-deep messages are refused, and an error
survives its trip through ``ErrorReply``."""

from __future__ import annotations

import msgpack
import pytest

from common.codec import decode, encode, error_reply, raise_error
from common.errors import Conflict, InvalidRequest, Timeout
from schemas.serving import GenerateRequest


def test_missing_top_level_field_names_it() -> None:
    with pytest.raises(InvalidRequest) as err:
        decode(msgpack.packb({"type": "GenerateRequest.v1"}), GenerateRequest)
    assert err.value.data["field"] == "$.request_id"


def test_missing_nested_field_names_its_path() -> None:
    raw = {"type": "GenerateRequest.v1", "request_id": "r", "prompt": "x", "sampling": []}
    with pytest.raises(InvalidRequest) as err:
        decode(msgpack.packb(raw), GenerateRequest)
    assert err.value.data["field"] == "$.sampling"


def test_message_without_its_type_tag_is_refused() -> None:
    with pytest.raises(InvalidRequest) as err:
        decode(msgpack.packb({"request_id": "r", "prompt": "x"}), GenerateRequest)
    assert err.value.data["field"] == "$.type"


def test_wrong_tag_is_refused() -> None:
    with pytest.raises(InvalidRequest):
        decode(msgpack.packb({"type": "Ok.v1", "request_id": "r", "prompt": "x"}), GenerateRequest)


def test_int_encoded_float_is_accepted() -> None:
    raw: dict[str, object] = {"type": "GenerateRequest.v1", "request_id": "r", "prompt": "x"}
    raw["sampling"] = {"temperature": 1, "top_p": 1, "max_tokens": 4}
    req = decode(msgpack.packb(raw), GenerateRequest)
    assert req.sampling.temperature == 1.0


def test_deep_nesting_is_a_clear_error() -> None:
    deep = b"\x91" * 10_000 + b"\xc0"
    with pytest.raises(InvalidRequest):
        decode(deep, GenerateRequest)


def test_error_round_trip_keeps_class_and_data() -> None:
    reply = error_reply(Conflict("id reused", request_id="r"))
    back = decode(encode(reply), type(reply))
    with pytest.raises(Conflict) as err:
        raise_error(back)
    assert err.value.data == {"request_id": "r"}
    assert error_reply(Timeout("slow")).retryable
