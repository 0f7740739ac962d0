"""Test-double drivers for the stress test: the reference driver, except
that after two good executions it crashes the process, hangs, or returns a
wrong result. ``nnrt bench --stress --driver tests.integration.bench_doubles:crashing``."""
import os
import signal
import time

import numpy as np

from nnrt.drivers.reference import ReferenceDevice, ReferencePreparedModel
from nnrt.hal import PreparedModel
from nnrt.hal.request import write_outputs

GOOD_RUNS = 2


class _Misbehaving(ReferencePreparedModel):
    # It binds nothing: each computation is the execute_synchronously below.
    create_execution = PreparedModel.create_execution

    def __init__(self, prepared: ReferencePreparedModel, fault: str):
        super().__init__(prepared.model, prepared.executor)
        self.fault = fault
        self.runs = 0

    def execute_synchronously(self, request, measure=False, deadline=None, loop_timeout=None, *,
                              checkpoint=None):
        self.runs += 1
        if self.runs > GOOD_RUNS:
            if self.fault == "crash":
                os.kill(os.getpid(), signal.SIGKILL)
            if self.fault == "hang":
                time.sleep(3600)
        result = super().execute_synchronously(request, measure, deadline, loop_timeout,
                                               checkpoint=checkpoint)
        if self.fault == "wrong" and self.runs > GOOD_RUNS:
            operands = self.model.main.operands
            wrong = [np.full(s.dimensions, 3, operands[i].type.dtype)
                     for s, i in zip(result.output_shapes, self.model.main.output_indexes)]
            write_outputs(self.model, request, wrong)
        return result


class _Device(ReferenceDevice):
    fault = ""

    async def prepare_model(self, model, *args, **kwargs):
        if self.fault == "hang at start":
            time.sleep(3600)     # blocks the child's loop: compiling never ends
        return _Misbehaving(await super().prepare_model(model, *args, **kwargs), self.fault)


def _make(fault: str):
    device = _Device(f"{fault}-double")
    device.fault = fault
    return device


def crashing():
    return _make("crash")


def hanging():
    return _make("hang")


def hanging_at_start():
    return _make("hang at start")


def wrong():
    return _make("wrong")


def good():
    return _make("none")
