"""Fenced execution of a compiled model: its steps chained by sync fences.

Theory of operation
-------------------
``execute_fenced(compiled, inputs, wait_for=...)`` returns ``(fence,
callback)`` at once. Each step of the compiled model (one per device run of
the partition) becomes one HAL ``execute_fenced`` whose ``wait_for`` is the
previous step's fence; the app's ``wait_for`` gates the first step. A step
on a driver service therefore starts in the service the moment its input
fence is signaled, without a round trip through the app: the app awaits
only the returned fence.

Buffers. Every operand crossing a step boundary lives in its own shared
memory (:class:`nnrt.memory.Memory`), allocated *before* launching, because
a step launched now reads its inputs and writes its outputs later, in
whichever process runs it. Sizes come from each step's output guess (the
shapes declared or inferred at compile time, refined by executions). A step
whose outputs have unknown shapes cannot be sized in advance: it runs as an
*awaited stage* (it waits for its input fence like the others, then runs
with the runtime's grow-and-retry on OUTPUT_INSUFFICIENT_SIZE), and the
launcher waits for it to settle before sizing and launching the later steps.
The chain is still fenced; only its launch pauses there.

The app's inputs are copied into runtime memory when they are known to be
ready: at the call when ``wait_for`` is empty (the app may reuse its arrays
at once), otherwise once every ``wait_for`` fence is signaled (a producer
may be writing them until then), by the launcher, which then launches the
first step. The app's fences are awaited there rather than handed to the
first step because the copy out of the app's arrays has to happen in this
process anyway, and launching a step on a driver service is a single send
(the client makes the result fence), so nothing is lost by launching late.

Who runs it. The chain must outlive the ``execute_fenced`` call, so the
launcher is a task of the runtime's own task group (``Runtime.task_group``,
entered by ``async with nnrt.Runtime()`` and cancelled when the runtime
closes: pending chains then settle their fences with an error). It runs on
the app's event loop and only ever waits on eventfds, so asyncio, uvloop
and trio apps all work; in-process steps run on the scheduler's worker
threads, steps on driver services in their service.

The returned fence is the runtime's own: the launcher signals it after every
step's callback has settled (so no driver still touches a buffer), after
copying results into app-given output arrays, and after recording the
outcome in the callback; whoever wakes on it finds ``get_execution_info``
and ``get_result`` ready. Before that both raise BAD_STATE (the rule of
docs/guide/fences-and-pipelines.md).

Not done here, unlike ``execute``: a step that fails because of its driver
is not rerun on the CPU (the chain's fence may already be in other hands
waiting for this very execution); the chain fails with the step's status.
"""
from __future__ import annotations

import math
import threading
import time
import weakref
from typing import Any, Sequence

import anyio
import anyio.lowlevel
import numpy as np

from ..errors import ErrorStatus, NnrtError, bad_state
from ..fence.sync_fence import SyncFence
from ..hal import UINT64_MAX, ExecutionResult
from ..hal.fenced import check_timeout_after_fence, check_wait_for, microseconds, run_fenced
from ..memory import Memory, Region
from ..vlog import vlog
from .results import ExecutionTiming, Result, copy_into
from .step import Buffer, build_request

# -- public results -------------------------------------------------------------

class FencedCallback:
    """What a fenced execution of a compiled model reports. Nothing is
    available before its fence is signaled: ``get_*`` raise BAD_STATE, so
    outputs the runtime owns are never exposed early."""

    def __init__(self, fence: SyncFence):
        self._fence = fence  # our own handle, to await in result()
        self._status: ErrorStatus | None = None
        self._message = ""
        self._timings: tuple[ExecutionTiming, ExecutionTiming] | None = None
        self._result: Result | None = None

    @property
    def done(self) -> bool:
        return self._status is not None

    def get_execution_info(self) -> tuple[ErrorStatus, ExecutionTiming, ExecutionTiming]:
        """``(status, timing_launched, timing_fenced)``: launched runs from the
        ``execute_fenced`` call to the fence being signaled, fenced from the
        last ``wait_for`` fence being signaled (the call, without any) to the
        fence. Microseconds, None when not measured (``measure_timing=False``
        or a failed execution). BAD_STATE before the fence is signaled."""
        if self._status is None:
            raise bad_state("get_execution_info: the fenced execution's fence is not signaled yet")
        return self._status, *self._timings

    def get_result(self) -> Result:
        """The :class:`nnrt.Result`; NnrtError with the status when the
        execution failed; BAD_STATE before the fence is signaled."""
        if self._status is None:
            raise bad_state("get_result: the fenced execution's fence is not signaled yet")
        if self._status is not ErrorStatus.NONE:
            raise NnrtError(self._status, self._message or "the fenced execution failed")
        return self._result

    async def result(self) -> Result:
        """Wait for the fence (without blocking the event loop), then
        :meth:`get_result`."""
        try:
            await self._fence.wait_signaled()
        except NnrtError:
            pass  # get_result raises with the status and the step's message
        return self.get_result()

    def _settle(self, status: ErrorStatus, message: str, launched: ExecutionTiming,
                fenced: ExecutionTiming, result: Result | None) -> None:
        self._message = message
        self._timings = (launched, fenced)
        self._result = result
        self._status = status  # last: `done` and the getters key on it


_NOT_MEASURED = ExecutionTiming(None, None)


# -- buffers --------------------------------------------------------------------

class _MemoryPool:
    """The shared memories of one compiled model's fenced executions, reused
    once an execution has settled: a driver service keeps a memory it has
    seen mapped (by id), so steady-state executions pass no fds and map
    nothing. Sizes are rounded up to powers of two; a few are kept per size.
    Used from the app's thread and the host's, hence the lock."""

    PER_SIZE = 8

    def __init__(self):
        self._lock = threading.Lock()
        self._free: dict[int, list[Memory]] = {}

    def take(self, nbytes: int) -> Memory:
        size = max(64, 1 << max(0, nbytes - 1).bit_length())
        with self._lock:
            free = self._free.get(size)
            if free:
                return free.pop()
        return Memory.create(size, "nnrt-fenced")

    def give(self, memory: Memory) -> None:
        with self._lock:
            free = self._free.setdefault(memory.size, [])
            if len(free) < self.PER_SIZE and not memory.closed:
                free.append(memory)
                return
        memory.close()


_pools: "weakref.WeakKeyDictionary[Any, _MemoryPool]" = weakref.WeakKeyDictionary()
_pools_lock = threading.Lock()


def _pool_of(compiled) -> _MemoryPool:
    with _pools_lock:
        pool = _pools.get(compiled)
        if pool is None:
            pool = _pools[compiled] = _MemoryPool()
        return pool


def _out_shape(dims, operand) -> tuple[int, ...]:
    return () if operand.type.is_scalar else tuple(dims)


# -- the chain --------------------------------------------------------------------

class _Chain:
    def __init__(self, compiled, arrays: list, user_outputs, wait_for: list[SyncFence],
                 measure: bool, deadline, loop_timeout, timeout_after_fence,
                 fence: SyncFence, callback: FencedCallback, launched_at: float):
        self.compiled = compiled
        self.steps = list(compiled._steps)
        self.arrays = arrays
        self.user_outputs = user_outputs
        self.wait_for = wait_for
        self.measure = measure
        self.deadline = deadline
        self.loop_timeout = loop_timeout
        self.timeout_after_fence = timeout_after_fence
        self.fence = fence
        self.callback = callback
        self.launched_at = launched_at
        self.fenced_at: float | None = None
        hal = compiled.model.hal_model
        self.input_indexes = hal.main.input_indexes
        self.input_operands = [hal.main.operands[i] for i in self.input_indexes]
        self.output_indexes = hal.main.output_indexes
        self.values: dict[int, Buffer | None] = {}
        self.pool = _pool_of(compiled)
        self.memories: list[Memory] = []
        self.callbacks: list = []          # one per launched stage, in chain order
        self.launch_error: NnrtError | None = None

    # inputs

    def stage_inputs(self) -> None:
        """Copy the app's inputs into runtime memory (they are ready now); an
        input given as a Region of an nnrt.Memory is used in place."""
        for index, arr, operand in zip(self.input_indexes, self.arrays, self.input_operands):
            if arr is None:
                self.values[index] = None
                continue
            if isinstance(arr, Region):
                dims = (arr.dimensions or operand.dimensions) if operand.type.is_tensor else ()
                self.values[index] = Buffer(arr.memory, operand.type.dtype, tuple(dims),
                                            arr.offset, arr.length)
                continue
            buf = self.values.get(index)
            if buf is None:
                buf = self._allocate(arr.dtype, arr.shape)
                self.values[index] = buf
            buf.array()[...] = arr

    def _allocate(self, dtype, shape) -> Buffer:
        dtype = np.dtype(dtype)
        buf = Buffer(self.pool.take(math.prod(shape) * dtype.itemsize), dtype, tuple(shape))
        self.memories.append(buf.memory)
        return buf

    # launching (a task of the runtime's task group)

    async def drive(self, tg) -> None:
        try:
            try:
                await self._launch(tg)
            except NnrtError as e:  # a step refused its request: the chain stops here
                self.launch_error = e
            except Exception as e:  # noqa: BLE001 - a driver bug must not leave the fence ACTIVE
                self.launch_error = NnrtError(ErrorStatus.GENERAL_FAILURE,
                                              f"launching the fenced chain raised "
                                              f"{type(e).__name__}: {e}")
            await self._settle()
        finally:
            for f in self.wait_for:
                f.close()

    async def _launch(self, tg) -> None:
        if self.wait_for:
            # The inputs are the app's arrays, copied here, so the app's
            # fences are awaited here too; launching the first step after
            # them costs no round trip (a service call is a send).
            await self._wait_for_app_fences()
            self.fenced_at = time.monotonic()
            self.stage_inputs()
        else:
            self.fenced_at = self.launched_at
        prev: list[SyncFence] = []
        for k, step in enumerate(self.steps):
            if step.sized():
                fence, cb = await self._launch_step(tg, step, prev, list(step.output_guess))
            else:
                vlog("execution", "fenced step %d has outputs of unknown shape: awaiting it", k)
                fence, cb = await self._launch_awaited(tg, step, prev)
                await cb.wait_execution_info()
            for f in prev:
                f.close()
            prev = [fence]
            self.callbacks.append(cb)
        for f in prev:
            f.close()

    async def _wait_for_app_fences(self) -> None:
        """Return once every app fence is signaled; NnrtError with a fence's
        status if one was signaled with an error (checked for all first, so
        an error already there is seen at once), MISSED_DEADLINE_TRANSIENT
        if the deadline passes first."""
        for f in self.wait_for:
            f.poll()
            if f.status is not ErrorStatus.NONE:
                f.wait_signaled_nowait()  # raises with its status
        timeout = math.inf if self.deadline is None else self.deadline - time.monotonic()
        with anyio.move_on_after(timeout):
            for f in self.wait_for:
                await f.wait_signaled()
            return
        raise NnrtError(ErrorStatus.MISSED_DEADLINE_TRANSIENT,
                        "the deadline passed before the wait_for fences were signaled")

    async def _launch_step(self, tg, step, prev, guesses):
        out_bufs = [self._allocate(o.type.dtype, _out_shape(g, o))
                    for g, o in zip(guesses, step.outputs)]
        self.values.update(zip(step.plan.outputs, out_bufs))
        request = build_request([self.values[i] for i in step.plan.inputs], step.inputs, out_bufs)
        return await step.prepared.execute_fenced(
            tg, request, prev, self.measure, self.deadline, self.loop_timeout,
            self.timeout_after_fence)

    async def _launch_awaited(self, tg, step, prev):
        def allocate(dims, operand) -> Buffer:
            known = operand.type.is_scalar or (len(dims) > 0 and all(d > 0 for d in dims))
            return self._allocate(operand.type.dtype, _out_shape(dims, operand) if known else (0,))

        async def run(run_deadline) -> ExecutionResult:
            async def execute(request):
                return await step.prepared.execute(request, self.measure, run_deadline,
                                                   self.loop_timeout)
            result, outs = await step.run(self.values, execute, allocate=allocate)
            if result.status == ErrorStatus.NONE:
                self.values.update(zip(step.plan.outputs, outs))
            return result

        return await run_fenced(tg, run, prev, measure=self.measure, deadline=self.deadline,
                                timeout_after_fence=self.timeout_after_fence)

    # settling

    async def _settle(self) -> None:
        """Wait for every launched stage, then publish the outcome and signal."""
        status, message = ErrorStatus.NONE, ""
        results = []
        with anyio.CancelScope(shield=True):
            for cb in self.callbacks:
                try:
                    await cb.wait_execution_info()
                    results.append(cb.get_result())
                except NnrtError as e:
                    results.append(ExecutionResult(e.status, message=e.message))
        for r in results:  # the first failure is the cause; later stages only saw its fence
            if r.status is not ErrorStatus.NONE and status is ErrorStatus.NONE:
                status, message = r.status, r.message
        if self.launch_error is not None and status is ErrorStatus.NONE:
            status, message = self.launch_error.status, self.launch_error.message
        result = None
        if status is ErrorStatus.NONE:
            try:
                result = self._result(results[-len(self.steps):])
            except NnrtError as e:
                status, message = e.status, e.message
        launched = fenced = _NOT_MEASURED
        signal_at = time.monotonic()
        if self.measure and status is ErrorStatus.NONE:
            on_device = result.timing.on_device if result.timing else None
            launched_us = microseconds(signal_at - self.launched_at)
            fenced_us = min(microseconds(signal_at - self.fenced_at), launched_us)
            if on_device is not None:
                launched_us, fenced_us = max(launched_us, on_device), max(fenced_us, on_device)
            launched = ExecutionTiming(on_device, launched_us)
            fenced = ExecutionTiming(on_device, fenced_us)
        self.callback._settle(status, message, launched, fenced, result)
        self._release(status)
        if status is ErrorStatus.NONE:
            self.fence.signal()
        else:
            self.fence.signal_error(status)
        self.fence.close()

    def _result(self, step_results: list[ExecutionResult]) -> Result:
        # Views onto the shared memory (no copy): the mapping outlives the
        # Memory's fd, which _release closes, for as long as a view exists.
        outputs = [self.values[index].array() for index in self.output_indexes]
        if self.user_outputs is not None:
            outputs = copy_into(self.user_outputs, outputs)
        timing = None
        if self.measure:
            on_device = in_driver = 0
            for r in step_results:
                if r.timing.on_device == UINT64_MAX or r.timing.in_driver == UINT64_MAX:
                    on_device = in_driver = None
                    break
                on_device += r.timing.on_device
                in_driver += r.timing.in_driver
            timing = ExecutionTiming(on_device, in_driver)
        return Result(outputs, [tuple(o.shape) for o in outputs], timing)

    def _release(self, status: ErrorStatus) -> None:
        """Give the memories back to the pool, except those the result's
        arrays view (closed: the views keep the mapping alive) and all of
        them after a failure (a driver that lost contact with us might still
        write into one)."""
        exposed = set()
        if self.user_outputs is None:
            exposed = {id(self.values[i].memory) for i in self.output_indexes
                       if self.values.get(i) is not None}
        for m in self.memories:
            if status is ErrorStatus.NONE and id(m) not in exposed:
                self.pool.give(m)
            else:
                m.close()


async def execute_fenced(compiled, inputs: Sequence[Any], outputs: Sequence[np.ndarray] | None = None,
                         wait_for: Sequence[SyncFence] = (), measure_timing: bool = False,
                         deadline: float | None = None, loop_timeout: float | None = None,
                         timeout_after_fence: float | None = None,
                         ) -> tuple[SyncFence, FencedCallback]:
    """Run ``compiled`` once, after every fence of ``wait_for`` is signaled,
    without waiting for it: returns ``(fence, callback)`` at once. The fence
    is signaled when the execution is done (with an error status if it
    failed) and may be the ``wait_for`` of another execution; the callback
    gives the outcome after that. Arguments as :meth:`CompiledModel.execute`;
    ``timeout_after_fence`` (seconds) bounds each step from the moment its
    input fence is signaled (the whole execution for a single-step model).

    ``outputs`` the app passes hold the results once the returned fence is
    signaled (undefined before). ``inputs`` are read once every ``wait_for``
    fence is signaled (at the call without any), so a producer may fill them
    until it signals; from then until the returned fence the app must not
    change them. An input that needs converting (another dtype, not
    C-contiguous) is converted, hence read, at the call.
    Bad arguments raise INVALID_ARGUMENT here; nothing is started.
    """
    launched_at = time.monotonic()
    arrays, user_outputs, measure_timing, deadline = compiled._check_request(
        inputs, outputs, measure_timing, deadline)
    timeout_after_fence = check_timeout_after_fence(timeout_after_fence)
    fences = check_wait_for(wait_for)
    task_group = compiled._runtime.task_group   # BAD_STATE outside 'async with'
    fence = SyncFence.create()
    owned = []
    try:
        owned = [f.dup() for f in fences]
        callback = FencedCallback(fence._dup(can_signal=False))
        chain = _Chain(compiled, arrays, user_outputs, owned, bool(measure_timing), deadline,
                       loop_timeout, timeout_after_fence, fence, callback, launched_at)
        if not owned:
            chain.stage_inputs()  # ready now; the app may reuse its arrays at once
        caller_fence = fence._dup(can_signal=False)
    except BaseException:
        for f in owned:
            f.close()
        fence.close()
        raise
    task_group.start_soon(chain.drive, task_group)
    await anyio.lowlevel.checkpoint()
    return caller_fence, callback


__all__ = ["FencedCallback", "execute_fenced"]
