"""The QoS scheduler core, driven by a manual clock: orderings and decisions,
never wall-clock times."""
import dataclasses

import pytest

from nnrt import ErrorStatus, NnrtError, Priority
from nnrt.qos import AppSettings, JobState, ManualClock, Scheduler, SchedulerLoad, Verdict
from nnrt.qos.scheduler import SERVICE_SAMPLES
from nnrt.hal.types import deadline_in

HIGH, MEDIUM, LOW = Priority.HIGH, Priority.MEDIUM, Priority.LOW


def make(**kwargs):
    clock = ManualClock(100.0)
    return Scheduler(clock=clock, **kwargs), clock


def run_all(s, jobs, clock=None, cost=lambda job: 0.0):
    """Finish running jobs one at a time until every job in ``jobs`` is DONE;
    returns the jobs in the order they got a slot."""
    order = []
    pending = list(jobs)
    while True:
        live = [j for j in pending if j.state is JobState.RUNNING and j not in order]
        order.extend(sorted(live, key=lambda j: j.started_at))
        runnable = [j for j in pending if j.state is JobState.RUNNING]
        if not runnable:
            break
        job = runnable[0]
        if clock is not None:
            clock.advance(cost(job))
        s.finish(job)
    return order


def test_one_app_is_served_by_priority_then_deadline_then_arrival():
    s, clock = make()
    blocker = s.submit("app", LOW)
    assert blocker.state is JobState.RUNNING
    a = s.submit("app", LOW)
    b = s.submit("app", HIGH)
    c = s.submit("app", HIGH, deadline=clock() + 10)
    d = s.submit("app", MEDIUM)
    e = s.submit("app", HIGH, deadline=clock() + 5)
    f = s.submit("app", LOW)
    g = s.submit("app", MEDIUM, deadline=clock() + 50)
    assert all(j.state is JobState.QUEUED for j in (a, b, c, d, e, f, g))
    order = run_all(s, [blocker, a, b, c, d, e, f, g])
    assert order == [blocker, e, c, b, g, d, a, f]


def test_slots_bound_concurrency():
    s, _ = make(slots=2)
    jobs = [s.submit("app", MEDIUM) for _ in range(3)]
    assert [j.state for j in jobs] == [JobState.RUNNING, JobState.RUNNING, JobState.QUEUED]
    assert s.statistics().busy == 2
    s.finish(jobs[1])
    assert jobs[2].state is JobState.RUNNING
    assert s.take_wakeups() == jobs   # each dispatch is announced once, in order


def test_apps_with_work_take_turns():
    s, _ = make()
    blocker = s.submit("x", LOW)
    a = [s.submit("A", HIGH) for _ in range(4)]
    b = [s.submit("B", LOW) for _ in range(4)]
    order = run_all(s, [blocker, *a, *b])
    # Priority does not cross apps: B's LOW work alternates with A's HIGH work.
    assert [j.app for j in order[1:]] == ["A", "B"] * 4


def test_fairness_is_by_device_time_so_a_flood_of_long_jobs_gets_half():
    s, clock = make()
    a = [s.submit("A", MEDIUM) for _ in range(20)]
    b = [s.submit("B", MEDIUM) for _ in range(20)]
    cost = {"A": 3.0, "B": 1.0}
    run_all(s, a + b, clock, cost=lambda job: cost[job.app])
    # Look at the time both apps were backlogged: until one queue ran dry.
    end = min(a[-1].started_at, b[-1].started_at)
    records = [r for r in s.finished_jobs() if r.finished_at <= end]
    assert len(records) > 10
    share = {app: sum(r.ran for r in records if r.app == app) for app in "AB"}
    assert 0.4 <= share["A"] / (share["A"] + share["B"]) <= 0.6
    assert s.statistics().run_time_of("A") == pytest.approx(60.0)


def test_an_idle_app_does_not_bank_credit():
    s, clock = make()
    for _ in range(5):               # A alone for a while
        job = s.submit("A", MEDIUM)
        clock.advance(1.0)
        s.finish(job)
    blocker = s.submit("A", MEDIUM)
    a = [s.submit("A", MEDIUM) for _ in range(3)]
    b = [s.submit("B", MEDIUM) for _ in range(3)]
    order = run_all(s, [blocker, *a, *b], clock, cost=lambda job: 1.0)
    assert [j.app for j in order[1:]] == ["B", "A", "B", "A", "B", "A"]


def test_a_higher_priority_job_of_the_same_app_preempts_at_a_boundary():
    s, clock = make()
    low = s.submit("app", LOW)
    low2 = s.submit("app", LOW)
    clock.advance(0.5)
    assert s.checkpoint(low) is Verdict.CONTINUE
    high = s.submit("app", HIGH)
    assert high.state is JobState.QUEUED
    clock.advance(0.25)
    assert s.checkpoint(low) is Verdict.PREEMPTED
    assert low.state is JobState.PREEMPTED and high.state is JobState.RUNNING
    assert high.started_at == clock() and low.preemptions == 1
    assert low.ran == pytest.approx(0.75)
    clock.advance(1.0)
    s.finish(high)
    # The preempted job resumes ahead of the LOW job that was queued before it.
    assert low.state is JobState.RUNNING and low2.state is JobState.QUEUED
    clock.advance(0.25)
    s.finish(low)
    assert low.ran == pytest.approx(1.0)   # time parked is not run time
    stats = s.statistics()
    assert stats.of("app", LOW).preempted == 1
    assert stats.of("app", LOW).completed == 1 and stats.of("app", HIGH).completed == 1


def test_another_apps_high_priority_does_not_preempt():
    s, _ = make()
    low = s.submit("A", LOW)
    other = s.submit("B", HIGH)
    assert s.checkpoint(low) is Verdict.CONTINUE
    s.finish(low)
    assert other.state is JobState.RUNNING


def test_preemption_hands_the_slot_to_the_same_app_not_the_fairness_pick():
    s, clock = make()
    low = s.submit("A", LOW)
    clock.advance(5.0)               # A has used far more than B
    queued_b = s.submit("B", MEDIUM)
    high = s.submit("A", HIGH)
    assert s.checkpoint(low) is Verdict.PREEMPTED
    assert high.state is JobState.RUNNING and queued_b.state is JobState.QUEUED


def test_no_preemption_for_equal_priority():
    s, _ = make()
    first = s.submit("app", MEDIUM)
    s.submit("app", MEDIUM, deadline=s.clock() + 1)   # earlier deadline, same level
    assert s.checkpoint(first) is Verdict.CONTINUE


def test_deadline_already_passed_is_transient():
    s, clock = make()
    with pytest.raises(NnrtError) as e:
        s.submit("app", MEDIUM, deadline=clock() - 1)
    assert e.value.status == ErrorStatus.MISSED_DEADLINE_TRANSIENT
    assert s.statistics().of("app", MEDIUM).deadline_misses == 1


def test_work_slower_than_its_deadline_on_an_idle_device_is_persistent():
    s, clock = make()
    s.for_test_set_estimate("model", 2.5)    # 25 % faster would still take 1.875 s
    with pytest.raises(NnrtError) as e:
        s.submit("app", MEDIUM, deadline=clock() + 1.5, model="model")
    assert e.value.status == ErrorStatus.MISSED_DEADLINE_PERSISTENT
    assert s.submit("app", MEDIUM, deadline=clock() + 2.5, model="model").state \
        is JobState.RUNNING


def test_work_late_because_the_device_is_busy_is_refused_at_dequeue_as_transient():
    s, clock = make()
    s.for_test_set_estimate("m", 1.0)
    blocker = s.submit("app", MEDIUM)
    job = s.submit("app", MEDIUM, deadline=clock() + 2.0, model="m")
    s.take_wakeups()
    clock.advance(1.5)
    s.finish(blocker)
    assert job.state is JobState.DONE and job.started_at is None
    assert job.status == ErrorStatus.MISSED_DEADLINE_TRANSIENT
    assert s.take_wakeups() == [job]


def test_poll_refuses_a_waiting_job_at_its_wake_time():
    s, clock = make()
    s.for_test_set_estimate("m", 1.0)
    blocker = s.submit("app", MEDIUM)
    job = s.submit("app", MEDIUM, deadline=clock() + 3.0, model="m")
    assert s.wake_time(job) == pytest.approx(clock() + 2.0)
    clock.advance(2.0)
    s.poll()
    assert job.state is JobState.QUEUED
    clock.advance(0.01)
    s.poll()
    assert job.status == ErrorStatus.MISSED_DEADLINE_TRANSIENT
    assert blocker.state is JobState.RUNNING


def test_preemption_that_makes_a_job_late_refuses_it_when_it_would_resume():
    s, clock = make()
    s.for_test_set_estimate("low", 1.0)
    low = s.submit("app", LOW, deadline=clock() + 1.5, model="low")
    clock.advance(0.2)
    high = s.submit("app", HIGH)
    assert s.checkpoint(low) is Verdict.PREEMPTED
    clock.advance(0.8)      # 0.8 s of LOW work left at +1.0: done at +1.8, due at +1.5
    s.finish(high)
    assert low.state is JobState.DONE
    assert low.status == ErrorStatus.MISSED_DEADLINE_TRANSIENT


def test_a_running_job_is_aborted_at_a_boundary_transient_when_it_waited():
    s, clock = make()
    s.for_test_set_estimate("m", 1.0)
    blocker = s.submit("app", MEDIUM)
    job = s.submit("app", MEDIUM, deadline=clock() + 2.5, model="m")
    clock.advance(1.0)
    s.finish(blocker)
    assert job.state is JobState.RUNNING
    clock.advance(1.0)
    assert s.checkpoint(job) is Verdict.CONTINUE     # 1.0 s run, due at +2.5: on time
    clock.advance(0.6)
    assert s.checkpoint(job) is Verdict.STOPPED      # past the deadline
    assert job.status == ErrorStatus.MISSED_DEADLINE_TRANSIENT
    assert s.statistics().busy == 0


def test_a_running_job_too_slow_even_alone_is_aborted_as_persistent():
    s, clock = make()
    s.for_test_set_estimate("m", 1.0)
    job = s.submit("app", MEDIUM, deadline=clock() + 2.0, model="m")
    clock.advance(2.1)
    assert s.checkpoint(job) is Verdict.STOPPED
    assert job.status == ErrorStatus.MISSED_DEADLINE_PERSISTENT


def test_the_estimate_aborts_before_the_deadline_passes():
    s, clock = make()
    s.for_test_set_estimate("m", 2.0)
    blocker = s.submit("app", MEDIUM)
    job = s.submit("app", MEDIUM, deadline=clock() + 3.0, model="m")
    clock.advance(0.5)
    s.finish(blocker)                     # 0.5 + 2.0 <= 3.0: it starts
    assert job.state is JobState.RUNNING
    clock.advance(0.5)
    assert s.checkpoint(job) is Verdict.CONTINUE
    s.for_test_set_estimate("m", 4.0)     # it turned out slower than thought
    assert s.checkpoint(job) is Verdict.STOPPED
    assert clock() < job.deadline
    assert job.status == ErrorStatus.MISSED_DEADLINE_PERSISTENT


def test_success_after_the_deadline_is_reported_as_a_miss():
    s, clock = make()
    job = s.submit("app", MEDIUM, deadline=clock() + 1.0)
    clock.advance(0.4)
    assert s.finish(job) == ErrorStatus.NONE
    blocker = s.submit("app", MEDIUM)
    late = s.submit("app", MEDIUM, deadline=clock() + 1.0)
    clock.advance(0.5)
    s.finish(blocker)
    clock.advance(0.7)
    assert s.finish(late) == ErrorStatus.MISSED_DEADLINE_TRANSIENT
    assert s.statistics().of("app", MEDIUM).deadline_misses == 1


def test_run_time_estimate_is_a_moving_average_of_completed_runs():
    s, clock = make()
    assert s.estimate("m") is None
    for seconds in (1.0, 2.0):
        job = s.submit("app", MEDIUM, model="m")
        clock.advance(seconds)
        s.finish(job)
    assert s.estimate("m") == pytest.approx(1.25)
    job = s.submit("app", MEDIUM, model="m")
    clock.advance(100.0)
    s.finish(job, ErrorStatus.GENERAL_FAILURE)      # failed runs teach nothing
    assert s.estimate("m") == pytest.approx(1.25)


def test_queue_limit_is_per_app_and_transient_when_the_app_fails_fast():
    s, _ = make(queue_limit=2, settings=lambda app: AppSettings(fail_when_full=(app == "A")))
    s.submit("A", MEDIUM)
    s.submit("A", MEDIUM)
    s.submit("A", MEDIUM)
    with pytest.raises(NnrtError) as e:
        s.submit("A", HIGH)
    assert e.value.status == ErrorStatus.RESOURCE_EXHAUSTED_TRANSIENT
    assert "limit is 2" in str(e.value)
    s.submit("B", MEDIUM)      # another app is not affected
    s.submit("B", MEDIUM)
    held = s.submit("B", MEDIUM)     # B waits for a place instead (the default)
    assert held.held and held.state is JobState.QUEUED


def test_memory_limit_is_persistent():
    s, _ = make(memory_limit=1000)
    s.check_memory(1000)
    with pytest.raises(NnrtError) as e:
        s.check_memory(1001, "model m")
    assert e.value.status == ErrorStatus.RESOURCE_EXHAUSTED_PERSISTENT
    assert "model m needs 1001 bytes" in str(e.value)


@pytest.mark.parametrize("kwargs, words", [
    ({"priority": 5}, "priority 5"),
    ({"priority": "HIGH"}, "priority 'HIGH'"),
    ({"deadline": "soon"}, "deadline 'soon'"),
    ({"deadline": float("nan")}, "deadline nan"),
    ({"deadline": True}, "deadline True"),
    ({"app": ["not", "hashable"]}, "app key"),
    ({"model": {}}, "model key"),
])
def test_invalid_values_are_invalid_argument(kwargs, words):
    s, _ = make()
    args = {"app": "app", "priority": MEDIUM, **kwargs}
    with pytest.raises(NnrtError) as e:
        s.submit(args.pop("app"), args.pop("priority"), **args)
    assert e.value.status == ErrorStatus.INVALID_ARGUMENT
    assert words in str(e.value)
    assert s.statistics().classes == ()


@pytest.mark.parametrize("kwargs", [{"slots": 0}, {"queue_limit": -1}, {"slots": 1.5},
                                    {"memory_limit": -5}])
def test_invalid_settings_are_invalid_argument(kwargs):
    with pytest.raises(NnrtError) as e:
        Scheduler(**kwargs)
    assert e.value.status == ErrorStatus.INVALID_ARGUMENT


def test_deadline_in_is_on_the_monotonic_clock():
    import time
    before = time.monotonic()
    d = deadline_in(ms=250)
    assert before + 0.25 <= d <= time.monotonic() + 0.25
    assert deadline_in(s=1.0) > d
    with pytest.raises(NnrtError) as e:
        deadline_in(ms=float("inf"))
    assert e.value.status == ErrorStatus.INVALID_ARGUMENT


def test_cancelling_a_queued_job_withdraws_it_and_wakes_its_owner():
    s, _ = make()
    blocker = s.submit("app", MEDIUM)
    job = s.submit("app", MEDIUM)
    s.take_wakeups()
    s.cancel(job)
    assert job.state is JobState.DONE and s.take_wakeups() == [job]
    s.finish(blocker)
    assert s.statistics().of("app", MEDIUM).cancelled == 1
    assert s.statistics().of("app", MEDIUM).queued == 0


def test_cancelling_a_running_job_stops_it_at_the_next_boundary_and_frees_the_slot():
    s, _ = make()
    job = s.submit("app", MEDIUM)
    nxt = s.submit("app", MEDIUM)
    s.cancel(job)
    assert job.state is JobState.RUNNING and nxt.state is JobState.QUEUED
    assert s.checkpoint(job) is Verdict.STOPPED
    assert nxt.state is JobState.RUNNING
    assert s.finish(job) == ErrorStatus.GENERAL_FAILURE   # already over: finish is a no-op
    assert s.statistics().of("app", MEDIUM).cancelled == 1


def test_cancelling_a_preempted_job():
    s, _ = make()
    low = s.submit("app", LOW)
    high = s.submit("app", HIGH)
    assert s.checkpoint(low) is Verdict.PREEMPTED
    s.take_wakeups()
    s.cancel(low)
    assert low.state is JobState.DONE and s.take_wakeups() == [low]
    s.finish(high)
    assert s.statistics().busy == 0


def test_statistics_per_app_and_priority():
    s, clock = make()
    jobs = [s.submit("app", LOW) for _ in range(5)]
    for k, job in enumerate(jobs):
        assert job.state is JobState.RUNNING
        if k == 2:
            low = s.statistics().of("app", LOW)
            assert (low.running, low.queued, low.completed) == (1, 2, 2)
        clock.advance(1.0)
        s.finish(job)
    stats = s.statistics()
    low = stats.of("app", LOW)
    assert (low.queued, low.running, low.completed, low.run_time) == (0, 0, 5, 5.0)
    assert (low.wait_p50, low.wait_p99) == (2.0, 4.0)     # waits were 0, 1, 2, 3, 4 s
    assert stats.of("nobody", MEDIUM).completed == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        low.completed = 0


def test_load_counts_waiting_and_running_jobs_and_a_recent_median_run_time():
    s, clock = make(slots=2)
    assert s.load() == SchedulerLoad(0, 0, 2, None)     # no job finished yet
    jobs = [s.submit(app, MEDIUM) for app in ("a", "b", "a", "c")]
    assert s.load() == SchedulerLoad(2, 2, 2, None)
    clock.advance(4.0)
    s.finish(jobs[0])
    assert s.load() == SchedulerLoad(1, 2, 2, 4.0)
    for job in jobs[1:]:
        s.finish(job)
    assert (s.load().queued, s.load().running) == (0, 0)
    # A slow first run (an interpreter warming up) is one sample of the
    # median: once enough fast runs came, it does not count.
    s, clock = make()
    for ran in [50.0] + [1.0] * (SERVICE_SAMPLES // 2) + [2.0] * (SERVICE_SAMPLES // 2):
        job = s.submit("app", MEDIUM)
        clock.advance(ran)
        s.finish(job)
    assert s.load().service_time == 1.0      # not 50: the slow one is the outlier
    job = s.submit("app", MEDIUM)
    clock.advance(2.0)
    s.finish(job)     # the window holds the last SERVICE_SAMPLES: more 2 s runs than 1 s
    assert s.load().service_time == 2.0


def test_illegal_transitions_name_the_state():
    s, _ = make()
    s.submit("app", MEDIUM)
    queued = s.submit("app", MEDIUM)
    with pytest.raises(NnrtError, match="finished while QUEUED"):
        s.finish(queued)
    with pytest.raises(NnrtError, match="boundary while QUEUED"):
        s.checkpoint(queued)


def test_forget_app():
    s, _ = make()
    s.finish(s.submit("gone", MEDIUM))
    s.forget_app("gone")
    assert s.statistics().classes == ()
    # One with work left is forgotten when its last job ends.
    running, waiting = s.submit("leaving", MEDIUM), s.submit("leaving", LOW)
    s.forget_app("leaving")
    assert {c.app for c in s.statistics().classes} == {"leaving"}
    s.finish(running)        # (the waiting one gets the slot)
    assert {c.app for c in s.statistics().classes} == {"leaving"}
    s.finish(waiting)        # its last one
    assert s.statistics().classes == ()
    assert [j.app for j in s.finished_jobs()][-2:] == ["leaving", "leaving"]


def test_a_job_on_an_idle_device_is_dispatched_with_the_accounting_of_the_queue():
    # Submitted with nobody waiting: dispatched without passing through the
    # queue, with the counters a pass through it would leave.
    s, clock = make(slots=2)
    first = s.submit("app", MEDIUM, model="m")
    second = s.submit("other", LOW, model="m")
    assert first.state is second.state is JobState.RUNNING
    assert first.started_at == first.submitted_at == 100.0
    medium = s.statistics().of("app", MEDIUM)
    assert (medium.queued, medium.running, medium.wait_p50) == (0, 1, 0.0)
    third = s.submit("app", HIGH, model="m")          # both slots taken: it queues
    assert third.state is JobState.QUEUED and s.statistics().of("app", HIGH).queued == 1
    clock.advance(2.0)
    s.finish(first)
    assert third.state is JobState.RUNNING and third.started_at == 102.0
    assert s.statistics().of("app", HIGH).wait_p50 == 2.0
    assert s.estimate("m") == 2.0


def test_continues_is_checkpoint_when_nobody_waits():
    s, clock = make()
    job = s.submit("app", LOW, model="m")
    clock.advance(0.5)
    assert s.continues(job)                   # nobody waits: CONTINUE, no lock needed
    assert job.longest_step == 0.5 and job._last_boundary == 100.5
    waiting = s.submit("app", HIGH, model="m")
    assert not s.continues(job)               # a job waits: the full checkpoint decides
    assert s.checkpoint(job) is Verdict.PREEMPTED and waiting.state is JobState.RUNNING
    s.finish(waiting)
    assert job.state is JobState.RUNNING and s.continues(job)
    s.cancel(job)
    assert not s.continues(job)               # asked to stop: the checkpoint stops it
    assert s.checkpoint(job) is Verdict.STOPPED
    late = s.submit("app", LOW, deadline=clock() + 10.0)
    assert not s.continues(late)              # a hard deadline is the checkpoint's to judge
    soft, _ = make(settings=lambda app: AppSettings(soft_deadlines=True))
    job = soft.submit("app", LOW, deadline=clock() + 10.0)
    assert soft.continues(job)                # a soft one never stops a run


def test_a_duration_given_as_a_deadline_is_told_how_to_write_one():
    """deadline=33 (33 ms meant) is long past on the monotonic clock: the
    error says so and names nnrt.deadline_in; a deadline just missed does not."""
    s, clock = make()
    clock.advance(5000)
    with pytest.raises(NnrtError) as e:
        s.submit("app", MEDIUM, deadline=33)
    assert e.value.status == ErrorStatus.MISSED_DEADLINE_TRANSIENT
    assert "nnrt.deadline_in(ms=33)" in e.value.message
    with pytest.raises(NnrtError) as e:
        s.submit("app", MEDIUM, deadline=clock() - 1)
    assert "deadline_in" not in e.value.message
