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
                        (the arena and the slot cache are those of every
                        service client: nnrt.memory.staging)
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

import itertools
import os
import threading
from dataclasses import dataclass
from typing import NamedTuple

import anyio

import abc

from ..hal import (NO_TIMING, BurstSession, ExecutionResult, OutputShape, Request, Timing)
from ..errors import ErrorStatus, NnrtError
from ..fmq import Ready, Ring, RingClosed, RingCorrupted, WouldBlock
from ..memory import DeviceToken
from ..memory.staging import ArenaPool, SlotCache, Staging, Stager
from .. import trace
from .wire import (UINT64_MAX, BurstArgument, BurstProtocolError, RequestEncoder,
                   ResultDecoder)

REQUEST_RING_SIZE = 1 << 19   # > 2 * wire.MAX_REQUEST_SIZE: any request fits
RESULT_RING_SIZE = 1 << 18    # > 2 * wire.MAX_RESULT_SIZE


@dataclass(frozen=True, slots=True)
class BurstControllerStatistics:
    executions: int
    slots: int               # slots the controller has given out and not freed
    slots_freed: int
    bytes_staged: int        # bytes copied through the arena (in and out), in total
    layouts_staged: int = 0  # requests whose pools and regions were checked in full
                             # (once per layout: a request laid out as the last
                             # one only has its bytes copied)


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
        # Orders concurrent callers of one session. fast_acquire: taking it
        # when free is a flag, not a trip through the event loop (issue 16).
        self._lock = anyio.Lock(fast_acquire=True)
        self._serials = itertools.count(1)
        self._encoder = RequestEncoder()
        # The last request's layout: a request with the same argument tuples
        # (the runtime reuses them while shapes hold) placed alike converts
        # to the same burst arguments, which the encoder then recognises.
        self._last_layout: _Layout | None = None
        self._decoder = ResultDecoder()
        self._slots = SlotCache()        # read by the connection's reader thread too
        # One execution at a time: one arena, reused while nothing else may write it.
        self._arenas = ArenaPool("nnrt-burst-arena", max_free=1)
        self._stager = Stager(self._arenas)
        # (OutputShapes of the last result, the burst shapes they came from).
        self._last_shapes: tuple = ((), ())
        # (a decoded result, the ExecutionResult it made without timings).
        self._last_result: tuple = (None, None)
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
                                         self._stager.layouts)

    # -- execution ------------------------------------------------------------

    async def execute(self, request: Request, measure: bool = False,
                      deadline: float | None = None,
                      loop_timeout: float | None = None) -> ExecutionResult:
        lock = self._lock
        try:
            lock.acquire_nowait()     # free: taken without a trip through the loop
        except WouldBlock:
            await lock.acquire()
        try:
            if self.closed or self._dead is not None:
                return self._unusable()
            self._busy = True
            try:
                # (Inline, not a second coroutine: one frame less to resume per wake-up.)
                self._flush_frees()
                try:
                    plan = self._plan(request)
                except NnrtError as e:
                    return ExecutionResult(e.status, message=e.message)
                serial = next(self._serials)
                try:
                    frame = self._encoder.encode_fields(serial, plan.inputs, plan.outputs,
                                                        plan.slots, measure, deadline,
                                                        loop_timeout)
                except BurstProtocolError as e:
                    plan.staging.finish()
                    return ExecutionResult(ErrorStatus.INVALID_ARGUMENT, message=e.message)
                return await self._round_trip(serial, frame, plan)
            finally:
                self._busy = False
                if self.closed:
                    self._close_rings()
        finally:
            lock.release()

    def _unusable(self) -> ExecutionResult | None:
        if self.closed:
            return ExecutionResult(ErrorStatus.INVALID_ARGUMENT,
                                   message="the burst session is closed")
        if self._dead is not None:
            return ExecutionResult(self._dead_status, message=self._dead)
        return None

    @trace.traced("burst hand-off")
    async def _round_trip(self, serial: int | None, frame, plan=None) -> ExecutionResult:
        """Write ``frame`` and await the result of ``serial`` (None: the next
        result, whatever its serial -- for_test_execute_raw)."""
        outstanding = True
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
                        outstanding = False
                        return self._unusable()
            while True:
                # Wait first: the result is seldom there yet, and a wait
                # that finds it returns at once (read_nowait's WouldBlock
                # would be raised and caught on every frame).
                if await results.wait_read(also=self._wake) is Ready.ALSO and self._woken():
                    outstanding = False
                    return self._unusable()
                try:
                    raw = results.read_nowait()
                except WouldBlock:
                    continue
                try:
                    result, got, on_device, in_driver = self._decoder.decode_parts(raw)
                except BurstProtocolError as e:
                    outstanding = False
                    return self._tear_down(f"the service sent a result that does not decode: "
                                           f"{e.message}")
                if serial is None or got == serial or got == 0:
                    outstanding = False
                    break
                if got > serial:
                    outstanding = False
                    return self._tear_down(f"result serial {got} answers no request "
                                           f"(expected {serial})")
                # An older serial: a cancelled execution's result; drop it.
            if result.status == ErrorStatus.NONE and plan is not None:
                self._bytes_staged += plan.staging.copy_out()
        except (RingCorrupted, RingClosed) as e:
            outstanding = False
            return self._tear_down(f"the burst's ring failed: {e}")
        finally:
            if plan is not None:
                # Cancelled with the request in flight: the server may still
                # write this execution's outputs into the arena, so the next
                # execution must not share it (its slot is freed next time).
                plan.staging.finish(reuse=not outstanding)
        self._executions += 1
        last = self._last_result
        if result is last[0] and on_device == in_driver == UINT64_MAX:
            # The decoder hands back one result object for every result of
            # its kind: without timings, the same ExecutionResult (frozen).
            return last[1]
        shapes = self._last_shapes
        if result.output_shapes is not shapes[1]:
            # ... and the same shapes tuple: converted once (issue 16).
            shapes = self._last_shapes = (tuple(OutputShape(s.dimensions, s.is_sufficient)
                                                for s in result.output_shapes),
                                          result.output_shapes)
        if on_device == in_driver == UINT64_MAX:
            answer = ExecutionResult(result.status, shapes[0], NO_TIMING, result.message)
            self._last_result = (result, answer)
            return answer
        return ExecutionResult(result.status, shapes[0], Timing(on_device, in_driver),
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

    def _plan(self, request: Request) -> "_Plan":
        """The request in slots: its pools placed by nnrt.memory.staging, each
        memory named by its slot, arguments offset into their place."""
        staging = self._stager.stage(request.pools, request.inputs, request.outputs)
        try:
            self._bytes_staged += staging.bytes_in
            last = self._last_layout
            if last is not None and last.places is staging.places \
                    and last.inputs is request.inputs and last.outputs is request.outputs:
                # Staged as the last request, into the same places (only our
                # arena: the stager keeps no app Memory): the same slots and
                # burst arguments, without looking them up again.
                return _Plan(last.burst_inputs, last.burst_outputs, last.slots, staging)
            slots: list[int] = []
            index_of_slot: dict[int, int] = {}
            where: list[tuple[int, int]] = []    # pool index -> (slot index, base offset)
            for k, place in enumerate(staging.places):
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
            last = self._last_layout
            slots = tuple(slots)
            kept = staging.places if staging.places is self._stager.kept_places else None
            if last is not None and last.inputs is request.inputs \
                    and last.outputs is request.outputs and last.where == where:
                # The arguments of the last request, placed alike: the same.
                self._last_layout = last._replace(places=kept, slots=slots)
                return _Plan(last.burst_inputs, last.burst_outputs, slots, staging)

            def argument(a, what: str) -> BurstArgument:
                if a.has_no_value:
                    return BurstArgument(has_no_value=True)
                loc = a.location
                if loc is None or not 0 <= loc.pool_index < len(where):
                    raise NnrtError(ErrorStatus.INVALID_ARGUMENT,
                                    f"{what}: pool index "
                                    f"{None if loc is None else loc.pool_index} "
                                    f"out of range ({len(where)} pools)")
                if loc.offset < 0 or loc.length < 0:
                    raise NnrtError(ErrorStatus.INVALID_ARGUMENT,
                                    f"{what}: negative offset or length")
                index, base = where[loc.pool_index]
                return BurstArgument(False, index, base + loc.offset, loc.length,
                                     tuple(a.dimensions))

            inputs = tuple(argument(a, f"input {k}") for k, a in enumerate(request.inputs))
            outputs = tuple(argument(a, f"output {k}") for k, a in enumerate(request.outputs))
            self._last_layout = _Layout(request.inputs, request.outputs, where, inputs, outputs,
                                        kept, slots)
        except BaseException:
            staging.finish()
            raise
        return _Plan(inputs, outputs, slots, staging)

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
        self._stager.close()
        self._arenas.close()
        self._slots.clear()
        with self._wake_lock:
            if self._wake >= 0:
                os.close(self._wake)
                self._wake = -1

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("dead" if self._dead else "open")
        return f"<BurstController {self.burst_id} ({state})>"


class _Layout(NamedTuple):
    """How the last request was laid out in slots (``BurstController._plan``)."""
    inputs: tuple              # its HAL argument tuples, recognised by identity
    outputs: tuple
    where: list                # pool index -> (slot index, base offset)
    burst_inputs: tuple        # the burst arguments they converted to
    burst_outputs: tuple
    places: tuple | None       # the stager's kept places it was staged into, if any
    slots: tuple[int, ...]


class _Plan:
    __slots__ = ("inputs", "outputs", "slots", "staging")

    def __init__(self, inputs, outputs, slots, staging: Staging):
        self.inputs = inputs
        self.outputs = outputs
        self.slots = slots
        self.staging = staging


__all__ = ["BurstController", "BurstControllerStatistics", "BurstLink", "MemoryGrant",
           "REQUEST_RING_SIZE", "RESULT_RING_SIZE"]
