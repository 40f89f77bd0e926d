"""One trajectory attempt as a pure state machine: the context L_k as token ids, the actions,
the chain of ready checkpoints and what recovery does to them. No bus, no event loop, no clock
(every time comes in as an argument): ``runner.py`` executes what this decides.

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

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from schemas.rollout import (
    ActionRecord,
    FinishReason,
    PolicyDecision,
    ReadyPrefix,
    RecoveryEntry,
    RecoveryKind,
    RecoveryLog,
    Timings,
)
from schemas.seeds import derive_seed
from services.controller.policy import CheckpointPolicy, Decision
from workloads.actions import (
    AnswerAction,
    BashAction,
    InvalidAction,
    SubmitAction,
    format_observation,
    invalid_action_observation,
    parse_action,
)

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
class Limits:
    """What bounds one attempt (the request's, the task's and the node's, combined)."""

    max_turns: int
    max_invalid_in_row: int
    max_prompt_tokens: int
    """Longest context the router takes as a prompt."""
    max_context_tokens: int
    """Model context: prompt + response tokens."""
    max_response_tokens: int
    observation_chars: int
    action_timeout_s: float
    deadline_s: float
    vocab_size: int = 0
    """Token ids the tokenizer knows (the router refuses a prompt holding any other); a
    response with one cannot be continued: 0 means unchecked."""


@dataclass(frozen=True)
class Generate:
    """Ask the router for the next response."""

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    seed: int


@dataclass(frozen=True)
class Execute:
    """Run the agent's command (already wrapped for the task's workdir by the runner)."""

    command: str
    prefix: int
    """k: actions done before it."""


@dataclass(frozen=True)
class Score:
    """Compute the reward, then finish with ``reason``."""

    reason: FinishReason
    text: str
    """The final response (answer tasks are scored on it)."""
    detail: str = ""


@dataclass(frozen=True)
class Finish:
    """End now with this reward (no scoring)."""

    reason: FinishReason
    detail: str = ""
    reward: float = 0.0


@dataclass(frozen=True)
class Again:
    """The response was unparseable; an observation saying so was appended: generate again."""

    reason: str


Step = Generate | Execute | Score | Finish | Again


@dataclass(frozen=True)
class Pending:
    """A checkpoint decided at boundary k, with the array lengths of L_k."""

    prefix: int
    response_len: int
    actions_len: int
    turn: int


@dataclass
class TrajectoryCore:
    """The state of one attempt. ``prompt_ids`` is L_0."""

    trajectory_id: str
    prompt_ids: list[int]
    limits: Limits
    policy: CheckpointPolicy
    sample_seed: int
    has_sandbox: bool
    started_at: float
    """Clock value (the runner's) when the attempt started; the deadline counts from it."""
    observation_ids: Callable[[Sequence[int], str], list[int]]
    """(the response just appended, observation text) → the tokens of the next user turn and
    generation header (``model.chat.ChatFormat.observation``)."""
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    actions: list[ActionRecord] = field(default_factory=list)
    turn: int = 0
    invalid_in_row: int = 0
    generations: int = 0
    env_steps: int = 0
    ready: list[ReadyPrefix] = field(default_factory=list)
    recovery: RecoveryLog = field(default_factory=RecoveryLog)
    timings: Timings = field(default_factory=Timings)
    finish: Finish | None = None
    last_text: str = ""
    _last_llm_s: float = 0.0
    _pending_command: str = ""

    # --- the context --------------------------------------------------------------------
    @property
    def prefix(self) -> int:
        """k: actions kept so far (the sandbox's action boundary)."""
        return len(self.actions)

    @property
    def context(self) -> list[int]:
        """The current context: L_0 + everything after it."""
        return self.prompt_ids + self.response_ids

    def _append(
        self,
        ids: list[int],
        *,
        model: bool,
        logprobs: list[float] | None = None,
        versions: list[int] | None = None,
    ) -> None:
        self.response_ids += ids
        self.loss_mask += [1 if model else 0] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.weight_versions += versions if versions is not None else [-1] * len(ids)

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

    # --- turns --------------------------------------------------------------------------
    def next_generation(self, now: float) -> Generate | Score | Finish:
        """The next LLM request, or why the attempt ends here: past its deadline (not scored,
        reward 0), or out of turns or context (scored as it stands: the tests may pass)."""
        if now - self.started_at >= self.limits.deadline_s:
            return self.stop(Finish("deadline", f"ran past {self.limits.deadline_s:g} s"))
        if self.turn >= self.limits.max_turns:
            return Score("max_turns", self.last_text, f"{self.turn} turns")
        context = self.context
        room = self.limits.max_context_tokens - len(context)
        if len(context) > self.limits.max_prompt_tokens or room < 1:
            return Score("length", self.last_text, f"context of {len(context)} tokens")
        self.generations += 1
        return Generate(
            request_id=f"{self.trajectory_id}-g{self.generations}",
            prompt_ids=context,
            max_tokens=min(self.limits.max_response_tokens, room),
            seed=self.turn_seed(),
        )

    def turn_seed(self) -> int:
        """The seed of the next response: ``(sample seed, its turn)``, not the request count.
        A response regenerated after a restore to C_k (or by a controller that adopted the
        attempt) is the same turn of the same history, so it draws the same tokens as the
        one it replaces, and the trajectory a failure touched is the failure-free one
        (failure transparency). The request id still counts requests: the router never takes
        a regeneration for a request it already answered."""
        return derive_seed(self.sample_seed, self.turn + 1)

    def on_response(
        self,
        token_ids: list[int],
        logprobs: list[float],
        versions: list[int],
        text: str,
        *,
        llm_s: float,
        resumes: int = 0,
        now: float = 0.0,
    ) -> Step:
        """The model's response (its tokens are kept with mask 1) and what it asks for."""
        self.turn += 1
        self.timings.llm_s += llm_s
        self._last_llm_s = llm_s
        self.policy.observe_response(llm_s)
        if len(versions) != len(token_ids):
            versions = [versions[-1] if versions else 0] * len(token_ids)
        self._append(list(token_ids), model=True, logprobs=list(logprobs), versions=list(versions))
        self.last_text = text
        if resumes:
            self.recovery.engine_handovers += resumes
            self.log("engine_handover", now, f"request resumed {resumes}x")
        vocab = self.limits.vocab_size
        if vocab and any(t >= vocab for t in token_ids):
            return Score(
                "malformed", text, "response holds tokens outside the tokenizer's vocabulary"
            )
        action = parse_action(text)
        if not self.has_sandbox:  # single-turn: whatever the response says is final
            if isinstance(action, AnswerAction):
                return Score("answered", text, f"answer {action.answer!r}")
            return Score("malformed", text, "no 'Answer:' line")
        if isinstance(action, SubmitAction):
            return Score("answered", text, "submitted")
        if isinstance(action, BashAction):
            self.invalid_in_row = 0
            self._pending_command = action.command
            return Execute(action.command, self.prefix)
        reason = (
            action.reason
            if isinstance(action, InvalidAction)
            else "a final 'Answer:' does not end a sandbox task; run the submit command"
        )
        self.invalid_in_row += 1
        if self.invalid_in_row >= self.limits.max_invalid_in_row:
            return Score("malformed", text, f"{self.invalid_in_row} unparseable responses in a row")
        self._append(self._observation_ids(invalid_action_observation(reason)), model=False)
        self.policy.observe_step(env_s=0.0, llm_s=llm_s)
        return Again(reason)

    def on_observation(
        self,
        *,
        stdout: str,
        stderr: str,
        exit_code: int,
        env_s: float,
        timed_out: bool = False,
        truncated: bool = False,
    ) -> None:
        """The command ran (an ordinary outcome, whatever its exit code, its own timeout
        included): record the action, append the observation as the next user turn."""
        self.timings.env_s += env_s
        self.actions.append(
            ActionRecord(
                turn=self.turn,
                prefix=self.prefix,
                command=self._pending_command,
                exit_code=exit_code,
                env_s=round(env_s, 6),
                timed_out=timed_out,
                truncated=truncated,
                generation=self.generations,
            )
        )
        text = format_observation(
            stdout,
            stderr,
            exit_code,
            limit_chars=self.limits.observation_chars,
            timed_out=timed_out,
            timeout_s=self.limits.action_timeout_s,
            truncated=truncated,
        )
        self._append(self._observation_ids(text), model=False)
        self.policy.observe_step(env_s=env_s, llm_s=self._last_llm_s)
        self._last_llm_s = 0.0

    def begin_step(self) -> int:
        """An environment step starts (its exec is about to run): its number, 1-based, over
        the whole attempt — steps undone by a restore and failed ones count too."""
        self.env_steps += 1
        return self.env_steps

    def _observation_ids(self, text: str) -> list[int]:
        return list(self.observation_ids(self._last_response(), text))

    def _last_response(self) -> list[int]:
        """The model tokens at the end of the arrays (the response just appended)."""
        i = len(self.loss_mask)
        while i > 0 and self.loss_mask[i - 1] == 1:
            i -= 1
        return self.response_ids[i:]

    # --- checkpoints ----------------------------------------------------------------------
    def decide_checkpoint(
        self, *, step_s: float, now: float, elapsed_s: float = 0.0
    ) -> tuple[Decision, Pending | None]:
        """Ask the policy after an environment step; a yes comes with the L_k lengths the
        checkpoint will stand for."""
        decision = self.policy.decide(step_s=step_s, elapsed_s=elapsed_s, now=now)
        self.recovery.decisions.append(
            PolicyDecision(
                prefix=self.prefix,
                policy=self.policy.config.name,
                checkpoint=decision.checkpoint,
                reason=decision.reason,
                p=decision.p,
                regen_cost_s=decision.regen_cost_s,
                benefit=decision.benefit,
                checkpoint_cost_s=decision.checkpoint_cost_s,
                q=decision.q,
                visible_cost=decision.visible_cost,
                elapsed_s=elapsed_s,
            )
        )
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
        self._truncate(ready.response_len, ready.actions_len, ready.turn)
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
        self._truncate(0, 0, 0)
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

    def _truncate(self, response_len: int, actions_len: int, turn: int) -> None:
        del self.response_ids[response_len:]
        del self.loss_mask[response_len:]
        del self.logprobs[response_len:]
        del self.weight_versions[response_len:]
        del self.actions[actions_len:]
        self.turn = turn
        self.invalid_in_row = 0
        self._last_llm_s = 0.0
        self._pending_command = ""

    def stop(self, finish: Finish) -> Finish:
        self.finish = finish
        return finish

    def finished(self, reason: FinishReason, detail: str, reward: float) -> Finish:
        """The attempt's end after scoring."""
        return self.stop(Finish(reason, detail, reward))
