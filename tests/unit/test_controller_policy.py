"""The checkpoint policies: Algorithm 1 (benefit p·C against visible cost c·(1 − q)) and the
comparison policies (never, always, interval:N, young-daly)."""

from __future__ import annotations

import math

import pytest

from services.controller.policy import (
    CheckpointPolicy,
    PolicyConfig,
    PolicyKind,
    PolicyStats,
    parse_policy,
)


def test_nothing_at_risk_means_no_checkpoint() -> None:
    p = CheckpointPolicy(PolicyConfig(fixed_probability=0.5))
    d = p.decide(step_s=1.0)
    assert not d.checkpoint and d.reason == "nothing_at_risk"


def test_benefit_against_visible_cost_without_bubble_data() -> None:
    p = CheckpointPolicy(PolicyConfig(fixed_probability=0.1, prior_checkpoint_cost_s=0.3))
    p.observe_step(env_s=1.0, llm_s=1.0)  # C = 2 s → benefit 0.2 < visible 0.3 (q = 0)
    d = p.decide(step_s=1.0)
    assert not d.checkpoint and d.q == 0.0 and math.isclose(d.benefit, 0.2)
    assert d.reason == "visible_cost_exceeds_benefit"
    p.observe_step(env_s=1.0, llm_s=1.0)  # C = 4 s → benefit 0.4 > 0.3
    d = p.decide(step_s=1.0)
    assert d.checkpoint and d.reason == "benefit_exceeds_visible_cost"
    assert d.regen_cost_s == pytest.approx(4.0) and d.visible_cost == pytest.approx(0.3)


def test_q_from_an_empirical_distribution() -> None:
    p = CheckpointPolicy(PolicyConfig(fixed_probability=0.01, prior_checkpoint_cost_s=0.5))
    for t in [2.0, 3.0, 4.0, 5.0]:
        p.observe_response(t)
    p.observe_step(env_s=5.0, llm_s=5.0)  # benefit 0.1
    # x = 0: every response lasts ≥ 0.5 s → q = 1, nothing visible → checkpoint
    d = p.decide(step_s=1.0, elapsed_s=0.0)
    assert d.q == 1.0 and d.visible_cost == 0.0 and d.checkpoint
    # x = 4.8: only the 5 s response is still running and it ends in 0.2 s < c → q = 0
    d = p.decide(step_s=1.0, elapsed_s=4.8)
    assert d.q == 0.0 and not d.checkpoint
    # x = 2.5: 3 alive (3, 4, 5), 2 of them last ≥ 3.5 → q = 2/3
    assert p.q(2.5, 1.0) == pytest.approx(2 / 3)
    # P(T ≥ 3.5 | T ≥ 0) = 2/4: a checkpoint of 3.5 s fits half the bubbles
    assert p.q(0.0, 3.5) == pytest.approx(0.5)
    # beyond every observed response: no bubble assumed
    assert p.q(6.0, 0.1) == 0.0


def test_q_needs_a_few_responses_first() -> None:
    p = CheckpointPolicy(PolicyConfig(min_responses=3))
    p.observe_response(10.0)
    p.observe_response(10.0)
    assert p.q(0.0, 1.0) == 0.0  # 2 < 3 responses: conservative
    p.observe_response(10.0)
    assert p.q(0.0, 1.0) == 1.0
    p.observe_response(float("nan"))  # ignored
    p.observe_response(-1.0)
    assert p.stats is not None and p.stats.responses == 3


def test_probability_from_failure_rate_and_estimate() -> None:
    p = CheckpointPolicy(PolicyConfig(failure_rate=0.1))
    assert p.probability(2.0) == pytest.approx(1 - math.exp(-0.2))
    est = CheckpointPolicy(PolicyConfig(prior_failure_rate=0.01, prior_exposure_s=100.0))
    assert est.failure_rate == pytest.approx(0.01)  # (0 + 0.01·100) / (0 + 100)
    est.observe_step(env_s=10.0)
    est.observe_failure()
    assert est.failure_rate == pytest.approx(2 / 110)
    fixed = CheckpointPolicy(PolicyConfig(failure_rate=5.0, fixed_probability=0.05))
    assert fixed.probability(100.0) == 0.05  # the injected probability wins


def test_checkpoint_cost_ewma_and_reset() -> None:
    p = CheckpointPolicy(PolicyConfig(cost_ewma_alpha=0.5, prior_checkpoint_cost_s=1.0))
    assert p.checkpoint_cost_s == 1.0
    p.observe_step(env_s=3.0)
    p.observe_checkpoint(0.2)
    assert p.checkpoint_cost_s == pytest.approx(0.2) and p.regen_cost_s == 0.0
    p.observe_checkpoint(0.4)
    assert p.checkpoint_cost_s == pytest.approx(0.3)


def test_timeout_cooldown_disables_checkpointing() -> None:
    p = CheckpointPolicy(PolicyConfig(fixed_probability=1.0, cooldown_s=20.0))
    p.observe_step(env_s=100.0)
    p.observe_timeout(now=1000.0)
    assert p.decide(step_s=1.0, now=1010.0).reason == "cooldown"
    assert p.decide(step_s=1.0, now=1019.99).reason == "cooldown"
    assert p.decide(step_s=1.0, now=1020.0).checkpoint


@pytest.mark.parametrize("kind", ["always", "interval", "young-daly", "risk-aware"])
def test_every_policy_but_never_honours_the_cooldown(kind: PolicyKind) -> None:
    p = CheckpointPolicy(PolicyConfig(kind=kind, fixed_probability=1.0))
    p.observe_step(env_s=100.0)
    p.observe_timeout(now=0.0)
    assert p.decide(step_s=1.0, now=1.0).reason == "cooldown"


def test_response_window_slides() -> None:
    p = CheckpointPolicy(PolicyConfig(response_window=3))
    for t in [1.0, 2.0, 3.0, 10.0]:
        p.observe_response(t)
    assert p.survival(1.5) == 1.0  # 1.0 fell out of the window


def test_never_and_always() -> None:
    never = CheckpointPolicy(PolicyConfig(kind="never", fixed_probability=1.0))
    never.observe_step(env_s=1000.0)
    assert never.decide(step_s=1.0).reason == "policy_never"
    always = CheckpointPolicy(PolicyConfig(kind="always", fixed_probability=0.0))
    always.observe_step(env_s=0.001)
    d = always.decide(step_s=0.001)
    assert d.checkpoint and d.reason == "policy_always"
    assert not CheckpointPolicy(PolicyConfig(kind="always")).decide(step_s=1.0).checkpoint


def test_interval_counts_steps_since_the_last_checkpoint() -> None:
    p = CheckpointPolicy(PolicyConfig(kind="interval", interval=3))
    got = []
    for _ in range(7):
        p.observe_step(env_s=0.1, llm_s=0.1)
        d = p.decide(step_s=0.1)
        got.append(d.checkpoint)
        if d.checkpoint:
            p.observe_checkpoint(0.2)
    assert got == [False, False, True, False, False, True, False]
    p.observe_restore()
    assert p.steps_since_checkpoint == 0 and p.regen_cost_s == 0.0


def test_young_daly_interval() -> None:
    # MTBF = 1/λ = 200 s, c = 1 s → τ = √(2 · 1 · 200) = 20 s of work between checkpoints
    p = CheckpointPolicy(
        PolicyConfig(kind="young-daly", failure_rate=1 / 200, prior_checkpoint_cost_s=1.0)
    )
    assert p.young_daly_interval_s(step_s=1.0) == pytest.approx(20.0)
    p.observe_step(env_s=10.0, llm_s=9.0)
    assert p.decide(step_s=10.0).reason == "below_young_daly_interval"
    p.observe_step(env_s=0.5, llm_s=0.5)  # C = 20 s
    assert p.decide(step_s=0.5).reason == "young_daly_interval_reached"
    # a per-step probability p over steps of d seconds: λ = −ln(1 − p) / d
    q = CheckpointPolicy(
        PolicyConfig(kind="young-daly", fixed_probability=0.05, prior_checkpoint_cost_s=0.5)
    )
    lam = -math.log(0.95) / 2.0
    assert q.young_daly_interval_s(step_s=2.0) == pytest.approx(math.sqrt(2 * 0.5 / lam))
    zero = CheckpointPolicy(PolicyConfig(kind="young-daly", fixed_probability=0.0))
    assert zero.young_daly_interval_s(step_s=1.0) == math.inf


def test_shared_stats_across_trajectories() -> None:
    stats = PolicyStats(PolicyConfig(prior_failure_rate=0.01))
    a = CheckpointPolicy(stats.config, stats)
    b = CheckpointPolicy(stats.config, stats)
    for t in (1.0, 2.0):
        a.observe_response(t)
    a.observe_checkpoint(0.7)
    b.observe_failure()
    assert b.q(0.0, 0.5) == 1.0  # b sees a's response times
    assert b.checkpoint_cost_s == pytest.approx(0.7)  # and a's checkpoint cost
    assert a.failures == 1  # and a sees b's failure
    a.observe_step(env_s=3.0)
    assert a.regen_cost_s == 3.0 and b.regen_cost_s == 0.0  # what is at risk stays per sandbox


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("never", ("never", 1)),
        ("always", ("always", 1)),
        ("risk-aware", ("risk-aware", 1)),
        ("young-daly", ("young-daly", 1)),
        ("interval:4", ("interval", 4)),
        (" interval:1 ", ("interval", 1)),
    ],
)
def test_parse_policy(text: str, want: tuple[str, int]) -> None:
    assert parse_policy(text) == want


@pytest.mark.parametrize(
    "text", ["", "sometimes", "interval", "interval:0", "interval:x", "always:3"]
)
def test_parse_policy_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="policy"):
        parse_policy(text)


def test_config_checks_kind_and_interval() -> None:
    with pytest.raises(ValueError):
        PolicyConfig(kind="sometimes")  # type: ignore[arg-type]  # an unknown kind, on purpose
    with pytest.raises(ValueError):
        PolicyConfig(kind="interval", interval=0)
    assert PolicyConfig(kind="interval", interval=5).name == "interval:5"


def test_the_estimate_learns_an_injected_rate_it_is_not_told() -> None:
    """Failures injected with p = 0.05 per 0.5 s step: after a few hundred steps the estimate
    is near the truth although the prior said 0.001/s."""
    stats = PolicyStats(PolicyConfig())
    policy = CheckpointPolicy(stats.config, stats, image="swe")
    for step in range(400):
        policy.observe_step(env_s=0.5)
        if step % 20 == 0:  # 1 in 20 steps: p = 0.05
            policy.observe_failure()
    p = stats.step_probability("swe")
    assert p is not None and 0.03 < p < 0.07
    assert policy.probability(0.5) == pytest.approx(p)
    # Told the probability, the policy uses it instead (the estimate is still kept).
    oracle = CheckpointPolicy(PolicyConfig(fixed_probability=0.05), stats, image="swe")
    assert oracle.probability(0.5) == 0.05


def test_the_failure_rate_is_estimated_per_image_and_shrunk_to_the_nodes() -> None:
    stats = PolicyStats(PolicyConfig(prior_failure_rate=0.001, prior_exposure_s=60.0))
    flaky = CheckpointPolicy(stats.config, stats, image="flaky")
    sound = CheckpointPolicy(stats.config, stats, image="sound")
    for _ in range(100):
        flaky.observe_step(env_s=1.0)
        sound.observe_step(env_s=1.0)
    for _ in range(10):
        flaky.observe_failure()
    node = (10 + 0.001 * 60) / (200 + 60)
    assert stats.failure_rate == pytest.approx(node)
    # each image's prior is the other images' estimate
    from_sound, from_flaky = 0.06 / 160, 10.06 / 160
    assert flaky.failure_rate == pytest.approx((10 + from_sound * 60) / (100 + 60))
    assert sound.failure_rate == pytest.approx((0 + from_flaky * 60) / (100 + 60))
    assert flaky.failure_rate > stats.failure_rate > sound.failure_rate
    # One image alone: its estimate is the node's.
    alone = PolicyStats(PolicyConfig())
    alone.observe_exposure(30.0, "only")
    alone.observe_failure("only")
    assert alone.failure_rate_of("only") == pytest.approx(alone.failure_rate)
    # An image not seen yet borrows the node's estimate; a configured λ overrides all.
    assert CheckpointPolicy(stats.config, stats, image="new").failure_rate == stats.failure_rate
    fixed = PolicyStats(PolicyConfig(failure_rate=0.5))
    fixed.observe_failure("flaky")
    assert fixed.failure_rate_of("flaky") == 0.5
    # What the summary reports: per image and over the node, per step of average length.
    assert stats.step_probability("flaky") == pytest.approx(1 - math.exp(-flaky.failure_rate))
    assert stats.step_probability() == pytest.approx(1 - math.exp(-node))
    assert stats.step_probability("new") is None
    assert PolicyStats().step_probability() is None


def test_prior_knobs_are_checked() -> None:
    with pytest.raises(ValueError, match="prior"):
        PolicyConfig(prior_exposure_s=0.0)
