"""Execution priority and deadline values, as the HAL defines them."""
from __future__ import annotations

import enum
import math
import time

from ..errors import invalid


class Priority(enum.IntEnum):
    """Relative priority among one app's models (NeuralNetworks.h values)."""

    LOW = 90
    MEDIUM = 100
    HIGH = 110
    DEFAULT = 100


def check_priority(priority) -> Priority:
    try:
        return Priority(priority)
    except ValueError:
        raise invalid(f"priority {priority!r} is not LOW, MEDIUM or HIGH") from None


def check_deadline(deadline) -> float | None:
    """A deadline is None or an absolute ``time.monotonic()`` value in seconds."""
    if deadline is None:
        return None
    if isinstance(deadline, bool) or not isinstance(deadline, (int, float)) \
            or math.isnan(deadline):
        raise invalid(f"deadline {deadline!r} is not a monotonic-clock time in seconds")
    return float(deadline)


def deadline_in(ms: float = 0.0, *, s: float = 0.0) -> float:
    """The absolute deadline ``ms`` milliseconds (plus ``s`` seconds) from
    now, on the monotonic clock that every ``deadline=`` takes:
    ``compiled.execute(x, deadline=nnrt.deadline_in(ms=33))``."""
    for name, value in (("ms", ms), ("s", s)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value):
            raise invalid(f"deadline_in({name}={value!r}): expected a finite number")
    return time.monotonic() + ms / 1000.0 + s
