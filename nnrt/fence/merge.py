"""The merge watcher: signals a merged fence once all of its members are.

Theory of operation
-------------------
A merged fence must signal even when nobody in this process is awaiting it:
it may have been passed to another process, or be waited on synchronously
from a script. So it cannot be driven by a task of some event loop. Instead
one daemon thread per process (started by the first merge that has to wait)
blocks in ``epoll_wait`` on every pending member; this is the user-space
stand-in for the kernel's sync_file merge.

Ownership: :meth:`MergeWatcher.add` receives *dups* of the member fds and of
the merged fence's fd and owns them from then on, so the app may close its
own fence objects at any time. A member fd is unregistered and closed as soon
as it is readable (a signaled eventfd stays readable, so level-triggered
epoll would report it forever); the output fd is closed after the outcome is
written.

Outcome: the merged fence signals when every member has signaled, like the
kernel's fence arrays — not early on the first error, because a member that
is still running may still be writing buffers the app would reuse once it
sees the merged fence settle. If any member ended in ERROR, the merged fence
ends in ERROR with the status of the first such member in the order given.

Locking: ``_lock`` guards ``_members`` and the statistics. ``add`` registers
with epoll while holding it, so the thread, which takes it before looking an
fd up, never sees an fd that is registered but not yet in ``_members``.
``epoll_ctl`` is safe to call while another thread is in ``epoll_wait``.

Fork: the child gets a copy of the tables but not the thread; the at-fork
hook closes the child's copies of the fds and gives it a fresh watcher. The
parent's watcher keeps serving the parent's merges.
"""
from __future__ import annotations

import os
import select
import threading
from dataclasses import dataclass

from ..errors import ErrorStatus, NnrtError
from ..handoff import run_soon
from .outcome import FenceState, decode_count, encode_outcome, peek_count


@dataclass(frozen=True)
class MergeStatistics:
    pending_merges: int   # merged fences not yet signaled by the watcher
    watched_fds: int      # member fds the watcher is waiting on


class _Merge:
    __slots__ = ("output_fd", "statuses", "remaining")

    def __init__(self, output_fd: int, statuses: list[ErrorStatus | None]):
        self.output_fd = output_fd
        self.statuses = statuses
        self.remaining = sum(s is None for s in statuses)


def merged_status(statuses) -> ErrorStatus:
    """The outcome of a merge once all members are done: the first error, else NONE."""
    return next((s for s in statuses if s is not ErrorStatus.NONE), ErrorStatus.NONE)


class MergeWatcher:
    def __init__(self):
        self._lock = threading.Lock()
        self._epoll: select.epoll | None = None
        self._members: dict[int, tuple[_Merge, int]] = {}
        self._pending = 0

    def add(self, output_fd: int, member_fds: list[int | None],
            known: list[ErrorStatus | None]) -> None:
        """Watch ``member_fds`` (None where ``known`` already holds the outcome)
        and write the merged outcome to ``output_fd``. Takes ownership of every fd."""
        merge = _Merge(output_fd, list(known))
        assert merge.remaining == sum(fd is not None for fd in member_fds)
        if merge.remaining == 0:
            self._settle(merge)
            return
        with self._lock:
            if self._epoll is None:
                try:
                    epoll = select.epoll()
                    run_soon(self._serve, epoll)   # a worker thread, for good
                except (OSError, RuntimeError) as e:
                    for fd in [output_fd, *member_fds]:
                        if fd is not None:
                            _close_quietly(fd)
                    raise NnrtError(ErrorStatus.RESOURCE_EXHAUSTED_TRANSIENT,
                                    f"cannot start the fence merge watcher: {e}") from None
                self._epoll = epoll
            self._pending += 1
            for index, fd in enumerate(member_fds):
                if fd is not None:
                    self._members[fd] = (merge, index)
                    self._epoll.register(fd, select.EPOLLIN)

    def statistics(self) -> MergeStatistics:
        with self._lock:
            return MergeStatistics(self._pending, len(self._members))

    def _serve(self, epoll: select.epoll) -> None:
        while True:
            events = epoll.poll()
            with self._lock:
                for fd, _ in events:
                    entry = self._members.pop(fd, None)
                    if entry is None:
                        continue
                    epoll.unregister(fd)
                    merge, index = entry
                    merge.statuses[index] = _member_status(fd)
                    os.close(fd)
                    merge.remaining -= 1
                    if merge.remaining == 0:
                        # Counted down before the write, so a waiter woken by
                        # the merged fence already sees it gone from statistics().
                        self._pending -= 1
                        self._settle(merge)

    @staticmethod
    def _settle(merge: _Merge) -> None:
        try:
            os.eventfd_write(merge.output_fd, encode_outcome(merged_status(merge.statuses)))
        except OSError:
            # Only EAGAIN is possible: someone else added a near-2**64 value to
            # the merged fence, which then already decodes as an invalid ERROR.
            pass
        finally:
            os.close(merge.output_fd)

    def _forget_after_fork(self) -> None:
        # Runs in the child only: single-threaded, so the (possibly held) lock is ignored.
        for fd in self._members:
            _close_quietly(fd)
        for merge in {m for m, _ in self._members.values()}:
            _close_quietly(merge.output_fd)
        if self._epoll is not None:
            self._epoll.close()


def _member_status(fd: int) -> ErrorStatus:
    try:
        state, status, _ = decode_count(peek_count(fd))
    except NnrtError:
        return ErrorStatus.GENERAL_FAILURE
    # epoll said readable, so the counter is not zero; an ACTIVE reading can
    # only mean the fdinfo read failed in some unforeseen way.
    return status if state is not FenceState.ACTIVE else ErrorStatus.GENERAL_FAILURE


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


watcher = MergeWatcher()


def _reset_after_fork() -> None:
    global watcher
    watcher._forget_after_fork()
    watcher = MergeWatcher()


os.register_at_fork(after_in_child=_reset_after_fork)


def statistics() -> MergeStatistics:
    """What the process's merge watcher is waiting on."""
    return watcher.statistics()
