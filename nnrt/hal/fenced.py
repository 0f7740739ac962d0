"""The fenced-execution engine: wait for input fences, run, signal a fence.

Independent of drivers: a driver (in-process or inside a driver service)
hands it an async ``run`` callable and gets back what HAL 1.3's
``executeFenced`` returns, a sync fence and a callback.

Theory of operation
-------------------
``run_fenced(task_group, run, wait_for, ...)`` validates its arguments,
duplicates the ``wait_for`` fences (so the caller may close its handles at
once), creates the result fence F, starts the execution as a task of the
caller's ``task_group`` and returns ``(F, callback)`` without waiting. The
task group is the caller's because the execution must outlive the call that
started it but not the service that owns it: cancelling the group (service
shutdown) settles F with GENERAL_FAILURE rather than leaving it ACTIVE.

The task walks the table ``_PHASES``:

    WAITING_FOR_FENCES --fences_signaled--> RUNNING --run_finished--> FINISHED
           |  fence_error / deadline_missed / cancelled        |
           +-----------------------> FAILED <------------------+
                                   deadline_missed / cancelled

Waiting costs nothing on the event loop: each still-active fence is awaited
through its fd's readability (``SyncFence.wait_signaled``). A single one (a
pipeline stage) is awaited directly; several are awaited concurrently, so the
first fence signaled with an error ends the wait at once (fail fast: the
execution will not run, so no buffer of ours is in use).

Deadlines are absolute times on ``clock`` (``time.monotonic`` by default).
Before the fences are signaled only ``deadline`` applies; once they are, the
run must finish by ``min(deadline, fenced_at + timeout_after_fence)``, and
that combined deadline is handed to ``run`` so the driver can abort its own
work. Missing either gives MISSED_DEADLINE_TRANSIENT: waiting for fences or
for another stage says nothing about what the execution itself costs, so a
retry with a later deadline may well succeed (PERSISTENT is for work that
cannot make its deadline even on an idle device). A run that reports success
after the deadline is reported as missed too, never as a late success.

Every outcome is recorded in the callback *before* F's eventfd is written,
so whoever wakes on F finds ``get_execution_info()`` ready.
"""
from __future__ import annotations

import dataclasses
import enum
import math
import time
from typing import Awaitable, Callable, Iterable

import anyio
import anyio.abc

from .types import NO_TIMING, UINT64_MAX, ExecutionResult, Timing
from ..errors import ErrorStatus, NnrtError, bad_state, invalid
from .types import check_deadline
from ..vlog import vlog
from ..fence.sync_fence import SyncFence


class Phase(enum.Enum):
    WAITING_FOR_FENCES = "waiting_for_fences"
    RUNNING = "running"
    FINISHED = "finished"   # run() returned; its status may still be an error
    FAILED = "failed"       # never ran, or was stopped before it returned


_PHASES: dict[tuple[Phase, str], Phase] = {
    (Phase.WAITING_FOR_FENCES, "fences_signaled"): Phase.RUNNING,
    (Phase.WAITING_FOR_FENCES, "fence_error"): Phase.FAILED,
    (Phase.WAITING_FOR_FENCES, "deadline_missed"): Phase.FAILED,
    (Phase.WAITING_FOR_FENCES, "cancelled"): Phase.FAILED,
    (Phase.RUNNING, "run_finished"): Phase.FINISHED,
    (Phase.RUNNING, "deadline_missed"): Phase.FAILED,
    (Phase.RUNNING, "cancelled"): Phase.FAILED,
}

RunFn = Callable[[float | None], Awaitable[ExecutionResult]]


class FencedExecutionCallback:
    """What a fenced execution reports once its fence is signaled (HAL
    ``IFencedExecutionCallback``). Nothing is available before: outputs of a
    fenced execution must not be read until its fence is signaled."""

    def __init__(self):
        self._done = anyio.Event()
        self._result: ExecutionResult | None = None
        self._info: tuple[ErrorStatus, Timing, Timing] | None = None

    @property
    def done(self) -> bool:
        return self._info is not None

    def get_execution_info(self) -> tuple[ErrorStatus, Timing, Timing]:
        """``(status, timing_launched, timing_fenced)``; each Timing is
        ``(on_device, in_driver)`` in microseconds, UINT64_MAX when not measured.
        BAD_STATE before the execution's fence is signaled."""
        if self._info is None:
            raise bad_state("get_execution_info: the fenced execution's fence is not signaled yet")
        return self._info

    def get_result(self) -> ExecutionResult:
        """The ``ExecutionResult`` of ``run`` (or of the engine, when it never ran),
        with its message; BAD_STATE before the fence is signaled."""
        if self._result is None:
            raise bad_state("get_result: the fenced execution's fence is not signaled yet")
        return self._result

    async def wait_execution_info(self) -> tuple[ErrorStatus, Timing, Timing]:
        """Wait for the execution to settle, then return :meth:`get_execution_info`."""
        await self._done.wait()
        return self.get_execution_info()

    def _settle(self, result: ExecutionResult, launched: Timing, fenced: Timing) -> None:
        self._result = result
        self._info = (result.status, launched, fenced)
        self._done.set()


class _FencedExecution:
    def __init__(self, run: RunFn, wait_for: list[SyncFence], measure: bool,
                 deadline: float | None, timeout_after_fence: float | None, clock,
                 launched_at: float):
        self.run = run
        self.wait_for = wait_for
        self.measure = measure
        self.deadline = deadline
        self.timeout_after_fence = timeout_after_fence
        self.clock = clock
        self.launched_at = launched_at
        self.fenced_at: float | None = None
        self.phase = Phase.WAITING_FOR_FENCES
        self.fence = SyncFence.create()
        self.callback = FencedExecutionCallback()

    def _step(self, event: str) -> None:
        try:
            self.phase = _PHASES[(self.phase, event)]
        except KeyError:
            raise bad_state(f"fenced execution: {event} is not allowed in phase {self.phase.name}") from None

    async def serve(self) -> None:
        try:
            try:
                result = await self._execute()
            except BaseException:
                # Cancelled (the owner's task group is shutting down) or a bug:
                # the fence must not stay ACTIVE for whoever waits on it.
                if self.phase in (Phase.WAITING_FOR_FENCES, Phase.RUNNING):
                    self._step("cancelled")
                    self._finish(ExecutionResult(ErrorStatus.GENERAL_FAILURE,
                                                 message="the fenced execution was cancelled"))
                raise
            self._finish(result)
        finally:
            for f in self.wait_for:
                f.close()
            self.fence.close()

    async def _execute(self) -> ExecutionResult:
        failure = await self._wait_for_fences()
        if failure is not None:
            return failure
        self.fenced_at = self.clock()
        run_deadline = self.deadline
        if self.timeout_after_fence is not None:
            after_fence = self.fenced_at + self.timeout_after_fence
            run_deadline = after_fence if run_deadline is None else min(run_deadline, after_fence)
        if run_deadline is not None and self.clock() > run_deadline:
            return self._missed("the deadline passed before the execution could start")
        self._step("fences_signaled")
        result = await _within(run_deadline, self.clock, self._run(run_deadline))
        late = (run_deadline is not None and self.clock() > run_deadline
                and result is not None and result.status is ErrorStatus.NONE)
        if result is None or late:  # None: stopped by the deadline
            return self._missed("the execution did not finish within its deadline "
                                "or timeout_after_fence")
        self._step("run_finished")
        return result

    async def _run(self, run_deadline: float | None) -> ExecutionResult:
        try:
            return _checked(await self.run(run_deadline))
        except NnrtError as e:
            return ExecutionResult(e.status, tuple(e.output_shapes or ()), message=e.message)
        except Exception as e:  # a driver bug must not take the service down
            vlog("execution", "fenced run raised %r", e)
            return ExecutionResult(ErrorStatus.GENERAL_FAILURE,
                                   message=f"the execution raised {type(e).__name__}: {e}")

    async def _wait_for_fences(self) -> ExecutionResult | None:
        """None once every fence is signaled, else the failure to report."""
        if self.deadline is not None and self.clock() > self.deadline:
            return self._missed("the deadline passed before the input fences were waited for")
        pending = []
        for f in self.wait_for:
            try:
                f.wait_signaled_nowait()
            except anyio.WouldBlock:
                pending.append(f)
            except NnrtError as e:
                return self._fence_failed(e.status)
        if not pending:
            return None
        # One fence (a pipeline stage) is awaited directly; several at once,
        # so that the first one signaled with an error ends the wait.
        wait = pending[0].wait_signaled() if len(pending) == 1 else _wait_all(pending)
        try:
            done = await _within(self.deadline, self.clock, _returning(True, wait))
        except NnrtError as e:
            return self._fence_failed(e.status)
        if done is None:
            return self._missed("the deadline passed before the input fences were signaled")
        return None

    def _fence_failed(self, status: ErrorStatus) -> ExecutionResult:
        self._step("fence_error")
        return ExecutionResult(status, message=f"an input fence was signaled with error {status.name}")

    def _missed(self, message: str) -> ExecutionResult:
        self._step("deadline_missed")
        return ExecutionResult(ErrorStatus.MISSED_DEADLINE_TRANSIENT, message=message)

    def _finish(self, result: ExecutionResult) -> None:
        signal_at = self.clock()
        launched = fenced = NO_TIMING
        if self.measure and result.status is ErrorStatus.NONE:
            on_device = result.timing.on_device
            launched_us = microseconds(signal_at - self.launched_at)
            fenced_us = min(microseconds(signal_at - self.fenced_at), launched_us)
            if on_device != UINT64_MAX:
                # Two clocks (the driver's and ours) measure nested intervals;
                # keep the HAL invariant in_driver >= on_device exact.
                launched_us, fenced_us = max(launched_us, on_device), max(fenced_us, on_device)
            launched, fenced = Timing(on_device, launched_us), Timing(on_device, fenced_us)
        self.callback._settle(result, launched, fenced)
        vlog("execution", "fenced execution %s: %s", self.phase.name, result.status.name)
        if self.fence.closed:
            return
        if result.status is ErrorStatus.NONE:
            self.fence.signal()
        else:
            self.fence.signal_error(result.status)


async def _within(deadline: float | None, clock, coro):
    """Await ``coro`` and return its value, or None if ``deadline`` (on ``clock``)
    passes first. No cancel scope when there is no deadline: they are not free."""
    if deadline is None:
        return await coro
    with anyio.move_on_after(deadline - clock()):
        return await coro
    return None


async def _returning(value, coro):
    await coro
    return value


async def _wait_all(fences: list[SyncFence]) -> None:
    """Wait until every fence is signaled; NnrtError as soon as one is signaled
    with an error (the others are no longer waited for)."""
    failed: list[NnrtError] = []

    async def watch(fence: SyncFence) -> None:
        try:
            await fence.wait_signaled()
        except NnrtError as e:
            failed.append(e)
            group.cancel_scope.cancel()

    async with anyio.create_task_group() as group:
        for fence in fences:
            group.start_soon(watch, fence)
    if failed:
        raise failed[0]


def _checked(result) -> ExecutionResult:
    """``result`` with an ErrorStatus member for its status, or a GENERAL_FAILURE
    naming what ``run`` returned instead."""
    if not isinstance(result, ExecutionResult):
        return ExecutionResult(ErrorStatus.GENERAL_FAILURE,
                               message=f"run returned a {type(result).__name__}, not an ExecutionResult")
    try:
        status = ErrorStatus(result.status)
    except ValueError:
        return ExecutionResult(ErrorStatus.GENERAL_FAILURE,
                               message=f"run returned status {result.status!r}, not an ErrorStatus")
    return result if status is result.status else dataclasses.replace(result, status=status)


def microseconds(seconds: float) -> int:
    return max(0, round(seconds * 1_000_000))


def check_wait_for(wait_for) -> list[SyncFence]:
    try:
        fences = list(wait_for)
    except TypeError:
        raise invalid(f"wait_for must be a list of SyncFence, not {type(wait_for).__name__}") from None
    for i, f in enumerate(fences):
        if not isinstance(f, SyncFence):
            raise invalid(f"wait_for[{i}] is a {type(f).__name__}, not a SyncFence")
        if f.closed:
            raise invalid(f"wait_for[{i}] is a closed SyncFence")
    return fences


def check_timeout_after_fence(timeout_after_fence) -> float | None:
    if timeout_after_fence is None:
        return None
    if isinstance(timeout_after_fence, bool) or not isinstance(timeout_after_fence, (int, float)) \
            or math.isnan(timeout_after_fence) or timeout_after_fence < 0:
        raise invalid(f"timeout_after_fence {timeout_after_fence!r} is not None or "
                      "a number of seconds >= 0")
    return float(timeout_after_fence)


async def run_fenced(task_group: anyio.abc.TaskGroup, run: RunFn, wait_for: Iterable[SyncFence] = (),
                     *, measure: bool = False, deadline: float | None = None,
                     timeout_after_fence: float | None = None,
                     clock: Callable[[], float] = time.monotonic,
                     ) -> tuple[SyncFence, FencedExecutionCallback]:
    """Start a fenced execution in ``task_group`` and return ``(fence, callback)`` at once.

    ``run(deadline)`` is awaited once every fence in ``wait_for`` is signaled;
    it gets the absolute deadline on ``clock`` it must finish by (or None) and
    returns an ``ExecutionResult``. The returned fence is SIGNALED when it
    succeeds and ERROR (with the status) otherwise; the caller owns it and may
    pass it on, but cannot signal it. ``wait_for`` fences are duplicated, so
    the caller may close its own handles right away. ``measure`` asks for
    the timings of ``callback.get_execution_info()``.

    INVALID_ARGUMENT (raised here, nothing started) for a bad argument.
    """
    launched_at = clock()
    if not callable(run):
        raise invalid(f"run must be an async callable, not {type(run).__name__}")
    fences = check_wait_for(wait_for)
    deadline = check_deadline(deadline)
    timeout_after_fence = check_timeout_after_fence(timeout_after_fence)
    owned: list[SyncFence] = []
    execution = None
    try:
        for f in fences:
            owned.append(f.dup())
        execution = _FencedExecution(run, owned, bool(measure), deadline, timeout_after_fence,
                                     clock, launched_at)
        caller_fence = execution.fence._dup(can_signal=False)
    except BaseException:
        for f in owned:
            f.close()
        if execution is not None:
            execution.fence.close()
        raise
    task_group.start_soon(execution.serve, name="nnrt fenced execution")
    return caller_fence, execution.callback


__all__ = ["FencedExecutionCallback", "Phase", "run_fenced"]
