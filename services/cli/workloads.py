"""``belayer workloads ls``: every workload a name loads here — built-in, registered, or an
installed package's ``belayer.workloads`` entry point — and where it comes from; with
``--plugin SPEC`` it also loads a ``module:factory`` plugin, so a broken one is one clear error
here rather than at ``belayer up``."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

from common.errors import BelayerError
from services.cli.shared import fail, print_json
from workloads.plugins import PLUGIN_API_VERSION, Found
from workloads.registry import available, load_workload

workloads_app = typer.Typer(
    help="Workloads: the built-in ones and your own (docs/workloads.md, 'Your own workload').",
    no_args_is_help=True,
)

LS_PLUGIN = typer.Option(
    None,
    "--plugin",
    help="Also load this package.module:factory plugin and list it (repeatable).",
)
LS_JSON = typer.Option(False, "--json", help="Print JSON on stdout.")


@workloads_app.command("ls")
def ls(plugin: list[str] | None = LS_PLUGIN, json_out: bool = LS_JSON) -> None:
    """List the workloads this machine can load, and where each comes from."""
    found = available()
    for spec in plugin or []:
        try:
            wl = load_workload(spec)
        except BelayerError as exc:
            fail(f"--plugin {spec!r}: {exc}")
        found.append(Found(wl.name, "module", spec))
    if json_out:
        print_json(
            {
                "plugin_api_version": PLUGIN_API_VERSION,
                "workloads": [
                    {"name": f.name, "source": f.source, "target": f.target} for f in found
                ],
            }
        )
        return
    table = Table(title=f"workloads (plugin contract v{PLUGIN_API_VERSION})")
    for column in ("name", "source", "factory"):
        table.add_column(column)
    for f in found:
        table.add_row(f.name, f.source, f.target)
    Console().print(table)
