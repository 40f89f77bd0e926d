"""``belayer env create|exec|checkpoint|restore|destroy|ls``, mounted as ``belayer env`` by
``services/cli/main.py`` (which also mounts ``belayer bench env`` when this module imports)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import typer

from schemas.env import SandboxLimits
from services.cli.shared import print_json, run, with_bus
from services.environment.client import PlacedEnvClient

env_app = typer.Typer(
    help="Environment sandboxes: create, exec, full_checkpoint, full_restore, destroy, ls.",
    no_args_is_help=True,
)

NATS_URL = typer.Option(None, "--nats-url", help="NATS URL (default: the running node's).")


def _call(nats_url: str | None, fn: Any) -> Any:
    async def go(nc: Any) -> Any:
        # Each sandbox's operations go to the host it lives on (a deployment with several
        # environment hosts; with one, the same as the node's environment service).
        return await fn(PlacedEnvClient(nc))

    return run(with_bus(nats_url, go, name="cli-env", role="operator"))


def _out(obj: Any, as_json: bool, text: str) -> None:
    if as_json:
        print_json(msgspec.to_builtins(obj))
    else:
        typer.echo(text)


@env_app.command("create")
def create(
    image: str = typer.Option("", help="Image (default: the service's base image)."),
    file: list[str] = typer.Option(
        [], "--file", help="HOST_PATH:SANDBOX_PATH to copy in (repeatable)."
    ),
    memory_mb: int = typer.Option(512, help="Memory limit (MiB)."),
    cpus: float = typer.Option(1.0, help="CPU quota (cores)."),
    pids: int = typer.Option(256, help="Process limit."),
    trajectory: str = typer.Option("", "--trajectory", help="Trajectory id."),
    sandbox_id: str = typer.Option("", "--id", help="Sandbox id (default: random)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    nats_url: str | None = NATS_URL,
) -> None:
    """Create a sandbox; prints its id."""
    files: dict[str, bytes] = {}
    for spec in file:
        host, _, inside = spec.partition(":")
        if not inside:
            raise typer.BadParameter(f"--file {spec!r}: expected HOST_PATH:SANDBOX_PATH")
        files[inside] = Path(host).read_bytes()
    limits = SandboxLimits(memory_mb=memory_mb, cpus=cpus, pids=pids)
    r = _call(
        nats_url,
        lambda c: c.create(
            image=image, files=files, limits=limits, trajectory_id=trajectory, sandbox_id=sandbox_id
        ),
    )
    _out(r, as_json, r.sandbox_id)


@env_app.command("exec")
def exec_(
    sandbox_id: str = typer.Argument(..., help="Sandbox id."),
    command: str = typer.Argument(..., help="Shell command (run with sh -c)."),
    timeout: float = typer.Option(30.0, "--timeout", help="Seconds before the command is killed."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    nats_url: str | None = NATS_URL,
) -> None:
    """Run a command in a sandbox; exits with its exit code."""
    r = _call(nats_url, lambda c: c.exec(sandbox_id, command, timeout))
    if as_json:
        print_json(msgspec.to_builtins(r))
    else:
        typer.echo(r.stdout, nl=False)
        typer.echo(r.stderr, nl=False, err=True)
        if r.truncated:
            typer.echo("[output truncated]", err=True)
    raise typer.Exit(r.exit_code if 0 <= r.exit_code < 256 else 1)


@env_app.command("checkpoint")
def checkpoint(
    sandbox_id: str = typer.Argument(..., help="Sandbox id."),
    prefix: int = typer.Option(..., "--prefix", "-k", help="Action-boundary index k."),
    trajectory: str = typer.Option("", "--trajectory", help="Trajectory id."),
    timeout: float = typer.Option(0.0, "--timeout", help="Deadline (0: the service default)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    nats_url: str | None = NATS_URL,
) -> None:
    """full_checkpoint: capture files + processes at prefix k and publish it as ready."""
    r = _call(nats_url, lambda c: c.checkpoint(sandbox_id, prefix, trajectory, timeout))
    died = (
        "\nthe container died during the checkpoint (after the dump completed): the sandbox is "
        "failed; full_restore it"
        if r.container_exited
        else ""
    )
    _out(r, as_json, f"{r.checkpoint_id} prefix={r.prefix} total={r.total_s * 1000:.0f}ms{died}")


@env_app.command("restore")
def restore(
    sandbox_id: str = typer.Argument(..., help="Sandbox id."),
    checkpoint_id: str = typer.Option("", "--checkpoint", help="Default: the latest ready one."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    nats_url: str | None = NATS_URL,
) -> None:
    """full_restore: a fresh container with the checkpoint's files and processes."""
    r = _call(nats_url, lambda c: c.restore(sandbox_id, checkpoint_id))
    passed = "".join(
        f"\n  {a.checkpoint_id}: {a.outcome} ({a.error})"
        for a in r.candidates
        if a.outcome != "restored"
    )
    _out(
        r,
        as_json,
        f"{r.sandbox_id} restored to prefix {r.prefix} ({r.checkpoint_id}) in "
        f"{r.duration_s * 1000:.0f}ms via {r.method}"
        + (f"; passed over:{passed}" if passed else ""),
    )


@env_app.command("destroy")
def destroy(
    sandbox_id: str = typer.Argument(..., help="Sandbox id."),
    nats_url: str | None = NATS_URL,
) -> None:
    """Remove a sandbox, its container and its checkpoints."""
    r = _call(nats_url, lambda c: c.destroy(sandbox_id))
    typer.echo(r.detail)


@env_app.command("ls")
def ls(
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    nats_url: str | None = NATS_URL,
) -> None:
    """List sandboxes (id, container, ready prefix, checkpoint)."""
    r = _call(nats_url, lambda c: c.list())
    if as_json:
        print_json(msgspec.to_builtins(r.sandboxes))
        return
    typer.echo(f"{'ID':<20} {'CONTAINER':<13} {'STATE':<14} {'READY':>5}  CHECKPOINT")
    for s in r.sandboxes:
        ready = "-" if s.ready_prefix is None else str(s.ready_prefix)
        typer.echo(
            f"{s.id:<20} {s.container_id[:12]:<13} {s.state:<14} {ready:>5}  {s.checkpoint_id or '-'}"
        )
