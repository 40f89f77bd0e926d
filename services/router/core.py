"""The router's state machine: pure and synchronous, no NATS. ``service.py`` feeds it inputs
(requests, step batches, registrations, failures) and executes the actions it returns.

Invariants it maintains:
- a request is assigned to at most one engine at a time and only output from that engine's
  *current epoch* is accepted (no split brain);
- the caller gets each token exactly once, in order (``TokenDelta.start`` is contiguous);
- a resume hands the new worker prompt + every token already held (token-level recovery), so
  nothing is regenerated — except in ``baseline`` mode, which restarts from the prompt and
  counts the regenerated tokens;
- every k tokens the held tokens are persisted as a ``TokenLogChunk`` with a deterministic id.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from common.errors import Conflict, EngineUnavailable, NotFound
from schemas import events as ev
from schemas.serving import (
    EngineInfo,
    EngineRequest,
    GenerateResult,
    HeldRequest,
    RequestPhase,
    SamplingParams,
    SeqDelta,
    StepBatch,
    TokenDelta,
    TokenLogChunk,
)
from services.router import watchdog
from services.router.config import RouterConfig
from services.router.placement import place
from services.router.state import (
    AbortOnEngine,
    Action,
    EmitEvent,
    EngineState,
    EngineStatus,
    PersistChunk,
    RequestState,
    SendToCaller,
    SubmitToEngine,
    check_limits,
    request_identity,
)

RECOVERABLE_REASONS = frozenset({"submit failed"})
"""Failures only the router suspected (a late acknowledgement; see ``_suspected``), withdrawn if
the worker still answers pings. The shadow's, the supervisor's reports are final."""


class RouterCore:
    """All routing decisions. ``now`` is injected so tests control time."""

    def __init__(
        self, config: RouterConfig, decode: Callable[[list[int]], str], *, router_id: str = ""
    ) -> None:
        self.config = config
        self.decode = decode
        self.router_id = router_id
        """This router process's incarnation, stamped on everything sent to callers."""
        self.engines: dict[str, EngineState] = {}
        self.active: dict[str, RequestState] = {}
        self.pending: list[str] = []
        """Requests waiting for any healthy engine."""
        self.finished: OrderedDict[str, GenerateResult] = OrderedDict()
        self.finished_identity: dict[str, str] = {}
        """``request_identity`` of each finished request kept for replay."""
        self.regenerated_tokens = 0
        self.counters: dict[str, int] = dict.fromkeys(
            ("tokens", "requests", "resumes", "adopted", "stale_batches", "engine_failures"), 0
        )
        self.hold_pending = False
        """While True (a restarted router adopting live requests), pending requests wait."""

    # --- requests ---------------------------------------------------------------------------
    def validate(
        self, prompt_ids: list[int], sampling: SamplingParams, engine_id: str | None
    ) -> None:
        """Reject requests that can never run (raises a typed error naming the problem)."""
        check_limits(self.config, prompt_ids, sampling)
        if engine_id is not None:
            eng = self.engines.get(engine_id)
            if eng is None:
                raise NotFound("unknown engine", engine_id=engine_id)
            if eng.status is EngineStatus.UNHEALTHY:
                raise EngineUnavailable("engine is marked unhealthy", engine_id=engine_id)

    def submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        *,
        inbox: str | None,
        stream: bool = True,
        engine_id: str | None = None,
        identity: str | None = None,
    ) -> list[Action]:
        """A caller's request. A known id is never generated twice: the caller is attached to
        the running request (with a catch-up delta) or handed the finished result. A known id
        whose request differs (``identity``: prompt and sampling as the caller sent them;
        default: computed from ``prompt_ids`` and ``sampling``) is ``conflict``."""
        identity = identity or request_identity(prompt_ids, sampling)
        known = self.finished_identity.get(request_id)
        if known is None and request_id in self.active:
            known = self.active[request_id].identity
        if known and known != identity:
            raise Conflict(
                "request id reused with a different request (prompt or sampling)",
                request_id=request_id,
                field="$.request_id",
            )
        done = self.finished.get(request_id)
        if done is not None:
            return [SendToCaller(inbox, done)] if inbox else []
        req = self.active.get(request_id)
        if req is not None:
            actions: list[Action] = []
            if inbox:
                req.subscribers[inbox] = stream
                if stream and req.tokens:
                    actions.append(SendToCaller(inbox, self._delta(req, 0, len(req.tokens))))
            return actions
        self.validate(prompt_ids, sampling, engine_id)
        self.counters["requests"] += 1
        req = RequestState(
            request_id, list(prompt_ids), sampling, pinned_engine=engine_id, identity=identity
        )
        if inbox:
            req.subscribers[inbox] = stream
        self.active[request_id] = req
        return self._place([req])

    def cancel(self, request_id: str) -> list[Action]:
        req = self.active.get(request_id)
        if req is None:
            if request_id in self.finished:
                raise Conflict("request already finished", request_id=request_id)
            raise NotFound("unknown request", request_id=request_id)
        actions: list[Action] = []
        if req.engine_id is not None:
            eng = self.engines[req.engine_id]
            actions.append(AbortOnEngine(eng.id, eng.epoch, [request_id]))
        actions += self._finish(req, "abort")
        return actions

    # --- placement --------------------------------------------------------------------------
    def _place(self, reqs: list[RequestState]) -> list[Action]:
        """Placement (``placement.place``): requests with nowhere to go wait in ``pending``."""
        baseline = self.config.recovery == "baseline"
        return place(self.engines, self.pending, reqs, baseline=baseline)

    def _fill(self, eng: EngineState) -> list[Action]:
        """Waiting requests get placed once an engine has room again."""
        if not self.pending or not eng.has_room or eng.status is not EngineStatus.UP:
            return []
        return self._place(self._take_pending())

    def report_load(
        self, engine_id: str, epoch: int, pid: int, running: int, waiting: int
    ) -> list[Action]:
        """The current worker's own counts (a ping reply): placement follows them."""
        eng = self.engines.get(engine_id)
        if eng is None or (epoch, pid) != (eng.epoch, eng.worker_pid):
            return []
        eng.report(running, waiting)
        return self._fill(eng)

    def submit_refused(self, engine_id: str, epoch: int, request_ids: list[str]) -> list[Action]:
        """The worker's queue was full (``engine_unavailable``): it counts as full until it
        reports again, and the requests go to another engine or wait."""
        eng = self.engines.get(engine_id)
        if eng is None or eng.epoch != epoch:
            return []
        eng.reported, eng.sent_since_report = max(eng.reported, eng.capacity), 0
        reqs = [self.active[r] for r in request_ids if r in self.active]
        reqs = [r for r in reqs if r.engine_id == engine_id]
        for req in reqs:
            eng.assigned.discard(req.request_id)
            req.engine_id = None
        return self._place(reqs)

    def submit_rejected(self, engine_id: str, request_ids: list[str], error: str) -> list[Action]:
        """The worker refused the requests themselves (over its limits): they fail."""
        reqs = [self.active[r] for r in request_ids if r in self.active]
        actions: list[Action] = []
        for req in reqs:
            if req.engine_id == engine_id:
                actions += self._finish(req, "error", error=error)
        return actions

    def _engine_request(self, req: RequestState) -> EngineRequest:
        return req.engine_request(baseline=self.config.recovery == "baseline")

    # --- workers ----------------------------------------------------------------------------
    def register(
        self,
        engine_id: str,
        epoch: int,
        pid: int,
        *,
        device: str = "cpu",
        max_num_seqs: int = 16,
        weight_version: int = 0,
        now: float = 0.0,
    ) -> list[Action]:
        """A worker became the main worker of ``engine_id`` at ``epoch``. A newer epoch replaces
        the old worker and resumes its requests on the new one; an older epoch is refused."""
        eng = self.engines.get(engine_id)
        if eng is None:
            eng = EngineState(engine_id, epoch, pid, device, max_num_seqs, weight_version)
            eng.max_queued = self.config.limits.max_queued
            self.engines[engine_id] = eng
            first: list[Action] = [
                EmitEvent(ev.EngineRegistered(engine_id=engine_id, epoch=epoch, pid=pid))
            ]
            return first + self._place(self._take_pending())
        if epoch < eng.epoch or (epoch == eng.epoch and pid != eng.worker_pid):
            raise Conflict("stale epoch", engine_id=engine_id, epoch=epoch, current_epoch=eng.epoch)
        if epoch == eng.epoch:
            return []  # the same worker registering twice (retry): nothing to do
        actions: list[Action] = []
        if eng.status is EngineStatus.UP:
            # Replaced without a failure report: the old worker failed all the same.
            actions += self.engine_failed(engine_id, now, reason="replaced", epoch=eng.epoch)
        old_pid, old_epoch = eng.worker_pid, eng.epoch
        eng.epoch, eng.worker_pid, eng.weight_version = epoch, pid, weight_version
        eng.device, eng.max_num_seqs = device, max_num_seqs
        eng.reported = eng.sent_since_report = 0
        if eng.status is not EngineStatus.UNHEALTHY:
            eng.status = EngineStatus.UP
        registered = ev.EngineRegistered(
            engine_id=engine_id, epoch=epoch, pid=pid, old_pid=old_pid, old_epoch=old_epoch
        )
        actions.append(EmitEvent(registered))
        if eng.status is EngineStatus.UNHEALTHY:
            return actions
        interrupted = self._take_back(eng)
        if interrupted:
            resumed = ev.RequestsResumed(
                engine_id=engine_id,
                epoch=epoch,
                count=len(interrupted),
                held_tokens=sum(len(r.tokens) for r in interrupted),
                request_ids=[r.request_id for r in interrupted],
            )
            actions.append(EmitEvent(resumed))
        return actions + self._place(interrupted + self._take_pending())

    def engine_failed(
        self, engine_id: str, now: float, *, reason: str, epoch: int | None = None
    ) -> list[Action]:
        """The engine's worker died or hung. A second failure inside the window marks the
        device unhealthy and spreads its requests over healthy engines; otherwise they wait for
        the next worker of this engine (shadow takeover or restart)."""
        eng = self.engines.get(engine_id)
        if eng is None:
            raise NotFound("unknown engine", engine_id=engine_id)
        if epoch is not None and epoch != eng.epoch:
            return []  # about a worker that was already replaced
        if eng.status is EngineStatus.DOWN:
            # Already down: a shadow's or supervisor's report (hung, exited) makes it final.
            if not self._suspected(reason):
                eng.down_reason = reason
            return []
        if eng.status is not EngineStatus.UP:
            return []
        self.counters["engine_failures"] += 1
        window = self.config.failure_window_s
        eng.failures = [t for t in eng.failures if now - t <= window] + [now]
        failed = ev.EngineFailedEvent(
            engine_id=engine_id,
            epoch=eng.epoch,
            pid=eng.worker_pid,
            reason=reason,
            request_ids=sorted(eng.assigned),
        )
        actions: list[Action] = [EmitEvent(failed)]
        if len(eng.failures) >= 2:
            actions += self.mark_unhealthy(engine_id, reason="repeated failure")
        else:
            eng.status = EngineStatus.DOWN
            eng.down_reason = reason
        return actions

    def engine_recovered(self, engine_id: str, epoch: int, pid: int) -> list[Action]:
        """A down engine's current worker answers after all: bring it back up and give it
        its requests again (it replaces any copy it still runs)."""
        eng = self.engines.get(engine_id)
        if eng is None or eng.status is not EngineStatus.DOWN:
            return []
        if not self._suspected(eng.down_reason):
            return []  # a confirmed failure (exited, hung; baseline: missed heartbeats)
        if epoch != eng.epoch or pid != eng.worker_pid:
            return []  # a new worker will register under its own epoch
        eng.status = EngineStatus.UP
        del eng.failures[-1:]  # a withdrawn suspicion is no failure (the unhealthy window)
        held = [self.active[r] for r in sorted(eng.assigned) if r in self.active]
        eng.assigned.clear()
        recovered = ev.EngineRecovered(
            engine_id=engine_id,
            epoch=epoch,
            pid=pid,
            requests=len(held),
            request_ids=[r.request_id for r in held],
        )
        return [EmitEvent(recovered), *self._place(held + self._take_pending())]

    def _suspected(self, reason: str) -> bool:
        """Only the router's suspicion? In belayer mode a missed ping is too (the baseline's
        heartbeat triggers a cold restart): the shadow and the supervisor confirm failures and
        bring new workers there, so nothing would bring the engine back after a late answer."""
        belayer_ping = self.config.recovery == "belayer" and reason == "heartbeat"
        return reason in RECOVERABLE_REASONS or belayer_ping

    def mark_unhealthy(self, engine_id: str, *, reason: str) -> list[Action]:
        eng = self.engines[engine_id]
        eng.status = EngineStatus.UNHEALTHY
        moved = self._take_back(eng)
        for req in (r for r in moved if r.pinned_engine == engine_id):
            req.pinned_engine = None  # its engine is unhealthy: any healthy engine will do
        unhealthy = ev.EngineUnhealthy(
            engine_id=engine_id,
            reason=reason,
            moved_requests=len(moved),
            request_ids=[r.request_id for r in moved],
        )
        actions: list[Action] = [EmitEvent(unhealthy)]
        # Spread evenly: place one at a time so each sees the load the previous one added.
        for req in moved:
            actions += self._place([req])
        return actions

    def _take_back(self, eng: EngineState) -> list[RequestState]:
        """The active requests ``eng`` held, no longer on any engine (each one resume more)."""
        reqs = [self.active[r] for r in sorted(eng.assigned) if r in self.active]
        eng.assigned.clear()
        for req in reqs:
            req.resumes += 1
            self.counters["resumes"] += 1
            req.engine_id = None
        return reqs

    def _take_pending(self) -> list[RequestState]:
        if self.hold_pending:
            return []
        reqs = [self.active[r] for r in self.pending if r in self.active]
        self.pending.clear()
        return reqs

    def release_pending(self) -> list[Action]:
        """End of a restart's adoption phase: place whatever no worker still held."""
        self.hold_pending = False
        return self._place(self._take_pending())

    def adopt(self, engine_id: str, held: list[HeldRequest], weight_version: int) -> list[Action]:
        """A restarted router takes over requests a live worker still runs (or just finished):
        the worker's tokens extend what the log had, so nothing is generated again."""
        eng = self.engines.get(engine_id)
        if eng is None or eng.status is not EngineStatus.UP:
            return []
        actions: list[Action] = []
        adopted: list[str] = []
        for h in held:
            req = self.active.get(h.request_id)
            if req is None or req.engine_id is not None or len(h.token_ids) < len(req.tokens):
                continue
            if not watchdog.extends(h, req):
                mismatch = ev.AdoptMismatch(
                    engine_id=engine_id, request_id=h.request_id, logged=len(req.tokens)
                )
                actions.append(EmitEvent(mismatch))
                continue
            if h.request_id in self.pending:
                self.pending.remove(h.request_id)
            logged = len(req.tokens)
            req.engine_id = engine_id
            req.engine_history.append(engine_id)
            eng.assigned.add(h.request_id)
            adopted.append(h.request_id)
            # The caller got at least the logged tokens from the old router (it streamed them
            # before logging them): catch up from there; clients drop what they already hold.
            more = list(h.token_ids[logged:])
            actions += self._append(req, more, list(h.logprobs[logged:]), weight_version)
            if h.finished:
                actions += self._finish(req, h.finish_reason or "stop")
        if held:
            event = ev.RequestsAdopted(engine_id=engine_id, count=len(held), request_ids=adopted)
            actions.append(EmitEvent(event))
            self.counters["adopted"] += len(held)
        return actions

    # --- stall watchdog (``watchdog.py``) ----------------------------------------------------
    def stalled(self, engine_id: str) -> list[str]:
        """Requests on up engine ``engine_id`` with no token since the previous call."""
        eng = self.engines.get(engine_id)
        if eng is None or eng.status is not EngineStatus.UP:
            return []
        return watchdog.stalled(eng, self.active)

    def reconcile(
        self, engine_id: str, epoch: int, asked: list[str], copies: list[HeldRequest], version: int
    ) -> list[Action]:
        """Act on the worker's copies of ``asked`` (``stalled``; ``watchdog.verdict``): take
        the lost last tokens of a finished copy and finish, or resubmit from the tokens held
        (the worker replaces any copy; overlapping tokens are dropped by index)."""
        eng = self.engines.get(engine_id)
        if eng is None or eng.status is not EngineStatus.UP or epoch != eng.epoch:
            return []
        by_id = {h.request_id: h for h in copies}
        actions: list[Action] = []
        for rid in asked:
            req, h = self.active.get(rid), by_id.get(rid)
            if req is None or req.engine_id != engine_id:
                continue
            outcome = watchdog.verdict(req, h)
            if outcome == "wait":
                continue
            held = len(req.tokens)
            more = list(h.token_ids[held:]) if h is not None and outcome == "finish" else []
            event = ev.StalledRequestReconciled(
                engine_id=engine_id, request_id=rid, held=held, recovered=len(more),
                outcome="finished" if outcome == "finish" else "resubmitted",
            )  # fmt: skip
            actions.append(EmitEvent(event))
            if h is None or outcome == "resubmit":
                actions.append(SubmitToEngine(eng.id, eng.epoch, [self._engine_request(req)]))
                continue
            actions += self._append(req, more, list(h.logprobs[held:]), version)
            actions += self._finish(req, h.finish_reason or "stop")
        return actions

    # --- tokens -----------------------------------------------------------------------------
    def on_step(self, batch: StepBatch) -> list[Action]:
        """Worker output of one step. Output of an unknown engine, a stale epoch or a down
        engine never reaches a caller."""
        eng = self.engines.get(batch.engine_id)
        if (
            eng is None
            or (batch.epoch, batch.worker_pid) != (eng.epoch, eng.worker_pid)
            or eng.status is not EngineStatus.UP
        ):
            if not batch.deltas:
                return []  # only counts, from a worker that is not the engine's
            self.counters["stale_batches"] += 1
            stale = ev.StaleOutputRejected(
                engine_id=batch.engine_id,
                epoch=batch.epoch,
                pid=batch.worker_pid,
                current_epoch=eng.epoch if eng else None,
                request_ids=[d.request_id for d in batch.deltas],
            )
            return [EmitEvent(stale)]
        eng.weight_version = batch.weight_version
        if batch.running >= 0:
            eng.report(batch.running, batch.waiting)
        actions: list[Action] = []
        for d in batch.deltas:
            req = self.active.get(d.request_id)
            if req is None or req.engine_id != eng.id:
                continue  # aborted or moved: the worker learns through its abort
            if d.error:
                actions += self._finish(req, "error", error=d.error)
                continue
            if d.finish_reason == "abort" and not d.token_ids:
                continue  # the worker dropping a copy it was told to replace; not the caller's abort
            actions += self._apply_delta(req, d, batch.weight_version)
        return actions + self._fill(eng)

    def _apply_delta(self, req: RequestState, d: SeqDelta, version: int) -> list[Action]:
        """Place a worker's tokens by index: overlaps (tokens generated again — baseline
        restarts, a restarted router's resubmission) are dropped and counted; a gap (a lost
        batch) resubmits the request from the tokens held, so nothing is skipped."""
        toks, lps = list(d.token_ids), list(d.logprobs)
        held = len(req.tokens)
        start = held if d.start < 0 else d.start
        if start > held:
            eng = self.engines[req.engine_id] if req.engine_id else None
            if eng is None:
                return []
            gap = ev.TokenGapResubmitted(
                engine_id=eng.id, request_id=req.request_id, held=held, start=start
            )
            return [
                EmitEvent(gap),
                SubmitToEngine(eng.id, eng.epoch, [self._engine_request(req)]),
            ]
        overlap = min(held - start, len(toks))
        if overlap:
            req.regenerated += overlap
            self.regenerated_tokens += overlap
            toks, lps = toks[overlap:], lps[overlap:]
        actions = self._append(req, toks, lps, version)
        if d.finished:
            # A regenerating worker (baseline) that stops before reaching the held tokens
            # cannot finish what the caller already holds more of.
            if start + len(d.token_ids) >= held:
                actions += self._finish(req, d.finish_reason or "stop")
        return actions

    def _append(
        self, req: RequestState, toks: list[int], lps: list[float], version: int
    ) -> list[Action]:
        """Hold a worker's new tokens (those past the ones held; counted in ``tokens``): stream
        them to the callers and log every full chunk. The tokens are cut at chunk boundaries
        and each piece goes out before the chunk it completes, all through the router's one
        ordered writer: a caller always holds every logged token and at most k more, so a
        restarted router (which streams on from the log) re-sends at most k and leaves no gap."""
        self.counters["tokens"] += len(toks)
        k = self.config.token_log_chunk
        actions: list[Action] = []
        while toks:
            n, held = req.room(k), len(req.tokens)
            req.hold(toks[:n], lps[:n], version)
            toks, lps = toks[n:], lps[n:]
            actions += [
                SendToCaller(inbox, self._delta(req, held, len(req.tokens)))
                for inbox, stream in req.subscribers.items()
                if stream
            ]
            if len(req.tokens) - req.logged >= k:
                actions.append(PersistChunk(req.chunk(len(req.tokens), final=False, reason=None)))
        return actions

    def _delta(self, req: RequestState, start: int, end: int) -> TokenDelta:
        return req.delta(start, end, self.router_id)

    def _finish(self, req: RequestState, reason: str, *, error: str | None = None) -> list[Action]:
        self.active.pop(req.request_id, None)
        if req.request_id in self.pending:
            self.pending.remove(req.request_id)
        if req.engine_id is not None and req.engine_id in self.engines:
            self.engines[req.engine_id].assigned.discard(req.request_id)
        result = req.result(reason, self.decode(req.tokens), self.router_id)
        self.remember(result, req.identity)
        actions: list[Action] = [
            PersistChunk(req.chunk(len(req.tokens), final=True, reason=reason))
        ]
        actions += [SendToCaller(inbox, result) for inbox in req.subscribers]
        if error:
            failed = ev.RequestFailed(
                engine_id=req.engine_id or "", request_id=req.request_id, error=error
            )
            actions.append(EmitEvent(failed))
        return actions

    def request_state(self, request_id: str) -> RequestPhase:
        """What this router knows of a request (``router.status`` with a request id)."""
        if request_id in self.active:
            return "active"
        return "finished" if request_id in self.finished else "unknown"

    def remember(self, result: GenerateResult, identity: str = "") -> None:
        """Keep a finished result for replay (bounded, oldest dropped first)."""
        self.finished[result.request_id] = result
        if identity:
            self.finished_identity[result.request_id] = identity
        while len(self.finished) > self.config.finished_cache:
            old, _ = self.finished.popitem(last=False)
            self.finished_identity.pop(old, None)

    # --- restart recovery -------------------------------------------------------------------
    def restore(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        chunks: list[TokenLogChunk],
        *,
        inbox: str | None,
        identity: str = "",
    ) -> None:
        """Rebuild one request from the durable log after a router restart: finished requests
        become replayable results; unfinished ones become active with their logged tokens held
        (they are placed once engines register)."""
        req = RequestState(request_id, list(prompt_ids), sampling, identity=identity)
        if inbox:
            req.subscribers[inbox] = True
        final = req.replay(chunks)
        if final is not None:
            self._finish(req, final)
            return
        req.router_restarts = 1
        self.active[request_id] = req
        self.pending.append(request_id)

    # --- status -----------------------------------------------------------------------------
    def metrics(self) -> dict[str, int]:
        return {**self.counters, "regenerated_tokens": self.regenerated_tokens}

    def engine_infos(self) -> list[EngineInfo]:
        return [e.info() for e in sorted(self.engines.values(), key=lambda e: e.id)]
