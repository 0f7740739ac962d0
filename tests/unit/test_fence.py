"""Sync fences (states, outcome encoding, merge, waits) and the fenced-execution
engine, in one process. Cross-process passing is in
tests/integration/test_fence_processes.py."""
import gc
import os
import threading
import time

import anyio
import pytest

from nnrt.hal import NO_TIMING, UINT64_MAX, ExecutionResult, OutputShape, Timing
from nnrt.errors import ErrorStatus, NnrtError, ResultCode
from nnrt.fence import FenceState, MergeStatistics, SyncFence, merge_statistics
from nnrt.hal.fenced import run_fenced
from nnrt.fence.outcome import ERROR_TAG, decode_count, encode_outcome, parse_fdinfo

BACKENDS = {"asyncio": ("asyncio", {}), "uvloop": ("asyncio", {"use_uvloop": True}),
            "trio": ("trio", {})}


@pytest.fixture(params=sorted(BACKENDS))
def arun(request):
    """Run an async function to completion on asyncio, asyncio+uvloop and trio."""
    backend, options = BACKENDS[request.param]
    # uvloop opens a pipe on its first loop and keeps it; open it before any
    # test counts file descriptors.
    anyio.run(anyio.sleep, 0, backend=backend, backend_options=options)

    def run(fn, *args):
        return anyio.run(fn, *args, backend=backend, backend_options=options)
    return run


def open_fds() -> int:
    gc.collect()  # fences dropped by earlier tests close their fds when collected
    return len(os.listdir("/proc/self/fd"))


class FakeClock:
    def __init__(self, now=1000.0):
        self.now = now

    def __call__(self):
        return self.now


OK = ExecutionResult(ErrorStatus.NONE)


async def settle(fence: SyncFence):
    """Await a fence and return its state instead of raising on ERROR."""
    try:
        await fence.wait_signaled()
    except NnrtError:
        pass
    return fence.poll()


# -- outcome encoding ---------------------------------------------------------

def test_every_status_round_trips_through_the_counter():
    assert decode_count(0) == (FenceState.ACTIVE, ErrorStatus.NONE, True)
    assert decode_count(encode_outcome(ErrorStatus.NONE)) == (FenceState.SIGNALED, ErrorStatus.NONE, True)
    for status in ErrorStatus:
        if status is not ErrorStatus.NONE:
            assert decode_count(encode_outcome(status)) == (FenceState.ERROR, status, True)


@pytest.mark.parametrize("count", [2, 3, ERROR_TAG, ERROR_TAG | 9, 2 * ERROR_TAG | 5, 2**64 - 2])
def test_a_counter_no_single_signaler_writes_is_an_untrusted_error(count):
    assert decode_count(count) == (FenceState.ERROR, ErrorStatus.GENERAL_FAILURE, False)


def test_fdinfo_parsing():
    assert parse_fdinfo(b"pos:\t0\nflags:\t02004002\neventfd-count:     100000005\n") == ERROR_TAG | 5
    assert parse_fdinfo(b"pos:\t0\nflags:\t02\n") is None
    assert parse_fdinfo(b"eventfd-count: zz\n") is None


# -- states and transitions ---------------------------------------------------

def test_signal_makes_the_fence_readable_for_good_and_every_handle_sees_it():
    with SyncFence.create() as fence, fence.dup() as other:
        assert fence.poll() is FenceState.ACTIVE and other.poll() is FenceState.ACTIVE
        assert fence.wait_signaled_blocking(0) is False
        fence.signal()
        for _ in range(3):  # observing never consumes the outcome
            assert fence.poll() is FenceState.SIGNALED
            assert other.poll() is FenceState.SIGNALED
            assert other.wait_signaled_blocking(0) is True
        late = SyncFence.from_fd(os.dup(fence.fileno()))
        assert late.poll() is FenceState.SIGNALED and late.status is ErrorStatus.NONE
        late.close()


def test_signal_error_is_distinguishable_through_the_fd_alone():
    with SyncFence.create() as fence:
        fence.signal_error(ErrorStatus.MISSED_DEADLINE_TRANSIENT)
        assert fence.poll() is FenceState.ERROR
        with SyncFence.from_fd(os.dup(fence.fileno())) as seen:
            assert seen.poll() is FenceState.ERROR
            assert seen.status is ErrorStatus.MISSED_DEADLINE_TRANSIENT
            with pytest.raises(NnrtError) as e:
                seen.wait_signaled_blocking(0)
            assert e.value.status is ErrorStatus.MISSED_DEADLINE_TRANSIENT
            with pytest.raises(NnrtError) as e:
                seen.wait_signaled_nowait()
            assert e.value.status is ErrorStatus.MISSED_DEADLINE_TRANSIENT


@pytest.mark.parametrize("first, second", [("signal", "signal"), ("signal", "signal_error"),
                                           ("signal_error", "signal"), ("signal_error", "signal_error")])
def test_a_second_signal_is_an_illegal_transition_naming_state_and_event(first, second):
    def do(fence, what):
        fence.signal() if what == "signal" else fence.signal_error(ErrorStatus.GENERAL_FAILURE)
    with SyncFence.create() as fence:
        do(fence, first)
        before = fence.poll()
        with pytest.raises(NnrtError) as e:
            do(fence, second)
        assert e.value.result_code is ResultCode.BAD_STATE
        assert second in e.value.message and before.name in e.value.message
        assert fence.poll() is before


def test_signal_is_refused_when_another_holder_already_signaled():
    with SyncFence.create() as fence, fence.dup() as other:
        other.signal_error(ErrorStatus.DEVICE_UNAVAILABLE)
        with pytest.raises(NnrtError, match="signal is not allowed in state ERROR"):
            fence.signal()
        assert fence.status is ErrorStatus.DEVICE_UNAVAILABLE


@pytest.mark.parametrize("status", [ErrorStatus.NONE, 99, "GENERAL_FAILURE", None])
def test_signal_error_needs_an_error_status(status):
    with SyncFence.create() as fence:
        with pytest.raises(NnrtError) as e:
            fence.signal_error(status)
        assert e.value.status is ErrorStatus.INVALID_ARGUMENT
        assert fence.poll() is FenceState.ACTIVE


def test_a_foreign_write_reads_as_an_error_not_as_success():
    with SyncFence.create() as fence:
        os.eventfd_write(fence.fileno(), 7)
        assert fence.poll() is FenceState.ERROR and fence.status is ErrorStatus.GENERAL_FAILURE


def test_empty_fence_is_already_signaled_and_has_no_fd():
    fence = SyncFence.empty()
    assert fence.is_empty and fence.poll() is FenceState.SIGNALED and fence.wait_signaled_blocking(0) is True
    fence.wait_signaled_nowait()
    with pytest.raises(NnrtError, match="no file descriptor"):
        fence.fileno()
    with pytest.raises(NnrtError, match="not by hand"):
        fence.signal()
    assert fence.dup().is_empty
    fence.close()
    assert fence.closed


def test_close_is_idempotent_and_later_use_is_bad_state():
    fence = SyncFence.create()
    fd = fence.fileno()
    with fence:
        pass
    assert fence.closed
    fence.close()
    with pytest.raises(OSError):
        os.fstat(fd)
    for call in (fence.poll, fence.fileno, fence.signal, lambda: fence.wait_signaled_blocking(0)):
        with pytest.raises(NnrtError) as e:
            call()
        assert e.value.result_code is ResultCode.BAD_STATE


def test_from_fd_rejects_what_is_not_an_open_eventfd_and_leaves_it_to_the_caller():
    r, w = os.pipe()
    try:
        for bad in (r, -1, True, "3", 10**6):
            with pytest.raises(NnrtError) as e:
                SyncFence.from_fd(bad)
            assert e.value.status is ErrorStatus.INVALID_ARGUMENT
        os.fstat(r)  # still open: a refused fd is not adopted
    finally:
        os.close(r)
        os.close(w)


def test_a_fence_cannot_be_pickled_into_a_meaningless_fd_number():
    import pickle
    with SyncFence.create() as fence, pytest.raises(TypeError, match="SCM_RIGHTS"):
        pickle.dumps(fence)


def test_wait_times_out_and_validates_its_timeout():
    with SyncFence.create() as fence:
        assert fence.wait_signaled_blocking(0) is False
        assert fence.wait_signaled_blocking(0.01) is False
        for bad in (-1, float("nan"), "1", True):
            with pytest.raises(NnrtError) as e:
                fence.wait_signaled_blocking(bad)
            assert e.value.status is ErrorStatus.INVALID_ARGUMENT


def test_wait_returns_when_another_thread_signals():
    with SyncFence.create() as fence, fence.dup() as signaler:
        thread = threading.Thread(target=signaler.signal)
        thread.start()
        assert fence.wait_signaled_blocking(30) is True
        thread.join()


# -- merge --------------------------------------------------------------------

def test_merge_signals_once_every_member_has_even_when_members_are_closed():
    a, b, c = (SyncFence.create() for _ in range(3))
    a_signaler = a.dup()
    merged = SyncFence.merge([a, b, c])
    a.close()  # the watcher holds its own fds on the members
    b.signal()
    c.signal()
    assert merged.wait_signaled_blocking(0.02) is False  # a is still active
    with pytest.raises(NnrtError, match="not by hand"):
        merged.signal()
    a_signaler.signal()
    assert merged.wait_signaled_blocking(30) is True
    assert merge_statistics() == MergeStatistics(pending_merges=0, watched_fds=0)
    for f in (a_signaler, b, c, merged):
        f.close()


def test_merge_all_good_and_one_error():
    good = [SyncFence.create() for _ in range(3)]
    bad = [SyncFence.create() for _ in range(3)]
    merged_good = SyncFence.merge(good)
    merged_bad = SyncFence.merge(bad)
    for f in good:
        f.signal()
    bad[0].signal()
    bad[1].signal_error(ErrorStatus.RESOURCE_EXHAUSTED_TRANSIENT)
    assert merged_bad.poll() is FenceState.ACTIVE  # waits for all members, even after an error
    bad[2].signal_error(ErrorStatus.DEVICE_UNAVAILABLE)
    assert merged_good.wait_signaled_blocking(30) is True
    with pytest.raises(NnrtError) as e:
        merged_bad.wait_signaled_blocking(30)
    assert e.value.status is ErrorStatus.RESOURCE_EXHAUSTED_TRANSIENT  # first failed member in order
    assert merge_statistics() == MergeStatistics(pending_merges=0, watched_fds=0)
    for f in good + bad + [merged_good, merged_bad]:
        f.close()


def test_merge_of_settled_members_is_settled_at_once():
    done = SyncFence.create()
    done.signal()
    failed = SyncFence.create()
    failed.signal_error(ErrorStatus.OUTPUT_INSUFFICIENT_SIZE)
    assert SyncFence.merge([done, SyncFence.empty()]).poll() is FenceState.SIGNALED
    assert SyncFence.merge([]).poll() is FenceState.SIGNALED
    merged = SyncFence.merge([done, failed])
    assert merged.poll() is FenceState.ERROR and merged.status is ErrorStatus.OUTPUT_INSUFFICIENT_SIZE
    active = SyncFence.create()
    mixed = SyncFence.merge([failed, active])
    assert mixed.poll() is FenceState.ACTIVE
    active.signal()
    with pytest.raises(NnrtError) as e:
        mixed.wait_signaled_blocking(30)
    assert e.value.status is ErrorStatus.OUTPUT_INSUFFICIENT_SIZE


def test_merge_rejects_non_fences_and_closed_ones():
    closed = SyncFence.create()
    closed.close()
    for bad in ([3], [closed], [SyncFence.empty(), None]):
        with pytest.raises(NnrtError):
            SyncFence.merge(bad)


# -- async waits --------------------------------------------------------------

def test_many_async_waiters_wake_on_one_signal(arun):
    async def main():
        fence = SyncFence.create()
        woke = []

        async def waiter(i):
            await fence.wait_signaled()
            woke.append(i)

        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(waiter, i)
            await anyio.sleep(0.01)
            assert woke == []
            fence.signal()
        assert sorted(woke) == [0, 1, 2, 3]
        fence.close()
    before = open_fds()
    arun(main)
    assert open_fds() == before


def test_async_wait_raises_the_error_status(arun):
    async def main():
        fence = SyncFence.create()
        failures = []

        async def waiter():
            with pytest.raises(NnrtError) as e:
                await fence.wait_signaled()
            failures.append(e.value.status)

        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            tg.start_soon(waiter)
            await anyio.wait_all_tasks_blocked()
            with fence.dup() as signaler:
                signaler.signal_error(ErrorStatus.DEAD_OBJECT)
        assert failures == [ErrorStatus.DEAD_OBJECT] * 2
        assert fence.status is ErrorStatus.DEAD_OBJECT
        fence.close()
    arun(main)


def test_async_wait_can_be_cancelled_and_waited_again(arun):
    async def main():
        fence = SyncFence.create()
        with anyio.move_on_after(0.01) as scope:
            await fence.wait_signaled()
        assert scope.cancelled_caught
        with pytest.raises(anyio.WouldBlock):
            fence.wait_signaled_nowait()
        fence.signal()
        await fence.wait_signaled()
        fence.close()
    before = open_fds()
    arun(main)
    assert open_fds() == before


def test_async_wait_on_a_merged_fence(arun):
    async def main():
        a, b = SyncFence.create(), SyncFence.create()
        merged = SyncFence.merge([a, b])
        async with anyio.create_task_group() as tg:
            tg.start_soon(merged.wait_signaled)
            a.signal()
            await anyio.wait_all_tasks_blocked()
            b.signal()
        assert merged.poll() is FenceState.SIGNALED
    arun(main)


# -- run_fenced ---------------------------------------------------------------

def logging_run(log, name="run", result=OK):
    async def run(deadline):
        log.append(name)
        await anyio.sleep(0)
        return result
    return run


def test_the_run_does_not_start_before_the_app_signals_its_fence(arun):
    async def main():
        log = []
        gate = SyncFence.create()
        async with anyio.create_task_group() as tg:
            fence, callback = await run_fenced(tg, logging_run(log), [gate])
            await anyio.wait_all_tasks_blocked()  # the engine waits on the gate
            assert fence.poll() is FenceState.ACTIVE and not callback.done
            with pytest.raises(NnrtError) as e:
                callback.get_execution_info()
            assert e.value.result_code is ResultCode.BAD_STATE
            log.append("app signals")
            gate.signal()
            await fence.wait_signaled()
            log.append("fence seen")
        assert log == ["app signals", "run", "fence seen"]
        assert callback.get_execution_info() == (ErrorStatus.NONE, NO_TIMING, NO_TIMING)
    arun(main)


def test_a_chain_runs_in_order_and_the_app_awaits_only_the_last_fence(arun):
    async def main():
        log = []
        gate = SyncFence.create()
        async with anyio.create_task_group() as tg:
            f1, _ = await run_fenced(tg, logging_run(log, "stage1"), [gate])
            f2, _ = await run_fenced(tg, logging_run(log, "stage2"), [f1])
            f3, cb3 = await run_fenced(tg, logging_run(log, "stage3"), [f2])
            f1.close()
            f2.close()  # the engine keeps its own handles on its inputs
            log.append("go")
            gate.signal()
            await f3.wait_signaled()
        assert log == ["go", "stage1", "stage2", "stage3"]
        assert (await cb3.wait_execution_info())[0] is ErrorStatus.NONE
    arun(main)


def test_an_input_fence_error_fails_the_chain_without_running(arun):
    async def main():
        log = []
        gate = SyncFence.create()
        async with anyio.create_task_group() as tg:
            f1, cb1 = await run_fenced(tg, logging_run(log, "stage1"), [gate])
            f2, cb2 = await run_fenced(tg, logging_run(log, "stage2"), [f1, SyncFence.empty()])
            gate.signal_error(ErrorStatus.RESOURCE_EXHAUSTED_PERSISTENT)
            with pytest.raises(NnrtError) as e:
                await f2.wait_signaled()
        assert e.value.status is ErrorStatus.RESOURCE_EXHAUSTED_PERSISTENT
        assert log == []
        assert cb1.get_execution_info()[0] is ErrorStatus.RESOURCE_EXHAUSTED_PERSISTENT
        assert cb2.get_result().status is ErrorStatus.RESOURCE_EXHAUSTED_PERSISTENT
    arun(main)


def test_one_failed_fence_fails_at_once_while_another_is_still_active(arun):
    async def main():
        log = []
        never, failing = SyncFence.create(), SyncFence.create()
        async with anyio.create_task_group() as tg:
            fence, _ = await run_fenced(tg, logging_run(log), [never, failing])
            failing.signal_error(ErrorStatus.GENERAL_FAILURE)
            assert await settle(fence) is FenceState.ERROR
        assert fence.status is ErrorStatus.GENERAL_FAILURE and log == []
    arun(main)


def test_a_deadline_passing_before_the_fences_are_signaled_is_missed(arun):
    async def main():
        log = []
        never = SyncFence.create()
        async with anyio.create_task_group() as tg:
            fence, cb = await run_fenced(tg, logging_run(log), [never],
                                         deadline=time.monotonic() + 0.02)
            assert await settle(fence) is FenceState.ERROR
        assert fence.status is ErrorStatus.MISSED_DEADLINE_TRANSIENT and log == []
        assert cb.get_execution_info()[0] is ErrorStatus.MISSED_DEADLINE_TRANSIENT
    arun(main)


def test_a_deadline_already_passed_fails_without_waiting(arun):
    async def main():
        clock = FakeClock()
        log = []
        never = SyncFence.create()
        async with anyio.create_task_group() as tg:
            fence, _ = await run_fenced(tg, logging_run(log), [never], deadline=clock.now - 1, clock=clock)
            assert await settle(fence) is FenceState.ERROR
        assert fence.status is ErrorStatus.MISSED_DEADLINE_TRANSIENT and log == []
    arun(main)


def test_timeout_after_fence_aborts_a_run_that_does_not_finish(arun):
    async def main():
        log = []
        gate = SyncFence.create()

        async def run(deadline):
            log.append(("run", deadline is not None))
            await anyio.sleep_forever()

        async with anyio.create_task_group() as tg:
            fence, _ = await run_fenced(tg, run, [gate], timeout_after_fence=0.02)
            gate.signal()
            assert await settle(fence) is FenceState.ERROR
        assert fence.status is ErrorStatus.MISSED_DEADLINE_TRANSIENT
        assert log == [("run", True)]  # it ran, with the fence-relative deadline
    arun(main)


def test_the_run_gets_the_earlier_of_deadline_and_fence_plus_timeout(arun):
    async def main():
        clock = FakeClock(100.0)
        seen = []

        async def run(deadline):
            seen.append(deadline)
            return OK

        gate = SyncFence.create()
        async with anyio.create_task_group() as tg:
            f1, _ = await run_fenced(tg, run, [gate], deadline=110.0, timeout_after_fence=2.0, clock=clock)
            f2, _ = await run_fenced(tg, run, [gate], deadline=101.0, timeout_after_fence=2.0, clock=clock)
            clock.now = 100.5
            gate.signal()
            await f1.wait_signaled()
            await f2.wait_signaled()
        assert sorted(seen) == [101.0, 102.5]
    arun(main)


def test_a_success_reported_after_the_deadline_is_a_missed_deadline(arun):
    async def main():
        clock = FakeClock(100.0)

        async def slow(deadline):
            clock.now = deadline + 0.001
            return OK

        async with anyio.create_task_group() as tg:
            fence, cb = await run_fenced(tg, slow, [], timeout_after_fence=1.0, clock=clock)
            assert await settle(fence) is FenceState.ERROR
        assert cb.get_execution_info()[0] is ErrorStatus.MISSED_DEADLINE_TRANSIENT
    arun(main)


@pytest.mark.parametrize("outcome, status", [
    (ExecutionResult(ErrorStatus.OUTPUT_INSUFFICIENT_SIZE, (OutputShape((1, 8), False),)),
     ErrorStatus.OUTPUT_INSUFFICIENT_SIZE),
    (NnrtError(ErrorStatus.INVALID_ARGUMENT, "bad request"), ErrorStatus.INVALID_ARGUMENT),
    (ValueError("driver bug"), ErrorStatus.GENERAL_FAILURE),
    ("not a result", ErrorStatus.GENERAL_FAILURE),
    (ExecutionResult(99), ErrorStatus.GENERAL_FAILURE),
    (ExecutionResult(4), ErrorStatus.INVALID_ARGUMENT),  # a plain int status is accepted
])
def test_a_failed_run_signals_its_status(arun, outcome, status):
    async def main():
        async def run(deadline):
            if isinstance(outcome, Exception):
                raise outcome
            return outcome

        async with anyio.create_task_group() as tg:
            fence, cb = await run_fenced(tg, run, [], measure=True)
            assert await settle(fence) is FenceState.ERROR
        assert fence.status is status
        assert cb.get_execution_info() == (status, NO_TIMING, NO_TIMING)
        if isinstance(outcome, ExecutionResult):
            assert cb.get_result().output_shapes == outcome.output_shapes
    arun(main)


def test_timings_measure_from_the_call_and_from_the_last_fence(arun):
    async def main():
        clock = FakeClock(100.0)

        async def run(deadline):
            clock.now += 0.25
            return ExecutionResult(ErrorStatus.NONE, timing=Timing(200_000, 240_000))

        gate = SyncFence.create()
        async with anyio.create_task_group() as tg:
            fence, cb = await run_fenced(tg, run, [gate], measure=True, clock=clock)
            clock.now = 100.5
            gate.signal()
            await fence.wait_signaled()
        assert cb.get_execution_info() == (ErrorStatus.NONE, Timing(200_000, 750_000),
                                           Timing(200_000, 250_000))
    arun(main)


def test_timing_invariants_hold_on_the_real_clock(arun):
    async def main():
        async def run(deadline):
            await anyio.sleep(0.002)
            return ExecutionResult(ErrorStatus.NONE, timing=Timing(1_000_000, 1_000_000))

        async def unmeasured(deadline):
            return OK

        gate = SyncFence.create()
        async with anyio.create_task_group() as tg:
            f1, cb1 = await run_fenced(tg, run, [gate], measure=True)
            f2, cb2 = await run_fenced(tg, unmeasured, [gate], measure=True)
            await anyio.sleep(0.002)
            gate.signal()
        _, launched, fenced = cb1.get_execution_info()
        assert fenced.in_driver <= launched.in_driver
        assert launched.in_driver >= launched.on_device == 1_000_000  # driver's clock ran ahead
        assert fenced.in_driver >= fenced.on_device
        _, launched, fenced = cb2.get_execution_info()
        assert launched.on_device == fenced.on_device == UINT64_MAX
        assert 0 <= fenced.in_driver <= launched.in_driver < UINT64_MAX
    arun(main)


def test_the_callers_fence_cannot_be_signaled_and_closing_it_does_not_stop_the_run(arun):
    async def main():
        log = []
        async with anyio.create_task_group() as tg:
            fence, cb = await run_fenced(tg, logging_run(log), [])
            with pytest.raises(NnrtError, match="not by hand"):
                fence.signal()
            fence.close()
            assert (await cb.wait_execution_info())[0] is ErrorStatus.NONE
        assert log == ["run"]
    before = open_fds()
    arun(main)
    assert open_fds() == before


def test_cancelling_the_task_group_settles_the_fence_with_an_error(arun):
    async def main():
        never = SyncFence.create()
        async with anyio.create_task_group() as tg:
            fence, cb = await run_fenced(tg, logging_run([]), [never])
            await anyio.wait_all_tasks_blocked()
            tg.cancel_scope.cancel()
        assert fence.poll() is FenceState.ERROR and fence.status is ErrorStatus.GENERAL_FAILURE
        assert cb.get_execution_info()[0] is ErrorStatus.GENERAL_FAILURE
    arun(main)


def test_run_fenced_rejects_bad_arguments_before_starting_anything(arun):
    async def main():
        closed = SyncFence.create()
        closed.close()
        async with anyio.create_task_group() as tg:
            for kwargs in ({"wait_for": [3]}, {"wait_for": 3}, {"wait_for": [closed]},
                           {"deadline": float("nan")}, {"timeout_after_fence": -1},
                           {"timeout_after_fence": "1"}, {"run": None}):
                args = {"run": logging_run([]), "wait_for": [], **kwargs}
                with pytest.raises(NnrtError) as e:
                    await run_fenced(tg, args.pop("run"), **args)
                assert e.value.status is ErrorStatus.INVALID_ARGUMENT, kwargs
    before = open_fds()
    arun(main)
    assert open_fds() == before


def test_closing_a_handle_does_not_disturb_a_task_waiting_on_it(arun):
    async def main():
        fence = SyncFence.create()
        signaler = fence.dup()
        async with anyio.create_task_group() as tg:
            tg.start_soon(fence.wait_signaled)
            await anyio.wait_all_tasks_blocked()
            fence.close()  # the waiter waits on its own dup of the fd
            signaler.signal()
        signaler.close()
    before = open_fds()
    arun(main)
    assert open_fds() == before
