"""Drivers with one planted bug each, to prove the conformance kit catches
them: the reference driver with a wrong ErrorStatus, and the reference
driver with a wrong result for one operation (ADD)."""
from __future__ import annotations

import dataclasses

import numpy as np

from nnrt.drivers.reference import ReferenceDevice, ReferencePreparedModel
from nnrt.errors import ErrorStatus
from nnrt.hal import DeviceType, ExecutionResult, PreparedModel
from nnrt.model.types import OperationType


class WrongStatusPrepared(ReferencePreparedModel):
    """Answers GENERAL_FAILURE where the HAL requires INVALID_ARGUMENT or
    OUTPUT_INSUFFICIENT_SIZE (a lazy error path)."""

    # It binds nothing: each computation is the execute_synchronously below.
    create_execution = PreparedModel.create_execution

    def execute_synchronously(self, request, measure=False, deadline=None, loop_timeout=None, *,
                              checkpoint=None) -> ExecutionResult:
        result = super().execute_synchronously(request, measure, deadline, loop_timeout,
                                               checkpoint=checkpoint)
        if result.status in (ErrorStatus.INVALID_ARGUMENT, ErrorStatus.OUTPUT_INSUFFICIENT_SIZE):
            return ExecutionResult(ErrorStatus.GENERAL_FAILURE, (), result.timing,
                                   "something went wrong")
        return result


class WrongStatusDevice(ReferenceDevice):
    type = DeviceType.ACCELERATOR

    def __init__(self, name: str = "planted-status"):
        super().__init__(name)

    async def prepare_model(self, model, *args, **kwargs):
        prepared = await super().prepare_model(model, *args, **kwargs)
        return WrongStatusPrepared(prepared.model, prepared.executor)


def _off_by_one(kernel):
    def wrong(call):
        results = list(kernel(call))
        out = np.array(results[0], copy=True)
        if out.size:  # quant8: off by 5, beyond the CTS's off-by-one
            out.reshape(-1)[0] += 1 if out.dtype.kind == "f" else 5
        results[0] = out
        return results
    return wrong


class WrongAddDevice(ReferenceDevice):
    """ADD's first output element is off by one; every other op is right."""

    type = DeviceType.ACCELERATOR

    def __init__(self, name: str = "planted-add"):
        super().__init__(name)

    async def prepare_model(self, model, *args, **kwargs):
        prepared = await super().prepare_model(model, *args, **kwargs)
        for plan in prepared.executor.plans.values():
            plan.steps = tuple(dataclasses.replace(s, kernel=_off_by_one(s.kernel))
                               if s.type == OperationType.ADD else s for s in plan.steps)
        return prepared
