"""``belayer auth init`` (identities for a deployment across hosts) and the checks ``belayer
up`` makes before it starts anything: credentials, TLS files and the cluster it joins."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import typer

from common.auth import (
    BusConfig,
    authorization_conf,
    engine_host_identities,
    ensure_identities,
    node_identities,
    read_seed,
    seed_file,
)
from common.bus import connect, tls_context
from common.errors import BelayerError
from common.subjects import check_token
from services.cli.shared import fail, one_line
from services.supervisor.client import node_identity_names
from services.supervisor.config import SupervisorConfig, host_engine_ids, parse_engine_host

auth_app = typer.Typer(
    help="Identities (NATS nkeys) and permissions for a deployment across hosts.",
    no_args_is_help=True,
)

JOIN_TIMEOUT_S = 5.0
"""How long ``up --join`` waits for the deployment's NATS to answer."""


def preflight(config: SupervisorConfig) -> None:
    """Refuse to start a node whose credentials, TLS files or cluster would fail it: one
    ``error:`` line and exit 1, before any process starts."""
    try:
        if config.bus.tls_ca or config.bus.tls_cert:
            tls_context(config.bus)
        own = None
        if config.creds_dir:
            creds_dir = Path(config.creds_dir)
            for name in node_identity_names(config):
                read_seed(seed_file(creds_dir, name))
            own = seed_file(creds_dir, "supervisor" if config.role == "node" else "host")
        if config.nats_url:
            bus = dataclasses.replace(config.bus, creds=str(own) if own else "")
            asyncio.run(_probe(config.nats_url, bus))
    except BelayerError as exc:
        fail(one_line(str(exc)))


async def _probe(url: str, bus: BusConfig) -> None:
    nc = await connect(url, name="up-preflight", bus=bus, timeout=JOIN_TIMEOUT_S, reconnect=False)
    await nc.close()


@auth_app.command("init")
def init(
    out: Path = typer.Argument(..., help="Directory to write (existing identities are kept)."),
    engines: int = typer.Option(1, "--engines", "-n", min=1, help="Engines of the node."),
    env_hosts: list[str] = typer.Option(
        [], "--env-host", help="Name of a host that runs only sandboxes (repeatable)."
    ),
    engine_hosts: list[str] = typer.Option(
        [],
        "--engine-host",
        help="NAME:N: a host that runs N rollout engines (NAME-e0 …) for the node (repeatable; "
        "give the node the same --engine-host).",
    ),
) -> None:
    """Write the identities of a deployment: `OUT/node/` (every service of the node that
    runs the router, engines and controller, plus `client` and `operator`), `OUT/<host>/`
    per environment host (`host`, `environment`), and `OUT/auth.conf`, the
    `authorization` block every nats-server of the cluster includes. Copy each directory only
    to its host (seed files are mode 0600)."""
    try:
        for host in env_hosts:
            check_token(host, "host name")
        if "node" in env_hosts:
            raise ValueError("'node' is the node's own directory: name the host otherwise")
        hosts = [parse_engine_host(spec) for spec in engine_hosts]
        if {h for h, _ in hosts} & set(env_hosts) or len({h for h, _ in hosts}) < len(hosts):
            raise ValueError("every host needs its own name")
        engine_ids = [f"e{i}" for i in range(engines)]
        identities = ensure_identities(out / "node", node_identities(engine_ids))
        for host in env_hosts:
            identities += ensure_identities(
                out / host, [("host", "host", ""), ("environment", "environment", "")]
            )
        for host, count in hosts:
            ids = host_engine_ids(host, count)
            identities += ensure_identities(out / host, engine_host_identities(host, ids))
        conf = out / "auth.conf"
        conf.write_text(authorization_conf(identities))
    except (ValueError, BelayerError) as exc:
        fail(one_line(str(exc)), 2)
    except OSError as exc:
        fail(one_line(f"cannot write {out}: {exc.strerror or exc}"))
    typer.echo(
        f"wrote {len(identities)} identities under {out} and {conf} (include it in every "
        "nats-server's config); give each host only its own directory"
    )
