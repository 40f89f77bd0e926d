"""Time to the first resumed token: from the router taking an engine's worker down to the first
new token each resumed request receives from the engine's next worker (``resumed_first_token``).

Pure: the router's service feeds it the events its core emits and the step batches it
accepts, with the time (``time.monotonic()``) passed in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas import events as ev
from schemas.serving import StepBatch

MAX_WAIT_S = 600.0
"""A resumed request still without a new token after this long is no longer timed (it was
aborted, moved to another engine or finished elsewhere)."""


@dataclass(frozen=True)
class _Waiting:
    engine_id: str
    epoch: int
    failed_at: float
    held: int
    """Tokens the request held when resumed: the first new token is the one at this index."""


@dataclass
class ResumeClock:
    failed_at: dict[str, float] = field(default_factory=dict)
    """Engine → when its last worker was taken down (not yet resumed)."""
    waiting: dict[str, _Waiting] = field(default_factory=dict)
    """Request → its resume, until its first new token."""

    def on_event(self, event: ev.EventBase, now: float, held: dict[str, int]) -> None:
        """An event the router's core emitted. ``held``: tokens each active request holds."""
        if isinstance(event, ev.EngineFailedEvent):
            self.failed_at[event.engine_id] = now
        elif isinstance(event, ev.RequestsResumed):
            failed_at = self.failed_at.pop(event.engine_id, None)
            if failed_at is None:
                return  # the failure was seen by another router incarnation: nothing to time
            self._prune(now)
            for rid in event.request_ids:
                if rid in held:
                    self.waiting[rid] = _Waiting(event.engine_id, event.epoch, failed_at, held[rid])

    def on_step(self, batch: StepBatch, now: float) -> ev.ResumedFirstToken | None:
        """A step batch: the resumed requests that got their first new token in it (a token
        at or past the ones held: a worker that regenerates from the prompt, as in baseline
        mode, delivers nothing new until it passes them)."""
        ids: list[str] = []
        seconds: list[float] = []
        for d in batch.deltas:
            w = self.waiting.get(d.request_id)
            if w is None or (w.engine_id, w.epoch) != (batch.engine_id, batch.epoch):
                continue
            start = w.held if d.start < 0 else d.start
            if not d.token_ids or start + len(d.token_ids) <= w.held:
                continue
            del self.waiting[d.request_id]
            ids.append(d.request_id)
            seconds.append(max(0.0, now - w.failed_at))
        if not ids:
            return None
        return ev.ResumedFirstToken(
            engine_id=batch.engine_id, epoch=batch.epoch, request_ids=ids, seconds=seconds
        )

    def _prune(self, now: float) -> None:
        for rid in [r for r, w in self.waiting.items() if now - w.failed_at > MAX_WAIT_S]:
            del self.waiting[rid]
