"""The failure-injection grammar of ``belayer rollout --inject`` and when injections fire."""

from __future__ import annotations

import pytest

from services.controller.fault_specs import (
    KINDS,
    TRIGGERS,
    Trigger,
    check_specs,
    draw,
    fires_at_step,
    fires_at_turn,
    injected_probability,
    parse_inject,
)


def test_parses_the_documented_forms() -> None:
    specs = parse_inject(
        "sandbox-kill@turn=3, worker-kill@s=5,sandbox-pause@turn=2/1,sandbox-kill@p=0.05"
    )
    assert [(s.kind, s.trigger, s.value, s.target) for s in specs] == [
        ("sandbox-kill", "turn", 3.0, -1),
        ("worker-kill", "s", 5.0, -1),
        ("sandbox-pause", "turn", 2.0, 1),
        ("sandbox-kill", "p", 0.05, -1),
    ]
    assert specs[0].text == "sandbox-kill@turn=3" and specs[2].text == "sandbox-pause@turn=2/1"
    assert parse_inject("") == [] and parse_inject("  ") == []
    assert parse_inject("controller-kill@turn=1")[0].kind == "controller-kill"


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("sandbox-kill", "expected KIND@WHEN"),
        ("disk-full@turn=1", "unknown kind"),
        ("sandbox-kill@step=1", "unknown trigger"),
        ("sandbox-kill@turn", "unknown trigger"),
        ("sandbox-kill@turn=0", "T ≥ 1"),
        ("sandbox-kill@turn=2.5", "whole number"),
        ("sandbox-kill@turn=2/x", "index"),
        ("sandbox-kill@p=1.5", "probability"),
        ("sandbox-kill@p=abc", "needs a number"),
        ("sandbox-kill@p=nan", "finite"),
        ("worker-kill@s=-1", "SECONDS ≥ 0"),
        ("sandbox-kill@turn=1,,worker-kill@s=1", "empty item"),
    ],
)
def test_refuses_bad_specs_with_a_reason(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_inject(text)


def test_grammar_is_extensible() -> None:
    def step(value: str) -> tuple[float, int]:
        return float(int(value)), -1

    triggers = {**TRIGGERS, "step": Trigger(step, "step=S: at training step S")}
    specs = parse_inject("trainer-kill@step=4", kinds=(*KINDS, "trainer-kill"), triggers=triggers)
    assert specs[0].kind == "trainer-kill" and specs[0].trigger == "step" and specs[0].value == 4
    with pytest.raises(ValueError, match="cannot inject"):
        check_specs(specs, slots=4)  # the controller itself refuses what it cannot do


def test_check_specs_knows_the_slots() -> None:
    check_specs(parse_inject("sandbox-kill@turn=1/3"), slots=4)
    with pytest.raises(ValueError, match="#4 does not exist"):
        check_specs(parse_inject("sandbox-kill@turn=1/4"), slots=4)


def test_turn_fires_after_the_t_th_action_of_every_or_one_trajectory() -> None:
    every, one = parse_inject("sandbox-kill@turn=2,sandbox-kill@turn=3/1")
    assert [fires_at_turn(every, slot=0, actions=a) for a in range(5)] == [
        False, False, True, False, False
    ]  # fmt: skip
    assert fires_at_turn(every, slot=7, actions=2)
    assert fires_at_turn(one, slot=1, actions=3) and not fires_at_turn(one, slot=0, actions=3)


def test_p_draws_are_deterministic_and_have_the_right_rate() -> None:
    (spec,) = parse_inject("sandbox-kill@p=0.05")
    fired = [
        fires_at_step(spec, seed=7, slot=s, attempt=0, step=t, index=0)
        for s in range(40)
        for t in range(1, 101)
    ]
    assert 0.035 < sum(fired) / len(fired) < 0.065
    again = [
        fires_at_step(spec, seed=7, slot=s, attempt=0, step=t, index=0)
        for s in range(40)
        for t in range(1, 101)
    ]
    assert fired == again
    assert draw(7, 0, 0, 1, 0) != draw(7, 0, 1, 1, 0)  # a fresh attempt draws afresh
    (never,) = parse_inject("sandbox-kill@p=0")
    assert not any(
        fires_at_step(never, seed=1, slot=0, attempt=0, step=t, index=0) for t in range(500)
    )
    (turn,) = parse_inject("sandbox-kill@turn=1")
    assert not fires_at_step(turn, seed=1, slot=0, attempt=0, step=1, index=0)


def test_injected_probability_for_the_policy() -> None:
    assert injected_probability(parse_inject("sandbox-kill@turn=2,worker-kill@p=0.5")) is None
    p = injected_probability(parse_inject("sandbox-kill@p=0.1,sandbox-pause@p=0.1"))
    assert p == pytest.approx(1 - 0.9 * 0.9)
