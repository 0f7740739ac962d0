"""Fair share with a latency guarantee across apps, backpressure and
truthful deadlines: one fake-clock test per invariant named in the
scheduler's theory of operation (F*, B*, D*)."""
import pytest

from nnrt import ErrorStatus, NnrtError, Priority
from nnrt.qos import AppSettings, JobState, ManualClock, Scheduler, Verdict

HIGH, MEDIUM, LOW = Priority.HIGH, Priority.MEDIUM, Priority.LOW


def make(weights=None, **kwargs):
    clock = ManualClock(100.0)
    weights = weights or {}
    settings = kwargs.pop("settings", None) or (lambda app: AppSettings(weight=weights.get(app, 1)))
    return Scheduler(clock=clock, settings=settings, **kwargs), clock


def run_op_by_op(s, clock, apps, *, until, op=0.001, ops=10, priority=MEDIUM, model=None):
    """Every app in ``apps`` keeps ``apps[app]`` jobs of ``ops`` operations
    of ``op`` seconds queued; the one slot runs them op by op with a
    checkpoint between operations, until the clock reaches ``until``."""
    left = {}

    def top_up():
        for app, depth in apps.items():
            mine = [j for j in left if j.app == app]
            for _ in range(depth - len(mine)):
                job = s.submit(app, priority, model=(model or app))
                left[job] = ops

    top_up()
    while clock() < until:
        running = [j for j in left if j.state is JobState.RUNNING]
        assert len(running) == 1
        job = running[0]
        clock.advance(op)
        left[job] -= 1
        if left[job] == 0:
            s.finish(job)
            del left[job]
        else:
            s.checkpoint(job)
        top_up()


def shares(s, apps):
    total = {app: s.statistics().run_time_of(app) for app in apps}
    return {app: t / sum(total.values()) for app, t in total.items()}


@pytest.mark.parametrize("weights,expected", [({"A": 1, "B": 1}, 0.5), ({"A": 3, "B": 1}, 0.75)])
def test_weighted_shares_follow_the_weights(weights, expected):
    # F2, with unequal job lengths and unequal queue depths.
    s, clock = make(weights)
    run_op_by_op(s, clock, {"A": 3, "B": 1}, until=clock() + 20.0)
    share = shares(s, "AB")
    assert share["A"] == pytest.approx(expected, abs=0.01)   # within one 10 ms job of 20 s


def test_weighted_shares_with_different_job_lengths():
    # F2: A's jobs are 5x longer than B's; 1:1 still splits device time evenly.
    s, clock = make({"A": 1, "B": 1})
    jobs = [s.submit(app, MEDIUM, model=app) for app, n in (("A", 30), ("B", 30))
            for _ in range(n)]
    cost = {"A": 0.005, "B": 0.001}
    while clock() < 100.05:
        job = next(j for j in jobs if j.state is JobState.RUNNING)
        clock.advance(cost[job.app])
        s.finish(job)
        jobs.append(s.submit(job.app, MEDIUM, model=job.app))   # both stay backlogged
    assert shares(s, "AB")["A"] == pytest.approx(0.5, abs=0.05)   # 5 ms of 50 ms


def test_a_light_app_below_its_share_preempts_another_apps_job():
    # F3: B floods with 10-operation jobs; A submits a light frame and gets
    # the slot at B's next boundary, not at the end of B's job.
    s, clock = make()
    s.for_test_set_estimate("heavy", 0.010)
    s.for_test_set_estimate("light", 0.001)
    b = [s.submit("B", LOW, model="heavy") for _ in range(3)]
    clock.advance(0.0003)
    a = s.submit("A", HIGH, model="light")
    assert a.state is JobState.QUEUED
    assert s.checkpoint(b[0]) is Verdict.PREEMPTED
    assert a.state is JobState.RUNNING and a.started_at - a.submitted_at == pytest.approx(0.0)
    assert s.statistics().of("B", LOW).preempted == 1
    clock.advance(0.001)
    s.finish(a)
    assert b[0].state is JobState.RUNNING      # B resumes its preempted job first


def test_the_frame_loop_of_a_light_app_waits_one_operation_per_frame():
    # F3 over time: A at 30 fps (1 ms frames) against B flooding 10 ms jobs
    # of 1 ms operations: every frame waits at most one of B's operations.
    s, clock = make()
    s.for_test_set_estimate("light", 0.001)
    s.for_test_set_estimate("heavy", 0.010)
    left = {}
    waits = []
    next_frame = clock() + 0.005
    frame = None
    for _ in range(3):
        left[s.submit("B", LOW, model="heavy")] = 10
    end = clock() + 3.0
    while clock() < end:
        if frame is None and clock() >= next_frame:
            frame = s.submit("A", HIGH, model="light")
            left[frame] = 1
            next_frame += 1 / 30
        job = next(j for j in left if j.state is JobState.RUNNING)
        clock.advance(0.001)
        left[job] -= 1
        if left[job] == 0:
            del left[job]
            s.finish(job)
            if job is frame:
                waits.append(job.started_at - job.submitted_at)
                frame = None
            else:
                left[s.submit("B", LOW, model="heavy")] = 10
        else:
            s.checkpoint(job)
    assert len(waits) >= 85
    assert max(waits) <= 0.001 + 1e-9


@pytest.mark.parametrize("weights,expected", [({"A": 1, "B": 1}, 0.5), ({"A": 3, "B": 1}, 0.75)])
def test_equal_floods_do_not_preempt_each_other(weights, expected):
    # F4, and F2 without preemptions
    s, clock = make(weights)
    for app in "AB":
        s.for_test_set_estimate(app, 0.010)
    run_op_by_op(s, clock, {"A": 2, "B": 2}, until=clock() + 2.0)
    stats = s.statistics()
    assert stats.of("A", MEDIUM).preempted == 0 and stats.of("B", MEDIUM).preempted == 0
    assert shares(s, "AB")["A"] == pytest.approx(expected, abs=0.01)


def test_a_job_far_over_its_estimate_is_preempted_for_a_waiting_app():
    # F4's exception: an estimate that was wrong does not lock the others out.
    s, clock = make()
    s.for_test_set_estimate("A", 0.010)
    s.for_test_set_estimate("B", 0.010)
    a = s.submit("A", MEDIUM, model="A")
    b = s.submit("B", MEDIUM, model="B")
    clock.advance(0.015)                       # 1.5x: noise, keeps the slot
    assert s.checkpoint(a) is Verdict.CONTINUE
    clock.advance(0.010)                       # 2.5x: the estimate was wrong
    assert s.checkpoint(a) is Verdict.PREEMPTED
    assert b.state is JobState.RUNNING


def test_an_app_ahead_of_its_share_does_not_preempt():
    # F6: A has used far more than B; A's short job must wait for B's job.
    s, clock = make()
    s.for_test_set_estimate("light", 0.001)
    s.for_test_set_estimate("heavy", 0.010)
    a0 = s.submit("A", MEDIUM, model="heavy")
    b0 = s.submit("B", MEDIUM, model="heavy")      # waits, level with A
    clock.advance(1.0)                              # A's job overran: A is far ahead
    s.finish(a0)
    assert b0.state is JobState.RUNNING
    a1 = s.submit("A", HIGH, model="light")
    clock.advance(0.001)
    assert s.checkpoint(b0) is Verdict.CONTINUE
    assert a1.state is JobState.QUEUED


def test_weights_level_an_idle_app_in_virtual_time():
    # F5 with weights: B (weight 1) floods; A (weight 3) idle for a long
    # time comes back level with B's virtual time, not 3x ahead in credit.
    s, clock = make({"A": 3, "B": 1})
    run_op_by_op(s, clock, {"B": 2}, until=clock() + 5.0)
    b_virtual = s._apps["B"].settled
    s.submit("A", MEDIUM, model="A")
    assert s._apps["A"].service == pytest.approx(3 * b_virtual, rel=0.01)


def _runs_in_a_row(s, clock, jobs, other_job, seconds=1.0):
    """Run ``jobs``' app's jobs (each ``seconds`` long), each replaced by a
    new one just before it ends (its app stays backlogged), until
    ``other_job`` gets the slot; how many ran first."""
    n = 0
    while other_job.state is not JobState.RUNNING:
        job = next(j for j in jobs if j.state is JobState.RUNNING)
        clock.advance(seconds)
        jobs.append(s.submit(job.app, MEDIUM, model=job.app))
        s.finish(job)
        n += 1
    return n


def test_an_idle_app_keeps_the_lag_it_had_when_it_left():
    # F5': A goes idle while behind B (B's 3 s job ran while A waited); when
    # A comes back it is still owed that lag, up to one of its own jobs, so
    # it runs two 1 s jobs in a row after B's next one. Levelling it with B
    # instead (as before) forgot what B's long job took from it: A ran one,
    # then the tie went to B. A client slow to resubmit goes idle like this
    # at every gap, on a loaded host many times a second.
    s, clock = make()
    s.for_test_set_estimate("A", 1.0)
    s.for_test_set_estimate("B", 1.0)
    b0 = s.submit("B", MEDIUM, model="B")
    a0 = s.submit("A", MEDIUM, model="A")          # levelled with B's settled 0
    b1 = s.submit("B", MEDIUM, model="B")
    clock.advance(3.0)                              # B's job took 3 s
    s.finish(b0)
    assert a0.state is JobState.RUNNING             # A: 0 < B: 3
    clock.advance(1.0)
    s.finish(a0)                                    # A idle, 2 s behind B: keeps 1 (one job)
    assert b1.state is JobState.RUNNING             # A has nothing queued: B goes on
    a1 = s.submit("A", MEDIUM, model="A")           # A's client resubmits during B's job
    assert s._apps["A"].service == pytest.approx(2.0)
    b2 = s.submit("B", MEDIUM, model="B")
    clock.advance(1.0)
    s.finish(b1)                                    # B: 4, A: 2
    assert _runs_in_a_row(s, clock, [a1], b2) == 2


def test_an_idle_app_banks_no_credit_beyond_its_lag():
    # F5': however long A was idle, it comes back at most one of its jobs
    # behind the least-served active app.
    s, clock = make({"A": 3, "B": 1})
    s.for_test_set_estimate("A", 0.010)
    a0 = s.submit("A", MEDIUM, model="A")
    clock.advance(0.010)
    s.finish(a0)                                    # A idle, nobody else: no lag
    run_op_by_op(s, clock, {"B": 2}, until=clock() + 5.0)
    s.submit("A", MEDIUM, model="A")
    b_virtual = s._apps["B"].settled
    assert 3 * (b_virtual - 0.010 / 3) - 1e-9 <= s._apps["A"].service <= 3 * b_virtual + 1e-9


def test_a_new_app_is_not_owed_what_others_ran_before_it_came():
    # F7: A has run 100 frames alone (0.1 s of device time) when B starts
    # flooding. B starts at the system's virtual time, where A left it, so
    # A's next frame preempts B at its next boundary. Placed at zero, B was
    # owed A's 0.1 s first: A's frame waited for B to run all of it (in a
    # driver service, seconds when A had run beside another flood before).
    s, clock = make()
    s.for_test_set_estimate("light", 0.001)
    s.for_test_set_estimate("heavy", 0.010)
    for _ in range(100):
        frame = s.submit("A", HIGH, model="light")
        clock.advance(0.001)
        s.finish(frame)
        clock.advance(0.032)
    b = [s.submit("B", LOW, model="heavy") for _ in range(3)]
    clock.advance(0.001)
    assert s.checkpoint(b[0]) is Verdict.CONTINUE
    frame = s.submit("A", HIGH, model="light")
    clock.advance(0.001)
    assert s.checkpoint(b[0]) is Verdict.PREEMPTED
    assert frame.state is JobState.RUNNING
    assert s._apps["B"].settled == pytest.approx(0.100 + 0.002)   # from A's 0.1 s, not 0


def test_an_app_back_while_all_were_idle_banks_no_credit():
    # F7 (F5 when nobody is active): A ran one job, then B ran 5 s alone
    # and went idle too. A comes back while no app is active: at B's
    # virtual time, not at its own 5 s behind, so when B floods again the
    # two split the device from there instead of A taking 5 s first.
    s, clock = make()
    a0 = s.submit("A", MEDIUM, model="A")
    clock.advance(0.010)
    s.finish(a0)
    for _ in range(50):
        job = s.submit("B", MEDIUM, model="B")
        clock.advance(0.1)
        s.finish(job)
    a1 = s.submit("A", MEDIUM, model="A")
    assert s._apps["A"].settled == pytest.approx(s._apps["B"].settled)   # 5.01 s, not 0.01
    clock.advance(0.010)
    s.finish(a1)
    before = {app: s.statistics().run_time_of(app) for app in "AB"}
    run_op_by_op(s, clock, {"A": 2, "B": 2}, until=clock() + 1.0)
    ran = {app: s.statistics().run_time_of(app) - before[app] for app in "AB"}
    assert ran["A"] / (ran["A"] + ran["B"]) == pytest.approx(0.5, abs=0.02)


def test_a_pinned_job_is_not_preempted_but_still_stops():
    # P1: a job running on another app's preempted job's thread keeps the
    # slot against a more important job of its own app and against another
    # app's short job; a cancellation still stops it at its next boundary.
    s, clock = make()
    s.for_test_set_estimate("long", 0.010)
    s.for_test_set_estimate("short", 0.001)
    a = s.submit("A", LOW, model="long")
    s.pin(a)
    mine = s.submit("A", HIGH, model="short")
    other = s.submit("B", HIGH, model="short")
    clock.advance(0.025)                           # overran, and B is far behind
    assert s.checkpoint(a) is Verdict.CONTINUE
    assert mine.state is other.state is JobState.QUEUED
    s.cancel(a)
    assert s.checkpoint(a) is Verdict.STOPPED
    assert JobState.RUNNING in (mine.state, other.state)
    with pytest.raises(NnrtError):
        s.pin(mine if mine.state is JobState.QUEUED else other)


def test_a_full_queue_holds_new_jobs_until_a_place_frees():
    # B1: beyond the queue limit jobs are held, then queued oldest first.
    s, clock = make(queue_limit=2)
    jobs = [s.submit("A", MEDIUM) for _ in range(6)]      # 1 running, 2 queued, 3 held
    assert [j.held for j in jobs] == [False, False, False, True, True, True]
    assert s.statistics().of("A", MEDIUM).queued == 5
    order = []
    while any(j.state is not JobState.DONE for j in jobs):
        job = next(j for j in jobs if j.state is JobState.RUNNING)
        order.append(job)
        clock.advance(0.01)
        assert s.finish(job) == ErrorStatus.NONE
    assert order == jobs
    # Cancelling a held job withdraws it.
    more = [s.submit("A", MEDIUM) for _ in range(5)]
    s.cancel(more[-1])
    assert more[-1].state is JobState.DONE and not more[-1].held
    assert len(s._apps["A"].held) == 1


def test_a_hundred_jobs_of_one_app_all_complete():
    # B1 with the default queue limit of 32.
    s, clock = make()
    jobs = [s.submit("A", MEDIUM) for _ in range(100)]
    while any(j.state is not JobState.DONE for j in jobs):
        job = next(j for j in jobs if j.state is JobState.RUNNING)
        clock.advance(0.001)
        s.finish(job)
    assert all(j.status == ErrorStatus.NONE for j in jobs)


def test_persistent_only_beyond_the_margin():
    # D1: a 40 ms estimate against a 33 ms budget is too close to call.
    s, clock = make()
    s.for_test_set_estimate("m", 0.040)
    with pytest.raises(NnrtError) as e:
        s.submit("A", MEDIUM, deadline=clock() + 0.033, model="m")
    assert e.value.status == ErrorStatus.MISSED_DEADLINE_TRANSIENT
    s.for_test_set_estimate("m", 0.050)           # 25 % faster is still 37.5 ms
    with pytest.raises(NnrtError) as e:
        s.submit("A", MEDIUM, deadline=clock() + 0.033, model="m")
    assert e.value.status == ErrorStatus.MISSED_DEADLINE_PERSISTENT


def test_a_refused_model_gets_a_probe_run_and_recovers():
    # D2: the lockout scenario. One slow run (a busy host) makes a 5 ms
    # model look like 180 ms; a 30 fps loop with 33 ms deadlines is refused,
    # then a probe runs, measures 5 ms, and the loop runs again.
    s, clock = make()
    job = s.submit("A", MEDIUM, model="m")
    clock.advance(0.180)
    s.finish(job)
    outcomes = []
    for frame in range(20):
        try:
            job = s.submit("A", MEDIUM, deadline=clock() + 0.033, model="m")
        except NnrtError as e:
            outcomes.append(e.status)
        else:
            assert job.state is JobState.RUNNING
            clock.advance(0.005)
            outcomes.append(s.finish(job))
        clock.advance(1 / 30)
    ok = [i for i, o in enumerate(outcomes) if o == ErrorStatus.NONE]
    assert ok and ok[0] < 5, outcomes                       # recovers within 5 frames
    assert ok == list(range(ok[0], 20)), outcomes            # and stays recovered
    assert s.estimate("m") == pytest.approx(0.005)


def test_a_probe_during_a_slow_spell_reports_its_miss_and_learns():
    # D2: while the model really is slow, probes run, report the miss truthfully.
    s, clock = make()
    s.for_test_set_estimate("m", 0.100)
    outcomes = []
    for frame in range(9):
        try:
            job = s.submit("A", MEDIUM, deadline=clock() + 0.033, model="m")
        except NnrtError as e:
            outcomes.append(e.status)
        else:
            assert job.probe
            clock.advance(0.100)
            outcomes.append(s.finish(job))
        clock.advance(1 / 30)
    # Every third frame is a probe; it ran alone for 100 ms against 33 ms,
    # so its miss is PERSISTENT too: measured, not guessed.
    P = ErrorStatus.MISSED_DEADLINE_PERSISTENT
    assert outcomes == [P] * 9
    probes = [r for r in s.finished_jobs() if r.started_at is not None]
    assert len(probes) == 3 and all(r.ran == pytest.approx(0.1) for r in probes)


def test_a_probe_is_not_aborted_on_its_estimate():
    s, clock = make()
    s.for_test_set_estimate("m", 0.100)
    for _ in range(2):
        with pytest.raises(NnrtError):
            s.submit("A", MEDIUM, deadline=clock() + 0.033, model="m")
    probe = s.submit("A", MEDIUM, deadline=clock() + 0.033, model="m")
    clock.advance(0.010)
    assert s.checkpoint(probe) is Verdict.CONTINUE
    clock.advance(0.030)                      # now really past the deadline
    assert s.checkpoint(probe) is Verdict.STOPPED
    assert probe.status == ErrorStatus.MISSED_DEADLINE_TRANSIENT


def test_soft_deadlines_run_late_and_report_the_miss():
    s, clock = make(settings=lambda app: AppSettings(soft_deadlines=True))
    s.for_test_set_estimate("m", 1.0)
    job = s.submit("A", MEDIUM, deadline=clock() + 0.5, model="m")    # hard would refuse
    assert job.state is JobState.RUNNING
    clock.advance(0.6)
    assert s.checkpoint(job) is Verdict.CONTINUE                      # hard would abort
    clock.advance(0.4)
    # It ran alone for 1 s against 0.5 s: too slow even on an idle device.
    assert s.finish(job) == ErrorStatus.MISSED_DEADLINE_PERSISTENT
    assert s.statistics().of("A", MEDIUM).deadline_misses == 1
    blocker = s.submit("A", MEDIUM)
    late = s.submit("A", MEDIUM, deadline=clock() + 0.5, model="m")
    clock.advance(1.0)
    s.finish(blocker)                                                  # hard would refuse
    assert late.state is JobState.RUNNING
    clock.advance(0.2)
    assert s.finish(late) == ErrorStatus.MISSED_DEADLINE_TRANSIENT    # late from waiting


def test_new_settings_apply_to_known_apps_and_release_held_jobs():
    s, clock = make(queue_limit=1)
    jobs = [s.submit("A", MEDIUM) for _ in range(4)]           # running, queued, 2 held
    assert sum(j.held for j in jobs) == 2
    s.set_settings(lambda app: AppSettings(weight=2, queue_limit=8))
    assert s.settings_of("A").weight == 2
    assert not any(j.held for j in jobs)


def test_a_broken_policy_falls_back_to_defaults():
    def broken(app):
        raise KeyError(app)
    s, _ = make(settings=broken)
    assert s.submit("A", MEDIUM).state is JobState.RUNNING
    assert s.settings_of("A") == AppSettings()


@pytest.mark.parametrize("kwargs", [dict(weight=0), dict(weight=-1), dict(weight=True),
                                    dict(queue_limit=0), dict(memory_limit=-1),
                                    dict(max_priority=7)])
def test_invalid_app_settings(kwargs):
    with pytest.raises(NnrtError) as e:
        AppSettings(**kwargs)
    assert e.value.status == ErrorStatus.INVALID_ARGUMENT
