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

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .. import ops
from ..errors import ErrorStatus, NnrtError
from ..hal.types import OutputShape
from ..model.graph import HalModel, Operand, decode_value
from ..model.types import OperandLifeTime as L, OperationType
from ..hal.validate import ValidatedModel
from ..vlog import on as vlog_on, vlog
from .. import trace as tracing

_CONSTANT = (L.CONSTANT_COPY, L.CONSTANT_REFERENCE)
DEFAULT_LOOP_TIMEOUT = 2.0   # seconds, NNAPI's default WHILE loop timeout
MAX_LOOP_TIMEOUT = 15.0


@dataclass(frozen=True, slots=True)
class _Step:
    type: OperationType
    kernel: ops.registry.Kernel
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    arg_templates: tuple[tuple, ...]     # (type, scale, zero_point, channel_quant) per input
    out_operands: tuple[Operand, ...]
    out_dims: tuple[tuple[int, ...], ...]  # declared/inferred, 0 = unknown, () = unknown rank


class _SubgraphPlan:
    def __init__(self, model: HalModel, index: int | None, dims: dict[int, tuple[int, ...]]):
        sub = model.subgraph(index)
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
            templates = tuple((sub.operands[i].type, sub.operands[i].scale,
                               sub.operands[i].zero_point, sub.operands[i].channel_quant)
                              for i in op.inputs)
            out_operands = tuple(sub.operands[i] for i in op.outputs)
            steps.append(_Step(op.type, opdef.kernel, op.inputs, op.outputs, templates,
                               out_operands, tuple(dims.get(i, ()) for i in op.outputs)))
        self.steps = tuple(steps)


class Executor:
    def __init__(self, model: HalModel, validated: ValidatedModel):
        self.model = model
        self.relaxed = model.relax_computation_float32_to_float16
        self.plans = {index: _SubgraphPlan(model, index, validated.dims[index])
                      for index in validated.dims}

    def run(self, inputs: list, *, loop_timeout: float | None = None,
            deadline: float | None = None,
            checkpoint: Callable[["ExecutionContext"], None] | None = None) -> list[np.ndarray]:
        """Run the main subgraph on ``inputs`` (arrays/scalars, None = omitted).
        ``checkpoint(context)`` is called at every operation boundary."""
        context = ExecutionContext(self, loop_timeout, deadline, checkpoint)
        return context.run_subgraph(None, inputs)


class RequestPlan:
    """How a request's arguments become the main subgraph's inputs and how
    its outputs reach the request's regions, resolved once per prepared model
    (operand types, element types, declared shapes): what
    ``nnrt.hal.request`` does per execution, without looking anything up.

    ``buffers`` are the request's pools as flat byte views, as
    :meth:`nnrt.hal.validate.RequestValidator.check` returns them for a
    request it has validated."""

    __slots__ = ("_inputs", "_outputs")

    def __init__(self, model: HalModel):
        sub = model.main
        self._inputs = tuple((sub.operands[i], sub.operands[i].type.is_tensor,
                              sub.operands[i].type.dtype, sub.operands[i].dimensions)
                             for i in sub.input_indexes)
        self._outputs = tuple((i, sub.operands[i].type.dtype) for i in sub.output_indexes)

    def read_inputs(self, request, buffers) -> list:
        """An array view per tensor input (no copy), a Python value per
        scalar, None for an omitted input."""
        inputs = []
        for arg, (operand, is_tensor, dtype, declared) in zip(request.inputs, self._inputs):
            if arg.has_no_value:
                inputs.append(None)
                continue
            loc = arg.location
            if is_tensor:
                inputs.append(np.frombuffer(buffers[loc.pool_index], dtype,
                                            loc.length // dtype.itemsize,
                                            loc.offset).reshape(arg.dimensions or declared))
            else:
                raw = buffers[loc.pool_index][loc.offset:loc.offset + loc.length]
                inputs.append(decode_value(operand, raw))
        return inputs

    @staticmethod
    def output_shapes(request, outputs: list) -> tuple[OutputShape, ...]:
        """Each output's shape and whether its region holds it."""
        shapes = []
        for value, arg in zip(outputs, request.outputs):
            if value.__class__ is not np.ndarray:
                value = np.asarray(value)
            shapes.append(OutputShape(value.shape, value.nbytes <= arg.location.length))
        return tuple(shapes)

    def write_outputs(self, request, buffers, outputs: list) -> None:
        """Copy ``outputs`` into their regions (which ``output_shapes`` said
        are big enough); INVALID_ARGUMENT for a read-only pool."""
        for arg, (index, dtype), value in zip(request.outputs, self._outputs, outputs):
            arr = np.ascontiguousarray(value, dtype=dtype)
            if not arr.nbytes:
                continue
            loc = arg.location
            pool = buffers[loc.pool_index]
            if pool.readonly:
                raise NnrtError(ErrorStatus.INVALID_ARGUMENT,
                                f"output operand {index}: pool {loc.pool_index} is read-only")
            np.frombuffer(pool, np.uint8, arr.nbytes, loc.offset)[:] = \
                arr.reshape(-1).view(np.uint8)


class ExecutionContext:
    """One execution's state: what kernels reach through ``call.executor``."""

    def __init__(self, executor: Executor, loop_timeout: float | None, deadline: float | None,
                 checkpoint: Callable[["ExecutionContext"], None] | None = None):
        self.executor = executor
        if loop_timeout is None:
            loop_timeout = DEFAULT_LOOP_TIMEOUT
        elif isinstance(loop_timeout, bool) or not isinstance(loop_timeout, (int, float)) \
                or not loop_timeout >= 0:
            # Negative or NaN: NaN would never time out (every comparison is false).
            raise NnrtError(ErrorStatus.INVALID_ARGUMENT,
                            f"loop timeout {loop_timeout!r} is not a duration in seconds >= 0")
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

    def run_subgraph(self, index: int | None, inputs: list) -> list:
        plan = self.executor.plans[index]
        values = list(plan.initial)
        if len(inputs) != len(plan.input_indexes):
            raise NnrtError(ErrorStatus.GENERAL_FAILURE,
                            f"subgraph {index} takes {len(plan.input_indexes)} inputs, "
                            f"got {len(inputs)}")
        for i, v in zip(plan.input_indexes, inputs):
            values[i] = v
        relaxed = self.executor.relaxed
        trace = vlog_on("cpuexe")
        frame = [index, 0]
        self._frames.append(frame)
        try:
            self._run_steps(plan, values, frame, relaxed, trace)
        finally:
            self._frames.pop()
        return [values[i] for i in plan.output_indexes]

    def _run_steps(self, plan: _SubgraphPlan, values: list, frame: list, relaxed: bool,
                   trace: bool) -> None:
        checkpoint = self._checkpoint
        if checkpoint is not None and frame[0] is not None:
            checkpoint(self)   # entering a referenced subgraph: once per WHILE iteration
        for k, step in enumerate(plan.steps):
            frame[1] = k
            if checkpoint is not None:
                checkpoint(self)
            args = [ops.Arg(t, values[i], s, z, c)
                    for i, (t, s, z, c) in zip(step.inputs, step.arg_templates)]
            call = ops.Call(step.type, args, list(step.out_operands), relaxed, self)
            start = time.perf_counter() if trace else 0.0
            try:
                results = tracing.call(step.type.name, step.kernel, call)
            except NnrtError:
                raise
            except (ValueError, TypeError, IndexError, KeyError, ArithmeticError,
                    MemoryError) as e:
                raise NnrtError(ErrorStatus.GENERAL_FAILURE,
                                f"{step.type.name} failed: {type(e).__name__}: {e}") from e
            if trace:
                vlog("cpuexe", "%s %.3f ms", step.type.name, (time.perf_counter() - start) * 1e3)
            if len(results) != len(step.outputs):
                raise NnrtError(ErrorStatus.GENERAL_FAILURE,
                                f"{step.type.name} kernel returned {len(results)} outputs, "
                                f"expected {len(step.outputs)} (bug in the kernel)")
            for j, (i, result) in enumerate(zip(step.outputs, results)):
                values[i] = _checked_output(step, j, result)
        frame[1] = len(plan.steps)


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
                            f"{step.type.name} output {k} has element type {result.dtype}, "
                            f"operand type {operand.type.name} needs {dtype} (bug in the kernel)")
    dims = step.out_dims[k]
    if dims and result.shape != dims:   # (equal: the common case, without the walk below)
        if len(dims) != result.ndim or any(d and d != r for d, r in zip(dims, result.shape)):
            raise NnrtError(ErrorStatus.GENERAL_FAILURE,
                            f"{step.type.name} output {k} has shape {list(result.shape)}, "
                            f"but its operand is declared {list(dims)}")
    return result
