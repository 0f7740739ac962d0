"""Handing work to threads and results back to the thread or event loop that
waits for them: the two moves every driver makes between an app's loop and
the threads that do the work.

:class:`Waiter` is a one-shot result box: any thread calls ``deliver``; the
task that made it (asyncio or trio, through anyio) ``await``s ``wait()``, or
a blocked thread calls ``wait_blocking()``. Delivery posts straight to the
waiting loop (``call_soon_threadsafe`` / ``TrioToken.run_sync_soon``), so a
result costs one wake-up of the loop, whichever thread produced it.

:func:`run_soon` runs a callable on an idle worker thread (a new one when
none is idle) and returns at once: unlike ``anyio.to_thread.run_sync`` the
caller does not wait for the return, so the result can come back through a
``Waiter`` from a different thread than the one that started (a job another
thread ran on its behalf: see :meth:`nnrt.qos.gate.ExecutionGate.checkpoint`).
"""
from __future__ import annotations

import asyncio
import os
import queue
import sys
import threading
from typing import Any, Callable

import anyio
import anyio.lowlevel

from .vlog import vlog

_PENDING = object()


class Waiter:
    """One value, delivered once from any thread."""

    __slots__ = ("value", "_event", "_post", "_thread_event", "_taken")

    def __init__(self, blocking: bool = False):
        """``blocking``: the waiter is a thread (``wait_blocking``); otherwise
        it must be made inside the task that will ``await wait()``."""
        self.value: Any = _PENDING
        self._event = self._post = self._thread_event = None
        if blocking:
            self._thread_event = threading.Event()
            return
        self._event = anyio.Event()
        self._taken = threading.Event()
        try:
            self._post = asyncio.get_running_loop().call_soon_threadsafe
        except RuntimeError:  # not asyncio: trio is the other loop anyio runs on
            trio = sys.modules.get("trio")
            if trio is None:
                raise RuntimeError("a Waiter needs an asyncio or trio event loop") from None
            self._post = trio.lowlevel.current_trio_token().run_sync_soon

    @property
    def delivered(self) -> bool:
        return self.value is not _PENDING

    def deliver(self, value: Any) -> None:
        """Store ``value`` and wake the waiter; from any thread, once."""
        self.value = value
        if self._thread_event is not None:
            self._thread_event.set()
            return
        try:
            self._post(self._event.set)
        except RuntimeError:
            pass  # the waiting loop has ended: nobody is waiting any more

    async def wait(self) -> Any:
        """The value, once delivered. Cancellable, and a cancelled wait may be
        resumed by awaiting again (an anyio Event survives cancellation, where
        a future awaited by a cancelled task is cancelled with it)."""
        await self._event.wait()
        self._taken.set()
        return self.value

    def wait_taken(self, timeout: float) -> bool:
        """From the delivering thread: block until the awaiting task has
        resumed with the value (True), or ``timeout`` seconds."""
        return self._taken.wait(timeout)

    def wait_blocking(self, timeout: float | None = None) -> Any:
        """The value, for a ``blocking`` waiter; after a ``timeout`` check
        ``delivered`` first."""
        self._thread_event.wait(timeout)
        return self.value


class _Worker:
    __slots__ = ("inbox",)

    def __init__(self):
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()


class WorkerThreads:
    """Threads that run callables handed to them, reused while idle (the most
    recently idle first, its stack still warm) and ended after ``idle_timeout``
    seconds without work. No upper bound: a driver's waiting jobs each hold
    a thread, and the job holding the slot must never wait for a thread a
    queued job holds; the scheduler's per-app queue limit bounds them."""

    # Idle threads end after this many seconds: a service whose apps opened
    # and closed many bursts (a thread each) is back to its idle footprint
    # soon after (issue 39), while a camera loop reuses its warm thread.
    def __init__(self, name: str, idle_timeout: float = 5.0):
        self.name = name
        self.idle_timeout = idle_timeout
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        os.register_at_fork(after_in_child=self._forget_threads)

    def run_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        with self._lock:
            worker = self._idle.pop() if self._idle else None
        if worker is not None:
            worker.inbox.put((fn, args))
            return
        worker = _Worker()
        threading.Thread(target=self._serve, args=(worker, (fn, args)), name=self.name,
                         daemon=True).start()

    def _serve(self, worker: _Worker, item) -> None:
        while True:
            fn, args = item
            try:
                fn(*args)
            except BaseException as e:  # a callable's bug must not end the thread silently
                vlog("driver", "%s: %r raised %r", self.name, fn, e)
            del fn, args, item
            with self._lock:
                self._idle.append(worker)
            try:
                item = worker.inbox.get(timeout=self.idle_timeout)
            except queue.Empty:
                with self._lock:
                    if worker in self._idle:
                        self._idle.remove(worker)
                        return
                item = worker.inbox.get()   # work was handed over as the wait timed out

    def _forget_threads(self) -> None:
        # A forked child has none of the parent's threads.
        self._lock = threading.Lock()
        self._idle = []


_EXECUTION_THREADS = WorkerThreads("nnrt-execution")


def run_soon(fn: Callable[..., Any], *args: Any) -> None:
    """Run ``fn(*args)`` on a worker thread; returns at once."""
    _EXECUTION_THREADS.run_soon(fn, *args)


async def run_in_worker(fn: Callable[..., Any], *args: Any) -> Any:
    """Await ``fn(*args)`` run on a worker thread of the same cache; its
    exception is raised here. Like ``anyio.to_thread.run_sync`` (which it
    replaces, so that nnrt has one kind of thread), a cancelled caller still
    waits for ``fn`` to return — it may be using the caller's buffers — and
    is cancelled after that."""
    waiter = Waiter()

    def work() -> None:
        try:
            waiter.deliver((True, fn(*args)))
        except BaseException as e:   # delivered, not lost on a worker thread
            waiter.deliver((False, e))

    run_soon(work)
    with anyio.CancelScope(shield=True):
        ok, value = await waiter.wait()
    await anyio.lowlevel.checkpoint_if_cancelled()
    if not ok:
        raise value
    return value
