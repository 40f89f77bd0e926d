"""The ``belayer`` command line."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from services.cli import generate as generate_cmd
from services.cli import node as node_cmds

app = typer.Typer(
    name="belayer",
    help="Belayer: failure-tolerant agentic RL rollout. Start a node with `belayer up`, send "
    "requests with `belayer generate`, watch recovery with `belayer events`, stop with `belayer down`.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command()(node_cmds.up)
app.command()(node_cmds.down)
app.command()(node_cmds.status)
app.command()(node_cmds.events)
app.command()(generate_cmd.generate)

model_app = typer.Typer(
    help="Model directories (Hugging Face layout: config.json + safetensors + tokenizer).",
    no_args_is_help=True,
)
app.add_typer(model_app, name="model")


@model_app.command("init")
def model_init(
    out_dir: Path = typer.Argument(..., help="Directory to write."),
    tiny: bool = typer.Option(
        True, "--tiny/--no-tiny", help="A tiny random Qwen3 (the only kind made here)."
    ),
    hidden_size: int = typer.Option(256, help="Hidden size."),
    num_layers: int = typer.Option(4, help="Decoder layers."),
    vocab_size: int = typer.Option(4096, max=4096, help="Vocabulary size (≤ 4096)."),
    seed: int = typer.Option(0, help="Initialisation seed."),
) -> None:
    """Write a tiny random Qwen3 model with a local tokenizer (nothing is downloaded)."""
    if not tiny:
        typer.echo(
            "error: only --tiny models can be made here; point --model at an existing HF directory",
            err=True,
        )
        raise typer.Exit(2)
    from model.tiny import init_tiny_model

    path = init_tiny_model(
        out_dir, hidden_size=hidden_size, num_layers=num_layers, vocab_size=vocab_size, seed=seed
    )
    typer.echo(f"wrote tiny Qwen3 model to {path}")


bench_app = typer.Typer(help="Benchmarks: print a table and write JSON.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")


def _run_bench(fn: Callable[[], dict[str, Any]], as_json: bool) -> None:
    """Run a benchmark; with ``--json`` its table goes to stderr and the JSON to stdout."""
    if not as_json:
        fn()
        return
    with contextlib.redirect_stdout(sys.stderr):
        result = fn()
    sys.stdout.write(json.dumps(result, indent=2, default=str) + "\n")


@bench_app.command("serve")
def bench_serve(
    as_json: bool = typer.Option(
        False, "--json", help="Print the results as JSON on stdout (the table goes to stderr)."
    ),
    out: Path = typer.Option(
        Path("bench-results/serve.json"), "--out", help="Where to write the JSON."
    ),
    new_tokens: int = typer.Option(128, help="New tokens per request."),
) -> None:
    """Tokens/s at batch 1 and 8: engine alone vs the full bus path; attach vs cold load; up time."""
    from bench.serve import main as bench_main

    _run_bench(lambda: bench_main(out, new_tokens=new_tokens), as_json)


@bench_app.command("handover")
def bench_handover(
    as_json: bool = typer.Option(
        False, "--json", help="Print the results as JSON on stdout (the table goes to stderr)."
    ),
    out: Path = typer.Option(
        Path("bench-results/handover.json"), "--out", help="Where to write the JSON."
    ),
    failures: int = typer.Option(10, min=1, help="Worker failures to inject in belayer mode."),
    heartbeat_s: float = typer.Option(
        5.0, "--heartbeat", help="Baseline: the router's remote heartbeat interval (seconds)."
    ),
) -> None:
    """SIGKILL → detection / new worker ready / first resumed token, belayer vs baseline."""
    from bench.handover import main as bench_main

    _run_bench(lambda: bench_main(out, failures=failures, heartbeat_s=heartbeat_s), as_json)


def _mount_environment() -> None:
    """The environment CLI needs the docker SDK; mount it when importable."""
    try:
        from services.cli.env import env_app
    except ImportError:
        return
    app.add_typer(env_app, name="env")
    try:
        from services.cli.env import bench_env
    except ImportError:
        return
    bench_app.command("env")(bench_env)


_mount_environment()

if __name__ == "__main__":
    app()
