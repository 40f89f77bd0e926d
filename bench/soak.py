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
import os
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
from bench import soak_faults as sf
from bench import soak_node as sn
from bench import soak_train as st
from bench import soak_work as sw
from bench.report import progress as report_progress
from bench.report import write_json
from bench.soak_cluster import NatsFaults, local_servers
from bench.soak_report import report
from common import subjects
from common.bus import connect
from common.codec import decode
from common.config import RunPaths
from common.epoch import current_epoch
from common.errors import BelayerError, InvalidRequest
from common.events import EventTail
from common.node import NodeInfo, resolve_bus
from schemas.serving import GenerateRequest, SamplingParams, StepBatch
from services.rl.node import NodeHandle, launch, running_node, shut_down
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
REFERENCE_CONCURRENCY = 8
WORKLOADS = ("serve", "math", "swe")
"""serve: generate requests; math, swe: also rollouts through the controller (swe: and a
sandbox lane, the sandbox faults' target)."""


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
    train: bool = False
    """A training lane (``bench/soak_train.py``) instead of the rollout lane (math, swe)."""
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


async def _prepare(
    nc: Any, node: NodeInfo, opts: SoakOptions, events: Any, bus: Any
) -> tuple[sn.Target, tuple[str, ...], NatsFaults | None]:
    """The target (the node as found), the kinds to inject and, on a cluster with servers on
    this machine, the hands on those; refuses kinds it does not take."""
    v = await sn.view(nc)
    if v is None:
        raise BelayerError("the node's supervisor or router does not answer")
    names = frozenset(n for n, (_pid, alive) in v.procs.items() if alive)
    if opts.workload != "serve" and "controller" not in names:
        raise InvalidRequest(f"--workload {opts.workload}: the node runs no controller")
    if opts.workload == "swe" and "environment" not in names:
        raise InvalidRequest(
            "--workload swe: the node runs no environment service (belayer up --env)"
        )
    if opts.train and "trainer" not in names:
        raise InvalidRequest("--train: the node runs no trainer (belayer up --training)")
    servers = local_servers(node.nats_url)
    available = sn.kinds_for(
        set(names), node.recovery, sandboxes=opts.workload == "swe", cluster=bool(servers)
    )
    kinds = opts.kinds or available
    if missing := [k for k in kinds if k not in available]:
        raise InvalidRequest(
            f"this node takes no {', '.join(missing)} (it takes {', '.join(available)})"
        )
    target = sn.Target(
        names=names, engines=tuple(sorted(v.engines)), shadows=node.recovery == "belayer",
        events=events,
    )  # fmt: skip
    return target, kinds, NatsFaults(servers, bus) if servers else None


def work_lanes(
    nc: Any,
    events: Any,
    node: NodeHandle,
    opts: SoakOptions,
    tag: str,
    stop: asyncio.Event,
    history: History,
) -> list[asyncio.Task[int]]:
    """The lane beyond generate requests: rollouts (math, swe), or with ``--train`` RL steps
    (the trainer trains every published trajectory: the two lanes would feed one trainer)."""
    if opts.workload == "serve":
        return []
    if not opts.train:
        return [
            asyncio.create_task(sw.rollout_lane(nc, opts.workload, tag, opts.seed, stop, history))
        ]
    lane = st.TrainLane(
        nc,
        events,
        node,
        opts.workload,
        opts.seed,
        history,
        checkpoint_dir=node.paths.root / "trainer" if node.ours else None,
        deterministic=node.ours and SupervisorConfig().worker.engine.deterministic,
    )
    return [asyncio.create_task(lane.run(stop))]


async def soak_node(
    node: NodeInfo, paths: RunPaths, opts: SoakOptions, history: History, *, ours: bool = False
) -> dict[str, Any]:
    """Load, faults, references on the node (``ours``: the soak started it); what the report
    needs of the run."""
    url, bus = resolve_bus(None, role="operator", paths=paths)
    nc = await connect(url, name="soak", bus=bus, timeout=5.0)
    events = await EventTail(nc).start()
    target: sn.Target | None = None
    try:
        target, kinds, nats = await _prepare(nc, node, opts, events, bus)
        engines = target.engines
        progress(f"node {node.run_id}: engines {', '.join(engines)}; faults: {', '.join(kinds)}")
        shm_before = sn.shm_files(node.run_id)
        for e in engines:  # the epochs as they stand, before any fault
            history.write(
                sc.EpochSeen(
                    engine=e, epoch=(await current_epoch(nc.jetstream(), e))[0], t=time.time()
                )
            )
        sub = await watch_batches(nc, history)
        viewer = sf.Viewer(nc)
        stop = asyncio.Event()
        tag = uuid.uuid4().hex[:6]
        box = sw.SandboxLane(nc, paths.root, history) if opts.workload == "swe" else None
        background = [asyncio.create_task(watch_epochs(nc, engines, history)),
                      asyncio.create_task(viewer.run())]  # fmt: skip
        lanes = [
            asyncio.create_task(lane(nc, i, tag, opts.seed, stop, history))
            for i in range(opts.concurrency)
        ]
        work = work_lanes(nc, events, NodeHandle(paths, node, ours), opts, tag, stop, history)
        if box is not None:
            work.append(asyncio.create_task(box.run(stop)))
        t0 = time.time()
        try:
            plan = list(schedule(kinds, opts.faults, engines, opts.seed))
            schedule_ = sf.Schedule(target, viewer, box, history, nats)
            faults = await schedule_.run(plan, opts.duration_s)
            await asyncio.sleep(
                max(0.0, t0 + opts.duration_s - time.time())
            )  # the load runs its time
            stop.set()
            sent = sum(await asyncio.gather(*lanes))  # each lane finishes its request
            done = await asyncio.gather(*work)
        finally:
            for task in (*lanes, *work, *background):  # interrupted: nothing keeps running
                task.cancel()
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        load_s = time.time() - t0
        what = "train steps" if opts.train else "rollouts"
        progress(
            f"{sent} requests, {done[0] if done and opts.workload != 'serve' else 0} {what} in {load_s:.0f} s; fault-free references of each request"
        )
        await references(nc, history)
        return {"run_id": node.run_id, "engines": list(engines), "kinds": list(kinds), "requests": sent,
                "load_s": load_s, "faults_injected": len(faults), "shm_before": sorted(shm_before)}  # fmt: skip
    finally:
        if target is not None:
            target.resume_stopped()
        await events.stop()
        await nc.drain()


def soak_config(paths: RunPaths, opts: SoakOptions) -> SupervisorConfig:
    """The node a soak starts: the defaults, ``opts.engines`` engines, the environment service
    with ``--workload swe``, the trainer with ``--train`` (``bench/soak_train.py``'s, its
    checkpoints under ``<run dir>/trainer``), no engine retired for failing twice in a row and
    no crash-loop backoff (a service restarted after ``restart_backoff_s`` however soon it is
    killed again): the soak's faults are not a sick machine's. Under the default backoff a
    service the schedule kills again within ``stable_after_s`` of its start waits up to
    ``restart_backoff_max_s`` before its restart, and the soak would time that policy, not the
    recovery."""
    d = SupervisorConfig()
    return dataclasses.replace(
        d,
        restart_backoff_max_s=d.restart_backoff_s,
        run_dir=str(paths.root),
        owner_pid=os.getpid(),  # a SIGKILLed soak leaves no node behind
        engines=opts.engines,
        environment=opts.workload == "swe",
        training=opts.train,
        trainer=st.trainer_config(paths.root / "trainer", opts.seed) if opts.train else d.trainer,
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
    if opts.workload not in WORKLOADS:
        raise InvalidRequest(f"--workload {opts.workload}: unknown (one of {', '.join(WORKLOADS)})")
    if unknown := [k for k in opts.kinds if k not in sn.ALL_KINDS]:
        raise InvalidRequest(
            f"unknown fault kind {', '.join(unknown)} (kinds: {', '.join(sn.ALL_KINDS)})"
        )
    if opts.train and opts.workload == "serve":
        raise InvalidRequest("--train trains on rollouts: give --workload math or swe")
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
        info = asyncio.run(
            _cancel_on_sigterm(soak_node(node, paths, opts, history, ours=tmp is not None))
        )
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
