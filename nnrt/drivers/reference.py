"""The reference CPU driver: every operation of the registry, run in-process
with numpy. It is what the runtime falls back to and what every other driver
is compared with.

Every execution goes through the device's QoS scheduler
(:mod:`nnrt.qos.scheduler`, behind an :class:`~nnrt.qos.gate.ExecutionGate`):
``execute`` and ``execute_synchronously`` (and so bursts, which are built on
them) submit a job for the prepared model's app and priority, wait for a
slot, and run the executor with the gate's checkpoint at every operation
boundary, where a higher-priority job of the same app preempts it, a hopeless
deadline aborts it and a cancellation stops it. ``execute`` runs all of that
on a worker thread of its own — or, when it preempts a running job, on that
job's thread (donation, see :mod:`nnrt.qos.gate`) — and the result goes
straight from whichever thread ran it to the awaiting task. Cancelling the
awaiting task withdraws or stops the job and returns only once the thread
running it has let go of the request's buffers.
"""
from __future__ import annotations

import itertools
import os
import time
from typing import Callable, Hashable

import anyio
import numpy as np

from .. import ops
from .._version import __version__
from ..errors import ErrorStatus, NnrtError
from ..memory import as_buffer
from ..model.graph import HalModel, decode_value
from ..model.types import OperandType
from ..hal.validate import validate_model, validate_request
from ..qos.gate import ExecutionGate
from ..hal.types import Priority, check_deadline, check_priority
from ..qos.scheduler import (DEFAULT_QUEUE_LIMIT, Job, JobState, Scheduler, SchedulerStatistics,
                             check_key)
from ..vlog import vlog
from .executor import Executor
from ..handoff import Waiter, run_soon
from .heap import keep_freed_memory
from ..hal import (Capabilities, Device, DeviceType, ExecutionPreference, ExecutionResult,
                  OutputShape, PerformanceInfo, PreparedModel, Request, Timing, NO_TIMING)


class ReferenceDevice(Device):
    type = DeviceType.CPU
    feature_level = 30  # HAL 1.3 / Android 11
    version_string = f"nnrt-reference-{__version__}"

    def __init__(self, name: str = "nnrt-reference", *, app: Hashable = None, slots: int = 1,
                 queue_limit: int = DEFAULT_QUEUE_LIMIT, memory_limit: int | None = None,
                 clock: Callable[[], float] = time.monotonic):
        """``app`` keys the scheduler queue of models prepared without an
        explicit ``app=`` (default: this process's pid); ``slots`` is how many
        executions run at once; ``memory_limit`` (bytes) refuses bigger models
        with RESOURCE_EXHAUSTED_PERSISTENT."""
        keep_freed_memory()   # a fresh array per operation: see nnrt/drivers/heap.py
        self.name = name
        self.app = os.getpid() if app is None else check_key(app, "app key")
        self.scheduler = Scheduler(slots=slots, queue_limit=queue_limit,
                                   memory_limit=memory_limit, clock=clock, name=name)
        self.gate = ExecutionGate(self.scheduler, spawn=run_soon)

    def statistics(self) -> SchedulerStatistics:
        """The scheduler's counters per app and priority."""
        return self.gate.statistics()

    def finished_jobs(self) -> tuple:
        return self.gate.finished_jobs()

    def capabilities(self) -> Capabilities:
        one = PerformanceInfo(1.0, 1.0)
        return Capabilities(one, one, {t: one for t in OperandType}, one, one)

    def supported_operations(self, model: HalModel) -> list[bool]:
        supported = []
        for op in model.main.operations:
            try:
                opdef = ops.definition(op.type)
                opdef.validate(ops.OpView(model, None, op))
                supported.append(True)
            except NnrtError:
                supported.append(False)
        return supported

    async def prepare_model(self, model: HalModel, preference: ExecutionPreference = ExecutionPreference.FAST_SINGLE_ANSWER,
                            priority: Priority = Priority.MEDIUM, deadline: float | None = None,
                            cache=None, *, app: Hashable = None) -> "ReferencePreparedModel":
        return self.prepare_model_synchronously(model, preference, priority, deadline, app=app)

    def prepare_model_synchronously(self, model: HalModel,
                                    preference: ExecutionPreference = ExecutionPreference.FAST_SINGLE_ANSWER,
                                    priority: Priority = Priority.MEDIUM,
                                    deadline: float | None = None, *,
                                    app: Hashable = None) -> "ReferencePreparedModel":
        """Prepare ``model``; its executions run at ``priority`` in the queue
        of ``app`` (default: the device's ``app``)."""
        try:
            ExecutionPreference(preference)
        except ValueError:
            raise NnrtError(ErrorStatus.INVALID_ARGUMENT,
                            f"execution preference {preference!r} is not valid") from None
        priority = check_priority(priority)
        deadline = check_deadline(deadline)
        app = self.app if app is None else check_key(app, "app key")
        clock = self.scheduler.clock
        if deadline is not None and clock() > deadline:
            raise NnrtError(ErrorStatus.MISSED_DEADLINE_PERSISTENT,
                            "the preparation deadline had passed before preparation began")
        self.scheduler.check_memory(model_bytes(model), "the model")
        validated = validate_model(model)
        if deadline is not None and clock() > deadline:
            raise NnrtError(ErrorStatus.MISSED_DEADLINE_TRANSIENT,
                            "the model was prepared after its preparation deadline")
        vlog("driver", "%s: prepared a HAL %s model with %d operations (app %r, %s)", self.name,
             validated.version.name, len(model.main.operations), app, priority.name)
        return ReferencePreparedModel(model, Executor(model, validated), self.gate, priority, app)


def model_bytes(model: HalModel) -> int:
    """Memory a model needs to run: its constants plus every operand whose
    size is known (an upper bound: the executor frees nothing mid-run)."""
    total = len(model.operand_values)
    total += sum(as_buffer(pool).nbytes for pool in model.pools)
    for sub in (model.main, *model.referenced):
        total += sum(o.byte_size for o in sub.operands if o.location is None)
    return total


_PREPARED_IDS = itertools.count(1)

# Longest a donor thread waits for the donated job's result to be taken by
# its task before resuming its own job (a loop hop is ~0.1-0.3 ms).
_DONOR_LINGER = 0.002


class ReferencePreparedModel(PreparedModel):
    def __init__(self, model: HalModel, executor: Executor, gate: ExecutionGate,
                 priority: Priority = Priority.MEDIUM, app: Hashable = None):
        self.model = model
        self.executor = executor
        self.priority = Priority(priority)
        self.app = app
        self._gate = gate
        # The scheduler's run-time estimate is kept per prepared model.
        self.key = f"{type(self).__name__}-{next(_PREPARED_IDS)}"

    async def execute(self, request: Request, measure: bool = False,
                      deadline: float | None = None,
                      loop_timeout: float | None = None) -> ExecutionResult:
        started = time.perf_counter_ns()
        waiter = Waiter()

        def work(job: Job) -> None:
            # Called by the gate once: on a thread that owns the job (its own,
            # or a preempted job's: donation), or with the job already ended.
            if job.state is JobState.DONE:
                result = ExecutionResult(job.status or ErrorStatus.GENERAL_FAILURE,
                                         message=job.message)
            else:
                try:
                    result = self._run_claimed(job, request, measure, loop_timeout, started)
                except BaseException as e:   # SystemExit and the like: still answer
                    waiter.deliver(ExecutionResult(ErrorStatus.GENERAL_FAILURE,
                                                   message=f"the execution was interrupted: {e!r}"))
                    raise
            waiter.deliver(result)
            if self._gate.running_donated():
                # This thread's own job, preempted by this one, resumes next:
                # let the awaiting task take the result first, rather than
                # compete with it for the CPU and the GIL (bounded).
                waiter.wait_taken(_DONOR_LINGER)

        try:
            job = self._submit(request, deadline, work)
        except NnrtError as e:
            return ExecutionResult(e.status, message=e.message)
        try:
            return await waiter.wait()
        except BaseException:
            # Cancelled: withdraw the job, or stop it at its next boundary
            # (which gives the slot back), and wait, shielded, until the
            # thread running it lets go of the request's pools, which the
            # caller may free as soon as this returns: at most one operation.
            if self._gate.cancel(job):
                with anyio.CancelScope(shield=True):
                    await waiter.wait()
            raise

    def execute_synchronously(self, request: Request, measure: bool = False,
                              deadline: float | None = None,
                              loop_timeout: float | None = None) -> ExecutionResult:
        started = time.perf_counter_ns()
        try:
            job = self._submit(request, deadline)
        except NnrtError as e:
            return ExecutionResult(e.status, message=e.message)
        try:
            self._gate.claim(job)     # no work offered: only this thread runs it
        except NnrtError as e:
            return ExecutionResult(e.status, message=e.message)
        except BaseException:
            self._gate.cancel(job)
            raise
        return self._run_claimed(job, request, measure, loop_timeout, started)

    def _submit(self, request: Request, deadline, work=None) -> Job:
        deadline = check_deadline(deadline)
        validate_request(self.model, request)
        return self._gate.submit(self.app, self.priority, deadline=deadline, model=self.key,
                                 work=work)

    def _run_claimed(self, job: Job, request: Request, measure: bool,
                     loop_timeout: float | None, started: int) -> ExecutionResult:
        """Run a job this thread owns, with the gate's checkpoint at every
        boundary, and give the slot back. A failure is a result; only what is
        not an Exception (KeyboardInterrupt) propagates, after the slot is
        given back."""
        gate = self._gate
        shapes: tuple[OutputShape, ...] = ()
        message = ""
        try:
            inputs = self._read_inputs(request)
            outputs = self.executor.run(inputs, loop_timeout=loop_timeout, deadline=job.deadline,
                                        checkpoint=lambda _context: gate.checkpoint(job))
            shapes = tuple(OutputShape(tuple(np.shape(o)),
                                       np.asarray(o).nbytes <= arg.location.length)
                           for o, arg in zip(outputs, request.outputs))
            if all(s.is_sufficient for s in shapes):
                self._write_outputs(request, outputs)
                status = ErrorStatus.NONE
            else:
                status, message = (ErrorStatus.OUTPUT_INSUFFICIENT_SIZE,
                                   "an output buffer is too small")
        except NnrtError as e:
            status, message = e.status, e.message
            shapes = tuple(e.output_shapes or ()) or shapes
        except Exception as e:
            status, message = ErrorStatus.GENERAL_FAILURE, f"the executor raised {e!r}"
        except BaseException:   # KeyboardInterrupt in a synchronous caller: free the slot
            gate.finish(job, ErrorStatus.GENERAL_FAILURE, "the execution was interrupted")
            raise
        final = gate.finish(job, status, message)
        if final != status:
            # Never report success for work that finished after its deadline.
            return ExecutionResult(final, shapes, message=job.message)
        timing = NO_TIMING
        if measure and status == ErrorStatus.NONE:
            on_device = int(job.ran * 1_000_000)
            in_driver = max((time.perf_counter_ns() - started) // 1000, on_device)
            timing = Timing(on_device, in_driver)
        return ExecutionResult(status, shapes, timing, message)

    def _read_inputs(self, request: Request) -> list:
        sub = self.model.main
        inputs = []
        for arg, index in zip(request.inputs, sub.input_indexes):
            if arg.has_no_value:
                inputs.append(None)
                continue
            operand = sub.operands[index]
            loc = arg.location
            raw = as_buffer(request.pools[loc.pool_index])[loc.offset:loc.offset + loc.length]
            if operand.type.is_tensor:
                dims = tuple(arg.dimensions) or operand.dimensions
                inputs.append(np.frombuffer(raw, dtype=operand.type.dtype).reshape(dims))
            else:
                inputs.append(decode_value(operand, raw))
        return inputs

    def _write_outputs(self, request: Request, outputs: list) -> None:
        sub = self.model.main
        for arg, index, value in zip(request.outputs, sub.output_indexes, outputs):
            operand = sub.operands[index]
            arr = np.ascontiguousarray(value, dtype=operand.type.dtype)
            if arr.nbytes == 0:
                continue
            loc = arg.location
            pool = as_buffer(request.pools[loc.pool_index])
            if pool.readonly:
                raise NnrtError(ErrorStatus.INVALID_ARGUMENT,
                                f"output operand {index}: pool {loc.pool_index} is read-only")
            pool[loc.offset:loc.offset + arr.nbytes] = arr.reshape(-1).view(np.uint8)
