"""The failure-injection grammar of ``belayer rollout --inject`` and when an injection fires.
Pure: no clock, no I/O (the controller's ``fault_actions.py`` carries out what this decides).

    SPEC    := ITEM ("," ITEM)*
    ITEM    := KIND "@" TRIGGER "=" VALUE
    KIND    := sandbox-kill | sandbox-pause | worker-kill | controller-kill
    TRIGGER := turn   VALUE = T or T/i   after the T-th action of every trajectory (or of #i)
             | p      VALUE = P          with probability P per environment step
             | s      VALUE = SECONDS    that long into the rollout

Examples: ``sandbox-kill@turn=3``, ``sandbox-pause@turn=2/0``, ``worker-kill@s=5``,
``sandbox-kill@p=0.05``. Other front ends extend it by passing their own ``kinds`` and
``triggers`` (the trainer adds ``step=S``, ``trainer-kill``, ``shadow-kill``); the controller
refuses what it cannot carry out.

Sandbox kinds hit the trajectory's own container; process kinds (``worker-kill``,
``controller-kill``) with ``turn=T`` fire once per rollout, at the first trajectory to get
there (or at ``#i``), since killing the same worker for every trajectory would only retire the
engine. ``p`` draws are deterministic per (rollout seed, slot, attempt, step, spec).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from schemas.rollout import FaultSpec
from schemas.seeds import MASK64, splitmix64

SANDBOX_KINDS = ("sandbox-kill", "sandbox-pause")
PROCESS_KINDS = ("worker-kill", "controller-kill")
KINDS: tuple[str, ...] = SANDBOX_KINDS + PROCESS_KINDS
"""The kinds the controller carries out."""


@dataclass(frozen=True)
class Trigger:
    """How one trigger's value is written and read."""

    parse: Callable[[str], tuple[float, int]]
    """VALUE text → (value, target slot or -1); raises ``ValueError`` with the reason."""
    help: str


def _turn(text: str) -> tuple[float, int]:
    turn, _, target = text.partition("/")
    if not turn.isdigit() or int(turn) < 1:
        raise ValueError("turn=T needs a whole number T ≥ 1 (turn=T or turn=T/i)")
    if target and not target.isdigit():
        raise ValueError("turn=T/i needs a trajectory index i ≥ 0")
    return float(int(turn)), int(target) if target else -1


def _probability(text: str) -> tuple[float, int]:
    p = _number(text, "p=P")
    if not 0.0 <= p <= 1.0:
        raise ValueError("p=P needs a probability 0 ≤ P ≤ 1")
    return p, -1


def _seconds(text: str) -> tuple[float, int]:
    s = _number(text, "s=SECONDS")
    if s < 0.0:
        raise ValueError("s=SECONDS needs SECONDS ≥ 0")
    return s, -1


def _number(text: str, form: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{form} needs a number, not {text!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"{form} needs a finite number")
    return value


TRIGGERS: dict[str, Trigger] = {
    "turn": Trigger(_turn, "turn=T[/i]: after the T-th action (of trajectory #i)"),
    "p": Trigger(_probability, "p=P: with probability P per environment step"),
    "s": Trigger(_seconds, "s=SECONDS: that long into the rollout"),
}


def parse_inject(
    text: str,
    *,
    kinds: tuple[str, ...] = KINDS,
    triggers: Mapping[str, Trigger] = TRIGGERS,
) -> list[FaultSpec]:
    """Parse a comma-separated ``KIND@TRIGGER=VALUE`` list; empty text → []. Raises
    ``ValueError`` naming the bad item and what would be accepted."""
    specs: list[FaultSpec] = []
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            if text.strip():
                raise ValueError(f"empty item in injection spec {text!r}")
            continue
        kind, at, when = item.partition("@")
        if not at:
            raise ValueError(f"{item!r}: expected KIND@WHEN, e.g. sandbox-kill@turn=3")
        if kind not in kinds:
            raise ValueError(f"{item!r}: unknown kind {kind!r} (one of {', '.join(kinds)})")
        name, eq, value = when.partition("=")
        if not eq or name not in triggers:
            forms = "; ".join(t.help for t in triggers.values())
            raise ValueError(f"{item!r}: unknown trigger {when!r} ({forms})")
        try:
            number, target = triggers[name].parse(value.strip())
        except ValueError as exc:
            raise ValueError(f"{item!r}: {exc}") from None
        specs.append(FaultSpec(kind=kind, trigger=name, value=number, target=target, text=item))
    return specs


def check_specs(specs: list[FaultSpec], slots: int) -> None:
    """Refuse (``ValueError``) specs this controller cannot carry out for ``slots`` slots."""
    for spec in specs:
        name = spec.text or f"{spec.kind}@{spec.trigger}={spec.value}"
        if spec.kind not in KINDS:
            raise ValueError(f"{name!r}: the controller cannot inject {spec.kind!r}")
        if spec.trigger not in TRIGGERS:
            raise ValueError(f"{name!r}: the controller does not know trigger {spec.trigger!r}")
        if spec.trigger == "turn" and (spec.value < 1 or spec.value != int(spec.value)):
            raise ValueError(f"{name!r}: turn needs a whole number ≥ 1")
        if spec.trigger == "p" and not 0.0 <= spec.value <= 1.0:
            raise ValueError(f"{name!r}: p needs a probability 0 ≤ P ≤ 1")
        if spec.target >= slots:
            raise ValueError(f"{name!r}: trajectory #{spec.target} does not exist ({slots} slots)")


def spec_key(index: int, spec: FaultSpec) -> str:
    """Stable name of spec ``index`` of a request (what ``fired`` lists hold)."""
    return f"{index}:{spec.text or spec.kind}"


def draw(seed: int, slot: int, attempt: int, step: int, index: int) -> float:
    """A deterministic uniform number in [0, 1) for a ``p`` injection."""
    x = splitmix64(seed & MASK64)
    for part in (slot, attempt, step, index):
        x = splitmix64((x + 0xA24BAED4963EE407 * (part + 1)) & MASK64)
    return (x >> 11) / float(1 << 53)


def fires_at_turn(spec: FaultSpec, slot: int, actions: int) -> bool:
    """Does a ``turn`` spec fire for ``slot`` right after its ``actions``-th action?"""
    if spec.trigger != "turn" or actions != int(spec.value):
        return False
    return spec.target in (-1, slot)


def fires_at_step(
    spec: FaultSpec, *, seed: int, slot: int, attempt: int, step: int, index: int
) -> bool:
    """Does a ``p`` spec fire at the start of environment step ``step`` (1-based)?"""
    if spec.trigger != "p" or spec.value <= 0.0:
        return False
    return draw(seed, slot, attempt, step, index) < spec.value


def injected_probability(specs: list[FaultSpec]) -> float | None:
    """The per-step sandbox failure probability the injections amount to (for the policy's
    p_t), or None when no sandbox injection is probabilistic."""
    ps = [s.value for s in specs if s.trigger == "p" and s.kind in SANDBOX_KINDS]
    if not ps:
        return None
    survive = 1.0
    for p in ps:
        survive *= 1.0 - p
    return 1.0 - survive
