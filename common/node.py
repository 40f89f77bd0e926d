"""The node file (``<run dir>/node.json``) written by ``belayer up``: how CLIs and services find
the bus without a flag."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

from common.config import RunPaths
from common.errors import BusUnavailable


@dataclass
class NodeInfo:
    """What ``belayer up`` records about a running node."""

    nats_url: str
    run_id: str
    supervisor_pid: int
    nats_pid: int | None = None
    model_dir: str = ""
    engines: list[str] = field(default_factory=list)
    recovery: str = "belayer"
    started_at: float = 0.0
    ready: bool = False

    def write(self, paths: RunPaths) -> None:
        paths.root.mkdir(parents=True, exist_ok=True)
        tmp = paths.node_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        tmp.replace(paths.node_file)


def read_node(paths: RunPaths) -> NodeInfo | None:
    """The node file, or None when no node was started from this run directory."""
    try:
        data = json.loads(paths.node_file.read_text())
    except (OSError, ValueError):
        return None
    return NodeInfo(**data)


def resolve_nats_url(explicit: str | None, paths: RunPaths | None = None) -> str:
    """``explicit`` (a ``--nats-url`` flag), else ``$BELAYER_NATS_URL``, else the running node's
    URL from its node file; raise ``BusUnavailable`` with a hint when there is none."""
    if explicit:
        return explicit
    env = os.environ.get("BELAYER_NATS_URL")
    if env:
        return env
    node = read_node(paths or RunPaths.default())
    if node is None:
        raise BusUnavailable(
            "no Belayer node is running here: start one with `belayer up` or pass --nats-url"
        )
    return node.nats_url
