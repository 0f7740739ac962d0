"""The burst server: the driver-service side of a burst session.

Theory of operation
-------------------
One :class:`BurstServer` per burst. Its task (started by the connection
that configured the burst, in that connection's task group) runs a
dedicated serving thread and stops it when cancelled. The thread's loop is::

    read a frame (Ring.read_or: a poll on the ring's eventfd and a stop
                  eventfd, in one native call)
    decode it                        -> INVALID_ARGUMENT result if it does not
    a request: map the slots it names -> unknown slots: one get_memories call,
                                        made on the event loop (from_thread)
      one-shot (layout 0)            -> prepared.execute_synchronously()
      defining layout N              -> prepared.create_execution() kept as N
                                        (replacing the old N), then computed
    a run of layout N                -> that execution's execute_synchronously()
    write the result frame to the result ring

Layouts are the declared fast path: the controller binds a request once
(``BurstController.create_execution``) and the driver binds it here once
(its ``create_execution``: the LiteRT driver ties its interpreters to the
slots' memory), so a run frame costs the driver's computation and nothing
else. At most ``wire.MAX_LAYOUTS`` are kept; a layout goes when its number
is defined again, when a slot it uses is freed, and with the burst; a
definition the driver refuses (INVALID_ARGUMENT) defines nothing.

Why a thread and ``execute_synchronously`` rather than a task awaiting the
driver's ``execute``: a driver's async ``execute`` hands the work to a
worker thread and back, two more wake-ups per frame on top of the two ring
hand-offs; on a small model those wake-ups are the whole cost, and the point
of a burst is to pay only the ring. ``execute_synchronously`` goes through
the same request validation and the same scheduler (the job waits for its
turn in this thread), so a burst execution is ordered, preempted and
refused exactly like any other. HAL burst servers have their own thread too.

Requests are served one at a time, in ring order, so executions of one burst
never overlap and results come back in request order.

Slots. The controller names each memory pool by a slot id it never reuses
within the burst. The server keeps ``slot -> Memory`` (mapped once); a slot
it does not know is asked of the controller over the control connection
(``fetch``, the service's ``GET_MEMORIES`` call, HAL
``IBurstCallback.getMemories``) and cached from then on. A slot freed by the
controller (the app released the Memory) is unmapped after the execution in
progress, if any, so a mapping is never pulled from under the driver. The
slot table is shared by the thread and the event loop (``free``): a lock
guards it.

Failures. Nothing that goes wrong in one burst leaves it: the app on the
other side may be hostile, and an exception escaping :meth:`run` would end
the connection's task group (and with it every other call of that app). A
frame that does not decode fails that execution with INVALID_ARGUMENT
(serial taken from the header when it is readable) and the burst goes on; a
driver error fails that execution. A result ring whose maximum frame cannot
hold every result (``wire.MAX_RESULT_SIZE``) is refused when the burst is
made (INVALID_ARGUMENT to CONFIGURE_BURST). :class:`~nnrt.fmq.RingCorrupted`
(impossible counters: the stream is out of sync), and any other error of the
rings, the eventfds or this module, ends the burst with an ``end_reason``
that the connection sends to the app (BURST_ENDED). The burst also ends on
``stop()`` (RELEASE_BURST, RELEASE_MODEL) and when its task is cancelled
(the control connection closed: the app died): the stop eventfd wakes the
thread, a pending ``fetch`` is cancelled, and once the thread has returned
every mapping and both rings are closed. Until then the event loop drains
the rings' eventfds every 50 ms: the one way left to block the thread is an
app making an eventfd blocking (the description is shared) and saturating
it, and a drain releases that write.
"""
from __future__ import annotations

import itertools
import os
import struct
import threading
from dataclasses import dataclass
from typing import Awaitable, Callable

import anyio
import anyio.lowlevel

from ..hal import PreparedModel, Request, RequestArgument
from ..errors import ErrorStatus, NnrtError
from ..handoff import run_in_worker
from ..fmq import PREFIX, Ready, Ring, RingClosed, RingCorrupted, WouldBlock
from ..memory import Memory
from ..model.graph import DataLocation
from ..vlog import vlog
from .. import trace
from .wire import (MAX_MESSAGE, MAX_RESULT_SIZE, REQUEST_MAGIC, RUN_MAGIC, UINT64_MAX,
                   BurstOutputShape,
                   BurstProtocolError, BurstRequest, BurstResult, decode_frame, encode_result)

# Fetch the memories behind some slots: slot -> Memory for every slot it
# could get (NnrtError when the controller refuses). Runs on the event loop.
Fetch = Callable[[tuple[int, ...]], Awaitable[dict[int, Memory]]]

_SERIAL = struct.Struct("<4sHHQ")
_DRAIN_INTERVAL = 0.05   # seconds between drains of a stopped burst's eventfds

# How long (seconds) the serving thread watches the request ring for the
# next frame before it sleeps on the eventfd, when a core is free for it
# (nnrt.fmq.ring: the GIL released, and only while the kernel's run queue
# leaves a core idle). An app in a frame loop sends its next request within
# this; one whose frames are far apart (a 30 fps camera) costs a core this
# long per frame (0.75 % at 30 fps). A frame caught spinning costs neither
# side a wake-up: the app's write signals nobody, and the thread's caches
# stay warm for the driver.
REQUEST_SPIN = 250e-6


@dataclass(frozen=True, slots=True)
class BurstServerStatistics:
    executions: int            # requests answered (malformed ones included)
    malformed: int             # requests that did not decode
    get_memories_calls: int    # round trips to the controller for unknown slots
    slots_fetched: int         # slots mapped after such a call
    slots_mapped: int          # slots mapped now
    slots_freed: int
    layouts: int = 0           # layouts defined (each bound to the driver once)


class BurstCounters:
    """Totals over all bursts of a service (for its ``burst_statistics``)."""

    def __init__(self):
        self.ids = itertools.count(1)
        self.opened = 0
        self.executions = 0
        self.get_memories_calls = 0
        self.slots_fetched = 0
        self.layouts = 0


class _Stopped(Exception):
    """The burst was stopped while the thread was waiting."""


class BurstServer:
    """Serves one burst: see the module docstring."""

    def __init__(self, burst_id: int, prepared: PreparedModel, requests: Ring, results: Ring,
                 fetch: Fetch, counters: BurstCounters | None = None, label: str = "burst",
                 model_id: int = 0):
        """Takes ownership of both rings, also when it refuses them:
        INVALID_ARGUMENT when the result ring cannot carry every result."""
        if results.max_frame < MAX_RESULT_SIZE:
            requests.close()
            results.close()
            raise NnrtError(ErrorStatus.INVALID_ARGUMENT,
                            f"the burst's result ring takes frames of at most "
                            f"{results.max_frame} bytes; a result may need {MAX_RESULT_SIZE} "
                            f"(make it with capacity >= {_ring_for(MAX_RESULT_SIZE)})")
        self.burst_id = burst_id
        self.model_id = model_id   # the service's id of ``prepared``
        self.prepared = prepared
        self._requests = requests
        self._results = results
        self._fetch = fetch
        self._counters = counters or BurstCounters()
        self._label = label
        self._lock = threading.Lock()       # guards _memories, _to_free, _executing
        self._memories: dict[int, Memory] = {}
        self._to_free: set[int] = set()
        self._executing = False
        self._stop_efd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self._stopped = False
        self._stop_requested: anyio.Event | None = None   # made by run(), on the loop
        self._loop_token = None                            # the same
        self._drain_scope: anyio.CancelScope | None = None
        self._thread_done = False
        self._fetch_scope: anyio.CancelScope | None = None
        self.closed = False
        # Why the burst ended on our side, to tell the controller (None:
        # released by it, or its connection is gone).
        self.end_reason: str | None = None
        self._executions = self._malformed = 0
        self._get_memories_calls = self._slots_fetched = self._slots_freed = 0
        self._layouts = 0
        # Layout number -> (its slots, the driver's execution bound to them);
        # used by the serving thread, dropped under the lock when a slot goes.
        self._bound: dict[int, tuple[frozenset, object]] = {}

    def statistics(self) -> BurstServerStatistics:
        return BurstServerStatistics(self._executions, self._malformed, self._get_memories_calls,
                                     self._slots_fetched, len(self._memories), self._slots_freed,
                                     self._layouts)

    # -- lifetime (event loop) ------------------------------------------------

    async def run(self) -> None:
        """Serve requests (in a thread) until stopped, cancelled or out of
        sync; then unmap and close everything."""
        self._counters.opened += 1
        self._stop_requested = anyio.Event()
        # The serving thread is nnrt's worker, not anyio's: it reaches this
        # loop (GET_MEMORIES) through the loop's token.
        self._loop_token = anyio.lowlevel.current_token()
        try:
            if not self._stopped:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._stop_when_cancelled)
                    # Not abandoned on cancel: the task waits for the thread,
                    # which _stop_when_cancelled wakes, so nothing is closed
                    # under it.
                    try:
                        # nnrt's one kind of thread, ended after a few idle
                        # seconds: anyio's pool kept a closed burst's thread
                        # until its next call (issue 39: 256 bursts opened and
                        # closed left 256 threads).
                        await run_in_worker(self._serve_forever)
                    finally:
                        # However the thread ended: the drain loop must stop,
                        # or this task group (and the service's shutdown)
                        # would wait for it forever (the live fuzzer's find).
                        self._thread_done = True
                        if self._drain_scope is not None:
                            self._drain_scope.cancel()
                    tg.cancel_scope.cancel()
        except Exception as e:  # e.g. no thread could be started: this burst ends, not more
            self._end(f"{type(e).__name__}: {e}")
        finally:
            self.close()

    async def _stop_when_cancelled(self) -> None:
        try:
            await self._stop_requested.wait()
        finally:
            self.stop()
            # The thread returns at its next wait (the stop eventfd wakes it)
            # -- unless it is blocked writing to an eventfd of the app's that
            # the app made blocking and saturated: draining releases it. The
            # app may do it again, so until the thread is back (run() then
            # cancels the shielded scope to cut the last sleep short).
            with anyio.CancelScope(shield=True) as self._drain_scope:
                while not self._thread_done:
                    for ring in (self._requests, self._results):
                        try:
                            ring.drain_eventfds()
                        except Exception:   # closed meanwhile: nothing left to release
                            pass
                    await anyio.sleep(_DRAIN_INTERVAL)

    def stop(self, reason: str | None = None) -> None:
        """End the burst: the thread returns, then run() unmaps everything.
        ``reason`` (for :attr:`end_reason`) when the controller did not ask
        for it. Call it on the event loop."""
        if reason is not None and self.end_reason is None:
            self.end_reason = reason
        if self._stopped or self.closed:
            self._stopped = True
            return
        self._stopped = True
        if self._stop_requested is not None:
            self._stop_requested.set()
        os.eventfd_write(self._stop_efd, 1)
        if self._fetch_scope is not None:
            self._fetch_scope.cancel()

    def close(self) -> None:
        """Unmap every slot and close both rings. Idempotent. Only once the
        thread has returned (run() does it), or if it never started."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            memories, self._memories = self._memories, {}
            bound, self._bound = self._bound, {}
        for _slots, execution in bound.values():
            execution.release()
        del bound
        for closeable in (*memories.values(), self._requests, self._results):
            try:
                closeable.close()
            except Exception as e:  # keep releasing the rest
                vlog("driver", "%s: closing %r failed: %s", self._label, closeable, e)
        os.close(self._stop_efd)

    def free(self, slots) -> None:
        """The controller forgot ``slots``: unmap them (after the execution
        in progress, which may still be using them)."""
        with self._lock:
            self._to_free.update(slots)
            if self._executing:
                return
            freed = self._take_frees()
        for mem in freed:
            mem.close()

    def _take_frees(self) -> list[Memory]:
        """Under the lock: forget the slots to free and the layouts using
        them (released first: their views must go before the mappings)."""
        gone = [n for n, (slots, _) in self._bound.items() if not slots.isdisjoint(self._to_free)]
        for n in gone:
            self._bound.pop(n)[1].release()
        freed = [m for m in (self._memories.pop(s, None) for s in self._to_free) if m is not None]
        self._slots_freed += len(freed)
        self._to_free.clear()
        return freed

    # -- the serving thread ---------------------------------------------------

    def _serve_forever(self) -> None:
        try:
            while not self._stopped:
                frame = self._requests.read_or(self._stop_efd)
                if frame is None:   # stopped (the stop eventfd), nothing left to serve
                    return
                encoded = self._serve(frame)
                while True:
                    try:
                        self._results.write_nowait(encoded)
                        break
                    except WouldBlock:  # the controller is behind: wait for room
                        if self._results.wait_write_blocking(len(encoded), also=self._stop_efd) \
                                is Ready.ALSO:
                            return
        except RingCorrupted as e:
            self._end(f"its ring is out of sync: {e}")
        except (RingClosed, _Stopped):
            pass
        except Exception as e:  # FrameTooLarge, an eventfd error, a bug: this burst only
            self._end(f"{type(e).__name__}: {e}")
        except BaseException as e:
            # The loop cancelled a GET_MEMORIES this thread waited for
            # (anyio.from_thread.run raises the loop's CancelledError here):
            # the burst ends; nothing may escape into run().
            if not self._stopped:
                self._end(f"{type(e).__name__} while waiting for the event loop")

    def _end(self, why: str) -> None:
        vlog("driver", "%s: ending the burst: %s", self._label, why)
        if self.end_reason is None:
            self.end_reason = _clip(why)

    @trace.traced("burst serve")
    def _serve(self, frame: bytes):
        """The encoded result of one request frame (a buffer valid until
        the next frame is served)."""
        self._executions += 1
        self._counters.executions += 1
        try:
            message = decode_frame(frame)
        except BurstProtocolError as e:
            self._malformed += 1
            return self._encode(_peek_serial(frame), ErrorStatus.INVALID_ARGUMENT,
                                message=_clip(e.message))
        with self._lock:
            self._executing = True
        try:
            if message.__class__ is BurstRequest:
                result = self._execute(message)
            else:   # a run of a bound layout
                bound = self._bound.get(message.layout)
                if bound is None:
                    raise NnrtError(ErrorStatus.INVALID_ARGUMENT,
                                    f"burst layout {message.layout} is not defined")
                result = bound[1].execute_synchronously(message.deadline)
            return self._answer(message.serial, result)
        except NnrtError as e:
            return self._encode(message.serial, e.status, message=_clip(e.message))
        except _Stopped:
            raise
        except Exception as e:  # a driver bug must not end the burst or the service
            return self._encode(message.serial, ErrorStatus.GENERAL_FAILURE,
                                message=_clip(f"{type(e).__name__} in the driver: {e}"))
        finally:
            with self._lock:
                self._executing = False
                freed = self._take_frees() if self._to_free else []
            for mem in freed:
                mem.close()

    def _encode(self, serial: int, status: ErrorStatus, shapes=(), on_device=UINT64_MAX,
                in_driver=UINT64_MAX, message: str = "") -> bytes:
        try:
            return encode_result(BurstResult(serial, status, shapes, on_device, in_driver,
                                             message))
        except BurstProtocolError as e:  # e.g. a driver's shape beyond u32
            return encode_result(BurstResult(
                serial, ErrorStatus.GENERAL_FAILURE,
                message=_clip(f"the driver's result cannot be sent: {e.message}")))

    def _answer(self, serial: int, result) -> bytes:
        shapes = tuple(BurstOutputShape(tuple(s.dimensions), bool(s.is_sufficient))
                       for s in result.output_shapes)
        timing, message = result.timing, result.message
        return self._encode(serial, result.status, shapes, timing.on_device, timing.in_driver,
                            _clip(message) if message else "")

    def _execute(self, req: BurstRequest):
        """Run a request: one-shot, or defining (and binding) its layout."""
        with self._lock:
            unknown = tuple(dict.fromkeys(s for s in req.slots if s not in self._memories))
        if unknown:
            self._get_memories_calls += 1
            self._counters.get_memories_calls += 1
            fetched = anyio.from_thread.run(self._fetch_on_loop, unknown, token=self._loop_token)
            if fetched is None:
                raise _Stopped
            missing = [s for s in unknown if s not in fetched]
            if missing:
                for mem in fetched.values():
                    mem.close()
                raise NnrtError(ErrorStatus.INVALID_ARGUMENT,
                                f"the controller did not give burst slots {missing}")
            with self._lock:
                self._memories.update(fetched)
            self._slots_fetched += len(unknown)
            self._counters.slots_fetched += len(unknown)
        with self._lock:
            memories = [self._memories.get(s) for s in req.slots]
        if any(m is None or m.closed for m in memories):  # (free() waits for the execution)
            raise NnrtError(ErrorStatus.GENERAL_FAILURE,
                            f"burst slots {list(req.slots)} are not all mapped")
        request = Request(tuple(_argument(a) for a in req.inputs),
                          tuple(_argument(a) for a in req.outputs),
                          tuple(m.view() for m in memories))
        if not req.layout:
            return self.prepared.execute_synchronously(request, req.measure_timing,
                                                       req.deadline, req.loop_timeout)
        old = self._bound.pop(req.layout, None)
        if old is not None:
            old[1].release()
        execution = self.prepared.create_execution(request, req.measure_timing,
                                                   req.loop_timeout)
        result = execution.execute_synchronously(req.deadline)
        if result.status == ErrorStatus.INVALID_ARGUMENT:
            # A request the driver refuses defines nothing (a driver that
            # binds nothing validates only when it runs).
            execution.release()
            return result
        with self._lock:
            self._bound[req.layout] = (frozenset(req.slots), execution)
        self._layouts += 1
        self._counters.layouts += 1
        return result

    async def _fetch_on_loop(self, slots) -> dict[int, Memory] | None:
        """``fetch`` on the event loop; None when the burst was stopped meanwhile."""
        if self._stopped:
            return None
        with anyio.CancelScope() as self._fetch_scope:
            return await self._fetch(slots)
        return None


def _argument(a) -> RequestArgument:
    if a.has_no_value:
        return RequestArgument(has_no_value=True)
    return RequestArgument(False, DataLocation(a.pool_index, a.offset, a.length),
                           tuple(a.dimensions))


def _peek_serial(frame: bytes) -> int:
    """The serial of a frame that did not decode, 0 when unreadable."""
    if len(frame) >= _SERIAL.size:
        magic, _version, _flags, serial = _SERIAL.unpack_from(frame)
        if magic in (REQUEST_MAGIC, RUN_MAGIC):
            return serial
    return 0


def _ring_for(max_frame: int) -> int:
    """The smallest ring capacity whose default max frame holds ``max_frame``."""
    return 1 << (2 * (max_frame + PREFIX) - 1).bit_length()


def _clip(message: str) -> str:
    raw = message.encode("utf-8", "replace")
    if len(raw) <= MAX_MESSAGE:
        return message
    return raw[:MAX_MESSAGE].decode("utf-8", "ignore")


__all__ = ["BurstCounters", "BurstServer", "BurstServerStatistics", "REQUEST_SPIN"]
