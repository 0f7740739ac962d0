"""A thread-safe front for the :class:`~nnrt.qos.scheduler.Scheduler`, for
drivers that run each execution on a thread of its own (the in-process
reference device, a driver service's executor threads).

Theory of operation
-------------------
One lock serializes every call into the scheduler; the scheduler itself
stays free of threads and I/O. Each job has a ``threading.Event``; after
every call the gate drains the scheduler's wake-up outbox and sets the event
of each job named there, still under the lock. A waiting thread checks its
job's state and clears its event under that same lock before sleeping, so a
wake-up between the check and the sleep is never lost.

The thread that owns a job calls, in order: ``wait_started`` (sleeps until
the job holds a slot), ``checkpoint`` at every operation boundary, then
``finish``. A preempted job's thread sleeps inside ``checkpoint`` and returns
from it when the job is dispatched again: the execution's context (next
operation, live operand values, nested WHILE/IF frames) is simply that
thread's stack, kept whole while parked, so resuming never restarts
anything. (Rejected: turning the executor into an explicit continuation,
which would need every control-flow kernel rewritten as a generator.)

A waiting job with a deadline sleeps at most until its ``wake_time``; on
waking it polls the scheduler, which refuses it if it is hopeless by then,
so a caller is told about a missed deadline when it happens, not when a slot
frees.

``cancel`` may come from any thread (an event loop whose task was
cancelled): a waiting job is withdrawn and its thread woken; a running one
stops at its next boundary; a job that was given a slot but whose thread
never started (no ``wait_started`` yet) gives the slot back at once.
"""
from __future__ import annotations

import threading
from typing import Hashable

from ..errors import ErrorStatus, NnrtError
from .priority import Priority
from .scheduler import Job, JobRecord, JobState, Scheduler, SchedulerStatistics, Verdict

_SLACK = 1e-4   # seconds past a wake time, so the job is hopeless when the poll runs


class ExecutionGate:
    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self._lock = threading.Lock()
        self._events: dict[Job, threading.Event] = {}
        self._attached: set[Job] = set()

    def submit(self, app: Hashable, priority: Priority, *, deadline: float | None = None,
               model: Hashable = None) -> Job:
        """Queue a job; NnrtError when the scheduler refuses it."""
        with self._lock:
            job = self.scheduler.submit(app, priority, deadline=deadline, model=model)
            self._events[job] = threading.Event()
            self._deliver()
        return job

    def wait_started(self, job: Job) -> None:
        """Block until ``job`` holds a slot; raise its NnrtError when it was
        refused or cancelled instead. The calling thread becomes the job's
        owner (it must call ``finish``)."""
        with self._lock:
            self._attached.add(job)
        self._wait_running(job)

    def checkpoint(self, job: Job) -> None:
        """An operation boundary: return to go on (possibly after being
        parked by a preemption and resumed), or raise NnrtError to unwind."""
        with self._lock:
            verdict = self.scheduler.checkpoint(job)
            self._deliver()
        if verdict is Verdict.CONTINUE:
            return
        if verdict is Verdict.STOPPED:
            raise self._error(job)
        self._wait_running(job)

    def finish(self, job: Job, status: ErrorStatus = ErrorStatus.NONE,
               message: str = "") -> ErrorStatus:
        """End the job's run (no-op when it already stopped); returns the
        status to report (a miss instead of NONE when it finished late)."""
        with self._lock:
            final = self.scheduler.finish(job, status, message)
            self._deliver()
            self._forget(job)
        return final

    def cancel(self, job: Job) -> None:
        with self._lock:
            if job.state is JobState.RUNNING and job not in self._attached:
                self.scheduler.cancel(job)
                self.scheduler.finish(job, ErrorStatus.GENERAL_FAILURE,
                                      "the execution was cancelled before it started")
            else:
                self.scheduler.cancel(job)
            self._deliver()
            if job.state is JobState.DONE and job not in self._attached:
                self._forget(job)

    def poll(self) -> None:
        with self._lock:
            self.scheduler.poll()
            self._deliver()

    def statistics(self) -> SchedulerStatistics:
        with self._lock:
            return self.scheduler.statistics()

    def finished_jobs(self) -> tuple[JobRecord, ...]:
        with self._lock:
            return self.scheduler.finished_jobs()

    def _wait_running(self, job: Job) -> None:
        clock = self.scheduler.clock
        while True:
            with self._lock:
                state = job.state
                if state is JobState.DONE:
                    self._forget(job)
                    raise self._error(job)
                event = self._events[job]
                event.clear()
                if state is JobState.RUNNING:
                    return
                wake = self.scheduler.wake_time(job)
                timeout = None if wake is None else max(wake - clock(), 0.0) + _SLACK
            if not event.wait(timeout):
                self.poll()

    def _deliver(self) -> None:
        for job in self.scheduler.take_wakeups():
            event = self._events.get(job)
            if event is not None:
                event.set()

    def _forget(self, job: Job) -> None:
        self._events.pop(job, None)
        self._attached.discard(job)

    @staticmethod
    def _error(job: Job) -> NnrtError:
        return NnrtError(job.status or ErrorStatus.GENERAL_FAILURE,
                         job.message or "the execution was stopped")
