"""Fenced executions on an out-of-process driver service: pipelines chained
by fences, app-created gates, error propagation, timings; and the service's
EXECUTE_FENCED calls seen through the HAL proxy.

The service is a real `nnrt driver serve` process (spawned by the runtime);
fences cross the socket as SCM_RIGHTS. Orderings are asserted through an
event log and fence states, never through wall-clock times."""
import os

import numpy as np
import pytest

import nnrt
from nnrt import ErrorStatus, FenceState, NnrtError, OperandType as T, OperationType as Op
from nnrt.hal import Request, RequestArgument
from nnrt.drivers.reference import ReferenceDevice
from nnrt.service.client import ServiceDevice, ServicePreparedModel
from nnrt.memory import Memory
from nnrt.model.graph import DataLocation
from nnrt.runtime.fenced import execute_fenced
from tests.conftest import start_service, stop

SHAPE = (1, 8)


def affine_model(scale: float, offset: float) -> nnrt.Model:
    """y = x * scale + offset: one tiny stage of a pipeline."""
    m = nnrt.Model()
    x = m.add_operand(T.TENSOR_FLOAT32, list(SHAPE))
    s = m.add_operand(T.TENSOR_FLOAT32, [1])
    m.set_operand_value(s, np.array([scale], np.float32))
    o = m.add_operand(T.TENSOR_FLOAT32, [1])
    m.set_operand_value(o, np.array([offset], np.float32))
    zero = m.add_operand(T.INT32)
    m.set_operand_value(zero, 0)
    t = m.add_operand(T.TENSOR_FLOAT32, list(SHAPE))
    m.add_operation(Op.MUL, [x, s, zero], [t])
    y = m.add_operand(T.TENSOR_FLOAT32, list(SHAPE))
    m.add_operation(Op.ADD, [t, o, zero], [y])
    m.identify_inputs_and_outputs([x], [y])
    return m.finish()


STAGES = [(2.0, 1.0), (0.5, -3.0), (3.0, 0.25)]
X = np.arange(8, dtype=np.float32).reshape(SHAPE)


@pytest.fixture(scope="module")
def service_path(tmp_path_factory):
    """One `nnrt driver serve` process for the module (spawning costs ~0.7 s)."""
    path = str(tmp_path_factory.mktemp("fenced") / "svc.sock")
    proc = start_service(path, "sample-float-fast", "svc")
    yield path
    stop(proc)


@pytest.fixture
async def service_rt(service_path):
    """A runtime with its own connection to the module's service."""
    svc = await ServiceDevice.connect(service_path)
    try:
        async with nnrt.Runtime(devices=[svc, ReferenceDevice()]) as rt:
            yield rt
    finally:
        svc.close()


async def compile_stages(rt):
    stages = [await rt.compile(affine_model(*p), devices=["svc"]) for p in STAGES]
    for c in stages:
        assert isinstance(c._steps[0].prepared, ServicePreparedModel)
    return stages


async def test_three_stage_pipeline_matches_awaited_runs_and_app_awaits_only_the_last(service_rt):
    stages = await compile_stages(service_rt)
    expected = X
    for c in stages:  # the reference: three awaited executions
        expected = (await c.execute([expected])).outputs[0]
    buffers = [np.zeros(SHAPE, np.float32) for _ in range(2)]
    f1, cb1 = await execute_fenced(stages[0], [X], outputs=[buffers[0]])
    f2, cb2 = await execute_fenced(stages[1], [buffers[0]], outputs=[buffers[1]], wait_for=[f1])
    f3, cb3 = await execute_fenced(stages[2], [buffers[1]], wait_for=[f2], measure_timing=True)
    await f3.wait_signaled()  # the only wait of the app
    # The last fence implies the earlier ones: each stage waited for its predecessor.
    assert f1.poll() is FenceState.SIGNALED and f2.poll() is FenceState.SIGNALED
    assert np.array_equal(cb3.get_result().outputs[0], expected)
    assert np.array_equal(buffers[1], cb2.get_result().outputs[0])
    for cb in (cb1, cb2, cb3):
        assert cb.get_execution_info()[0] is ErrorStatus.NONE
    for f in (f1, f2, f3):
        f.close()


async def test_an_app_fence_gates_the_execution_until_the_app_signals_it(service_rt):
    compiled = (await compile_stages(service_rt))[0]
    log = []
    x = np.zeros(SHAPE, np.float32)  # the "camera frame", written before the gate opens
    gate = nnrt.SyncFence.create()
    fence, cb = await execute_fenced(compiled, [x], wait_for=[gate])
    # The service holds the execution: nothing settles while the gate is closed,
    # however long we give it (a round trip to the service and back).
    await compiled.execute([X])
    log.append(("checked", fence.poll(), cb.done))
    with pytest.raises(NnrtError) as e:
        cb.get_result()
    assert e.value.result_code == nnrt.ResultCode.BAD_STATE
    x[...] = X  # the producer finishes the frame, then opens the gate
    log.append(("signal",))
    gate.signal()
    result = await cb.result()
    log.append(("done", fence.poll()))
    assert log == [("checked", FenceState.ACTIVE, False), ("signal",),
                   ("done", FenceState.SIGNALED)]
    assert np.array_equal(result.outputs[0], X * 2 + 1)  # read after the gate, not at the call
    gate.close()
    fence.close()


async def test_an_input_fence_signaled_with_an_error_fails_the_chain_without_running_it(
        service_rt):
    stages = await compile_stages(service_rt)
    gate = nnrt.SyncFence.create()
    buffers = [np.full(SHAPE, 7, np.float32) for _ in range(2)]
    f1, cb1 = await execute_fenced(stages[0], [X], outputs=[buffers[0]], wait_for=[gate])
    f2, cb2 = await execute_fenced(stages[1], [buffers[0]], outputs=[buffers[1]], wait_for=[f1])
    f3, cb3 = await execute_fenced(stages[2], [buffers[1]], wait_for=[f2])
    gate.signal_error(ErrorStatus.DEVICE_UNAVAILABLE)
    with pytest.raises(NnrtError) as e:
        await f3.wait_signaled()
    assert e.value.status is ErrorStatus.DEVICE_UNAVAILABLE
    for f, cb in ((f1, cb1), (f2, cb2), (f3, cb3)):
        assert f.poll() is FenceState.ERROR and f.status is ErrorStatus.DEVICE_UNAVAILABLE
        status, launched, fenced = cb.get_execution_info()
        assert status is ErrorStatus.DEVICE_UNAVAILABLE
        assert launched == fenced == nnrt.ExecutionTiming(None, None)
        with pytest.raises(NnrtError) as e:
            cb.get_result()
        assert e.value.status is ErrorStatus.DEVICE_UNAVAILABLE
    assert np.all(buffers[0] == 7) and np.all(buffers[1] == 7)  # never written
    for f in (gate, f1, f2, f3):
        f.close()


async def test_the_service_does_not_run_stages_behind_a_failed_fence(service_rt):
    """HAL level, where the service writes straight into shared memory: after
    an error on the first input fence, no stage's output memory was touched."""
    stages = await compile_stages(service_rt)
    memories = [Memory.create(32) for _ in range(4)]
    for m in memories:
        m.array(np.float32, SHAPE)[...] = 7
    gate = nnrt.SyncFence.create()
    prev, fences, callbacks = [gate], [], []
    for k, c in enumerate(stages):
        fence, cb = await c._steps[0].prepared.execute_fenced(
            None, _request(memories[k], memories[k + 1]), prev)
        fences.append(fence)
        callbacks.append(cb)
        prev = [fence]
    gate.signal_error(ErrorStatus.GENERAL_FAILURE)
    with pytest.raises(NnrtError):
        await fences[-1].wait_signaled()
    for cb in callbacks:
        status, _launched, _fenced = await cb.wait_execution_info()
        assert status is ErrorStatus.GENERAL_FAILURE
        assert "input fence" in cb.get_result().message
    for m in memories[1:]:
        assert np.all(m.array(np.float32, SHAPE) == 7)
    for f in (gate, *fences):
        f.close()
    for m in memories:
        m.close()


def _request(src: Memory, dst: Memory) -> Request:
    return Request((RequestArgument(False, DataLocation(0, 0, 32), SHAPE),),
                   (RequestArgument(False, DataLocation(1, 0, 32)),), (src, dst))


async def test_fenced_timings_are_ordered(service_rt):
    stages = await compile_stages(service_rt)
    gate = nnrt.SyncFence.create()
    f1, cb1 = await execute_fenced(stages[0], [X], wait_for=[gate], measure_timing=True)
    await stages[1].execute([X])  # time passes between the call and the gate
    gate.signal()
    r = await cb1.result()
    status, launched, fenced = cb1.get_execution_info()
    assert status is ErrorStatus.NONE
    for t in (launched, fenced, r.timing):
        assert t.on_device is not None and t.in_driver is not None
        assert t.in_driver >= t.on_device
    assert fenced.in_driver <= launched.in_driver
    gate.close()
    f1.close()


async def test_the_service_proxy_passes_fences_both_ways(service_rt):
    """HAL level: ServicePreparedModel.execute_fenced with Memory pools; the
    returned fence is the service's eventfd, the info comes after it."""
    compiled = (await compile_stages(service_rt))[0]
    prepared = compiled._steps[0].prepared
    src, dst = Memory.create(32), Memory.create(32)
    src.array(np.float32, SHAPE)[...] = X
    request = _request(src, dst)
    gate = nnrt.SyncFence.create()
    fence, cb = await prepared.execute_fenced(None, request, [gate], measure=True)
    with pytest.raises(NnrtError):
        fence.signal()  # the service signals it, not the caller
    assert fence.poll() is FenceState.ACTIVE
    with pytest.raises(NnrtError) as e:
        cb.get_execution_info()
    assert e.value.result_code == nnrt.ResultCode.BAD_STATE
    gate.signal()
    await fence.wait_signaled()
    status, launched, fenced = cb.get_execution_info()
    assert status is ErrorStatus.NONE and fenced.in_driver <= launched.in_driver
    assert cb.get_result().output_shapes[0].dimensions == SHAPE
    assert np.array_equal(dst.array(np.float32, SHAPE), X * 2 + 1)
    # Numpy pools cannot be used: the service works on them after the call.
    bad = Request(request.inputs, request.outputs, (bytearray(32), bytearray(32)))
    with pytest.raises(NnrtError) as e:
        await prepared.execute_fenced(None, bad, [])
    assert e.value.status is ErrorStatus.INVALID_ARGUMENT
    # A wait_for fd that is not an eventfd is refused by the service, which keeps serving.
    for f in (gate, fence):
        f.close()
    src.close()
    dst.close()


async def test_a_wait_for_fd_that_is_not_an_eventfd_is_refused_and_the_service_keeps_serving(
        service_rt):
    compiled = (await compile_stages(service_rt))[0]
    prepared = compiled._steps[0].prepared
    src, dst = Memory.create(32), Memory.create(32)
    r, w = os.pipe()
    try:
        fake = nnrt.SyncFence.__new__(nnrt.SyncFence)  # a handle around a pipe, as a bad peer would send
        nnrt.SyncFence.__init__(fake, r, can_signal=False)
        fence, cb = await prepared.execute_fenced(None, _request(src, dst), [fake])
        fake._fd = None  # the pipe end is closed below, not by the handle
        # The call returned at once; the refusal comes through the fence and the callback.
        with pytest.raises(NnrtError) as e:
            await fence.wait_signaled()
        assert e.value.status is ErrorStatus.INVALID_ARGUMENT
        status, _, _ = await cb.wait_execution_info()
        assert status is ErrorStatus.INVALID_ARGUMENT
        assert "wait_for fence 0" in cb.get_result().message
        fence.close()
        src.array(np.float32, SHAPE)[...] = X
        fence, cb = await prepared.execute_fenced(None, _request(src, dst), [])
        await fence.wait_signaled()
        assert np.array_equal(dst.array(np.float32, SHAPE), X * 2 + 1)
        fence.close()
    finally:
        os.close(r)
        os.close(w)
        src.close()
        dst.close()


async def test_a_service_dying_settles_its_pending_fences_with_an_error(tmp_path):
    path = str(tmp_path / "doomed.sock")
    proc = start_service(path, "sample-float-fast", "doomed")
    try:
        svc = await ServiceDevice.connect(path)
        async with nnrt.Runtime(devices=[svc, ReferenceDevice()]) as rt:
            compiled = await rt.compile(affine_model(2, 1), devices=["doomed"])
            gate = nnrt.SyncFence.create()
            fence, cb = await execute_fenced(compiled, [X], wait_for=[gate])
            proc.kill()
            proc.wait(timeout=10)
            gate.signal()  # the stage behind it can no longer run anywhere
            with pytest.raises(NnrtError) as e:
                await cb.result()
            assert e.value.status in (ErrorStatus.DEAD_OBJECT, ErrorStatus.GENERAL_FAILURE)
            assert fence.poll() is FenceState.ERROR
            gate.close()
            fence.close()
        svc.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def split_model() -> nnrt.Model:
    """x*2+1 -> tanh -> *3+0.5: MUL/ADD go to sample-partial, TANH does not."""
    m = nnrt.Model()
    zero = m.add_operand(T.INT32)
    m.set_operand_value(zero, 0)

    def const(v):
        c = m.add_operand(T.TENSOR_FLOAT32, [1])
        m.set_operand_value(c, np.array([v], np.float32))
        return c

    def op(kind, *inputs):
        out = m.add_operand(T.TENSOR_FLOAT32, list(SHAPE))
        m.add_operation(kind, list(inputs), [out])
        return out

    x = m.add_operand(T.TENSOR_FLOAT32, list(SHAPE))
    t = op(Op.TANH, op(Op.ADD, op(Op.MUL, x, const(2.0), zero), const(1.0), zero))
    y = op(Op.ADD, op(Op.MUL, t, const(3.0), zero), const(0.5), zero)
    m.identify_inputs_and_outputs([x], [y])
    return m.finish()


async def test_a_model_split_over_two_services_is_chained_by_fences(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.delenv("NNRT_DRIVERS", raising=False)
    async with nnrt.Runtime(spawn=["sample-partial", "sample-float-fast"]) as rt:
        compiled = await rt.compile(split_model(),
                                    devices=["sample-partial", "sample-float-fast"])
        assert [d.name for d in compiled.devices] == ["sample-partial", "sample-float-fast",
                                                      "sample-partial"]
        expected = (await compiled.execute([X])).outputs[0]
        gate = nnrt.SyncFence.create()
        fence, cb = await execute_fenced(compiled, [X], wait_for=[gate], measure_timing=True)
        gate.signal()
        await fence.wait_signaled()  # the steps waited on each other inside the services
        r = cb.get_result()
        assert np.array_equal(r.outputs[0], expected)
        assert np.allclose(expected, np.tanh(X * 2 + 1) * 3 + 0.5, atol=1e-6)
        status, launched, fenced = cb.get_execution_info()
        assert status is ErrorStatus.NONE and fenced.in_driver <= launched.in_driver
        assert r.timing.in_driver >= r.timing.on_device
        gate.close()
        fence.close()
