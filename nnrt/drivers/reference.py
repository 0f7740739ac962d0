"""The reference CPU driver: every operation of the registry, run in-process
with numpy. It is what the runtime falls back to and what every other driver
is compared with.

It schedules nothing itself: the QoS front (:class:`nnrt.qos.ScheduledDevice`)
wraps it like any other driver and passes a checkpoint, which the executor
calls at every operation boundary (``Scheduling.boundaries`` is OPERATION).
"""
from __future__ import annotations

import time
from functools import partial

from .. import ops
from .._version import __version__
from ..errors import ErrorStatus, NnrtError
from ..handoff import run_in_worker
from ..hal import (NO_TIMING, AppKey, Boundaries, Capabilities, Checkpoint, Device, DeviceType,
                   Execution, ExecutionPreference, ExecutionResult, OutputShape,
                   PerformanceInfo, PreparedModel, Priority, Request, RequestExecution,
                   Scheduling, Timing)
from ..hal.buffers import BufferRegistry, uses_tokens
from ..hal.types import BufferDesc, BufferRole
from ..hal.cache import CacheFiles, check_counts
from ..hal.validate import validate_model
from ..model.graph import HalModel
from ..model.types import HalVersion, OperandType
from ..vlog import vlog
from . import cached
from .executor import Binding, ExecutionContext, Executor, RequestPlan
from .blas import limit_blas_threads
from ..memory.heap import keep_freed_memory

_PLAN = "reference-plan"   # the one model cache file: the model and its inferred dimensions


class ReferenceDevice(Device):
    type = DeviceType.CPU
    # HAL 1.3 and the operations NNAPI added after it (BATCH_MATMUL, PACK at
    # feature level 6; MIRROR_PAD, REVERSE at 7): nnrt/testing/vectors/FL*.
    feature_level = HalVersion.FL7.feature_level
    version_string = f"nnrt-reference-{__version__}"

    def __init__(self, name: str = "nnrt-reference"):
        keep_freed_memory()   # a fresh array per operation: see nnrt/memory/heap.py
        limit_blas_threads()  # the slots are its parallelism: see nnrt/drivers/blas.py
        self.name = name
        self.buffers = BufferRegistry()   # memory domains: buffers kept in this process

    def capabilities(self) -> Capabilities:
        one = PerformanceInfo(1.0, 1.0)
        return Capabilities(one, one, {t: one for t in OperandType}, one, one)

    def supported_extensions(self):
        # nnrt's own extensions whose operations the registry runs
        # (com.nnrt.tflite: TFLite builtins without an NNAPI twin).
        return ops.registered_extensions()

    def scheduling(self) -> Scheduling:
        # Stops between any two operations; one execution at a time (numpy
        # kernels mostly hold the GIL: a second slot would only interleave).
        return Scheduling(Boundaries.OPERATION, slots=1)

    async def supported_operations(self, model: HalModel) -> list[bool]:
        validate_model(model)  # an invalid model is INVALID_ARGUMENT, not "unsupported"
        supported = []
        for op in model.main.operations:
            try:
                opdef = ops.definition(op.type)
                opdef.validate(ops.OpView(model, None, op))
                supported.append(True)
            except NnrtError:
                supported.append(False)
        return supported

    async def prepare_model(self, model: HalModel,
                            preference: ExecutionPreference = ExecutionPreference.FAST_SINGLE_ANSWER,
                            priority: Priority = Priority.MEDIUM, deadline: float | None = None,
                            cache=None, *, app: AppKey = None) -> "ReferencePreparedModel":
        validated = validate_model(model)
        vlog("driver", "%s: prepared a HAL %s model with %d operations", self.name,
             validated.version.name, len(model.main.operations))
        prepared = ReferencePreparedModel(model, Executor(model, validated), self.buffers, app)
        if cache is not None:
            check_counts(cache, self.number_of_cache_files_needed())
            cached.save(self, cache, [(cache.model[0], _PLAN, cached.pack(
                cached.dims_meta(validated), [cached.model_blob(model)]))])
        return prepared

    def number_of_cache_files_needed(self) -> tuple[int, int]:
        # The plan is the model and what validation inferred (which is most
        # of the preparation's time); the executor is rebuilt from them.
        return (1, 0)

    async def prepare_model_from_cache(self, cache: CacheFiles,
                                       priority: Priority = Priority.MEDIUM,
                                       deadline: float | None = None, *,
                                       app: AppKey = None) -> "ReferencePreparedModel":
        check_counts(cache, self.number_of_cache_files_needed())
        # Reading and checking the file takes a while: not on a service's loop.
        return await run_in_worker(partial(self._prepare_from_cache, cache, app))

    def _prepare_from_cache(self, cache: CacheFiles, app: AppKey) -> "ReferencePreparedModel":
        meta, blobs = cached.unpack(cached.load(self, cache, cache.model[0], _PLAN))
        if len(blobs) != 1:
            raise cached.CacheRejected(cached.CacheReject.UNUSABLE, "the plan holds no model")
        model = cached.model_of(blobs[0])
        validated = cached.validated_of(meta)
        vlog("driver", "%s: prepared a HAL %s model with %d operations from its cache",
             self.name, validated.version.name, len(model.main.operations))
        return ReferencePreparedModel(model, Executor(model, validated), self.buffers, app)

    async def allocate(self, desc: BufferDesc, prepared_models, input_roles: list[BufferRole],
                       output_roles: list[BufferRole], *, app: AppKey = None):
        """A buffer kept in this driver (see nnrt/hal/buffers.py)."""
        return self.buffers.allocate_for(self.name, ReferencePreparedModel, app, desc,
                                         prepared_models, input_roles, output_roles)

    def __repr__(self) -> str:
        return f"<ReferenceDevice {self.name}>"


class ReferencePreparedModel(PreparedModel):
    def __init__(self, model: HalModel, executor: Executor, buffers: BufferRegistry | None = None,
                 app: AppKey = None):
        self.model = model
        self.executor = executor
        self.buffers = BufferRegistry() if buffers is None else buffers
        self.app = app    # who prepared it: the only app whose buffers it may use
        # The operand facts every binding uses, resolved once (see RequestPlan).
        self._plan = RequestPlan(executor)

    def create_execution(self, request: Request, measure: bool = False,
                         loop_timeout: float | None = None) -> Execution:
        """``request`` validated and bound once (:class:`Binding`: where each
        input is read and each output written). A request naming driver
        buffers by token runs through the buffer registry each time."""
        if uses_tokens(request):
            return RequestExecution(self, request, measure, loop_timeout)
        return ReferenceExecution(self, self._plan.bind(request), request, measure, loop_timeout)

    def execute_synchronously(self, request: Request, measure: bool = False,
                              deadline: float | None = None,
                              loop_timeout: float | None = None, *,
                              checkpoint: Checkpoint | None = None) -> ExecutionResult:
        """Validate ``request``, run every operation (``checkpoint`` between
        any two), write the outputs. A failure is a result. A request naming
        driver buffers by token runs through the buffer registry."""
        if uses_tokens(request):
            return self.buffers.execute(
                self, self.app, request,
                lambda plain: self.execute_synchronously(plain, measure, deadline, loop_timeout,
                                                         checkpoint=checkpoint))
        try:
            binding = self._plan.bind(request)
        except NnrtError as e:
            return ExecutionResult(e.status, tuple(e.output_shapes or ()), message=e.message)
        return ReferenceExecution(self, binding, request, measure, loop_timeout) \
            .execute_synchronously(deadline, checkpoint=checkpoint)


class ReferenceExecution(Execution):
    """A request of a :class:`ReferencePreparedModel`, bound (its
    :class:`Binding`), run by the executor at each computation."""

    def __init__(self, prepared: ReferencePreparedModel, binding: Binding, request: Request,
                 measure: bool, loop_timeout: float | None):
        self.prepared = prepared
        self.request = request
        self.measure = bool(measure)
        self.loop_timeout = loop_timeout
        self._binding = binding

    def execute_synchronously(self, deadline: float | None = None, *,
                              checkpoint: Checkpoint | None = None) -> ExecutionResult:
        bound = self._binding
        if bound is None:
            return ExecutionResult(ErrorStatus.INVALID_ARGUMENT,
                                   message="the execution was released")
        unusable = bound.usable()
        if unusable is not None:
            return ExecutionResult(ErrorStatus.INVALID_ARGUMENT, message=unusable)
        started = time.perf_counter_ns() if self.measure else 0
        shapes: tuple[OutputShape, ...] = ()
        try:
            stop = (lambda _context: checkpoint()) if checkpoint is not None else None
            context = ExecutionContext(self.prepared.executor, self.loop_timeout, deadline, stop)
            outputs = context.run_main(bound.read_inputs())
            shapes = bound.output_shapes(outputs)
            bound.write_outputs(outputs)
        except NnrtError as e:
            return ExecutionResult(e.status, tuple(e.output_shapes or ()) or shapes,
                                   message=e.message)
        except Exception as e:
            return ExecutionResult(ErrorStatus.GENERAL_FAILURE,
                                   message=f"the executor raised {e!r}")
        timing = NO_TIMING
        if self.measure:
            elapsed = (time.perf_counter_ns() - started) // 1000
            timing = Timing(elapsed, elapsed)
        return bound.succeeded(shapes, timing)

    def release(self) -> None:
        self.request = self._binding = None

    def __repr__(self) -> str:
        return f"<ReferenceExecution of {len(self.prepared.model.main.operations)} operations>"
