"""Typed, versioned messages: the base struct and the MessagePack codec.

Every message is a ``msgspec.Struct`` whose wire form is a MessagePack map carrying a
``type`` tag such as ``"GenerateRequest.v1"``. Types evolve only by adding defaulted fields at
the end; a breaking change is a new ``.v2`` class. Decoding validates every field; a bad
payload raises ``common.errors.InvalidRequest`` whose message names the field (``$.max_tokens``).
"""

from __future__ import annotations

from typing import Any, TypeVar, overload

import msgspec

from common.errors import BelayerError, InvalidRequest, error_class


class Message(msgspec.Struct, kw_only=True, tag_field="type", omit_defaults=False):
    """Base of every wire message. Subclasses set ``tag="Name.vN"``."""


M = TypeVar("M")

_encoder = msgspec.msgpack.Encoder()
_decoders: dict[Any, msgspec.msgpack.Decoder[Any]] = {}

#: Largest message any service accepts (NATS' own default max_payload is 1 MiB).
MAX_MESSAGE_BYTES = 8 * 1024 * 1024


def encode(msg: Any) -> bytes:
    """Serialize a message (or any msgspec-encodable value) to MessagePack bytes."""
    return _encoder.encode(msg)


@overload
def decode(data: bytes, typ: type[M]) -> M: ...
@overload
def decode(data: bytes, typ: Any) -> Any: ...
def decode(data: bytes, typ: Any) -> Any:
    """Decode and validate ``data`` as ``typ`` (a Message class or a Union of them).

    Raises ``InvalidRequest`` naming the offending field on any malformed or wrongly typed input.
    """
    if len(data) > MAX_MESSAGE_BYTES:
        raise InvalidRequest("message too large", size=len(data), limit=MAX_MESSAGE_BYTES)
    dec = _decoders.get(typ)
    if dec is None:
        dec = _decoders[typ] = msgspec.msgpack.Decoder(typ)
    try:
        return dec.decode(data)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"invalid message: {exc}", field=_field_of(str(exc))) from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"malformed MessagePack: {exc}", field="$") from None


def _field_of(text: str) -> str:
    """Pull ``$.path`` out of a msgspec validation message ("... - at `$.max_tokens`")."""
    marker = "at `"
    i = text.rfind(marker)
    if i < 0:
        return "$"
    return text[i + len(marker) :].rstrip("`")


class ErrorReply(Message, tag="ErrorReply.v1"):
    """A failed request. ``code`` is stable (see ``common/errors.py``)."""

    code: str
    """Error code, e.g. ``invalid_request``, ``not_found``, ``conflict``."""
    message: str
    """Human-readable explanation."""
    retryable: bool = False
    """Whether the same call may succeed later."""
    data: dict[str, Any] = {}
    """Details: the offending field, the id that was unknown, limits…"""


def error_reply(exc: BelayerError) -> ErrorReply:
    """Wire form of a Belayer error."""
    data = {
        k: v if isinstance(v, (str, int, float, bool, type(None))) else str(v)
        for k, v in exc.data.items()
    }
    return ErrorReply(code=exc.code, message=exc.message, retryable=exc.retryable, data=data)


def raise_error(reply: ErrorReply) -> None:
    """Raise the typed error an ``ErrorReply`` stands for."""
    raise error_class(reply.code)(reply.message, **reply.data)


class Ok(Message, tag="Ok.v1"):
    """A bare acknowledgement."""

    detail: str = ""
    """Optional note for humans."""
