"""The QoS front: any :class:`~nnrt.hal.Device` behind the per-app scheduler.

:class:`ScheduledDevice` wraps a driver from outside, so every driver — the
reference one, the samples, the LiteRT one, a vendor's — gets per-app
queues, priorities, deadlines, cancellation, statistics and preemption
without writing any of it. The runtime puts one in front of every
in-process device, and a driver service puts one in front of the device it
serves; a device that already has one says so (``Scheduling.fronted``).

An execution is a job of the :class:`~nnrt.qos.scheduler.Scheduler`, behind
an :class:`~nnrt.qos.gate.ExecutionGate`: ``execute`` and
``execute_synchronously`` (and so bursts and fenced executions, built on
them) submit a job for the prepared model's app and priority, wait for a
slot and call the driver's ``execute_synchronously`` with the gate's
checkpoint, which the driver calls at every boundary it declared
(``Device.scheduling().boundaries``): there a higher-priority job of the
same app preempts it, a hopeless deadline aborts it and a cancellation
stops it. A driver without boundaries is still queued, prioritised and
deadline-checked; its whole runs are the preemption granularity.

``execute`` runs the job on a worker thread — or, when it preempts a running
job on a one-slot device, on that job's thread (donation, see
:mod:`nnrt.qos.gate`) — and the result goes straight from whichever thread
ran it to the awaiting task. Cancelling the awaiting task withdraws or stops
the job and returns only once the thread running it let go of the request's
buffers.
"""
from __future__ import annotations

import itertools
import os
import time
from functools import partial
from typing import Callable

import anyio
import anyio.lowlevel

from ..errors import ErrorStatus, NnrtError, invalid
from ..handoff import Waiter, run_soon
from ..hal import (AppDeclaration, AppKey, Boundaries, Capabilities, Checkpoint, Device, Execution,
                   ExecutionPreference, ExecutionResult, PreparedModel, Priority, Request,
                   Scheduling, Timing, check_deadline, check_priority)
from ..hal.cache import CacheFiles
from ..hal.validate import validate_model
from ..memory import as_buffer
from ..model.graph import HalModel
from ..model.types import OperationType
from ..vlog import vlog
from .. import trace
from .gate import ExecutionGate
from .policy import Policy
from .scheduler import (DEFAULT_QUEUE_LIMIT, AppSettings, Job, JobRecord, JobState, Scheduler,
                        SchedulerLoad, SchedulerStatistics, check_key, check_memory_limit)

_PREPARED_IDS = itertools.count(1)

# Longest a donor thread waits for the donated job's result to be taken by
# its task before resuming its own job (a loop hop is ~0.1-0.3 ms).
_DONOR_LINGER = 0.002

# Inline runs (``ScheduledExecution.execute``): a job that gets its slot at
# once runs on the awaiting task's thread, with no hand-off to a worker
# thread (two thread wake-ups, ~0.1 ms: most of a small model's cost), once
# the same execution's last INLINE_AFTER runs each took at most
# ``inline_bound`` seconds of real time (default INLINE_BOUND). That is what
# it may hold its event loop for: far below what a loop notices (asyncio's
# slow-callback warning starts at 100 ms), and about what the thread
# hand-off it replaces costs on a loaded machine. Past runs only bound the
# next one when its work cannot depend on the data: a bound execution's
# shapes are fixed, and a model with control flow (a WHILE's trip count is
# the data's) is never run inline. A one-shot execution (``execute`` of a
# request) counts only when every input of its model has fixed shapes (the
# prepared model's record); otherwise it has no past runs. A driver service
# runs no app's work on its shared event loop: its front has inline_bound 0.
INLINE_BOUND = 0.0005
INLINE_AFTER = 2


class ScheduledDevice(Device):
    """``device`` behind a per-app priority scheduler with deadlines."""

    def __init__(self, device: Device, *, app: AppKey = None, slots: int | None = None,
                 queue_limit: int = DEFAULT_QUEUE_LIMIT, memory_limit: int | None = None,
                 clock: Callable[[], float] = time.monotonic, policy: Policy | None = None,
                 inline_bound: float = INLINE_BOUND):
        """``app`` keys the queue of models prepared without an explicit
        ``app=`` (default: this process's pid); ``slots`` is how many
        executions run at once (default: as many as the device says it
        runs); ``memory_limit`` (bytes) refuses bigger models with
        RESOURCE_EXHAUSTED_PERSISTENT; ``policy`` gives each app its
        weight, priority cap, limits and deadline kind (default:
        ``Policy()``, the same for every app); ``inline_bound`` (seconds
        of real time) is the longest run of a model whose executions may
        run on the awaiting task's thread (0: never)."""
        declared = device.scheduling()
        if declared.fronted:
            raise NnrtError(ErrorStatus.INVALID_ARGUMENT,
                            f"device {device.name} already has a scheduler in front of it")
        self.device = device
        self.name = device.name
        self.type = device.type
        self.version_string = device.version_string
        self.feature_level = device.feature_level
        self.app = os.getpid() if app is None else check_key(app, "app key")
        self._boundaries = declared.boundaries
        self.policy = Policy() if policy is None else policy
        # What each app declared when it connected (introduce_app): the
        # policy's script and app rules match it.
        self._declarations: dict[AppKey, AppDeclaration] = {}
        self.scheduler = Scheduler(slots=declared.slots if slots is None else slots,
                                   queue_limit=queue_limit, memory_limit=memory_limit,
                                   clock=clock, name=device.name,
                                   settings=self.policy.resolver(self._declarations.get))
        self.gate = ExecutionGate(self.scheduler, spawn=run_soon)
        if isinstance(inline_bound, bool) or not isinstance(inline_bound, (int, float)) \
                or not inline_bound >= 0:
            raise NnrtError(ErrorStatus.INVALID_ARGUMENT,
                            f"inline_bound must be seconds >= 0, got {inline_bound!r}")
        self.inline_bound = float(inline_bound)

    # -- queries: the driver's own answers ---------------------------------------

    def capabilities(self) -> Capabilities:
        return self.device.capabilities()

    def supported_extensions(self) -> list:
        return self.device.supported_extensions()

    def number_of_cache_files_needed(self) -> tuple[int, int]:
        return self.device.number_of_cache_files_needed()

    def scheduling(self) -> Scheduling:
        return Scheduling(self._boundaries, self.scheduler.slots, fronted=True)

    async def supported_operations(self, model: HalModel) -> list[bool]:
        return await self.device.supported_operations(model)

    @property
    def alive(self) -> bool:
        return self.device.alive

    def close(self) -> None:
        self.device.close()

    async def allocate(self, desc, prepared_models, input_roles, output_roles, *,
                       app: AppKey = None):
        """The driver's buffer for ``app`` (default: the front's): the roles'
        prepared models must be this front's and that app's; the driver gets
        its own prepared models behind them."""
        app = self.app if app is None else check_key(app, "app key")
        inner = []
        for k, prepared in enumerate(prepared_models):
            if not isinstance(prepared, ScheduledPreparedModel) or prepared._gate is not self.gate:
                raise NnrtError(ErrorStatus.INVALID_ARGUMENT,
                                f"allocate: prepared model {k} was not prepared on {self.name}")
            if prepared.app != app:
                raise NnrtError(ErrorStatus.INVALID_ARGUMENT,
                                f"allocate: prepared model {k} belongs to another app")
            inner.append(prepared.prepared)
        return await self.device.allocate(desc, inner, input_roles, output_roles, app=app)

    def set_policy(self, policy: Policy) -> None:
        """Apply a new policy (a service's SIGHUP) to known and future apps;
        work in flight and the apps' attained service are kept."""
        self.policy = policy
        self.gate.set_settings(policy.resolver(self._declarations.get))

    def settings_of(self, app: AppKey = None) -> AppSettings:
        """The settings the policy gives ``app`` (default: the front's app)."""
        return self.scheduler.settings_of(self.app if app is None else app)

    async def statistics(self) -> SchedulerStatistics:
        """The scheduler's counters per app and priority."""
        return self.gate.statistics()

    def load(self) -> SchedulerLoad:
        """How busy the device is now (cheap: a reply of a remote service
        carries it)."""
        return self.gate.load()

    async def finished_jobs(self) -> tuple[JobRecord, ...]:
        return self.gate.finished_jobs()

    def introduce_app(self, app: AppKey, declaration: AppDeclaration) -> None:
        """What ``app`` declared, for the policy to match when the scheduler
        first sees it. The first declaration of an app holds: the settings an
        app got do not change under it."""
        if not isinstance(declaration, AppDeclaration):
            raise invalid(f"introduce_app takes an AppDeclaration, got {declaration!r}")
        self._declarations.setdefault(check_key(app, "app key"), declaration)

    def forget_app(self, app: AppKey) -> None:
        """The app's counters leave the statistics (once its last job ends)."""
        app = check_key(app, "app key")
        self._declarations.pop(app, None)
        self.gate.forget_app(app)

    # -- preparation ---------------------------------------------------------------

    async def prepare_model(self, model: HalModel,
                            preference: ExecutionPreference = ExecutionPreference.FAST_SINGLE_ANSWER,
                            priority: Priority = Priority.MEDIUM, deadline: float | None = None,
                            cache=None, *, app: AppKey = None) -> "ScheduledPreparedModel":
        """Prepare ``model`` on the driver; its executions run at ``priority``
        in the queue of ``app`` (default: the front's ``app``)."""
        try:
            preference = ExecutionPreference(preference)
        except ValueError:
            raise NnrtError(ErrorStatus.INVALID_ARGUMENT,
                            f"execution preference {preference!r} is not valid") from None
        priority, deadline, app, settings = self._admit(priority, deadline, app)
        clock = self.scheduler.clock
        validate_model(model)   # sized below: a malformed model is refused, not measured
        control_flow = any(op.type in (OperationType.IF, OperationType.WHILE)
                           for op in model.main.operations)
        check_memory_limit(model_bytes(model),
                           self.scheduler.memory_limit if settings.memory_limit is None
                           else settings.memory_limit, "the model")
        prepared = await self.device.prepare_model(model, preference, priority, deadline, cache,
                                                   app=app)
        if deadline is not None and clock() > deadline:
            prepared.release()
            raise NnrtError(ErrorStatus.MISSED_DEADLINE_TRANSIENT,
                            "the model was prepared after its preparation deadline")
        vlog("driver", "%s: prepared %d operations behind the scheduler (app %r, %s)",
             self.name, len(model.main.operations), app, priority.name)
        fixed = all(model.main.operands[i].is_fully_specified for i in model.main.input_indexes)
        return ScheduledPreparedModel(prepared, self.gate, priority, app,
                                      self._boundaries is not Boundaries.NONE,
                                      0.0 if control_flow else self.inline_bound, fixed)

    def _admit(self, priority, deadline, app):
        """The checks every preparation starts with: ``(priority capped by
        the app's policy, deadline, app, the app's settings)``."""
        priority = check_priority(priority)
        deadline = check_deadline(deadline)
        app = self.app if app is None else check_key(app, "app key")
        if deadline is not None and self.scheduler.clock() > deadline:
            raise NnrtError(ErrorStatus.MISSED_DEADLINE_PERSISTENT,
                            "the preparation deadline had passed before preparation began")
        settings = self.gate.settings_of(app)
        if priority > settings.max_priority:
            vlog("driver", "%s: app %r asked for %s, its policy caps it at %s", self.name, app,
                 priority.name, settings.max_priority.name)
            priority = settings.max_priority
        return priority, deadline, app, settings

    async def prepare_model_from_cache(self, cache: CacheFiles,
                                       priority: Priority = Priority.MEDIUM,
                                       deadline: float | None = None, *,
                                       app: AppKey = None) -> "ScheduledPreparedModel":
        """Prepare from the driver's cache files, with the checks of
        :meth:`prepare_model`. Without a model to size, the memory limit
        applies to the cache files' bytes (they hold the model's constants)."""
        priority, deadline, app, settings = self._admit(priority, deadline, app)
        clock = self.scheduler.clock
        try:
            size = sum(os.fstat(fd).st_size for fd in (*cache.model, *cache.data))
        except OSError as e:
            raise NnrtError(ErrorStatus.INVALID_ARGUMENT, f"a cache fd: {e}") from None
        check_memory_limit(size, self.scheduler.memory_limit if settings.memory_limit is None
                           else settings.memory_limit, "the cached model")
        prepared = await self.device.prepare_model_from_cache(cache, priority, deadline, app=app)
        if deadline is not None and clock() > deadline:
            prepared.release()
            raise NnrtError(ErrorStatus.MISSED_DEADLINE_TRANSIENT,
                            "the model was prepared after its preparation deadline")
        vlog("driver", "%s: prepared a model from its cache behind the scheduler (app %r, %s)",
             self.name, app, priority.name)
        return ScheduledPreparedModel(prepared, self.gate, priority, app,
                                      self._boundaries is not Boundaries.NONE)

    def __repr__(self) -> str:
        return f"<ScheduledDevice {self.name} ({self.scheduler.slots} slot(s))>"


def model_bytes(model: HalModel) -> int:
    """Memory a model needs to run: its constants plus every operand whose
    size is known (an upper bound: the executor frees nothing mid-run)."""
    total = len(model.operand_values)
    total += sum(as_buffer(pool).nbytes for pool in model.pools)
    for sub in (model.main, *model.referenced):
        total += sum(o.byte_size for o in sub.operands if o.location is None)
    return total


class ScheduledPreparedModel(PreparedModel):
    """A driver's prepared model whose executions are scheduler jobs."""

    def __init__(self, prepared: PreparedModel, gate: ExecutionGate,
                 priority: Priority = Priority.MEDIUM, app: AppKey = None,
                 stops: bool = True, inline_bound: float = INLINE_BOUND,
                 fixed_shapes: bool = False):
        """``fixed_shapes``: every input of the model has fully specified
        dimensions, so every request runs the same shapes and its one-shot
        executions share one record of short runs (see ScheduledExecution)."""
        self.prepared = prepared
        self.priority = Priority(priority)
        self.app = app
        self._gate = gate
        self._stops = stops   # the driver calls the checkpoint at its boundaries
        # The scheduler's run-time estimate is kept per prepared model.
        self.key = f"prepared-{next(_PREPARED_IDS)}"
        # The longest run of one of its executions that counts as short (see INLINE_BOUND).
        self._inline_bound_ns = int(inline_bound * 1e9)
        self._one_shots = _ShortRuns() if fixed_shapes else None

    def release(self) -> None:
        self.prepared.release()

    def estimate(self) -> float | None:
        """What the scheduler believes one execution of this model takes
        (seconds; None before its first run): what deadlines are judged by."""
        return self._gate.estimate(self.key)

    def create_execution(self, request: Request, measure: bool = False,
                         loop_timeout: float | None = None) -> "ScheduledExecution":
        """The driver's execution of ``request`` (bound once, by the driver),
        each computation a scheduler job."""
        return ScheduledExecution(self, self.prepared.create_execution(request, measure,
                                                                       loop_timeout))

    def _one_shot(self, request: Request, measure: bool,
                  loop_timeout: float | None) -> "ScheduledExecution | ExecutionResult":
        """An execution computed once; a request the driver refuses to bind
        is a result."""
        try:
            return ScheduledExecution(self, self.prepared.create_execution(
                request, measure, loop_timeout), self._one_shots)
        except NnrtError as e:
            return ExecutionResult(e.status, tuple(e.output_shapes or ()), message=e.message)
        except Exception as e:
            return ExecutionResult(ErrorStatus.GENERAL_FAILURE, message=f"the driver raised {e!r}")

    async def execute(self, request: Request, measure: bool = False,
                      deadline: float | None = None,
                      loop_timeout: float | None = None) -> ExecutionResult:
        """A one-shot :class:`ScheduledExecution` of ``request``."""
        execution = self._one_shot(request, measure, loop_timeout)
        if execution.__class__ is ExecutionResult:
            return execution
        return await execution.execute(deadline)

    def execute_synchronously(self, request: Request, measure: bool = False,
                              deadline: float | None = None,
                              loop_timeout: float | None = None, *,
                              checkpoint=None) -> ExecutionResult:
        """Queue, wait for a slot on this thread, run. ``checkpoint`` is not
        taken: this is the scheduler's own."""
        if checkpoint is not None:
            raise NnrtError(ErrorStatus.INVALID_ARGUMENT,
                            "a scheduled execution takes no outside checkpoint")
        execution = self._one_shot(request, measure, loop_timeout)
        if execution.__class__ is ExecutionResult:
            return execution
        return execution.execute_synchronously(deadline)

    def __repr__(self) -> str:
        return f"<ScheduledPreparedModel {self.key} app={self.app!r} {self.priority.name}>"


class _ShortRuns:
    """Runs in a row that took at most the inline bound (see ScheduledExecution)."""

    __slots__ = ("count",)

    def __init__(self):
        self.count = 0


class ScheduledExecution(Execution):
    """A driver's :class:`~nnrt.hal.Execution` whose computations are jobs of
    the model's app and priority.

    Whether a computation may run on the awaiting task's own thread (an
    inline run, no hand-off to a worker) is a record of short runs: the
    last INLINE_AFTER runs each took at most the model's inline bound of
    real time, unpreempted. A reusable execution keeps its own (its request
    is bound, so its shapes are fixed); the one-shot executions of a model
    whose inputs all have fixed shapes share the prepared model's; any other
    one-shot execution has none and never runs inline. Only a model with
    control flow (bound 0) could take longer on other data."""

    def __init__(self, model: ScheduledPreparedModel, inner: Execution,
                 record: _ShortRuns | None = None):
        self.model = model
        self.inner = inner
        self.request = inner.request
        self.measure = inner.measure
        self.loop_timeout = inner.loop_timeout
        self._record = _ShortRuns() if record is None else record

    @property
    def inline(self) -> bool:
        """Whether the next computation, when its job gets a slot at once,
        runs on the awaiting task's thread."""
        return self._record.count >= INLINE_AFTER

    def release(self) -> None:
        self.request = None
        self.inner.release()

    async def execute(self, deadline: float | None = None) -> ExecutionResult:
        """Compute on the thread of a job (a worker's, or a preempted job's:
        donation), or inline (see the class); the result goes from that
        thread to the awaiting task."""
        model = self.model
        gate = model._gate
        job = None
        if self._record.count >= INLINE_AFTER:
            # A schedule point, as any execute (the loop's other tasks run; a
            # cancelled caller stops here, with nothing queued), then the
            # inline run if the job gets its slot at once.
            await anyio.lowlevel.checkpoint()
            started = time.perf_counter_ns() if self.measure else 0   # (only a timing reads it)
            try:
                job, owned = gate.submit_here(
                    model.app, model.priority, model=model.key,
                    deadline=deadline if deadline is None else check_deadline(deadline))
            except NnrtError as e:
                return ExecutionResult(e.status, message=e.message)
            if owned:
                return self._run_claimed(job, started, inline=True)
        else:
            started = time.perf_counter_ns()
        waiter = Waiter()

        def work(job: Job) -> None:
            # Called by the gate once: on a thread that owns the job (its own,
            # or a preempted job's: donation), or with the job already ended.
            if job.state is JobState.DONE:
                result = ExecutionResult(job.status or ErrorStatus.GENERAL_FAILURE,
                                         message=job.message)
            else:
                try:
                    result = self._run_claimed(job, started)
                except BaseException as e:   # SystemExit and the like: still answer
                    waiter.deliver(ExecutionResult(ErrorStatus.GENERAL_FAILURE,
                                                   message=f"the execution was interrupted: {e!r}"))
                    raise
            waiter.deliver(result)
            if gate.running_donated():
                # This thread's own job, preempted by this one, resumes next:
                # let the awaiting task take the result first, rather than
                # compete with it for the CPU and the GIL (bounded).
                waiter.wait_taken(_DONOR_LINGER)

        if job is None:
            try:
                job = gate.submit(model.app, model.priority, deadline=check_deadline(deadline),
                                  model=model.key, work=work)
            except NnrtError as e:
                return ExecutionResult(e.status, message=e.message)
        else:
            gate.give_work(job, work)   # it waits: a worker thread runs it
        try:
            return await waiter.wait()
        except BaseException:
            # Cancelled: withdraw the job, or stop it at its next boundary
            # (which gives the slot back), and wait, shielded, until the
            # thread running it lets go of the request's pools, which the
            # caller may free as soon as this returns: at most one boundary.
            if gate.cancel(job):
                with anyio.CancelScope(shield=True):
                    await waiter.wait()
            raise

    def execute_synchronously(self, deadline: float | None = None, *,
                              checkpoint=None) -> ExecutionResult:
        """Queue, wait for a slot on this thread, run. ``checkpoint`` is not
        taken: this is the scheduler's own."""
        if checkpoint is not None:
            raise NnrtError(ErrorStatus.INVALID_ARGUMENT,
                            "a scheduled execution takes no outside checkpoint")
        model = self.model
        gate = model._gate
        started = time.perf_counter_ns()
        try:
            job, owned = gate.submit_here(model.app, model.priority,
                                          deadline=check_deadline(deadline), model=model.key)
        except NnrtError as e:
            return ExecutionResult(e.status, message=e.message)
        if not owned:
            try:
                gate.claim(job)     # no work offered: only this thread runs it
            except NnrtError as e:
                return ExecutionResult(e.status, message=e.message)
            except BaseException:
                gate.cancel(job)
                raise
        return self._run_claimed(job, started)

    def _run_claimed(self, job: Job, started: int, inline: bool = False) -> ExecutionResult:
        """Run a job this thread owns on the driver, with the gate's
        checkpoint at every boundary (none when ``inline``: an event loop's
        thread must never park), and give the slot back. A failure is a
        result; only what is not an Exception (KeyboardInterrupt) propagates,
        after the slot is given back. Traced as the span "scheduled run"."""
        model = self.model
        gate = model._gate
        checkpoint = Checkpoint(partial(gate.checkpoint, job), gate.scheduler.waiting) \
            if model._stops and not inline else None
        traced = time.monotonic_ns() if trace.recording else 0   # the span's start
        ran = time.perf_counter_ns()
        try:
            result = self.inner.execute_synchronously(job.deadline, checkpoint=checkpoint)
        except NnrtError as e:
            result = ExecutionResult(e.status, tuple(e.output_shapes or ()), message=e.message)
        except Exception as e:
            result = ExecutionResult(ErrorStatus.GENERAL_FAILURE,
                                     message=f"the driver raised {e!r}")
        except BaseException:   # KeyboardInterrupt in a synchronous caller: free the slot
            gate.finish(job, ErrorStatus.GENERAL_FAILURE, "the execution was interrupted")
            raise
        final = gate.finish(job, result.status, result.message)
        # Real time, not the scheduler's clock: what an inline run would
        # hold its event loop for. A preempted run is not short.
        now = time.perf_counter_ns()
        if job.preemptions == 0 and 0 < now - ran <= model._inline_bound_ns:
            self._record.count += 1
        else:
            self._record.count = 0
        if traced:
            trace.complete("scheduled run", traced / 1000, time.monotonic_ns() / 1000)
            trace.interval("queue wait", job.submitted_at, job.started_at, app=job.app,
                           priority=job.priority.name, preemptions=job.preemptions)
        if final != result.status:
            # Never report success for work that finished after its deadline.
            return ExecutionResult(final, result.output_shapes, message=job.message)
        if self.measure and result.status == ErrorStatus.NONE:
            # On the device: the scheduler's account of the job's run time,
            # preempted spells excluded (a driver timing itself across a
            # preemption would count the time it sat parked). In the driver:
            # from the call to now, queue waiting included.
            on_device = int(job.ran * 1_000_000)
            in_driver = max((now - started) // 1000, on_device)
            result = ExecutionResult(result.status, result.output_shapes,
                                     Timing(on_device, in_driver), result.message)
        return result

    def __repr__(self) -> str:
        state = "inline" if self.inline else "handed off"
        return f"<ScheduledExecution of {self.model.key} ({state}) {self.inner!r}>"
