"""``belayer soak``: faults of every kind under a mixed load, invariants checked on every
history (the driver is ``bench/soak.py``, the checker ``bench/soak_check.py``)."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from bench.soak_node import ALL_KINDS
from services.cli.shared import fail, one_line

if TYPE_CHECKING:
    from bench.soak import SoakOptions

_KINDS_HELP = (
    "Comma-separated fault kinds (default: every kind the node takes): "
    + ", ".join(ALL_KINDS)
    + ". worker-hang is a SIGSTOP of the main worker; sandbox-kill and sandbox-pause are docker "
    "kill and pause of the soak's sandbox, checkpoint-interrupt a SIGKILL of the environment "
    "service mid-checkpoint (those three with --workload swe); nats-kill SIGKILLs one server "
    "of the node's NATS cluster that runs on this machine and starts it again as it was started "
    "(a node joined with belayer up --join URL,URL,...); the others SIGKILL their process."
)

_WORKLOAD_HELP = (
    "serve: generate requests; math: also math rollouts through the controller; swe: also swe "
    "rollouts (Docker sandboxes) and a sandbox lane, checkpointed and restored, for the sandbox "
    "faults (the node the soak starts then runs the environment service)."
)
_TRAIN_HELP = (
    "With --workload math or swe: a training lane instead of the rollout lane, real RL steps "
    "back to back (rollout, rewards, the trainer's update, every engine on the new weights; 2 "
    "tasks x 2 samples at a negligible learning rate, so the load does not drift). The node "
    "the soak starts then runs the trainer, and trainer-kill is drawn. Checked: no trajectory "
    "trained twice, each trained one published, steps strictly increasing, the lane training "
    "again after every trainer-kill and never failing."
)


def soak(
    faults: int = typer.Option(20, "--faults", min=1, help="Faults to inject."),
    duration: float = typer.Option(
        120.0, "--duration", min=1.0, help="Seconds to spread the faults over (and to load)."
    ),
    kinds: str = typer.Option("", "--kinds", help=_KINDS_HELP),
    seed: int = typer.Option(0, "--seed", help="Seed of the fault schedule and of the load."),
    workload: str = typer.Option("serve", "--workload", help=_WORKLOAD_HELP),
    train: bool = typer.Option(False, "--train", help=_TRAIN_HELP),
    engines: int = typer.Option(
        1, "--engines", min=1, max=8, help="Engines of a node the soak starts."
    ),
    concurrency: int = typer.Option(
        4, "--concurrency", min=1, max=64, help="Requests in flight at once."
    ),
    run_dir: Path | None = typer.Option(
        None,
        "--run-dir",
        help="Soak the node running from this run directory (default: $BELAYER_HOME or "
        "./.belayer); with none running there, the soak starts its own in a temporary "
        "directory and stops it at the end.",
    ),
    out: Path = typer.Option(
        Path("bench-results/soak.json"), "--out", help="Where to write the JSON result."
    ),
    history: Path | None = typer.Option(
        None,
        "--history",
        help="Where to write the history (JSONL; default: <out stem>-history.jsonl next to it).",
    ),
    as_json: bool = typer.Option(
        False, "--json", help="Print the result as JSON on stdout (the tables go to stderr)."
    ),
    check: Path | None = typer.Option(
        None,
        "--check",
        help="Only check this history (JSONL) of an earlier soak again: no node, no faults.",
    ),
) -> None:
    """Faults of every kind under a mixed load; every request's history checked.

    Streaming and non-streaming requests, greedy and seeded-sampled, of 8 to
    320 tokens, run back to back while a seeded schedule SIGKILLs (or, for
    worker-hang, SIGSTOPs) the node's processes: main workers, shadows, the
    router, the weight store, the KV arena, the controller (the trainer and
    the environment service where they run); with --workload swe also the
    soak's sandbox (docker kill, docker pause) and a checkpoint mid-write.
    With --train a training lane runs RL steps on the node's trainer and
    trainer-kill is among the kinds. On a node joined to a NATS cluster
    (belayer up --join) nats-kill SIGKILLs one of the cluster's servers that
    run on this machine and starts it again. Faults on different parts overlap; a
    part is faulted only when whole again, and each fault's time to recover
    is measured.

    Then every request runs again without faults, and the history (JSONL) is
    checked: each request finished exactly once, with the tokens of its
    fault-free reference; its stream had no gap and no repeat; engine epochs
    only grew; no two workers streamed for one engine in one epoch; every
    rollout's slots were published exactly once; a restored sandbox held an
    acknowledged checkpoint's state; every fault was injected; with --train,
    no trajectory trained twice, each trained one published, train steps
    strictly increasing, the lane trained after every trainer-kill and had
    no error; nothing was left over (processes, /dev/shm files, containers).

    Prints a table per fault kind and the verdict; exit 1 on FAIL. A node of
    your own should run with --failure-window 0 (else a second worker fault
    of an engine inside the window retires it, as designed).
    """
    from bench.soak import SoakOptions

    opts = SoakOptions(
        faults=faults, duration_s=duration, seed=seed, workload=workload, train=train, engines=engines,
        concurrency=concurrency, run_dir=run_dir, out=out, history=history,
        kinds=tuple(k.strip() for k in kinds.split(",") if k.strip()),
    )  # fmt: skip

    _run(opts, check, as_json)


def _run(opts: SoakOptions, check: Path | None, as_json: bool) -> None:
    """The soak (or ``--check``), its errors as one line; exit 1 unless the verdict is PASS."""
    from bench.soak import main as soak_main
    from bench.soak import recheck
    from common.errors import BelayerError, InvalidRequest
    from services.rl.node import NodeFailed

    def go() -> dict:
        return recheck(check, opts) if check is not None else soak_main(opts)

    try:
        if as_json:
            with contextlib.redirect_stdout(sys.stderr):
                result = go()
            sys.stdout.write(json.dumps(result, indent=2, default=str) + "\n")
        else:
            result = go()
    except KeyboardInterrupt:
        fail("interrupted: the soak stopped what it started", 130)
    except InvalidRequest as exc:
        fail(one_line(str(exc)), 2)
    except (BelayerError, NodeFailed, OSError) as exc:
        fail(one_line(str(exc)))
    if result["verdict"] != "PASS":
        raise typer.Exit(1)
