"""Checkpoint policies, the risk-aware one being Algorithm 1 of the paper. Pure: no clock, no I/O.

After each environment step t the controller asks whether a ``full_checkpoint`` is worth it.
``risk-aware`` (the default):

    benefit  = p_t · C_t        p_t = 1 − exp(−λ·d_t)   (or a fixed injected probability)
    visible  = c_t · (1 − q(x; c_t))
    q(x; c)  = P(T ≥ x + c | T ≥ x)   for the LLM-response time T (empirical, online)
    checkpoint  ⇔  benefit > visible   (and not inside a timeout cooldown)

``C_t`` is the regeneration cost (LLM + env seconds) accumulated since the last ready
checkpoint; ``c_t`` the estimated checkpoint cost (an EWMA of measured checkpoints, starting
from a configured prior); ``x`` how long the current LLM response has already been running
(0 when the decision is taken right after the step, before the next request). λ is configured,
or estimated from the failures observed, per environment image: a Gamma prior (rate
``prior_failure_rate`` worth ``prior_exposure_s`` seconds of exposure) updated online,

    λ̂_node  = (F + λ0·E0) / (E + E0)                F failures in E seconds of exposure
    λ̂_other = (F − F_i + λ0·E0) / (E − E_i + E0)    the other images' data
    λ̂_image = (F_i + λ̂_other·E0) / (E_i + E0)       the image's own, shrunk to the others'

so an image that fails often is not hidden by the others, one seen for a few seconds borrows
the others' rate, and with a single image λ̂_image = λ̂_node. ``fixed_probability`` (an oracle: a benchmark passes the probability
it injects) replaces the estimate.

The others, for comparison: ``never``; ``always`` (after every step); ``interval:N`` (every N
steps); ``young-daly`` (whenever C_t reaches the Young/Daly interval √(2·c·MTBF), MTBF = 1/λ).
Every policy but ``never`` honours the cooldown after a checkpoint timed out.

The statistics (response times, checkpoint costs, failures, exposure) describe the node, not
one trajectory: ``PolicyStats`` is shared by every trajectory's ``CheckpointPolicy``, which
keeps only what is at risk in its own sandbox.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from schemas.rollout import PolicyDecision

PolicyKind = Literal["risk-aware", "always", "never", "interval", "young-daly"]
KINDS: tuple[str, ...] = ("risk-aware", "always", "never", "interval", "young-daly")


@dataclass(frozen=True)
class PolicyConfig:
    """Knobs of the checkpoint policy."""

    failure_rate: float | None = None
    """λ in failures per second of exposure; None: estimate from observed failures."""
    fixed_probability: float | None = None
    """If set, p_t for every step (an oracle: the probability a benchmark injects); overrides
    λ and the estimate."""
    prior_failure_rate: float = 1e-3
    """λ0: the estimate before any exposure (the prior's mean)."""
    prior_exposure_s: float = 60.0
    """E0: the prior's weight in seconds of exposure (λ0·E0 pseudo-failures): small, so a
    few observed failures move the estimate within one rollout."""
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
    kind: PolicyKind = "risk-aware"
    """Which policy decides (see the module docstring)."""
    interval: int = 1
    """``interval``: checkpoint every this many environment steps."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown checkpoint policy {self.kind!r} (one of {', '.join(KINDS)})")
        if self.interval < 1:
            raise ValueError(f"interval must be >= 1, got {self.interval}")
        if self.prior_failure_rate < 0 or self.prior_exposure_s <= 0:
            raise ValueError("prior_failure_rate must be >= 0 and prior_exposure_s > 0")

    @property
    def name(self) -> str:
        """The policy as ``parse_policy`` reads it (``interval:3``)."""
        return f"interval:{self.interval}" if self.kind == "interval" else self.kind


def parse_policy(text: str) -> tuple[PolicyKind, int]:
    """``never|always|risk-aware|interval:N|young-daly`` → (kind, interval). Raises
    ``ValueError`` naming the accepted forms."""
    name, _, arg = text.strip().partition(":")
    forms = "never, always, risk-aware, interval:N (N ≥ 1), young-daly"
    if name == "interval":
        if not arg.isdigit() or int(arg) < 1:
            raise ValueError(f"policy {text!r}: interval needs a whole number N ≥ 1 ({forms})")
        return "interval", int(arg)
    if arg or name not in KINDS:
        raise ValueError(f"unknown checkpoint policy {text!r} (one of: {forms})")
    return name, 1  # type: ignore[return-value]  # name is one of KINDS (checked above)


@dataclass
class Exposure:
    """What one environment image (or the whole node) was seen to go through."""

    seconds: float = 0.0
    """Environment seconds at risk."""
    steps: int = 0
    """Environment steps those seconds came from."""
    failures: int = 0
    """Sandbox failures observed."""


@dataclass
class PolicyStats:
    """Online estimates shared by the trajectories of one controller."""

    config: PolicyConfig = field(default_factory=PolicyConfig)
    exposure_s: float = 0.0
    failures: int = 0
    steps: int = 0
    images: dict[str, Exposure] = field(default_factory=dict)
    """Per environment image (``""``: a task without a sandbox image named)."""
    _cost_s: float | None = None
    _responses: deque[float] = field(default_factory=deque)
    _sorted: list[float] = field(default_factory=list)

    def observe_exposure(self, env_s: float, image: str = "") -> None:
        """One environment step of ``env_s`` seconds in a sandbox of ``image``."""
        env_s = max(0.0, env_s)
        own = self.images.setdefault(image, Exposure())
        self.exposure_s += env_s
        self.steps += 1
        own.seconds += env_s
        own.steps += 1

    def observe_response(self, seconds: float) -> None:
        """One complete LLM-response time T (feeds q)."""
        if seconds < 0 or math.isnan(seconds):
            return
        self._responses.append(seconds)
        bisect.insort(self._sorted, seconds)
        if len(self._responses) > self.config.response_window:
            old = self._responses.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]

    def observe_checkpoint_cost(self, seconds: float) -> None:
        a = self.config.cost_ewma_alpha
        self._cost_s = seconds if self._cost_s is None else a * seconds + (1 - a) * self._cost_s

    def observe_failure(self, image: str = "") -> None:
        """A sandbox failure of ``image``."""
        self.failures += 1
        self.images.setdefault(image, Exposure()).failures += 1

    @property
    def failure_rate(self) -> float:
        """λ over the node: configured, else (F + λ0·E0) / (E + E0)."""
        if self.config.failure_rate is not None:
            return self.config.failure_rate
        e0 = self.config.prior_exposure_s
        return (self.failures + self.config.prior_failure_rate * e0) / (self.exposure_s + e0)

    def failure_rate_of(self, image: str) -> float:
        """λ of one image: configured, else its own failures and exposure with the other
        images' estimate as its prior (an image not seen yet: the node's)."""
        own = self.images.get(image)
        if self.config.failure_rate is not None or own is None:
            return self.failure_rate
        e0, lam0 = self.config.prior_exposure_s, self.config.prior_failure_rate
        others = (self.failures - own.failures + lam0 * e0) / (
            max(0.0, self.exposure_s - own.seconds) + e0
        )
        return (own.failures + others * e0) / (own.seconds + e0)

    def step_probability(self, image: str | None = None) -> float | None:
        """The estimated failure probability of one environment step of average length,
        1 − exp(−λ̂·d̄), for ``image`` (None: over the node, λ̂_node and the node's d̄); None
        before a step was seen. What the policy believes, comparable with an injected
        per-step probability."""
        seen = (
            Exposure(self.exposure_s, self.steps, self.failures)
            if image is None
            else self.images.get(image)
        )
        if seen is None or seen.steps == 0:
            return None
        rate = self.failure_rate if image is None else self.failure_rate_of(image)
        return 1.0 - math.exp(-rate * seen.seconds / seen.steps)

    @property
    def checkpoint_cost_s(self) -> float:
        """c_t: EWMA of measured checkpoint costs (or the prior)."""
        return self.config.prior_checkpoint_cost_s if self._cost_s is None else self._cost_s

    @property
    def responses(self) -> int:
        return len(self._sorted)

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


@dataclass
class CheckpointPolicy:
    """The policy of one trajectory (one sandbox): what is at risk since its last ready
    checkpoint, its cooldown, and the shared ``stats``."""

    config: PolicyConfig = field(default_factory=PolicyConfig)
    stats: PolicyStats | None = None
    """Shared estimates; None: a private ``PolicyStats`` with this config."""
    image: str = ""
    """The sandbox's environment image: its failures and exposure feed, and its λ reads,
    that image's estimate."""
    regen_cost_s: float = 0.0
    steps_since_checkpoint: int = 0
    cooldown_until: float = 0.0

    def __post_init__(self) -> None:
        if self.stats is None:
            self.stats = PolicyStats(self.config)

    @property
    def _stats(self) -> PolicyStats:
        assert self.stats is not None
        return self.stats

    # --- observations -------------------------------------------------------------------
    def observe_step(self, env_s: float, llm_s: float = 0.0) -> None:
        """A step finished: its env and LLM seconds are now at risk until the next checkpoint."""
        env_s, llm_s = max(0.0, env_s), max(0.0, llm_s)
        self.regen_cost_s += env_s + llm_s
        self.steps_since_checkpoint += 1
        self._stats.observe_exposure(env_s, self.image)

    def observe_response(self, seconds: float) -> None:
        """One complete LLM-response time T (feeds q)."""
        self._stats.observe_response(seconds)

    def observe_checkpoint(self, seconds: float) -> None:
        """A checkpoint became ready after ``seconds``: update c_t, reset C_t."""
        self._stats.observe_checkpoint_cost(seconds)
        self.regen_cost_s = 0.0
        self.steps_since_checkpoint = 0

    def observe_restore(self) -> None:
        """The sandbox and context went back to a ready prefix (or L_0): nothing after it is
        at risk any more."""
        self.regen_cost_s = 0.0
        self.steps_since_checkpoint = 0

    def observe_failure(self) -> None:
        """A sandbox failure happened (feeds the λ estimate of this sandbox's image)."""
        self._stats.observe_failure(self.image)

    def observe_timeout(self, now: float) -> None:
        """A checkpoint timed out: disable checkpointing for the cooldown."""
        self.cooldown_until = now + self.config.cooldown_s

    # --- estimates ----------------------------------------------------------------------
    @property
    def exposure_s(self) -> float:
        return self._stats.exposure_s

    @property
    def failures(self) -> int:
        return self._stats.failures

    @property
    def failure_rate(self) -> float:
        """λ for this sandbox: its image's estimate (or the configured λ)."""
        return self._stats.failure_rate_of(self.image)

    @property
    def checkpoint_cost_s(self) -> float:
        return self._stats.checkpoint_cost_s

    def probability(self, step_s: float) -> float:
        """p_t for a step of ``step_s`` seconds."""
        if self.config.fixed_probability is not None:
            return min(1.0, max(0.0, self.config.fixed_probability))
        return 1.0 - math.exp(-self.failure_rate * max(0.0, step_s))

    def survival(self, t: float) -> float:
        return self._stats.survival(t)

    def q(self, elapsed_s: float, cost_s: float) -> float:
        return self._stats.q(elapsed_s, cost_s)

    def young_daly_interval_s(self, step_s: float) -> float:
        """√(2·c·MTBF) with MTBF = 1/λ (λ from a fixed per-step probability: −ln(1−p)/d_t)."""
        p = self.config.fixed_probability
        if p is not None:
            if p <= 0.0:
                return math.inf
            rate = -math.log(max(1e-12, 1.0 - min(p, 1.0 - 1e-12))) / max(step_s, 1e-3)
        else:
            rate = self.failure_rate
        if rate <= 0.0:
            return math.inf
        return math.sqrt(2.0 * self.checkpoint_cost_s / rate)

    # --- the decision -------------------------------------------------------------------
    def decide(
        self, *, step_s: float, elapsed_s: float = 0.0, now: float = 0.0, prefix: int = 0
    ) -> PolicyDecision:
        """Checkpoint now? ``step_s`` is d_t, ``elapsed_s`` is x, ``now`` the clock (only
        compared with the cooldown), ``prefix`` the action boundary k it is about. The answer
        with every term is the record the trajectory's recovery log keeps."""
        p = self.probability(step_s)
        benefit = p * self.regen_cost_s
        c = self.checkpoint_cost_s
        q = self.q(elapsed_s, c)
        visible = c * (1.0 - q)

        def answer(take: bool, reason: str) -> PolicyDecision:
            return PolicyDecision(
                prefix=prefix, policy=self.config.name, checkpoint=take, reason=reason, p=p,
                regen_cost_s=self.regen_cost_s, benefit=benefit, checkpoint_cost_s=c, q=q,
                visible_cost=visible, elapsed_s=elapsed_s,
            )  # fmt: skip

        kind = self.config.kind
        if kind == "never":
            return answer(False, "policy_never")
        if now < self.cooldown_until:
            return answer(False, "cooldown")
        if self.regen_cost_s <= 0.0 and self.steps_since_checkpoint == 0:
            return answer(False, "nothing_at_risk")
        if kind == "always":
            return answer(True, "policy_always")
        if kind == "interval":
            due = self.steps_since_checkpoint >= self.config.interval
            return answer(due, "interval_reached" if due else "interval_not_reached")
        if kind == "young-daly":
            due = self.regen_cost_s >= self.young_daly_interval_s(step_s)
            return answer(
                due, "young_daly_interval_reached" if due else "below_young_daly_interval"
            )
        if self.regen_cost_s <= 0.0:
            return answer(False, "nothing_at_risk")
        take = benefit > visible
        return answer(
            take, "benefit_exceeds_visible_cost" if take else "visible_cost_exceeds_benefit"
        )
