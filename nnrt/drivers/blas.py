"""Running the reference driver's BLAS calls on the calling thread only.

Why: numpy's matrix products go to a BLAS (OpenBLAS in numpy's wheels), which
splits any product above a small size (m*n*k > 256K for OpenBLAS) across its
own worker threads, one per CPU, and keeps those workers spinning for a
while after each call. The reference driver's convolutions and fully
connected layers are such products, one per operation: CONV_2D 3x3 on
1x32x32x16 is a 1024x144 by 144x16 product. A trace of a HIGH job waiting
behind a flood of those (summed up in docs/design/scheduler.md) showed
where the time went on a shared 2-vCPU host: each product forked to a
worker and joined it; the join waited until the worker got a CPU, and the
spinning workers took the CPU the app's event loop and the HIGH job needed.
A LOW operation's step took 6.8 ms of wall time (p50) instead of 0.4 ms,
4 ms of it waiting in the kernel's run queue, and HIGH waited 4.3 ms (p50)
for a boundary instead of 0.4 ms. The same product took 0.10 ms on one
thread and 0.39 ms on two there.

The scheduler's slots are the reference driver's parallelism (and each
driver service is its own process), so its kernels use one BLAS thread.
BLAS libraries keep that setting per process (OpenBLAS's pthreads build
ignores ``openblas_set_num_threads_local``'s "local": measured, a setting
made on one thread applied to every thread), so this changes the BLAS of
the whole process, as ``nnrt/memory/heap.py`` changes its allocator: an
app's own numpy products run on one thread too once a reference device
exists. ``NNRT_BLAS_THREADS=N`` picks another count; ``NNRT_BLAS_THREADS=0``
leaves the BLAS alone.

The libraries are found with threadpoolctl (OpenBLAS, MKL, BLIS: whichever
numpy loaded); without one (numpy's own fallback), nothing to do.
"""
from __future__ import annotations

import os
import threading

from ..vlog import vlog

ENV = "NNRT_BLAS_THREADS"
DEFAULT_THREADS = 1

_lock = threading.Lock()
_applied: int | None = None


def limit_blas_threads() -> int:
    """Apply the limit once per process; the thread count now in force for
    every BLAS numpy uses (0 when left alone or there is none)."""
    global _applied
    with _lock:
        if _applied is None:
            _applied = _apply()
        return _applied


def _wanted() -> int:
    value = os.environ.get(ENV, str(DEFAULT_THREADS))
    try:
        threads = int(value)
    except ValueError:
        threads = -1
    if threads < 0:
        vlog("driver", "blas: %s=%r is not a thread count; using %d", ENV, value,
             DEFAULT_THREADS)
        return DEFAULT_THREADS
    return threads


def _apply() -> int:
    threads = _wanted()
    if threads == 0:
        vlog("driver", "blas: left alone (%s=0)", ENV)
        return 0
    import numpy  # noqa: F401  (loads the BLAS threadpoolctl is to find)
    from threadpoolctl import ThreadpoolController
    libraries = ThreadpoolController().select(user_api="blas").lib_controllers
    for library in libraries:
        library.set_num_threads(threads)
        vlog("driver", "blas: %s %s (%s) runs on %d thread(s)", library.internal_api,
             library.version, library.filepath, library.get_num_threads())
    return threads if libraries else 0
