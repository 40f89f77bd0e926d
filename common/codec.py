"""The wire codec as services use it: MessagePack encode/decode of ``schemas`` messages with
decode failures raised as ``InvalidRequest`` (naming the field), and errors to and from their
``ErrorReply`` form."""

from __future__ import annotations

from typing import Any, TypeVar, overload

from common.errors import BelayerError, InvalidRequest, error_class
from schemas import base
from schemas.base import ErrorReply

M = TypeVar("M")

encode = base.encode


@overload
def decode(data: bytes, typ: type[M]) -> M: ...
@overload
def decode(data: bytes, typ: Any) -> Any: ...
def decode(data: bytes, typ: Any) -> Any:
    """Decode and validate ``data`` as ``typ``; ``InvalidRequest`` (with ``field``) if it is not
    a valid message of that type."""
    try:
        return base.decode(data, typ)
    except base.DecodeFailure as exc:
        raise InvalidRequest(exc.message, field=exc.field, **exc.data) from None


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
