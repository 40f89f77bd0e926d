"""Belayer's Python API: what the CLI does, for notebooks and scripts.

    import belayer

    with belayer.Node() as node:                       # attach to ./.belayer's node, or start one
        out = node.generate("Once upon a time", max_tokens=32, temperature=0)
        print(out.text, out.router_restarts)
        result = node.rollout("math", tasks=2, n=2)    # a RolloutResult: summary and rows
        for ev in node.events(kinds=["handover_complete"], timeout=5):
            print(ev.kind, ev.engine_id)

``belayer.AsyncNode`` is the same with ``async`` methods (``async with``, ``await
node.generate(...)``, ``async for ev in node.events(...)``). Every error is a
``belayer.BelayerError`` subclass with a one-line message and a stable ``code``
(docs/protocol.md, "Error codes"); nothing else escapes. docs/python-api.md has the details.
"""

from belayer.api import AsyncNode, Node
from common.errors import BelayerError, InvalidRequest, NotFound, Timeout, Unauthorized
from schemas.events import EventBase
from schemas.rollout import RolloutResult, RolloutSummary, TrajectoryRow
from schemas.serving import GenerateResult

__all__ = [
    "AsyncNode",
    "BelayerError",
    "EventBase",
    "GenerateResult",
    "InvalidRequest",
    "Node",
    "NotFound",
    "RolloutResult",
    "RolloutSummary",
    "Timeout",
    "TrajectoryRow",
    "Unauthorized",
]
