"""The invariants ``belayer soak`` checks on every history it kept (pure: no bus, no processes).

A soak's history is a JSONL file of typed records (``Record``): every request as submitted,
every delta a streaming caller was handed, every result or error, the fault-free reference of
every request, every fault injected (and when the node was whole again), every engine epoch
read from the ``engine_epochs`` bucket, the first step batch of every (engine, epoch, worker
pid) on ``belayer.router.tokens``, and what was left over at the end. ``check`` reads the
records back and returns each violation of:

- ``finished_once``: every accepted request ended with exactly one result (no error, no second
  result, no result of a request never submitted);
- ``reference``: its tokens equal the fault-free reference of the same request (same prompt,
  sampling and seed, run after the faults on the same node);
- ``stream``: a streaming request's deltas start at 0 and follow each other without a gap or
  an overlap (no token handed twice, none out of order) and add up to the result's tokens;
- ``epochs``: an engine's epoch only grows;
- ``split_brain``: no two worker pids streamed for one engine in one epoch;
- ``recovered``: the node was whole again after every fault;
- ``leftovers``: no process, ``/dev/shm`` file or container of the node is left at the end;
- ``trajectories``: every rollout ended done, and every slot of it was published exactly once
  (once: no slot twice; not zero: none lost);
- ``sandbox``: a restored sandbox holds what its checkpoint held, and no checkpoint the
  environment service acknowledged was lost (the restored prefix is at least the last one
  acknowledged before the failure);
- ``injected``: every fault of the schedule was injected (one the soak could not make —
  its target gone, the node's status unread — is this, not a failed recovery);
- with a training lane (``--train``), ``trained_once``, ``trained_published``,
  ``train_steps`` and ``train_lane`` (``bench/soak_train_check.py``).

``fault_table`` summarises the faults per kind: count, recovered, time until the faulted part
worked again and until the node was whole again (p50/p99), and the streaming requests that waited longer than ``SLOW_S`` for
their next token after a fault.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from bench.report import percentile
from bench.soak_train_check import (
    TRAIN_INVARIANTS,
    Trained,
    TrainerResumedSeen,
    TrainError,
    TrainLane,
    TrainLaneEnded,
    check_training,
)

INVARIANTS = (
    "finished_once", "reference", "stream", "epochs", "split_brain", "recovered", "leftovers",
    "trajectories", "sandbox", "injected", *TRAIN_INVARIANTS,
)  # fmt: skip
"""Every invariant ``check`` reports, in the order of the docstring."""
SLOW_S = 2.0
"""A streaming request whose next token came later than this after a fault is flagged."""


class Submitted(msgspec.Struct, tag="submitted", kw_only=True):
    """A request as the soak sent it."""

    rid: str
    t: float
    stream: bool
    prompt: str
    temperature: float
    seed: int | None
    max_tokens: int
    ignore_eos: bool = True
    top_p: float = 1.0


class Delta(msgspec.Struct, tag="delta", kw_only=True):
    """Tokens handed to a streaming caller (``start``: index of the first)."""

    rid: str
    t: float
    start: int
    tokens: list[int]


class Finished(msgspec.Struct, tag="finished", kw_only=True):
    """The request's result."""

    rid: str
    t: float
    tokens: list[int]
    finish_reason: str
    resumes: int = 0
    router_restarts: int = 0


class Errored(msgspec.Struct, tag="errored", kw_only=True):
    """The request ended with an error instead of a result."""

    rid: str
    t: float
    error: str


class Reference(msgspec.Struct, tag="reference", kw_only=True):
    """The fault-free run of request ``rid`` (or the error it got)."""

    rid: str
    tokens: list[int]
    error: str = ""


class Fault(msgspec.Struct, tag="fault", kw_only=True):
    """One fault of the schedule: ``back_t`` is when the faulted part worked again (the engine
    up under another worker, the process restarted), ``recovered_t`` when the whole node was
    (every process alive, every engine up, every shadow warm again); None: never.
    ``injected`` false: the soak could not make it (``detail`` says why)."""

    kind: str
    t: float
    target: str
    pid: int
    recovered_t: float | None = None
    back_t: float | None = None
    detail: str = ""
    injected: bool = True

    @property
    def made(self) -> bool:
        """The fault was injected (an older history marks one that was not in ``detail``
        only)."""
        return self.injected and not self.detail.startswith("could not be injected")


class EpochSeen(msgspec.Struct, tag="epoch", kw_only=True):
    """An engine's epoch as read from the ``engine_epochs`` bucket."""

    engine: str
    epoch: int
    t: float


class BatchSeen(msgspec.Struct, tag="batch", kw_only=True):
    """The first step batch seen from (engine, epoch, worker pid)."""

    engine: str
    epoch: int
    pid: int
    t: float


class Leftovers(msgspec.Struct, tag="leftovers", kw_only=True):
    """What the node left at the end (each a description)."""

    processes: list[str] = []
    shm: list[str] = []
    containers: list[str] = []


class RolloutSubmitted(msgspec.Struct, tag="rollout", kw_only=True):
    """A rollout the soak submitted through the controller (``slots``: trajectories it has)."""

    rid: str
    t: float
    workload: str
    slots: int


class TrajectorySeen(msgspec.Struct, tag="trajectory", kw_only=True):
    """A trajectory as read from TRAJECTORIES after its rollout was done (one per message)."""

    rollout: str
    trajectory_id: str
    slot: int
    attempt: int
    t: float


class RolloutEnded(msgspec.Struct, tag="rollout_end", kw_only=True):
    """The rollout was done (or ``error``: the soak could not follow it to the end)."""

    rid: str
    t: float
    completed: int = 0
    slots_failed: int = 0
    error: str = ""


class CheckpointAcked(msgspec.Struct, tag="checkpoint", kw_only=True):
    """The environment service acknowledged checkpoint ``prefix`` of the sandbox lane."""

    sandbox: str
    prefix: int
    checkpoint_id: str
    t: float


class SandboxBack(msgspec.Struct, tag="sandbox_back", kw_only=True):
    """The sandbox lane worked again after a failure: restored to ``prefix`` (0: a fresh
    sandbox), whose file reads ``content``; ``acked``: the last prefix acknowledged before."""

    sandbox: str
    prefix: int
    content: str
    acked: int
    t: float
    error: str = ""


Record = (
    Submitted
    | Delta
    | Finished
    | Errored
    | Reference
    | Fault
    | EpochSeen
    | BatchSeen
    | Leftovers
    | RolloutSubmitted
    | TrajectorySeen
    | RolloutEnded
    | CheckpointAcked
    | SandboxBack
    | TrainLane
    | Trained
    | TrainerResumedSeen
    | TrainError
    | TrainLaneEnded
)

_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(Record)


def dump(record: Record) -> bytes:
    """One JSONL line (newline included)."""
    return _ENCODER.encode(record) + b"\n"


def load(path: Path) -> list[Record]:
    """Every record of a history file, in order; a line that is not one raises ``ValueError``
    naming the line."""
    out: list[Record] = []
    with open(path, "rb") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(_DECODER.decode(line))
            except msgspec.DecodeError as exc:
                raise ValueError(f"{path}:{i}: not a soak record ({exc})") from None
    return out


@dataclass(frozen=True)
class Violation:
    """One broken invariant."""

    invariant: str
    subject: str
    """The request id, engine or fault it is about."""
    detail: str


@dataclass
class _Request:
    sub: Submitted | None = None
    deltas: list[Delta] = field(default_factory=list)
    results: list[Finished] = field(default_factory=list)
    errors: list[Errored] = field(default_factory=list)
    reference: Reference | None = None

    @property
    def end_t(self) -> float | None:
        ends = [r.t for r in self.results] + [e.t for e in self.errors]
        return min(ends) if ends else None


def _requests(records: Iterable[Record]) -> dict[str, _Request]:
    reqs: dict[str, _Request] = defaultdict(_Request)
    for r in records:
        if isinstance(r, Submitted):
            reqs[r.rid].sub = r
        elif isinstance(r, Delta):
            reqs[r.rid].deltas.append(r)
        elif isinstance(r, Finished):
            reqs[r.rid].results.append(r)
        elif isinstance(r, Errored):
            reqs[r.rid].errors.append(r)
        elif isinstance(r, Reference):
            reqs[r.rid].reference = r
    return dict(reqs)


def _check_request(rid: str, req: _Request) -> Iterator[Violation]:
    if req.sub is None:
        yield Violation("finished_once", rid, "a result or delta for a request never submitted")
        return
    for e in req.errors:
        yield Violation("finished_once", rid, f"ended with an error: {e.error}")
    if len(req.results) != 1:
        if not req.errors or req.results:
            yield Violation("finished_once", rid, f"{len(req.results)} results (expected 1)")
        return
    tokens = req.results[0].tokens
    ref = req.reference
    if ref is None:
        yield Violation("reference", rid, "no fault-free reference was computed")
    elif ref.error:
        yield Violation("reference", rid, f"the reference run failed: {ref.error}")
    elif ref.tokens != tokens:
        diff = next(
            (i for i, (a, b) in enumerate(zip(tokens, ref.tokens, strict=False)) if a != b),
            min(len(tokens), len(ref.tokens)),
        )
        yield Violation(
            "reference", rid,
            f"tokens differ from the reference at index {diff} "
            f"({len(tokens)} tokens vs {len(ref.tokens)})",
        )  # fmt: skip
    yield from _check_stream(rid, req.sub, req.deltas, tokens)


def _check_stream(
    rid: str, sub: Submitted, deltas: list[Delta], tokens: list[int]
) -> Iterator[Violation]:
    if not sub.stream:
        if deltas:
            yield Violation("stream", rid, f"{len(deltas)} deltas for a non-streaming request")
        return
    held: list[int] = []
    for d in deltas:
        if d.start != len(held):
            what = "overlap (a token handed twice)" if d.start < len(held) else "gap"
            yield Violation(
                "stream", rid, f"{what}: delta starts at {d.start} with {len(held)} tokens held"
            )
            return
        held += d.tokens
    if held != tokens:
        yield Violation(
            "stream", rid,
            f"the deltas ({len(held)} tokens) are not the result's tokens ({len(tokens)})",
        )  # fmt: skip


def _check_engines(records: list[Record]) -> Iterator[Violation]:
    last: dict[str, EpochSeen] = {}
    for r in sorted((r for r in records if isinstance(r, EpochSeen)), key=lambda r: r.t):
        prev = last.get(r.engine)
        if prev is not None and r.epoch < prev.epoch:
            yield Violation(
                "epochs", r.engine, f"epoch went back from {prev.epoch} to {r.epoch} at {r.t:.3f}"
            )
        if prev is None or r.epoch >= prev.epoch:
            last[r.engine] = r
    pids: dict[tuple[str, int], set[int]] = defaultdict(set)
    for b in records:
        if isinstance(b, BatchSeen):
            pids[(b.engine, b.epoch)].add(b.pid)
    for (engine, epoch), seen in sorted(pids.items()):
        if len(seen) > 1:
            yield Violation(
                "split_brain", engine,
                f"workers {sorted(seen)} all streamed in epoch {epoch}",
            )  # fmt: skip


def _check_rollouts(records: list[Record]) -> Iterator[Violation]:
    subs = {r.rid: r for r in records if isinstance(r, RolloutSubmitted)}
    ends = {r.rid: r for r in records if isinstance(r, RolloutEnded)}
    slots: dict[str, dict[int, list[str]]] = defaultdict(lambda: defaultdict(list))
    for t in records:
        if isinstance(t, TrajectorySeen):
            slots[t.rollout][t.slot].append(t.trajectory_id)
    for rid in sorted(set(slots) - set(subs)):
        yield Violation("trajectories", rid, "trajectories of a rollout never submitted")
    for rid, sub in sorted(subs.items()):
        end = ends.get(rid)
        if end is None or end.error:
            yield Violation("trajectories", rid, f"not done: {end.error if end else 'no end'}")
            continue
        seen = slots.get(rid, {})
        for slot, tids in sorted(seen.items()):
            if len(tids) > 1 or not 0 <= slot < sub.slots:
                yield Violation(
                    "trajectories", rid, f"slot {slot} published {len(tids)} times: {tids}"
                )
        if lost := sorted(set(range(sub.slots)) - set(seen)):
            yield Violation("trajectories", rid, f"slots {lost} never published")


def _check_sandbox(records: list[Record]) -> Iterator[Violation]:
    for b in records:
        if not isinstance(b, SandboxBack):
            continue
        if b.prefix < b.acked:
            yield Violation(
                "sandbox", b.sandbox,
                f"restored to prefix {b.prefix}, but {b.acked} was acknowledged ({b.error})",
            )  # fmt: skip
        if b.prefix and b.content != str(b.prefix):
            yield Violation(
                "sandbox", b.sandbox,
                f"restored to prefix {b.prefix}, its file reads {b.content!r}",
            )  # fmt: skip


def check(records: list[Record]) -> list[Violation]:
    """Every violation in the history ``records`` (empty: the soak passed)."""
    out: list[Violation] = []
    for rid, req in sorted(_requests(records).items()):
        out += _check_request(rid, req)
    out += _check_engines(records)
    out += _check_rollouts(records)
    out += _check_sandbox(records)
    for f in records:
        if isinstance(f, Fault) and not f.made:
            out.append(Violation("injected", f"{f.kind} {f.target}", f.detail))
        elif isinstance(f, Fault) and f.recovered_t is None:
            out.append(
                Violation("recovered", f"{f.kind} {f.target}", f"never recovered ({f.detail})")
            )
    published = {t.trajectory_id for t in records if isinstance(t, TrajectorySeen)}
    kills = [f.t for f in records if isinstance(f, Fault) and f.kind == "trainer-kill" and f.made]
    out += [Violation(*v) for v in check_training(records, published, kills)]
    for left in records:
        if isinstance(left, Leftovers):
            for what, items in (
                ("processes", left.processes),
                ("shm files", left.shm),
                ("containers", left.containers),
            ):
                if items:
                    out.append(Violation("leftovers", what, ", ".join(items)))
    return out


@dataclass(frozen=True)
class Slow:
    """A streaming request that waited longer than ``SLOW_S`` after a fault."""

    rid: str
    kind: str
    wait_s: float


def request_waits(records: list[Record]) -> list[Slow]:
    """For every fault and every streaming request in flight at its time: how long until the
    request's next token (or its end). All of them, slow or not."""
    reqs = [r for r in _requests(records).values() if r.sub is not None and r.sub.stream]
    out = []
    for f in records:
        if not isinstance(f, Fault) or not f.made:
            continue
        for req in reqs:
            assert req.sub is not None
            end = req.end_t
            if req.sub.t >= f.t or (end is not None and end <= f.t):
                continue
            after = [d.t for d in req.deltas if d.t > f.t]
            nxt = min(after) if after else end
            if nxt is not None:
                out.append(Slow(req.sub.rid, f.kind, nxt - f.t))
    return out


@dataclass(frozen=True)
class KindRow:
    """One fault kind's line of the soak's table."""

    kind: str
    count: int
    """Faults of the kind in the schedule (injected or not)."""
    recovered: int
    recover_p50_s: float | None
    """Fault → the node whole again."""
    recover_p99_s: float | None
    back_p50_s: float | None
    """Fault → the faulted part working again."""
    back_p99_s: float | None
    requests_hit: int
    """Streaming requests in flight at a fault of this kind."""
    slow: int
    """… of which waited longer than ``SLOW_S`` for their next token."""
    wait_max_s: float | None
    not_injected: int = 0
    """… of ``count``: faults the soak could not make (not counted as failed recoveries)."""


def fault_table(records: list[Record]) -> list[KindRow]:
    """Per fault kind (in order of first appearance): count, recovered, time to recover."""
    faults: dict[str, list[Fault]] = {}
    for r in records:
        if isinstance(r, Fault):
            faults.setdefault(r.kind, []).append(r)
    waits: dict[str, list[float]] = defaultdict(list)
    for w in request_waits(records):
        waits[w.kind].append(w.wait_s)
    rows = []
    for kind, fs in faults.items():
        times = [f.recovered_t - f.t for f in fs if f.recovered_t is not None]
        back = [f.back_t - f.t for f in fs if f.back_t is not None]
        ws = waits.get(kind, [])
        rows.append(
            KindRow(
                kind=kind,
                count=len(fs),
                recovered=len(times),
                recover_p50_s=percentile(times, 50),
                recover_p99_s=percentile(times, 99),
                back_p50_s=percentile(back, 50),
                back_p99_s=percentile(back, 99),
                requests_hit=len(ws),
                slow=sum(w > SLOW_S for w in ws),
                wait_max_s=max(ws) if ws else None,
                not_injected=sum(not f.made for f in fs),
            )
        )
    return rows
