"""Belayer's error hierarchy. Every error that crosses a process boundary is one of these.

    BelayerError                      base; carries ``code`` and a ``data`` dict
    ├── RetryableError                the same call may succeed later
    │   ├── BusUnavailable            NATS unreachable / no responders / timed out
    │   ├── EngineUnavailable         no healthy engine can take the request now
    │   ├── CheckpointBusy            a checkpoint/exec holds the sandbox
    │   ├── Overloaded                a flood: the service shed this request unread
    │   └── Timeout                   an operation ran past its deadline (the same call, later
    │                                 or with more time, may succeed)
    └── FatalError                    the call will fail the same way again
        ├── InvalidRequest            malformed or wrongly typed message (names the field)
        ├── NotFound                  unknown engine, request, sandbox, checkpoint, version
        ├── Conflict                  stale epoch, duplicate id, compare-and-set lost
        ├── ResourceLimit             oversized prompt, output cap, memory
        ├── CheckpointInvalid         corrupt or hostile checkpoint archive
        ├── SandboxError              container/CRIU/Docker failure
        └── Unauthorized              credentials missing, unreadable or refused

On the bus an error travels as ``schemas.base.ErrorReply`` (code, message, data, retryable);
``from_reply`` turns it back into the matching class, so callers catch typed errors.
Library exceptions (nats, docker, OSError) are translated at the service boundary.
"""

from __future__ import annotations

from typing import Any, ClassVar


class BelayerError(Exception):
    """Base error: ``code`` is stable (users match on it), ``data`` holds the details."""

    code: ClassVar[str] = "error"
    retryable: ClassVar[bool] = False

    def __init__(self, message: str, **data: Any) -> None:
        super().__init__(message)
        self.message = message
        self.data = data

    def __str__(self) -> str:
        if not self.data:
            return self.message
        extras = ", ".join(f"{k}={v!r}" for k, v in self.data.items())
        return f"{self.message} ({extras})"


class RetryableError(BelayerError):
    code = "retryable"
    retryable = True


class FatalError(BelayerError):
    code = "fatal"


class BusUnavailable(RetryableError):
    code = "bus_unavailable"


class EngineUnavailable(RetryableError):
    code = "engine_unavailable"


class CheckpointBusy(RetryableError):
    code = "checkpoint_busy"


class Overloaded(RetryableError):
    code = "overloaded"


class InvalidRequest(FatalError):
    code = "invalid_request"


class NotFound(FatalError):
    code = "not_found"


class Conflict(FatalError):
    code = "conflict"


class ResourceLimit(FatalError):
    code = "resource_limit"


class CheckpointInvalid(FatalError):
    code = "checkpoint_invalid"


class SandboxError(FatalError):
    code = "sandbox_error"


class Timeout(RetryableError):
    code = "timeout"


class Unauthorized(FatalError):
    code = "unauthorized"


class RewardFailed(FatalError):
    """A user's reward function raised or returned something that is not a reward: that
    trajectory's reward failed (it is recorded and counted; the step goes on)."""

    code = "reward_failed"


_BY_CODE: dict[str, type[BelayerError]] = {
    cls.code: cls
    for cls in (
        BelayerError,
        RetryableError,
        FatalError,
        BusUnavailable,
        EngineUnavailable,
        CheckpointBusy,
        Overloaded,
        InvalidRequest,
        NotFound,
        Conflict,
        ResourceLimit,
        CheckpointInvalid,
        SandboxError,
        Timeout,
        Unauthorized,
        RewardFailed,
    )
}


def error_class(code: str) -> type[BelayerError]:
    """The error class for a wire ``code`` (unknown codes map to ``BelayerError``)."""
    return _BY_CODE.get(code, BelayerError)
