"""Messages of the node supervisor (``belayer.supervisor.*``)."""

from __future__ import annotations

import msgspec

from schemas.base import Id, Message

RunId = Id
"""Id of one node run (names its shared-memory segments and message ids)."""


class ProcInfo(msgspec.Struct, kw_only=True):
    """One supervised process."""

    name: str
    pid: int | None
    alive: bool
    restarts: int = 0
    uptime_s: float = 0.0


class SupervisorStatusRequest(Message, tag="SupervisorStatusRequest.v1"):
    """Ask the supervisor for its process table."""


class SupervisorStatus(Message, tag="SupervisorStatus.v1"):
    """The supervisor's process table."""

    run_id: RunId
    pid: int
    ready: bool
    procs: list[ProcInfo]


class StopNode(Message, tag="StopNode.v1"):
    """Stop every service of the node, then the supervisor (``belayer down``)."""

    reason: str = ""
