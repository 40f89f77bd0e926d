"""The scheduling loop: an ``LLMEngine`` driven from its own thread.

torch work blocks, so the engine runs in a dedicated thread while the asyncio side talks to the
bus. Commands reach the thread through a queue; each loop turn refreshes the heartbeat file,
applies commands, runs one engine step and hands the step's outputs to ``on_batch``.
"""

from __future__ import annotations

import os
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from torch import Tensor

from common.logging import get_logger
from schemas.serving import EngineRequest, HeldRequest, SeqDelta
from services.worker.engine.backend import EngineBackend
from services.worker.engine.llm_engine import StepOutput
from services.worker.engine.sequence import SamplingParams as EngineSampling

log = get_logger(component="engine_loop")


@dataclass
class Submit:
    requests: list[EngineRequest]


@dataclass
class Abort:
    request_ids: list[str]


@dataclass
class Snapshot:
    """Ask the loop for its copy of some requests; the answer arrives on ``future``."""

    request_ids: list[str]
    future: Future[list[HeldRequest]]


@dataclass
class SwapWeights:
    """Switch the engine to another weight version at the next loop turn; ``on_swapped`` runs
    in the engine thread right after, so step batches carry the new version from then on."""

    params: dict[str, Tensor]
    on_swapped: Callable[[], None]
    future: Future[None]


Command = Submit | Abort | Snapshot | SwapWeights


@dataclass
class Track:
    """Every generated token of one request this worker knows (held ones included)."""

    token_ids: list[int]
    logprobs: list[float]
    finished: bool = False
    finish_reason: str | None = None

    def held(self, request_id: str) -> HeldRequest:
        return HeldRequest(
            request_id=request_id,
            token_ids=list(self.token_ids),
            logprobs=list(self.logprobs),
            finished=self.finished,
            finish_reason=self.finish_reason,  # type: ignore[arg-type]  # the engine's str is one of FinishReason
        )


#: Finished requests remembered for a restarted router (``EngineStateRequest``).
RECENT_LIMIT = 4096


def to_engine_sampling(req: EngineRequest) -> EngineSampling:
    s = req.sampling
    return EngineSampling(
        temperature=s.temperature,
        top_p=s.top_p,
        seed=s.seed,
        max_tokens=s.max_tokens,
        stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
    )


class EngineLoop:
    """Runs ``engine`` in a thread; ``on_batch(step, deltas)`` is called from that thread."""

    def __init__(
        self,
        engine: EngineBackend,
        *,
        on_batch: Callable[[int, list[SeqDelta]], None],
        heartbeat_file: Path | None,
        idle_turn_s: float = 0.01,
        on_turn: Callable[[], None] | None = None,
    ) -> None:
        self.engine = engine
        self.on_batch = on_batch
        self.heartbeat_file = heartbeat_file
        self.idle_turn_s = idle_turn_s
        self.on_turn = on_turn
        self.commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self.wake = threading.Event()
        self.stopping = threading.Event()
        self.steps = 0
        self.tracks: dict[str, Track] = {}
        self.recent: OrderedDict[str, Track] = OrderedDict()
        self.thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.fatal: BaseException | None = None
        self.busy_reported = False
        """The last step batch said the engine holds work (an empty one follows when idle)."""
        self.inbox = 0
        """Requests submitted but not yet handed to the engine (guarded by ``_inbox_lock``)."""
        self._inbox_lock = threading.Lock()

    def start(self) -> None:
        if self.heartbeat_file is not None:
            self.heartbeat_file.parent.mkdir(parents=True, exist_ok=True)
            self.heartbeat_file.touch()
        self.thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self.stopping.set()
        self.wake.set()
        if self.thread.is_alive():
            self.thread.join(timeout)

    def submit(self, cmd: Command) -> None:
        if isinstance(cmd, Submit):
            with self._inbox_lock:
                self.inbox += len(cmd.requests)
        self.commands.put(cmd)
        self.wake.set()

    def holds(self, request_id: str) -> bool:
        """Whether the engine already has this request (a resubmission replaces it)."""
        return request_id in self.tracks

    def _beat(self) -> None:
        if self.heartbeat_file is not None:
            try:
                os.utime(self.heartbeat_file)
            except FileNotFoundError:
                self.heartbeat_file.touch()

    def _apply(self, cmd: Command, errors: list[SeqDelta]) -> None:
        if isinstance(cmd, SwapWeights):
            try:
                self.engine.load_weights(cmd.params)
                cmd.on_swapped()
                cmd.future.set_result(None)
            except Exception as exc:  # a bad version must not kill the loop
                cmd.future.set_exception(exc)
            return
        if isinstance(cmd, Snapshot):
            copies = [
                t.held(rid)
                for rid in cmd.request_ids
                if (t := self.tracks.get(rid) or self.recent.get(rid)) is not None
            ]
            cmd.future.set_result(copies)
            return
        if isinstance(cmd, Abort):
            for rid in cmd.request_ids:
                self.engine.abort_request(rid)
                self.tracks.pop(rid, None)
            return
        for req in cmd.requests:
            # A resubmitted id replaces the running copy (a restarted router resumes requests
            # this worker may still hold).
            self.engine.abort_request(req.request_id)
            n = req.generated_offset
            held = list(req.token_ids[len(req.token_ids) - n :]) if n else []
            lps = list(req.held_logprobs[:n]) + [0.0] * max(0, n - len(req.held_logprobs))
            try:
                self.engine.add_request(
                    req.request_id,
                    list(req.token_ids),
                    to_engine_sampling(req),
                    generated_offset=n,
                )
                self.tracks[req.request_id] = Track(held, lps)
            except ValueError as exc:  # e.g. prompt longer than the engine can ever hold
                self.tracks.pop(req.request_id, None)
                errors.append(
                    SeqDelta(
                        request_id=req.request_id,
                        token_ids=[],
                        logprobs=[],
                        finished=True,
                        finish_reason="error",
                        error=str(exc),
                        start=n,
                    )
                )
            with self._inbox_lock:  # the engine counts it now
                self.inbox -= 1

    def _deltas(self, outputs: list[StepOutput]) -> list[SeqDelta]:
        """Step outputs → deltas with positions; records them in the tracks."""
        deltas = []
        for o in outputs:
            if o.finish_reason == "abort":
                continue  # every abort is ours (a replaced copy or the router's cancel)
            track = self.tracks.get(o.request_id)
            if track is None:
                continue
            start = len(track.token_ids)
            track.token_ids += o.new_token_ids
            track.logprobs += o.new_logprobs
            if o.finished:
                track.finished, track.finish_reason = True, o.finish_reason
                self.recent[o.request_id] = self.tracks.pop(o.request_id)
                while len(self.recent) > RECENT_LIMIT:
                    self.recent.popitem(last=False)
            deltas.append(
                SeqDelta(
                    request_id=o.request_id,
                    token_ids=list(o.new_token_ids),
                    logprobs=list(o.new_logprobs),
                    finished=o.finished,
                    finish_reason=o.finish_reason,  # type: ignore[arg-type]  # the engine's str is one of FinishReason
                    start=start,
                )
            )
        return deltas

    def _run(self) -> None:
        try:
            while not self.stopping.is_set():
                self._beat()
                if self.on_turn is not None:
                    self.on_turn()
                errors: list[SeqDelta] = []
                while True:
                    try:
                        self._apply(self.commands.get_nowait(), errors)
                    except queue.Empty:
                        break
                if errors:
                    self.on_batch(self.steps, errors)
                if not self.engine.has_unfinished():
                    if self.busy_reported:  # tell the router the engine is empty now
                        self.busy_reported = False
                        self.on_batch(self.steps, [])
                    self.wake.wait(self.idle_turn_s)
                    self.wake.clear()
                    continue
                outputs = self.engine.step()
                self.steps += 1
                deltas = self._deltas(outputs)
                if deltas:
                    self.busy_reported = True
                    self.on_batch(self.steps, deltas)
        except BaseException as exc:  # the worker must die loudly, not hang with a stale loop
            self.fatal = exc
            log.exception("engine_loop_crashed")
            os._exit(70)

    @property
    def load(self) -> tuple[int, int]:
        """(running, waiting): waiting counts what was submitted but not yet picked up."""
        return self.engine.num_running, self.engine.num_waiting + self.inbox
