"""ExecutionGate.submit_here and give_work: a job that gets its slot at once
is owned by the submitting thread on return (no wake-up, no thread); one
that waits is claimed, or given work, as any job. Real threads, a manual
clock; events fix the interleaving, so the tests assert orders and owners,
never times."""
import threading

import numpy as np

from nnrt import ErrorStatus, Priority
from nnrt.qos import JobState

from .test_donation import Work, setup
from .test_preemption import TIMEOUT, chain

HIGH, LOW = Priority.HIGH, Priority.LOW


def test_a_job_that_gets_a_free_slot_is_owned_by_the_submitting_thread():
    gate, scheduler, _, spawn = setup()
    job, owned = gate.submit_here("app", LOW, model="m")
    assert owned and job.state is JobState.RUNNING
    assert spawn.calls == 0
    # Owned: a cancel must wait for this thread to let go of the buffers.
    assert gate.cancel(job) is True
    assert gate.finish(job) == ErrorStatus.NONE
    assert job.state is JobState.DONE and scheduler.statistics().busy == 0
    assert [r.model for r in scheduler.finished_jobs()] == ["m"]


def test_a_job_that_waits_is_claimed_when_the_slot_frees():
    gate, scheduler, _, spawn = setup()
    first, owned = gate.submit_here("app", LOW, model="first")
    assert owned
    second, owned = gate.submit_here("app", LOW, model="second")
    assert not owned and second.state is JobState.QUEUED
    claimed = []
    thread = threading.Thread(target=lambda: claimed.append(gate.claim(second)))
    thread.start()
    gate.finish(first)
    thread.join(TIMEOUT)
    assert claimed == [True] and second.state is JobState.RUNNING
    gate.finish(second)
    assert spawn.calls == 0
    assert [r.model for r in scheduler.finished_jobs()] == ["first", "second"]


def test_work_given_to_a_waiting_job_gets_a_thread_only_when_dispatched():
    gate, scheduler, _, spawn = setup()
    blocker, _ = gate.submit_here("app", LOW)
    job, owned = gate.submit_here("app", LOW, model="waits")
    assert not owned
    x = np.ones(8, np.float32)
    work = Work(gate, chain(3), [x])
    gate.give_work(job, work)
    assert spawn.calls == 0                 # queued without a deadline: no thread yet
    gate.finish(blocker)
    assert work.done.wait(TIMEOUT)
    assert spawn.calls == 1 and work.calls == 1
    assert work.state_at_call is JobState.RUNNING
    np.testing.assert_array_equal(work.result[0], chain(3).run([x])[0])


def test_work_given_after_the_job_was_dispatched_meanwhile_starts_at_once():
    gate, scheduler, _, spawn = setup()
    blocker, _ = gate.submit_here("app", LOW)
    job, owned = gate.submit_here("app", LOW)
    assert not owned
    gate.finish(blocker)                    # dispatched with nobody to run it yet
    assert job.state is JobState.RUNNING
    work = Work(gate, chain(2), [np.ones(8, np.float32)])
    gate.give_work(job, work)
    assert work.done.wait(TIMEOUT)
    assert spawn.calls == 1 and work.state_at_call is JobState.RUNNING
    assert scheduler.statistics().busy == 0


def test_work_given_to_a_job_refused_meanwhile_reports_the_refusal():
    gate, scheduler, clock, spawn = setup()
    scheduler.for_test_set_estimate("slow", 1.0)
    blocker, _ = gate.submit_here("app", LOW)
    job, owned = gate.submit_here("app", LOW, model="slow", deadline=clock() + 2.0)
    assert not owned
    clock.advance(1.5)                      # now it cannot make its deadline
    gate.poll()
    assert job.state is JobState.DONE
    work = Work(gate, chain(2), [np.ones(8, np.float32)])
    gate.give_work(job, work)
    assert work.done.wait(TIMEOUT)
    assert work.calls == 1 and work.state_at_call is JobState.DONE
    assert work.error == ErrorStatus.MISSED_DEADLINE_TRANSIENT
    gate.finish(blocker)


def test_a_higher_priority_job_waits_for_an_owned_job_and_then_runs():
    gate, scheduler, _, spawn = setup()
    low, owned = gate.submit_here("app", LOW, model="low")
    assert owned
    high, owned = gate.submit_here("app", HIGH, model="high")
    assert not owned
    gate.finish(low)
    assert high.state is JobState.RUNNING   # the slot went straight to it
    assert gate.claim(high) is True
    gate.finish(high)
    assert [r.model for r in scheduler.finished_jobs()] == ["low", "high"]
