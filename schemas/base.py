"""Typed, versioned messages: the base struct and the MessagePack codec.

Every message is a ``msgspec.Struct`` whose wire form is a MessagePack map carrying a
``type`` tag such as ``"GenerateRequest.v1"``. Types evolve only by adding defaulted fields at
the end; a breaking change is a new ``.v2`` class. Decoding validates every field; a bad
payload raises :class:`DecodeFailure` naming the field (``$.max_tokens``); ``common.codec``
turns that into the bus error ``invalid_request``. This package imports nothing else of ours.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar, overload

import msgspec

ID_PATTERN = r"^[A-Za-z0-9_-]{1,128}\Z"
r"""What every id matches, as a whole string (``\Z``: a trailing newline is refused too)."""

Id = Annotated[str, msgspec.Meta(pattern=ID_PATTERN)]
"""An id that may become a subject token, a message id or a path component: 1 to 128 letters,
digits, ``_`` or ``-`` (no dots, spaces, wildcards, slashes)."""

IdOrEmpty = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{0,128}\Z")]
"""An ``Id`` or ``""`` (for fields whose empty value means "none" or "pick one")."""


class Message(msgspec.Struct, kw_only=True, tag_field="type", omit_defaults=False):
    """Base of every wire message. Subclasses set ``tag="Name.vN"``."""


M = TypeVar("M")


class DecodeFailure(ValueError):
    """A payload that is not a valid message: ``field`` is the JSON-path of the offending
    field (``$`` for the whole message)."""

    def __init__(self, message: str, *, field: str = "$", **data: Any) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.data = data


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

    A message must carry its ``type`` tag. Raises :class:`DecodeFailure` naming the offending
    field on any malformed or wrongly typed input.
    """
    if len(data) > MAX_MESSAGE_BYTES:
        raise DecodeFailure("message too large", size=len(data), limit=MAX_MESSAGE_BYTES)
    dec = _decoders.get(typ)
    if dec is None:
        dec = _decoders[typ] = msgspec.msgpack.Decoder(_require_tag(typ))
    try:
        return dec.decode(data)
    except msgspec.ValidationError as exc:
        raise DecodeFailure(f"invalid message: {exc}", field=_field_of(str(exc))) from None
    except msgspec.DecodeError as exc:
        raise DecodeFailure(f"malformed MessagePack: {exc}", field="$") from None
    except RecursionError:
        raise DecodeFailure("message nested too deeply", field="$") from None


class _NoMessage(Message, tag="\x00none"):
    """Never sent: in a Union with a single message type it makes msgspec require the ``type``
    tag (a lone tagged struct would otherwise decode an untagged map)."""


def _require_tag(typ: Any) -> Any:
    if isinstance(typ, type) and issubclass(typ, Message):
        return typ | _NoMessage
    return typ


def _field_of(text: str) -> str:
    """The JSON-path of the field a msgspec validation message is about: ``... - at
    `$.sampling` `` → ``$.sampling``; a missing field ``x`` at ``$.sampling`` →
    ``$.sampling.x``."""
    marker = "at `"
    i = text.rfind(marker)
    path = "$" if i < 0 else text[i + len(marker) :].rstrip("`")
    missing = "missing required field `"
    j = text.find(missing)
    if j >= 0:
        name = text[j + len(missing) :].split("`", 1)[0]
        path = f"{path}.{name}"
    return path


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


class Ok(Message, tag="Ok.v1"):
    """A bare acknowledgement."""

    detail: str = ""
    """Optional note for humans."""
