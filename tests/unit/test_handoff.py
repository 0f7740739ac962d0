"""The thread/loop hand-off primitives of nnrt/drivers/handoff.py and the
allocator settings of nnrt/memory/heap.py."""
import os
import subprocess
import sys
import threading

import anyio
import pytest

from nnrt.handoff import Waiter, WorkerThreads

TIMEOUT = 10.0


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_value_delivered_from_another_thread_wakes_the_awaiting_task(backend):
    async def main():
        waiter = Waiter()
        threading.Thread(target=waiter.deliver, args=("result",)).start()
        with anyio.fail_after(TIMEOUT):
            return await waiter.wait()

    assert anyio.run(main, backend=backend) == "result"


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_cancelled_wait_can_be_resumed_and_still_gets_the_value(backend):
    async def main():
        waiter = Waiter()
        with anyio.move_on_after(0.01) as scope:
            await waiter.wait()
        assert scope.cancelled_caught and not waiter.delivered
        threading.Thread(target=waiter.deliver, args=(42,)).start()
        with anyio.fail_after(TIMEOUT):
            return await waiter.wait()

    assert anyio.run(main, backend=backend) == 42


def test_the_delivering_thread_can_wait_until_the_task_took_the_value():
    async def main():
        waiter = Waiter()
        taken = []

        def deliver():
            waiter.deliver("v")
            taken.append(waiter.wait_taken(TIMEOUT))

        thread = threading.Thread(target=deliver)
        thread.start()
        assert await waiter.wait() == "v"
        await anyio.to_thread.run_sync(thread.join)
        unawaited = Waiter()
        unawaited.deliver("nobody waits")
        return taken, unawaited.wait_taken(0.01)

    taken, unawaited = anyio.run(main)
    assert taken == [True] and unawaited is False


def test_delivery_after_the_loop_ended_is_dropped_quietly():
    async def make():
        return Waiter()

    waiter = anyio.run(make)
    waiter.deliver("late")               # the loop is closed: nothing raises
    assert waiter.delivered and waiter.value == "late"


def test_a_blocking_waiter():
    waiter = Waiter(blocking=True)
    threading.Timer(0.01, waiter.deliver, args=("x",)).start()
    assert waiter.wait_blocking(TIMEOUT) == "x"


def test_worker_threads_are_reused_and_end_when_idle():
    pool = WorkerThreads("test-workers", idle_timeout=0.2)
    seen = []
    done = threading.Semaphore(0)

    def job():
        seen.append(threading.get_ident())
        done.release()

    for _ in range(5):                   # one after another: one thread serves all
        pool.run_soon(job)
        assert done.acquire(timeout=TIMEOUT)
    assert len(set(seen)) == 1
    worker = next(t for t in threading.enumerate() if t.ident == seen[0])
    worker.join(TIMEOUT)                 # idle past the timeout: it ends
    assert not worker.is_alive()
    pool.run_soon(job)                   # and a new one starts on demand
    assert done.acquire(timeout=TIMEOUT)


def test_concurrent_work_gets_more_threads():
    pool = WorkerThreads("test-workers", idle_timeout=1.0)
    barrier = threading.Barrier(4, timeout=TIMEOUT)   # deadlocks unless each has a thread
    finished = threading.Semaphore(0)

    def job():
        barrier.wait()
        finished.release()

    for _ in range(3):
        pool.run_soon(job)
    barrier.wait()
    for _ in range(3):
        assert finished.acquire(timeout=TIMEOUT)


def test_a_raising_callable_does_not_kill_the_worker():
    pool = WorkerThreads("test-workers", idle_timeout=1.0)
    idents, done = [], threading.Event()

    def bad():
        idents.append(threading.get_ident())
        raise ValueError("boom")

    def good():
        idents.append(threading.get_ident())
        done.set()

    pool.run_soon(bad)
    pool.run_soon(good)
    assert done.wait(TIMEOUT)
    assert len(idents) == 2


HEAP_PROBE = ("from nnrt.memory.heap import keep_freed_memory; "
              "print(keep_freed_memory(), keep_freed_memory())")


def _glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") is not None
    except (ValueError, OSError, AttributeError):
        return False


@pytest.mark.skipif(not _glibc(), reason="mallopt is glibc's")
@pytest.mark.service
def test_heap_settings_apply_once_and_can_be_turned_off():
    on = subprocess.run([sys.executable, "-c", HEAP_PROBE], capture_output=True, text=True,
                        env=dict(os.environ, NNRT_KEEP_FREED_MEMORY="1"), check=True)
    off = subprocess.run([sys.executable, "-c", HEAP_PROBE], capture_output=True, text=True,
                         env=dict(os.environ, NNRT_KEEP_FREED_MEMORY="0"), check=True)
    assert on.stdout.split() == ["True", "True"]
    assert off.stdout.split() == ["False", "False"]
