"""The node file (``<run dir>/node.json``) written by ``belayer up``: how CLIs and services find
the bus without a flag."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from common.auth import BusConfig
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
    creds_dir: str = ""
    """Where this node's identity files are (a path; the seeds never enter this file)."""
    tls_ca: str = ""
    """CA file of the node's bus (empty: no TLS)."""
    tls_cert: str = ""
    """Client certificate for the bus (empty: none)."""
    tls_key: str = ""
    """Its key file."""
    role: str = "node"
    """``node`` or ``env-host`` (a host that joined another node's deployment)."""
    metrics_url: str = ""
    """The node's Prometheus endpoint (``belayer up --metrics-port``; empty: off)."""
    owner_pid: int = 0
    """The process the node stops with (``SupervisorConfig.owner_pid``: ``belayer run``'s own
    node, a foreground ``belayer up``); 0: none."""

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
    known = {f for f in NodeInfo.__dataclass_fields__}
    return NodeInfo(**{k: v for k, v in data.items() if k in known})


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


def resolve_bus(
    explicit_url: str | None,
    *,
    creds: str | None = None,
    role: str = "client",
    paths: RunPaths | None = None,
) -> tuple[str, BusConfig]:
    """The URL and credentials a command-line tool connects with: ``--nats-url`` /
    ``$BELAYER_NATS_URL`` / the node file's URL (``resolve_nats_url``); ``--creds`` /
    ``$BELAYER_CREDS`` / the run directory's identity of ``role`` (``client``, or
    ``operator`` for sandboxes and ``down``) when the URL is the node's; TLS files from
    ``$BELAYER_TLS_CA`` / ``_CERT`` / ``_KEY`` or the node file."""
    paths = paths or RunPaths.default()
    url = resolve_nats_url(explicit_url, paths)
    node = read_node(paths)
    own = node is not None and url == node.nats_url
    creds = creds or os.environ.get("BELAYER_CREDS", "")
    if not creds and own and node is not None and node.creds_dir:
        found = Path(node.creds_dir) / f"{role}.nk"
        creds = str(found)
    env = os.environ.get
    mine = node if own else None
    return url, BusConfig(
        creds=creds,
        tls_ca=env("BELAYER_TLS_CA", "") or (mine.tls_ca if mine else ""),
        tls_cert=env("BELAYER_TLS_CERT", "") or (mine.tls_cert if mine else ""),
        tls_key=env("BELAYER_TLS_KEY", "") or (mine.tls_key if mine else ""),
    )
