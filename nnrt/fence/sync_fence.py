"""SyncFence: an eventfd that becomes readable once, when the fence is signaled.

Theory of operation
-------------------
The truth about a fence lives in its eventfd, shared by every process that
holds a copy of the fd; a :class:`SyncFence` object is one process's view of
it. The view has a state (ACTIVE, SIGNALED, ERROR) that changes only through
the transition table ``_TRANSITIONS``: either this object signals the fence
(SIGNAL, SIGNAL_ERROR) or it observes an outcome someone else wrote into the
fd (OBSERVE_SIGNALED, OBSERVE_ERROR). Once SIGNALED or ERROR the view never
changes again, and no more I/O is done to learn the outcome.

The outcome encoding and the non-consuming read are in :mod:`.outcome`:
signaling adds 1 (good) or ERROR_TAG|status (error) to the counter, and
readers peek at the counter through /proc instead of reading it, so the fd
stays readable for every waiter in every process.

Waiting never polls in a loop: :meth:`SyncFence.wait` blocks in ``poll(2)``
on the fd, :meth:`SyncFence.wait_signaled` awaits the fd's readability with
anyio (``loop.add_reader`` on asyncio and uvloop, epoll on trio). Each async
waiter waits on its own ``dup`` of the fd, because both asyncio (through
anyio) and trio refuse two tasks waiting on one fd.

One signaler: a fence is meant to be signaled by exactly one party (the app
for a fence it created, the engine for a fence returned by a fenced
execution). ``signal`` refuses when this process can already see an outcome
in the fd, but two processes signaling at the same instant both succeed and
leave a counter that decodes as ERROR/GENERAL_FAILURE for later observers.

An *empty* fence has no fd and is SIGNALED from the start: the HAL's "the
execution already finished, there is nothing to wait for".
"""
from __future__ import annotations

import enum
import errno
import math
import os
import select
import time

import anyio
import anyio.lowlevel

from ..errors import ErrorStatus, NnrtError, bad_state, invalid
from .. import trace
from . import merge as _merge
from .outcome import FenceState, decode_count, encode_outcome, peek_count


class FenceEvent(enum.Enum):
    SIGNAL = "signal"                      # this object signals success
    SIGNAL_ERROR = "signal_error"          # this object signals an error
    OBSERVE_SIGNALED = "observe_signaled"  # the fd shows a success written elsewhere
    OBSERVE_ERROR = "observe_error"        # the fd shows an error written elsewhere


_TRANSITIONS: dict[tuple[FenceState, FenceEvent], FenceState] = {
    (FenceState.ACTIVE, FenceEvent.SIGNAL): FenceState.SIGNALED,
    (FenceState.ACTIVE, FenceEvent.SIGNAL_ERROR): FenceState.ERROR,
    (FenceState.ACTIVE, FenceEvent.OBSERVE_SIGNALED): FenceState.SIGNALED,
    (FenceState.ACTIVE, FenceEvent.OBSERVE_ERROR): FenceState.ERROR,
}

_OBSERVED = {FenceState.SIGNALED: FenceEvent.OBSERVE_SIGNALED,
             FenceState.ERROR: FenceEvent.OBSERVE_ERROR}

_POLL_MAX_MS = 2**31 - 1


def _os_error(e: OSError, what: str) -> NnrtError:
    if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOMEM):
        return NnrtError(ErrorStatus.RESOURCE_EXHAUSTED_TRANSIENT, f"{what}: {e.strerror}")
    return NnrtError(ErrorStatus.GENERAL_FAILURE, f"{what}: {e.strerror}")


def _new_eventfd() -> int:
    try:
        return os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
    except OSError as e:
        raise _os_error(e, "cannot create a sync fence eventfd") from None


def _dup(fd: int) -> int:
    try:
        return os.dup(fd)  # non-inheritable, like every fd Python creates
    except OSError as e:
        raise _os_error(e, f"cannot duplicate sync fence fd {fd}") from None


def _readable(fd: int) -> bool:
    """True when ``fd`` polls readable (or invalid: POLLNVAL, which peek_count reports)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


class SyncFence:
    """One process's handle on a sync fence. Build it with :meth:`create`,
    :meth:`from_fd`, :meth:`empty` or :meth:`merge`; it owns its fd and closes
    it on :meth:`close` (or when used as a context manager)."""

    __slots__ = ("_fd", "_state", "_status", "_can_signal", "_closed", "__weakref__")

    def __init__(self, fd: int | None, *, can_signal: bool,
                 state: FenceState = FenceState.ACTIVE, status: ErrorStatus = ErrorStatus.NONE):
        # Private: use the factories. fd None = empty (state SIGNALED) or closed.
        self._fd = fd
        self._closed = False
        self._state = state
        self._status = status
        self._can_signal = can_signal

    # -- construction -----------------------------------------------------

    @classmethod
    def create(cls) -> SyncFence:
        """A new ACTIVE fence that the caller signals (e.g. when a camera frame is ready)."""
        return cls(_new_eventfd(), can_signal=True)

    @classmethod
    def from_fd(cls, fd: int) -> SyncFence:
        """Adopt ``fd`` (an eventfd the caller owns, e.g. received by SCM_RIGHTS or
        inherited); the fence closes it. On error the fd stays the caller's."""
        if isinstance(fd, bool) or not isinstance(fd, int) or fd < 0:
            raise invalid(f"sync fence fd {fd!r} is not a file descriptor")
        fence = cls(fd, can_signal=True)
        try:
            fence._observe(validate=True)  # INVALID_ARGUMENT unless an open eventfd
        except NnrtError:
            fence._fd = None  # not ours after all: leave it to the caller
            raise
        # Like every fd nnrt opens: not leaked into processes spawned later,
        # where it would keep the fence alive unseen.
        os.set_inheritable(fd, False)
        return fence

    @classmethod
    def empty(cls) -> SyncFence:
        """An fd-less fence that is already SIGNALED (the work already finished)."""
        return cls(None, can_signal=False, state=FenceState.SIGNALED)

    @classmethod
    def merge(cls, fences) -> SyncFence:
        """A new fence that signals once every fence in ``fences`` has; it ends in
        ERROR (status of the first failed member in order) if any member did.
        The members may be closed right after the call; the merged fence is
        signaled by the process's merge watcher and cannot be signaled by hand."""
        fences = list(fences)
        for i, f in enumerate(fences):
            if not isinstance(f, SyncFence):
                raise invalid(f"merge: item {i} is a {type(f).__name__}, not a SyncFence")
            f._require_open("merge")
        known: list[ErrorStatus | None] = []
        member_fds: list[int | None] = []
        out = _new_eventfd()
        try:
            for f in fences:
                if f.poll() is FenceState.ACTIVE:
                    member_fds.append(_dup(f._fd))
                    known.append(None)
                else:
                    member_fds.append(None)
                    known.append(f._status)
            watcher_out = _dup(out)
        except BaseException:
            for fd in member_fds:
                if fd is not None:
                    os.close(fd)
            os.close(out)
            raise
        merged = cls(out, can_signal=False)  # owns `out` from here, whatever happens
        _merge.watcher.add(watcher_out, member_fds, known)
        merged._observe()  # already settled when every member was
        return merged

    def dup(self) -> SyncFence:
        """An independent handle on the same fence (its own fd, same outcome)."""
        return self._dup(self._can_signal)

    def _dup(self, can_signal: bool) -> SyncFence:
        if self._fd is None:
            self._require_open("dup")
            return SyncFence.empty()
        return SyncFence(_dup(self._fd), can_signal=can_signal, state=self._state, status=self._status)

    # -- state ------------------------------------------------------------

    @property
    def is_empty(self) -> bool:
        return self._fd is None and not self._closed

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def status(self) -> ErrorStatus:
        """The ErrorStatus of an ERROR fence as last seen by :meth:`poll` or a wait
        (NONE otherwise)."""
        self._require_open("status")
        return self._status

    def fileno(self) -> int:
        """The eventfd, to pass to another process (``pass_fds``, SCM_RIGHTS).
        Still owned by this fence."""
        self._require_open("fileno")
        if self._fd is None:
            raise invalid("an empty sync fence has no file descriptor; send it as 'no fence'")
        return self._fd

    def poll(self) -> FenceState:
        """The fence's state now, without waiting and without consuming it."""
        self._require_open("poll")
        self._observe()
        return self._state

    def _require_open(self, what: str) -> None:
        if self._closed:
            raise bad_state(f"{what} on a closed sync fence")

    def _transition(self, event: FenceEvent) -> FenceState:
        try:
            return _TRANSITIONS[(self._state, event)]
        except KeyError:
            raise bad_state(f"sync fence fd {self._fd}: {event.value} is not allowed "
                            f"in state {self._state.name}") from None

    def _observe(self, fd: int | None = None, *, validate: bool = False) -> None:
        # fd: a dup to read instead of self._fd (a waiter's own, which survives close()).
        if self._state is not FenceState.ACTIVE:
            return
        fd = self._fd if fd is None else fd
        if not validate and not _readable(fd):
            return  # a zero-timeout poll is ~10x cheaper than reading /proc
        state, status, _ = decode_count(peek_count(fd))
        if state is FenceState.ACTIVE:
            return
        self._state = self._transition(_OBSERVED[state])
        self._status = status

    def _outcome(self) -> bool:
        if self._state is FenceState.ERROR:
            raise NnrtError(self._status, f"the sync fence was signaled with error {self._status.name}")
        return self._state is FenceState.SIGNALED

    # -- signaling --------------------------------------------------------

    def signal(self) -> None:
        """Mark the work done: ACTIVE -> SIGNALED, waking every waiter."""
        trace.instant("fence signaled")
        self._write(FenceEvent.SIGNAL, ErrorStatus.NONE)

    def signal_error(self, status: ErrorStatus) -> None:
        """Mark the work failed with ``status``: ACTIVE -> ERROR."""
        try:
            status = ErrorStatus(status)
        except ValueError:
            raise invalid(f"signal_error: {status!r} is not an ErrorStatus") from None
        if status is ErrorStatus.NONE:
            raise invalid("signal_error: status NONE is not an error; use signal()")
        self._write(FenceEvent.SIGNAL_ERROR, status)

    def _write(self, event: FenceEvent, status: ErrorStatus) -> None:
        self._require_open(event.value)
        if not self._can_signal:
            raise bad_state(f"{event.value}: this sync fence is signaled by the nnrt "
                            "(a merged fence or a fenced execution's fence), not by hand")
        self._observe()  # refuse when another holder already signaled it
        new_state = self._transition(event)
        try:
            os.eventfd_write(self._fd, encode_outcome(status))
        except OSError as e:
            raise _os_error(e, f"cannot signal sync fence fd {self._fd}") from None
        self._state, self._status = new_state, status

    # -- waiting ----------------------------------------------------------

    def wait_signaled_nowait(self) -> None:
        """Return if SIGNALED, raise NnrtError(status) if ERROR, raise
        ``anyio.WouldBlock`` if still ACTIVE."""
        self._require_open("wait_signaled_nowait")
        self._observe()
        if not self._outcome():
            raise anyio.WouldBlock

    async def wait_signaled(self) -> None:
        """Wait (without blocking the event loop) until the fence is signaled;
        raise NnrtError with the fence's status if it was signaled with an error."""
        self._require_open("wait_signaled")
        self._observe()
        if self._state is FenceState.ACTIVE:
            fd = _dup(self._fd)
            try:
                while self._state is FenceState.ACTIVE:  # one pass: readable means signaled
                    await anyio.wait_readable(fd)
                    self._observe(fd)
            finally:
                # Trio keeps an idle epoll entry per fd number; tell the loop
                # before closing so the number can be reused safely.
                anyio.notify_closing(fd)
                os.close(fd)
        else:
            await anyio.lowlevel.checkpoint()
        self._outcome()

    def wait_signaled_blocking(self, timeout: float | None = None) -> bool:
        """Block the calling thread until the fence is signaled or ``timeout``
        seconds pass (None = no limit). True when signaled, False on timeout;
        NnrtError with the fence's status when it was signaled with an error."""
        self._require_open("wait_signaled_blocking")
        if timeout is not None:
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
                    or math.isnan(timeout) or timeout < 0:
                raise invalid(f"wait_signaled_blocking: timeout {timeout!r} is not None or a "
                              f"number of seconds >= 0")
        self._observe()
        if self._state is FenceState.ACTIVE:
            poller = select.poll()
            poller.register(self._fd, select.POLLIN)
            end = None if timeout is None else time.monotonic() + timeout
            while True:
                if end is None:
                    ms = _POLL_MAX_MS
                else:
                    ms = min(_POLL_MAX_MS, max(0, math.ceil((end - time.monotonic()) * 1000)))
                if poller.poll(ms) or (end is not None and time.monotonic() >= end):
                    break
            self._observe()
        return self._outcome()

    # -- lifetime ---------------------------------------------------------

    def close(self) -> None:
        """Close this handle's fd. Other handles and processes are unaffected;
        closing does not signal the fence."""
        if self._closed:
            return
        fd, self._fd, self._closed = self._fd, None, True
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> SyncFence:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        # A dropped handle must not leak its fd; closing never signals.
        if getattr(self, "_fd", None) is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None

    def __reduce__(self):
        # Pickling would copy a bare fd number, meaningless in another process.
        raise TypeError("a SyncFence cannot be pickled; send fileno() by SCM_RIGHTS "
                        "(or pass_fds) and adopt it with SyncFence.from_fd")

    def __repr__(self) -> str:
        if self._closed:
            return "<SyncFence closed>"
        if self._fd is None:
            return "<SyncFence empty SIGNALED>"
        detail = f" {self._status.name}" if self._state is FenceState.ERROR else ""
        return f"<SyncFence fd={self._fd} {self._state.name}{detail}>"
