"""A thread-safe front for the :class:`~nnrt.qos.scheduler.Scheduler`, for
drivers that run each execution on a thread of its own (the in-process
reference device, a driver service's executor threads).

Theory of operation
-------------------
One lock serializes every call into the scheduler; the scheduler itself
stays free of threads and I/O. Each job has a ticket with a
``threading.Event``; after every call the gate drains the scheduler's
wake-up outbox and sets the event of each job named there, still under the
lock. A waiting thread checks its job's state and clears its event under
that same lock before sleeping, so a wake-up between the check and the sleep
is never lost.

A job is run by the thread that owns it, which calls ``checkpoint`` at every
operation boundary, then ``finish``. A preempted job's thread sleeps inside
``checkpoint`` and returns from it when the job is dispatched again: the
execution's context (next operation, live operand values, nested WHILE/IF
frames) is simply that thread's stack, kept whole while parked, so resuming
never restarts anything. (Rejected: turning the executor into an explicit
continuation, which would need every control-flow kernel rewritten as a
generator.)

Two ways to become the owner:

- A synchronous caller submits without ``work`` and calls ``claim`` on its
  own thread, which sleeps until the job holds a slot.
- A caller that must not block (an event loop) submits with ``work``: the
  gate calls ``work(job)`` exactly once, on a thread that owns the job once
  it holds a slot, or with the job DONE if it ended first (refused,
  cancelled) so ``work`` can report that. The thread is started with
  ``spawn`` only when the job needs one — when it is dispatched, or at once
  if it has a deadline (its thread wakes at the job's ``wake_time`` to have
  it refused when hopeless) — so a queued job without a deadline holds no
  thread.

Donation. When a running job is preempted on a one-slot device, its thread
— awake at the boundary already — claims the job that took the slot, if
that job came with ``work`` and has no thread running it, and runs
``work(job)`` itself before parking. The preempting job's path then has no
thread wake-up in it at all (the one that made HIGH's latency under a LOW
flood jump: docs/design/scheduler.md). Only with one slot: the donated job runs on top of
the preempted job's stack, so the preempted job cannot move until it ends;
with one slot nothing else could have run it meanwhile (its app's more
important job holds the only slot, and the app's queue serves that
priority first), with more slots the preempted job might be dispatched to
another slot and hold it idle. Across apps too (a light app's frame
preempting a flooding app's job: on a loaded host the wake-up of a thread of
its own took 2-6 ms in a driver service, ten times the frame's run); then
the donated job is pinned (``Scheduler.pin``): never preempted until it
ends, because its app's queue, unlike the preempted job's own app's, gives
no guarantee that the job parked below it is not dispatched first.

A waiting job with a deadline sleeps at most until its ``wake_time``; on
waking it polls the scheduler, which refuses it if it is hopeless by then,
so a caller is told about a missed deadline when it happens, not when a slot
frees.

``cancel`` may come from any thread (an event loop whose task was
cancelled): a waiting job is withdrawn and its thread woken; a running one
stops at its next boundary; a job that was given a slot but not claimed yet
gives the slot back at once (and a thread waiting to claim it, or the
job's ``work``, learns of the cancellation).
"""
from __future__ import annotations

import threading
from typing import Callable, Hashable

from ..errors import ErrorStatus, NnrtError
from ..vlog import vlog
from .. import trace
from ..hal.types import Priority
from .scheduler import (_RUNNING, Job, JobRecord, JobState, Scheduler, SchedulerLoad,
                        SchedulerStatistics, Verdict)

_SLACK = 1e-4   # seconds past a wake time, so the job is hopeless when the poll runs


class _Ticket:
    """The gate's side of one job: the event its waiting thread sleeps on,
    which thread owns it (None until claimed), the ``work`` the gate runs for
    it and whether a thread was given that work yet. The ticket lives from
    ``submit`` until the owner calls ``finish``, or until a thread learns
    that the unclaimed job ended.

    The event is made by the first thread that waits (``arm``), under the
    lock: a job that gets its slot at once and is never preempted -- the
    common case -- never needs one, and a wake-up while nobody waits needs
    no record, since a waiter checks the job's state after arming."""

    __slots__ = ("event", "owner", "work", "spawned")

    def __init__(self, work: Callable[[Job], None] | None, owner: int | None = None):
        self.event: threading.Event | None = None
        self.owner = owner
        self.work = work
        self.spawned = False

    def arm(self) -> threading.Event:
        """Under the lock, before checking the job's state and sleeping."""
        event = self.event
        if event is None:
            event = self.event = threading.Event()
        else:
            event.clear()
        return event

    def wake(self) -> None:
        """Under the lock."""
        if self.event is not None:
            self.event.set()


class ExecutionGate:
    def __init__(self, scheduler: Scheduler,
                 spawn: Callable[..., None] | None = None):
        """``spawn(fn, *args)`` runs ``fn(*args)`` on another thread and
        returns at once; needed only for jobs submitted with ``work``."""
        self.scheduler = scheduler
        self.spawn = spawn
        self._lock = threading.Lock()
        self._tickets: dict[Job, _Ticket] = {}
        # Per thread: .depth, donated jobs running on it; .serving, it is a job's own
        # thread (_serve); .following, the job it runs next (continuation).
        self._local = threading.local()

    def submit(self, app: Hashable, priority: Priority, *, deadline: float | None = None,
               model: Hashable = None, work: Callable[[Job], None] | None = None) -> Job:
        """Queue a job; NnrtError when the scheduler refuses it. Without
        ``work`` the caller's thread must ``claim`` it; with ``work`` the gate
        calls ``work(job)`` once, on an owning thread or with the job DONE.
        ``work`` must not raise."""
        if work is not None and self.spawn is None:
            raise TypeError("jobs with work need a gate made with spawn=")
        with self._lock:
            job = self.scheduler.submit(app, priority, deadline=deadline, model=model)
            ticket = self._tickets[job] = _Ticket(work)
            if work is not None and deadline is not None:
                ticket.spawned = True   # its thread polls the deadline while it waits
                starts = [job]
            else:
                starts = []
            starts += self._deliver(self.scheduler.take_wakeups())
        self._start(starts)
        return job

    def submit_here(self, app: Hashable, priority: Priority, *, deadline: float | None = None,
                    model: Hashable = None) -> tuple[Job, bool]:
        """``submit`` for a caller that would run the job on its own thread:
        when the job gets a slot at once (a free slot, nothing ahead of it),
        the calling thread owns it on return (True) and runs it now, then
        calls ``finish`` -- one lock taken, no wake-up, no event. Otherwise
        (False) it waits as any job: the caller then ``claim``s it, or hands
        it ``give_work`` (a caller that must not block)."""
        scheduler = self.scheduler
        lock = self._lock
        lock.acquire()    # (not ``with``: this and ``finish`` run at every execution)
        try:
            job = scheduler.submit(app, priority, deadline=deadline, model=model)
            owned = job.state is _RUNNING
            self._tickets[job] = _Ticket(None, threading.get_ident() if owned else None)
            woken = scheduler.take_wakeups()
            if owned:
                woken.remove(job)     # its owner is right here, awake
            starts = self._deliver(woken) if woken else woken
        finally:
            lock.release()
        if starts:
            self._start(starts)
        return job, owned

    def give_work(self, job: Job, work: Callable[[Job], None]) -> None:
        """Give a job that ``submit_here`` left waiting the ``work`` that
        ``submit`` would have taken: from now on it is such a job (its thread
        starts when it needs one; at once if it got its slot, ended or has a
        deadline meanwhile)."""
        if self.spawn is None:
            raise TypeError("jobs with work need a gate made with spawn=")
        with self._lock:
            ticket = self._tickets.get(job)
            if ticket is None or ticket.owner is not None:
                raise NnrtError(ErrorStatus.GENERAL_FAILURE,
                                f"job {job.seq} is owned already (bug in the gate's caller)")
            ticket.work = work
            start = job.deadline is not None or job.state in (JobState.RUNNING, JobState.DONE)
            ticket.spawned = start
        if start:
            self._start([job])

    def claim(self, job: Job) -> bool:
        """Block until the job holds a slot and own it (True: the caller runs
        it and must call ``finish``), or return False when another thread
        claimed it (donation: that thread runs it to the end). Raise the
        job's NnrtError when it was refused or cancelled instead."""
        with self._lock:
            ticket = self._tickets.get(job)
        if ticket is None:          # a donor already ran it to the end
            return False
        me = threading.get_ident()
        clock = self.scheduler.clock
        while True:
            with self._lock:
                if ticket.owner is not None:
                    return False
                if job.state is JobState.DONE:
                    self._tickets.pop(job, None)
                    raise self._error(job)
                event = ticket.arm()
                if job.state is JobState.RUNNING:
                    ticket.owner = me
                    self.scheduler.resumed(job)
                    return True
                wake = self.scheduler.wake_time(job)
                timeout = None if wake is None else max(wake - clock(), 0.0) + _SLACK
            if not event.wait(timeout):
                self.poll()

    def checkpoint(self, job: Job) -> None:
        """An operation boundary of a job this thread owns: return to go on
        (possibly after being parked by a preemption and resumed, and after
        running the preempting job meanwhile), or raise NnrtError to unwind."""
        if self.scheduler.continues(job):
            return      # nobody waits, nothing asked of it: no lock (issue 16)
        donated = None
        with self._lock:
            verdict = self.scheduler.checkpoint(job)
            woken = self.scheduler.take_wakeups()
            if verdict is Verdict.PREEMPTED:
                donated = self._donation(job, woken)
            starts = self._deliver(woken, skip=donated)
        self._start(starts)
        if verdict is Verdict.CONTINUE:
            return
        if verdict is Verdict.STOPPED:
            raise self._error(job)
        trace.instant("preempted", job=job.seq, app=job.app, priority=job.priority.name)
        if donated is not None:
            self._run_donated(donated, job)
        self._wait_running(job)

    def finish(self, job: Job, status: ErrorStatus = ErrorStatus.NONE,
               message: str = "") -> ErrorStatus:
        """End the run of a job this thread owns (no-op when it already
        stopped); returns the status to report (a miss instead of NONE when
        it finished late). The job's buffers must be free by now. On a job's
        own thread (``_serve``), the job that takes the freed slot is claimed
        for this thread, which runs it once its ``work`` returns
        (continuation)."""
        scheduler = self.scheduler
        lock = self._lock
        lock.acquire()
        try:
            final = scheduler.finish(job, status, message)
            woken = scheduler.take_wakeups()
            self._tickets.pop(job, None)
            if not woken:       # nobody was waiting for the slot (the common case)
                return final
            following = self._continuation(woken)
            starts = self._deliver(woken, skip=following)
        finally:
            lock.release()
        if following is not None:
            self._local.following = following
        self._start(starts)
        return final

    def cancel(self, job: Job) -> bool:
        """Withdraw or stop ``job``, from any thread; True when a thread owns
        it and is still running it (it stops at its next boundary: wait for
        it to let go of the request's buffers before freeing them)."""
        with self._lock:
            ticket = self._tickets.get(job)
            owned = ticket is not None and ticket.owner is not None
            self.scheduler.cancel(job)
            woken = self.scheduler.take_wakeups()
            if job.state is JobState.RUNNING and not owned:
                # Dispatched but not claimed yet: nobody touched the buffers.
                self.scheduler.finish(job, ErrorStatus.GENERAL_FAILURE,
                                      "the execution was cancelled before it started")
                woken += [job] + self.scheduler.take_wakeups()
            starts = self._deliver(woken)
        self._start(starts)
        return owned

    def poll(self) -> None:
        with self._lock:
            self.scheduler.poll()
            starts = self._deliver(self.scheduler.take_wakeups())
        self._start(starts)

    def running_donated(self) -> bool:
        """True on a thread that is running another job's work for it
        (donation), with its own preempted job parked below."""
        return getattr(self._local, "depth", 0) > 0

    def set_settings(self, settings) -> None:
        with self._lock:
            self.scheduler.set_settings(settings)
            starts = self._deliver(self.scheduler.take_wakeups())
        self._start(starts)

    def settings_of(self, app: Hashable):
        with self._lock:
            return self.scheduler.settings_of(app)

    def estimate(self, model: Hashable) -> float | None:
        with self._lock:
            return self.scheduler.estimate(model)

    def statistics(self) -> SchedulerStatistics:
        with self._lock:
            return self.scheduler.statistics()

    def load(self) -> SchedulerLoad:
        with self._lock:
            return self.scheduler.load()

    def forget_app(self, app: Hashable) -> None:
        with self._lock:
            self.scheduler.forget_app(app)

    def finished_jobs(self) -> tuple[JobRecord, ...]:
        with self._lock:
            return self.scheduler.finished_jobs()

    # --- internals --------------------------------------------------------

    def _deliver(self, woken: list[Job], skip: tuple[Job, _Ticket] | None = None) -> list[Job]:
        """Under the lock: wake the threads of ``woken`` jobs; returns the
        jobs with work that need a thread started (after the lock)."""
        starts = []
        for job in woken:
            ticket = self._tickets.get(job)
            if ticket is None or (skip is not None and job is skip[0]):
                continue
            if ticket.work is not None and not ticket.spawned and ticket.owner is None:
                ticket.spawned = True
                starts.append(job)
            else:
                ticket.wake()
        return starts

    def _start(self, jobs: list[Job]) -> None:
        for job in jobs:
            self.spawn(self._serve, job)

    def _serve(self, job: Job) -> None:
        """A job's own thread, for a job submitted with work; then, in turn,
        each job that took the slot its last job freed (continuation)."""
        with self._lock:
            ticket = self._tickets.get(job)
        if ticket is None:
            return
        try:
            if not self.claim(job):
                return                  # donated: its donor calls work
        except NnrtError:
            pass                        # ended unclaimed: work reports it
        self._serve_in_turn(job, ticket)

    def _serve_in_turn(self, job: Job, ticket: _Ticket, following: bool = False) -> None:
        """Run ``work`` of a job this thread owns (claimed by ``finish`` for
        the thread that freed its slot when ``following``), then of each job
        that ``finish`` claims for this thread as it frees the slot."""
        local = self._local
        local.serving = True
        try:
            while True:
                if following:
                    with self._lock:
                        self.scheduler.resumed(job)
                ticket.work(job)
                after, local.following = getattr(local, "following", None), None
                if after is None:
                    return
                (job, ticket), following = after, True
        finally:
            local.serving = False
            # ``work`` raised (it must not) after its job claimed the next:
            # that one still needs a thread, or its slot is held forever.
            after, local.following = getattr(local, "following", None), None
            if after is not None:
                self.spawn(self._serve_in_turn, *after, True)

    def _continuation(self, woken: list[Job]) -> tuple[Job, _Ticket] | None:
        """Under the lock, in ``finish``: the job that took the slot just
        freed, claimed for this thread, if this is a job's own thread with
        nothing parked below (not running donated work) and that job needs
        a thread. Waking another thread for it while this one goes idle cost
        a wake-up per job, and on a busy host the two woken threads (the
        next job's and the event loop's, for this job's result) were queued
        on one CPU, the loop behind the job for up to a scheduler tick
        (docs/design/scheduler.md)."""
        local = self._local
        if not getattr(local, "serving", False) or getattr(local, "depth", 0) > 0:
            return None
        for job in woken:
            if job.state is JobState.RUNNING:
                ticket = self._tickets.get(job)
                if ticket is not None and ticket.work is not None and not ticket.spawned \
                        and ticket.owner is None:
                    ticket.spawned = True
                    ticket.owner = threading.get_ident()
                    return job, ticket
        return None

    def _donation(self, preempted: Job, woken: list[Job]) -> tuple[Job, _Ticket] | None:
        """Under the lock, just after ``preempted`` gave its slot away: the
        job that took it, claimed for this thread, if it may be donated."""
        if self.scheduler.slots != 1:
            return None
        for job in woken:
            if job.state is JobState.RUNNING:
                ticket = self._tickets.get(job)
                if ticket is None or ticket.owner is not None or ticket.work is None:
                    return None
                if job.app != preempted.app:
                    self.scheduler.pin(job)   # see Scheduler.pin: another app's job is below
                ticket.owner = threading.get_ident()
                return job, ticket
        return None

    def _run_donated(self, donated: tuple[Job, _Ticket], preempted: Job) -> None:
        job, ticket = donated
        vlog("execution", "%s: job %d runs on the thread of preempted job %d",
             self.scheduler.name, job.seq, preempted.seq)
        donors = self._local
        donors.depth = getattr(donors, "depth", 0) + 1
        try:
            ticket.work(job)
        except BaseException as e:   # a bug in work: end the job, keep the donor's own going
            vlog("execution", "%s: donated job %d raised %r", self.scheduler.name, job.seq, e)
            if job.state is JobState.RUNNING:
                self.finish(job, ErrorStatus.GENERAL_FAILURE, f"the execution raised {e!r}")
        finally:
            donors.depth -= 1
        # A thread of its own, if it has one (a deadline), is asleep in claim()
        # until its wake time, then sees the job owned and leaves: not woken
        # here, where it would compete with the result's hand-over.

    def _wait_running(self, job: Job) -> None:
        """Park the owner's thread until its preempted job runs again."""
        clock = self.scheduler.clock
        with self._lock:
            ticket = self._tickets[job]
        while True:
            with self._lock:
                if job.state is JobState.DONE:
                    self._tickets.pop(job, None)
                    raise self._error(job)
                event = ticket.arm()
                if job.state is JobState.RUNNING:
                    self.scheduler.resumed(job)
                    return
                wake = self.scheduler.wake_time(job)
                timeout = None if wake is None else max(wake - clock(), 0.0) + _SLACK
            if not event.wait(timeout):
                self.poll()

    @staticmethod
    def _error(job: Job) -> NnrtError:
        return NnrtError(job.status or ErrorStatus.GENERAL_FAILURE,
                         job.message or "the execution was stopped")
