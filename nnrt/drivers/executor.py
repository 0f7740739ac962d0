"""The reference executor (AOSP's CpuExecutor): runs a validated model one
operation at a time with the registry's numpy kernels.

An :class:`Executor` is built once per prepared model (constants decoded,
kernels looked up, per-operation argument templates made) and is shared by
every execution of that model; per-execution state lives in
:class:`ExecutionContext`, which kernels see as ``call.executor`` (control-flow
kernels run referenced subgraphs through it).

Operation boundaries. Before each operation, and on entering every
subgraph (so once per WHILE iteration, whatever the loop's subgraphs hold),
the context calls the ``checkpoint`` it was given. That is where the QoS
scheduler acts (``nnrt.qos.gate.ExecutionGate.checkpoint``): it returns to
go on, blocks while the execution is preempted and returns when it is
resumed, or raises NnrtError (deadline abort, cancellation) to unwind. The
execution's state between operations (``position``: the next operation of
each active subgraph, and the live operand values) belongs to the context
and the calling thread's frames, so a parked execution resumes exactly where
it stopped and computes what an uninterrupted run computes.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .. import ops
from ..ops import Arg, Call
from ..errors import ErrorStatus, NnrtError
from ..hal.types import NO_TIMING, ExecutionResult, OutputShape, Timing
from ..model.graph import HalModel, Operand, decode_value
from ..model.types import OperandLifeTime as L, OperationType
from ..hal.validate import ValidatedModel, validate_request
from ..memory import Memory, as_buffer
from ..vlog import on as vlog_on, vlog
from .. import trace as tracing

# The cpuexe log's switch, read once: NNRT_VLOG is read when nnrt.vlog is
# imported and never again.
_CPUEXE = vlog_on("cpuexe")
# An Arg made as NamedTuple's own ``__new__`` makes it, without that Python
# call per input of every operation (issue 16).
_new_arg = tuple.__new__

_CONSTANT = (L.CONSTANT_COPY, L.CONSTANT_REFERENCE)
# Operands whose value is the same in every execution: a constant, a
# subgraph reference, an omitted optional input.
_FIXED = (*_CONSTANT, L.SUBGRAPH, L.NO_VALUE)

# Every execution runs with numpy's floating-point errors ignored: kernels
# compute IEEE results (inf, NaN) as a device does, never a RuntimeWarning,
# and never a FloatingPointError because the calling thread set
# np.seterr(all="raise") (an inline run executes on the app's own thread).
# numpy >= 2 keeps that state in a context variable holding an "extobj":
# the one made here is set around each execution for the cost of a
# ContextVar.set, where ``np.errstate`` builds it anew at every entry
# (~1.5 us, a tenth of a small model's run, once in each of 11 kernels
# before: issue 16). numpy 1.x: ``np.errstate`` once per execution.
try:
    from numpy._core.umath import _extobj_contextvar as _FP_STATE, _make_extobj
    _FP_IGNORED = _make_extobj(all="ignore")
except (ImportError, AttributeError, TypeError):
    _FP_STATE = _FP_IGNORED = None
DEFAULT_LOOP_TIMEOUT = 2.0   # seconds, NNAPI's default WHILE loop timeout
MAX_LOOP_TIMEOUT = 15.0


@dataclass(frozen=True, slots=True)
class _Step:
    type: OperationType
    name: str                            # type.name, read once (an enum's name is a property)
    kernel: ops.registry.Kernel
    # The kernel's Args, with None where the value is read at run time: an
    # input whose value is fixed has its Arg made once, shared by every
    # execution (an Arg is immutable).
    args: tuple[Arg | None, ...]
    reads: tuple[tuple, ...]    # (position, operand index, type, scale, zero_point, channel_quant)
    outputs: tuple[int, ...]
    out_operands: tuple[Operand, ...]
    out_dims: tuple[tuple[int, ...], ...]  # declared/inferred, 0 = unknown, () = unknown rank
    results: tuple[tuple, ...]  # (position, operand index, dtype (None: a scalar), dims) per output


class _SubgraphPlan:
    def __init__(self, model: HalModel, index: int | None, dims: dict[int, tuple[int, ...]]):
        sub = model.subgraph(index)
        self.index = index
        self.operands = sub.operands
        self.input_indexes = sub.input_indexes
        self.output_indexes = sub.output_indexes
        self.initial: list = [None] * len(sub.operands)
        for i, operand in enumerate(sub.operands):
            if operand.lifetime in _CONSTANT:
                self.initial[i] = model.constant_value(operand)
            elif operand.lifetime == L.SUBGRAPH:
                self.initial[i] = operand.location.offset
        steps = []
        for op in sub.operations:
            opdef = ops.definition(op.type)
            args, reads = [], []
            for position, i in enumerate(op.inputs):
                o = sub.operands[i]
                if o.lifetime in _FIXED:
                    args.append(Arg(o.type, self.initial[i], o.scale, o.zero_point,
                                    o.channel_quant))
                else:
                    args.append(None)
                    reads.append((position, i, o.type, o.scale, o.zero_point, o.channel_quant))
            out_operands = tuple(sub.operands[i] for i in op.outputs)
            out_dtypes = tuple(None if o.type.is_scalar else o.type.dtype for o in out_operands)
            out_dims = tuple(dims.get(i, ()) for i in op.outputs)
            steps.append(_Step(op.type, op.type.name, opdef.kernel, tuple(args), tuple(reads),
                               op.outputs, out_operands, out_dims,
                               tuple(zip(range(len(op.outputs)), op.outputs, out_dtypes,
                                         out_dims))))
        self.steps = tuple(steps)

    def values(self, inputs: list) -> list:
        """Every operand's value as a run on ``inputs`` starts."""
        if len(inputs) != len(self.input_indexes):
            raise NnrtError(ErrorStatus.GENERAL_FAILURE,
                            f"subgraph {self.index} takes {len(self.input_indexes)} inputs, "
                            f"got {len(inputs)}")
        values = list(self.initial)
        for i, v in zip(self.input_indexes, inputs):
            values[i] = v
        return values


class Executor:
    def __init__(self, model: HalModel, validated: ValidatedModel):
        self.model = model
        self.relaxed = model.relax_computation_float32_to_float16
        self.plans = {index: _SubgraphPlan(model, index, validated.dims[index])
                      for index in validated.dims}
        self.main = self.plans[None]

    def run(self, inputs: list, *, loop_timeout: float | None = None,
            deadline: float | None = None,
            checkpoint: Callable[["ExecutionContext"], None] | None = None) -> list[np.ndarray]:
        """Run the main subgraph on ``inputs`` (arrays/scalars, None = omitted).
        ``checkpoint(context)`` is called at every operation boundary."""
        context = ExecutionContext(self, loop_timeout, deadline, checkpoint)
        return context.run_main(self.main.values(inputs))


class RequestPlan:
    """How a request's arguments become the main subgraph's inputs and how
    its outputs reach the request's regions, resolved once per prepared model
    (operand types, element types, declared shapes): what
    ``nnrt.hal.request`` does per execution, without looking anything up.

    :meth:`bind` validates a request and resolves it into a
    :class:`Binding`: where each input is read and each output written. A
    reusable execution (``ReferencePreparedModel.create_execution``) binds
    once and runs its binding again and again; a one-shot execution binds
    for its one run. Tested by tests/unit/test_executor_plan.py."""

    __slots__ = ("model", "_initial", "_inputs", "_outputs")

    def __init__(self, executor: Executor):
        model = self.model = executor.model
        sub = model.main
        self._initial = executor.main.initial
        self._inputs = tuple((i, sub.operands[i], sub.operands[i].type.is_tensor,
                              sub.operands[i].type.dtype, sub.operands[i].dimensions)
                             for i in sub.input_indexes)
        self._outputs = tuple((i, sub.operands[i].type.dtype, sub.operands[i].dimensions)
                              for i in sub.output_indexes)

    def bind(self, request) -> "Binding":
        """``request`` validated and resolved; INVALID_ARGUMENT as
        :func:`nnrt.hal.validate.validate_request` gives it."""
        sizes = validate_request(self.model, request)   # first: a layout needs a valid request
        return Binding(_Layout(self, request), request, sizes)


_FIXED_SIZE = (np.ndarray, memoryview, bytes, Memory)   # pools that cannot be resized


class _Output:
    """Where one output of a request's layout goes."""

    __slots__ = ("index", "dtype", "pool_index", "offset", "length", "declared", "as_declared")

    def __init__(self, index: int, dtype: np.dtype, dims: tuple[int, ...], pool_index: int,
                 offset: int, length: int):
        self.index = index             # the operand
        self.dtype = dtype
        self.pool_index = pool_index
        self.offset = offset
        self.length = length           # bytes of the region
        # The shape the output has when it comes out as declared (the usual
        # case), and whether it is then written as it is, without a check:
        # a tensor that fits (into a pool that is not read-only: a read-only
        # pool is refused when an output is written to it, after the size
        # check, as nnrt.hal.request.write_outputs does).
        self.declared = OutputShape(dims, dtype.itemsize * math.prod(dims) <= length)
        self.as_declared = bool(dims) and self.declared.is_sufficient


class _Layout:
    """A request's arguments resolved against a :class:`RequestPlan`,
    whatever pools they point into: per tensor input its operand, shape,
    element type, pool index and offset; per scalar input its operand and
    region; per output an :class:`_Output`; and the output shapes and result
    of an execution whose outputs come out as declared. Immutable once made;
    shared by every :class:`Binding` of these arguments."""

    __slots__ = ("inputs", "outputs", "initial", "tensors", "scalars", "reads", "outs",
                 "declared", "fits", "done")

    def __init__(self, plan: RequestPlan, request):
        self.inputs = tuple(request.inputs)
        self.outputs = tuple(request.outputs)
        # The main subgraph's values as an execution starts, an omitted
        # input's (None) included: the inputs read are put in a copy.
        self.initial = plan._initial
        tensors, scalars = [], []
        for arg, (i, operand, is_tensor, dtype, declared) in zip(self.inputs, plan._inputs):
            if arg.has_no_value:
                continue
            loc = arg.location
            if is_tensor:
                tensors.append((i, tuple(arg.dimensions) or declared, dtype, loc.pool_index,
                                loc.offset))
            else:
                scalars.append((i, operand, loc.pool_index, loc.offset, loc.length))
        self.tensors = tuple(tensors)
        self.scalars = tuple(scalars)
        # The pools the inputs are read from.
        self.reads = tuple({t[3] for t in tensors} | {t[2] for t in scalars})
        self.outs = tuple(
            _Output(index, dtype, tuple(arg.dimensions) or declared, arg.location.pool_index,
                    arg.location.offset, arg.location.length)
            for arg, (index, dtype, declared) in zip(self.outputs, plan._outputs))
        # The output shapes, and the result, of an execution whose outputs
        # all came out as declared: made once, not per execution.
        self.declared = tuple(out.declared for out in self.outs)
        self.fits = all(s.is_sufficient for s in self.declared)
        self.done = ExecutionResult(ErrorStatus.NONE, self.declared)


def _kinds(pools, sizes) -> tuple[tuple, tuple]:
    """The Memories among ``pools``, and the pools that can be resized, with
    their sizes now."""
    memories = resizable = ()
    for p, size in zip(pools, sizes):
        if isinstance(p, Memory):
            memories += (p,)
        elif not isinstance(p, _FIXED_SIZE):
            resizable += ((p, size),)
    return memories, resizable


class Binding:
    """A :class:`_Layout` over one request's pools: where each input is read
    and each output written, and the result of an execution whose outputs
    come out as declared.

    It keeps the request's pool objects (a Memory as its own byte view),
    and no view of its own into them unless they are all numpy arrays (then
    a view per tensor input and per output of declared shape, made once):
    arrays over other pools are made per execution (one call each) and die
    with it, because a view kept here would keep a closed Memory mapped (a
    burst's slots are unmapped when it ends, tests/integration/test_burst.py)
    or a bytearray from being resized. The binding stays valid as long as no
    pool changed size and no :class:`nnrt.memory.Memory` was closed, which
    :meth:`usable` checks: numpy arrays, memoryviews, bytes and Memories
    have a fixed size; any other buffer (a bytearray, an mmap) can be
    resized between two executions, so its size is compared at each."""

    __slots__ = ("layout", "_pools", "_sources", "_memories", "_resizable", "_start",
                 "_targets")

    def __init__(self, layout: _Layout, request, sizes: tuple[int, ...]):
        self.layout = layout
        self._pools = pools = tuple(request.pools)
        memories = resizable = ()
        self._start = self._targets = None
        for p in pools:
            if p.__class__ is not np.ndarray:
                memories, resizable = _kinds(pools, sizes)
                break
        else:
            # Numpy arrays only (the runtime's pools): the tensor inputs'
            # views, and the outputs' targets, are made here, once. A view
            # of an array keeps alive just that array, which this binding
            # holds anyway, and sees its bytes as they are at each execution.
            self._start = self._values(pools)
            self._targets = self._targets_in(pools)
        self._memories = memories
        self._resizable = resizable
        # What arrays are made over: the pool itself, a Memory's own view
        # (no new view: holding it does not keep the Memory mapped).
        self._sources = tuple(p.view() if isinstance(p, Memory) else p
                              for p in pools) if memories else pools

    def usable(self) -> str | None:
        """None while the binding is valid; else why not (a closed Memory,
        a pool resized since)."""
        if self._memories and any(m.closed for m in self._memories):
            return "a memory of the bound request was closed"
        if self._resizable and any(as_buffer(p).nbytes != n for p, n in self._resizable):
            return "a pool of the bound request changed size"
        return None

    def read_inputs(self) -> list:
        """Every operand's value as the main subgraph starts (what
        :meth:`ExecutionContext.run_main` takes), the inputs read from the
        pools: an array view per tensor input (no copy: the pool as it is
        now), a Python value per scalar, None for an omitted input."""
        start = self._start
        values = list(start) if start is not None else self._values(self._sources)
        sources = self._sources
        for i, operand, pool, offset, length in self.layout.scalars:
            values[i] = decode_value(operand, np.frombuffer(sources[pool], np.uint8, length,
                                                            offset))
        return values

    def _targets_in(self, pools) -> tuple:
        """Per output, a view of its region as declared (None for an output
        of open shape), what its value is written into when it comes out as
        declared. Numpy pools only."""
        return tuple(np.ndarray(out.declared.dimensions, out.dtype, pools[out.pool_index],
                                out.offset) if out.as_declared else None
                     for out in self.layout.outs)

    def _values(self, sources) -> list:
        """The main subgraph's starting values with a view per tensor input."""
        layout = self.layout
        values = list(layout.initial)
        for i, shape, dtype, pool, offset in layout.tensors:
            values[i] = np.ndarray(shape, dtype, sources[pool], offset)
        return values

    def output_shapes(self, outputs: list) -> tuple[OutputShape, ...]:
        """Each output's shape and whether its region holds it;
        OUTPUT_INSUFFICIENT_SIZE, with these shapes, when one does not."""
        layout = self.layout
        declared = shapes = layout.declared
        for k, (value, out) in enumerate(zip(outputs, layout.outs)):
            if value.__class__ is not np.ndarray:
                value = np.asarray(value)
            if value.shape != out.declared.dimensions:
                if shapes is declared:
                    shapes = list(shapes)
                shapes[k] = OutputShape(value.shape, value.nbytes <= out.length)
        if shapes is declared:
            if layout.fits:
                return shapes
        else:
            shapes = tuple(shapes)
        if not all(s.is_sufficient for s in shapes):
            raise NnrtError(ErrorStatus.OUTPUT_INSUFFICIENT_SIZE, "an output buffer is too small",
                            output_shapes=shapes)
        return shapes

    def write_outputs(self, outputs: list) -> None:
        """Copy ``outputs`` (arrays of their operands' element types, as the
        executor checks them) into their regions, which ``output_shapes``
        said are big enough; INVALID_ARGUMENT for a read-only pool."""
        sources = self._sources
        targets = self._targets
        if targets is not None:
            # Views made with the binding; a pool is asked whether it is
            # writable now: a view made before keeps the flag it had then.
            for value, out, target in zip(outputs, self.layout.outs, targets):
                if target is not None and value.shape == out.declared.dimensions \
                        and sources[out.pool_index].flags.writeable:
                    target[...] = value
                else:
                    self._write(value, out)
            return
        for value, out in zip(outputs, self.layout.outs):
            if out.as_declared and value.shape == out.declared.dimensions:
                pool = sources[out.pool_index]
                if not out.offset and pool.__class__ is np.ndarray and pool.dtype is out.dtype \
                        and pool.flags.carray and pool.shape == value.shape:
                    # The region is the whole of a numpy pool of this very
                    # shape and element type (the runtime's new output
                    # arrays): written through the pool itself, no view made.
                    pool[...] = value
                    continue
                target = np.ndarray(value.shape, out.dtype, pool, out.offset)
                if target.flags.writeable:    # (an array over a read-only pool is read-only)
                    target[...] = value
                    continue
            self._write(value, out)

    def _write(self, value, out: _Output) -> None:
        """``value`` into ``out``'s region byte by byte, for what
        :meth:`write_outputs` does not write through an array of the
        region's shape (another shape than declared, a read-only pool)."""
        arr = np.ascontiguousarray(value, dtype=out.dtype)
        if not arr.nbytes:
            return
        if as_buffer(self._pools[out.pool_index]).readonly:
            raise NnrtError(ErrorStatus.INVALID_ARGUMENT,
                            f"output operand {out.index}: pool {out.pool_index} is read-only")
        np.frombuffer(self._sources[out.pool_index], np.uint8, arr.nbytes, out.offset)[:] = \
            arr.reshape(-1).view(np.uint8)

    def succeeded(self, shapes: tuple[OutputShape, ...], timing: Timing) -> ExecutionResult:
        """The result of an execution that wrote outputs of ``shapes``."""
        layout = self.layout
        if shapes is layout.declared and timing is NO_TIMING:
            return layout.done
        return ExecutionResult(ErrorStatus.NONE, shapes, timing)


class ExecutionContext:
    """One execution's state: what kernels reach through ``call.executor``."""

    __slots__ = ("executor", "loop_timeout", "deadline", "_checkpoint", "_frames")

    def __init__(self, executor: Executor, loop_timeout: float | None, deadline: float | None,
                 checkpoint: Callable[["ExecutionContext"], None] | None = None):
        self.executor = executor
        if loop_timeout is None:
            self.loop_timeout = DEFAULT_LOOP_TIMEOUT
        elif isinstance(loop_timeout, bool) or not isinstance(loop_timeout, (int, float)) \
                or not loop_timeout >= 0:
            # Negative or NaN: NaN would never time out (every comparison is false).
            raise NnrtError(ErrorStatus.INVALID_ARGUMENT,
                            f"loop timeout {loop_timeout!r} is not a duration in seconds >= 0")
        else:
            self.loop_timeout = min(float(loop_timeout), MAX_LOOP_TIMEOUT)
        self.deadline = deadline
        self._checkpoint = checkpoint
        # [subgraph index, next operation] per active subgraph, outermost first.
        self._frames: list[list] = []

    @property
    def position(self) -> tuple[tuple[int | None, int], ...]:
        """(subgraph, next operation index) of every active subgraph, outermost first."""
        return tuple((index, k) for index, k in self._frames)

    def checkpoint(self) -> None:
        """An operation boundary (see the module docstring)."""
        if self._checkpoint is not None:
            self._checkpoint(self)

    def run_main(self, values: list) -> list:
        """The main subgraph's outputs from ``values``, every operand's value
        as it starts (what ``main.values(inputs)`` gives and a
        :class:`Binding` reads from a request's pools)."""
        if _FP_STATE is None:
            with np.errstate(all="ignore"):
                return self._run(self.executor.main, values)
        token = _FP_STATE.set(_FP_IGNORED)
        try:
            return self._run(self.executor.main, values)
        finally:
            _FP_STATE.reset(token)

    def run_subgraph(self, index: int | None, inputs: list) -> list:
        plan = self.executor.plans[index]
        return self._run(plan, plan.values(inputs))

    def _run(self, plan: _SubgraphPlan, values: list) -> list:
        checkpoint = self._checkpoint
        relaxed = self.executor.relaxed
        # Read once per subgraph run: a kernel is called directly unless
        # tracing or the cpuexe log is on.
        observed = _CPUEXE or tracing.recording
        frame = [plan.index, 0]
        self._frames.append(frame)
        try:
            if checkpoint is not None and plan.index is not None:
                checkpoint(self)   # entering a referenced subgraph: once per WHILE iteration
            for k, step in enumerate(plan.steps):
                frame[1] = k
                if checkpoint is not None:
                    checkpoint(self)
                args = list(step.args)
                for position, i, t, s, z, c in step.reads:
                    args[position] = _new_arg(Arg, (t, values[i], s, z, c))
                call = Call(step.type, args, step.out_operands, relaxed, self)
                try:
                    results = _observed(step, call) if observed else step.kernel(call)
                except NnrtError:
                    raise
                except (ValueError, TypeError, IndexError, KeyError, ArithmeticError,
                        MemoryError) as e:
                    raise NnrtError(ErrorStatus.GENERAL_FAILURE,
                                    f"{step.name} failed: {type(e).__name__}: {e}") from e
                if len(results) != len(step.outputs):
                    raise NnrtError(ErrorStatus.GENERAL_FAILURE,
                                    f"{step.name} kernel returned {len(results)} outputs, "
                                    f"expected {len(step.outputs)} (bug in the kernel)")
                for (j, i, dtype, dims), result in zip(step.results, results):
                    # An array of the operand's element type and declared
                    # shape is right as it is; anything else is checked.
                    if result.__class__ is not np.ndarray or result.dtype != dtype \
                            or result.shape != dims:
                        result = _checked_output(step, j, result)
                    values[i] = result
        finally:
            self._frames.pop()
        return list(map(values.__getitem__, plan.output_indexes))


def _observed(step: _Step, call: Call) -> list:
    """``step``'s kernel on ``call``, traced and logged as they are enabled."""
    start = time.perf_counter()
    if tracing.enabled():
        results = tracing.call(step.name, step.kernel, call)
    else:
        results = step.kernel(call)
    vlog("cpuexe", "%s %.3f ms", step.name, (time.perf_counter() - start) * 1e3)
    return results


def _checked_output(step: _Step, k: int, result):
    operand = step.out_operands[k]
    if operand.type.is_scalar:
        return result
    dtype = operand.type.dtype
    if not isinstance(result, np.ndarray):
        result = np.asarray(result)
    if result.dtype != dtype:
        if result.dtype.kind == "f" and dtype.kind == "f":
            result = result.astype(dtype)
        else:
            raise NnrtError(ErrorStatus.GENERAL_FAILURE,
                            f"{step.name} output {k} has element type {result.dtype}, "
                            f"operand type {operand.type.name} needs {dtype} (bug in the kernel)")
    dims = step.out_dims[k]
    if dims and result.shape != dims:   # (equal: the common case, without the walk below)
        if len(dims) != result.ndim or any(d and d != r for d, r in zip(dims, result.shape)):
            raise NnrtError(ErrorStatus.GENERAL_FAILURE,
                            f"{step.name} output {k} has shape {list(result.shape)}, "
                            f"but its operand is declared {list(dims)}")
    return result
