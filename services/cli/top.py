"""``belayer top``: a live view of a node in the terminal (rich ``Live``, refreshed every
``--interval``): engines (epoch, worker and shadow pids, state, requests, weight version),
the router's counters, the controller's rollouts, the trainer's step, the sandboxes and the
latest events as they arrive. ``q`` quits (Ctrl-C and SIGTERM too). Every panel is read over the bus on its own, so
a router restart shows as "not answering" in its panel and the view goes on."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import termios
import threading
import time
import tty
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats.errors
import typer
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from common import events as node_events
from common import subjects
from common.bus import connect
from common.codec import decode
from common.errors import BelayerError
from common.node import read_node, resolve_bus
from schemas.env import EnvListing
from schemas.events import AnyEvent, EventBase
from schemas.events_training import ControllerEvent, RolloutStarted
from schemas.node import SupervisorStatus
from schemas.rollout import RolloutResult
from schemas.serving import RouterStatus
from schemas.trainer import TrainerStatus
from services.cli.shared import fail
from services.controller.client import status as rollout_status
from services.environment.client import EnvClient
from services.rl.run import run_paths
from services.router.client import router_status
from services.supervisor.client import supervisor_status
from services.trainer.client import trainer_status

TOP_INTERVAL = typer.Option(1.0, "--interval", min=0.2, max=60.0, help="Seconds between refreshes.")
TOP_ONCE = typer.Option(False, "--once", help="Print one frame and exit (no terminal needed).")
TOP_RUN_DIR = typer.Option(
    None, "--run-dir", help="Run directory of the node (default: $BELAYER_HOME or ./.belayer)."
)
TOP_NATS_URL = typer.Option("", "--nats-url", help="NATS URL (default: the running node's).")
TOP_CREDS = typer.Option(
    "", "--creds", help="Credentials (nkey seed file) of an identity to read with."
)
EVENTS_SHOWN = 12
"""How many of the latest events the view keeps."""
EVENTS_FRAME_LINES = 5
"""Lines of the events table besides its rows (title, header, rules)."""
ROLLOUTS_SHOWN = 4
"""How many of the latest rollouts the view follows."""


@dataclass
class View:
    """What the last refresh read (None: that service did not answer)."""

    router: RouterStatus | None = None
    supervisor: SupervisorStatus | None = None
    trainer: TrainerStatus | None = None
    sandboxes: EnvListing | None = None
    rollouts: dict[str, RolloutResult | None] = field(default_factory=dict)
    """The latest rollouts (by id, oldest first) and what the controller last said of each
    (None: not answered yet)."""
    events: deque[EventBase] = field(default_factory=lambda: deque(maxlen=EVENTS_SHOWN))
    title: str = ""

    def saw(self, ev: EventBase) -> None:
        """An event as it arrives: kept for the events panel; a controller event names a
        rollout to follow."""
        self.events.append(ev)
        if isinstance(ev, ControllerEvent) and ev.rollout_id not in self.rollouts:
            self.rollouts[ev.rollout_id] = None
            for rid in list(self.rollouts)[:-ROLLOUTS_SHOWN]:
                del self.rollouts[rid]


def top(
    interval: float = TOP_INTERVAL,
    once: bool = TOP_ONCE,
    run_dir: Path | None = TOP_RUN_DIR,
    nats_url: str = TOP_NATS_URL,
    creds: str = TOP_CREDS,
) -> None:
    """A live view of a node: engines, router, rollouts, trainer, sandboxes and the latest
    recovery events, refreshed every --interval seconds; q quits. Reads with the run
    directory's operator identity (client when there is none), or --creds FILE with
    --nats-url for another deployment."""
    paths = run_paths(run_dir)
    node = read_node(paths)
    if not (nats_url or node):
        fail("no Belayer node is running here: start one with `belayer up` or pass --nats-url")
    role = "operator" if (paths.root / "auth" / "operator.nk").exists() else "client"
    url, bus = resolve_bus(nats_url or None, creds=creds or None, role=role, paths=paths)
    who = Path(creds).stem if creds else role  # the identity read with
    title = f"belayer top — {node.run_id if node else url}  ({who})"
    try:
        asyncio.run(_main(url, bus, title, interval, once))
    except BelayerError as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        pass


async def _main(url: str, bus: Any, title: str, interval: float, once: bool) -> None:
    nc = await connect(url, name="cli-top", bus=bus, timeout=3.0)
    view = View(title=title)

    async def on_event(msg: Any) -> None:
        with contextlib.suppress(BelayerError):  # a kind this version does not know
            view.saw(decode(msg.data, AnyEvent))

    await nc.subscribe(subjects.EVENTS_ALL, cb=on_event)
    await _latest_rollout(nc, view)
    try:
        if once:
            await _refresh(nc, view)
            Console().print(render(view))
            return
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        keys = _Keys(lambda: loop.call_soon_threadsafe(stop.set))
        with keys, Live(render(view), refresh_per_second=4, screen=False) as live:
            while not stop.is_set():
                await _refresh(nc, view)
                live.update(render(view, live.console))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), interval)
    finally:
        await nc.drain()


async def _latest_rollout(nc: Any, view: View) -> None:
    """The rollout started last, from stream EVENTS (rollouts started later come as events)."""
    try:
        msg = await nc.jetstream().get_last_msg(
            subjects.STREAM_EVENTS, node_events.subject(RolloutStarted)
        )
        view.rollouts.setdefault(decode(msg.data or b"", RolloutStarted).rollout_id, None)
    except (TimeoutError, nats.errors.Error, BelayerError):
        return  # none yet, or not readable by this identity: the panel fills from events


async def _refresh(nc: Any, view: View) -> None:
    """Read every panel's source, each on its own (one that does not answer shows as such)."""

    async def ask(coro: Any) -> Any:
        try:
            return await coro
        except BelayerError:
            return None

    env = EnvClient(nc, timeout=1.0)
    view.router, view.supervisor, view.trainer, view.sandboxes = await asyncio.gather(
        ask(router_status(nc, timeout=1.0)), ask(supervisor_status(nc, timeout=1.0)),
        ask(trainer_status(nc, timeout=1.0)), ask(env.list()),
    )  # fmt: skip
    follow = [r for r, res in view.rollouts.items() if res is None or res.state != "done"]
    answers = await asyncio.gather(*(ask(rollout_status(nc, r, timeout=1.0)) for r in follow))
    for rid, res in zip(follow, answers, strict=True):
        if res is not None and rid in view.rollouts:
            view.rollouts[rid] = res


def render(view: View, console: Console | None = None) -> Group:
    """The whole frame; on ``console`` (a terminal) only as many of the latest events as fit
    below the other panels, so the newest stay on screen in a short terminal."""
    now = time.strftime("%H:%M:%S")
    parts: list[Any] = [Text(f"{view.title}   {now}   (q quits)", style="bold")]
    parts.append(_engines(view))
    r = view.router
    if r is None:
        parts.append(
            Text(
                "router: not answering (restarting?) — requests resume when it is back",
                style="yellow",
            )
        )
    else:
        m = r.metrics
        parts.append(Text(
            f"router {r.router_id or '?'}: in flight {r.inflight}, finished {r.finished}, requests "
            f"{m.get('requests', 0)}, resumes {m.get('resumes', 0)}, adopted {m.get('adopted', 0)}, "
            f"regenerated tokens {m.get('regenerated_tokens', 0)}"
        ))  # fmt: skip
    parts.append(_rollouts(view))
    t = view.trainer
    parts.append(Text(
        "trainer: none" if t is None else
        f"trainer: step {t.step}, weights v{t.version}, {'busy' if t.busy else 'idle'}, "
        f"batch {t.batch_size} ({t.group_size} per group), replaying {t.replaying}"
    ))  # fmt: skip
    parts.append(_sandboxes(view))
    shown = EVENTS_SHOWN
    if console is not None:
        used = len(console.render_lines(Group(*parts), console.options, pad=False))
        shown = max(1, console.height - used - EVENTS_FRAME_LINES)
    parts.append(_events(view, shown))
    return Group(*parts)


def _engines(view: View) -> Table:
    table = Table(title="engines", title_justify="left", expand=False)
    for col in (
        "engine",
        "epoch",
        "worker pid",
        "shadow pid",
        "state",
        "requests",
        "held",
        "weights",
    ):
        table.add_column(col)
    procs = {p.name: p for p in view.supervisor.procs} if view.supervisor else {}
    for e in view.router.engines if view.router else []:
        shadow = procs.get(f"shadow-{e.id}")
        shadow_pid = str(shadow.pid) if shadow and shadow.alive else "-"
        state = e.state or ("up" if e.healthy else "down")
        table.add_row(e.id, str(e.epoch), str(e.worker_pid), shadow_pid, state,
                      str(e.running), str(e.holding), f"v{e.weight_version}")  # fmt: skip
    return table


def _rollouts(view: View) -> Text:
    """One line per rollout followed, the latest first (lines, not a table: an id stays whole
    on a narrow terminal)."""
    if not view.rollouts:
        return Text("rollouts: none seen yet")
    lines = ["rollouts:"]
    for rid, res in reversed(view.rollouts.items()):
        if res is None:
            lines.append(f"  {rid}: no answer from the controller")
            continue
        m = res.summary
        lines.append(
            f"  {rid} ({res.workload or '?'}) {res.state}: "
            f"{m.trajectories_completed}/{m.trajectories} trajectories done, {m.running} running, "
            f"{m.trajectories_failed} failed attempts, {m.env_restores} restores, "
            f"{m.restarts_from_scratch} from scratch, {m.checkpoints} checkpoints, "
            f"{m.engine_handovers} handovers"
        )
    return Text("\n".join(lines))


def _sandboxes(view: View) -> Table | Text:
    if view.sandboxes is None:
        return Text(
            "sandboxes: the environment service does not answer (or this identity may not list)"
        )
    table = Table(title="sandboxes", title_justify="left")
    for col in ("sandbox", "state", "trajectory", "ready prefix", "checkpoints"):
        table.add_column(col)
    for s in view.sandboxes.sandboxes[:10]:
        prefix = "-" if s.ready_prefix is None else str(s.ready_prefix)
        table.add_row(s.id, s.state, s.trajectory_id or "-", prefix, str(s.checkpoints))
    return table


def _events(view: View, shown: int = EVENTS_SHOWN) -> Table:
    table = Table(title="latest events", title_justify="left")
    for col in ("time", "event", "engine", "source"):
        table.add_column(col)
    for ev in list(reversed(view.events))[:shown]:
        stamp = time.strftime("%H:%M:%S", time.localtime(ev.ts))
        table.add_row(stamp, ev.kind, getattr(ev, "engine_id", "") or "-", ev.source or "-")
    return table


class _Keys:
    """``q`` on the terminal calls ``on_quit`` (a reader thread in cbreak mode); nothing when
    stdin is not a terminal."""

    def __init__(self, on_quit: Any) -> None:
        self.on_quit = on_quit
        self.saved: Any = None
        self.fd = sys.stdin.fileno() if sys.stdin.isatty() else -1

    def __enter__(self) -> _Keys:
        if self.fd >= 0:
            self.saved = termios.tcgetattr(self.fd)
            tty.setcbreak(self.fd)
            threading.Thread(target=self._read, name="top-keys", daemon=True).start()
        return self

    def _read(self) -> None:
        while True:
            try:
                ch = os.read(self.fd, 1)
            except OSError:
                return
            if not ch or ch in (b"q", b"Q"):
                self.on_quit()
                return

    def __exit__(self, *exc: object) -> None:
        if self.saved is not None:
            termios.tcsetattr(self.fd, termios.TCSADRAIN, self.saved)
