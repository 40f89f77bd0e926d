"""Pure core of sandbox placement across environment hosts: which registered host takes the
next sandbox (the most free capacity), and which registrations still count. No I/O here
(the client reads the registrations from KV ``env_hosts``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from schemas.env import EnvHostInfo

STALE_AFTER_S = 10.0
"""A registration not refreshed for this long is not placed on (hosts refresh every
``EnvConfig.register_every_s``, 2 s by default)."""


def fresh(
    hosts: Iterable[EnvHostInfo], now: float, stale_after_s: float = STALE_AFTER_S
) -> list[EnvHostInfo]:
    """The registrations refreshed within ``stale_after_s`` of ``now``."""
    return [h for h in hosts if now - h.ts <= stale_after_s]


def free_capacity(host: EnvHostInfo, placed: Mapping[str, int]) -> int:
    """Sandboxes ``host`` can still take: its capacity less its live sandboxes and those
    placed on it since its registration was read (``placed``)."""
    return host.capacity - host.sandboxes - placed.get(host.host, 0)


def choose_host(
    hosts: Iterable[EnvHostInfo],
    *,
    placed: Mapping[str, int] | None = None,
    exclude: Iterable[str] = (),
) -> str | None:
    """The host with the most free capacity (ties: the name, so the choice is stable), not one
    of ``exclude``; ``None`` when no host has room."""
    left = set(exclude)
    best: tuple[int, str] | None = None
    for h in hosts:
        if h.host in left:
            continue
        room = free_capacity(h, placed or {})
        if room > 0 and (best is None or (room, _neg(h.host)) > (best[0], _neg(best[1]))):
            best = (room, h.host)
    return best[1] if best else None


def _neg(name: str) -> tuple[int, ...]:
    """A key that orders names in reverse (so that ``max`` prefers the smaller name)."""
    return tuple(-ord(c) for c in name)
