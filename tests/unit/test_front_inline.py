"""Inline runs of the QoS front (nnrt/qos/front.py): once an execution's
runs are known to be short, an ``execute`` whose job gets its slot at once
runs on the awaiting task's own thread -- no worker thread -- and everything
else (a one-shot execution too) goes through a worker thread. The tests look at which
thread ran the driver and at the scheduler's records, never at times."""
import threading
import time

import anyio
import numpy as np
import pytest

from nnrt import ErrorStatus, NnrtError, Priority
from nnrt.drivers.reference import ReferenceDevice
from nnrt.hal import ExecutionResult, PreparedModel, Request, RequestArgument
from nnrt.model.graph import DataLocation
from nnrt.qos import ScheduledDevice
from nnrt.qos.front import INLINE_AFTER, ScheduledPreparedModel

TIMEOUT = 10.0
HIGH, LOW = Priority.HIGH, Priority.LOW
# The request every execution binds.
REQUEST = Request((RequestArgument(has_no_value=True),), (), ())


class Recording(PreparedModel):
    """A driver's prepared model that records the thread of each run and
    whether it got a checkpoint; ``during`` runs inside a run."""

    def __init__(self, busy_ns: int = 0):
        self.threads: list[int] = []
        self.checkpoints: list[bool] = []
        self.busy_ns = busy_ns
        self.during = None

    def execute_synchronously(self, request, measure=False, deadline=None, loop_timeout=None,
                              *, checkpoint=None):
        self.threads.append(threading.get_ident())
        self.checkpoints.append(checkpoint is not None)
        if checkpoint is not None:
            checkpoint()
        if self.during is not None:
            self.during()
        end = time.perf_counter_ns() + self.busy_ns   # a run that is long, on purpose
        while time.perf_counter_ns() < end:
            pass
        return ExecutionResult(ErrorStatus.NONE)

    def release(self):
        pass


# A bound no run of Recording reaches however loaded the machine is (the
# default is half a millisecond of real time): these tests must not depend
# on how fast a thread gets a core.
GENEROUS = 60.0


def front_of(model: Recording, inline_bound=GENEROUS) -> tuple[ScheduledDevice,
                                                                ScheduledPreparedModel]:
    device = ScheduledDevice(ReferenceDevice(), slots=1, inline_bound=inline_bound)
    return device, ScheduledPreparedModel(model, device.gate, LOW, device.app,
                                          inline_bound=inline_bound)


async def teach(execution) -> None:
    """Run it as often as the front needs to know its runs are short."""
    for _ in range(INLINE_AFTER):
        await execution.execute()


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_short_runs_that_get_a_free_slot_run_on_the_loop_thread(backend):
    model = Recording()
    device, prepared = front_of(model)
    execution = prepared.create_execution(REQUEST)

    async def main():
        for _ in range(6):
            result = await execution.execute()
            assert result.status == ErrorStatus.NONE
        return threading.get_ident()

    loop_thread = anyio.run(main, backend=backend)
    # The first runs teach the front that the model is short: worker threads.
    assert all(t != loop_thread for t in model.threads[:INLINE_AFTER])
    assert model.threads[INLINE_AFTER:] == [loop_thread] * (6 - INLINE_AFTER)
    # An inline run has no boundaries: the loop's thread must never park.
    assert model.checkpoints[INLINE_AFTER:] == [False] * (6 - INLINE_AFTER)
    # The scheduler accounted every one of them.
    stats = device.gate.statistics().of(device.app, LOW)
    assert stats.completed == 6 and stats.running == 0 and stats.queued == 0
    records = device.gate.finished_jobs()
    assert len(records) == 6 and all(r.started_at is not None and r.ran >= 0 for r in records)


def test_runs_longer_than_the_bound_never_run_on_the_loop_thread():
    model = Recording(busy_ns=2_000_000)
    _, prepared = front_of(model, inline_bound=0.001)
    execution = prepared.create_execution(REQUEST)

    async def main():
        for _ in range(INLINE_AFTER + 2):
            assert (await execution.execute()).status == ErrorStatus.NONE
        return threading.get_ident()

    loop_thread = anyio.run(main)
    assert loop_thread not in model.threads
    assert all(model.checkpoints)          # on a worker thread, with its boundaries


def test_a_job_that_must_wait_for_the_slot_runs_on_a_worker_thread():
    model = Recording()
    device, prepared = front_of(model)
    execution = prepared.create_execution(REQUEST)

    async def main():
        await teach(execution)
        job, owned = device.gate.submit_here(device.app, LOW, model="holder")
        assert owned                       # the slot is taken until finish below
        results = []

        async def run():
            results.append(await execution.execute())
        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            # The loop is free while the job waits: this task polls.
            while device.gate.statistics().of(device.app, LOW).queued == 0:
                await anyio.sleep(0.001)
            device.gate.finish(job)
        assert results[0].status == ErrorStatus.NONE
        return threading.get_ident()

    loop_thread = anyio.run(main)
    assert model.threads[-1] != loop_thread
    assert model.checkpoints[-1]


def test_inline_runs_can_be_turned_off():
    model = Recording()
    _, prepared = front_of(model, inline_bound=0)
    execution = prepared.create_execution(REQUEST)

    async def main():
        for _ in range(INLINE_AFTER + 2):
            await execution.execute()
        return threading.get_ident()

    assert anyio.run(main) not in model.threads


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_tasks_running_inline_executions_take_turns(backend):
    model = Recording()
    _, prepared = front_of(model)
    execution = prepared.create_execution(REQUEST)
    order = []

    async def loop(name):
        for _ in range(5):
            await execution.execute()
            order.append(name)

    async def main():
        await teach(execution)
        async with anyio.create_task_group() as tg:
            tg.start_soon(loop, "a")
            tg.start_soon(loop, "b")

    anyio.run(main, backend=backend)
    # Each execute is a schedule point: neither task runs all of its
    # executions before the other starts.
    assert order.index("b") < 5 and order.index("a") < 5
    assert sorted(order) == ["a"] * 5 + ["b"] * 5


def test_a_cancelled_caller_stops_before_anything_is_queued():
    model = Recording()
    device, prepared = front_of(model)
    execution = prepared.create_execution(REQUEST)

    async def main():
        await teach(execution)
        with anyio.CancelScope() as scope:
            scope.cancel()
            await execution.execute()
        assert scope.cancelled_caught

    anyio.run(main)
    assert len(model.threads) == INLINE_AFTER
    assert len(device.gate.finished_jobs()) == INLINE_AFTER
    assert device.gate.statistics().busy == 0


def test_an_inline_run_is_one_step_a_higher_priority_job_takes_the_slot_after_it():
    model = Recording()
    device, prepared = front_of(model)
    execution = prepared.create_execution(REQUEST)
    high = ScheduledPreparedModel(Recording(), device.gate, HIGH, device.app)
    high_results = []
    thread = None

    def submit_high_meanwhile():
        # Inside the inline run: a HIGH job of the same app arrives on
        # another thread and waits (no boundary to preempt at).
        nonlocal thread
        model.during = None
        thread = threading.Thread(
            target=lambda: high_results.append(high.execute_synchronously(REQUEST)))
        thread.start()
        for _ in range(int(TIMEOUT / 0.001)):
            if device.gate.statistics().of(device.app, HIGH).queued == 1:
                return
            time.sleep(0.001)
        raise AssertionError("the HIGH job never queued")

    async def main():
        await teach(execution)
        model.during = submit_high_meanwhile
        assert (await execution.execute()).status == ErrorStatus.NONE
        return threading.get_ident()

    loop_thread = anyio.run(main)
    thread.join(TIMEOUT)
    assert model.threads[-1] == loop_thread
    assert high_results[0].status == ErrorStatus.NONE
    low_record, high_record = device.gate.finished_jobs()[-2:]
    assert (low_record.priority, high_record.priority) == (LOW, HIGH)
    assert low_record.preemptions == 0
    assert high_record.started_at >= low_record.finished_at


def test_one_shot_executions_and_new_executions_run_on_a_worker_thread():
    model = Recording()
    _, prepared = front_of(model)
    execution = prepared.create_execution(REQUEST)

    async def main():
        for _ in range(INLINE_AFTER + 1):
            await execution.execute()
        # The record is the execution's: a new one (even of the same
        # request), and a one-shot ``execute``, have no past runs.
        await prepared.create_execution(REQUEST).execute()
        for _ in range(INLINE_AFTER + 1):
            await prepared.execute(REQUEST)
        return threading.get_ident()

    loop_thread = anyio.run(main)
    assert execution.inline
    assert model.threads[INLINE_AFTER] == loop_thread
    assert loop_thread not in model.threads[INLINE_AFTER + 1:]


def test_a_model_with_control_flow_never_runs_inline(monkeypatch):
    from nnrt.drivers.reference import ReferenceExecution
    from tests.integration.test_qos_inprocess import endless_model

    threads = []
    run = ReferenceExecution.execute_synchronously

    def recording(self, *args, **kwargs):
        threads.append(threading.get_ident())
        return run(self, *args, **kwargs)
    monkeypatch.setattr(ReferenceExecution, "execute_synchronously", recording)
    device = ScheduledDevice(ReferenceDevice(), inline_bound=GENEROUS)
    x = np.ones(1, np.float32)
    request = Request((RequestArgument(False, DataLocation(0, 0, 4), (1,)),),
                      (RequestArgument(False, DataLocation(1, 0, 4)),),
                      (x, np.zeros(1, np.float32)))

    async def main():
        prepared = await device.prepare_model(endless_model().hal_model)
        execution = prepared.create_execution(request, loop_timeout=0.001)
        for _ in range(INLINE_AFTER + 2):
            # A WHILE whose trip count is the data's: stopped by its timeout.
            result = await execution.execute()
            assert result.status == ErrorStatus.MISSED_DEADLINE_TRANSIENT
        return threading.get_ident()

    loop_thread = anyio.run(main)
    assert len(threads) == INLINE_AFTER + 2 and loop_thread not in threads


def test_the_inline_bound_is_checked():
    with pytest.raises(NnrtError) as e:
        ScheduledDevice(ReferenceDevice(), inline_bound=-1)
    assert e.value.status == ErrorStatus.INVALID_ARGUMENT


def test_one_shot_executions_of_a_model_of_fixed_shapes_share_its_record():
    """Every request of a model whose inputs have fixed shapes runs the same
    shapes: its one-shot executions (``execute`` of a request) count their
    short runs together and then run inline too."""
    model = Recording()
    device = ScheduledDevice(ReferenceDevice(), slots=1, inline_bound=GENEROUS)
    prepared = ScheduledPreparedModel(model, device.gate, LOW, device.app,
                                      inline_bound=GENEROUS, fixed_shapes=True)

    async def main():
        for _ in range(INLINE_AFTER + 2):
            await prepared.execute(REQUEST)
        return threading.get_ident()

    loop_thread = anyio.run(main)
    assert loop_thread not in model.threads[:INLINE_AFTER]
    assert model.threads[INLINE_AFTER:] == [loop_thread] * 2


async def test_a_driver_service_runs_no_apps_work_on_its_event_loop(tmp_path, monkeypatch):
    """The service's front has inline bound 0: however short and however
    often an app's executions run, reusable (COMPUTE) or one-shot, its job
    runs on a worker thread, never on the loop every app shares."""
    from nnrt.drivers.reference import ReferenceExecution
    from nnrt.service.client import ServiceDevice
    from nnrt.service.server import serve
    from tests.integration.test_service import add_model, numpy_request
    threads = []
    run = ReferenceExecution.execute_synchronously

    def recording(self, *args, **kwargs):
        threads.append(threading.get_ident())
        return run(self, *args, **kwargs)
    monkeypatch.setattr(ReferenceExecution, "execute_synchronously", recording)
    async with anyio.create_task_group() as tg:
        await tg.start(serve, ReferenceDevice(), str(tmp_path / "s.sock"))
        dev = await ServiceDevice.connect(str(tmp_path / "s.sock"))
        try:
            prepared = await dev.prepare_model(add_model())
            x = np.ones((1, 4), np.float32)
            out = np.zeros((1, 4), np.float32)
            execution = prepared.create_execution(numpy_request([x, x], [out]))
            for _ in range(INLINE_AFTER + 3):
                assert (await execution.execute()).status == ErrorStatus.NONE
                assert (await prepared.execute(numpy_request([x, x], [out]))).status \
                    == ErrorStatus.NONE
        finally:
            dev.close()
            tg.cancel_scope.cancel()
    assert len(threads) == 2 * (INLINE_AFTER + 3)
    assert threading.get_ident() not in threads    # the service's loop is this thread
