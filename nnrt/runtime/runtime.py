"""The app-facing runtime: ``Runtime`` finds devices and compiles models,
``CompiledModel`` runs executions and burst sessions.

The async core uses anyio, so it runs on asyncio (uvloop when installed) and
on trio. The runtime talks to drivers only through the HAL
(``nnrt.hal``).
"""
from __future__ import annotations

import math
import time
import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import anyio
import numpy as np

from ..hal import (UINT64_MAX, Device, DeviceType, ExecutionPreference, PreparedModel, Request,
                           RequestArgument)
from ..drivers.reference import ReferenceDevice
from ..qos import ScheduledDevice
from ..errors import ErrorStatus, NnrtError, bad_state, invalid
from ..memory import Memory, Region
from ..model.builder import Model
from ..model.graph import DataLocation, Operand
from ..hal.validate import ValidatedModel, validate_model
from . import partition, signature
from .fenced import execute_fenced
from .results import ExecutionTiming, Result, copy_into
from ..hal.types import Priority, check_deadline, check_priority
from ..vlog import vlog

# How many times an execution is retried with larger output buffers after
# OUTPUT_INSUFFICIENT_SIZE (dynamic output shapes) before giving up.
_MAX_RESIZE_RETRIES = 2


class Runtime:
    """Finds devices and compiles models for them. Use as ``async with``."""

    def __init__(self, *, devices: Sequence[Device] | None = None, spawn: Sequence = (),
                 discover: bool = True, policy=None):
        """``devices`` replaces discovery with the given devices. Otherwise the
        runtime has the in-process reference CPU device, the services listed in
        ``NNRT_DRIVERS`` and the config file (``discover=True``), and the
        services it starts itself from ``spawn`` (driver kinds such as
        ``"sample-float-fast"``, or ``(name, kind)`` pairs), stopped on close.
        ``policy`` (``nnrt.qos.Policy``) applies to the in-process devices."""
        self._given_devices = list(devices) if devices is not None else None
        self._spawn = list(spawn)
        self._discover = discover
        self._policy = policy
        self._devices: list[Device] | None = None
        self._cpu: Device | None = None
        self._services: list = []
        self._folder = None

    async def __aenter__(self) -> "Runtime":
        await self.open()
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    async def open(self) -> None:
        if self._devices is not None:
            return
        if self._given_devices is not None:
            # QoS in front of every driver: a device without a scheduler of
            # its own gets one (a service's proxy has one in the service).
            self._devices = [d if d.scheduling().fronted
                             else ScheduledDevice(d, policy=self._policy)
                             for d in self._given_devices]
            self._cpu = next((d for d in self._devices if d.type == DeviceType.CPU), None)
        else:
            found: list[Device] = []
            if self._discover or self._spawn:
                from . import discovery  # the service client needs only be loaded when used
                if self._discover:
                    found += await discovery.connect_configured()
                if self._spawn:
                    self._folder = discovery.private_folder()
                    self._services, spawned = await discovery.spawn(self._spawn,
                                                                    self._folder.name)
                    found += spawned
            self._cpu = ScheduledDevice(ReferenceDevice(), policy=self._policy)
            self._devices = found + [self._cpu]
        vlog("manager", "devices: %s", ", ".join(d.name for d in self._devices))

    def close(self) -> None:
        if self._devices is None:
            return
        if self._given_devices is None:
            for d in self._devices:
                d.close()
        for service in self._services:
            service.stop()
        self._services = []
        if self._folder is not None:
            self._folder.cleanup()
            self._folder = None
        self._devices = None
        self._cpu = None

    @property
    def devices(self) -> list[Device]:
        if self._devices is None:
            raise bad_state("the runtime is not open: use 'async with nnrt.Runtime() as rt'")
        # A service that died leaves the list (the HAL's DEAD_OBJECT).
        self._devices = [d for d in self._devices if d.alive]
        return list(self._devices)

    def device(self, name: str) -> Device:
        for d in self.devices:
            if d.name == name:
                return d
        raise invalid(f"no device named {name!r}; devices: {[d.name for d in self.devices]}")

    async def supported_operations(self, model: Model,
                                   devices: Sequence[str | Device] | None = None) -> list[bool]:
        """Which operations of ``model`` the given devices (default: every
        device) can run together."""
        hal = _finished(model).hal_model
        devices = [self._resolve(d) for d in devices] if devices is not None else self.devices
        flags = [False] * len(hal.main.operations)
        for d in devices:
            flags = [a or b for a, b in zip(flags, await d.supported_operations(hal))]
        return flags

    async def statistics(self, device: str | Device):
        """The counters of the scheduler in front of ``device`` (per app and
        priority: queued, running, completed, preempted, deadline misses,
        queue-wait p50/p99, device time), None when it has none."""
        return await self._resolve(device).statistics()

    async def finished_jobs(self, device: str | Device) -> tuple:
        """The recent executions the scheduler of ``device`` finished, with
        its own timestamps (submitted, started, finished, longest step)."""
        return await self._resolve(device).finished_jobs()

    def _resolve(self, device: str | Device) -> Device:
        return self.device(device) if isinstance(device, str) else device

    async def compile(self, model: Model, *,
                      preference: ExecutionPreference = ExecutionPreference.FAST_SINGLE_ANSWER,
                      priority: Priority = Priority.MEDIUM, deadline: float | None = None,
                      devices: Sequence[str | Device] | None = None) -> "CompiledModel":
        """Validate ``model``, assign its operations to devices and prepare
        each step on its device.

        ``devices`` restricts compilation to the named devices; then, as in
        NNAPI, a device that fails to prepare its part fails the compilation.
        Otherwise every device is a candidate and a part whose device fails
        to prepare it falls back to the reference CPU device.
        """
        hal = _finished(model).hal_model
        priority = check_priority(priority)
        deadline = check_deadline(deadline)
        try:
            preference = ExecutionPreference(preference)
        except ValueError:
            raise invalid(f"execution preference {preference!r} is not valid") from None
        validated = validate_model(hal)
        explicit = devices is not None
        candidates = [self._resolve(d) for d in devices] if explicit else self.devices
        if explicit and not candidates:
            raise invalid("devices=[] names no device")
        supported = [await d.supported_operations(hal) for d in candidates]
        plans = partition.split(hal, partition.assign_devices(hal, candidates, supported,
                                                              preference))
        steps = []
        for plan in plans:
            start = time.perf_counter()
            try:
                prepared = await plan.device.prepare_model(plan.model, preference, priority,
                                                           deadline)
                device = plan.device
            except NnrtError as e:
                if explicit or plan.device is self.cpu or e.status in _NOT_THE_DRIVERS_FAULT:
                    raise
                vlog("compilation", "%s failed to prepare a step (%s); falling back to %s",
                     plan.device.name, e, self.cpu.name)
                device = self.cpu
                prepared = await device.prepare_model(plan.model, preference, priority, deadline)
            vlog("compilation", "step of %d operations prepared on %s in %.1f ms",
                 len(plan.model.main.operations), device.name,
                 (time.perf_counter() - start) * 1e3)
            steps.append(_Step(device, prepared, plan, validated))
        return CompiledModel(self, model, validated, steps, priority, preference,
                             fallback_allowed=not explicit)

    @property
    def cpu(self) -> Device:
        """The CPU device work falls back to: the runtime's own reference
        device, or with ``devices=`` the first given device of type CPU."""
        self.devices   # BAD_STATE when not open
        if self._cpu is None:
            raise NnrtError(ErrorStatus.DEVICE_UNAVAILABLE, "the runtime has no CPU device")
        return self._cpu

    def _forget(self, device: Device) -> None:
        """A device whose service died leaves the device list."""
        if self._devices is not None and device in self._devices:
            self._devices.remove(device)
            vlog("manager", "device %s is gone", device.name)


# Failures that are about the request or the app, not the driver: retrying on
# the CPU would fail the same way, break the app's deadline, or (a full queue:
# RESOURCE_EXHAUSTED) just move the app's flood onto the CPU, so they are
# reported as they are.
_NOT_THE_DRIVERS_FAULT = frozenset({
    ErrorStatus.INVALID_ARGUMENT, ErrorStatus.OUTPUT_INSUFFICIENT_SIZE,
    ErrorStatus.MISSED_DEADLINE_TRANSIENT, ErrorStatus.MISSED_DEADLINE_PERSISTENT,
    ErrorStatus.RESOURCE_EXHAUSTED_TRANSIENT, ErrorStatus.RESOURCE_EXHAUSTED_PERSISTENT,
})


def _finished(model: Model) -> Model:
    if not isinstance(model, Model):
        raise invalid(f"expected an nnrt.Model, got {type(model).__name__}")
    if not model.finished:
        raise bad_state("the model must be finished before it is compiled")
    return model


class _Step:
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
        self.output_guess: list[tuple[int, ...]] = [dims[i] for i in plan.outputs]

    async def run(self, values: dict, user_outputs: Sequence[np.ndarray] | None, measure: bool,
                  deadline: float | None, loop_timeout: float | None, session=None):
        """Execute the step on ``values`` (original operand index -> array or
        None), through burst ``session`` when given; returns the HAL result
        and the output arrays."""
        executor = session if session is not None else self.prepared
        in_args, pools = [], []
        for index, operand in zip(self.plan.inputs, self.inputs):
            value = values[index]
            if value is None:
                in_args.append(RequestArgument(has_no_value=True))
            elif isinstance(value, Region):
                dims = (value.dimensions or operand.dimensions) if operand.type.is_tensor else ()
                in_args.append(RequestArgument(False, DataLocation(
                    _pool_of(pools, value.memory), value.offset, value.length), tuple(dims)))
            else:
                pools.append(value.reshape(-1).view(np.uint8))
                dims = tuple(value.shape) if operand.type.is_tensor else ()
                in_args.append(RequestArgument(False, DataLocation(len(pools) - 1, 0,
                                                                   value.nbytes), dims))
        for _attempt in range(_MAX_RESIZE_RETRIES + 1):
            outs = (list(user_outputs) if user_outputs is not None
                    else [_allocate(dims, o) for dims, o in zip(self.output_guess, self.outputs)])
            out_pools = list(pools)
            out_args = []
            for out in outs:
                if isinstance(out, Region):
                    location = DataLocation(_pool_of(out_pools, out.memory), out.offset,
                                            out.length)
                else:
                    out_pools.append(_writable_bytes(out))
                    location = DataLocation(len(out_pools) - 1, 0, out.nbytes)
                out_args.append(RequestArgument(False, location))
            request = Request(tuple(in_args), tuple(out_args), tuple(out_pools))
            result = await executor.execute(request, measure, deadline, loop_timeout)
            if result.status == ErrorStatus.OUTPUT_INSUFFICIENT_SIZE and user_outputs is None \
                    and result.output_shapes:
                self.output_guess = [s.dimensions for s in result.output_shapes]
                continue
            break
        if result.status != ErrorStatus.NONE:
            return result, outs
        self.output_guess = [s.dimensions for s in result.output_shapes]
        arrays = []
        for out, shape, operand in zip(outs, result.output_shapes, self.outputs):
            if isinstance(out, Region):  # a view onto the app's memory: no copy
                arrays.append(out.array(operand.type.dtype, shape.dimensions))
            else:
                arrays.append(_shaped(out, shape.dimensions))
        return result, arrays


def _pool_of(pools: list, memory: Memory) -> int:
    """Index of ``memory`` among ``pools``, appending it the first time: one
    pool per Memory however many regions of it a request uses."""
    for k, pool in enumerate(pools):
        if pool is memory:
            return k
    pools.append(memory)
    return len(pools) - 1


def _allocate(dims: tuple[int, ...], operand: Operand) -> np.ndarray:
    if operand.type.is_scalar:
        return np.empty(1, operand.type.dtype)
    count = math.prod(dims) if dims and all(dims) else 0
    # A zero-byte buffer is still a buffer: the driver reports the size it needs.
    return np.empty(count, operand.type.dtype)


class CompiledModel:
    """A model prepared on one or more devices; run it with :meth:`execute`
    or a :meth:`burst`."""

    def __init__(self, runtime: Runtime, model: Model, validated: ValidatedModel,
                 steps: list[_Step], priority: Priority, preference: ExecutionPreference,
                 fallback_allowed: bool):
        self.model = model
        self.priority = priority
        self.preference = preference
        self._runtime = runtime
        self._validated = validated
        self._steps = steps
        self._fallback_allowed = fallback_allowed
        # Prepared models live in their drivers (maybe another process) until
        # released: release them when this object goes away or is closed.
        self._prepared_models = [s.prepared for s in steps]
        self._finalizer = weakref.finalize(self, _release, self._prepared_models)
        hal = model.hal_model
        self._inputs: list[Operand] = [hal.main.operands[i] for i in hal.main.input_indexes]
        self._outputs: list[Operand] = [hal.main.operands[i] for i in hal.main.output_indexes]
        self._signature = signature.Signature(model)

    @property
    def inputs(self) -> list[signature.TensorInfo]:
        """The inputs an app passes: name, dtype, shape (None = unknown), quantization."""
        return self._signature.inputs

    @property
    def outputs(self) -> list[signature.TensorInfo]:
        return self._signature.outputs

    def reset_state(self) -> None:
        """Zero the state a stateful model carries between executions."""
        self._signature.reset_state()

    @property
    def devices(self) -> list[Device]:
        """The device of each step, in execution order."""
        return [s.device for s in self._steps]

    @property
    def device(self) -> Device:
        """The device of a single-device compilation (the first step's otherwise)."""
        return self._steps[0].device

    @property
    def _prepared(self) -> PreparedModel:
        return self._steps[0].prepared

    async def execute(self, inputs: Sequence[Any], *, outputs: Sequence[np.ndarray] | None = None,
                      measure_timing: bool = False, deadline: float | None = None,
                      loop_timeout: float | None = None) -> Result:
        """Run the model once. ``inputs`` are numpy arrays (or values numpy can
        convert), None for an omitted optional input. ``outputs`` may give
        the arrays to write results into; otherwise the runtime allocates them.
        ``inputs`` may also be a dict keyed by input name; a stateful model's
        state inputs and outputs are carried by the runtime, not passed."""
        inputs, outputs = self._signature.order_inputs(inputs), self._signature.order_outputs(outputs)
        return self._signature.carry_state(
            await self._execute(inputs, outputs, measure_timing, deadline, loop_timeout, None))

    async def _execute(self, inputs, outputs, measure_timing, deadline, loop_timeout,
                       sessions: dict | None) -> Result:
        deadline = check_deadline(deadline)
        arrays = self._stage_inputs(inputs)
        user_outputs = self._check_outputs(outputs) if outputs is not None else None
        try:
            return await self._run(self._steps, arrays, user_outputs, measure_timing, deadline,
                                   loop_timeout, sessions)
        except _DriverFailure as failure:
            vlog("execution", "%s failed (%s); running the whole model on %s",
                 failure.device.name, failure.error, self._runtime.cpu.name)
            self._steps = await self._cpu_steps()
            return await self._run(self._steps, arrays, user_outputs, measure_timing, deadline,
                                   loop_timeout)

    def close(self) -> None:
        """Release the prepared models in their drivers now (also done when
        the compiled model is garbage collected)."""
        self._finalizer()

    async def __aenter__(self) -> "CompiledModel":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    async def _cpu_steps(self) -> list[_Step]:
        """The whole model prepared on the CPU device (fallback after a driver failure)."""
        cpu = self._runtime.cpu
        hal = self.model.hal_model
        plan = partition.StepPlan(cpu, hal, hal.main.input_indexes, hal.main.output_indexes)
        prepared = await cpu.prepare_model(hal, self.preference, self.priority)
        self._prepared_models.append(prepared)
        return [_Step(cpu, prepared, plan, self._validated)]

    async def _run(self, steps: list[_Step], arrays: list, user_outputs, measure: bool,
                   deadline: float | None, loop_timeout: float | None,
                   sessions: dict | None = None) -> Result:
        hal = self.model.hal_model
        values = dict(zip(hal.main.input_indexes, arrays))
        single = len(steps) == 1
        on_device = in_driver = 0
        measured = measure
        for step in steps:
            session = sessions.get(id(step)) if sessions else None
            result, outs = await step.run(values, user_outputs if single else None, measure,
                                          deadline, loop_timeout, session)
            if result.status != ErrorStatus.NONE:
                error = NnrtError(result.status, result.message or "execution failed",
                                  output_shapes=[s.dimensions for s in result.output_shapes])
                if result.status == ErrorStatus.DEAD_OBJECT:
                    self._runtime._forget(step.device)
                if result.status not in _NOT_THE_DRIVERS_FAULT and self._can_fall_back(step):
                    raise _DriverFailure(step.device, error)
                raise error
            values.update(zip(step.plan.outputs, outs))
            t = result.timing
            if t.on_device == UINT64_MAX or t.in_driver == UINT64_MAX:
                measured = False
            else:
                on_device += t.on_device
                in_driver += t.in_driver
        outputs = [values[i] for i in hal.main.output_indexes]
        if user_outputs is not None and not single:
            outputs = copy_into(user_outputs, outputs)
        shapes = [tuple(np.shape(o)) for o in outputs]
        timing = None
        if measure:
            timing = ExecutionTiming(on_device if measured else None,
                                     in_driver if measured else None)
        return Result(outputs, shapes, timing)

    def _can_fall_back(self, step: _Step) -> bool:
        try:
            return self._fallback_allowed and step.device is not self._runtime.cpu
        except NnrtError:  # a runtime without a CPU device has nothing to fall back to
            return False

    def burst(self) -> "Burst":
        return Burst(self)

    async def execute_fenced(self, inputs: Sequence[Any], *, outputs=None, wait_for=(),
                             measure_timing: bool = False, deadline: float | None = None,
                             loop_timeout: float | None = None,
                             timeout_after_fence: float | None = None):
        """Start an execution that waits for every fence in ``wait_for`` and
        return ``(fence, callback)`` at once: the fence is signaled when the
        execution ends; ``callback.get_result()`` / ``await callback.result()``
        give the outputs after that (see docs/fences.md). Steps on several
        devices are chained by fences, not by waiting in the app."""
        return await execute_fenced(self, inputs, outputs, wait_for, measure_timing, deadline,
                                    loop_timeout, timeout_after_fence)

    def _stage_inputs(self, inputs: Sequence[Any]) -> list:
        if len(inputs) != len(self._inputs):
            raise invalid(f"the model takes {len(self._inputs)} inputs, got {len(inputs)}")
        staged = []
        for k, (value, operand) in enumerate(zip(inputs, self._inputs)):
            if value is None:
                staged.append(None)
            elif isinstance(value, Region):
                if operand.type.is_tensor and not value.dimensions \
                        and not operand.is_fully_specified:
                    raise invalid(f"input {k} has unknown dimensions "
                                  f"{list(operand.dimensions)}: give them with the region "
                                  f"(memory.region(offset, length, dimensions))")
                staged.append(value)
            else:
                staged.append(_as_operand_array(value, operand, f"input {k}"))
        return staged

    def _check_outputs(self, outputs: Sequence) -> list:
        if len(outputs) != len(self._outputs):
            raise invalid(f"the model has {len(self._outputs)} outputs, got {len(outputs)} "
                          f"output arrays")
        for k, (arr, operand) in enumerate(zip(outputs, self._outputs)):
            if isinstance(arr, Region):
                if not arr.memory.writable:
                    raise invalid(f"output {k}: the memory is mapped read-only")
                continue
            if not isinstance(arr, np.ndarray) or arr.dtype != operand.type.dtype \
                    or not arr.flags.c_contiguous or not arr.flags.writeable:
                raise invalid(f"output {k} must be a writable C-contiguous numpy array of "
                              f"{operand.type.dtype}, or a Region of an nnrt.Memory")
        return list(outputs)


def _release(prepared_models: list) -> None:
    for prepared in prepared_models:
        try:
            prepared.release()
        except NnrtError:  # the service is gone: nothing left to release
            pass
    prepared_models.clear()


class _DriverFailure(Exception):
    """A step failed because of its driver; the execution may be retried on the CPU."""

    def __init__(self, device: Device, error: NnrtError):
        super().__init__(str(error))
        self.device = device
        self.error = error


def _writable_bytes(arr: np.ndarray):
    return arr.reshape(-1).view(np.uint8) if arr.size else bytearray(0)


def _shaped(arr: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    count = math.prod(shape)  # () -> 1: a scalar
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
    """A burst session: a sequence of executions of one compiled model
    (a camera-frame loop).

    Opening it configures a HAL burst on each step's prepared model: for a
    driver service that is a pair of shared-memory rings, so each frame costs
    one hand-off instead of a socket round trip; an in-process driver has
    nothing to hand off and runs frames as plain executions. Frames run in
    order, one at a time. After a driver failure the compiled model falls back
    to the CPU as ``execute`` does and the burst carries on there.
    """

    def __init__(self, compiled: CompiledModel):
        self._compiled = compiled
        self._lock = anyio.Lock()
        self._sessions: dict | None = None

    async def __aenter__(self) -> "Burst":
        sessions = {}
        try:
            for step in self._compiled._steps:
                sessions[id(step)] = await step.prepared.configure_burst()
        except BaseException:
            for session in sessions.values():
                session.close()
            raise
        self._sessions = sessions
        return self

    async def __aexit__(self, *exc) -> None:
        sessions, self._sessions = self._sessions, None
        for session in (sessions or {}).values():
            session.close()

    async def execute(self, inputs: Sequence[Any], *, outputs=None, measure_timing: bool = False,
                      deadline: float | None = None, loop_timeout: float | None = None) -> Result:
        if self._sessions is None:
            raise bad_state("the burst session is not open: use 'async with compiled.burst()'")
        sig = self._compiled._signature
        async with self._lock:  # a burst runs its requests in order, one at a time
            return sig.carry_state(await self._compiled._execute(
                sig.order_inputs(inputs), sig.order_outputs(outputs), measure_timing, deadline,
                loop_timeout, self._sessions))


def run(model: Model, inputs: Sequence[Any], **kwargs) -> Result:
    """Synchronous helper for scripts: compile ``model`` on the default
    devices and execute it once. Built on the async core."""
    async def main() -> Result:
        async with Runtime() as rt:
            compiled = await rt.compile(model)
            return await compiled.execute(inputs, **kwargs)
    return anyio.run(main)
