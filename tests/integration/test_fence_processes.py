"""Sync fences across real processes: the fd is inherited by a fresh
interpreter (pass_fds) or sent as SCM_RIGHTS over a Unix socketpair to a
forked child; one side signals, the other awaits and sees the right outcome.
Each child is told when to signal, so the tests order events instead of
timing them. Forked children (cheap) serve the tests where the fd must
travel by SCM_RIGHTS anyway; a fresh interpreter (about half a second to
import nnrt) shows that nothing but the fd is shared."""
import os
import socket
import subprocess
import sys
import traceback
from pathlib import Path

import anyio
import pytest

from nnrt.hal import ExecutionResult
from nnrt.errors import ErrorStatus, NnrtError
from nnrt.fence import FenceState, MergeStatistics, SyncFence, merge_statistics
from nnrt.hal.fenced import run_fenced

ROOT = Path(__file__).resolve().parents[2]

# signal FD STATUS: adopt the inherited fd, wait for a line on stdin, signal.
CHILD = r'''
import sys
from nnrt.errors import ErrorStatus
from nnrt.fence import SyncFence
fence = SyncFence.from_fd(int(sys.argv[1]))
sys.stdin.readline()
if sys.argv[2] == "NONE":
    fence.signal()
else:
    fence.signal_error(ErrorStatus[sys.argv[2]])
print("signaled", flush=True)
'''


def spawn_signaler(fence: SyncFence, status: ErrorStatus) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, str(fence.fileno()), status.name],
                            cwd=ROOT, pass_fds=[fence.fileno()], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def go(proc: subprocess.Popen) -> None:
    proc.stdin.write("go\n")
    proc.stdin.flush()


def finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    return out


def fork(child, *args) -> int:
    """Run ``child(*args)`` in a forked process; it exits 0 unless it raised."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            child(*args)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    return pid


def join(pid: int) -> None:
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def socketpair():
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)


@pytest.mark.parametrize("backend, status", [("asyncio", ErrorStatus.NONE),
                                             ("trio", ErrorStatus.MISSED_DEADLINE_PERSISTENT)],
                         ids=["signal-asyncio", "error-trio"])
def test_a_child_process_signals_and_the_parent_awaits(backend, status):
    fence = SyncFence.create()
    proc = spawn_signaler(fence, status)

    async def main():
        outcome = []

        async def waiter():
            try:
                await fence.wait_signaled()
                outcome.append(ErrorStatus.NONE)
            except NnrtError as e:
                outcome.append(e.status)

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(waiter)
                await anyio.wait_all_tasks_blocked()
                assert fence.poll() is FenceState.ACTIVE and outcome == []
                go(proc)
        return outcome

    assert anyio.run(main, backend=backend) == [status]
    assert finish(proc).strip() == "signaled"
    assert fence.poll() is (FenceState.SIGNALED if status is ErrorStatus.NONE else FenceState.ERROR)
    assert fence.status is status
    fence.close()


def test_a_fence_signaled_by_another_process_gates_a_fenced_execution():
    gate = SyncFence.create()
    proc = spawn_signaler(gate, ErrorStatus.NONE)
    log = []

    async def run(deadline):
        log.append("run")
        return ExecutionResult(ErrorStatus.NONE)

    async def main():
        async with anyio.create_task_group() as tg:
            fence, callback = await run_fenced(tg, run, [gate])
            gate.close()  # the engine holds its own handle
            await anyio.wait_all_tasks_blocked()
            log.append("child signals")
            go(proc)
            with anyio.fail_after(30):
                await fence.wait_signaled()
        return callback.get_execution_info()[0]

    assert anyio.run(main) is ErrorStatus.NONE
    assert log == ["child signals", "run"]
    finish(proc)


def receive_and_signal_error(sock: socket.socket) -> None:
    _, fds, _, _ = socket.recv_fds(sock, 16, 1)
    fence = SyncFence.from_fd(fds[0])
    assert fence.poll() is FenceState.ACTIVE
    assert sock.recv(16) == b"go"
    fence.signal_error(ErrorStatus.DEVICE_UNAVAILABLE)
    sock.sendall(b"signaled")


def test_a_fence_sent_by_scm_rights_is_signaled_with_an_error_by_the_receiver():
    parent_end, child_end = socketpair()
    pid = fork(receive_and_signal_error, child_end)
    child_end.close()
    fence = SyncFence.create()  # created after the fork: only SCM_RIGHTS can carry it

    async def main():
        socket.send_fds(parent_end, [b"fence"], [fence.fileno()])
        parent_end.sendall(b"go")
        with pytest.raises(NnrtError) as e, anyio.fail_after(30):  # a dead child must not hang us
            await fence.wait_signaled()
        return e.value.status

    assert anyio.run(main) is ErrorStatus.DEVICE_UNAVAILABLE
    assert parent_end.recv(16) == b"signaled"
    join(pid)
    assert fence.poll() is FenceState.ERROR and fence.status is ErrorStatus.DEVICE_UNAVAILABLE
    parent_end.close()
    fence.close()


def create_send_and_signal(sock: socket.socket) -> None:
    fence = SyncFence.create()
    socket.send_fds(sock, [b"fence"], [fence.fileno()])
    assert sock.recv(16) == b"go"
    fence.signal()
    sock.sendall(b"signaled")


def test_a_fence_created_by_a_child_is_awaited_by_the_parent():
    parent_end, child_end = socketpair()
    pid = fork(create_send_and_signal, child_end)
    child_end.close()

    async def main():
        _, fds, _, _ = socket.recv_fds(parent_end, 16, 1)
        fence = SyncFence.from_fd(fds[0])
        assert fence.poll() is FenceState.ACTIVE
        parent_end.sendall(b"go")
        with anyio.fail_after(30):
            await fence.wait_signaled()
        return fence

    fence = anyio.run(main, backend="trio")
    assert fence.poll() is FenceState.SIGNALED
    assert parent_end.recv(16) == b"signaled"
    join(pid)
    fence.close()
    parent_end.close()


def observe_and_report(sock: socket.socket) -> None:
    _, fds, _, _ = socket.recv_fds(sock, 16, 3)
    report = []
    for fd in fds:
        with SyncFence.from_fd(fd) as fence:
            report.append(f"{fence.poll().name} {fence.status.name}")
    sock.sendall("\n".join(report).encode())


def test_other_processes_observe_outcomes_without_consuming_them():
    good, bad, active = SyncFence.create(), SyncFence.create(), SyncFence.create()
    good.signal()
    bad.signal_error(ErrorStatus.DEAD_OBJECT)
    expected = b"SIGNALED NONE\nERROR DEAD_OBJECT\nACTIVE NONE"
    for _ in range(2):  # the second observer sees what the first saw
        parent_end, child_end = socketpair()
        pid = fork(observe_and_report, child_end)
        child_end.close()
        socket.send_fds(parent_end, [b"fences"], [good.fileno(), bad.fileno(), active.fileno()])
        assert parent_end.recv(256) == expected
        join(pid)
        parent_end.close()
    with SyncFence.from_fd(os.dup(good.fileno())) as again:
        assert again.poll() is FenceState.SIGNALED
    for f in (good, bad, active):
        f.close()


def wait_on_received(sock: socket.socket) -> None:
    _, fds, _, _ = socket.recv_fds(sock, 16, 1)
    fence = SyncFence.from_fd(fds[0])
    sock.sendall(b"waiting")
    try:
        fence.wait_signaled_blocking(30)
        sock.sendall(b"SIGNALED")
    except NnrtError as e:
        sock.sendall(f"ERROR {e.status.name}".encode())


def test_a_merged_fence_wakes_a_waiter_in_another_process():
    a, b = SyncFence.create(), SyncFence.create()
    merged = SyncFence.merge([a, b])
    parent_end, child_end = socketpair()
    pid = fork(wait_on_received, child_end)
    child_end.close()
    socket.send_fds(parent_end, [b"fence"], [merged.fileno()])
    assert parent_end.recv(16) == b"waiting"
    a.signal()
    b.signal_error(ErrorStatus.RESOURCE_EXHAUSTED_TRANSIENT)
    assert parent_end.recv(64) == b"ERROR RESOURCE_EXHAUSTED_TRANSIENT"
    join(pid)
    for f in (a, b, merged):
        f.close()
    parent_end.close()


def merge_in_child(b: SyncFence) -> None:
    # No watcher thread was inherited: a fresh watcher serves the child.
    assert merge_statistics() == MergeStatistics(0, 0)
    mine = SyncFence.merge([b])
    b.signal()
    assert mine.wait_signaled_blocking(30) is True


def test_merging_works_in_a_forked_child_while_the_parent_has_a_merge_pending():
    a, b = SyncFence.create(), SyncFence.create()
    merged = SyncFence.merge([a])  # the parent's watcher thread now waits on a
    join(fork(merge_in_child, b))
    assert merged.poll() is FenceState.ACTIVE
    a.signal()
    assert merged.wait_signaled_blocking(30) is True
    for f in (a, b, merged):
        f.close()
