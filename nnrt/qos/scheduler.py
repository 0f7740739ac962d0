"""The per-app priority scheduler that sits in front of a driver.

Theory of operation
-------------------
The scheduler is a pure state machine: no threads, no I/O, no sleeping. Time
comes from the ``clock`` it is given (``time.monotonic`` in drivers, a
:class:`~nnrt.qos.clock.ManualClock` in tests), and every decision is taken
inside one of the calls below, so a test can replay any interleaving exactly.
Callers that run jobs on threads wrap it in :class:`~nnrt.qos.gate.ExecutionGate`,
which adds the one lock and the wake-ups.

*Jobs.* ``submit`` turns one execution request into a :class:`Job` that moves
through the states of ``_TRANSITIONS``: QUEUED -> RUNNING (holds one of the
``slots``) -> DONE, with two detours: a RUNNING job can be PREEMPTED at an
operation boundary and later RUNNING again, and a waiting job can be refused
or cancelled. Whoever executes a RUNNING job calls ``checkpoint(job)`` at every
operation boundary and ``finish(job, status)`` at the end.

*Order inside an app.* Each app (an opaque hashable key chosen by the caller:
the peer uid or pid of a driver service's client, the process id in-process)
has one queue sorted by ``(priority, preempted first, deadline, arrival)``:
HIGH before MEDIUM before LOW, then the earliest deadline (none last), then
first come first served. A preempted job sorts before every not-yet-started
job of its priority level, so it resumes before newer work of its level.

*Fairness between apps* (EEVDF-like). Each app has a *weight* (its
:class:`AppSettings`, from the operator's policy; 1 by default) and an
*attained service*: device seconds charged to it so far. Its *virtual time*
is service / weight. When a slot is free, the app served next is the one
with work waiting and the least virtual time. A job is charged its run-time
estimate when it gets a slot and the difference to the measured time when
it gives the slot back, so concurrent slots are accounted while in flight.
An app that was idle starts level with the least-served active app's
*settled* virtual time (without charges for work still in flight), less
the lag it had when it went idle (how far it was behind, at most one of its
own jobs, as EEVDF keeps a sleeping task's lag): it cannot bank credit
while idle, nor lose what it was owed because its client was a moment late
to resubmit; and levelling up to a charge made a moment ago would erase the
small lag an app with one request outstanding always has when it resubmits.
A new app starts there too, with no lag. When no other app is active, the
floor is the *system's virtual time*: that of the last app that went idle
(EEVDF's V, CFS's min_vruntime), never zero -- a newcomer placed at zero
would be owed everything the others ever ran. Ties go to the app served
longest ago (round robin).
Over time backlogged apps get device time in proportion to their weights.

*Preemption.* At each boundary ``checkpoint`` asks two questions, in order:

1. Within the app (NNAPI: priority is relative among one app's models): is
   the head of the job's own queue of a higher priority? Then the running
   job gives its slot to that job, not to the fairness pick: the app spends
   its own turn on its more important work.
2. Across apps (the latency guarantee): is there another app that is
   *eligible* — its settled virtual time is not ahead of the running app's
   current one (settled plus the time this job has run so far), so it has
   had no more than its share — whose next job has an earlier *virtual
   deadline*, and a head job at most half as long (``_SHORTER``) as the
   running job?
   A waiting app's virtual deadline is (service + its head job's remaining
   estimate) / weight; the running job's is (its app's settled service when
   it was dispatched + the larger of its estimate and the time it has run)
   / weight. Lengths are estimates; a running job that has run ``_OVERRUN``
   times its estimate counts as longer than anything (its estimate was
   wrong, not noisy). Then the running job is preempted and the slot goes to that app's head
   job. So a light app below its share (a 1 ms frame against another app's
   10 ms jobs) waits for one operation of the other app, not for its whole
   job. The "shorter" test keeps apps flooding with jobs of similar length
   from chopping each other's jobs (weighted fair queueing at operation
   granularity would preempt a weight-1 app's job several times per job of
   a weight-3 app, each preemption a thread switch, for no gain in
   fairness): their shares come from the choice at dispatch.

The executor keeps a preempted job's context (next operation, live operand
values) and resumes it when the scheduler dispatches it again; a preempted
job sorts before every not-yet-started job of its priority level.

A pinned job (``pin``: the gate runs it on the thread of another app's
job it preempted) is never preempted until it ends (P1,
``test_a_pinned_job_is_not_preempted_but_still_stops``): that thread
holds the preempted job's context below it.

Invariants (asserted where the state changes where that is cheap; each has
a fake-clock test in ``tests/unit/test_scheduler_fair.py`` or
``tests/unit/test_scheduler.py``):

- F1 an app's queue is served in ``(priority, preempted first, deadline,
  arrival)`` order
  (``test_one_app_is_served_by_priority_then_deadline_then_arrival``);
- F2 backlogged apps get device time in proportion to their weights, within
  one job (``test_weighted_shares_follow_the_weights``);
- F3 an eligible app whose head job has an earlier virtual deadline than
  another app's running job gets the slot at that job's next boundary
  (``test_a_light_app_below_its_share_preempts_another_apps_job``);
- F4 jobs of two apps with equal estimates do not preempt each other,
  whatever their weights, unless one overruns its estimate ``_OVERRUN``
  times (``test_equal_floods_do_not_preempt_each_other``,
  ``test_a_job_far_over_its_estimate_is_preempted_for_a_waiting_app``);
- F5 an app that was idle cannot bank credit: it comes back level with the
  least-served active app, less the lag it had when it left, at most one
  of its jobs (``test_an_idle_app_does_not_bank_credit``,
  ``test_weights_level_an_idle_app_in_virtual_time``,
  ``test_an_idle_app_keeps_the_lag_it_had_when_it_left``,
  ``test_an_idle_app_banks_no_credit_beyond_its_lag``);
- F6 an app is preempted across apps only by an app that is not ahead of it
  in virtual time (asserted in ``checkpoint``;
  ``test_an_app_ahead_of_its_share_does_not_preempt``).
- F7 an app that arrives (new, or back from idle) while no other app is
  active starts at the system's virtual time, which never goes back: it is
  not owed what other apps ran before it came
  (``test_a_new_app_is_not_owed_what_others_ran_before_it_came``,
  ``test_an_app_back_while_all_were_idle_banks_no_credit``).

*Backpressure.* Each app may have ``queue_limit`` jobs in its queue. By
default a job submitted beyond that is *held* (QUEUED, but not in the queue,
so never dispatched) and moves into the queue, oldest first, as places free
up: the caller simply waits longer (B1,
``test_a_full_queue_holds_new_jobs_until_a_place_frees``). An app whose
settings say ``fail_when_full`` gets RESOURCE_EXHAUSTED_TRANSIENT instead.
Held jobs are bounded too (``_HOLD_FACTOR`` times the queue limit) so a
runaway caller cannot grow a service without bound.

*Deadlines.* Each model has a run-time estimate: the smaller of an
exponential moving average of the time its completed runs held a slot and
its latest run (one slow run on a busy host must not make a 5 ms model look
like a 50 ms one for the next dozen frames). A job with a *hard* deadline
(the default) is *hopeless* at time ``now`` when ``now + remaining estimate >
deadline``; it is refused at submission, skipped with a refusal at dequeue,
or aborted at an operation boundary. The code says whose fault it is:
PERSISTENT only when the estimate itself says an idle device cannot make it
with a margin (its run time so far plus the remaining estimate shrunk by
``_PERSISTENT_MARGIN`` still exceeds the time it had at submission);
TRANSIENT otherwise — late because the device was busy, a deadline that had
passed at submission, or too close to call (D1,
``test_persistent_only_beyond_the_margin``). Estimates are re-measured (D2,
``test_a_refused_model_gets_a_probe_run_and_recovers``): once
``_PROBE_AFTER`` jobs of a model in a row were refused on its estimate, the
next one is a *probe*: admitted, never refused or aborted on the estimate
(only when its deadline has actually passed), and measured; if it finishes
late it is reported as a miss, which is the truth. So a loop whose model was
slow once recovers within a few frames. A job with a *soft* deadline
(``AppSettings.soft_deadlines``) is never refused or aborted: it runs to the
end and reports the miss if it finished late. A job that finishes after its
deadline is never reported as a success (``finish`` turns NONE into a miss).

*Waking.* Every state change that the owner of a job must notice (a dispatch,
a refusal, a cancellation of a waiting job) appends the job to an outbox the
caller drains with ``take_wakeups``. A waiting job's ``wake_time`` says when
it becomes hopeless, so a caller with a timer calls ``poll`` then and the job
is refused at once instead of waiting for a slot.
"""
from __future__ import annotations

import bisect
import enum
import itertools
import math
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable, Hashable

from ..errors import (STATUS_INSUFFICIENT as _INSUFFICIENT, STATUS_NONE as _NONE, ErrorStatus,
                      NnrtError, invalid)
from ..vlog import on as vlog_on, vlog
from ..hal.types import Priority, check_deadline, check_priority

DEFAULT_QUEUE_LIMIT = 32     # waiting jobs per app before RESOURCE_EXHAUSTED_TRANSIENT
_ESTIMATE_WEIGHT = 0.25      # weight of the newest run in the moving average
# PERSISTENT only when even a run this much faster than the estimate could
# not make the deadline: estimates are noisy (a busy host stretches runs),
# and PERSISTENT tells the app to give up on the deadline altogether.
_PERSISTENT_MARGIN = 0.25
# A deadline this far (seconds) before its submission was not a late
# deadline but a duration taken for a time: the error says how to write one.
_A_DURATION_MISTAKEN = 60.0
# A running job that overran its estimate by less than this factor is noise
# and is not preempted for it; beyond, its estimate was wrong.
_OVERRUN = 2.0
# Across apps, a waiting job preempts only a running job at least 1/_SHORTER
# times as long (by estimate): estimates of similar jobs differ by noise.
_SHORTER = 0.5
_PROBE_AFTER = 2             # refusals of a model in a row on its estimate before a probe run
_HOLD_FACTOR = 32            # held jobs per app, in queue limits, before failing anyway
_MAX_ESTIMATES = 4096        # models remembered (least recently used are forgotten)
_WAIT_SAMPLES = 1024         # queue waits kept per (app, priority) for percentiles


@dataclass(frozen=True)
class AppSettings:
    """What the operator's policy says about one app (``nnrt/qos/policy.py``
    reads them from TOML). None means the device's own setting."""

    weight: float = 1.0                       # share of the device, relative to other apps
    max_priority: Priority = Priority.HIGH    # higher requested priorities are lowered to this
    queue_limit: int | None = None            # jobs in its queue (None: the scheduler's)
    memory_limit: int | None = None           # bytes per model (None: the device's)
    soft_deadlines: bool = False              # run late and report the miss, never refuse
    fail_when_full: bool = False              # RESOURCE_EXHAUSTED at the queue limit, not wait
    # What a driver service lets the app hold at once, over all its
    # connections (None: the service's --limit *_per_app).
    connections: int | None = None
    models: int | None = None                 # prepared models
    bursts: int | None = None                 # burst sessions (a service thread each)
    name: str | None = None                   # the policy rule that matched (for status)
    # The app as the policy saw it, for status: a label, not a setting.
    who: str | None = field(default=None, compare=False)

    def __post_init__(self):
        if isinstance(self.weight, bool) or not isinstance(self.weight, (int, float)) \
                or not 0 < self.weight < math.inf:
            raise invalid(f"an app's weight must be a positive number, got {self.weight!r}")
        object.__setattr__(self, "max_priority", check_priority(self.max_priority))
        for what in ("queue_limit", "memory_limit", "connections", "models", "bursts"):
            value = getattr(self, what)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < (0 if what == "memory_limit" else 1)):
                raise invalid(f"{what} must be None or a positive integer, got {value!r}")


DEFAULT_SETTINGS = AppSettings()

# NNRT_VLOG is read once, at import (nnrt.vlog): whether every run logs is
# decided once here too, not by a call on every submit, dispatch and end.
_VLOG = vlog_on("execution")

# App and model keys hashable by their type: not hashed again to be checked.
_PLAIN_KEYS = frozenset({int, str, type(None)})


class JobState(enum.Enum):
    QUEUED = "queued"          # waiting for its first slot
    RUNNING = "running"        # holds a slot
    PREEMPTED = "preempted"    # gave its slot back at a boundary; waits to resume
    DONE = "done"              # finished, refused, aborted or cancelled; ``status`` says which

    # Members are singletons: hash by identity (in C), not Enum's hash of the
    # name (a Python call on every ``_TRANSITIONS`` lookup).
    __hash__ = object.__hash__


class _Event(enum.Enum):
    DISPATCH = "dispatch"
    PREEMPT = "preempt"
    FINISH = "finish"
    STOP = "stop"        # aborted or cancelled at an operation boundary
    REFUSE = "refuse"    # a waiting job that cannot make its deadline
    CANCEL = "cancel"    # a waiting job withdrawn by its owner

    __hash__ = object.__hash__   # as JobState's


# The states and events every execution reads, bound once as the statuses
# are (nnrt.errors.STATUS_NONE: a member read off its class is slow on 3.11).
_RUNNING, _PREEMPTED, _DONE = JobState.RUNNING, JobState.PREEMPTED, JobState.DONE
_DISPATCH = _Event.DISPATCH

_TRANSITIONS = {
    (JobState.QUEUED, _Event.DISPATCH): JobState.RUNNING,
    (JobState.QUEUED, _Event.REFUSE): JobState.DONE,
    (JobState.QUEUED, _Event.CANCEL): JobState.DONE,
    (JobState.RUNNING, _Event.PREEMPT): JobState.PREEMPTED,
    (JobState.RUNNING, _Event.FINISH): JobState.DONE,
    (JobState.RUNNING, _Event.STOP): JobState.DONE,
    (JobState.PREEMPTED, _Event.DISPATCH): JobState.RUNNING,
    (JobState.PREEMPTED, _Event.REFUSE): JobState.DONE,
    (JobState.PREEMPTED, _Event.CANCEL): JobState.DONE,
}


class Verdict(enum.Enum):
    """What ``checkpoint`` tells the executor to do at an operation boundary."""

    CONTINUE = "continue"      # go on with the next operation
    PREEMPTED = "preempted"    # park, keeping the context, until dispatched again
    STOPPED = "stopped"        # unwind: ``job.status`` / ``job.message`` say why


@dataclass(eq=False, slots=True)
class Job:
    """One execution as the scheduler sees it. Callers read its fields; only
    the scheduler changes them. Times are in the scheduler's clock."""

    app: Hashable
    priority: Priority
    deadline: float | None
    model: Hashable
    seq: int
    submitted_at: float
    state: JobState = JobState.QUEUED
    started_at: float | None = None     # first dispatch
    finished_at: float | None = None
    ran: float = 0.0                    # seconds spent holding a slot (excludes waits)
    preemptions: int = 0
    longest_step: float = 0.0           # longest time between two boundaries holding a slot
                                        # (waking its thread included; ``ran`` excludes it)
    status: ErrorStatus | None = None   # set when DONE
    message: str = ""
    cancel_requested: bool = False
    probe: bool = False                 # admitted to re-measure a model its estimate refused
    soft: bool = False                  # soft deadline: never refused or aborted, only reported
    held: bool = False                  # beyond its app's queue limit, waiting for a place
    pinned: bool = False                # runs on another app's preempted job's thread (``pin``)
    _slot_since: float = 0.0
    _run_since: float = 0.0             # when its thread took the slot (``resumed``)
    _vstart: float = 0.0                # its app's settled service when dispatched
    _last_boundary: float = 0.0
    _charged: float = 0.0
    _cls: "_Class | None" = None        # its (app, priority) counters, found once

    def _order(self) -> tuple:
        preempted = 0 if self.state is JobState.PREEMPTED else 1
        deadline = self.deadline if self.deadline is not None else math.inf
        return (-int(self.priority), preempted, deadline, self.seq)

    def _move(self, event: _Event) -> None:
        try:
            self.state = _TRANSITIONS[(self.state, event)]
        except KeyError:
            raise NnrtError(ErrorStatus.GENERAL_FAILURE,
                            f"job {self.seq}: no transition from {self.state.name} on "
                            f"{event.name} (bug in the scheduler's caller)") from None


@dataclass(frozen=True, slots=True)
class JobRecord:
    """A finished job, kept in the scheduler's history (``finished_jobs``)."""

    app: Hashable
    priority: Priority
    model: Hashable
    seq: int
    submitted_at: float
    started_at: float | None
    finished_at: float
    ran: float
    preemptions: int
    longest_step: float
    status: ErrorStatus
    message: str

    @property
    def wait(self) -> float | None:
        """Seconds from submission to the first slot; None if it never ran."""
        return None if self.started_at is None else self.started_at - self.submitted_at


@dataclass(frozen=True, slots=True)
class ClassStatistics:
    """Counters of one (app, priority) class. Waits and run time in seconds."""

    app: Hashable
    priority: Priority
    queued: int = 0            # waiting now (including preempted jobs)
    running: int = 0           # holding a slot now
    completed: int = 0         # finished successfully in time
    preempted: int = 0         # times a running job gave its slot back
    deadline_misses: int = 0   # refused, aborted or finished late (MISSED_DEADLINE_*)
    cancelled: int = 0
    failed: int = 0            # any other error
    wait_p50: float | None = None
    wait_p99: float | None = None
    run_time: float = 0.0      # device seconds used


@dataclass(frozen=True, slots=True)
class AppStatistics:
    """What the policy gives one app the scheduler knows (``nnrt driver status``)."""

    app: Hashable
    rule: str                  # the policy rule that matched, "[default]" for none
    weight: float              # its share of the device, relative to other apps
    max_priority: Priority     # requested priorities above it are lowered to it
    who: str = ""              # its declared name, script or executable, pid


@dataclass(frozen=True, slots=True)
class SchedulerStatistics:
    slots: int
    busy: int
    classes: tuple[ClassStatistics, ...]
    apps: tuple[AppStatistics, ...] = ()

    def of(self, app: Hashable, priority: Priority) -> ClassStatistics:
        for c in self.classes:
            if c.app == app and c.priority == priority:
                return c
        return ClassStatistics(app, Priority(priority))

    def run_time_of(self, app: Hashable) -> float:
        return sum(c.run_time for c in self.classes if c.app == app)


@dataclass(frozen=True, slots=True)
class SchedulerLoad:
    """How busy the device is now, cheap to ask (O(apps)): jobs waiting
    (held ones included) and running over all apps, the slots, and the
    recent run time of a job that finished: the median (nearest rank) of
    the last ``SERVICE_SAMPLES`` (None before the first). A median, not a mean: one
    outlier -- an interpreter's slow first run, a run the OS stalled --
    does not move it. A pool of hosts reads it from every reply
    (``nnrt.service.remote.pool``)."""

    queued: int
    running: int
    slots: int
    service_time: float | None


SERVICE_SAMPLES = 16   # recent run times SchedulerLoad.service_time is the median of


@dataclass(eq=False)
class _Class:
    queued: int = 0
    running: int = 0
    completed: int = 0
    preempted: int = 0
    deadline_misses: int = 0
    cancelled: int = 0
    failed: int = 0
    run_time: float = 0.0
    waits: deque = field(default_factory=lambda: deque(maxlen=_WAIT_SAMPLES))


@dataclass(eq=False)
class _App:
    key: Hashable
    queue: list = field(default_factory=list)   # Jobs, sorted by Job._order()
    running: int = 0
    service: float = 0.0                         # attained device seconds (fairness)
    inflight: float = 0.0                        # part of ``service`` charged to running jobs
    last_served: int = -1
    lag: float = 0.0                             # virtual seconds it was owed when it went idle (F5)
    settings: AppSettings = DEFAULT_SETTINGS
    held: deque = field(default_factory=deque)   # Jobs beyond the queue limit, oldest first

    @property
    def weight(self) -> float:
        return self.settings.weight

    @property
    def settled(self) -> float:
        """Attained service without the charges of jobs still running."""
        return self.service - self.inflight


@dataclass(eq=False)
class _Estimate:
    average: float             # moving average of completed runs
    last: float                # the latest completed run
    refused: int = 0           # jobs refused on this estimate since the last completed run
    probing: bool = False      # a probe run is queued or running

    @property
    def value(self) -> float:
        return min(self.average, self.last)


_MISSES = (ErrorStatus.MISSED_DEADLINE_TRANSIENT, ErrorStatus.MISSED_DEADLINE_PERSISTENT)


def check_memory_limit(nbytes: int, limit: int | None, what: str = "the model") -> None:
    """RESOURCE_EXHAUSTED_PERSISTENT when ``nbytes`` exceeds ``limit`` (None = no limit)."""
    if limit is not None and nbytes > limit:
        raise NnrtError(ErrorStatus.RESOURCE_EXHAUSTED_PERSISTENT,
                        f"{what} needs {nbytes} bytes, more than the device's memory limit "
                        f"of {limit} bytes")


def check_key(value, what: str) -> Hashable:
    """``value`` if it can key a dict (app and model keys are opaque hashables)."""
    try:
        hash(value)
    except TypeError:
        raise invalid(f"{what} {value!r} is not hashable") from None
    return value


def _percentile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    rank = max(math.ceil(q * len(sorted_values)) - 1, 0)   # nearest rank
    return sorted_values[rank]


class Scheduler:
    """Per-app queues, fair service across apps, ``slots`` concurrent jobs,
    deadlines and preemption decisions. Not thread-safe: one caller at a time
    (see :class:`~nnrt.qos.gate.ExecutionGate`)."""

    def __init__(self, *, slots: int = 1, queue_limit: int = DEFAULT_QUEUE_LIMIT,
                 memory_limit: int | None = None, clock: Callable[[], float] = time.monotonic,
                 history: int = 256, name: str = "scheduler",
                 settings: Callable[[Hashable], AppSettings] | None = None):
        for what, value in (("slots", slots), ("queue_limit", queue_limit)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise invalid(f"{what} must be a positive integer, got {value!r}")
        if memory_limit is not None and (isinstance(memory_limit, bool)
                                         or not isinstance(memory_limit, int) or memory_limit < 0):
            raise invalid(f"memory_limit must be None or a byte count, got {memory_limit!r}")
        self.slots = slots
        self.queue_limit = queue_limit
        self.memory_limit = memory_limit
        self.clock = clock
        self.name = name
        self._settings = settings
        self._busy = 0
        # Jobs in the apps' queues (not held ones): 0 means nobody waits for
        # a slot, so filling slots has nothing to look at (O(1), issue 16).
        self._queued = 0
        self._apps: dict[Hashable, _App] = {}
        self._classes: dict[tuple[Hashable, Priority], _Class] = {}
        self._estimates: OrderedDict[Hashable, _Estimate] = OrderedDict()
        self._seq = itertools.count()
        self._served = itertools.count()
        self._wakeups: list[Job] = []
        # The system's virtual time when no app is active: the virtual time
        # of the last app that went idle (F7; EEVDF's V, CFS's min_vruntime).
        self._vtime = 0.0
        self._history: deque[Job] = deque(maxlen=history)   # DONE jobs
        self._leaving: set = set()    # apps gone, forgotten when their last job ends
        self._run_times: deque[float] = deque(maxlen=SERVICE_SAMPLES)   # of DONE jobs

    # --- the calls that drive it ------------------------------------------

    def submit(self, app: Hashable, priority: Priority, *, deadline: float | None = None,
               model: Hashable = None) -> Job:
        """Queue one job (and start it if a slot is free: check ``job.state``).

        INVALID_ARGUMENT for a bad priority, deadline or unhashable key;
        RESOURCE_EXHAUSTED_TRANSIENT when the app already has ``queue_limit``
        jobs waiting; MISSED_DEADLINE_* when the deadline cannot be met.
        """
        if priority.__class__ is not Priority:
            priority = check_priority(priority)
        if deadline is not None:
            deadline = check_deadline(deadline)
        if app.__class__ not in _PLAIN_KEYS:
            check_key(app, "app key")
        if model.__class__ not in _PLAIN_KEYS:
            check_key(model, "model key")
        now = self.clock()
        state = self._apps.get(app)
        if state is None:
            state = self._apps[app] = _App(app, settings=self._settings_of(app))
        limit = state.settings.queue_limit or self.queue_limit   # (_queue_limit, inlined)
        full = len(state.queue) >= limit
        if full and (state.settings.fail_when_full or len(state.held) >= limit * _HOLD_FACTOR):
            self._vlog("refused: app %r has %d jobs waiting (limit %d)", app, len(state.queue),
                       limit)
            raise NnrtError(ErrorStatus.RESOURCE_EXHAUSTED_TRANSIENT,
                            f"app {app!r} already has {len(state.queue) + len(state.held)} "
                            f"executions waiting on {self.name} (the limit is {limit}"
                            f"{'' if state.settings.fail_when_full else ' in its queue and %d held' % (limit * _HOLD_FACTOR)})")
        job = Job(app, priority, deadline, model, next(self._seq), now,
                  soft=state.settings.soft_deadlines and deadline is not None)
        late = None if deadline is None else self._lateness(job, now)
        if late is not None and self._may_probe(job, late):
            job.probe = True
            self._estimates[model].probing = True
            late = None
        if late is not None:
            status, message = late
            self._class(job).deadline_misses += 1
            self._refused_on_estimate(job, now)
            self._vlog("refused job %d (app %r, %s): %s", job.seq, app, priority.name, message)
            raise NnrtError(status, message)
        if not state.queue and not state.running and not state.held:
            self._place(state)
        if full:
            job.held = True
            state.held.append(job)
            self._class(job).queued += 1
            self._vlog("held job %d (app %r, %s): its queue is full (%d)", job.seq, app,
                       priority.name, limit)
            return job
        if _VLOG:   # (the arguments cost more than the rest of a submit)
            self._vlog("queued job %d (app %r, %s, deadline %s, model %r%s)", job.seq, app,
                       priority.name, "none" if deadline is None else f"{deadline - now:+.4f}s",
                       model, ", probe" if job.probe else "")
        if not self._queued and self._busy < self.slots:
            # Nobody waits and a slot is free: enqueueing it and filling the
            # slots would pick its app (the only one with a queue) and it (its
            # head, viable: checked above at this same ``now``). Dispatched
            # directly, with the same accounting (issue 16: the common case
            # of every execution on an idle device, without the queue walk).
            self._dispatch(state, job, now, queued=False)
            return job
        self._enqueue(state, job)
        self._fill_slots(now)
        return job

    def checkpoint(self, job: Job) -> Verdict:
        """An operation boundary of a RUNNING job: stop it (cancelled, or it
        can no longer make its deadline), hand its slot to a higher-priority
        job of the same app (PREEMPTED), or let it continue."""
        if job.state is not JobState.RUNNING:
            raise NnrtError(ErrorStatus.GENERAL_FAILURE,
                            f"job {job.seq} reached a boundary while {job.state.name} "
                            f"(bug in the scheduler's caller)")
        now = self.clock()
        job.longest_step = max(job.longest_step, now - job._last_boundary)
        job._last_boundary = now
        if job.cancel_requested:
            self._stop(job, now, ErrorStatus.GENERAL_FAILURE, "the execution was cancelled")
            return Verdict.STOPPED
        late = self._lateness(job, now)
        if late is not None:
            self._stop(job, now, *late)
            return Verdict.STOPPED
        if job.pinned:
            return Verdict.CONTINUE      # P1: its thread holds another job below it
        app = self._apps[job.app]
        head = self._viable_head(app, now)
        if head is not None and head.priority > job.priority:
            target = app                 # the app's own slot goes to its more important job
        else:
            target = self._cross_app_preemptor(job, app, now)
            if target is None:
                return Verdict.CONTINUE
            head = target.queue[0]
            # F6: only an app not ahead of the running one in virtual time.
            assert target.settled / target.weight <= \
                (app.settled + now - job._slot_since) / app.weight + 1e-9, \
                "cross-app preemption by an app ahead of its share"
        self._release(job, now)
        job._move(_Event.PREEMPT)
        job.preemptions += 1
        self._class(job).preempted += 1
        self._enqueue(app, job)
        self._vlog("preempted job %d (app %r, %s) for job %d (app %r, %s)", job.seq, job.app,
                   job.priority.name, head.seq, head.app, head.priority.name)
        self._dispatch(target, head, now)
        self._fill_slots(now)
        return Verdict.PREEMPTED

    def continues(self, job: Job) -> bool:
        """An operation boundary of a RUNNING job that ``checkpoint`` would
        answer CONTINUE without changing anything but the job's step times:
        nobody waits for a slot (no job to preempt it for, none to refuse),
        it has no hard deadline and no cancellation was asked. Then the step
        times are recorded, as ``checkpoint`` does, and True returned; False
        means "call ``checkpoint``".

        The one call its caller may make without the lock that serializes
        every other (``ExecutionGate.checkpoint``), from the thread running
        the job: it writes only fields of that job that nothing else writes
        while it runs, and each field it reads is one load. A submission or a
        cancellation racing with it is then seen at the next boundary, as if
        it had come just after this one (test_scheduler.py,
        ``test_continues_is_checkpoint_when_nobody_waits``)."""
        if self._queued or job.cancel_requested or job.state is not JobState.RUNNING \
                or (job.deadline is not None and not job.soft):
            return False
        now = self.clock()
        step = now - job._last_boundary
        if step > job.longest_step:
            job.longest_step = step
        job._last_boundary = now
        return True

    def finish(self, job: Job, status: ErrorStatus = ErrorStatus.NONE,
               message: str = "") -> ErrorStatus:
        """The end of a RUNNING job's run; returns the status to report, which
        is a missed deadline instead of NONE when it finished late. A job that
        is already DONE (stopped at a boundary, cancelled) keeps its status."""
        if job.state is _DONE:
            return job.status
        if job.state is not _RUNNING:
            raise NnrtError(ErrorStatus.GENERAL_FAILURE,
                            f"job {job.seq} finished while {job.state.name} "
                            f"(bug in the scheduler's caller)")
        now = self.clock()
        if status.__class__ is not ErrorStatus:
            status = ErrorStatus(status)
        self._leave(job, self._release(job, now))
        if (status is _NONE or status is _INSUFFICIENT) \
                and not job.cancel_requested:
            self._learn(job.model, job.ran)
        if job.probe:
            self._end_probe(job)
        if status is _NONE and job.deadline is not None and now > job.deadline:
            status = self._miss_code(job, 0.0)
            message = (f"the execution finished {now - job.deadline:.4f} s after its deadline")
        job.state = _DONE      # (_move: RUNNING --FINISH--> DONE, checked above)
        self._done(job, now, status, message)
        if self._queued:
            self._fill_slots(now)
        return status

    def resumed(self, job: Job) -> None:
        """The thread that runs a RUNNING job has taken its slot (after a
        dispatch: a thread started, or a parked one woken). The time from
        the dispatch to here is not the job's run time nor its app's device
        time: on a busy host waking a thread takes milliseconds, and
        counting them made a model look longer the more it was preempted —
        and so preempted more."""
        if job.state is JobState.RUNNING:
            job._run_since = max(job._run_since, self.clock())

    def pin(self, job: Job) -> None:
        """A RUNNING job is being run on the thread of another app's job it
        preempted (the gate's donation): it is never preempted until it ends
        (P1), only stopped (cancelled, or hopeless). Were it preempted, the
        job parked below it on that thread could be dispatched and hold the
        slot with nobody to run it, while the pinned job waited for that
        slot. (Within one app donation needs no pin: the job below has a
        lower priority, so the app's queue never serves it first.)"""
        if job.state is not JobState.RUNNING:
            raise NnrtError(ErrorStatus.GENERAL_FAILURE,
                            f"job {job.seq} pinned while {job.state.name} "
                            f"(bug in the scheduler's caller)")
        job.pinned = True

    def cancel(self, job: Job) -> None:
        """Withdraw a waiting job at once; a RUNNING one stops at its next
        boundary (``checkpoint``) and gives its slot back then."""
        if job.state is JobState.DONE:
            return
        job.cancel_requested = True
        if job.state is JobState.RUNNING:
            self._vlog("cancel requested for running job %d (app %r)", job.seq, job.app)
            return
        now = self.clock()
        self._dequeue(self._apps[job.app], job)
        job._move(_Event.CANCEL)
        self._end_probe(job)
        self._done(job, now, ErrorStatus.GENERAL_FAILURE, "the execution was cancelled")
        self._wakeups.append(job)

    def poll(self) -> None:
        """Refuse every waiting job that can no longer make its deadline."""
        now = self.clock()
        for app in list(self._apps.values()):
            for job in list(app.queue) + list(app.held):
                late = self._lateness(job, now)
                if late is not None and job.state is not JobState.DONE:
                    self._refuse(app, job, now, *late)
        self._fill_slots(now)

    def wake_time(self, job: Job) -> float | None:
        """When a waiting job becomes hopeless (``poll`` then refuses it);
        None when it has no deadline."""
        if job.deadline is None or job.state is JobState.DONE:
            return None
        return job.deadline - self._remaining(job, job.ran)

    def waiting(self) -> bool:
        """Whether any job waits for a slot now (one load: any thread may
        ask, without the lock; an answer that is stale at once is still one
        the caller could have got a moment earlier)."""
        return self._queued > 0

    def take_wakeups(self) -> list[Job]:
        """Jobs whose owners must look at them again (dispatched, refused or
        cancelled while waiting), oldest first; empties the outbox."""
        woken, self._wakeups = self._wakeups, []
        return woken

    # --- queries ----------------------------------------------------------

    def estimate(self, model: Hashable) -> float | None:
        """What the scheduler believes ``model``'s run takes, in seconds (the
        smaller of the moving average of completed runs and the latest run);
        None before its first run."""
        e = self._estimates.get(model)
        return None if e is None else e.value

    def settings_of(self, app: Hashable) -> AppSettings:
        """The settings the scheduler applies to ``app``."""
        state = self._apps.get(app)
        return state.settings if state is not None else self._settings_of(app)

    def set_settings(self, settings: Callable[[Hashable], AppSettings] | None) -> None:
        """A new policy (a service's SIGHUP): every known app is looked up
        again; attained service, queues and jobs in flight are kept. Jobs
        already submitted keep their deadline kind; held jobs move into a
        queue whose limit grew."""
        self._settings = settings
        for state in self._apps.values():
            state.settings = self._settings_of(state.key)
            self._promote(state)
        self._fill_slots(self.clock())

    def check_memory(self, nbytes: int, what: str = "the model") -> None:
        check_memory_limit(nbytes, self.memory_limit, what)

    def statistics(self) -> SchedulerStatistics:
        classes = []
        for (app, priority), c in self._classes.items():
            waits = sorted(c.waits)
            classes.append(ClassStatistics(app, priority, c.queued, c.running, c.completed,
                                           c.preempted, c.deadline_misses, c.cancelled,
                                           c.failed, _percentile(waits, 0.50),
                                           _percentile(waits, 0.99), c.run_time))
        apps = tuple(AppStatistics(key, state.settings.name or "[default]",
                                   state.settings.weight, state.settings.max_priority,
                                   state.settings.who or "")
                     for key, state in self._apps.items())
        return SchedulerStatistics(self.slots, self._busy, tuple(classes), apps)

    def load(self) -> SchedulerLoad:
        held = sum(len(state.held) for state in self._apps.values())
        return SchedulerLoad(self._queued + held, self._busy, self.slots,
                             _percentile(sorted(self._run_times), 0.50))

    def finished_jobs(self) -> tuple[JobRecord, ...]:
        """The most recent finished jobs (``history`` of them), oldest first."""
        return tuple(JobRecord(j.app, j.priority, j.model, j.seq, j.submitted_at, j.started_at,
                               j.finished_at, j.ran, j.preemptions, j.longest_step, j.status,
                               j.message) for j in self._history)

    def forget_app(self, app: Hashable) -> None:
        """The app has gone (a driver service's client disconnected): drop
        its counters now, or, while it still has executions queued or
        running (a cancelled call's job finishing), when the last one ends."""
        state = self._apps.get(app)
        if state is not None and (state.queue or state.running or state.held):
            self._leaving.add(app)
            return
        self._leaving.discard(app)
        self._apps.pop(app, None)
        for key in [k for k in self._classes if k[0] == app]:
            del self._classes[key]

    def for_test_set_estimate(self, model: Hashable, seconds: float) -> None:
        self._estimates[model] = _Estimate(float(seconds), float(seconds))

    # --- internals --------------------------------------------------------

    def _class(self, job: Job) -> _Class:
        c = job._cls
        if c is None:
            # Kept on the job: forget_app drops an app's counters only when
            # it has no job left, so a live job's counters are never stale.
            key = (job.app, job.priority)
            c = self._classes.get(key)
            if c is None:
                c = self._classes[key] = _Class()
            job._cls = c
        return c

    def _enqueue(self, app: _App, job: Job) -> None:
        queue = app.queue
        if queue:
            keys = [j._order() for j in queue]
            queue.insert(bisect.bisect(keys, job._order()), job)
        else:
            queue.append(job)
        self._queued += 1
        self._class(job).queued += 1

    def _dequeue(self, app: _App, job: Job) -> None:
        if job.held:
            app.held.remove(job)
            job.held = False
            self._class(job).queued -= 1
            return
        app.queue.remove(job)
        self._queued -= 1
        self._class(job).queued -= 1
        self._promote(app)

    def _promote(self, app: _App) -> None:
        """Held jobs move into the queue, oldest first, while it has room (B1)."""
        limit = self._queue_limit(app)
        while app.held and len(app.queue) < limit:
            job = app.held.popleft()
            job.held = False
            self._class(job).queued -= 1     # _enqueue counts it again
            self._enqueue(app, job)
            self._vlog("job %d (app %r) moves from held into the queue", job.seq, app.key)

    def _queue_limit(self, app: _App) -> int:
        limit = app.settings.queue_limit
        return self.queue_limit if limit is None else limit

    def _settings_of(self, app: Hashable) -> AppSettings:
        if self._settings is None:
            return DEFAULT_SETTINGS
        try:
            settings = self._settings(app)
        except Exception as e:   # a policy must never take the device down
            self._vlog("no settings for app %r (%r): defaults apply", app, e)
            return DEFAULT_SETTINGS
        return settings if isinstance(settings, AppSettings) else DEFAULT_SETTINGS

    def _may_probe(self, job: Job, late: tuple[ErrorStatus, str]) -> bool:
        """D2: whether a job the estimate refuses is let through to re-measure it."""
        e = self._estimates.get(job.model)
        return (e is not None and not e.probing and e.refused >= _PROBE_AFTER
                and job.deadline is not None and job.deadline > job.submitted_at)

    def _refused_on_estimate(self, job: Job, now: float) -> None:
        e = self._estimates.get(job.model)
        if e is not None and job.deadline is not None and job.deadline > now:
            e.refused += 1

    def _end_probe(self, job: Job) -> None:
        if job.probe:
            e = self._estimates.get(job.model)
            if e is not None:
                e.probing = False

    def _remaining(self, job: Job, ran: float) -> float:
        """For deadlines: the optimistic estimate less what it ran."""
        estimate = self._estimates.get(job.model)
        return max(estimate.value - ran, 0.0) if estimate is not None else 0.0

    def _expected(self, job: Job) -> float:
        """For fairness (charges, virtual deadlines, lengths): the moving
        average less what it ran. Not the optimistic deadline estimate: a
        charge biased low makes every run look like an overrun."""
        estimate = self._estimates.get(job.model)
        return max(estimate.average - job.ran, 0.0) if estimate is not None else 0.0

    def _ran(self, job: Job, now: float) -> float:
        if job.state is JobState.RUNNING:
            return job.ran + (now - job._run_since)
        return job.ran

    def _miss_code(self, job: Job, remaining: float) -> ErrorStatus:
        budget = job.deadline - job.submitted_at
        if budget > 0 and job.ran + remaining * (1 - _PERSISTENT_MARGIN) > budget:
            return ErrorStatus.MISSED_DEADLINE_PERSISTENT   # too slow even on an idle device
        return ErrorStatus.MISSED_DEADLINE_TRANSIENT        # late because the device was busy

    def _lateness(self, job: Job, now: float) -> tuple[ErrorStatus, str] | None:
        """(status, message) when ``job`` cannot finish by its deadline."""
        if job.deadline is None or job.soft:
            return None
        ran = self._ran(job, now)
        # A probe is judged by the clock alone: it is there to measure.
        remaining = 0.0 if job.probe else self._remaining(job, ran)
        if now + remaining <= job.deadline:
            return None
        budget = job.deadline - job.submitted_at
        if budget <= 0:
            message = "the deadline had passed before the execution was submitted"
            if budget < -_A_DURATION_MISTAKEN:
                # deadline=33 meant "33 ms from now": say how to write that.
                message += (f" (deadline={job.deadline:g} is a time on the monotonic clock, "
                            f"which reads {job.submitted_at:.0f} s now; for {job.deadline:g} ms "
                            f"from now pass nnrt.deadline_in(ms={job.deadline:g}))")
            return ErrorStatus.MISSED_DEADLINE_TRANSIENT, message
        if job.probe:
            return (ErrorStatus.MISSED_DEADLINE_TRANSIENT,
                    "the deadline passed while the execution was waiting or running")
        # D1: PERSISTENT only beyond the margin.
        # The time already run is a fact; the margin is for the estimate.
        if ran + remaining * (1 - _PERSISTENT_MARGIN) > budget:
            return (ErrorStatus.MISSED_DEADLINE_PERSISTENT,
                    f"the model needs about {ran + remaining:.4f} s but the deadline left "
                    f"{budget:.4f} s: it cannot make it even on an idle device")
        return (ErrorStatus.MISSED_DEADLINE_TRANSIENT,
                f"the device was busy: {max(job.deadline - now, 0):.4f} s left before the "
                f"deadline, about {remaining:.4f} s of work to do")

    def _learn(self, model: Hashable, seconds: float) -> None:
        if model is None:
            return
        estimates = self._estimates
        e = estimates.get(model)
        if e is None:
            estimates[model] = _Estimate(seconds, seconds)
            while len(estimates) > _MAX_ESTIMATES:
                estimates.popitem(last=False)
            return
        e.average += _ESTIMATE_WEIGHT * (seconds - e.average)
        e.last = seconds
        e.refused = 0
        estimates.move_to_end(model)   # the most recently used, kept longest

    def _viable_head(self, app: _App, now: float) -> Job | None:
        """The app's next job, refusing hopeless ones in front of it."""
        while app.queue:
            job = app.queue[0]
            late = self._lateness(job, now)
            if late is None:
                return job
            self._refuse(app, job, now, *late)
        return None

    def _least_other(self, app: _App) -> float | None:
        """The least *settled* virtual time of the active apps other than
        ``app``; None when none is active. (Its callers skip the call when
        ``app`` is the only app: the common case in process.)"""
        apps = self._apps
        active = [a.settled / a.weight for a in apps.values()
                  if a is not app and (a.queue or a.running)]
        return min(active) if active else None

    def _leave(self, job: Job, app: _App) -> None:
        """``job`` has ended; if its app has nothing else, it goes idle:
        keep how far it was behind the others (its lag), at most that one
        job in its virtual time (F5). The last active app to go idle leaves
        the system's virtual time at its own (F7)."""
        if app.queue or app.running or app.held:
            return
        weight = app.settings.weight    # (app.weight, inlined: this and _place run per job)
        least = None if len(self._apps) == 1 else self._least_other(app)
        if least is None:
            vtime = app.service / weight
            if vtime > self._vtime:
                self._vtime = vtime
            app.lag = 0.0
            return
        behind = least - app.service / weight
        app.lag = min(max(behind, 0.0), job.ran / weight)

    def _place(self, app: _App) -> None:
        """Idle or new -> active (F5, F7): no credit for the idle time, and
        no loss of the lag it had when it went idle. The floor is the
        least-served active app's *settled* virtual time (without charges
        for work still in flight): levelling up to a charge made a moment
        ago would erase the small lag an app with one request outstanding
        always has when it resubmits. Without the lag (EEVDF keeps it too),
        an app whose client is slow to resubmit (two executions in flight
        on a loaded host) lost what it was owed at every gap: the time
        another app's job stretched by the host had taken from it was
        forgotten. With no other app active the floor is the system's
        virtual time (F7): a new app starting from zero instead was owed
        everything the others had ever run -- a light app that had run
        alone for a while, or beside a flood that then ended, waited for
        the newcomer to catch up with all of it (seconds: measured in
        ``benchmarks/qos_apps.py``, docs/design/scheduler.md)."""
        least = None if len(self._apps) == 1 else self._least_other(app)
        floor = self._vtime if least is None else least
        service = (floor - app.lag) * app.settings.weight
        if service > app.service:
            app.service = service
        app.lag = 0.0

    def _pick_app(self) -> _App | None:
        best = None
        for app in self._apps.values():
            if app.queue and (best is None or (app.service / app.weight, app.last_served)
                              < (best.service / best.weight, best.last_served)):
                best = app
        return best

    def _cross_app_preemptor(self, job: Job, app: _App, now: float) -> _App | None:
        """F3: the eligible app, other than ``job``'s, whose head job has the
        earliest virtual deadline, if that is earlier than ``job``'s."""
        ran = now - job._slot_since
        current = (app.settled + ran) / app.weight
        running_deadline = (job._vstart + max(job._charged, ran)) / app.weight
        # Only a shorter job preempts (F4): shorter than the running job's
        # estimate, or any job once the running one has overrun its
        # estimate _OVERRUN times (the estimate was wrong, not noisy).
        # Whole-run terms, so a job resumed after a preemption is judged by
        # its whole length, not by what its estimate says is left.
        e = self._estimates.get(job.model)
        length = 0.0 if e is None else e.average
        longest = math.inf if job.ran + ran >= _OVERRUN * length else _SHORTER * length
        best, best_deadline = None, running_deadline
        for other in self._apps.values():
            if other is app or not other.queue:
                continue
            if other.settled / other.weight > current:
                continue                 # not eligible: ahead of the running app (F6)
            head = self._viable_head(other, now)
            if head is None:
                continue
            e = self._estimates.get(head.model)
            need = 0.0 if e is None else e.average
            if need >= longest:
                continue                 # F4: jobs of similar length do not churn
            deadline = (other.service + need) / other.weight
            if deadline < best_deadline:
                best, best_deadline = other, deadline
        return best

    def _fill_slots(self, now: float) -> None:
        while self._queued and self._busy < self.slots:
            app = self._pick_app()
            if app is None:
                return
            job = self._viable_head(app, now)
            if job is not None:
                self._dispatch(app, job, now)

    def _dispatch(self, app: _App, job: Job, now: float, queued: bool = True) -> None:
        """Give ``job`` (its app's queue head; ``queued=False``: a job just
        submitted that would have been, see ``submit``) a free slot."""
        # test_slots_bound_concurrency
        assert self._busy < self.slots, "dispatch without a free slot"
        resumed = job.state is _PREEMPTED
        if queued:
            self._dequeue(app, job)
            job._move(_DISPATCH)
        else:
            job.state = _RUNNING    # (_move: a job just made is QUEUED)
        c = job._cls or self._class(job)
        c.running += 1
        if job.started_at is None:
            job.started_at = now
            c.waits.append(now - job.submitted_at)
        job._slot_since = job._run_since = job._last_boundary = now
        job._vstart = app.service - app.inflight     # app.settled
        estimate = self._estimates.get(job.model)   # (_expected, inlined)
        charge = estimate.average - job.ran if estimate is not None else 0.0
        job._charged = charge = charge if charge > 0.0 else 0.0
        app.service += charge
        app.inflight += charge
        app.running += 1
        app.last_served = next(self._served)
        self._busy += 1
        self._wakeups.append(job)
        if _VLOG:
            self._vlog("%s job %d (app %r, %s) after %.4f s waiting", "resumed" if resumed
                       else "started", job.seq, job.app, job.priority.name,
                       now - job.submitted_at)

    def _release(self, job: Job, now: float) -> _App:
        """Give ``job``'s slot back, charging its app what it ran; returns the app."""
        # Device time is run time: from when the job's thread took the slot.
        # The wake-up before that (the slot held idle) is charged to nobody:
        # charging it skewed the shares towards the app whose threads woke
        # faster, and made the shares the scheduler keeps differ from the
        # run times its records show.
        interval = now - job._run_since
        job.ran += interval
        step = now - job._last_boundary
        if step > job.longest_step:
            job.longest_step = step
        app = self._apps[job.app]
        app.service += interval - job._charged
        app.inflight -= job._charged
        job._charged = 0.0
        app.running -= 1
        self._busy -= 1
        # test_cancelling_a_running_job_stops_it_at_the_next_boundary_and_frees_the_slot
        assert self._busy >= 0 and app.running >= 0, "a slot given back twice"
        c = job._cls or self._class(job)
        c.running -= 1
        c.run_time += interval
        return app

    def _stop(self, job: Job, now: float, status: ErrorStatus, message: str) -> None:
        self._leave(job, self._release(job, now))
        job._move(_Event.STOP)
        self._end_probe(job)
        self._done(job, now, status, message)
        self._fill_slots(now)

    def _refuse(self, app: _App, job: Job, now: float, status: ErrorStatus,
                message: str) -> None:
        self._dequeue(app, job)
        job._move(_Event.REFUSE)
        self._end_probe(job)
        self._done(job, now, status, message)
        self._wakeups.append(job)

    def _done(self, job: Job, now: float, status: ErrorStatus, message: str) -> None:
        job.status, job.message, job.finished_at = status, message, now
        c = job._cls or self._class(job)
        if status is _NONE:
            c.completed += 1
            self._run_times.append(job.ran)
        elif job.cancel_requested:
            c.cancelled += 1
        elif status in _MISSES:
            c.deadline_misses += 1
        else:
            c.failed += 1
        # The job itself: a DONE job never changes again, so its record is
        # made only when asked for (finished_jobs), not on every finish.
        self._history.append(job)
        if self._leaving and job.app in self._leaving:
            self.forget_app(job.app)
        if _VLOG:
            self._vlog("job %d (app %r, %s) done after %.4f s running: %s%s", job.seq,
                       job.app, job.priority.name, job.ran, status.name,
                       f" ({message})" if message else "")

    def _vlog(self, msg: str, *args) -> None:
        if _VLOG:
            vlog("execution", "%s: " + msg, self.name, *args)

