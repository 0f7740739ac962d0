"""Clocks for the scheduler: it reads time only through the callable it is
given, so tests and simulations drive time by hand (trio's MockClock idea)."""
from __future__ import annotations

import math

from ..errors import invalid


class ManualClock:
    """A monotonic clock in seconds that moves only when told to."""

    def __init__(self, start: float = 0.0):
        self._now = float(start)

    def __call__(self) -> float:
        return self._now

    def advance(self, seconds: float) -> float:
        if not isinstance(seconds, (int, float)) or math.isnan(seconds) or seconds < 0:
            raise invalid(f"a clock only moves forward: advance({seconds!r})")
        self._now += seconds
        return self._now
