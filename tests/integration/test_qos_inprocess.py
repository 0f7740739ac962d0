"""The QoS scheduler in front of the in-process reference device, on real
threads and the real clock. Times are compared only with the scheduler's own
timestamps (never with a wall-clock bound)."""
import asyncio

import anyio
import numpy as np
import pytest

import nnrt
from nnrt import ErrorStatus, NnrtError, OperandType as T, OperationType as Op, Priority
from nnrt.hal import Request, RequestArgument
from nnrt.drivers.reference import ReferenceDevice
from nnrt.qos import ScheduledDevice
from nnrt.model.graph import DataLocation

HIGH, MEDIUM, LOW = Priority.HIGH, Priority.MEDIUM, Priority.LOW
DIMS = (512, 512)


def chain_model(n: int, dims=DIMS) -> nnrt.Model:
    """x -> n ADDs of 1 -> y: n operations of the same cost."""
    m = nnrt.Model()
    x = m.add_operand(T.TENSOR_FLOAT32, list(dims))
    one = m.add_operand(T.TENSOR_FLOAT32, [1])
    m.set_operand_value(one, np.ones(1, np.float32))
    act = m.add_operand(T.INT32)
    m.set_operand_value(act, 0)
    cur = x
    for _ in range(n):
        out = m.add_operand(T.TENSOR_FLOAT32, list(dims))
        m.add_operation(Op.ADD, [cur, one, act], [out])
        cur = out
    m.identify_inputs_and_outputs([x], [cur])
    return m.finish()


def endless_model() -> nnrt.Model:
    """WHILE x >= x: x = x + x -- runs until its loop timeout or a cancel."""
    cond = nnrt.Model()
    x = cond.add_operand(T.TENSOR_FLOAT32, [1])
    go = cond.add_operand(T.TENSOR_BOOL8, [1])
    cond.add_operation(Op.GREATER_EQUAL, [x, x], [go])
    cond.identify_inputs_and_outputs([x], [go])
    cond.finish()
    body = nnrt.Model()
    x = body.add_operand(T.TENSOR_FLOAT32, [1])
    act = body.add_operand(T.INT32)
    body.set_operand_value(act, 0)
    y = body.add_operand(T.TENSOR_FLOAT32, [1])
    body.add_operation(Op.ADD, [x, x, act], [y])
    body.identify_inputs_and_outputs([x], [y])
    body.finish()
    m = nnrt.Model()
    x = m.add_operand(T.TENSOR_FLOAT32, [1])
    refs = [m.add_operand(T.SUBGRAPH), m.add_operand(T.SUBGRAPH)]
    m.set_operand_value_from_model(refs[0], cond)
    m.set_operand_value_from_model(refs[1], body)
    out = m.add_operand(T.TENSOR_FLOAT32, [1])
    m.add_operation(Op.WHILE, [*refs, x], [out])
    m.identify_inputs_and_outputs([x], [out])
    return m.finish()


async def wait_until(predicate, what: str):
    for _ in range(5000):
        if predicate():
            return
        await anyio.sleep(0.001)
    raise AssertionError(f"never happened: {what}")


async def test_high_starts_within_one_low_operation_under_a_low_flood():
    device = ScheduledDevice(ReferenceDevice(), slots=1)
    app = device.app
    x = np.zeros(DIMS, np.float32)
    async with nnrt.Runtime(devices=[device]) as rt:
        low = await rt.compile(chain_model(30), priority=LOW)
        high = await rt.compile(chain_model(2, (16,)), priority=HIGH)
        stop = anyio.Event()
        low_results = []

        async def flood():
            while not stop.is_set():
                low_results.append((await low.execute([x])).outputs[0])

        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(flood)
            for k in range(5):
                await wait_until(lambda: device.gate.statistics().of(app, LOW).running == 1,
                                 "a LOW execution running")
                await anyio.sleep(0.002 * (k + 1))    # land somewhere inside a LOW run
                r = await high.execute([np.full(16, k, np.float32)])
                assert r.outputs[0].tolist() == [k + 2.0] * 16
            stop.set()

    records = device.gate.finished_jobs()
    highs = [r for r in records if r.priority == HIGH]
    lows = [r for r in records if r.priority == LOW]
    assert len(highs) == 5 and lows
    longest_low_op = max(r.longest_step for r in lows)
    for h in highs:
        assert h.status == ErrorStatus.NONE
        assert h.wait <= longest_low_op, (h.wait, longest_low_op)
    stats = device.gate.statistics()
    assert stats.of(app, LOW).preempted >= 1
    assert stats.of(app, HIGH).completed == 5
    # Preempted LOW runs resumed and computed exactly what a plain run computes.
    assert all(np.array_equal(out, np.full(DIMS, 30.0, np.float32)) for out in low_results)


async def test_cancelling_the_awaiting_task_stops_the_execution_and_frees_the_slot():
    device = ScheduledDevice(ReferenceDevice(), slots=1)
    app = device.app
    async with nnrt.Runtime(devices=[device]) as rt:
        endless = await rt.compile(endless_model(), priority=LOW)
        quick = await rt.compile(chain_model(1, (4,)), priority=LOW)
        running = asyncio.create_task(endless.execute([np.ones(1, np.float32)],
                                                      loop_timeout=10.0))
        await wait_until(lambda: device.gate.statistics().of(app, LOW).running == 1, "running")
        queued = asyncio.create_task(endless.execute([np.ones(1, np.float32)]))
        await wait_until(lambda: device.gate.statistics().of(app, LOW).queued == 1, "queued")
        queued.cancel()
        running.cancel()
        for task in (queued, running):
            with pytest.raises(asyncio.CancelledError):
                await task
        # The cancellation reaches the caller only once the worker thread has
        # stopped (at its next boundary): the slot is free and the request's
        # buffers are the caller's again.
        assert device.gate.statistics().busy == 0
        stats = device.gate.statistics().of(app, LOW)
        assert (stats.cancelled, stats.running, stats.queued) == (2, 0, 0)
        r = await quick.execute([np.zeros(4, np.float32)])
        assert r.outputs[0].tolist() == [1.0] * 4


async def test_anyio_cancel_scope_cancels_a_queued_execution():
    device = ScheduledDevice(ReferenceDevice(), slots=1)
    app = device.app
    async with nnrt.Runtime(devices=[device]) as rt:
        endless = await rt.compile(endless_model(), priority=MEDIUM)
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: endless.execute([np.ones(1, np.float32)], loop_timeout=10.0))
            await wait_until(lambda: device.gate.statistics().busy == 1, "running")
            with anyio.move_on_after(0.01):
                await endless.execute([np.ones(1, np.float32)])
            assert device.gate.statistics().of(app, MEDIUM).queued == 0
            tg.cancel_scope.cancel()
        assert device.gate.statistics().busy == 0
        assert device.gate.statistics().of(app, MEDIUM).cancelled == 2


async def test_missed_deadlines_are_transient_when_busy_and_persistent_when_too_slow():
    device = ScheduledDevice(ReferenceDevice(), slots=1)
    async with nnrt.Runtime(devices=[device]) as rt:
        endless = await rt.compile(endless_model(), priority=LOW)
        chain = await rt.compile(chain_model(30), priority=LOW)
        x = np.zeros(DIMS, np.float32)
        await chain.execute([x])                       # teaches the scheduler its run time
        run_time = device.gate.finished_jobs()[-1].ran
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: endless.execute([np.ones(1, np.float32)], loop_timeout=10.0))
            await wait_until(lambda: device.gate.statistics().busy == 1, "the device busy")
            # Time enough on an idle device, but the device stays busy.
            with pytest.raises(NnrtError) as e:
                await chain.execute([x], deadline=nnrt.deadline_in(s=3 * run_time + 0.02))
            assert e.value.status == ErrorStatus.MISSED_DEADLINE_TRANSIENT
            tg.cancel_scope.cancel()
        # Less time than the model needs even alone: refused at once.
        with pytest.raises(NnrtError) as e:
            await chain.execute([x], deadline=nnrt.deadline_in(s=run_time / 2))
        assert e.value.status == ErrorStatus.MISSED_DEADLINE_PERSISTENT
        r = await chain.execute([x], deadline=nnrt.deadline_in(s=10))
        assert r.outputs[0][0, 0] == 30.0


async def test_two_apps_flooding_one_device_share_it():
    device = ScheduledDevice(ReferenceDevice(), slots=1)
    hal = chain_model(10).hal_model
    x = np.zeros(DIMS, np.float32)
    prepared = {app: await device.prepare_model(hal, priority=LOW, app=app)
                for app in ("a", "b")}
    counts = {"a": 0, "b": 0}
    stop = anyio.Event()

    async def flood(app):
        out = bytearray(x.nbytes)
        request = Request((RequestArgument(False, DataLocation(0, 0, x.nbytes)),),
                          (RequestArgument(False, DataLocation(1, 0, x.nbytes)),),
                          (x.reshape(-1).view(np.uint8), out))
        while not stop.is_set():
            result = await prepared[app].execute(request)
            assert result.status == ErrorStatus.NONE
            counts[app] += 1

    async with anyio.create_task_group() as tg:
        for app in ("a", "a", "a", "a", "b", "b"):      # a floods twice as hard
            tg.start_soon(flood, app)
        await wait_until(lambda: min(counts.values()) >= 15, "15 runs each")
        stop.set()
    stats = device.gate.statistics()
    share = stats.run_time_of("a") / (stats.run_time_of("a") + stats.run_time_of("b"))
    assert 0.4 <= share <= 0.6, share


def test_memory_limit_refuses_big_models_persistently():
    device = ScheduledDevice(ReferenceDevice(), memory_limit=1 << 20)
    with pytest.raises(NnrtError) as e:
        anyio.run(device.prepare_model, chain_model(2).hal_model)
    assert e.value.status == ErrorStatus.RESOURCE_EXHAUSTED_PERSISTENT
    anyio.run(device.prepare_model, chain_model(2, (16,)).hal_model)


def test_queue_limit_through_the_driver():
    import threading
    from nnrt.qos import Policy
    x = np.zeros(4, np.float32)
    request = Request((RequestArgument(False, DataLocation(0, 0, 16)),),
                      (RequestArgument(False, DataLocation(1, 0, 16)),),
                      (x.tobytes(), bytearray(16)))
    # An app that fails fast gets RESOURCE_EXHAUSTED_TRANSIENT at the limit.
    fail_fast = Policy.from_toml('[default]\nwhen_full = "fail"\n')
    device = ScheduledDevice(ReferenceDevice(), slots=1, queue_limit=1, policy=fail_fast)
    prepared = anyio.run(device.prepare_model, chain_model(1, (4,)).hal_model)
    job = device.gate.submit(device.app, LOW)           # holds the only slot
    waiting = device.gate.submit(device.app, LOW)       # fills the queue
    result = prepared.execute_synchronously(request)
    assert result.status == ErrorStatus.RESOURCE_EXHAUSTED_TRANSIENT
    device.gate.cancel(waiting)
    device.gate.cancel(job)
    assert prepared.execute_synchronously(request).status == ErrorStatus.NONE
    # By default it waits for a place instead, and runs once there is one.
    device = ScheduledDevice(ReferenceDevice(), slots=1, queue_limit=1)
    prepared = anyio.run(device.prepare_model, chain_model(1, (4,)).hal_model)
    job = device.gate.submit(device.app, LOW)
    waiting = device.gate.submit(device.app, LOW)
    results = []
    thread = threading.Thread(target=lambda: results.append(
        prepared.execute_synchronously(request)))
    thread.start()
    while device.gate.statistics().of(device.app, MEDIUM).queued != 1:   # held
        thread.join(0.001)
    assert not results
    device.gate.cancel(waiting)          # a place frees: it moves into the queue
    device.gate.cancel(job)              # the slot frees: it runs
    thread.join(30)
    assert [r.status for r in results] == [ErrorStatus.NONE]


def test_cancellation_on_trio():
    import trio

    async def main():
        device = ScheduledDevice(ReferenceDevice(), slots=1)
        async with nnrt.Runtime(devices=[device]) as rt:
            endless = await rt.compile(endless_model(), priority=LOW)
            with trio.move_on_after(0.05):
                await endless.execute([np.ones(1, np.float32)], loop_timeout=10.0)
            assert device.gate.statistics().busy == 0
            assert device.gate.statistics().of(device.app, LOW).cancelled == 1
            quick = await rt.compile(chain_model(1, (4,)), priority=LOW)
            return (await quick.execute([np.zeros(4, np.float32)])).outputs[0].tolist()

    assert trio.run(main) == [1.0] * 4
