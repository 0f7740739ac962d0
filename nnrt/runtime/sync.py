"""The synchronous API: ``nnrt.SyncRuntime`` and ``nnrt.run``.

A :class:`SyncRuntime` owns an event loop of its own and an ordinary async
:class:`~nnrt.runtime.Runtime` opened on it; every call from plain code is
one coroutine run on that loop until it completes. The async core is the
only one; this is a door into it, not a copy of it.

Theory of operation. The loop runs only during a call, in the calling
thread (``run_until_complete``), so a call from plain code costs what an
awaited call costs plus the loop's start and stop -- no thread hand-off
(measured: a private loop thread, two extra wake-ups per call, cost 1.3-1.5x
an awaited execution on a loaded machine). A thread that is itself running
an event loop (a Jupyter cell, an app's loop thread) cannot run a second
one, so its call is run by a worker of the one thread cache
(``nnrt.handoff``) while it blocks. ``_lock`` makes sure one thread at a
time runs the loop: calls from several threads take turns. Between calls the
loop is idle: what the drivers post to it (results, a service's messages)
waits for the next call, which is fine because nothing is pending then
except what the app does not wait for.

``SyncRuntime(loop_thread=True)`` runs the loop all the time on a private
thread instead, for an app that wants the runtime's background work to go on
between its calls (a service's death noticed at once, fenced chains started
through ``rt.runtime``); each call then costs two more thread wake-ups.

Why not ``anyio.run`` per call: the runtime, its devices and compiled
models belong to the loop that opened them (the scheduler's wake-ups, the
service connections), so one loop must outlive the calls.
"""
from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import threading
import weakref
from typing import Any, Sequence

from .. import handoff
from ..errors import bad_state
from ..model.builder import Model
from .results import Result
from .runtime import CompiledModel, Runtime


def _new_loop() -> asyncio.AbstractEventLoop:
    # Plain asyncio, not uvloop: the loop is started and stopped on every
    # call, and uvloop's start and stop cost ~85 us against asyncio's ~30 us
    # (more than an execution of a small model), while its faster I/O buys
    # nothing for one execution at a time.
    return asyncio.new_event_loop()


def _loop_running_here() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class SyncRuntime:
    """A :class:`Runtime` for code that does not ``await``::

        with nnrt.SyncRuntime() as rt:
            compiled = rt.compile(model)          # once
            for frame in frames:
                result = compiled.execute([frame])  # many times

    Takes the arguments of :class:`Runtime`. Works from plain code, inside a
    running event loop (Jupyter) and from any thread; calls from several
    threads run one at a time. Close it (or use ``with``); one left open is
    closed at interpreter exit.
    """

    def __init__(self, *, loop_thread: bool = False, **runtime_kwargs):
        self._loop = _new_loop()
        self._lock = threading.Lock()    # held by the thread running the loop
        self._thread: threading.Thread | None = None
        if loop_thread:
            self._thread = threading.Thread(target=self._loop.run_forever,
                                            name="nnrt-sync-loop", daemon=True)
            self._thread.start()
        self._runtime = Runtime(**runtime_kwargs)
        self._closed = False
        try:
            self._call(self._runtime.__aenter__())
        except BaseException:
            self._close_loop()
            raise
        _open.add(self)

    def _call(self, coro):
        """Run ``coro`` on this runtime's loop and return its outcome."""
        if self._thread is not None:
            if threading.current_thread() is self._thread:
                coro.close()
                raise bad_state("a SyncRuntime cannot be called from its own loop thread")
            future: concurrent.futures.Future = asyncio.run_coroutine_threadsafe(coro,
                                                                               self._loop)
            try:
                return future.result()
            except BaseException:
                future.cancel()
                raise
        if not _loop_running_here():
            return self._run(coro)
        waiter = handoff.Waiter(blocking=True)

        def run() -> None:
            try:
                waiter.deliver((True, self._run(coro)))
            except BaseException as e:
                waiter.deliver((False, e))
        handoff.run_soon(run)
        ok, value = waiter.wait_blocking()
        if not ok:
            raise value
        return value

    def _run(self, coro):
        with self._lock:
            if self._loop.is_closed():
                coro.close()
                raise bad_state("the SyncRuntime is closed")
            task = self._loop.create_task(coro)
            try:
                return self._loop.run_until_complete(task)
            except BaseException:
                if not task.done():   # KeyboardInterrupt while waiting: cancel the work
                    task.cancel()
                    self._loop.run_until_complete(asyncio.wait([task]))
                raise

    @property
    def runtime(self) -> Runtime:
        """The async runtime behind this one (its loop runs only during this
        SyncRuntime's calls: await its coroutines through them, not elsewhere)."""
        return self._runtime

    @property
    def devices(self):
        return self._runtime.devices

    @property
    def services(self):
        return self._runtime.services

    def compile(self, model: Model, **kwargs) -> "SyncCompiledModel":
        """As :meth:`Runtime.compile`, without ``await``."""
        self._check_open()
        return SyncCompiledModel(self, self._call(self._runtime.compile(model, **kwargs)))

    def statistics(self, device):
        self._check_open()
        return self._call(self._runtime.statistics(device))

    def cache_statistics(self):
        """As :meth:`Runtime.cache_statistics` (compile with ``cache_dir=``,
        ``token=`` as there)."""
        return self._runtime.cache_statistics()

    def _check_open(self) -> None:
        if self._closed:
            raise bad_state("the SyncRuntime is closed")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        _open.discard(self)
        try:
            self._call(self._runtime.__aexit__(None, None, None))
        finally:
            self._close_loop()

    def _close_loop(self) -> None:
        if self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            if self._thread.is_alive():   # stuck in a call: leave the loop to it
                return
        with self._lock:
            self._loop.close()

    def __enter__(self) -> "SyncRuntime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        if self._closed:
            return "<nnrt.SyncRuntime closed>"
        where = " on its loop thread" if self._thread is not None else ""
        return f"<nnrt.SyncRuntime{where} {self._runtime!r}>"


class SyncCompiledModel:
    """A :class:`CompiledModel` whose calls block instead of being awaited."""

    def __init__(self, runtime: SyncRuntime, compiled: CompiledModel):
        self._rt = runtime
        self.compiled = compiled

    def execute(self, inputs: Sequence[Any], **kwargs) -> Result:
        """As :meth:`CompiledModel.execute`, without ``await``."""
        return self._rt._call(self.compiled.execute(inputs, **kwargs))

    def create_execution(self, inputs=None, **kwargs) -> "SyncExecution":
        """As :meth:`CompiledModel.create_execution`; its ``compute()`` blocks."""
        return SyncExecution(self._rt, self.compiled.create_execution(inputs, **kwargs))

    def burst(self) -> "SyncBurst":
        """A burst session (``with compiled.burst() as burst: burst.execute(...)``)."""
        return SyncBurst(self._rt, self.compiled.burst())

    def reset_state(self) -> None:
        """As :meth:`CompiledModel.reset_state`."""
        self.compiled.reset_state()

    @property
    def inputs(self):
        return self.compiled.inputs

    @property
    def outputs(self):
        return self.compiled.outputs

    @property
    def placement(self):
        return self.compiled.placement

    @property
    def devices(self):
        return self.compiled.devices

    def statistics(self):
        return self.compiled.statistics()

    def close(self) -> None:
        self.compiled.close()

    def __enter__(self) -> "SyncCompiledModel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<nnrt.SyncCompiledModel {self.compiled!r}>"


class SyncExecution:
    """An :class:`~nnrt.runtime.execution.Execution` whose ``compute()``
    blocks. A bound execution computes on the calling thread, with no event
    loop at all: the QoS front queues it and the driver runs it right there
    (what makes the sync API cost no more than calling the driver). Anything
    else (the general path, recovering from a driver failure) runs on the
    runtime's loop as every other call."""

    def __init__(self, runtime: SyncRuntime, execution):
        self._rt = runtime
        self.execution = execution

    def compute(self, *, deadline: float | None = None) -> Result:
        self._rt._check_open()
        result = self.execution.compute_synchronously(deadline)
        if result is None:
            result = self._rt._call(self.execution.recover(deadline))
        return result

    @property
    def inputs(self) -> list:
        return self.execution.inputs

    @property
    def outputs(self) -> list | None:
        return self.execution.outputs

    @property
    def bound(self) -> bool:
        return self.execution.bound

    def close(self) -> None:
        self.execution.close()

    def __enter__(self) -> "SyncExecution":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<nnrt.SyncExecution {self.execution!r}>"


class SyncBurst:
    """A :class:`Burst` whose calls block; use as ``with``."""

    def __init__(self, runtime: SyncRuntime, burst):
        self._rt = runtime
        self.burst = burst

    def __enter__(self) -> "SyncBurst":
        self._rt._call(self.burst.__aenter__())
        return self

    def __exit__(self, *exc) -> None:
        self._rt._call(self.burst.__aexit__(*exc))

    def execute(self, inputs: Sequence[Any], **kwargs) -> Result:
        return self._rt._call(self.burst.execute(inputs, **kwargs))

    def compute(self, execution, *, deadline: float | None = None) -> Result:
        """As :meth:`Burst.compute`, of a :class:`SyncExecution` (or its execution)."""
        if isinstance(execution, SyncExecution):
            execution = execution.execution
        return self._rt._call(self.burst.compute(execution, deadline=deadline))

    def statistics(self):
        return self.burst.statistics()

    def __repr__(self) -> str:
        return f"<nnrt.SyncBurst {self.burst!r}>"


# -- nnrt.run --------------------------------------------------------------------

_open: "weakref.WeakSet[SyncRuntime]" = weakref.WeakSet()
_shared: SyncRuntime | None = None
_shared_lock = threading.Lock()
# Each model compiled once by nnrt.run, for as long as the model lives.
_compiled: "weakref.WeakKeyDictionary[Model, SyncCompiledModel]" = weakref.WeakKeyDictionary()


def run(model: Model, inputs: Sequence[Any], **kwargs) -> Result:
    """Execute ``model`` once from plain code, on the default devices.

    A thin convenience on one shared :class:`SyncRuntime`: the first call for
    a model compiles it, later calls reuse that compilation, so calling it in
    a loop costs an execution, not a compilation. ``kwargs`` are those of
    ``execute``. For other compile options, use :class:`SyncRuntime`.
    """
    global _shared
    with _shared_lock:
        if _shared is None or _shared._closed:
            _shared = SyncRuntime()
        rt = _shared
        compiled = _compiled.get(model)
        if compiled is None or compiled._rt is not rt or compiled.compiled.closed:
            compiled = _compiled[model] = rt.compile(model)
    return compiled.execute(inputs, **kwargs)


@atexit.register
def _close_all() -> None:
    for rt in list(_open):
        try:
            rt.close()
        except Exception:   # the interpreter is going away; nothing to report to
            pass


__all__ = ["SyncBurst", "SyncCompiledModel", "SyncExecution", "SyncRuntime", "run"]
