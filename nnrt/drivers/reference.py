"""The reference CPU driver: every operation of the registry, run in-process
with numpy. It is what the runtime falls back to and what every other driver
is compared with."""
from __future__ import annotations

import time

import anyio
import numpy as np

from .. import __version__, ops
from ..errors import ErrorStatus, NnrtError
from ..model.graph import Model, decode_value
from ..model.types import OperandType
from ..model.validate import validate_model, validate_request
from ..qos.priority import Priority, check_deadline, check_priority
from ..vlog import vlog
from .executor import Executor
from .hal import (Capabilities, Device, DeviceType, ExecutionPreference, ExecutionResult,
                  OutputShape, PerformanceInfo, PreparedModel, Request, Timing, NO_TIMING)


class ReferenceDevice(Device):
    type = DeviceType.CPU
    feature_level = 30  # HAL 1.3 / Android 11
    version_string = f"nnrt-reference-{__version__}"

    def __init__(self, name: str = "nnrt-reference"):
        self.name = name

    def capabilities(self) -> Capabilities:
        one = PerformanceInfo(1.0, 1.0)
        return Capabilities(one, one, {t: one for t in OperandType}, one, one)

    def supported_operations(self, model: Model) -> list[bool]:
        supported = []
        for op in model.main.operations:
            try:
                opdef = ops.definition(op.type)
                opdef.validate(ops.OpView(model, None, op))
                supported.append(True)
            except NnrtError:
                supported.append(False)
        return supported

    async def prepare_model(self, model: Model, preference: ExecutionPreference = ExecutionPreference.FAST_SINGLE_ANSWER,
                            priority: Priority = Priority.MEDIUM, deadline: float | None = None,
                            cache=None) -> "ReferencePreparedModel":
        return self.prepare_model_synchronously(model, preference, priority, deadline)

    def prepare_model_synchronously(self, model: Model,
                                    preference: ExecutionPreference = ExecutionPreference.FAST_SINGLE_ANSWER,
                                    priority: Priority = Priority.MEDIUM,
                                    deadline: float | None = None) -> "ReferencePreparedModel":
        try:
            ExecutionPreference(preference)
        except ValueError:
            raise NnrtError(ErrorStatus.INVALID_ARGUMENT,
                            f"execution preference {preference!r} is not valid") from None
        check_priority(priority)
        deadline = check_deadline(deadline)
        if deadline is not None and time.monotonic() > deadline:
            raise NnrtError(ErrorStatus.MISSED_DEADLINE_PERSISTENT,
                            "the preparation deadline had passed before preparation began")
        validated = validate_model(model)
        vlog("driver", "%s: prepared a HAL %s model with %d operations", self.name,
             validated.version.name, len(model.main.operations))
        return ReferencePreparedModel(model, Executor(model, validated))


class ReferencePreparedModel(PreparedModel):
    def __init__(self, model: Model, executor: Executor):
        self.model = model
        self.executor = executor

    async def execute(self, request: Request, measure: bool = False,
                      deadline: float | None = None,
                      loop_timeout: float | None = None) -> ExecutionResult:
        return await anyio.to_thread.run_sync(self.execute_synchronously, request, measure,
                                              deadline, loop_timeout)

    def execute_synchronously(self, request: Request, measure: bool = False,
                              deadline: float | None = None,
                              loop_timeout: float | None = None) -> ExecutionResult:
        started = time.perf_counter_ns()
        try:
            deadline = check_deadline(deadline)
            validate_request(self.model, request)
            if deadline is not None and time.monotonic() > deadline:
                return ExecutionResult(ErrorStatus.MISSED_DEADLINE_TRANSIENT,
                                       message="the deadline had passed before the execution began")
            inputs = self._read_inputs(request)
            device_start = time.perf_counter_ns()
            outputs = self.executor.run(inputs, loop_timeout=loop_timeout, deadline=deadline)
            device_end = time.perf_counter_ns()
            shapes = tuple(OutputShape(tuple(np.shape(o)),
                                       np.asarray(o).nbytes <= arg.location.length)
                           for o, arg in zip(outputs, request.outputs))
            if not all(s.is_sufficient for s in shapes):
                return ExecutionResult(ErrorStatus.OUTPUT_INSUFFICIENT_SIZE, shapes,
                                       message="an output buffer is too small")
            self._write_outputs(request, outputs)
        except NnrtError as e:
            return ExecutionResult(e.status, tuple(e.output_shapes or ()), message=e.message)
        if deadline is not None and time.monotonic() > deadline:
            # Never report success for work that finished after its deadline.
            return ExecutionResult(ErrorStatus.MISSED_DEADLINE_TRANSIENT, shapes,
                                   message="the execution finished after its deadline")
        timing = NO_TIMING
        if measure:
            on_device = (device_end - device_start) // 1000
            in_driver = max((time.perf_counter_ns() - started) // 1000, on_device)
            timing = Timing(on_device, in_driver)
        return ExecutionResult(ErrorStatus.NONE, shapes, timing)

    def _read_inputs(self, request: Request) -> list:
        sub = self.model.main
        inputs = []
        for arg, index in zip(request.inputs, sub.input_indexes):
            if arg.has_no_value:
                inputs.append(None)
                continue
            operand = sub.operands[index]
            loc = arg.location
            raw = memoryview(request.pools[loc.pool_index]).cast("B")[loc.offset:loc.offset + loc.length]
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
            pool = memoryview(request.pools[loc.pool_index]).cast("B")
            if pool.readonly:
                raise NnrtError(ErrorStatus.INVALID_ARGUMENT,
                                f"output operand {index}: pool {loc.pool_index} is read-only")
            pool[loc.offset:loc.offset + arr.nbytes] = arr.reshape(-1).view(np.uint8)
