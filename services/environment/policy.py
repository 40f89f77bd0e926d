"""The risk-aware checkpoint policy (Algorithm 1 of the paper). Pure: no clock, no I/O.

After each environment step t the controller asks whether a ``full_checkpoint`` is worth it:

    benefit  = p_t · C_t        p_t = 1 − exp(−λ·d_t)   (or a fixed injected probability)
    visible  = c_t · (1 − q(x; c_t))
    q(x; c)  = P(T ≥ x + c | T ≥ x)   for the LLM-response time T (empirical, online)
    checkpoint  ⇔  benefit > visible   (and not inside a timeout cooldown)

``C_t`` is the regeneration cost (LLM + env seconds) accumulated since the last ready
checkpoint; ``c_t`` the estimated checkpoint cost (an EWMA of measured checkpoints, starting
from a configured prior); ``x`` how long the current LLM response has already been running.
λ is configured, or estimated as observed failures / observed exposure seconds.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class PolicyConfig:
    """Knobs of the checkpoint policy."""

    failure_rate: float | None = None
    """λ in failures per second of exposure; None: estimate from observed failures."""
    fixed_probability: float | None = None
    """If set, p_t for every step (failure-injection experiments); overrides λ."""
    prior_failure_rate: float = 1e-3
    """λ used until a failure has been observed (and as a one-failure prior weight)."""
    prior_checkpoint_cost_s: float = 0.3
    """c_t before any checkpoint has been measured."""
    cost_ewma_alpha: float = 0.3
    """Weight of the newest measurement in the checkpoint-cost EWMA."""
    response_window: int = 256
    """How many recent LLM-response times the empirical q(x; c) uses."""
    min_responses: int = 2
    """Below this many observed responses q is 0 (no bubble assumed: conservative)."""
    cooldown_s: float = 20.0
    """Checkpointing stays disabled this long after a checkpoint timed out."""


@dataclass(frozen=True)
class Decision:
    """The policy's answer with every term, for logs and tests."""

    checkpoint: bool
    reason: str
    p: float
    regen_cost_s: float
    benefit: float
    checkpoint_cost_s: float
    q: float
    visible_cost: float


@dataclass
class CheckpointPolicy:
    """Online state of the policy for one trajectory (or one sandbox)."""

    config: PolicyConfig = field(default_factory=PolicyConfig)
    regen_cost_s: float = 0.0
    exposure_s: float = 0.0
    failures: int = 0
    cooldown_until: float = 0.0
    _cost_s: float | None = None
    _responses: deque[float] = field(default_factory=deque)
    _sorted: list[float] = field(default_factory=list)

    # --- observations -------------------------------------------------------------------
    def observe_step(self, env_s: float, llm_s: float = 0.0) -> None:
        """A step finished: its env and LLM seconds are now at risk until the next checkpoint."""
        env_s, llm_s = max(0.0, env_s), max(0.0, llm_s)
        self.regen_cost_s += env_s + llm_s
        self.exposure_s += env_s

    def observe_response(self, seconds: float) -> None:
        """One complete LLM-response time T (feeds q)."""
        if seconds < 0 or math.isnan(seconds):
            return
        self._responses.append(seconds)
        bisect.insort(self._sorted, seconds)
        if len(self._responses) > self.config.response_window:
            old = self._responses.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]

    def observe_checkpoint(self, seconds: float) -> None:
        """A checkpoint became ready after ``seconds``: update c_t, reset C_t."""
        a = self.config.cost_ewma_alpha
        self._cost_s = seconds if self._cost_s is None else a * seconds + (1 - a) * self._cost_s
        self.regen_cost_s = 0.0

    def observe_failure(self) -> None:
        """A sandbox failure happened (feeds the λ estimate)."""
        self.failures += 1

    def observe_timeout(self, now: float) -> None:
        """A checkpoint timed out: disable checkpointing for the cooldown."""
        self.cooldown_until = now + self.config.cooldown_s

    # --- estimates ----------------------------------------------------------------------
    @property
    def failure_rate(self) -> float:
        """λ: configured, else (failures + 1) / (exposure + 1/λ0), a prior worth one failure."""
        if self.config.failure_rate is not None:
            return self.config.failure_rate
        prior = self.config.prior_failure_rate
        return (self.failures + 1) / (self.exposure_s + 1.0 / prior)

    @property
    def checkpoint_cost_s(self) -> float:
        """c_t: EWMA of measured checkpoint costs (or the prior)."""
        return self.config.prior_checkpoint_cost_s if self._cost_s is None else self._cost_s

    def probability(self, step_s: float) -> float:
        """p_t for a step of ``step_s`` seconds."""
        if self.config.fixed_probability is not None:
            return min(1.0, max(0.0, self.config.fixed_probability))
        return 1.0 - math.exp(-self.failure_rate * max(0.0, step_s))

    def survival(self, t: float) -> float:
        """Empirical P(T ≥ t)."""
        n = len(self._sorted)
        if n == 0:
            return 0.0
        return (n - bisect.bisect_left(self._sorted, t)) / n

    def q(self, elapsed_s: float, cost_s: float) -> float:
        """q(x; c) = P(T ≥ x + c | T ≥ x); 0 with too little data or when x exceeds all data."""
        if len(self._sorted) < self.config.min_responses:
            return 0.0
        alive = self.survival(elapsed_s)
        if alive <= 0.0:
            return 0.0
        return min(1.0, self.survival(elapsed_s + cost_s) / alive)

    # --- the decision -------------------------------------------------------------------
    def decide(self, *, step_s: float, elapsed_s: float = 0.0, now: float = 0.0) -> Decision:
        """Algorithm 1: checkpoint now? ``step_s`` is d_t, ``elapsed_s`` is x, ``now`` the clock
        (only compared with the cooldown)."""
        p = self.probability(step_s)
        benefit = p * self.regen_cost_s
        c = self.checkpoint_cost_s
        q = self.q(elapsed_s, c)
        visible = c * (1.0 - q)
        if now < self.cooldown_until:
            return Decision(False, "cooldown", p, self.regen_cost_s, benefit, c, q, visible)
        if self.regen_cost_s <= 0.0:
            return Decision(False, "nothing_at_risk", p, 0.0, 0.0, c, q, visible)
        take = benefit > visible
        reason = "benefit_exceeds_visible_cost" if take else "visible_cost_exceeds_benefit"
        return Decision(take, reason, p, self.regen_cost_s, benefit, c, q, visible)
