"""Fenced execution in-process: the HAL default ``PreparedModel.execute_fenced``
and ``nnrt.runtime.fenced.execute_fenced`` chaining a partitioned model's
steps by fences. tests/integration covers driver services."""
import contextlib

import anyio
import numpy as np
import pytest

import nnrt
from nnrt import ErrorStatus, FenceState, NnrtError, OperationType as Op, ResultCode
from nnrt.hal import PreparedModel, Request, RequestArgument
from nnrt.drivers.reference import ReferenceDevice
from nnrt.memory import Memory
from nnrt.model.graph import DataLocation
from nnrt.hal.types import deadline_in
from nnrt.runtime.fenced import execute_fenced

from .test_partition import C, EXPECTED_T1, EXPECTED_Y, X, FailsAtRun, OnlyDevice, chain_model
from .test_runtime import add_model


class CountingDevice(OnlyDevice):
    """Counts the executions that reached the driver."""

    def __init__(self, name, ops):
        super().__init__(name, ops)
        self.executions = 0

    async def prepare_model(self, model, *args, **kwargs):
        prepared = await super().prepare_model(model, *args, **kwargs)
        device = self

        class Counting(type(prepared)):
            create_execution = PreparedModel.create_execution   # binds nothing

            def execute_synchronously(self, *a, **k):
                device.executions += 1
                return super().execute_synchronously(*a, **k)
        prepared.__class__ = Counting
        return prepared


@contextlib.asynccontextmanager
async def split_runtime(adder):
    async with nnrt.Runtime(devices=[adder, ReferenceDevice()]) as rt:
        compiled = await rt.compile(chain_model())
        assert len(compiled.devices) == 4
        yield rt, compiled


async def test_hal_default_execute_fenced_waits_then_runs_through_execute():
    device = CountingDevice("count", {Op.ADD})
    prepared = await device.prepare_model(add_model().hal_model)
    a, b, out = (np.full(4, v, np.float32) for v in (1, 2, 0))
    request = Request(tuple(RequestArgument(False, DataLocation(k, 0, 16)) for k in range(2)),
                      (RequestArgument(False, DataLocation(2, 0, 16)),),
                      (a.view(np.uint8), b.view(np.uint8), out.view(np.uint8)))
    gate = nnrt.SyncFence.create()
    async with anyio.create_task_group() as tg:
        fence, cb = await prepared.execute_fenced(tg, request, [gate], measure=True)
        await anyio.sleep(0.01)
        assert device.executions == 0 and fence.poll() is FenceState.ACTIVE
        gate.signal()
        await fence.wait_signaled()
    assert device.executions == 1
    status, launched, fenced = cb.get_execution_info()
    assert status is ErrorStatus.NONE and fenced.in_driver <= launched.in_driver
    assert out.tolist() == [3.0] * 4
    gate.close()
    fence.close()


async def test_a_split_model_chained_by_fences_matches_execute():
    adder = CountingDevice("adder", {Op.ADD})
    async with split_runtime(adder) as (rt, compiled):
        gate = nnrt.SyncFence.create()
        fence, cb = await execute_fenced(compiled, [X, C], wait_for=[gate], measure_timing=True)
        await anyio.sleep(0.01)
        assert fence.poll() is FenceState.ACTIVE and adder.executions == 0
        for get in (cb.get_result, cb.get_execution_info):
            with pytest.raises(NnrtError) as e:
                get()  # nothing before the fence: outputs the runtime owns stay hidden
            assert e.value.result_code == ResultCode.BAD_STATE
        gate.signal()
        r = await cb.result()
        assert adder.executions == 2 and fence.poll() is FenceState.SIGNALED
        assert np.array_equal(r.outputs[0], EXPECTED_Y) and np.array_equal(r.outputs[1], EXPECTED_T1)
        assert r.output_shapes == [(1, 2, 2, 1), (1, 2, 2, 1)]
        status, launched, fenced = cb.get_execution_info()
        assert status is ErrorStatus.NONE
        assert fenced.in_driver <= launched.in_driver
        assert launched.in_driver >= launched.on_device and fenced.in_driver >= fenced.on_device
        assert r.timing.in_driver >= r.timing.on_device
        gate.close()
        fence.close()


async def test_app_output_arrays_hold_the_results_once_the_fence_is_signaled():
    async with split_runtime(OnlyDevice("adder", {Op.ADD})) as (rt, compiled):
        outs = [np.zeros((1, 2, 2, 1), np.float32) for _ in range(2)]
        fence, cb = await execute_fenced(compiled, [X, C], outputs=outs)
        await fence.wait_signaled()  # no call into the callback: the fence alone says "ready"
        assert np.array_equal(outs[0], EXPECTED_Y) and np.array_equal(outs[1], EXPECTED_T1)
        fence.close()


async def test_a_step_of_unknown_output_shape_is_awaited_and_the_rest_still_chains():
    async with split_runtime(OnlyDevice("adder", {Op.ADD})) as (rt, compiled):
        compiled._steps[2].output_guess = [(0, 0, 0, 0)]  # as after compiling a dynamic shape
        fence, cb = await execute_fenced(compiled, [X, C])
        r = await cb.result()
        assert np.array_equal(r.outputs[0], EXPECTED_Y)
        assert compiled._steps[2].output_guess == [(1, 2, 2, 1)]  # learned for the next time
        fence.close()


async def test_an_error_on_the_app_fence_fails_every_step_without_running_any():
    adder = CountingDevice("adder", {Op.ADD})
    async with split_runtime(adder) as (rt, compiled):
        gate = nnrt.SyncFence.create()
        fence, cb = await execute_fenced(compiled, [X, C], wait_for=[gate], measure_timing=True)
        gate.signal_error(ErrorStatus.RESOURCE_EXHAUSTED_TRANSIENT)
        with pytest.raises(NnrtError) as e:
            await cb.result()
        assert e.value.status is ErrorStatus.RESOURCE_EXHAUSTED_TRANSIENT
        assert fence.poll() is FenceState.ERROR
        assert fence.status is ErrorStatus.RESOURCE_EXHAUSTED_TRANSIENT
        assert cb.get_execution_info() == (ErrorStatus.RESOURCE_EXHAUSTED_TRANSIENT,
                                           nnrt.ExecutionTiming(None, None),
                                           nnrt.ExecutionTiming(None, None))
        assert adder.executions == 0
        gate.close()
        fence.close()


async def test_a_failing_step_fails_the_chain_with_its_status():
    failing = FailsAtRun("adder", {Op.ADD}, ErrorStatus.DEVICE_UNAVAILABLE)
    async with split_runtime(failing) as (rt, compiled):
        fence, cb = await execute_fenced(compiled, [X, C])
        with pytest.raises(NnrtError) as e:
            await cb.result()
        assert e.value.status is ErrorStatus.DEVICE_UNAVAILABLE
        assert "fell over" in e.value.message
        assert fence.poll() is FenceState.ERROR
        fence.close()


async def test_a_deadline_before_the_fence_is_signaled_misses():
    async with split_runtime(OnlyDevice("adder", {Op.ADD})) as (rt, compiled):
        gate = nnrt.SyncFence.create()
        fence, cb = await execute_fenced(compiled, [X, C], wait_for=[gate],
                                         deadline=deadline_in(ms=20))
        with pytest.raises(NnrtError) as e:
            await cb.result()
        assert e.value.status is ErrorStatus.MISSED_DEADLINE_TRANSIENT
        gate.close()
        fence.close()


@pytest.mark.parametrize("kwargs", [
    {"wait_for": [object()]},
    {"wait_for": 3},
    {"timeout_after_fence": -1},
    {"deadline": "soon"},
    {"outputs": [np.zeros(4, np.int32)]},
])
async def test_bad_arguments_are_refused_before_anything_starts(kwargs):
    async with nnrt.Runtime(discover=False) as rt:
        compiled = await rt.compile(add_model())
        with pytest.raises(NnrtError) as e:
            await execute_fenced(compiled, [np.ones((1, 4)), np.ones((1, 4))], **kwargs)
        assert e.value.status is ErrorStatus.INVALID_ARGUMENT
        with pytest.raises(NnrtError):
            await execute_fenced(compiled, [np.ones((1, 4))])  # one input short


def test_works_from_a_trio_app():
    async def main():
        async with nnrt.Runtime(discover=False) as rt:
            compiled = await rt.compile(add_model())
            gate = nnrt.SyncFence.create()
            fence, cb = await execute_fenced(compiled, [np.ones((1, 4)), np.ones((1, 4))],
                                             wait_for=[gate])
            gate.signal()
            r = await cb.result()
            gate.close()
            fence.close()
            return r.outputs[0].tolist()
    assert anyio.run(main, backend="trio") == [[2.0] * 4]


async def test_memory_regions_are_used_in_place_and_read_after_the_gate():
    async with nnrt.Runtime(discover=False) as rt:
        compiled = await rt.compile(add_model())
        mem = Memory.create(48)
        a, b, out = (mem.region(16 * k, 16) for k in range(3))
        gate = nnrt.SyncFence.create()
        fence, cb = await execute_fenced(compiled, [a, b], outputs=[out], wait_for=[gate])
        mem.array(np.float32, 8)[...] = np.arange(8)  # written before the gate opens
        gate.signal()
        await fence.wait_signaled()
        assert mem.array(np.float32, 4, 32).tolist() == [4.0, 6.0, 8.0, 10.0]
        assert cb.get_result().outputs[0].tolist() == [[4.0, 6.0, 8.0, 10.0]]
        for f in (gate, fence):
            f.close()
        mem.close()
