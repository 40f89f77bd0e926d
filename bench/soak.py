"""``belayer soak``: faults of every kind under a mixed load, invariants checked on every history.

On a running node (the run directory's) or one started for the soak (a temporary run
directory, stopped at the end): ``concurrency`` lanes send requests back to back through the
router client — streaming and not, greedy and seeded-sampled (temperature 1, some with top-p),
of varied lengths — while a seeded schedule injects ``faults`` faults spread over
``duration_s`` (``bench/soak_node.py``: worker SIGKILL and SIGSTOP, shadow, router and the other
supervised services' SIGKILL). Before each fault the node is whole (every process alive, every
engine up under its main worker, every shadow warm); after it the soak waits until it is whole
again and the faulted process is gone: the time to recover. Meanwhile it records the first step
batch of every (engine, epoch, worker) on ``belayer.router.tokens`` and every epoch of the
``engine_epochs`` bucket. After the faults the load stops, every request is run again without
faults (its reference: same prompt, sampling and seed, another request id), the node is stopped
if the soak started it, and what it left is looked for. Everything goes to the history (JSONL,
``bench/soak_check.py``'s records), which ``check`` then reads back; the table per fault kind
and the verdict are printed, the result written as JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import shutil
import signal
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import soak_check as sc
from bench import soak_node as sn
from bench.report import Row, machine_info, print_table, timestamp, write_json
from bench.report import progress as report_progress
from common import subjects
from common.bus import connect
from common.codec import decode
from common.config import RunPaths
from common.epoch import current_epoch
from common.errors import BelayerError, InvalidRequest
from common.events import EventTail
from common.node import NodeInfo, resolve_bus
from schemas.serving import GenerateRequest, SamplingParams, StepBatch
from services.rl.node import launch, running_node, shut_down
from services.router.client import generate
from services.supervisor.client import SupervisorConfig

LENGTHS = (8, 24, 64, 160, 320)
"""``max_tokens`` of the requests (drawn uniformly; ``ignore_eos``: exactly this many)."""
WORDS = (
    "the quick brown fox jumps over a lazy dog while seven wizards quietly judge "
    "boxing matches of rust and python under grey winter skies near old harbours"
).split()
REQUEST_TIMEOUT_S = 180.0
"""A request not finished this long after its submission counts as lost."""
RECOVER_TIMEOUT_S = 60.0
"""A node not whole again this long after a fault did not recover."""
REFERENCE_CONCURRENCY = 8


def progress(message: str) -> None:
    report_progress("soak", message)


@dataclass(frozen=True)
class SoakOptions:
    """What ``belayer soak`` was asked for."""

    faults: int = 20
    duration_s: float = 120.0
    kinds: tuple[str, ...] = ()
    """Fault kinds to inject (empty: every kind the node takes)."""
    seed: int = 0
    workload: str = "serve"
    engines: int = 1
    """Engines of a node the soak starts."""
    concurrency: int = 4
    run_dir: Path | None = None
    """The running node's run directory (None: ``$BELAYER_HOME`` or ``./.belayer``)."""
    out: Path = Path("bench-results/soak.json")
    history: Path | None = None
    """The history file (default: next to ``out``, ``<stem>-history.jsonl``)."""

    @property
    def history_path(self) -> Path:
        return self.history or self.out.with_name(f"{self.out.stem}-history.jsonl")


class History:
    """The soak's JSONL history, written as things happen (line-buffered)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._f = open(path, "wb", buffering=0)  # closed by close()
        self.submitted: list[sc.Submitted] = []
        self.faults: list[sc.Fault] = []

    def write(self, record: sc.Record) -> None:
        if isinstance(record, sc.Submitted):
            self.submitted.append(record)
        elif isinstance(record, sc.Fault):
            self.faults.append(record)
        self._f.write(sc.dump(record))

    def close(self) -> None:
        self._f.close()


def schedule(
    kinds: tuple[str, ...], n: int, engines: tuple[str, ...], seed: int
) -> Iterator[tuple[str, str]]:
    """``n`` (kind, engine) pairs: every kind in turn, shuffled per round, engines drawn."""
    rng = random.Random(f"soak-faults-{seed}")
    done = 0
    while done < n:
        round_ = list(kinds)
        rng.shuffle(round_)
        for kind in round_[: n - done]:
            yield kind, rng.choice(engines)
            done += 1


def make_request(rng: random.Random, rid: str) -> sc.Submitted:
    """One request of the mixed load."""
    sampled = rng.random() < 0.5
    return sc.Submitted(
        rid=rid,
        t=time.time(),
        stream=rng.random() < 0.5,
        prompt=" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 24))),
        temperature=1.0 if sampled else 0.0,
        top_p=rng.choice((1.0, 0.9)) if sampled else 1.0,
        seed=rng.randrange(1, 2**31) if sampled else None,
        max_tokens=rng.choice(LENGTHS),
    )


def wire(s: sc.Submitted, rid: str | None = None, *, stream: bool | None = None) -> GenerateRequest:
    return GenerateRequest(
        request_id=rid or s.rid,
        prompt=s.prompt,
        stream=s.stream if stream is None else stream,
        sampling=SamplingParams(
            temperature=s.temperature, top_p=s.top_p, seed=s.seed, max_tokens=s.max_tokens,
            ignore_eos=s.ignore_eos,
        ),
    )  # fmt: skip


async def lane(nc: Any, n: int, tag: str, seed: int, stop: asyncio.Event, history: History) -> int:
    """Requests back to back until ``stop``; how many it sent."""
    rng = random.Random(f"soak-load-{seed}-{n}")
    i = 0
    while not stop.is_set():
        s = make_request(rng, f"soak-{tag}-{n}-{i}")
        i += 1
        history.write(s)

        def on_delta(d: Any, rid: str = s.rid) -> None:
            history.write(sc.Delta(rid=rid, t=time.time(), start=d.start, tokens=list(d.token_ids)))

        try:
            res = await generate(
                nc, wire(s), timeout=REQUEST_TIMEOUT_S, on_delta=on_delta if s.stream else None
            )
        except BelayerError as exc:
            history.write(sc.Errored(rid=s.rid, t=time.time(), error=f"{exc.code}: {exc}"))
            continue
        history.write(
            sc.Finished(
                rid=s.rid, t=time.time(), tokens=list(res.token_ids),
                finish_reason=res.finish_reason, resumes=res.resumes,
                router_restarts=res.router_restarts,
            )
        )  # fmt: skip
    return i


async def watch_batches(nc: Any, history: History) -> Any:
    """Record the first step batch of every (engine, epoch, worker pid); the subscription."""
    seen: set[tuple[str, int, int]] = set()

    async def cb(msg: Any) -> None:
        try:
            b = decode(msg.data, StepBatch)
        except BelayerError:
            return
        key = (b.engine_id, b.epoch, b.worker_pid)
        if key not in seen:
            seen.add(key)
            history.write(sc.BatchSeen(engine=key[0], epoch=key[1], pid=key[2], t=time.time()))

    return await nc.subscribe(subjects.router_tokens(), cb=cb)


async def watch_epochs(nc: Any, engines: tuple[str, ...], history: History) -> None:
    """Record every change of an engine's epoch in ``engine_epochs`` (read every 0.1 s)."""
    js = nc.jetstream()
    last: dict[str, int] = {}
    while True:
        for e in engines:
            with contextlib.suppress(BelayerError, asyncio.TimeoutError, Exception):
                epoch, _ = await current_epoch(js, e)
                if last.get(e) != epoch:
                    last[e] = epoch
                    history.write(sc.EpochSeen(engine=e, epoch=epoch, t=time.time()))
        await asyncio.sleep(0.1)  # a bounded poll of the bucket, not synchronisation


async def inject_all(
    nc: Any, target: sn.Target, opts: SoakOptions, kinds: tuple[str, ...], history: History
) -> list[sc.Fault]:
    """The schedule: fault i no sooner than i × duration / faults, the node whole before it."""
    t0 = time.monotonic()
    interval = opts.duration_s / max(1, opts.faults)
    out = []
    plan = schedule(kinds, opts.faults, target.engines, opts.seed)
    for i, (kind, engine) in enumerate(plan):
        await asyncio.sleep(max(0.0, t0 + i * interval - time.monotonic()))  # the pacing
        if await target.wait_whole(nc, timeout=RECOVER_TIMEOUT_S) is None:
            progress(f"fault {i + 1}: the node is not whole; injecting anyway")
        inj = await target.inject(nc, kind, engine)
        back = await target.wait_back(nc, inj, timeout=RECOVER_TIMEOUT_S)
        whole = await target.wait_whole(nc, gone=inj.pid, timeout=RECOVER_TIMEOUT_S)
        fault = sc.Fault(
            kind=kind, t=inj.t, target=inj.target, pid=inj.pid, recovered_t=whole, back_t=back,
            detail="" if whole else f"not whole {RECOVER_TIMEOUT_S:g} s after the fault",
        )  # fmt: skip
        history.write(fault)
        out.append(fault)
        if whole is None and (v := await sn.view(nc)) is not None and v.retired:
            progress(
                f"engine {', '.join(v.retired)} retired as unhealthy (a node of your own needs "
                "`belayer up --failure-window 0`): no more faults"
            )
            break
        took = (
            f"back in {back - inj.t:.2f} s, whole in {whole - inj.t:.2f} s"
            if back and whole
            else "NOT recovered"
        )
        progress(f"fault {i + 1}/{opts.faults}: {kind} {inj.target} (pid {inj.pid}): {took}")
    return out


async def references(nc: Any, history: History) -> None:
    """Every request again, alone in its slot of a fault-free node, non-streaming."""
    sem = asyncio.Semaphore(REFERENCE_CONCURRENCY)

    async def one(s: sc.Submitted) -> None:
        async with sem:
            try:
                res = await generate(
                    nc, wire(s, f"{s.rid}-ref", stream=False), timeout=REQUEST_TIMEOUT_S
                )
                history.write(sc.Reference(rid=s.rid, tokens=list(res.token_ids)))
            except BelayerError as exc:
                history.write(sc.Reference(rid=s.rid, tokens=[], error=f"{exc.code}: {exc}"))

    await asyncio.gather(*(one(s) for s in list(history.submitted)))


async def soak_node(
    node: NodeInfo, paths: RunPaths, opts: SoakOptions, history: History
) -> dict[str, Any]:
    """Load, faults, references on the node; what the report needs of the run."""
    url, bus = resolve_bus(None, role="operator", paths=paths)
    nc = await connect(url, name="soak", bus=bus, timeout=5.0)
    events = await EventTail(nc).start()
    target: sn.Target | None = None
    try:
        v = await sn.view(nc)
        if v is None:
            raise BelayerError("the node's supervisor or router does not answer")
        engines = tuple(sorted(v.engines))
        names = frozenset(n for n, (_pid, alive) in v.procs.items() if alive)
        available = sn.kinds_for(set(names), node.recovery)
        kinds = opts.kinds or available
        if missing := [k for k in kinds if k not in available]:
            raise InvalidRequest(
                f"this node takes no {', '.join(missing)} (it takes {', '.join(available)})"
            )
        target = sn.Target(
            names=names, engines=engines, shadows=node.recovery == "belayer", events=events
        )
        progress(f"node {node.run_id}: engines {', '.join(engines)}; faults: {', '.join(kinds)}")
        shm_before = sn.shm_files(node.run_id)
        for e in engines:  # the epochs as they stand, before any fault
            history.write(
                sc.EpochSeen(
                    engine=e, epoch=(await current_epoch(nc.jetstream(), e))[0], t=time.time()
                )
            )
        sub = await watch_batches(nc, history)
        epochs = asyncio.create_task(watch_epochs(nc, engines, history))
        stop = asyncio.Event()
        tag = uuid.uuid4().hex[:6]
        lanes = [
            asyncio.create_task(lane(nc, i, tag, opts.seed, stop, history))
            for i in range(opts.concurrency)
        ]
        t0 = time.time()
        try:
            faults = await inject_all(nc, target, opts, kinds, history)
            await asyncio.sleep(
                max(0.0, t0 + opts.duration_s - time.time())
            )  # the load runs its time
            stop.set()
            sent = sum(await asyncio.gather(*lanes))  # each lane finishes its request
        finally:
            for task in (*lanes, epochs):  # interrupted: nothing of the soak keeps running
                task.cancel()
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        load_s = time.time() - t0
        progress(f"{sent} requests in {load_s:.0f} s; fault-free references of each")
        await references(nc, history)
        return {"run_id": node.run_id, "engines": list(engines), "kinds": list(kinds), "requests": sent,
                "load_s": load_s, "faults_injected": len(faults), "shm_before": sorted(shm_before)}  # fmt: skip
    finally:
        if target is not None:
            target.resume_stopped()
        await events.stop()
        await nc.drain()


def soak_config(paths: RunPaths, opts: SoakOptions) -> SupervisorConfig:
    """The node a soak starts: the defaults, ``opts.engines`` engines, no sandboxes, no
    trainer, and no engine retired for failing twice in a row (the soak's faults are not a
    sick machine's)."""
    d = SupervisorConfig()
    return dataclasses.replace(
        d,
        run_dir=str(paths.root),
        engines=opts.engines,
        environment=False,
        training=False,
        router=dataclasses.replace(d.router, failure_window_s=0.0),
    )


async def _cancel_on_sigterm(coro: Any) -> Any:
    """Run ``coro``; SIGTERM cancels it (its ``finally`` blocks stop what it started)."""
    task = asyncio.ensure_future(coro)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, task.cancel)
    try:
        return await task
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(_sig: int, _frame: Any) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM as Ctrl-C while the soak runs: what it started is stopped either way."""
    before = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def _leftovers(
    node: NodeInfo, stopped: bool, shm_before: set[str], history: History
) -> sc.Leftovers:
    faulted = {f.pid for f in history.faults}
    return sc.Leftovers(
        processes=sn.orphans(node.run_id, None if stopped else node.supervisor_pid, faulted),
        shm=sn.leftover_shm(node.run_id, shm_before, stopped=stopped),
        containers=sn.leftover_containers(node.run_id) if stopped else [],
    )


def check_options(opts: SoakOptions) -> None:
    """What no node is needed to refuse (``InvalidRequest``: one line, exit 2)."""
    if opts.workload != "serve":
        raise InvalidRequest(
            f"--workload {opts.workload}: only the serve workload is implemented so far "
            "(math and swe rollouts are not driven yet)"
        )
    if unknown := [k for k in opts.kinds if k not in sn.ALL_KINDS]:
        raise InvalidRequest(
            f"unknown fault kind {', '.join(unknown)} (kinds: {', '.join(sn.ALL_KINDS)})"
        )
    if opts.faults < 1 or opts.duration_s <= 0 or opts.concurrency < 1 or opts.engines < 1:
        raise InvalidRequest("--faults, --duration, --concurrency and --engines must be positive")


def main(opts: SoakOptions, *, say: Callable[[str], None] = progress) -> dict[str, Any]:
    """The soak: find or start the node, load and faults, references, stop, check, report.
    SIGTERM or Ctrl-C stops it (and the node it started) and raises ``KeyboardInterrupt``."""
    check_options(opts)
    with _sigterm_interrupts():
        return _main(opts, say)


def _main(opts: SoakOptions, say: Callable[[str], None]) -> dict[str, Any]:
    from services.rl.run import run_paths

    paths = run_paths(opts.run_dir)
    node = running_node(paths)
    tmp: Path | None = None
    if node is None:
        tmp = Path(tempfile.mkdtemp(prefix="belayer-soak-"))
        paths = RunPaths(tmp / "node")
        say(
            f"no node runs from {run_paths(opts.run_dir).root}: starting one ({opts.engines} engine(s)) in {paths.root}"
        )
        try:
            node = launch(soak_config(paths, opts), paths, timeout=240.0)
        except BaseException:
            shut_down(paths, timeout=30.0)
            raise
    history = History(opts.history_path)
    info: dict[str, Any] = {}
    shm_before = sn.shm_files(node.run_id) if tmp is None else set()
    interrupted = False
    try:
        info = asyncio.run(_cancel_on_sigterm(soak_node(node, paths, opts, history)))
    except (asyncio.CancelledError, KeyboardInterrupt):
        interrupted = True
    finally:
        if tmp is not None:
            say("stopping the soak's node")
            shut_down(paths, timeout=60.0)
        history.write(_leftovers(node, tmp is not None, shm_before, history))
        history.close()
    if interrupted:  # stopped by the user: the node it started and that node's directory
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise KeyboardInterrupt
    result = report(opts, sc.load(history.path), info)
    if tmp is not None and result["verdict"] == "PASS":
        shutil.rmtree(tmp, ignore_errors=True)
    elif tmp is not None:
        say(f"the node's logs are kept in {paths.logs}")
    say(f"history in {history.path}; wrote {write_json(opts.out, result)}")
    return result


def recheck(history: Path, opts: SoakOptions) -> dict[str, Any]:
    """Check a history kept by an earlier soak again (no node needed); the JSON result, also
    written to ``opts.out``."""
    try:
        records = sc.load(history)
    except OSError as exc:
        raise InvalidRequest(f"cannot read the history {history}: {exc.strerror}") from None
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    result = report(dataclasses.replace(opts, history=history), records, {})
    progress(f"wrote {write_json(opts.out, result)}")
    return result


def report(opts: SoakOptions, records: list[sc.Record], info: dict[str, Any]) -> dict[str, Any]:
    """Check the history, print the table per fault kind and the verdict; the JSON result."""
    violations = sc.check(records)
    rows = sc.fault_table(records)
    slow = [w for w in sc.request_waits(records) if w.wait_s > sc.SLOW_S]
    finished = [r for r in records if isinstance(r, sc.Finished)]
    kinds = info.get("kinds", [])
    not_fired = [k for k in kinds if k not in {r.kind for r in rows}]
    verdict = "PASS" if not violations and not not_fired and finished else "FAIL"
    result: dict[str, Any] = {
        "bench": "soak",
        "timestamp": timestamp(),
        "options": {
            k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(opts).items()
        },
        "node": {k: v for k, v in info.items() if k != "shm_before"},
        "machine": machine_info(),
        "requests": len([r for r in records if isinstance(r, sc.Submitted)]),
        "finished": len(finished),
        "tokens": sum(len(r.tokens) for r in finished),
        "faults": [dataclasses.asdict(r) for r in rows],
        "kinds_not_fired": not_fired,
        "slow_requests": [dataclasses.asdict(w) for w in slow],
        "violations": [dataclasses.asdict(v) for v in violations],
        "verdict": verdict,
        "history": str(opts.history_path),
    }
    print_kinds(rows)
    by: dict[str, int] = {}
    for v in violations:
        by[v.invariant] = by.get(v.invariant, 0) + 1
    summary = [
        Row("requests (finished)", f"{result['requests']} ({result['finished']})"),
        Row("tokens delivered", str(result["tokens"])),
        Row(f"requests waiting > {sc.SLOW_S:g} s after a fault (flagged)", str(len(slow))),
        *(Row(f"violations: {name}", str(by.get(name, 0)), "0", "PASS" if not by.get(name) else "MISS")
          for name in sc.INVARIANTS),
        Row("fault kinds that did not fire", ", ".join(not_fired) or "none", "none",
            "PASS" if not not_fired else "MISS"),
        Row("verdict", verdict, "", verdict if verdict == "PASS" else "MISS"),
    ]  # fmt: skip
    print_table("belayer soak", summary)
    for v in violations[:20]:
        progress(f"violation {v.invariant} [{v.subject}]: {v.detail}")
    return result


def _s(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def print_kinds(rows: list[sc.KindRow]) -> None:
    """The table per fault kind (rich) on stdout."""
    import sys

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"faults (slow: a stream waited > {sc.SLOW_S:g} s for its next token)")
    heads = ("kind", "n", "recovered", "back p50 s", "back p99 s", "whole p50 s",
             "whole p99 s", "hit", "slow", "max wait s")  # fmt: skip
    for col in heads:
        table.add_column(
            col, justify="left" if col == "kind" else "right", no_wrap=col in ("kind", "recovered")
        )
    for r in rows:
        table.add_row(
            r.kind, str(r.count), str(r.recovered), _s(r.back_p50_s), _s(r.back_p99_s),
            _s(r.recover_p50_s), _s(r.recover_p99_s), str(r.requests_hit), str(r.slow),
            _s(r.wait_max_s),
        )  # fmt: skip
    width = max(100, shutil.get_terminal_size((100, 24)).columns)  # ten columns: not squeezed
    Console(file=sys.stdout, width=width).print(table)
