"""A step of a compiled model (one device's run of the partition) and the one
way its values become a HAL request: for plain executions, bursts and the
fenced chain alike.

A value is what the runtime holds for an operand: None (an omitted optional
input), a numpy array (the request points at its bytes: no copy), a
:class:`~nnrt.memory.Region` of an app's Memory, a :class:`Buffer` of the
runtime's own shared memory (the fenced chain's), or a
:class:`~nnrt.runtime.memory_domain.DeviceMemory` kept by the driver (the
request names it by token). One pool per Memory,
however many regions of it a request uses, so a driver service maps each
memory once.

:meth:`Step.run_inputs` is the one resize-and-retry loop: when a driver answers
OUTPUT_INSUFFICIENT_SIZE with the shapes it needs, the outputs are allocated
again at those shapes (at most ``MAX_RESIZE_RETRIES`` times), and the shapes
an execution reported are the next execution's first guess.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Awaitable, Callable, Sequence

import numpy as np

from ..errors import STATUS_INSUFFICIENT as _INSUFFICIENT, STATUS_NONE as _NONE, NnrtError
from ..hal import Device, ExecutionResult, PreparedModel, Request, RequestArgument
from ..hal.validate import ValidatedModel
from ..memory import DeviceToken, Memory, Region
from ..model.graph import DataLocation, Operand
from . import partition
from .memory_domain import DeviceMemory

# How many times an execution is retried with larger output buffers after
# OUTPUT_INSUFFICIENT_SIZE (dynamic output shapes) before giving up.
MAX_RESIZE_RETRIES = 2


@dataclass(slots=True)
class Buffer:
    """One operand's value in the runtime's shared memory."""

    memory: Memory
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int = 0
    length: int | None = None  # bytes the request may use (an app Region's); default nbytes

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def array(self, shape=None) -> np.ndarray:
        return self.memory.array(self.dtype, self.shape if shape is None else shape, self.offset)

    @property
    def location_length(self) -> int:
        return self.nbytes if self.length is None else self.length


def _location(pools: list, value, output: bool) -> DataLocation:
    if isinstance(value, DeviceMemory):   # a driver buffer: its token, used whole
        pools.append(DeviceToken(value.token))
        return DataLocation(len(pools) - 1, 0, 0)
    if isinstance(value, (Region, Buffer)):
        memory = value.memory
        for k, pool in enumerate(pools):
            if pool is memory:
                break
        else:
            pools.append(memory)
            k = len(pools) - 1
        length = value.length if isinstance(value, Region) else value.location_length
        return DataLocation(k, value.offset, length)
    if value.size:
        pools.append(value.reshape(-1).view(np.uint8))
    else:  # a zero-byte buffer is still a buffer: the driver reports the size it needs
        pools.append(bytearray(0))
    return DataLocation(len(pools) - 1, 0, value.nbytes)


def _dimensions(value, operand: Operand) -> tuple[int, ...]:
    if not operand.type.is_tensor:
        return ()
    if isinstance(value, Region):
        return tuple(value.dimensions or operand.dimensions)
    if isinstance(value, DeviceMemory):
        return tuple(value.dimensions)
    return tuple(value.shape)


def build_request(inputs: Sequence, input_operands: Sequence[Operand],
                  outputs: Sequence) -> Request:
    """The HAL request of a step for these input and output values."""
    pools: list = []
    in_args = [RequestArgument(has_no_value=True) if value is None else
               RequestArgument(False, _location(pools, value, False), _dimensions(value, operand))
               for value, operand in zip(inputs, input_operands)]
    out_args = [RequestArgument(False, _location(pools, value, True)) for value in outputs]
    return Request(tuple(in_args), tuple(out_args), tuple(pools))


def allocate_array(dims: tuple[int, ...], operand: Operand) -> np.ndarray:
    """An output array for ``operand``: shaped ``dims`` when they are known
    (``shaped`` then returns it as it is), else empty."""
    if operand.type.is_scalar:
        return np.empty(1, operand.type.dtype)
    if dims and all(dims):
        return np.empty(dims, operand.type.dtype)
    return np.empty(0, operand.type.dtype)


def shaped(value, shape: tuple[int, ...], operand: Operand):
    """The result an output value holds, at the shape the driver reported:
    a view, never a copy."""
    if value.__class__ is np.ndarray and value.shape == shape:
        return value               # allocated at the shape it got
    if isinstance(value, DeviceMemory):   # the data stays in the driver
        value.written(shape)
        return value
    if isinstance(value, Region):   # a view onto the app's memory
        return value.array(operand.type.dtype, shape)
    if isinstance(value, Buffer):
        return Buffer(value.memory, value.dtype, tuple(shape), value.offset, value.length)
    return value.reshape(-1)[:math.prod(shape)].reshape(shape)   # () -> 1: a scalar


Execute = Callable[[Request], Awaitable[ExecutionResult]]


def release_all(held: list) -> None:
    """Release each of ``held`` (prepared models, executions) and empty it;
    one whose service is gone has nothing left to release."""
    for item in held:
        try:
            item.release()
        except NnrtError:
            pass
    held.clear()


class DriverFailure(Exception):
    """A step failed because of its driver; the execution may be retried on the CPU."""

    def __init__(self, device: Device, error: NnrtError):
        super().__init__(str(error))
        self.device = device
        self.error = error


class Step:
    """One prepared step of a compiled model and the shapes it last produced."""

    def __init__(self, device: Device, prepared: PreparedModel, plan: partition.StepPlan,
                 validated: ValidatedModel):
        self.device = device
        self.prepared = prepared
        self.plan = plan
        operands = plan.model.main.operands
        self.inputs: list[Operand] = [operands[i] for i in plan.model.main.input_indexes]
        self.outputs: list[Operand] = [operands[i] for i in plan.model.main.output_indexes]
        # Output shapes we expect: declared or inferred at compile time, then
        # whatever the last execution reported (so a dynamic output is sized
        # right from the second execution on).
        dims = validated.dims[None]
        self._output_guess: list[tuple[int, ...]] = []
        self._sized: tuple | None = None   # (shapes, dtypes), see _guess
        self._guess([dims[i] for i in plan.outputs])

    def sized(self) -> bool:
        """Whether every output's shape is known before running."""
        return all(o.type.is_scalar or (len(g) > 0 and all(d > 0 for d in g))
                   for g, o in zip(self.output_guess, self.outputs))

    def run(self, values: dict, execute: Execute, user_outputs: Sequence | None = None,
            allocate: Callable[[tuple[int, ...], Operand], object] = allocate_array):
        """:meth:`run_inputs` on ``values`` (original operand index -> value)."""
        return self.run_inputs([values[i] for i in self.plan.inputs], execute, user_outputs,
                               allocate)

    async def run_inputs(self, inputs: list, execute: Execute,
                         user_outputs: Sequence | None = None,
                         allocate: Callable[[tuple[int, ...], Operand], object] = allocate_array):
        """Run the step on ``inputs`` (its input values, in order) with
        ``execute`` (the prepared model's, a burst session's, ...), into
        ``user_outputs`` when given, else into outputs made by ``allocate``
        (retrying larger ones after OUTPUT_INSUFFICIENT_SIZE). Returns the
        HAL result and the output values, shaped as reported on success."""
        for _attempt in range(MAX_RESIZE_RETRIES + 1):
            if user_outputs is not None:
                outs = list(user_outputs)
            elif allocate is allocate_array and self._sized is not None:
                outs = list(map(np.empty, *self._sized))
            else:
                outs = [allocate(dims, o) for dims, o in zip(self.output_guess, self.outputs)]
            result = await execute(build_request(inputs, self.inputs, outs))
            status = result.status
            if status == _INSUFFICIENT and user_outputs is None and result.output_shapes:
                self._guess([s.dimensions for s in result.output_shapes])
                continue
            break
        if status != _NONE:
            return result, outs
        shapes = [s.dimensions for s in result.output_shapes]
        if shapes != self._output_guess:
            self._guess(shapes)
        return result, [out if out.__class__ is np.ndarray and out.shape == shape
                        else shaped(out, shape, o)
                        for out, shape, o in zip(outs, shapes, self.outputs)]

    @property
    def output_guess(self) -> list[tuple[int, ...]]:
        """The output shapes the next execution expects."""
        return self._output_guess

    @output_guess.setter
    def output_guess(self, shapes) -> None:
        self._guess(list(shapes))

    def _guess(self, shapes: list[tuple[int, ...]]) -> None:
        """Expect ``shapes``; with every one known (and no scalar), keep the
        shapes and the dtypes the next execution's arrays are made at."""
        self._output_guess = shapes
        self._sized = ((tuple(shapes), tuple(o.type.dtype for o in self.outputs))
                       if all(o.type.is_tensor and dims and all(dims)
                              for dims, o in zip(shapes, self.outputs)) else None)
