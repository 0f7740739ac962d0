"""Preemption, resume, deadline aborts and cancellation at operation
boundaries: the reference executor behind an ExecutionGate, on real threads,
with a manual clock. Threading events fix the interleaving, so every test
asserts an order, not a time."""
import threading

import numpy as np
import pytest

import nnrt
from nnrt import ErrorStatus, NnrtError, OperandType as T, OperationType as Op, Priority
from nnrt.drivers.executor import Executor
from nnrt.hal.validate import validate_model
from nnrt.qos import ExecutionGate, JobState, ManualClock, Scheduler

HIGH, LOW = Priority.HIGH, Priority.LOW
TIMEOUT = 10.0   # only a safety net against a hang; never reached when the code works


def const(m, dims, value):
    i = m.add_operand(T.TENSOR_FLOAT32, list(dims))
    m.set_operand_value(i, np.full(dims, value, np.float32))
    return i


def act(m):
    i = m.add_operand(T.INT32)
    m.set_operand_value(i, 0)
    return i


def chain(n: int, dims=(8,)) -> Executor:
    """n alternating ADDs and MULs: every operation changes the value, so a
    skipped or repeated operation changes the result."""
    m = nnrt.Model()
    x = m.add_operand(T.TENSOR_FLOAT32, list(dims))
    cur = x
    for k in range(n):
        out = m.add_operand(T.TENSOR_FLOAT32, list(dims))
        if k % 2:
            m.add_operation(Op.MUL, [cur, const(m, dims, 1.0 + k / 64), act(m)], [out])
        else:
            m.add_operation(Op.ADD, [cur, const(m, dims, k + 1.0), act(m)], [out])
        cur = out
    m.identify_inputs_and_outputs([x], [cur])
    return executor(m.finish())


def counting_loop() -> Executor:
    """WHILE i < n: (acc, i) = (acc * 1.5 + 1, i + 1)."""
    def loop_operands(m):
        return (m.add_operand(T.TENSOR_FLOAT32, [4]), m.add_operand(T.TENSOR_FLOAT32, [1]),
                m.add_operand(T.TENSOR_FLOAT32, [1]))

    cond = nnrt.Model()
    acc, i, n = loop_operands(cond)
    go = cond.add_operand(T.TENSOR_BOOL8, [1])
    cond.add_operation(Op.LESS, [i, n], [go])
    cond.identify_inputs_and_outputs([acc, i, n], [go])
    cond.finish()
    body = nnrt.Model()
    acc, i, n = loop_operands(body)
    scaled = body.add_operand(T.TENSOR_FLOAT32, [4])
    body.add_operation(Op.MUL, [acc, const(body, [4], 1.5), act(body)], [scaled])
    acc2 = body.add_operand(T.TENSOR_FLOAT32, [4])
    body.add_operation(Op.ADD, [scaled, const(body, [4], 1.0), act(body)], [acc2])
    i2 = body.add_operand(T.TENSOR_FLOAT32, [1])
    body.add_operation(Op.ADD, [i, const(body, [1], 1.0), act(body)], [i2])
    body.identify_inputs_and_outputs([acc, i, n], [acc2, i2])
    body.finish()
    m = nnrt.Model()
    acc, i, n = loop_operands(m)
    refs = [m.add_operand(T.SUBGRAPH), m.add_operand(T.SUBGRAPH)]
    m.set_operand_value_from_model(refs[0], cond)
    m.set_operand_value_from_model(refs[1], body)
    out = m.add_operand(T.TENSOR_FLOAT32, [4])
    m.add_operation(Op.WHILE, [*refs, acc, i, n], [out])
    m.identify_inputs_and_outputs([acc, i, n], [out])
    return executor(m.finish())


def executor(model: nnrt.Model) -> Executor:
    hal = model.hal_model
    return Executor(hal, validate_model(hal))


class Runner:
    """Runs one job's execution on a thread. ``pause_when(position)`` makes
    the thread stop at that boundary, before asking the scheduler, until the
    test calls ``resume()``."""

    def __init__(self, gate, job, ex, inputs, pause_when=lambda position: False, tick=None):
        self.gate, self.job, self.ex, self.inputs = gate, job, ex, inputs
        self.pause_when, self.tick = pause_when, tick
        self.positions = []
        self.paused = threading.Event()
        self._resume = threading.Event()
        self.result = self.error = None
        self.thread = threading.Thread(target=self._main, daemon=True)
        self.thread.start()

    def resume(self):
        self._resume.set()

    def join(self):
        self.thread.join(TIMEOUT)
        assert not self.thread.is_alive()
        return self

    def _checkpoint(self, context):
        self.positions.append(context.position)
        if self.tick:
            self.tick()
        if not self.paused.is_set() and self.pause_when(context.position):
            self.paused.set()
            assert self._resume.wait(TIMEOUT)
        self.gate.checkpoint(self.job)

    def _main(self):
        try:
            self.gate.claim(self.job)
            try:
                self.result = self.ex.run(self.inputs, checkpoint=self._checkpoint)
            finally:
                self.gate.finish(self.job)
        except NnrtError as e:
            self.error = e


def setup(**kwargs):
    clock = ManualClock()
    scheduler = Scheduler(clock=clock, **kwargs)
    return ExecutionGate(scheduler), scheduler, clock


def test_preempted_execution_resumes_where_it_stopped_with_the_same_result():
    gate, scheduler, _ = setup()
    low_ex, high_ex = chain(12), chain(3)
    x = np.linspace(-1, 1, 8, dtype=np.float32)
    expected = low_ex.run([x])[0]

    low = gate.submit("app", LOW, model="low")
    runner = Runner(gate, low, low_ex, [x], pause_when=lambda p: p == ((None, 5),))
    assert runner.paused.wait(TIMEOUT)
    high = gate.submit("app", HIGH, model="high")
    assert high.state is JobState.QUEUED            # the slot is LOW's until a boundary
    runner.resume()
    gate.claim(high)                         # handed over at boundary 5
    assert low.state is JobState.PREEMPTED and low.preemptions == 1
    high_out = high_ex.run([x], checkpoint=lambda c: gate.checkpoint(high))[0]
    gate.finish(high)
    runner.join()

    assert runner.error is None
    np.testing.assert_array_equal(runner.result[0], expected)
    np.testing.assert_array_equal(high_out, high_ex.run([x])[0])
    # Each boundary was passed once, in order: the resumed run did not go back.
    assert runner.positions == [((None, k),) for k in range(12)]
    order = [r.model for r in scheduler.finished_jobs()]
    assert order == ["high", "low"]
    assert gate.statistics().of("app", LOW).preempted == 1


def test_preemption_between_while_iterations_keeps_the_loop_state():
    gate, scheduler, _ = setup()
    loop, high_ex = counting_loop(), chain(2)
    inputs = [np.arange(4, dtype=np.float32), np.zeros(1, np.float32),
              np.full(1, 6, np.float32)]
    expected = loop.run(inputs)[0]
    reference = np.arange(4, dtype=np.float32)
    for _ in range(6):
        reference = reference * np.float32(1.5) + np.float32(1)
    np.testing.assert_allclose(expected, reference, rtol=1e-6)

    low = gate.submit("app", LOW, model="loop")
    entries = []

    def inside_third_iteration(position):
        # Entering the body subgraph (index 1) for the third time.
        if len(position) == 2 and position[1] == (1, 0):
            entries.append(position)
        return len(entries) == 3

    runner = Runner(gate, low, loop, inputs, pause_when=inside_third_iteration)
    assert runner.paused.wait(TIMEOUT)
    high = gate.submit("app", HIGH, model="high")
    runner.resume()
    gate.claim(high)
    assert low.state is JobState.PREEMPTED
    high_ex.run([np.zeros(8, np.float32)], checkpoint=lambda c: gate.checkpoint(high))
    gate.finish(high)
    runner.join()
    assert runner.error is None
    np.testing.assert_array_equal(runner.result[0], expected)
    assert low.preemptions == 1


def test_a_lower_priority_job_never_preempts_and_other_apps_never_preempt():
    gate, scheduler, _ = setup()
    ex = chain(6)
    x = np.ones(8, np.float32)
    med = gate.submit("app", Priority.MEDIUM)
    runner = Runner(gate, med, ex, [x], pause_when=lambda p: p == ((None, 2),))
    assert runner.paused.wait(TIMEOUT)
    low = gate.submit("app", LOW)
    other = gate.submit("other app", HIGH)
    runner.resume()
    runner.join()
    assert med.preemptions == 0 and runner.error is None
    # Fair turns between apps: the other app goes next, despite LOW being older.
    assert other.state is JobState.RUNNING and low.state is JobState.QUEUED


def test_deadline_abort_at_a_boundary():
    gate, scheduler, clock = setup()
    scheduler.for_test_set_estimate("slow", 1.0)
    job = gate.submit("app", Priority.MEDIUM, deadline=clock() + 2.0, model="slow")
    nxt = gate.submit("app", Priority.MEDIUM, model="next")
    runner = Runner(gate, job, chain(12), [np.ones(8, np.float32)],
                    tick=lambda: clock.advance(0.5))
    runner.join()
    assert runner.result is None
    assert runner.error.status == ErrorStatus.MISSED_DEADLINE_PERSISTENT
    # Stopped at the first boundary past the deadline: 0.5 s per operation.
    assert len(runner.positions) == 5
    assert nxt.state is JobState.RUNNING            # the slot went on at once
    assert gate.statistics().of("app", Priority.MEDIUM).deadline_misses == 1


def test_a_preemption_that_makes_a_job_late_aborts_it_while_parked():
    gate, scheduler, clock = setup()
    scheduler.for_test_set_estimate("low", 1.0)
    low = gate.submit("app", LOW, deadline=clock() + 2.0, model="low")
    runner = Runner(gate, low, chain(12), [np.ones(8, np.float32)],
                    pause_when=lambda p: p == ((None, 3),))
    assert runner.paused.wait(TIMEOUT)
    high = gate.submit("app", HIGH)
    runner.resume()
    gate.claim(high)
    clock.advance(1.5)                  # the HIGH job takes long: LOW cannot make it now
    gate.finish(high)
    runner.join()
    assert runner.error.status == ErrorStatus.MISSED_DEADLINE_TRANSIENT
    assert len(runner.positions) == 4
    assert scheduler.statistics().busy == 0


def test_cancelling_a_running_execution_stops_it_at_the_next_boundary():
    gate, scheduler, _ = setup()
    job = gate.submit("app", LOW)
    nxt = gate.submit("app", LOW)
    runner = Runner(gate, job, chain(12), [np.ones(8, np.float32)],
                    pause_when=lambda p: p == ((None, 4),))
    assert runner.paused.wait(TIMEOUT)
    gate.cancel(job)
    assert nxt.state is JobState.QUEUED     # the running op finishes first
    runner.resume()
    runner.join()
    assert "cancelled" in str(runner.error) and len(runner.positions) == 5
    assert nxt.state is JobState.RUNNING
    assert gate.statistics().of("app", LOW).cancelled == 1


def test_cancelling_a_parked_execution_wakes_its_thread():
    gate, scheduler, _ = setup()
    low = gate.submit("app", LOW)
    runner = Runner(gate, low, chain(12), [np.ones(8, np.float32)],
                    pause_when=lambda p: p == ((None, 2),))
    assert runner.paused.wait(TIMEOUT)
    high = gate.submit("app", HIGH)
    runner.resume()
    gate.claim(high)
    assert low.state is JobState.PREEMPTED
    gate.cancel(low)
    runner.join()
    assert "cancelled" in str(runner.error)
    gate.finish(high)
    assert scheduler.statistics().busy == 0


def test_cancelling_a_job_whose_thread_never_started_frees_its_slot():
    gate, scheduler, _ = setup()
    job = gate.submit("app", LOW)            # dispatched at once: the slot was free
    nxt = gate.submit("app", LOW)
    assert job.state is JobState.RUNNING
    gate.cancel(job)
    assert job.state is JobState.DONE and nxt.state is JobState.RUNNING
    with pytest.raises(NnrtError, match="cancelled"):
        gate.claim(job)               # a late thread learns it at once


def test_a_waiting_job_is_refused_when_its_deadline_becomes_hopeless():
    gate, scheduler, clock = setup()
    blocker = gate.submit("app", LOW)
    job = gate.submit("app", LOW, deadline=clock() + 1.0)
    waiter = threading.Thread(target=lambda: pytest.raises(NnrtError, gate.claim, job),
                              daemon=True)
    waiter.start()
    clock.advance(1.5)
    gate.poll()
    waiter.join(TIMEOUT)
    assert not waiter.is_alive()
    assert job.status == ErrorStatus.MISSED_DEADLINE_TRANSIENT
    gate.finish(blocker)
