"""A result that reaches the app after its deadline is a miss, whatever the
driver said (issue 40: a service finished frames in time and their results
came back late, as successes). The double here is a device with a scheduler
of its own (as a service's proxy is) whose results arrive late: the
runtime's own check is what refuses them."""
import time

import anyio
import numpy as np
import pytest

import nnrt
from nnrt import ErrorStatus
from nnrt.drivers.reference import ReferenceDevice
from nnrt.hal import PreparedModel, Scheduling

from ..integration.test_service import public_add_model

X = np.ones((1, 4), np.float32)
LATE = 0.05    # seconds the double's results take to "come back"


class _Late(PreparedModel):
    """The driver's result, handed over ``LATE`` seconds after it finished."""

    def __init__(self, prepared):
        self.prepared = prepared

    def execute_synchronously(self, request, measure=False, deadline=None, loop_timeout=None,
                              *, checkpoint=None):
        result = self.prepared.execute_synchronously(request, measure, None, loop_timeout)
        time.sleep(LATE)
        return result

    async def execute(self, request, measure=False, deadline=None, loop_timeout=None):
        result = self.prepared.execute_synchronously(request, measure, None, loop_timeout)
        await anyio.sleep(LATE)
        return result


class LateDevice(ReferenceDevice):
    """Fronted (the runtime adds no scheduler that would see the lateness)."""

    def scheduling(self) -> Scheduling:
        return Scheduling(fronted=True)

    async def prepare_model(self, model, *args, **kwargs):
        return _Late(await super().prepare_model(model, *args, **kwargs))


@pytest.mark.parametrize("how", ["execute", "burst", "compute", "compute_synchronously"])
async def test_a_result_after_its_deadline_is_a_missed_deadline(how):
    async with nnrt.Runtime(devices=[LateDevice("late")]) as rt:
        compiled = await rt.compile(public_add_model())
        deadline = nnrt.deadline_in(ms=LATE * 1000 / 5)
        with pytest.raises(nnrt.NnrtError) as e:
            if how == "execute":
                await compiled.execute([X, X], deadline=deadline)
            elif how == "burst":
                async with compiled.burst() as burst:
                    await burst.execute([X, X], deadline=deadline)
            else:
                execution = compiled.create_execution([X, X])
                if how == "compute":
                    await execution.compute(deadline=deadline)
                else:   # on this thread: a bound execution needs no loop
                    execution.compute_synchronously(deadline)
        assert e.value.status == ErrorStatus.MISSED_DEADLINE_TRANSIENT
        assert "after the deadline" in e.value.message
        # Without a deadline, or with room, the same result is a success.
        assert (await compiled.execute([X, X])).outputs[0].tolist() == [[2.0] * 4]
        result = await compiled.execute([X, X], deadline=nnrt.deadline_in(s=5))
        assert result.outputs[0].tolist() == [[2.0] * 4]
        assert compiled.statistics().failures == 1
