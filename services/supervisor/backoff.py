"""Restart policy (pure): exponential backoff, reset after a stable run."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Backoff:
    """Delay before the next restart of one service."""

    initial: float = 0.5
    maximum: float = 10.0
    stable_after: float = 30.0
    current: float = 0.0
    restarts: int = 0

    def next_delay(self, ran_for: float) -> float:
        """Delay before restarting a service that exited after running ``ran_for`` seconds."""
        if ran_for >= self.stable_after or self.current == 0.0:
            self.current = self.initial
        else:
            self.current = min(self.maximum, self.current * 2)
        self.restarts += 1
        return self.current
