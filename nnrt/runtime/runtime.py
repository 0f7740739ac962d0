"""The app-facing runtime: ``Runtime`` finds devices and compiles models,
``CompiledModel`` runs executions and burst sessions.

The async core uses anyio, so it runs on asyncio (uvloop when installed) and
on trio. The runtime talks to drivers only through the HAL
(``nnrt.drivers.hal``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import anyio
import numpy as np

from ..drivers.hal import (UINT64_MAX, Device, ExecutionPreference, PreparedModel, Request,
                           RequestArgument)
from ..drivers.reference import ReferenceDevice
from ..errors import ErrorStatus, NnrtError, bad_state, invalid
from ..model.builder import Model
from ..model.graph import DataLocation, Operand
from ..model.validate import ValidatedModel, validate_model
from ..qos.priority import Priority, check_deadline, check_priority
from ..vlog import vlog

# How many times an execution is retried with larger output buffers after
# OUTPUT_INSUFFICIENT_SIZE (dynamic output shapes) before giving up.
_MAX_RESIZE_RETRIES = 2


@dataclass(frozen=True, slots=True)
class ExecutionTiming:
    """Microseconds, None when not measured (the HAL's UINT64_MAX)."""

    on_device: int | None
    in_driver: int | None


@dataclass(frozen=True)
class Result:
    outputs: list[np.ndarray]
    output_shapes: list[tuple[int, ...]]
    timing: ExecutionTiming | None  # None when timing was not asked for


class Runtime:
    """Finds devices and compiles models for them. Use as ``async with``."""

    def __init__(self, *, devices: Sequence[Device] | None = None):
        self._given_devices = list(devices) if devices is not None else None
        self._devices: list[Device] | None = None

    async def __aenter__(self) -> "Runtime":
        self.open()
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    def open(self) -> None:
        if self._devices is None:
            self._devices = (self._given_devices if self._given_devices is not None
                             else [ReferenceDevice()])
            vlog("manager", "devices: %s", ", ".join(d.name for d in self._devices))

    def close(self) -> None:
        self._devices = None

    @property
    def devices(self) -> list[Device]:
        if self._devices is None:
            raise bad_state("the runtime is not open: use 'async with nnrt.Runtime() as rt'")
        return list(self._devices)

    def device(self, name: str) -> Device:
        for d in self.devices:
            if d.name == name:
                return d
        raise invalid(f"no device named {name!r}; devices: {[d.name for d in self.devices]}")

    def supported_operations(self, model: Model, device: str | Device | None = None) -> list[bool]:
        """Which operations of ``model`` the device (default: every device
        together) can run."""
        hal = _finished(model).hal_model
        devices = [self._resolve(device)] if device is not None else self.devices
        flags = [False] * len(hal.main.operations)
        for d in devices:
            flags = [a or b for a, b in zip(flags, d.supported_operations(hal))]
        return flags

    def _resolve(self, device: str | Device) -> Device:
        return self.device(device) if isinstance(device, str) else device

    async def compile(self, model: Model, *,
                      preference: ExecutionPreference = ExecutionPreference.FAST_SINGLE_ANSWER,
                      priority: Priority = Priority.MEDIUM, deadline: float | None = None,
                      device: str | Device | None = None) -> "CompiledModel":
        """Validate ``model`` and prepare it on a device that supports every
        operation (``device`` picks one by name)."""
        hal = _finished(model).hal_model
        priority = check_priority(priority)
        deadline = check_deadline(deadline)
        try:
            preference = ExecutionPreference(preference)
        except ValueError:
            raise invalid(f"execution preference {preference!r} is not valid") from None
        validated = validate_model(hal)
        candidates = [self._resolve(device)] if device is not None else self.devices
        chosen = None
        for d in candidates:
            flags = d.supported_operations(hal)
            if all(flags):
                chosen = d
                break
        if chosen is None:
            flags = self.supported_operations(model, device)
            missing = [i for i, ok in enumerate(flags) if not ok] or [0]
            op = hal.main.operations[missing[0]] if hal.main.operations else None
            raise NnrtError(ErrorStatus.INVALID_ARGUMENT,
                            f"no device supports operation {missing[0]}"
                            f"{f' ({op.type.name})' if op else ''} of this model")
        start = time.perf_counter()
        prepared = await chosen.prepare_model(hal, preference, priority, deadline)
        vlog("compilation", "prepared on %s in %.1f ms", chosen.name,
             (time.perf_counter() - start) * 1e3)
        return CompiledModel(model, validated, chosen, prepared, priority)


def _finished(model: Model) -> Model:
    if not isinstance(model, Model):
        raise invalid(f"expected an nnrt.Model, got {type(model).__name__}")
    if not model.finished:
        raise bad_state("the model must be finished before it is compiled")
    return model


class CompiledModel:
    """A model prepared on a device; run it with :meth:`execute` or a :meth:`burst`."""

    def __init__(self, model: Model, validated: ValidatedModel, device: Device,
                 prepared: PreparedModel, priority: Priority):
        self.model = model
        self.device = device
        self.priority = priority
        self._prepared = prepared
        hal = model.hal_model
        self._inputs: list[Operand] = [hal.main.operands[i] for i in hal.main.input_indexes]
        self._outputs: list[Operand] = [hal.main.operands[i] for i in hal.main.output_indexes]
        main_dims = validated.dims[None]
        # Output shapes we expect: declared or inferred at compile time, then
        # whatever the last execution reported (so a dynamic output is sized
        # right from the second execution on).
        self._output_guess: list[tuple[int, ...]] = [main_dims[i] for i in hal.main.output_indexes]

    async def execute(self, inputs: Sequence[Any], *, outputs: Sequence[np.ndarray] | None = None,
                      measure_timing: bool = False, deadline: float | None = None,
                      loop_timeout: float | None = None) -> Result:
        """Run the model once. ``inputs`` are numpy arrays (or values numpy can
        convert), None for an omitted optional input. ``outputs`` may give
        the arrays to write results into; otherwise the runtime allocates them."""
        deadline = check_deadline(deadline)
        in_args, pools = self._stage_inputs(inputs)
        user_outputs = outputs is not None
        for _attempt in range(_MAX_RESIZE_RETRIES + 1):
            out_arrays = self._output_arrays(outputs)
            out_args = []
            for arr in out_arrays:
                out_args.append(RequestArgument(False, DataLocation(len(pools) + len(out_args), 0,
                                                                    arr.nbytes), ()))
            request = Request(tuple(in_args), tuple(out_args),
                              tuple(pools) + tuple(_writable_bytes(a) for a in out_arrays))
            result = await self._prepared.execute(request, measure_timing, deadline, loop_timeout)
            if result.status == ErrorStatus.OUTPUT_INSUFFICIENT_SIZE and not user_outputs \
                    and result.output_shapes:
                self._output_guess = [s.dimensions for s in result.output_shapes]
                continue
            break
        if result.status != ErrorStatus.NONE:
            raise NnrtError(result.status, result.message or "execution failed",
                            output_shapes=[s.dimensions for s in result.output_shapes])
        shapes = [s.dimensions for s in result.output_shapes]
        self._output_guess = shapes
        views = [_shaped(a, s) for a, s in zip(out_arrays, shapes)]
        timing = None
        if measure_timing:
            t = result.timing
            timing = ExecutionTiming(None if t.on_device == UINT64_MAX else t.on_device,
                                     None if t.in_driver == UINT64_MAX else t.in_driver)
        return Result(views, shapes, timing)

    def burst(self) -> "Burst":
        return Burst(self)

    def _stage_inputs(self, inputs: Sequence[Any]):
        if len(inputs) != len(self._inputs):
            raise invalid(f"the model takes {len(self._inputs)} inputs, got {len(inputs)}")
        args, pools = [], []
        for k, (value, operand) in enumerate(zip(inputs, self._inputs)):
            if value is None:
                args.append(RequestArgument(has_no_value=True))
                continue
            arr = _as_operand_array(value, operand, f"input {k}")
            pools.append(arr.reshape(-1).view(np.uint8))
            dims = tuple(arr.shape) if operand.type.is_tensor else ()
            args.append(RequestArgument(False, DataLocation(len(pools) - 1, 0, arr.nbytes), dims))
        return args, pools

    def _output_arrays(self, outputs: Sequence[np.ndarray] | None) -> list[np.ndarray]:
        if outputs is not None:
            if len(outputs) != len(self._outputs):
                raise invalid(f"the model has {len(self._outputs)} outputs, got {len(outputs)} "
                              f"output arrays")
            arrays = []
            for k, (arr, operand) in enumerate(zip(outputs, self._outputs)):
                if not isinstance(arr, np.ndarray) or arr.dtype != operand.type.dtype \
                        or not arr.flags.c_contiguous or not arr.flags.writeable:
                    raise invalid(f"output {k} must be a writable C-contiguous numpy array of "
                                  f"{operand.type.dtype}")
                arrays.append(arr)
            return arrays
        arrays = []
        for dims, operand in zip(self._output_guess, self._outputs):
            count = int(np.prod(dims)) if dims and all(dims) else 0
            if operand.type.is_scalar:
                count = 1
            # A zero-byte buffer is still a buffer: the driver reports the size it needs.
            arrays.append(np.empty(count, operand.type.dtype))
        return arrays


def _writable_bytes(arr: np.ndarray):
    return arr.reshape(-1).view(np.uint8) if arr.size else bytearray(0)


def _shaped(arr: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    count = int(np.prod(shape)) if shape else 1
    return arr.reshape(-1)[:count].reshape(shape)


def _as_operand_array(value: Any, operand: Operand, what: str) -> np.ndarray:
    dtype = operand.type.dtype
    arr = np.asarray(value)
    if arr.dtype != dtype:
        if arr.dtype == object or not (np.can_cast(arr.dtype, dtype, "same_kind")
                                       or arr.dtype.kind in "iub" and dtype.kind in "iub"):
            raise invalid(f"{what} is {operand.type.name}: a {arr.dtype} value does not "
                          f"convert to {dtype}")
        arr = arr.astype(dtype)
    if operand.type.is_scalar and arr.ndim != 0:
        raise invalid(f"{what} is a scalar {operand.type.name}, got shape {list(arr.shape)}")
    return np.ascontiguousarray(arr)


class Burst:
    """A burst session: a sequence of executions of one compiled model.

    With an in-process device there is nothing to hand off, so a burst runs
    its executions one after another through the same path as ``execute``;
    driver services get the shared-memory ring of DESIGN.md ("Burst
    executions and the FMQ").
    """

    def __init__(self, compiled: CompiledModel):
        self._compiled = compiled
        self._lock = anyio.Lock()
        self._open = False

    async def __aenter__(self) -> "Burst":
        self._open = True
        return self

    async def __aexit__(self, *exc) -> None:
        self._open = False

    async def execute(self, inputs: Sequence[Any], **kwargs) -> Result:
        if not self._open:
            raise bad_state("the burst session is not open: use 'async with compiled.burst()'")
        async with self._lock:  # a burst runs its requests in order, one at a time
            return await self._compiled.execute(inputs, **kwargs)


def run(model: Model, inputs: Sequence[Any], **kwargs) -> Result:
    """Synchronous helper for scripts: compile ``model`` on the default
    devices and execute it once. Built on the async core."""
    async def main() -> Result:
        async with Runtime() as rt:
            compiled = await rt.compile(model)
            return await compiled.execute(inputs, **kwargs)
    return anyio.run(main)
