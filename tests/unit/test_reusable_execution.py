"""Reusable executions: the HAL's ``create_execution`` (a default for a
driver that binds nothing, the litert driver's binding) and the app's
``compiled.create_execution`` / ``execution.compute``, awaited and from
plain code, with the in-process drivers."""
import asyncio
import os
import threading

import anyio
import numpy as np
import pytest

import nnrt
from nnrt import ErrorStatus, NnrtError
from nnrt.drivers.reference import ReferenceDevice
from nnrt.hal import ExecutionResult, PreparedModel, Request, RequestArgument, RequestExecution
from nnrt.model.graph import DataLocation
from tests.unit.test_partition import FailsAtRun, OnlyDevice, chain_model
from tests.unit.test_runtime import add_model

X = np.arange(4, dtype=np.float32).reshape(1, 4)
MOBILENET = "generated/mobilenet_v1_0.25_128_float32"


class Counting(PreparedModel):
    """A vendor's prepared model that writes only execute_synchronously."""

    def __init__(self):
        self.requests = []

    def execute_synchronously(self, request, measure=False, deadline=None, loop_timeout=None,
                              *, checkpoint=None):
        self.requests.append((request, measure, deadline, loop_timeout))
        return ExecutionResult(ErrorStatus.NONE)


def test_a_driver_that_binds_nothing_gets_an_execution_that_calls_it_each_time():
    prepared = Counting()
    request = Request((RequestArgument(has_no_value=True),), (), ())
    execution = prepared.create_execution(request, measure=True, loop_timeout=0.5)
    assert isinstance(execution, RequestExecution)
    assert execution.execute_synchronously(deadline=123.0).status == ErrorStatus.NONE
    assert anyio.run(execution.execute).status == ErrorStatus.NONE
    assert prepared.requests == [(request, True, 123.0, 0.5), (request, True, None, 0.5)]


def _litert_prepared(shared_model):
    from nnrt.drivers.litert import LiteRTDevice, available
    if not available():
        pytest.skip("LiteRT is not installed")
    path, x, expected = shared_model(MOBILENET)
    hal = nnrt.tflite.load(path).hal_model
    return LiteRTDevice().prepare_model_synchronously(hal), hal, x, expected


def _request(hal, x, out_bytes=None):
    main = hal.main
    out = main.operands[main.output_indexes[0]]
    output = np.zeros(out.byte_size if out_bytes is None else out_bytes, np.uint8)
    request = Request((RequestArgument(False, DataLocation(0, 0, x.nbytes), ()),),
                      (RequestArgument(False, DataLocation(1, 0, output.nbytes)),),
                      (x, output))
    return request, output.view(out.type.dtype)


def test_litert_binds_once_and_reads_the_inputs_new_values_each_time(shared_model):
    prepared, hal, x, expected = _litert_prepared(shared_model)
    frame = np.zeros_like(x)
    request, output = _request(hal, frame)
    execution = prepared.create_execution(request)
    frame[...] = x          # a new frame is a write into the bound input
    result = execution.execute_synchronously()
    assert result.status == ErrorStatus.NONE
    np.testing.assert_allclose(output.reshape(expected.shape), expected, rtol=1e-5, atol=1e-5)
    first = output.copy()
    frame[...] = 0
    assert execution.execute_synchronously().status == ErrorStatus.NONE
    assert not np.array_equal(output, first)
    # The same as an unbound execution of the same request.
    again = output.copy()
    assert prepared.execute_synchronously(request).status == ErrorStatus.NONE
    assert np.array_equal(output, again)


def test_litert_refuses_a_bad_request_when_it_binds(shared_model):
    prepared, hal, x, _ = _litert_prepared(shared_model)
    request, _ = _request(hal, x[..., :1].copy())   # the input region is too short
    with pytest.raises(NnrtError) as e:
        prepared.create_execution(request)
    assert e.value.status == ErrorStatus.INVALID_ARGUMENT


def test_litert_reports_a_too_small_output_with_the_shape_it_needs(shared_model):
    prepared, hal, x, expected = _litert_prepared(shared_model)
    request, _ = _request(hal, x, out_bytes=8)
    execution = prepared.create_execution(request)
    result = execution.execute_synchronously()
    assert result.status == ErrorStatus.OUTPUT_INSUFFICIENT_SIZE
    assert result.output_shapes[0].dimensions == expected.shape
    assert not result.output_shapes[0].is_sufficient


async def test_compute_reads_the_bound_inputs_and_writes_the_bound_outputs():
    async with nnrt.Runtime(devices=[ReferenceDevice()]) as rt:
        compiled = await rt.compile(add_model())
        a, b = X.copy(), np.ones((1, 4), np.float32)
        execution = compiled.create_execution([a, b])
        assert execution.bound and execution.inputs[0] is a
        result = await execution.compute()
        assert result.outputs[0].tolist() == [[1, 2, 3, 4]]
        assert result.outputs[0] is execution.outputs[0]
        a *= 10                 # the next frame
        result = await execution.compute()
        assert result.outputs[0].tolist() == [[1, 11, 21, 31]]
        assert result.output_shapes == [(1, 4)]
        assert compiled.statistics().executions == 2


async def test_inputs_none_binds_zeroed_inputs_and_given_outputs_are_written():
    async with nnrt.Runtime(devices=[ReferenceDevice()]) as rt:
        compiled = await rt.compile(add_model())
        out = np.full((1, 4), -1, np.float32)
        execution = compiled.create_execution(outputs=[out])
        execution.inputs[1][...] = 2
        result = await execution.compute()
        assert out.tolist() == [[2, 2, 2, 2]] and result.outputs[0] is out


async def test_bound_inputs_and_outputs_may_be_regions_of_one_memory():
    # Issue 41: a region output (no .shape) crashed the bound result with AttributeError.
    async with nnrt.Runtime(devices=[ReferenceDevice()]) as rt:
        compiled = await rt.compile(add_model())
        with nnrt.Memory.create(64) as memory:
            memory.view()[:16] = X.reshape(-1).view(np.uint8)
            memory.view()[16:32] = np.ones(4, np.float32).view(np.uint8)
            execution = compiled.create_execution(
                [memory.region(0, 16), memory.region(16, 16)], outputs=[memory.region(32, 16)])
            assert execution.bound
            result = execution.compute_synchronously()
            assert result.outputs[0].tolist() == [[1, 2, 3, 4]]
            assert memory.array(np.float32, (4,), 32).tolist() == [1, 2, 3, 4]
            execution.close()


async def test_a_converted_input_is_the_executions_own_array():
    async with nnrt.Runtime(devices=[ReferenceDevice()]) as rt:
        compiled = await rt.compile(add_model())
        given = [[1.0, 1.0, 1.0, 1.0]]  # a list: converted once, into float32
        execution = compiled.create_execution([np.ones((1, 4), np.float64), given])
        assert execution.inputs[0].dtype == np.float32
        execution.inputs[0][...] = 5
        assert (await execution.compute()).outputs[0].tolist() == [[6, 6, 6, 6]]


async def test_one_computation_at_a_time_once_when_not_reusable_none_after_close():
    async with nnrt.Runtime(devices=[ReferenceDevice()]) as rt:
        compiled = await rt.compile(add_model())
        once = compiled.create_execution([X, X], reusable=False)
        await once.compute()
        with pytest.raises(NnrtError, match="not made reusable") as e:
            await once.compute()
        assert e.value.result_code is nnrt.ResultCode.BAD_STATE
        execution = compiled.create_execution([X, X])
        async with anyio.create_task_group() as tg:
            tg.start_soon(execution.compute)
            await anyio.sleep(0)     # the first computation is under way
            with pytest.raises(NnrtError, match="computing already"):
                await execution.compute()
        execution.close()
        with pytest.raises(NnrtError, match="closed"):
            await execution.compute()
        assert "closed" in repr(execution)
        compiled.close()
        with pytest.raises(NnrtError, match="compiled model is closed"):
            await compiled.create_execution([X, X]).compute()


async def test_the_inputs_are_checked_once_as_execute_checks_them():
    async with nnrt.Runtime(devices=[ReferenceDevice()]) as rt:
        compiled = await rt.compile(add_model())
        with pytest.raises(NnrtError, match="takes 2 inputs, got 1"):
            compiled.create_execution([X])
        with pytest.raises(NnrtError, match="has shape"):
            compiled.create_execution([X, np.ones((2, 4), np.float32)])


async def test_measure_timing_and_a_deadline_apply_to_each_computation():
    async with nnrt.Runtime(devices=[ReferenceDevice()]) as rt:
        compiled = await rt.compile(add_model())
        execution = compiled.create_execution([X, X], measure_timing=True)
        result = await execution.compute()
        assert result.timing.on_device is not None
        assert result.timing.in_driver >= result.timing.on_device
        with pytest.raises(NnrtError) as e:
            await execution.compute(deadline=nnrt.deadline_in(-1))
        assert e.value.status in (ErrorStatus.MISSED_DEADLINE_PERSISTENT,
                                  ErrorStatus.MISSED_DEADLINE_TRANSIENT)
        assert (await execution.compute()).outputs[0].tolist() == [[0, 2, 4, 6]]


async def test_a_model_split_across_devices_computes_through_the_general_path():
    npu = OnlyDevice("npu", {nnrt.OperationType.ADD})
    async with nnrt.Runtime(devices=[npu, ReferenceDevice()]) as rt:
        compiled = await rt.compile(chain_model())
        x = np.arange(4, dtype=np.float32).reshape(1, 2, 2, 1)
        c = np.ones((1, 2, 2, 1), np.float32)
        want = (await compiled.execute([x, c])).outputs
        execution = compiled.create_execution([x, c])
        assert not execution.bound and execution.outputs is None
        result = await execution.compute()
        assert [o.tolist() for o in result.outputs] == [w.tolist() for w in want]
        assert execution.outputs is not None


async def test_a_driver_failure_moves_the_model_to_the_cpu_and_the_execution_with_it():
    npu = FailsAtRun("npu", set(nnrt.OperationType), ErrorStatus.GENERAL_FAILURE)
    async with nnrt.Runtime(devices=[npu, ReferenceDevice()]) as rt:
        compiled = await rt.compile(add_model())
        assert [d.name for d in compiled.devices] == ["npu"]
        execution = compiled.create_execution([X, X])
        result = await execution.compute()
        assert result.outputs[0].tolist() == [[0, 2, 4, 6]]
        assert [d.name for d in compiled.devices] == ["nnrt-reference"]
        assert compiled.statistics().fallbacks == 1
        assert (await execution.compute()).outputs[0].tolist() == [[0, 2, 4, 6]]
        assert execution.bound and compiled.statistics().fallbacks == 1


async def test_without_fallback_a_driver_failure_is_the_apps_error():
    npu = FailsAtRun("npu", set(nnrt.OperationType), ErrorStatus.GENERAL_FAILURE)
    async with nnrt.Runtime(devices=[npu, ReferenceDevice()]) as rt:
        compiled = await rt.compile(add_model(), fallback=False)
        execution = compiled.create_execution([X, X])
        with pytest.raises(NnrtError, match="fell over"):
            await execution.compute()
        assert compiled.statistics().failures == 1


class WhereItRuns(ReferenceDevice):
    """Records, per execution, its thread and whether an event loop runs there."""

    def __init__(self):
        super().__init__("where")
        self.runs = []

    async def prepare_model(self, model, *args, **kwargs):
        prepared = await super().prepare_model(model, *args, **kwargs)
        runs = self.runs

        class Recording(type(prepared)):
            create_execution = PreparedModel.create_execution   # binds nothing

            def execute_synchronously(self, *a, **k):
                try:
                    asyncio.get_running_loop()
                    loop = True
                except RuntimeError:
                    loop = False
                runs.append((threading.get_ident(), loop))
                return super().execute_synchronously(*a, **k)
        prepared.__class__ = Recording
        return prepared


def test_a_sync_execution_computes_on_the_callers_thread_with_no_event_loop():
    device = WhereItRuns()
    with nnrt.SyncRuntime(devices=[device]) as rt:
        compiled = rt.compile(add_model())
        execution = compiled.create_execution([X, X])
        for _ in range(3):
            assert execution.compute().outputs[0].tolist() == [[0, 2, 4, 6]]
        stats = rt.statistics("where")
    assert device.runs == [(threading.get_ident(), False)] * 3
    # Queued and accounted by the scheduler all the same.
    assert stats.of(os.getpid(), nnrt.Priority.MEDIUM).completed == 3


def test_a_sync_execution_recovers_from_a_driver_failure_on_the_runtimes_loop():
    npu = FailsAtRun("npu", set(nnrt.OperationType), ErrorStatus.GENERAL_FAILURE)
    with nnrt.SyncRuntime(devices=[npu, ReferenceDevice()]) as rt:
        compiled = rt.compile(add_model())
        execution = compiled.create_execution([X, X])
        assert execution.compute().outputs[0].tolist() == [[0, 2, 4, 6]]
        assert execution.compute().outputs[0].tolist() == [[0, 2, 4, 6]]
        assert compiled.statistics().fallbacks == 1
        assert [d.name for d in compiled.devices] == ["nnrt-reference"]


def test_a_reusable_execution_on_litert_gives_litert_outputs(shared_model):
    from nnrt.drivers.litert import available
    if not available():
        pytest.skip("LiteRT is not installed")
    path, x, expected = shared_model(MOBILENET)
    with nnrt.SyncRuntime(discover=False) as rt:
        compiled = rt.compile(nnrt.tflite.load(path), devices=["litert"])
        execution = compiled.create_execution([x])
        assert execution.bound
        for _ in range(2):
            out = execution.compute().outputs[0]
            np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
