"""The supervisor's handover decision (``services/supervisor/policy.py``): a confirmed takeover
is promoted, a failed one — the shadow died, or the deadline passed — falls back to a cold
restart of the main worker, and a main worker that still runs is restarted only on the
router's word that the engine is down."""

from __future__ import annotations

from dataclasses import replace
from typing import TypedDict

import pytest

from services.supervisor.policy import (
    HandoverAction,
    HandoverView,
    cold_restart_confirmed,
    handover_decision,
    promotion_confirmed,
    retirement_confirmed,
)

MAIN, SHADOW = 100, 200
UNDER_WAY = HandoverView(
    promoted=False,
    deadline_passed=False,
    failed_pid=MAIN,
    main_pid=MAIN,
    main_alive=True,
    shadow_pid=SHADOW,
    shadow_alive=True,
    router_state="down",
    router_pid=MAIN,
)
"""A shadow taking over from a hung main worker: the router took the engine down."""


def decide(**changes: object) -> tuple[HandoverAction, str]:
    d = handover_decision(replace(UNDER_WAY, **changes))  # type: ignore[arg-type]  # fields by name
    return d.action, d.reason


def test_a_takeover_under_way_is_waited_for() -> None:
    assert decide() == (HandoverAction.WAIT, "handover under way")


def test_a_confirmed_takeover_is_promoted_or_done() -> None:
    assert decide(router_state="up", router_pid=SHADOW)[0] is HandoverAction.PROMOTE
    assert decide(promoted=True, shadow_alive=False)[0] is HandoverAction.DONE
    assert decide(main_pid=MAIN + 1)[0] is HandoverAction.DONE  # already restarted


def test_a_shadow_that_dies_during_the_takeover_falls_back_to_a_cold_restart() -> None:
    """The observed bug: the shadow's health check timed out, it exited, and the hung (or
    meanwhile resumed) main worker was never restarted — the engine stayed down."""
    assert decide(shadow_alive=False) == (HandoverAction.COLD_RESTART, "shadow_exited")
    assert decide(shadow_alive=False, main_alive=False)[0] is HandoverAction.COLD_RESTART


def test_a_takeover_past_its_deadline_falls_back_to_a_cold_restart() -> None:
    assert decide(deadline_passed=True) == (HandoverAction.COLD_RESTART, "deadline")
    # the shadow registered but died: the router's "up" names a dead worker
    got = decide(deadline_passed=True, shadow_alive=False, router_state="up", router_pid=SHADOW)
    assert got == (HandoverAction.COLD_RESTART, "shadow_exited")


@pytest.mark.parametrize(
    ("changes", "action"),
    [
        # a forged handover_detected about a healthy worker: the router has it up
        (dict(router_state="up", router_pid=MAIN, deadline_passed=True), HandoverAction.DONE),
        # another worker (a restarted shadow) already serves the engine
        (dict(router_state="up", router_pid=999, shadow_alive=False), HandoverAction.DONE),
        # the router retired the engine: not restarted
        (dict(router_state="unhealthy", shadow_alive=False), HandoverAction.DONE),
        # the router did not answer: a running worker is not killed on a guess
        (dict(router_state=None, router_pid=None, shadow_alive=False), HandoverAction.WAIT),
    ],
)
def test_a_running_main_worker_is_restarted_only_when_the_router_has_the_engine_down(
    changes: dict[str, object], action: HandoverAction
) -> None:
    assert decide(**changes)[0] is action


def test_an_exited_main_worker_is_restarted_even_without_the_router() -> None:
    got = decide(main_alive=False, shadow_alive=False, router_state=None, router_pid=None)
    assert got == (HandoverAction.COLD_RESTART, "shadow_exited")


class Promotion(TypedDict):
    """``promotion_confirmed``'s arguments, typed so that ``**`` checks them."""

    shadow_pid: int | None
    shadow_alive: bool
    router_state: str | None
    router_pid: int | None
    router_epoch: int | None
    claimed_epoch: int


def test_a_promotion_needs_the_router_and_the_bucket_to_agree() -> None:
    ok = Promotion(shadow_pid=7, shadow_alive=True, router_state="up", router_pid=7,
                   router_epoch=3, claimed_epoch=3)  # fmt: skip
    assert promotion_confirmed(**ok)
    assert not promotion_confirmed(**(ok | {"shadow_alive": False}))
    assert not promotion_confirmed(**(ok | {"router_pid": 8}))  # the router has another worker
    assert not promotion_confirmed(**(ok | {"router_epoch": 2}))  # a stale registration
    assert not promotion_confirmed(**(ok | {"claimed_epoch": -1}))  # the bucket was unreadable
    assert not promotion_confirmed(**(ok | {"router_state": None}))  # no answer from the router
    assert not promotion_confirmed(**(ok | {"router_state": "down"}))


def test_retirement_and_cold_restart_need_the_routers_word() -> None:
    assert retirement_confirmed("unhealthy")
    assert not retirement_confirmed("down") and not retirement_confirmed(None)
    assert cold_restart_confirmed(main_pid=5, router_state="down", router_pid=5)
    assert not cold_restart_confirmed(main_pid=5, router_state="down", router_pid=6)
    assert not cold_restart_confirmed(main_pid=5, router_state="up", router_pid=5)
    assert not cold_restart_confirmed(main_pid=None, router_state="down", router_pid=None)
