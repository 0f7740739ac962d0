"""The burst controller: the app side of a burst session on a driver service.

Theory of operation
-------------------
Set-up (one control round trip): the controller creates both rings with
:meth:`nnrt.fmq.Ring.create` -- requests (controller -> server, ``1 << 19``
bytes, room for the largest request the wire format allows) and results
(server -> controller, ``1 << 18``) -- and sends their six fds with
``CONFIGURE_BURST`` by SCM_RIGHTS. The app creates them so that the service
never allocates shared memory on an app's behalf and a service that refuses
the burst leaves nothing behind in the app. The reply is the burst id.

An execution is then one request-ring write and one result-ring read::

    pools -> slots      a Memory gets a slot id on first use (cached, never
                        reused within the burst); any other pool (numpy,
                        bytes) is copied into an arena, itself a Memory with
                        a slot, and outputs are copied back
    encode, write       the frame (serial numbers count from 1)
    wait                the result ring's eventfd, or the wake-up eventfd
    decode, match       the result of our serial; older serials are results
                        of executions whose caller was cancelled: dropped

A one-shot ``execute`` places its request's pools in the session's arena
(nnrt.memory.staging) and sends the whole request. A bound execution
(``create_execution``, what ``Burst.compute`` uses) places its pools once,
in an arena of its own, and takes one of the burst's layout numbers: its
first frame sends the whole request and defines the layout, which the
server binds to the driver (nnrt.burst.server); each later frame is a run
frame of 32 bytes -- serial, deadline, layout -- and only the pools' bytes
move.

One execution at a time per session (a lock): the ring carries one request
and one result in flight, as HAL bursts do, and results are matched by order.

Slots. The server maps each slot once. When it meets an unknown one it asks
with ``GET_MEMORIES``; the connection's reader thread answers from this
controller's table (``grant_memories``: a duplicate of the Memory's fd),
so the answer never waits for the app's event loop, which is parked in
``execute`` at that moment. A slot is freed (``FREE_BURST_SLOTS``) when its
Memory is closed (noticed at the next execution) or garbage collected (a
``weakref.finalize`` queues the slot; the queue is flushed at the next
execution, never from the finalizer, which may run under the channel's
send lock).

Liveness. Every wait is ``Ring.wait_read(also=wake)``: ``wake`` is an
eventfd of this controller that the channel writes when the connection dies
(the reader thread sees EOF the moment the service process dies), so a
pending execution fails with DEAD_OBJECT at once, not at a timeout.
``close()`` releases the burst on the service (``RELEASE_BURST``), whose
task then ends and unmaps every slot. A result that does not decode, or a
serial from the future, means the ring is out of sync: the session is torn
down and reports GENERAL_FAILURE; a request the server could not decode
fails alone with INVALID_ARGUMENT and the burst goes on.
"""
from __future__ import annotations

import itertools
import os
import threading
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio

import abc

from ..hal import (NO_TIMING, BurstExecution, BurstSession, ExecutionResult, OutputShape, Request,
                   Timing)
from ..errors import ErrorStatus, NnrtError
from ..fmq import Ready, Ring, RingClosed, RingCorrupted, WouldBlock
from ..memory import DeviceToken
from ..memory.staging import ArenaPool, SlotCache, bind, stage
from .. import trace
from .wire import (MAX_LAYOUTS, UINT64_MAX, BurstArgument, BurstProtocolError, BurstRequest,
                   BurstRun, decode_result, encode_request, encode_run)

REQUEST_RING_SIZE = 1 << 19   # > 2 * wire.MAX_REQUEST_SIZE: any request fits
RESULT_RING_SIZE = 1 << 18    # > 2 * wire.MAX_RESULT_SIZE


@dataclass(frozen=True, slots=True)
class BurstControllerStatistics:
    executions: int
    slots: int               # slots the controller has given out and not freed
    slots_freed: int
    bytes_staged: int        # bytes copied through an arena (in and out), in total
    layouts_staged: int = 0  # requests whose pools and regions were placed and checked:
                             # once per bound execution, once per one-shot execute


@dataclass(frozen=True, slots=True)
class MemoryGrant:
    """A memory slot as the controller hands it to the server: a duplicate
    fd (the caller closes it once sent) and the region of it the slot is."""

    slot: int
    fd: int
    writable: bool
    offset: int
    size: int


class BurstLink(abc.ABC):
    """What a controller needs of the control connection it was configured
    over. The connection (``nnrt.service.client``) owns the control
    messages; the controller never builds one."""

    @abc.abstractmethod
    async def configure(self, fds: list[int]) -> int:
        """Send the rings' fds to configure a burst; its id."""

    @abc.abstractmethod
    def register(self, burst_id: int, controller: "BurstController") -> None:
        """Route the server's memory requests for ``burst_id`` to ``controller``
        (or tell it at once that the connection is dead)."""

    @abc.abstractmethod
    def free_slots(self, burst_id: int, slots: tuple[int, ...]) -> None:
        """Tell the server it may unmap ``slots``; no reply awaited."""

    @abc.abstractmethod
    def release(self, burst_id: int) -> None:
        """End the burst on the server; no reply awaited."""


class BurstController(BurstSession):
    """A burst session on a driver service; make one with
    ``await service_prepared_model.configure_burst()``."""

    def __init__(self, prepared, link: BurstLink, burst_id: int, requests: Ring, results: Ring):
        # Private: use open().
        self.prepared = prepared
        self._link = link
        self.burst_id = burst_id
        self._requests = requests
        self._results = results
        self._wake = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self._wake_lock = threading.Lock()
        # Orders concurrent callers of one session. fast_acquire: taking it
        # when free is a flag, not a trip through the event loop (issue 16).
        self._lock = anyio.Lock(fast_acquire=True)
        self._serials = itertools.count(1)
        self._slots = SlotCache()        # read by the connection's reader thread too
        # One-shot executions: one at a time, so one arena, reused.
        self._arenas = ArenaPool("nnrt-burst-arena", max_free=1)
        # Layout numbers free for bound executions (wire.MAX_LAYOUTS at most
        # bound in the service at once); a binding past them sends its whole
        # request every time.
        self._free_layouts = list(range(MAX_LAYOUTS, 0, -1))
        self._layouts_staged = 0
        self._dead: str | None = None        # why the session cannot go on
        self._dead_status = ErrorStatus.DEAD_OBJECT
        self._busy = False
        self.closed = False
        self._executions = self._slots_freed = self._bytes_staged = 0

    @classmethod
    async def open(cls, prepared, link: BurstLink) -> "BurstController":
        """Configure a burst of ``prepared`` (a service's prepared model) over ``link``."""
        requests = Ring.create(REQUEST_RING_SIZE, name="nnrt-burst-requests")
        try:
            results = Ring.create(RESULT_RING_SIZE, name="nnrt-burst-results")
        except BaseException:
            requests.close()
            raise
        try:
            burst_id = await link.configure(requests.fds() + results.fds())
        except BaseException:
            requests.close()
            results.close()
            raise
        controller = cls(prepared, link, burst_id, requests, results)
        link.register(burst_id, controller)
        return controller

    def statistics(self) -> BurstControllerStatistics:
        return BurstControllerStatistics(self._executions, len(self._slots),
                                         self._slots_freed, self._bytes_staged,
                                         self._layouts_staged)

    # -- execution ------------------------------------------------------------

    async def execute(self, request: Request, measure: bool = False,
                      deadline: float | None = None,
                      loop_timeout: float | None = None) -> ExecutionResult:
        """A one-shot execution: its pools staged, its whole request sent."""
        async with self._turn() as problem:
            if problem is not None:
                return problem
            try:
                staging = stage(request.pools, request.inputs, request.outputs, self._arenas)
            except NnrtError as e:
                return ExecutionResult(e.status, message=e.message)
            self._layouts_staged += 1
            self._bytes_staged += staging.bytes_in
            outstanding = True
            try:
                serial = next(self._serials)
                frame = encode_request(BurstRequest(
                    serial, *self._arguments(request, staging.places), measure, deadline,
                    loop_timeout))
                result, outstanding = await self._round_trip(frame, serial)
                if result.status == ErrorStatus.NONE:
                    self._bytes_staged += staging.copy_out()
                return result
            except NnrtError as e:
                outstanding = False
                return ExecutionResult(e.status, message=e.message)
            finally:
                # Cancelled with the request in flight: the server may still
                # write this execution's outputs into the arena, so the next
                # execution must not share it.
                staging.finish(reuse=not outstanding)

    def create_execution(self, request: Request, measure: bool = False,
                         loop_timeout: float | None = None) -> "BoundBurstExecution":
        """``request`` bound to this burst: its pools placed once (the
        numpy ones in an arena of its own), its arguments in slots, and a
        layout number of the burst, so that the service binds it once too
        and each computation is a run frame (serial and deadline)."""
        if self.closed or self._dead is not None:
            problem = self._unusable()
            raise NnrtError(problem.status, problem.message)
        return BoundBurstExecution(self, request, measure, loop_timeout)

    @asynccontextmanager
    async def _turn(self):
        """The session's turn (one execution at a time): yields None, or the
        result to give when the session cannot be used."""
        lock = self._lock
        try:
            lock.acquire_nowait()     # free: taken without a trip through the loop
        except WouldBlock:
            await lock.acquire()
        try:
            if self.closed or self._dead is not None:
                yield self._unusable()
                return
            self._busy = True
            try:
                self._flush_frees()
                yield None
            finally:
                self._busy = False
                if self.closed:
                    self._close_rings()
        finally:
            lock.release()

    def _arguments(self, request: Request, places) -> tuple[tuple, tuple, tuple]:
        """(burst inputs, burst outputs, slots) of ``request`` with its pools
        at ``places``: each memory named by its slot, arguments offset into
        their place. INVALID_ARGUMENT for a driver buffer (the ring carries
        shared-memory slots only) or an argument naming no pool."""
        slots: list[int] = []
        index_of_slot: dict[int, int] = {}
        where: list[tuple[int, int]] = []    # pool index -> (slot index, base offset)
        for k, place in enumerate(places):
            if isinstance(place, DeviceToken):
                raise NnrtError(ErrorStatus.INVALID_ARGUMENT,
                                f"request pool {k} is a driver buffer: the burst ring "
                                f"carries shared-memory slots only (run such a request "
                                f"with the prepared model's execute)")
            slot = self._slots.slot(place.memory)
            if slot not in index_of_slot:
                index_of_slot[slot] = len(slots)
                slots.append(slot)
            where.append((index_of_slot[slot], place.offset))

        def argument(a, what: str) -> BurstArgument:
            if a.has_no_value:
                return BurstArgument(has_no_value=True)
            loc = a.location
            if loc is None or not 0 <= loc.pool_index < len(where):
                raise NnrtError(ErrorStatus.INVALID_ARGUMENT,
                                f"{what}: pool index {None if loc is None else loc.pool_index} "
                                f"out of range ({len(where)} pools)")
            if loc.offset < 0 or loc.length < 0:
                raise NnrtError(ErrorStatus.INVALID_ARGUMENT, f"{what}: negative offset or length")
            index, base = where[loc.pool_index]
            return BurstArgument(False, index, base + loc.offset, loc.length,
                                 tuple(a.dimensions))

        return (tuple(argument(a, f"input {k}") for k, a in enumerate(request.inputs)),
                tuple(argument(a, f"output {k}") for k, a in enumerate(request.outputs)),
                tuple(slots))

    def _unusable(self) -> ExecutionResult | None:
        if self.closed:
            return ExecutionResult(ErrorStatus.INVALID_ARGUMENT,
                                   message="the burst session is closed")
        if self._dead is not None:
            return ExecutionResult(self._dead_status, message=self._dead)
        return None

    @trace.traced("burst hand-off")
    async def _round_trip(self, frame, serial: int | None) -> tuple[ExecutionResult, bool]:
        """Write ``frame`` (a request or run frame) and await the result of
        ``serial`` (None: the next result, whatever its serial --
        for_test_execute_raw): ``(result, whether the request may still be
        in flight)``. Results of older serials (executions whose caller was
        cancelled) are dropped."""
        requests, results = self._requests, self._results
        try:
            while True:
                try:
                    requests.write_nowait(frame)
                    break
                except WouldBlock:
                    # Full only when cancelled executions' requests are still
                    # queued: wait for the server to take them.
                    if await requests.wait_write(len(frame), also=self._wake) \
                            is Ready.ALSO and self._woken():
                        return self._unusable(), False
            while True:
                # Wait first: the result is seldom there yet, and a wait
                # that finds it returns at once.
                if await results.wait_read(also=self._wake) is Ready.ALSO and self._woken():
                    return self._unusable(), False
                try:
                    raw = results.read_nowait()
                except WouldBlock:
                    continue
                try:
                    result = decode_result(raw)
                except BurstProtocolError as e:
                    return self._tear_down(f"the service sent a result that does not decode: "
                                           f"{e.message}"), False
                if serial is None or result.serial == serial or result.serial == 0:
                    break
                if result.serial > serial:
                    return self._tear_down(f"result serial {result.serial} answers no request "
                                           f"(expected {serial})"), False
                # An older serial: a cancelled execution's result; drop it.
        except (RingCorrupted, RingClosed) as e:
            return self._tear_down(f"the burst's ring failed: {e}"), False
        self._executions += 1
        shapes = tuple(OutputShape(s.dimensions, s.is_sufficient) for s in result.output_shapes)
        timing = NO_TIMING if result.on_device == result.in_driver == UINT64_MAX \
            else Timing(result.on_device, result.in_driver)
        return ExecutionResult(result.status, shapes, timing, result.message), False

    def _woken(self) -> bool:
        """After the wake-up eventfd fired: True when the session must stop."""
        try:
            os.eventfd_read(self._wake)
        except BlockingIOError:
            pass
        if self._dead is None and not self.closed:
            return False
        # Re-arm: other waits of this session must see it too.
        os.eventfd_write(self._wake, 1)
        return True

    def _tear_down(self, why: str) -> ExecutionResult:
        self._dead_status = ErrorStatus.GENERAL_FAILURE
        self._dead = why
        self._release_on_service()
        return ExecutionResult(ErrorStatus.GENERAL_FAILURE, message=why)

    def for_test_execute_raw(self, frame: bytes):
        """Send ``frame`` as a request as it is and await its result (a test
        of the server's handling of malformed requests). Returns a coroutine."""
        async def run():
            async with self._turn() as problem:
                if problem is not None:
                    return problem
                return (await self._round_trip(bytes(frame), None))[0]
        return run()

    def for_test_corrupt_request_ring(self) -> None:
        """Publish an impossible write counter on the request ring (what a
        buggy or hostile app could do) and wake the server."""
        from ..fmq.ring import WRITE_OFFSET

        counters = memoryview(self._requests._mm).cast("Q")
        try:
            counters[WRITE_OFFSET // 8] = 1 << 40
        finally:
            counters.release()
        os.eventfd_write(self._requests.fds()[1], 1)

    # -- pools ------------------------------------------------------------------

    def _flush_frees(self) -> None:
        """Tell the service about slots whose Memory was closed or collected."""
        freed = self._slots.take_freed()
        if freed:
            self._slots_freed += len(freed)
            self._link.free_slots(self.burst_id, tuple(freed))

    # -- called from the channel's reader thread ----------------------------------

    def grant_memories(self, slots) -> list[MemoryGrant]:
        """The memories of ``slots``, for the server that asked for them,
        each with a duplicate fd the caller closes once sent (the app may
        close a Memory meanwhile); NnrtError naming a slot that has none."""
        grants: list[MemoryGrant] = []
        try:
            for slot in slots:
                mem = self._slots.memory(slot)
                if mem is None:
                    raise NnrtError(ErrorStatus.INVALID_ARGUMENT,
                                    f"slot {slot} names no open memory of burst {self.burst_id}")
                grants.append(MemoryGrant(slot, os.dup(mem.fileno()), mem.writable,
                                          mem.fd_offset, mem.size))
        except OSError as e:
            for g in grants:
                os.close(g.fd)
            raise NnrtError(ErrorStatus.GENERAL_FAILURE,
                            f"cannot pass the memory of burst {self.burst_id}: {e}") from None
        except BaseException:
            for g in grants:
                os.close(g.fd)
            raise
        return grants

    def on_burst_ended(self, reason: str) -> None:
        """The service ended the burst (BURST_ENDED): fail what waits."""
        if self._dead is None:
            self._dead_status = ErrorStatus.GENERAL_FAILURE
            self._dead = f"burst {self.burst_id} was ended by the service: {reason}"
        self._signal_wake()

    def on_channel_dead(self, message: str) -> None:
        if self._dead is None:
            self._dead = f"burst {self.burst_id}: {message}"
        self._signal_wake()

    def _signal_wake(self) -> None:
        with self._wake_lock:
            if self._wake >= 0:
                os.eventfd_write(self._wake, 1)

    # -- lifetime ----------------------------------------------------------------

    def close(self) -> None:
        """End the session: the service's burst task ends and unmaps every
        slot; a pending execution returns INVALID_ARGUMENT. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self._release_on_service()
        self._signal_wake()
        if not self._busy:
            self._close_rings()

    def _release_on_service(self) -> None:
        self._link.release(self.burst_id)

    def _close_rings(self) -> None:
        self._requests.close()
        self._results.close()
        self._arenas.close()
        self._slots.clear()
        with self._wake_lock:
            if self._wake >= 0:
                os.close(self._wake)
                self._wake = -1

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("dead" if self._dead else "open")
        return f"<BurstController {self.burst_id} ({state})>"


class BoundBurstExecution(BurstExecution):
    """A request bound to a :class:`BurstController` (its ``create_execution``).

    Its pools are placed once (:func:`nnrt.memory.staging.bind`), its
    arguments converted to slots once, and it holds one of the burst's
    layout numbers: its first computation sends the whole request, defining
    the layout in the service, which binds it to the driver there; every
    later one is a run frame of serial and deadline. A computation that
    failed sends the whole request again next time (the service may not
    have kept the layout). Without a free layout number (``MAX_LAYOUTS``
    bound at once) every computation sends the whole request."""

    def __init__(self, controller: BurstController, request: Request, measure: bool,
                 loop_timeout: float | None):
        self._controller = controller
        self.request = request
        self.measure = bool(measure)
        self.loop_timeout = loop_timeout
        pools = bind(request.pools, request.inputs, request.outputs, "nnrt-burst-bound")
        try:
            self._inputs, self._outputs, self._slots = controller._arguments(request,
                                                                             pools.places)
            self._memories = tuple(p.memory for p in pools.places if p.memory is not pools.arena)
            # Checked once, encoded at each definition (a layout number may
            # be given back and taken again).
            encode_request(BurstRequest(0, self._inputs, self._outputs, self._slots, measure,
                                        None, loop_timeout))
        except BaseException:
            pools.close()
            raise
        self._pools = pools
        controller._layouts_staged += 1
        free = controller._free_layouts
        self._layout = free.pop() if free else 0
        self._defined = False

    async def execute(self, deadline: float | None = None) -> ExecutionResult:
        controller = self._controller
        async with controller._turn() as problem:
            if problem is not None:
                return problem
            if self._pools is None:
                return ExecutionResult(ErrorStatus.INVALID_ARGUMENT,
                                       message="the burst execution was released")
            for k, memory in enumerate(self._memories):
                if memory.closed:
                    return ExecutionResult(ErrorStatus.INVALID_ARGUMENT,
                                           message=f"a memory of the bound request ({k}) is "
                                                   f"closed")
            serial = next(controller._serials)
            try:
                if self._defined:
                    frame = encode_run(BurstRun(serial, self._layout, deadline))
                else:
                    frame = encode_request(BurstRequest(
                        serial, self._inputs, self._outputs, self._slots, self.measure, deadline,
                        self.loop_timeout, self._layout))
            except BurstProtocolError as e:
                return ExecutionResult(ErrorStatus.INVALID_ARGUMENT, message=e.message)
            controller._bytes_staged += self._pools.copy_in()
            result, _ = await controller._round_trip(frame, serial)
            self._defined = self._layout != 0 and result.status == ErrorStatus.NONE
            if result.status == ErrorStatus.NONE:
                controller._bytes_staged += self._pools.copy_out()
            return result

    def release(self) -> None:
        """Give the layout number back and close the arena. The service
        keeps the layout's binding until the number is defined again or a
        slot it uses is freed. Idempotent."""
        pools, self._pools = self._pools, None
        if pools is None:
            return
        if self._layout:
            self._controller._free_layouts.append(self._layout)
            self._layout = 0
        pools.close()

    def __repr__(self) -> str:
        return (f"<BoundBurstExecution layout {self._layout or 'none'} of "
                f"{self._controller!r}>")


__all__ = ["BoundBurstExecution", "BurstController", "BurstControllerStatistics", "BurstLink", "MemoryGrant",
           "REQUEST_RING_SIZE", "RESULT_RING_SIZE"]
