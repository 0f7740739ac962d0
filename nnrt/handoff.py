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
import types
from typing import Any, Awaitable, Callable

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

    def __init__(self, name: str, idle_timeout: float = 30.0):
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


@types.coroutine
def _bare_yield():
    """What ``asyncio.sleep(0)`` awaits (its ``__sleep0``): a bare yield,
    which an asyncio task takes as "let the loop run the others first"."""
    yield


# A loop skips the I/O poll of a schedule point for at most this long
# (see ``schedule_point``): about one inline run (nnrt.qos.front.INLINE_BOUND).
IO_QUANTUM = 0.0005
_last_turn: tuple = (None, 0.0)    # (the loop, its time) of the last yield made here


def schedule_point() -> Awaitable[None]:
    """What ``anyio.lowlevel.checkpoint()`` awaits, to await on a per-call
    hot path: a turn of the loop for its other tasks, where a cancelled
    task stops. On an asyncio task that is ``asyncio.sleep(0)``'s bare
    yield, exactly what anyio's asyncio backend awaits, returned here
    without anyio's per-call look-up of the running library and the
    coroutine frames it and ``sleep`` add to every suspension and
    resumption: 6-15 us of CPU per in-process execution on this VM
    (issue 16). Elsewhere -- trio, or trio as a guest of an asyncio loop,
    whose code runs outside any asyncio task -- anyio's own.

    A turn that would do nothing but poll the loop's I/O is skipped when
    the loop polled less than ``IO_QUANTUM`` ago (a task executing back to
    back; ~10 us a turn here, a quarter of an in-process execution): on
    an asyncio loop whose ready queue is empty and none of whose timers is
    due. Another task that is ready, a cancellation (anyio delivers it
    through a callback, an asyncio timeout through a timer) or a deadline
    that is due still gets its turn here, as before; only a socket or pipe
    that became readable waits, for at most the quantum. Loops that do not
    show their ready queue (uvloop) always turn."""
    global _last_turn
    loop = _running_loop()
    if loop is None or _current_task(loop) is None:
        # Not an asyncio task: trio, or trio as a guest of an asyncio loop.
        return anyio.lowlevel.checkpoint()
    now = loop.time()
    last_loop, last = _last_turn
    if last_loop is loop and now - last < IO_QUANTUM and not getattr(loop, "_ready", True):
        timers = loop._scheduled
        if not timers or timers[0]._when > now + loop._clock_resolution:
            return _NO_TURN
    _last_turn = (loop, now)
    return _bare_yield()


_running_loop = asyncio._get_running_loop    # (None off a loop, where the public one raises)
# The task running on a loop: on 3.11 ``asyncio.current_task`` is a Python
# function around a look-up in this dict (the C one's), built in from 3.12.
_current_task = asyncio.tasks._current_tasks.get if sys.version_info < (3, 12) \
    else asyncio.current_task


class _NoTurn:
    """An awaitable that completes at once (a skipped turn): its iterator
    is an exhausted one, shared (built in, where a generator would be made
    per await)."""

    __slots__ = ()
    # A built-in method is not bound on look-up: ``__await__()`` returns
    # the exhausted iterator itself, whose first step ends the await.
    __await__ = iter(()).__iter__


_NO_TURN = _NoTurn()


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
