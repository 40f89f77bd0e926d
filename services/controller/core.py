"""One trajectory attempt as a pure state machine: the agent episode (``workloads.episode``,
the one implementation every episode runs: context L_k as token ids, actions, observations,
limits) plus the chain of ready checkpoints and what recovery does to them. No bus, no event
loop, no clock (every time comes in as an argument): ``runner.py`` executes what this decides.

The context only grows between recoveries: L_k (the context when the k-th action's observation
and the next generation header were appended) is always a prefix of the arrays, so a ready
checkpoint is remembered as the array lengths at k (``ReadyPrefix``) and restoring C_k
truncates every array back to exactly those lengths. Ready prefixes form a chain on the current
history: after a restore to C_j the ones past j are dropped (they belong to the abandoned
future); a restore that fails drops its checkpoint and falls back to the one before it, and
without any, to a fresh sandbox and L_0.

The loop, per turn: ``next_generation`` (or a finish: deadline, turns, context length) →
``on_response`` (the model's tokens, mask 1; then the action it asks for) → ``on_observation``
(the command's output as the next user turn, mask 0) → ``decide_checkpoint``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas.rollout import (
    PolicyDecision,
    ReadyPrefix,
    RecoveryEntry,
    RecoveryKind,
    RecoveryLog,
)
from services.controller.policy import CheckpointPolicy
from workloads.episode import Again, Episode, Execute, Finish, Generate, Limits, Score, Step

__all__ = [
    "INFRA_CODES",
    "Again",
    "Execute",
    "Finish",
    "Generate",
    "Limits",
    "Pending",
    "Score",
    "Step",
    "TrajectoryCore",
    "is_agent_timeout",
]

# Error codes of infrastructure failures (common/errors.py codes): the sandbox or the path to
# it broke. They trigger recovery and never reach the model.
INFRA_CODES = frozenset(
    {"sandbox_error", "bus_unavailable", "timeout", "not_found", "checkpoint_busy", "error"}
)


def is_agent_timeout(code: str, message: str, data: dict[str, object]) -> bool:
    """True when an exec error is the agent's own command running past its timeout (an
    ordinary observation), not the environment service timing out (``subject`` in its data:
    no reply on the bus) or anything else."""
    return code == "timeout" and "subject" not in data and "timeout_s" in data


@dataclass(frozen=True)
class Pending:
    """A checkpoint decided at boundary k, with the array lengths of L_k."""

    prefix: int
    response_len: int
    actions_len: int
    turn: int


@dataclass(kw_only=True)
class TrajectoryCore(Episode):
    """One attempt: the episode (``workloads.episode``) plus its checkpoints and recovery.
    ``prompt_ids`` is L_0."""

    policy: CheckpointPolicy
    env_steps: int = 0
    ready: list[ReadyPrefix] = field(default_factory=list)
    recovery: RecoveryLog = field(default_factory=RecoveryLog)

    def log(
        self,
        kind: RecoveryKind,
        now: float,
        detail: str = "",
        *,
        prefix: int | None = None,
        seconds: float = 0.0,
    ) -> None:
        self.recovery.entries.append(
            RecoveryEntry(
                kind=kind,
                turn=self.turn,
                prefix=self.prefix if prefix is None else prefix,
                detail=detail,
                seconds=round(seconds, 6),
                ts=now,
                generation=self.generations,
            )
        )

    # --- the episode's hooks: the policy learns, handovers are logged ----------------------
    def observe_response(self, llm_s: float) -> None:
        self.policy.observe_response(llm_s)

    def observe_step(self, env_s: float, llm_s: float) -> None:
        self.policy.observe_step(env_s=env_s, llm_s=llm_s)

    def observe_resumes(self, resumes: int, now: float) -> None:
        self.recovery.engine_handovers += resumes
        self.log("engine_handover", now, f"request resumed {resumes}x")

    def begin_step(self) -> int:
        """An environment step starts (its exec is about to run): its number, 1-based, over
        the whole attempt — steps undone by a restore and failed ones count too."""
        self.env_steps += 1
        return self.env_steps

    # --- checkpoints ----------------------------------------------------------------------
    def decide_checkpoint(
        self, *, step_s: float, now: float, elapsed_s: float = 0.0
    ) -> tuple[PolicyDecision, Pending | None]:
        """Ask the policy after an environment step; a yes comes with the L_k lengths the
        checkpoint will stand for."""
        decision = self.policy.decide(
            step_s=step_s, elapsed_s=elapsed_s, now=now, prefix=self.prefix
        )
        self.recovery.decisions.append(decision)
        if not decision.checkpoint:
            return decision, None
        return decision, Pending(self.prefix, len(self.response_ids), len(self.actions), self.turn)

    def on_checkpoint_ready(
        self, pending: Pending, checkpoint_id: str, seconds: float, now: float
    ) -> ReadyPrefix:
        """C_k is ready: it joins the chain (with L_k's lengths as they were at k)."""
        ready = ReadyPrefix(
            prefix=pending.prefix,
            checkpoint_id=checkpoint_id,
            response_len=pending.response_len,
            actions_len=pending.actions_len,
            turn=pending.turn,
        )
        self.ready.append(ready)
        self.recovery.checkpoints += 1
        self.timings.checkpoint_s += seconds
        self.policy.observe_checkpoint(seconds)
        self.log("checkpoint", now, checkpoint_id, prefix=pending.prefix, seconds=seconds)
        return ready

    def on_checkpoint_failed(
        self, pending: Pending, error: str, *, timed_out: bool, seconds: float, now: float
    ) -> None:
        self.recovery.checkpoint_failures += 1
        self.timings.checkpoint_s += seconds
        if timed_out:
            self.policy.observe_timeout(now)
        self.log("checkpoint_failed", now, error, prefix=pending.prefix, seconds=seconds)

    def on_checkpoint_wait(self, seconds: float) -> None:
        """The next action waited ``seconds`` for a checkpoint (visible on the critical path)."""
        self.timings.visible_checkpoint_s += max(0.0, seconds)

    # --- recovery -------------------------------------------------------------------------
    def on_sandbox_failure(self, during: str, code: str, error: str, now: float) -> None:
        """An infrastructure failure: nothing of the failed step is kept (the response that
        asked for it goes too, on the restore that follows)."""
        self.recovery.sandbox_failures += 1
        self.policy.observe_failure()
        self.log("sandbox_failure", now, f"{during}: {code}: {error}"[:500])

    def restore_candidate(self) -> ReadyPrefix | None:
        """The latest ready checkpoint still believed usable (None: restart from scratch)."""
        return self.ready[-1] if self.ready else None

    def on_restored(self, ready: ReadyPrefix, seconds: float, now: float) -> None:
        """The sandbox is at C_k again: truncate the context to exactly L_k and forget the
        checkpoints past it."""
        self.truncate(ready.response_len, ready.actions_len, ready.turn)
        self.ready = [r for r in self.ready if r.prefix <= ready.prefix]
        self.recovery.restores += 1
        self.timings.recovery_s += seconds
        self.policy.observe_restore()
        self.log("restore", now, ready.checkpoint_id, prefix=ready.prefix, seconds=seconds)

    def on_restore_failed(self, ready: ReadyPrefix, error: str, now: float) -> None:
        """C_k could not be restored: fall back to the checkpoint before it."""
        self.ready = [r for r in self.ready if r.checkpoint_id != ready.checkpoint_id]
        self.recovery.restore_failures += 1
        self.log(
            "restore_failed", now, f"{ready.checkpoint_id}: {error}"[:500], prefix=ready.prefix
        )

    def on_restarted_from_scratch(
        self, seconds: float, now: float, *, had_checkpoint: bool
    ) -> None:
        """A fresh sandbox from the base image with the task files: back to L_0."""
        self.truncate(0, 0, 0)
        self.ready = []
        self.recovery.restarts_from_scratch += 1
        if had_checkpoint:
            self.recovery.restarts_from_scratch_with_checkpoint += 1
        self.timings.recovery_s += seconds
        self.policy.observe_restore()
        self.log("restart_from_scratch", now, prefix=0, seconds=seconds)

    def fail(self, reason: str) -> Finish:
        """Recovery gave up: the attempt ends ``failed`` (never published)."""
        return self.stop(Finish("failed", reason))
