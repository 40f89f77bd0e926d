"""The supervisor's handover decision, pure (no bus, no event loop): once a shadow started
taking over an engine (``handover_detected``, or the main worker exited), what the supervisor
does when the takeover is confirmed, fails or runs past its deadline.

A handover fails when the shadow dies before the router has it as the engine's worker, or when
it is not confirmed within ``handover_timeout_s``. The router then holds the engine down for
good (a shadow's "hung" and the supervisor's "exited" reports are final), so unless something
starts a new worker the engine stays down: the supervisor falls back to a cold restart of the
engine's main worker — the path it takes when there is no shadow at all.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class HandoverAction(enum.Enum):
    WAIT = "wait"
    """Not decided yet: the shadow still works on it, or the router could not say."""
    PROMOTE = "promote"
    """The router has the shadow as the engine's worker: promote it."""
    DONE = "done"
    """Nothing (more) to do: promoted, the main worker was already replaced, the engine
    serves, or the router retired it."""
    COLD_RESTART = "cold_restart"
    """The handover failed: restart the engine's main worker cold."""


@dataclass(frozen=True)
class HandoverView:
    """What the supervisor knows when it looks (its process table and the router's registry
    entry for the engine)."""

    promoted: bool
    """The supervisor promoted the shadow meanwhile."""
    deadline_passed: bool
    """``handover_timeout_s`` passed since the handover began."""
    failed_pid: int | None
    """Pid of the main worker being replaced."""
    main_pid: int | None
    """Pid of the engine's main worker in the supervisor's table now."""
    main_alive: bool
    """That main worker still runs (hung or stalled: nobody else restarts it)."""
    shadow_pid: int | None
    """Pid of the shadow that was taking over."""
    shadow_alive: bool
    """That very shadow process still runs."""
    router_state: str | None
    """The router's state of the engine (``up``, ``down``, ``unhealthy``); None: no answer."""
    router_pid: int | None = None
    """The worker pid the router has for the engine."""


@dataclass(frozen=True)
class HandoverDecision:
    action: HandoverAction
    reason: str
    """Why (logged; for a cold restart: ``shadow_exited`` or ``deadline``)."""


def handover_decision(v: HandoverView) -> HandoverDecision:
    """Decide from ``v`` (see the module doc). A cold restart of a main worker that still
    runs needs the router's word that the engine is down; one that exited is restarted
    whatever the router says (a dead process can always be replaced)."""
    if v.promoted:
        return HandoverDecision(HandoverAction.DONE, "promoted")
    if v.main_pid != v.failed_pid:
        return HandoverDecision(HandoverAction.DONE, "main worker already replaced")
    if v.router_state == "unhealthy":
        return HandoverDecision(HandoverAction.DONE, "engine unhealthy: retired, not restarted")
    if v.router_state == "up":
        if v.router_pid == v.shadow_pid and v.shadow_alive:
            return HandoverDecision(HandoverAction.PROMOTE, "router has the shadow")
        if v.router_pid == v.main_pid and v.main_alive:
            return HandoverDecision(HandoverAction.DONE, "engine serves on its main worker")
        if v.router_pid not in (v.shadow_pid, v.main_pid):
            return HandoverDecision(HandoverAction.DONE, "engine up on another worker")
    if v.shadow_alive and not v.deadline_passed:
        return HandoverDecision(HandoverAction.WAIT, "handover under way")
    if v.main_alive and v.router_state is None:
        return HandoverDecision(HandoverAction.WAIT, "router did not answer")
    reason = "deadline" if v.shadow_alive else "shadow_exited"
    return HandoverDecision(HandoverAction.COLD_RESTART, reason)


# --- acting on an event: is what it claims confirmed? ------------------------------------
# Events only tell the supervisor when to look (anyone on the bus may publish one); each check
# below reads what the owners of the decision say — the router's registry entry for the engine
# (its state, epoch and worker pid; None: no answer) and the ``engine_epochs`` bucket — against
# the supervisor's own process table.


def promotion_confirmed(
    *,
    shadow_pid: int | None,
    shadow_alive: bool,
    router_state: str | None,
    router_pid: int | None,
    router_epoch: int | None,
    claimed_epoch: int,
) -> bool:
    """Promote the shadow only if the router has this very (live) shadow as the engine's
    worker, up, under the epoch the bucket holds (``claimed_epoch``; -1 when unreadable)."""
    return (
        shadow_pid is not None
        and shadow_alive
        and router_state == "up"
        and router_pid == shadow_pid
        and router_epoch == claimed_epoch
        and claimed_epoch >= 0
    )


def retirement_confirmed(router_state: str | None) -> bool:
    """Retire an engine only if the router lists it unhealthy."""
    return router_state == "unhealthy"


def cold_restart_confirmed(
    *, main_pid: int | None, router_state: str | None, router_pid: int | None
) -> bool:
    """Baseline: restart only the worker the router took down, and only if it is the one this
    supervisor runs."""
    return main_pid is not None and router_state == "down" and router_pid == main_pid
