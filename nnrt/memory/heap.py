"""Keeping freed tensor memory in the process (glibc ``mallopt``).

Why: the executor gets a fresh numpy array from every kernel, and frees the
one before. With glibc's defaults an array above the mmap threshold (128 KiB,
raised only as big blocks are freed) is mmapped and unmapped each time, and
a free top of the heap past the trim threshold goes back to the kernel, so
an operation page-faults its output in again, every time.
``benchmarks/heap.py``: a 30-operation chain on 512x512 float32 took 25.5 ms
per run on the main thread and 16.3 ms on another thread with the defaults,
8.8 and 8.9 ms with the settings below (2.9x and 1.8x).

The cost: memory freed by a large model's run stays in the process (up to
``TRIM_THRESHOLD`` per arena) instead of returning to the kernel, so the
resident size stays near its peak. ``NNRT_KEEP_FREED_MEMORY=0`` leaves the
allocator alone. On a libc without ``mallopt`` (musl) this does nothing.
"""
from __future__ import annotations

import ctypes
import os
import threading
import time

from ..handoff import run_soon
from ..vlog import vlog

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20   # glibc's largest: blocks below it come from the heap
TRIM_THRESHOLD = 256 << 20  # free heap top kept before giving memory back

_lock = threading.Lock()
_applied: bool | None = None
# give_back_soon: a trim is waiting to run; when the last one ran.
GIVE_BACK_INTERVAL = 0.5    # seconds at least between two trims
_give_back_pending = False
_given_back_at = 0.0


def keep_freed_memory() -> bool:
    """Apply the settings once per process; True when they are in force."""
    global _applied
    with _lock:
        if _applied is None:
            _applied = _apply()
        return _applied


def _apply() -> bool:
    if os.environ.get("NNRT_KEEP_FREED_MEMORY", "1") == "0":
        vlog("driver", "heap: left alone (NNRT_KEEP_FREED_MEMORY=0)")
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        vlog("driver", "heap: this libc has no mallopt; allocator left alone")
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and \
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    vlog("driver", "heap: mmap threshold %d, trim threshold %d: %s", MMAP_THRESHOLD,
         TRIM_THRESHOLD, "applied" if ok else "refused by mallopt")
    return ok


def give_back_freed_memory() -> None:
    """Return the free memory of every arena to the kernel now
    (``malloc_trim(0)``), whatever the trim threshold above. For memory a
    peer made us hold and then let go of -- a service's buffer of a huge
    unfinished frame -- which must not stay in the process. No-op without
    glibc."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim.argtypes = (ctypes.c_size_t,)
    trim(0)


def give_back_soon() -> None:
    """:func:`give_back_freed_memory` on a worker thread, soon, for what a
    departed peer held (its connection's buffers, its prepared models, a
    policy file read): calls while one is pending make one trim, and trims
    run at least ``GIVE_BACK_INTERVAL`` apart, so peers that connect and
    leave in a loop cost one trim every half second, not one each."""
    global _give_back_pending
    with _lock:
        if _give_back_pending:
            return
        _give_back_pending = True
    run_soon(_give_back_later)


def _give_back_later() -> None:
    global _give_back_pending, _given_back_at
    wait = _given_back_at + GIVE_BACK_INTERVAL - time.monotonic()
    if wait > 0:
        time.sleep(wait)
    with _lock:
        _give_back_pending = False
    give_back_freed_memory()
    _given_back_at = time.monotonic()
