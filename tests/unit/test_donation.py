"""Jobs submitted with work: the gate starts their threads only when they
need one, calls their work exactly once, and a preempted job's thread runs
the preempting job itself on a one-slot device (donation). Real threads, a
manual clock; events fix the interleaving, so the tests assert orders and
which thread ran what, never times."""
import threading

import numpy as np
import pytest

from nnrt import ErrorStatus, NnrtError, Priority
from nnrt.handoff import run_soon
from nnrt.qos import ExecutionGate, JobState, ManualClock, Scheduler

from .test_preemption import TIMEOUT, Runner, chain

HIGH, MEDIUM, LOW = Priority.HIGH, Priority.MEDIUM, Priority.LOW


class Spawner:
    """A gate's ``spawn``: counts the threads asked for, then starts them."""

    def __init__(self):
        self.calls = 0

    def __call__(self, fn, *args):
        self.calls += 1
        run_soon(fn, *args)


class Work:
    """A job's work: runs ``ex`` with the gate's checkpoint, records on which
    thread and with what outcome; ``done`` is set when it has been called."""

    def __init__(self, gate, ex, inputs):
        self.gate, self.ex, self.inputs = gate, ex, inputs
        self.thread = self.result = self.error = self.state_at_call = None
        self.calls = 0
        self.done = threading.Event()

    def __call__(self, job):
        self.calls += 1
        self.thread = threading.get_ident()
        self.state_at_call = job.state
        try:
            if job.state is not JobState.DONE:
                try:
                    self.result = self.ex.run(self.inputs,
                                              checkpoint=lambda c: self.gate.checkpoint(job))
                finally:
                    self.gate.finish(job)
            else:
                self.error = job.status
        except NnrtError as e:
            self.error = e.status
        finally:
            self.done.set()


def setup(slots=1):
    clock = ManualClock()
    spawn = Spawner()
    scheduler = Scheduler(clock=clock, slots=slots)
    return ExecutionGate(scheduler, spawn=spawn), scheduler, clock, spawn


def test_a_preempted_thread_runs_the_preempting_job_itself():
    gate, scheduler, _, spawn = setup()
    low_ex, high_ex = chain(10), chain(3)
    x = np.linspace(-1, 1, 8, dtype=np.float32)
    low = gate.submit("app", LOW, model="low")
    runner = Runner(gate, low, low_ex, [x], pause_when=lambda p: p == ((None, 4),))
    assert runner.paused.wait(TIMEOUT)
    high_work = Work(gate, high_ex, [x])
    gate.submit("app", HIGH, model="high", work=high_work)
    assert spawn.calls == 0                 # queued, no deadline: no thread yet
    runner.resume()
    runner.join()

    assert high_work.done.is_set() and high_work.calls == 1
    assert high_work.thread == runner.thread.ident        # donated
    assert spawn.calls == 0                 # no thread was ever started for it
    np.testing.assert_array_equal(high_work.result[0], high_ex.run([x])[0])
    np.testing.assert_array_equal(runner.result[0], low_ex.run([x])[0])
    assert runner.positions == [((None, k),) for k in range(10)]   # resumed, not rerun
    assert [r.model for r in scheduler.finished_jobs()] == ["high", "low"]
    assert low.preemptions == 1 and scheduler.statistics().busy == 0


def test_nested_donation_medium_then_high_on_the_low_thread():
    gate, scheduler, _, spawn = setup()
    x = np.ones(8, np.float32)
    low = gate.submit("app", LOW, model="low")
    runner = Runner(gate, low, chain(6), [x], pause_when=lambda p: p == ((None, 2),))
    assert runner.paused.wait(TIMEOUT)
    high_work = Work(gate, chain(2), [x])
    release_medium = threading.Event()
    medium_ex = chain(4)

    class MediumWork(Work):
        def __call__(self, job):
            # Submit HIGH from inside MEDIUM's run, before its second boundary.
            def checkpoint(c):
                if c.position == ((None, 1),) and not release_medium.is_set():
                    release_medium.set()
                    gate.submit("app", HIGH, model="high", work=high_work)
                gate.checkpoint(job)
            self.calls += 1
            self.thread = threading.get_ident()
            try:
                self.result = medium_ex.run([x], checkpoint=checkpoint)
            finally:
                gate.finish(job)
                self.done.set()

    medium_work = MediumWork(gate, medium_ex, [x])
    gate.submit("app", MEDIUM, model="medium", work=medium_work)
    runner.resume()
    runner.join()
    assert medium_work.thread == high_work.thread == runner.thread.ident
    assert [r.model for r in scheduler.finished_jobs()] == ["high", "medium", "low"]
    assert runner.error is None and spawn.calls == 0


def test_no_donation_with_two_slots():
    gate, scheduler, _, spawn = setup(slots=2)
    x = np.ones(8, np.float32)
    lows = [gate.submit("app", LOW, model=f"low{i}") for i in range(2)]
    runners = [Runner(gate, job, chain(8), [x], pause_when=lambda p: p == ((None, 3),))
               for job in lows]
    for r in runners:
        assert r.paused.wait(TIMEOUT)
    high_work = Work(gate, chain(2), [x])
    gate.submit("app", HIGH, model="high", work=high_work)
    for r in runners:
        r.resume()
    assert high_work.done.wait(TIMEOUT)
    for r in runners:
        r.join()
    assert high_work.thread not in {r.thread.ident for r in runners}
    assert spawn.calls == 1
    assert all(r.error is None for r in runners)


def test_a_job_with_a_deadline_gets_its_thread_at_once_and_it_leaves_after_a_donation():
    gate, scheduler, clock, spawn = setup()
    x = np.ones(8, np.float32)
    low = gate.submit("app", LOW, model="low")
    runner = Runner(gate, low, chain(6), [x], pause_when=lambda p: p == ((None, 1),))
    assert runner.paused.wait(TIMEOUT)
    high_work = Work(gate, chain(2), [x])
    gate.submit("app", HIGH, model="high", work=high_work, deadline=clock() + 100.0)
    assert spawn.calls == 1                 # its thread sleeps until the wake time
    runner.resume()
    runner.join()
    assert high_work.thread == runner.thread.ident and high_work.calls == 1


def test_a_queued_job_cancelled_before_it_had_a_thread_reports_through_its_work():
    gate, scheduler, _, spawn = setup()
    blocker = gate.submit("app", LOW)
    assert blocker.state is JobState.RUNNING
    work = Work(gate, chain(2), [np.ones(8, np.float32)])
    job = gate.submit("app", LOW, work=work)
    assert gate.cancel(job) is False        # nobody held its buffers
    assert work.done.wait(TIMEOUT)
    assert work.calls == 1 and work.state_at_call is JobState.DONE
    assert work.error == ErrorStatus.GENERAL_FAILURE
    gate.finish(blocker)
    assert scheduler.statistics().busy == 0


def test_cancelling_a_running_job_with_work_stops_it_and_reports_it():
    gate, scheduler, _, spawn = setup()
    entered = threading.Event()
    proceed = threading.Event()
    ex = chain(6)

    class Slow(Work):
        def __call__(self, job):
            def checkpoint(c):
                entered.set()
                assert proceed.wait(TIMEOUT)
                gate.checkpoint(job)
            self.calls += 1
            try:
                ex.run([np.ones(8, np.float32)], checkpoint=checkpoint)
            except NnrtError as e:
                self.error = e.status
            finally:
                gate.finish(job)
                self.done.set()

    work = Slow(gate, ex, None)
    job = gate.submit("app", LOW, work=work)
    assert entered.wait(TIMEOUT)
    assert gate.cancel(job) is True         # a thread holds its buffers: wait for it
    proceed.set()
    assert work.done.wait(TIMEOUT)
    assert work.error == ErrorStatus.GENERAL_FAILURE and work.calls == 1
    assert gate.statistics().of("app", LOW).cancelled == 1


def test_work_needs_a_gate_with_spawn():
    gate = ExecutionGate(Scheduler(clock=ManualClock()))
    with pytest.raises(TypeError, match="spawn"):
        gate.submit("app", LOW, work=lambda job: None)


def test_another_apps_preempting_job_runs_on_the_preempted_thread_pinned():
    # Across apps too: B's job is preempted at a boundary for A's light job
    # (F3), whose work runs on B's thread; A's job is pinned (P1) so it
    # cannot be preempted while B's context is parked below it.
    gate, scheduler, clock, spawn = setup()
    scheduler.for_test_set_estimate("heavy", 0.010)
    scheduler.for_test_set_estimate("light", 0.001)
    x = np.linspace(-1, 1, 8, dtype=np.float32)
    heavy_ex, light_ex = chain(10), chain(2)
    b = gate.submit("B", LOW, model="heavy")
    runner = Runner(gate, b, heavy_ex, [x], pause_when=lambda p: p == ((None, 4),))
    assert runner.paused.wait(TIMEOUT)
    light_work = Work(gate, light_ex, [x])
    a = gate.submit("A", HIGH, model="light", work=light_work)
    clock.advance(0.002)                    # B has run past A's virtual deadline
    runner.resume()
    runner.join()
    assert light_work.done.is_set() and light_work.thread == runner.thread.ident
    assert spawn.calls == 0 and a.pinned and not b.pinned
    np.testing.assert_array_equal(light_work.result[0], light_ex.run([x])[0])
    np.testing.assert_array_equal(runner.result[0], heavy_ex.run([x])[0])
    assert [r.model for r in scheduler.finished_jobs()] == ["light", "heavy"]
    assert b.preemptions == 1 and scheduler.statistics().busy == 0


class HeldWork(Work):
    """Work that waits for ``go`` before running, so the test can queue
    other jobs behind it."""

    def __init__(self, gate, ex, inputs):
        super().__init__(gate, ex, inputs)
        self.started, self.go = threading.Event(), threading.Event()

    def __call__(self, job):
        self.started.set()
        assert self.go.wait(TIMEOUT)
        super().__call__(job)


def test_the_thread_that_frees_the_slot_runs_the_next_job_itself():
    # Continuation: when a job's own thread finishes, the job that takes the
    # slot runs on that thread (after the first job's work has returned),
    # instead of a new thread being woken while this one goes idle.
    gate, scheduler, _, spawn = setup()
    x = np.linspace(-1, 1, 8, dtype=np.float32)
    first = HeldWork(gate, chain(3), [x])
    gate.submit("a", MEDIUM, model="m", work=first)
    assert first.started.wait(TIMEOUT) and spawn.calls == 1
    second, third = Work(gate, chain(4), [x]), Work(gate, chain(5), [x])
    gate.submit("b", MEDIUM, model="m", work=second)
    gate.submit("a", MEDIUM, model="m", work=third)
    first.go.set()
    assert third.done.wait(TIMEOUT) and second.done.wait(TIMEOUT)
    assert spawn.calls == 1                                  # no other thread was started
    assert first.thread == second.thread == third.thread
    for work, n in ((first, 3), (second, 4), (third, 5)):
        np.testing.assert_allclose(work.result[0], chain(n).run([x])[0])
        assert work.calls == 1 and work.error is None
    assert scheduler.statistics().busy == 0


def test_a_synchronous_owner_does_not_run_the_next_job():
    # Only a job's own thread continues: a caller that claimed its job on
    # its own thread (execute_synchronously, a burst) returns to its caller,
    # and the next job gets a thread of its own.
    gate, scheduler, _, spawn = setup()
    x = np.linspace(-1, 1, 8, dtype=np.float32)
    mine = gate.submit("a", MEDIUM, model="m")
    runner = Runner(gate, mine, chain(6), [x], pause_when=lambda p: p == ((None, 3),))
    assert runner.paused.wait(TIMEOUT)
    queued = Work(gate, chain(2), [x])
    gate.submit("b", MEDIUM, model="m", work=queued)
    runner.resume()
    runner.join()
    assert queued.done.wait(TIMEOUT)
    assert spawn.calls == 1 and queued.thread != runner.thread.ident
    np.testing.assert_allclose(queued.result[0], chain(2).run([x])[0])
