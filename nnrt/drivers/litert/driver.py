"""The litert device and its prepared models (the only module of this
package that sees the HAL classes).

Preparation validates the model, lowers every operation through the table
(:mod:`.table`), converts the partition to TFLite (:mod:`.flatbuffer`),
times it, cuts it into segments (:mod:`.segments`) and creates their
interpreters. An execution (:class:`LiteRTExecution`, bound once) copies
each input once from the request's pool (``hal.read_inputs`` views it) into
an interpreter tensor, invokes the segments in order with the checkpoint
between two, and copies each output once from the interpreter into its
view of the request's pool (``hal.request.output_views``).
"""
from __future__ import annotations

import time
from functools import partial

import numpy as np

from ..._version import __version__
from ...errors import ErrorStatus, NnrtError, invalid
from ...handoff import run_in_worker
from ...hal import (NO_TIMING, AppKey, Boundaries, Capabilities, Checkpoint, Device,
                    DeviceType, Execution, ExecutionPreference, ExecutionResult, OutputShape,
                    PerformanceInfo, PreparedModel, Priority, Request, RequestExecution,
                    Scheduling, Timing, check_deadline, check_priority, read_inputs)
from ...hal.request import output_views
from ...hal.buffers import BufferRegistry, uses_tokens
from ...hal.types import BufferDesc
from ...hal.cache import CacheFiles, CacheReject, CacheRejected, check_counts
from ...hal.validate import validate_model, validate_request
from ...model.graph import HalModel, Subgraph
from ...model.types import HalVersion, OperandType
from ...vlog import vlog
from .. import cached
from . import segments as seg
from .table import EXTENSIONS, OpInfo, Unsupported, lower

DEFAULT_SEGMENT_TIME = 0.002   # seconds: a HIGH job waits at most about this long behind
                               # a run that began with jobs waiting (segmented)

# Relative to the reference driver (1.0): LiteRT is 5-30x faster on the
# shared models on a quiet host (docs/performance.md); 0.1 stays on the safe side.
_FAST = PerformanceInfo(exec_time=0.1, power_usage=0.1)
_NOT_RUN = PerformanceInfo(float("inf"), float("inf"))
_TYPES_RUN = (OperandType.TENSOR_FLOAT32, OperandType.TENSOR_FLOAT16, OperandType.FLOAT16,
              OperandType.TENSOR_INT32,
              OperandType.TENSOR_QUANT8_ASYMM, OperandType.TENSOR_QUANT8_ASYMM_SIGNED,
              OperandType.TENSOR_QUANT8_SYMM, OperandType.TENSOR_QUANT8_SYMM_PER_CHANNEL,
              OperandType.TENSOR_BOOL8, OperandType.FLOAT32, OperandType.INT32,
              OperandType.BOOL)


def litert_version() -> str:
    from importlib.metadata import version
    return version("ai-edge-litert")


class LiteRTDevice(Device):
    type = DeviceType.CPU
    feature_level = HalVersion.FL7.feature_level   # it lowers operations up to level 7

    def __init__(self, name: str = "litert", *, num_threads: int = 1,
                 segment_time: float | None = DEFAULT_SEGMENT_TIME,
                 segments: int | None = None, slots: int = 1):
        """``num_threads`` per interpreter (1: the scheduler, not the driver,
        decides concurrency); ``segment_time`` (seconds) bounds a segment's
        estimated run time, None for one segment; ``segments`` instead cuts
        every partition into that many segments (for measurements);
        ``slots``: how many executions the scheduler runs at once (one core
        each: a pipeline's stages on two cores take 2)."""
        if num_threads < 1:
            raise invalid(f"num_threads must be at least 1, got {num_threads}")
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise invalid(f"slots must be an int of at least 1, got {slots!r}")
        self.slots = slots
        if segment_time is not None and segment_time <= 0:
            raise invalid(f"segment_time must be positive, got {segment_time}")
        if segments is not None and segments < 1:
            raise invalid(f"segments must be at least 1, got {segments}")
        self.name = name
        self.version_string = f"nnrt-litert-{__version__} (ai-edge-litert {litert_version()})"
        self.num_threads = num_threads
        self.segment_time = segment_time
        self.segments = segments
        self.buffers = BufferRegistry()   # memory domains: buffers kept in this process

    def capabilities(self) -> Capabilities:
        return Capabilities(_FAST, _FAST, {t: (_FAST if t in _TYPES_RUN else _NOT_RUN)
                                           for t in OperandType}, _NOT_RUN, _NOT_RUN)

    def supported_extensions(self):
        # nnrt's com.nnrt.tflite: its operations are TFLite builtins (table.py).
        return list(EXTENSIONS)

    def scheduling(self) -> Scheduling:
        # Stops between segments; one execution at a time by default (the
        # scheduler, not the driver, decides how many run at once, and with
        # one thread per interpreter one slot keeps a core for everyone else).
        return Scheduling(Boundaries.SEGMENT, slots=self.slots)

    async def supported_operations(self, model) -> list[bool]:
        dims = validate_model(model).dims[None]
        return [self._why_not(model, k, dims) is None for k in range(len(model.main.operations))]

    def unsupported_reasons(self, model) -> dict[int, str]:
        """Why each operation the driver does not run is refused (for reports)."""
        dims = validate_model(model).dims[None]
        reasons = {k: self._why_not(model, k, dims) for k in range(len(model.main.operations))}
        return {k: r for k, r in reasons.items() if r is not None}

    @staticmethod
    def _why_not(model, k: int, dims) -> str | None:
        # IF and WHILE have no rule: they, and the subgraphs they run, stay
        # with the reference driver; the rest of the main graph can run here.
        try:
            lower(OpInfo(model, k, dims))
        except Unsupported as e:
            return str(e)
        return None

    async def prepare_model(self, model, preference: ExecutionPreference =
                            ExecutionPreference.FAST_SINGLE_ANSWER,
                            priority: Priority = Priority.MEDIUM, deadline: float | None = None,
                            cache=None, *, app: AppKey = None) -> "LiteRTPreparedModel":
        if cache is not None:
            check_counts(cache, self.number_of_cache_files_needed())
        return await run_in_worker(
            partial(self.prepare_model_synchronously, model, preference, priority, deadline,
                    app=app, cache=cache))

    def number_of_cache_files_needed(self) -> tuple[int, int]:
        # The model file: the HAL model, its dimensions and the segment
        # table with each flatbuffer's size; the data file: the flatbuffers,
        # as parts (read in one pass, see hal.cache.read_parts). XNNPACK's
        # packed weights are not kept: the Interpreter API has no weight
        # cache, and CompiledModel's (which has one) is slower to create
        # than our interpreters with packing (docs/vendors/adding-a-driver.md).
        return (1, 1)

    def _cache_kinds(self) -> tuple[str, str]:
        # The segment table depends on how this device cuts: another
        # setting reads as a foreign file, not as a plan to trust.
        how = f"threads={self.num_threads} segment_time={self.segment_time} " \
              f"segments={self.segments}"
        return f"litert-plan-2 {how}", f"litert-segments-2 {how}"

    async def prepare_model_from_cache(self, cache: CacheFiles,
                                       priority: Priority = Priority.MEDIUM,
                                       deadline: float | None = None, *,
                                       app: AppKey = None) -> "LiteRTPreparedModel":
        check_counts(cache, self.number_of_cache_files_needed())
        priority = check_priority(priority)
        deadline = check_deadline(deadline)
        return await run_in_worker(partial(self._prepare_from_cache, cache, priority, deadline,
                                           app))

    def _prepare_from_cache(self, cache: CacheFiles, priority, deadline,
                            app) -> "LiteRTPreparedModel":
        start = time.perf_counter()
        plan_kind, data_kind = self._cache_kinds()
        meta, blobs = cached.unpack(cached.load(self, cache, cache.model[0], plan_kind))
        try:
            table, sizes = meta["segments"], meta["sizes"]
            if len(blobs) != 1 or len(table) != len(sizes) or not table:
                raise ValueError("the segment table and the flatbuffers disagree")
        except (KeyError, TypeError, ValueError) as e:
            raise CacheRejected(CacheReject.UNUSABLE, f"the segment table: {e!r}") from None
        # Each flatbuffer is read straight into the bytes LiteRT keeps.
        flatbuffers = cached.load_parts(self, cache, cache.data[0], data_kind, sizes)
        try:
            parts = [seg.Segment(tuple(ops), tuple(inputs), tuple(outputs), fb)
                     for (ops, inputs, outputs), fb in zip(table, flatbuffers)]
            seconds = float(meta["seconds"])
            dims = {int(i): tuple(int(x) for x in d) for i, d in meta["dims"]}
            whole = parts.pop() if meta["uncut"] is True else None
            if not parts:
                raise ValueError("no segment")
        except (KeyError, TypeError, ValueError) as e:
            raise CacheRejected(CacheReject.UNUSABLE, f"the segment table: {e!r}") from None
        model = cached.model_of(blobs[0])
        main = model.main
        if any(i not in dims for i in (*main.input_indexes, *main.output_indexes)):
            raise CacheRejected(CacheReject.UNUSABLE, "the model's inputs and outputs lack "
                                                      "dimensions")
        io = (model.main.input_indexes, model.main.output_indexes)
        try:
            runner = seg.Runner(parts, *io, self.num_threads)
            uncut = seg.Runner([whole], *io, self.num_threads) if whole is not None else None
        except (ValueError, RuntimeError) as e:
            raise CacheRejected(CacheReject.UNUSABLE, f"LiteRT refused a cached segment: {e}") \
                from None
        vlog("driver", "%s: prepared %d segment(s) from the cache in %.0f ms", self.name,
             len(parts), (time.perf_counter() - start) * 1e3)
        if deadline is not None and time.monotonic() > deadline:
            raise NnrtError(ErrorStatus.MISSED_DEADLINE_TRANSIENT,
                            "the model was prepared after its preparation deadline")
        return LiteRTPreparedModel(model, dims, runner, priority, app, seconds, self.buffers,
                                   uncut)

    def _save(self, cache: CacheFiles, model, dims, parts, seconds, uncut) -> None:
        """The plan (segment table, dimensions, timing) and the flatbuffers:
        each segment's, then the uncut model's when the model is cut."""
        plan_kind, data_kind = self._cache_kinds()
        kept_parts = parts + ([uncut] if uncut is not None else [])
        reduced, kept_parts = _io_only(model, kept_parts)
        main = model.main
        kept = (*main.input_indexes, *main.output_indexes)
        meta = {"dims": [[i, list(dims[old])] for i, old in
                         zip(reduced.main.input_indexes + reduced.main.output_indexes, kept)],
                "segments": [[list(p.ops), list(p.inputs), list(p.outputs)] for p in kept_parts],
                "sizes": [len(p.model) for p in kept_parts],
                "uncut": uncut is not None,
                "seconds": seconds}
        cached.save(self, cache, [
            (cache.model[0], plan_kind, cached.pack(meta, [cached.model_blob(reduced)])),
            (cache.data[0], data_kind, [p.model for p in kept_parts])])

    def prepare_model_synchronously(self, model, preference: ExecutionPreference =
                                    ExecutionPreference.FAST_SINGLE_ANSWER,
                                    priority: Priority = Priority.MEDIUM,
                                    deadline: float | None = None, *,
                                    app: AppKey = None,
                                    cache: CacheFiles | None = None) -> "LiteRTPreparedModel":
        try:
            ExecutionPreference(preference)
        except ValueError:
            raise invalid(f"execution preference {preference!r} is not valid") from None
        priority = check_priority(priority)
        deadline = check_deadline(deadline)
        if deadline is not None and time.monotonic() > deadline:
            raise NnrtError(ErrorStatus.MISSED_DEADLINE_PERSISTENT,
                            "the preparation deadline had passed before preparation began")
        dims = validate_model(model).dims[None]
        lowered = []
        for k in range(len(model.main.operations)):
            reason = self._why_not(model, k, dims)
            if reason is not None:
                raise invalid(f"{self.name} does not support operation {k} "
                              f"({model.main.operations[k].type.name}): {reason}")
            lowered.append(lower(OpInfo(model, k, dims)))
        start = time.perf_counter()
        whole = seg.whole(model, lowered, dims)
        try:
            first = seg.new_interpreter(whole.model, self.num_threads)
            seconds = seg.time_invoke(first, self.num_threads)
            groups = seg.cut([seg.cost(model, op, dims) for op in lowered], seconds,
                             self.segment_time, self.segments)
            io = (model.main.input_indexes, model.main.output_indexes)
            uncut = None
            if len(groups) == 1:
                parts = [whole]
                runner = seg.Runner(parts, *io, self.num_threads, first)
            else:
                # The uncut interpreter (the one timed) is kept too: it runs
                # when nobody waits for the device (see LiteRTExecution).
                parts = seg.plan(model, lowered, dims, groups)
                runner = seg.Runner(parts, *io, self.num_threads)
                uncut = seg.Runner([whole], *io, self.num_threads, first)
        except (ValueError, RuntimeError) as e:   # LiteRT refused the converted model
            raise NnrtError(ErrorStatus.GENERAL_FAILURE,
                            f"{self.name}: LiteRT could not prepare the converted model: {e}") \
                from None
        vlog("driver", "%s: prepared %d operations in %d segment(s), %.2f ms per run, "
             "in %.0f ms", self.name, len(lowered), len(parts), seconds * 1e3,
             (time.perf_counter() - start) * 1e3)
        if deadline is not None and time.monotonic() > deadline:
            raise NnrtError(ErrorStatus.MISSED_DEADLINE_TRANSIENT,
                            "the model was prepared after its preparation deadline")
        if cache is not None:
            self._save(cache, model, dims, parts, seconds, whole if uncut is not None else None)
        return LiteRTPreparedModel(model, dims, runner, priority, app, seconds, self.buffers,
                                   uncut)

    async def allocate(self, desc: BufferDesc, prepared_models, input_roles, output_roles, *,
                       app: AppKey = None):
        """A buffer kept in this driver (see nnrt/hal/buffers.py)."""
        return self.buffers.allocate_for(self.name, LiteRTPreparedModel, app, desc,
                                         prepared_models, input_roles, output_roles)


def _io_only(model, parts: list[seg.Segment]) -> tuple[HalModel, list[seg.Segment]]:
    """``model`` reduced to its input and output operands (renumbered from
    0), and ``parts`` with operand numbers to match: what a prepared model
    needs once the interpreters hold the rest (validating requests, mapping
    their inputs and outputs). Decoding 400 operands would cost a warm
    compilation 10 ms of MobileNet's 50. Operands that only cross between
    segments are mere keys; they are numbered after the kept ones."""
    main = model.main
    kept = list(dict.fromkeys((*main.input_indexes, *main.output_indexes)))
    number = {i: k for k, i in enumerate(kept)}

    def renumber(i: int) -> int:
        return number[i] if i in number else len(kept) + i
    reduced = HalModel(Subgraph(tuple(main.operands[i] for i in kept), (),
                                tuple(number[i] for i in main.input_indexes),
                                tuple(number[i] for i in main.output_indexes)),
                       relax_computation_float32_to_float16=model.relax_computation_float32_to_float16,
                       extension_prefixes=model.extension_prefixes)
    return reduced, [seg.Segment(p.ops, tuple(map(renumber, p.inputs)),
                                 tuple(map(renumber, p.outputs)), p.model) for p in parts]


class LiteRTPreparedModel(PreparedModel):
    def __init__(self, model, dims, runner: seg.Runner, priority: Priority, app: AppKey,
                 estimated_seconds: float, buffers: BufferRegistry | None = None,
                 uncut: seg.Runner | None = None):
        self.model = model
        # A model cut into segments keeps its uncut interpreter too, for the
        # executions that start while nobody waits for the device: cutting
        # costs copies across the cuts and fusion lost (5-17 % on the shared
        # models, docs/performance.md), which only buys preemption.
        self.uncut = uncut
        self.buffers = BufferRegistry() if buffers is None else buffers
        self.priority = priority
        self.app = app
        self.runner = runner
        self.estimated_seconds = estimated_seconds
        main = model.main
        # Per input/output operand: (position in the request, dtype, dims,
        # bytes); and the output shapes of a run whose buffers are all big
        # enough, made once (an execution is a few microseconds of Python
        # around invoke: keep it so).
        self._inputs = {i: (k, main.operands[i].type.dtype, tuple(dims[i]),
                            int(np.prod(dims[i])) * main.operands[i].type.element_size)
                        for k, i in enumerate(main.input_indexes)}
        self._outputs = {i: (k, main.operands[i].type.dtype, tuple(dims[i]),
                             int(np.prod(dims[i])) * main.operands[i].type.element_size)
                         for k, i in enumerate(main.output_indexes)}
        self._sufficient = tuple(OutputShape(dims_) for _, _, dims_, _ in self._outputs.values())

    @property
    def segment_count(self) -> int:
        return len(self.runner.segments)

    def output_shapes_of(self, request: Request) -> tuple[OutputShape, ...]:
        if all(arg.location.length >= need
               for arg, (_, _, _, need) in zip(request.outputs, self._outputs.values())):
            return self._sufficient
        return tuple(OutputShape(dims, arg.location.length >= need)
                     for arg, (_, _, dims, need) in zip(request.outputs, self._outputs.values()))

    def inputs_of(self, request: Request) -> dict[int, np.ndarray]:
        """The request's inputs (views of its pools) by operand, as prepared."""
        values = read_inputs(self.model, request)
        inputs = {}
        for value, (i, (_, _, dims, _)) in zip(values, self._inputs.items()):
            if value is None:
                raise invalid(f"input operand {i} has no value")
            if value.shape != dims:
                raise invalid(f"input operand {i}: dimensions {list(value.shape)}, "
                              f"the prepared model takes {list(dims)}")
            inputs[i] = value
        return inputs

    def create_execution(self, request: Request, measure: bool = False,
                         loop_timeout: float | None = None) -> Execution:
        """The request validated, and its inputs and outputs bound to its
        regions, once: each computation is set_tensor, invoke and a copy of
        each output into place. A request naming driver buffers by token
        runs through the buffer registry each time."""
        if uses_tokens(request):
            return RequestExecution(self, request, measure, loop_timeout)
        return LiteRTExecution(self, request, measure)

    def execute_synchronously(self, request: Request, measure: bool = False,
                              deadline: float | None = None, loop_timeout: float | None = None,
                              *, checkpoint: Checkpoint | None = None) -> ExecutionResult:
        if uses_tokens(request):   # driver buffers named by token: bound, then run
            return self.buffers.execute(
                self, self.app, request,
                lambda bound: self.execute_synchronously(bound, measure, deadline,
                                                         checkpoint=checkpoint))
        try:
            execution = LiteRTExecution(self, request, measure)
        except NnrtError as e:
            return ExecutionResult(e.status, message=e.message)
        return execution.execute_synchronously(deadline, checkpoint=checkpoint)


class LiteRTExecution(Execution):
    """A request of a :class:`LiteRTPreparedModel`, bound: its input views
    and its outputs' views (in place in the request's regions) by operand,
    and the result of a computation, made once."""

    def __init__(self, prepared: LiteRTPreparedModel, request: Request, measure: bool = False):
        validate_request(prepared.model, request)
        self.prepared = prepared
        self.request = request
        self.measure = bool(measure)
        self._runner = prepared.runner
        self._uncut = prepared.uncut
        shapes = prepared.output_shapes_of(request)
        self._inputs = prepared.inputs_of(request)
        if all(s.is_sufficient for s in shapes):
            views = output_views(prepared.model, request, [s.dimensions for s in shapes])
            self._outputs = dict(zip(prepared.model.main.output_indexes, views))
            self._done = ExecutionResult(ErrorStatus.NONE, shapes, NO_TIMING)
            self._short = None
        else:
            self._outputs = None
            self._short = ExecutionResult(ErrorStatus.OUTPUT_INSUFFICIENT_SIZE, shapes,
                                          message="an output buffer is too small")

    def execute_synchronously(self, deadline: float | None = None, *,
                              checkpoint: Checkpoint | None = None) -> ExecutionResult:
        if self._short is not None:
            return self._short
        started = time.perf_counter()
        try:
            if deadline is not None and time.monotonic() > check_deadline(deadline):
                raise NnrtError(ErrorStatus.MISSED_DEADLINE_TRANSIENT,
                                "the deadline passed before the execution began")
            # Segments only when they buy something: a job waits that could
            # take the device at a boundary.
            runner = self._runner if self._uncut is None or (
                checkpoint is not None and checkpoint.contended()) else self._uncut
            busy = runner.run(self._inputs, self._outputs, checkpoint)
        except NnrtError as e:
            return ExecutionResult(e.status, message=e.message)
        except (ValueError, RuntimeError) as e:
            return ExecutionResult(ErrorStatus.GENERAL_FAILURE, message=f"LiteRT failed: {e}")
        if not self.measure:
            return self._done
        on_device = int(busy * 1e6)
        return ExecutionResult(ErrorStatus.NONE, self._done.output_shapes,
                               Timing(on_device,
                                      max(int((time.perf_counter() - started) * 1e6), on_device)))

    def release(self) -> None:
        self.request = self._inputs = self._outputs = None
        self._short = ExecutionResult(ErrorStatus.INVALID_ARGUMENT,
                                      message="the execution was released")

    def __repr__(self) -> str:
        return f"<LiteRTExecution of {len(self._runner.segments)} segment(s)>"
