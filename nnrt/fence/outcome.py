"""How a sync fence's outcome is written into its eventfd, and read back
without consuming it.

An eventfd holds a 64-bit counter; it is readable while the counter is not
zero. A fence is unsignaled while its counter is 0, and its single signaler
adds exactly one value to it:

    1                          SIGNALED (the work finished well)
    ERROR_TAG | status         ERROR, with ``status`` an ErrorStatus != NONE
                               (ERROR_TAG is bit 32, so every HAL status fits
                               in the low 32 bits)

Any other non-zero value (two signalers, a foreign writer) decodes as ERROR
with GENERAL_FAILURE and ``valid=False``: a fence whose outcome cannot be
trusted must not let anyone read the outputs it guards.

Nobody ever ``read()``s the counter: reading resets it (or decrements it with
EFD_SEMAPHORE), so the first waiter would steal the outcome from every other
waiter in every process. Instead :func:`peek_count` reads the
``eventfd-count`` line of ``/proc/self/fdinfo/<fd>`` (Linux >= 3.8), which
shows the counter without touching it. Readiness (``poll``/``epoll``/
``wait_readable``) therefore stays on for good once a fence is signaled, and
any number of waiters, in any number of processes, see the same outcome.

The rejected alternative, read-then-write-back, leaves a window in which
another process polls the fence and sees it unsignaled again, and a
non-blocking read by a second process fails with EAGAIN; both would make
``poll()`` go backwards.

:func:`encode_outcome` and :func:`decode_count` are pure; :func:`peek_count`
is the one place that does I/O.
"""
from __future__ import annotations

import enum
import os

from ..errors import ErrorStatus, NnrtError

SIGNALED_COUNT = 1
ERROR_TAG = 1 << 32
_FDINFO_DIR = "/proc/self/fdinfo"
_COUNT_KEY = b"eventfd-count:"


class FenceState(enum.Enum):
    ACTIVE = "active"
    SIGNALED = "signaled"
    ERROR = "error"


_ERROR_STATUSES = {int(s): s for s in ErrorStatus if s is not ErrorStatus.NONE}


def encode_outcome(status: ErrorStatus) -> int:
    """The value a signaler adds to the counter for ``status`` (NONE = signaled)."""
    status = ErrorStatus(status)
    if status is ErrorStatus.NONE:
        return SIGNALED_COUNT
    return ERROR_TAG | int(status)


def decode_count(count: int) -> tuple[FenceState, ErrorStatus, bool]:
    """``(state, status, valid)`` for a counter value; ``valid`` is False when the
    value is not one a single signaler writes."""
    if count == 0:
        return FenceState.ACTIVE, ErrorStatus.NONE, True
    if count == SIGNALED_COUNT:
        return FenceState.SIGNALED, ErrorStatus.NONE, True
    if count >> 32 == 1 and (count & 0xFFFFFFFF) in _ERROR_STATUSES:
        return FenceState.ERROR, _ERROR_STATUSES[count & 0xFFFFFFFF], True
    return FenceState.ERROR, ErrorStatus.GENERAL_FAILURE, False


def parse_fdinfo(text: bytes) -> int | None:
    """The eventfd counter in an fdinfo listing, or None when it is not an eventfd's."""
    for line in text.splitlines():
        if line.startswith(_COUNT_KEY):
            try:
                return int(line[len(_COUNT_KEY):].strip(), 16)  # the kernel prints hex
            except ValueError:
                return None
    return None


def peek_count(fd: int) -> int:
    """The eventfd counter of ``fd``, read without consuming it.

    INVALID_ARGUMENT when ``fd`` is not open or not an eventfd.
    """
    try:
        info = os.open(f"{_FDINFO_DIR}/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        if not os.path.isdir(_FDINFO_DIR):
            raise NnrtError(ErrorStatus.GENERAL_FAILURE,
                            f"sync fences need {_FDINFO_DIR} (Linux with procfs mounted)") from None
        raise NnrtError(ErrorStatus.INVALID_ARGUMENT, f"fd {fd} is not an open file descriptor") from None
    try:
        text = os.read(info, 4096)
    finally:
        os.close(info)
    count = parse_fdinfo(text)
    if count is None:
        raise NnrtError(ErrorStatus.INVALID_ARGUMENT, f"fd {fd} is not an eventfd")
    return count
