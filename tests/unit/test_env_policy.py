"""The checkpoint policy (Algorithm 1): benefit p·C against visible cost c·(1 − q)."""

from __future__ import annotations

import math

import pytest

from services.environment.policy import CheckpointPolicy, PolicyConfig


def test_nothing_at_risk_means_no_checkpoint() -> None:
    p = CheckpointPolicy(PolicyConfig(fixed_probability=0.5))
    d = p.decide(step_s=1.0)
    assert not d.checkpoint and d.reason == "nothing_at_risk"


def test_benefit_against_visible_cost_without_bubble_data() -> None:
    p = CheckpointPolicy(PolicyConfig(fixed_probability=0.1, prior_checkpoint_cost_s=0.3))
    p.observe_step(env_s=1.0, llm_s=1.0)  # C = 2 s → benefit 0.2 < visible 0.3 (q = 0)
    d = p.decide(step_s=1.0)
    assert not d.checkpoint and d.q == 0.0 and math.isclose(d.benefit, 0.2)
    p.observe_step(env_s=1.0, llm_s=1.0)  # C = 4 s → benefit 0.4 > 0.3
    assert p.decide(step_s=1.0).checkpoint


def test_q_hides_the_checkpoint_in_the_llm_bubble() -> None:
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


def test_probability_from_failure_rate_and_estimate() -> None:
    p = CheckpointPolicy(PolicyConfig(failure_rate=0.1))
    assert p.probability(2.0) == pytest.approx(1 - math.exp(-0.2))
    est = CheckpointPolicy(PolicyConfig(prior_failure_rate=0.01))
    before = est.failure_rate
    est.observe_step(env_s=10.0)
    est.observe_failure()
    assert est.failure_rate > before


def test_checkpoint_cost_ewma_and_reset() -> None:
    p = CheckpointPolicy(PolicyConfig(cost_ewma_alpha=0.5, prior_checkpoint_cost_s=1.0))
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
    assert p.decide(step_s=1.0, now=1021.0).checkpoint


def test_response_window_slides() -> None:
    p = CheckpointPolicy(PolicyConfig(response_window=3))
    for t in [1.0, 2.0, 3.0, 10.0]:
        p.observe_response(t)
    assert p.survival(1.5) == 1.0  # 1.0 fell out of the window
