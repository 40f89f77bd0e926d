"""The agent episode, once: one response → one action → its observation → … → the score.

:class:`Episode` is a pure state machine over token ids (no bus, no event loop, no clock: every
time comes in as an argument). It decides what happens next — ``Generate`` the next response,
``Execute`` the command it asked for, ``Score`` the outcome, ``Finish`` without scoring, or
``Again`` after an unparseable response — and keeps the context L_k as the prompt L_0 plus
parallel arrays (token ids, loss mask, log-probabilities, weight versions). Every user of an
episode drives this one machine, so the observation texts, the turn and context limits and the
invalid-response rule are the same everywhere:

* the controller's trajectories (``services/controller``: :class:`Episode` plus checkpoints and
  recovery, executed on the bus),
* ``belayer run``'s held-out evaluation (:func:`play` at temperature 0, publishing nothing),
* ``belayer model eval`` (:func:`play` over an in-process engine).

Each limit is declared once here (:data:`MAX_INVALID_IN_ROW`, :data:`MAX_PROMPT_TOKENS`,
:data:`MAX_CONTEXT_TOKENS`); the controller's config defaults to these values.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from schemas.rollout import ActionRecord, FinishReason, Timings
from schemas.seeds import derive_seed
from workloads.actions import (
    AnswerAction,
    BashAction,
    InvalidAction,
    SubmitAction,
    format_observation,
    invalid_action_observation,
    parse_action,
)
from workloads.base import Task

MAX_INVALID_IN_ROW = 3
"""Unparseable responses in a row before an episode ends as ``malformed``."""
MAX_PROMPT_TOKENS = 1536
"""Longest context sent as a prompt (the router's ``max_prompt_tokens``); longer ends the
episode as ``length``."""
MAX_CONTEXT_TOKENS = 2048
"""Prompt + response tokens the model takes (the tiny models' ``max_position_embeddings``)."""


@dataclass(frozen=True)
class Limits:
    """What bounds one episode (the request's, the task's and the node's, combined)."""

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


def task_limits(
    task: Task,
    *,
    max_turns: int | None = None,
    max_response_tokens: int | None = None,
    deadline_s: float = float("inf"),
    vocab_size: int = 0,
    max_invalid_in_row: int = MAX_INVALID_IN_ROW,
    max_prompt_tokens: int = MAX_PROMPT_TOKENS,
    max_context_tokens: int = MAX_CONTEXT_TOKENS,
) -> Limits:
    """The limits of an episode of ``task``: the task's own, tightened by a request's
    ``max_turns`` / ``max_response_tokens`` where given."""
    own = task.limits
    return Limits(
        max_turns=min(max_turns, own.max_turns) if max_turns else own.max_turns,
        max_invalid_in_row=max_invalid_in_row,
        max_prompt_tokens=max_prompt_tokens,
        max_context_tokens=max_context_tokens,
        max_response_tokens=(
            min(max_response_tokens, own.max_response_tokens)
            if max_response_tokens
            else own.max_response_tokens
        ),
        observation_chars=own.observation_chars,
        action_timeout_s=own.action_timeout_s,
        deadline_s=deadline_s,
        vocab_size=vocab_size,
    )


@dataclass(frozen=True)
class Generate:
    """Ask for the next response."""

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    seed: int


@dataclass(frozen=True)
class Execute:
    """Run the agent's command (wrapped for the task's workdir by whoever runs it)."""

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


@dataclass(kw_only=True)
class Episode:
    """The state of one episode. ``prompt_ids`` is L_0."""

    trajectory_id: str
    """Names its requests (``<trajectory_id>-g<n>``)."""
    prompt_ids: list[int]
    limits: Limits
    sample_seed: int
    """Seed of the sample; each response is seeded by (it, the turn)."""
    has_sandbox: bool
    started_at: float
    """Clock value (the driver's) when the episode started; the deadline counts from it."""
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

    # --- hooks (the controller's checkpoint policy and recovery log) ------------------------
    def observe_response(self, llm_s: float) -> None:
        """A response took ``llm_s`` (the controller's policy learns from it)."""

    def observe_step(self, env_s: float, llm_s: float) -> None:
        """An environment step (or an invalid response) completed."""

    def observe_resumes(self, resumes: int, now: float) -> None:
        """The response was resumed on another engine ``resumes`` times."""

    # --- turns --------------------------------------------------------------------------
    def next_generation(self, now: float) -> Generate | Score | Finish:
        """The next LLM request, or why the episode ends here: past its deadline (not scored,
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
        self.observe_response(llm_s)
        if len(versions) != len(token_ids):
            versions = [versions[-1] if versions else 0] * len(token_ids)
        self._append(list(token_ids), model=True, logprobs=list(logprobs), versions=list(versions))
        self.last_text = text
        if resumes:
            self.observe_resumes(resumes, now)
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
        self._observe(invalid_action_observation(reason))
        self.observe_step(env_s=0.0, llm_s=llm_s)
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
        self._observe(text)
        self.observe_step(env_s=env_s, llm_s=self._last_llm_s)
        self._last_llm_s = 0.0

    def _observe(self, text: str) -> None:
        self._append(list(self.observation_ids(self._last_response(), text)), model=False)

    def _last_response(self) -> list[int]:
        """The model tokens at the end of the arrays (the response just appended)."""
        i = len(self.loss_mask)
        while i > 0 and self.loss_mask[i - 1] == 1:
            i -= 1
        return self.response_ids[i:]

    def truncate(self, response_len: int, actions_len: int, turn: int) -> None:
        """Back to the context as it was with ``response_len`` tokens after L_0 (a restore)."""
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
        """The episode's end after scoring."""
        return self.stop(Finish(reason, detail, reward))


# --- a driver ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Response:
    """One generated response, as the episode takes it."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    text: str
    """The text the model meant (special tokens dropped)."""
    llm_s: float = 0.0
    resumes: int = 0


@dataclass(frozen=True)
class Observed:
    """What running a command gave."""

    stdout: str
    stderr: str
    exit_code: int
    env_s: float = 0.0
    timed_out: bool = False
    truncated: bool = False


class EpisodeIO(Protocol):
    """What :func:`play` needs from the world: a model, a sandbox (sandbox tasks) and a
    scorer. An infrastructure failure raises (the caller recovers or retries); it is never an
    observation."""

    async def generate(self, step: Generate) -> Response: ...

    async def execute(self, step: Execute) -> Observed: ...

    async def score(self, step: Score) -> float: ...


async def play(episode: Episode, io: EpisodeIO, clock: Callable[[], float]) -> Finish:
    """Drive ``episode`` to its end through ``io`` (no checkpoints, no recovery): what the
    held-out evaluation and ``belayer model eval`` run. Returns the final ``Finish`` (its
    reward is the score)."""
    while episode.finish is None:
        step: Step = episode.next_generation(clock())
        if isinstance(step, Generate):
            r = await io.generate(step)
            step = episode.on_response(
                r.token_ids, r.logprobs, r.versions, r.text,
                llm_s=r.llm_s, resumes=r.resumes, now=clock(),
            )  # fmt: skip
        if isinstance(step, Execute):
            o = await io.execute(step)
            episode.on_observation(
                stdout=o.stdout, stderr=o.stderr, exit_code=o.exit_code, env_s=o.env_s,
                timed_out=o.timed_out, truncated=o.truncated,
            )  # fmt: skip
        elif isinstance(step, Score):
            episode.finished(step.reason, step.detail, await io.score(step))
    return episode.finish
