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
                        bytes) is copied into the controller's arena, itself
                        a Memory with a slot, and outputs are copied back
    encode, write       the request frame (serial numbers count from 1)
    wait                the result ring's eventfd, or the wake-up eventfd
    decode, match       the result of our serial; older serials are results
                        of executions whose caller was cancelled: dropped

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

import collections
import itertools
import os
import threading
import weakref
from dataclasses import dataclass

import anyio

import abc

from ..hal import (BurstSession, ExecutionResult, OutputShape, Request, Timing)
from ..errors import ErrorStatus, NnrtError
from ..fmq import Ready, Ring, RingClosed, RingCorrupted, WouldBlock
from ..memory import Memory
from .. import trace
from .wire import (BurstArgument, BurstProtocolError, BurstRequest, RequestEncoder,
                   decode_result)

REQUEST_RING_SIZE = 1 << 19   # > 2 * wire.MAX_REQUEST_SIZE: any request fits
RESULT_RING_SIZE = 1 << 18    # > 2 * wire.MAX_RESULT_SIZE
_ALIGN = 64


@dataclass(frozen=True, slots=True)
class BurstControllerStatistics:
    executions: int
    slots: int               # slots the controller has given out and not freed
    slots_freed: int
    bytes_staged: int        # bytes copied through the arena (in and out), in total


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
    over. The connection (``nnrt.drivers.service.client``) owns the control
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
        self._lock = anyio.Lock()
        self._serials = itertools.count(1)
        self._encoder = RequestEncoder()
        self._slot_ids = itertools.count(1)
        self._slot_of: weakref.WeakKeyDictionary[Memory, int] = weakref.WeakKeyDictionary()
        self._memory_of: dict[int, weakref.ref] = {}      # read by the reader thread
        self._collected: collections.deque[int] = collections.deque()
        self._arena: Memory | None = None
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
        return BurstControllerStatistics(self._executions, len(self._memory_of),
                                         self._slots_freed, self._bytes_staged)

    # -- execution ------------------------------------------------------------

    async def execute(self, request: Request, measure: bool = False,
                      deadline: float | None = None,
                      loop_timeout: float | None = None) -> ExecutionResult:
        async with self._lock:
            problem = self._unusable()
            if problem is not None:
                return problem
            self._busy = True
            try:
                return await self._execute(request, measure, deadline, loop_timeout)
            finally:
                self._busy = False
                if self.closed:
                    self._close_rings()

    def _unusable(self) -> ExecutionResult | None:
        if self.closed:
            return ExecutionResult(ErrorStatus.INVALID_ARGUMENT,
                                   message="the burst session is closed")
        if self._dead is not None:
            return ExecutionResult(self._dead_status, message=self._dead)
        return None

    async def _execute(self, request: Request, measure, deadline, loop_timeout):
        self._flush_frees()
        try:
            plan = self._plan(request)
        except NnrtError as e:
            return ExecutionResult(e.status, message=e.message)
        serial = next(self._serials)
        try:
            frame = self._encoder.encode(BurstRequest(serial, plan.inputs, plan.outputs,
                                                      plan.slots, bool(measure), deadline,
                                                      loop_timeout))
        except BurstProtocolError as e:
            return ExecutionResult(ErrorStatus.INVALID_ARGUMENT, message=e.message)
        return await self._round_trip(serial, frame, plan)

    @trace.traced("burst hand-off")
    async def _round_trip(self, serial: int | None, frame: bytes, plan=None) -> ExecutionResult:
        """Write ``frame`` and await the result of ``serial`` (None: the next
        result, whatever its serial -- for_test_execute_raw)."""
        outstanding = True
        try:
            while True:
                try:
                    self._requests.write_nowait(frame)
                    break
                except WouldBlock:
                    # Full only when cancelled executions' requests are still
                    # queued: wait for the server to take them.
                    if await self._requests.wait_write(len(frame), also=self._wake) \
                            is Ready.ALSO and self._woken():
                        outstanding = False
                        return self._unusable()
            while True:
                try:
                    raw = self._results.read_nowait()
                except WouldBlock:
                    if await self._results.wait_read(also=self._wake) is Ready.ALSO \
                            and self._woken():
                        outstanding = False
                        return self._unusable()
                    continue
                try:
                    result = decode_result(raw)
                except BurstProtocolError as e:
                    outstanding = False
                    return self._tear_down(f"the service sent a result that does not decode: "
                                           f"{e.message}")
                if serial is None or result.serial == serial or result.serial == 0:
                    outstanding = False
                    break
                if result.serial > serial:
                    outstanding = False
                    return self._tear_down(f"result serial {result.serial} answers no request "
                                           f"(expected {serial})")
                # An older serial: a cancelled execution's result; drop it.
        except (RingCorrupted, RingClosed) as e:
            outstanding = False
            return self._tear_down(f"the burst's ring failed: {e}")
        finally:
            if outstanding and plan is not None and plan.staged:
                # Cancelled with the request in flight: the server may still
                # write this execution's outputs into the arena, so the next
                # execution must not share it.
                self._drop_arena()
        shapes = tuple(OutputShape(s.dimensions, s.is_sufficient) for s in result.output_shapes)
        if result.status == ErrorStatus.NONE and plan is not None:
            self._copy_out(plan)
        self._executions += 1
        return ExecutionResult(result.status, shapes, Timing(result.on_device, result.in_driver),
                               result.message)

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
            async with self._lock:
                problem = self._unusable()
                if problem is not None:
                    return problem
                return await self._round_trip(None, bytes(frame))
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

    def _slot(self, mem: Memory) -> int:
        slot = self._slot_of.get(mem)
        if slot is None:
            slot = next(self._slot_ids)
            self._slot_of[mem] = slot
            self._memory_of[slot] = weakref.ref(mem)
            weakref.finalize(mem, self._collected.append, slot)
        return slot

    def _plan(self, request: Request) -> "_Plan":
        output_pools = {a.location.pool_index for a in request.outputs
                        if not a.has_no_value and a.location is not None}
        input_pools = {a.location.pool_index for a in request.inputs
                       if not a.has_no_value and a.location is not None}
        where: list[tuple[int, int]] = []      # pool index -> (slot index, base offset)
        slots: list[int] = []
        index_of_slot: dict[int, int] = {}
        staged: dict[int, tuple[memoryview, int]] = {}
        total = 0

        def slot_index(slot: int) -> int:
            if slot not in index_of_slot:
                index_of_slot[slot] = len(slots)
                slots.append(slot)
            return index_of_slot[slot]

        for k, pool in enumerate(request.pools):
            if isinstance(pool, Memory):
                if pool.closed:
                    raise NnrtError(ErrorStatus.INVALID_ARGUMENT,
                                    f"request pool {k} is a closed Memory")
                where.append((slot_index(self._slot(pool)), 0))
                continue
            try:
                raw = memoryview(pool).cast("B")
            except (TypeError, ValueError) as e:
                raise NnrtError(ErrorStatus.INVALID_ARGUMENT,
                                f"request pool {k} is not a contiguous buffer: {e}") from None
            if k in output_pools and raw.readonly:
                raise NnrtError(ErrorStatus.INVALID_ARGUMENT,
                                f"request pool {k} holds an output but is read-only")
            staged[k] = (raw, total)
            where.append((-1, total))
            total += -(-max(raw.nbytes, 1) // _ALIGN) * _ALIGN
        if staged:
            arena = self._take_arena(total)
            arena_index = slot_index(self._slot(arena))
            view = arena.view()
            for k, (raw, base) in staged.items():
                where[k] = (arena_index, base)
                if k in input_pools and raw.nbytes:
                    view[base:base + raw.nbytes] = raw
                    self._bytes_staged += raw.nbytes

        def argument(a, what: str) -> BurstArgument:
            if a.has_no_value:
                return BurstArgument(has_no_value=True)
            loc = a.location
            if loc is None or not 0 <= loc.pool_index < len(where):
                raise NnrtError(ErrorStatus.INVALID_ARGUMENT,
                                f"{what}: pool index {None if loc is None else loc.pool_index} "
                                f"out of range ({len(where)} pools)")
            index, base = where[loc.pool_index]
            if loc.offset < 0 or loc.length < 0:
                raise NnrtError(ErrorStatus.INVALID_ARGUMENT,
                                f"{what}: negative offset or length")
            if loc.pool_index in staged and loc.offset + loc.length > \
                    staged[loc.pool_index][0].nbytes:
                # The arena is larger than the pool: a region past the pool's
                # end would not be caught by the driver.
                raise NnrtError(ErrorStatus.INVALID_ARGUMENT,
                                f"{what}: region [{loc.offset}, {loc.offset + loc.length}) lies "
                                f"outside pool {loc.pool_index} of "
                                f"{staged[loc.pool_index][0].nbytes} bytes")
            return BurstArgument(False, index, base + loc.offset, loc.length,
                                 tuple(a.dimensions))

        inputs = tuple(argument(a, f"input {k}") for k, a in enumerate(request.inputs))
        outputs = tuple(argument(a, f"output {k}") for k, a in enumerate(request.outputs))
        return _Plan(inputs, outputs, tuple(slots), staged, output_pools,
                     self._arena if staged else None)

    def _take_arena(self, size: int) -> Memory:
        if self._arena is None or self._arena.size < size:
            self._drop_arena()
            self._arena = Memory.create(max(4096, 1 << (size - 1).bit_length()),
                                        "nnrt-burst-arena")
        return self._arena

    def _drop_arena(self) -> None:
        if self._arena is not None:
            self._arena.close()   # its slot is freed with the next execution
            self._arena = None

    def _copy_out(self, plan: "_Plan") -> None:
        if plan.arena is None or plan.arena.closed:
            return
        view = plan.arena.view()
        for k in plan.output_pools:
            entry = plan.staged.get(k)
            if entry is not None and entry[0].nbytes:
                raw, base = entry
                raw[:] = view[base:base + raw.nbytes]
                self._bytes_staged += raw.nbytes

    def _flush_frees(self) -> None:
        """Tell the service about slots whose Memory was closed or collected."""
        freed = set()
        while self._collected:
            freed.add(self._collected.popleft())
        for slot, ref in list(self._memory_of.items()):
            mem = ref()
            if mem is None or mem.closed:
                freed.add(slot)
        freed &= self._memory_of.keys()
        if not freed:
            return
        for slot in freed:
            ref = self._memory_of.pop(slot)
            mem = ref()
            if mem is not None:
                self._slot_of.pop(mem, None)
        self._slots_freed += len(freed)
        self._link.free_slots(self.burst_id, tuple(sorted(freed)))

    # -- called from the channel's reader thread ----------------------------------

    def grant_memories(self, slots) -> list[MemoryGrant]:
        """The memories of ``slots``, for the server that asked for them,
        each with a duplicate fd the caller closes once sent (the app may
        close a Memory meanwhile); NnrtError naming a slot that has none."""
        grants: list[MemoryGrant] = []
        try:
            for slot in slots:
                ref = self._memory_of.get(slot)
                mem = ref() if ref is not None else None
                if mem is None or mem.closed:
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
        self._drop_arena()
        self._memory_of.clear()
        with self._wake_lock:
            if self._wake >= 0:
                os.close(self._wake)
                self._wake = -1

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("dead" if self._dead else "open")
        return f"<BurstController {self.burst_id} ({state})>"


class _Plan:
    __slots__ = ("inputs", "outputs", "slots", "staged", "output_pools", "arena")

    def __init__(self, inputs, outputs, slots, staged, output_pools, arena):
        self.inputs = inputs
        self.outputs = outputs
        self.slots = slots
        self.staged = staged              # pool index -> (user buffer, offset in the arena)
        self.output_pools = output_pools
        self.arena = arena


__all__ = ["BurstController", "BurstControllerStatistics", "BurstLink", "MemoryGrant",
           "REQUEST_RING_SIZE", "RESULT_RING_SIZE"]
