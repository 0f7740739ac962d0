"""A single-producer / single-consumer ring of variable-size frames in shared
memory, with eventfd wake-ups (the FMQ of DESIGN.md). Imports nothing of nnrt.

Theory of operation
===================

Layout (one memfd, mapped ``MAP_SHARED`` by both processes)::

    offset   0  header line: magic b"nnrt-fmq", version, header size,
                capacity (a power of two), max frame size; written once by
                the creator before the fd is handed over, then read-only
    offset 128  write counter (u64)      -- written only by the producer
    offset 136  space-waiter flag (u64)  -- written only by the producer
    offset 256  read counter  (u64)      -- written only by the consumer
    offset 264  data-waiter flag (u64)   -- written only by the consumer
    offset 384  data area, ``capacity`` bytes

The counters sit on separate 128-byte lines (two 64-byte cache lines: the
adjacent-line prefetcher of x86 pulls pairs) so the producer's and the
consumer's stores never share a line. Both counters count bytes, only grow
(modulo 2**64) and are reduced by ``capacity - 1`` to an index, so "full" and
"empty" are never confused: ``write - read`` is the number of bytes in use.

A frame is an 8-byte prefix (u32 length, u32 length XOR 0xFFFFFFFF) and the
payload padded to 8 bytes; every frame starts at a multiple of 8, so a prefix
never straddles the end of the data area, while a payload may (it is copied
in two pieces). A frame larger than half the ring is refused up front
(:class:`FrameTooLarge`): a blocking writer then always makes progress once
the reader has taken at most half the ring, and a bad size is a caller bug
to report, not a wait that can never end.

Who owns which word, and why no lock is needed
----------------------------------------------
The producer is the only writer of the write counter and of data bytes in
``[write, read + capacity)``; the consumer is the only writer of the read
counter and only reads bytes in ``[read, write)``. Each waiter flag is written only by the side that
waits (it lives on that side's line). Each side keeps its own
counter in a local variable (the shared copy is only ever *published*, never
read back by its owner), so a buggy or hostile peer that scribbles over our
counter cannot steer our copies; the peer's counter is read and checked
(``0 <= write - read <= capacity``, multiple of 8, a sane prefix) and a
violation raises :class:`RingCorrupted` instead of reading out of bounds. No
word has two writers, so there is nothing to lock: publishing is one aligned
8-byte store, observing is one aligned 8-byte load.

Two implementations of one protocol
-----------------------------------
``_native.c`` (built by ``setup.py`` when a C compiler is present) does the
frame copy with acquire-load / release-store counters and provides the
fenced waiter handshake below; the pure-Python path is the fallback. Each
end picks its own (``native=``), and the two interoperate.

Memory ordering
---------------
What must hold: the consumer never sees a write counter before the payload
bytes it covers, and the producer never overwrites bytes the consumer has not
finished copying out (it must not see the read counter move before those
loads are done).

* Native end, any CPU: ``__atomic_load_n(ACQUIRE)`` of the peer's counter
  and ``__atomic_store_n(RELEASE)`` of ours give exactly these orderings
  (``ldar``/``stlr`` on aarch64, plain ``mov`` on x86-64).
* Pure-Python end on x86-64 (TSO): aligned 8-byte loads and stores are
  single-copy atomic; stores are not reordered with older stores (payload, then counter: the
  producer is safe), loads are not reordered with older loads (counter, then
  payload: the consumer is safe), and stores are not reordered with older
  loads (payload copied out, then read counter stored: safe). The one
  reordering x86 allows, a store with a *later* load, is exactly the
  Dekker trap below, which this design never relies on. Payload copies go
  through ``memcpy``; glibc's non-temporal path for huge copies ends with an
  ``sfence``, and fast-string (``rep movsb``) stores are not reordered with
  later stores. The counters are stored and loaded through a ``'Q'``
  memoryview, i.e. one native 8-byte ``memcpy``: a single ``mov``. (The
  ``struct`` module's ``'<Q'`` packer writes byte by byte and is not used.)
* Pure-Python end on aarch64 (and anything not x86): loads may pass loads and
  stores may pass stores, so publishing needs release/acquire ordering and
  pure Python has no such instruction. Here the ring issues ``sched_yield()``
  at the three points that need ordering (payload stores -> write counter;
  write counter load -> payload loads; payload loads -> read counter store):
  the scheduler entry takes the run-queue lock followed by a full barrier
  (``smp_mb__after_spinlock``), the same guarantee the ``membarrier`` system
  call is built on. The native end needs none of these syscalls.

Wake-ups: why none is lost
--------------------------
Two eventfds: ``data`` (producer -> consumer: "a frame was published") and
``space`` (consumer -> producer: "bytes were freed"). The tempting futex
scheme -- the consumer stores "I am going to sleep" in shared memory, and
the producer writes the eventfd only if it loads that flag as set -- is a
Dekker handshake: each side stores one word and then loads the other's, and
x86 may satisfy the load before the store is visible, so both sides can miss
each other and the consumer sleeps on a frame that is already there. It
needs a full fence on both sides, which pure Python cannot emit.

Every wait in this module is the same loop:

1. check the ring (return at once if the condition holds; a blocking
   waiter spins if asked and a core is idle; an async one never spins),
2. announce: set our waiter flag, then (native) a full fence,
3. check the ring again (return, withdrawing the flag, if it now holds),
4. sleep until the eventfd is readable (poll(2) / ``anyio.wait_readable``),
   drain it (a read resets it to 0; EAGAIN means it was 0 already),
   withdraw the flag, and go back to 1.

Both eventfds are non-blocking (``EFD_NONBLOCK``; :meth:`Ring.attach`
refuses blocking ones rather than change a description it shares with the
peer), so no read or write of ours blocks on the peer (for a peer that
changes the flags later, see "A hostile peer"): sleeping is always a poll. A write that fails with EAGAIN met a saturated counter; a saturated
counter is readable until someone drains it, so for the argument below it
is exactly a write that landed ("already signalled"). A failed write takes
the eventfd's lock just as a successful one does, so it orders the counter
store before the waiter's next drain all the same.

After publishing its counter, a native end fences and writes the peer's
eventfd only if the peer's waiter flag is set; a pure-Python end writes it
after *every* publish (option (b) of issue 8: one syscall per frame). A
pure-Python waiter cannot fence, so it never withdraws its flag: it stays at
1 (where ``create`` puts both flags), meaning "always wake me", and every
peer -- native or not -- signals it every time.

Native handshake (option (a)). Waiter: store flag=1; fence; load counter.
Publisher: store counter; fence; load flag. With a full fence on both sides
the two loads cannot both miss the other side's store (the x86 store->load
reordering is what the fences forbid), so either the waiter sees the new
counter at step 3 and does not sleep, or the publisher sees the flag and
writes the eventfd. A native end clears its own flag the first time it acts
in its role (create left it at 1) and after every sleep.

Always-signal (option (b)), used by and for pure-Python ends:

Suppose the producer publishes frame F after the consumer's check in step 3
found nothing. The producer's eventfd write comes after F's counter store. If the
write lands before the consumer's drain, the drain takes it but step 1
re-runs after the drain and the eventfd syscalls (each takes the eventfd's
lock: a full barrier) order the counter store before it, so F is seen. If it lands after the drain, the eventfd stays
readable and the next sleep returns at once. Either way the consumer cannot
sleep while F is unseen. Stale counts (a wake-up for a frame already read)
only cause one extra trip round the loop. The same argument, with roles
swapped, covers a producer waiting for space.

A hostile peer
--------------
A driver service attaches rings an app made, so everything the peer controls
is checked before use and a violation is a :class:`RingError` (never a
crash, a hang or an out-of-bounds access): at attach, the fds themselves
(see :meth:`Ring.attach`), the header (magic, version, a power-of-two
capacity in [64 B, 1 GiB] matching the file's size, a max frame that fits
half the ring) and both counters (multiples of 8, at most a ring apart);
on every frame, the peer's counter and the frame prefix (above). What the
header allows may still be useless to a user of the ring (a max frame of 0
bytes): that user checks ``max_frame`` against what it must send. What the
peer can still do is only to itself: stall its own ring, or saturate or
drain its eventfds (a stale or missing wake-up of its own waits). Drains
use ``RWF_NOWAIT`` and never block whatever the fd's flags. One thing the
kernel does not let us prevent: the peer clearing O_NONBLOCK on the shared
description after attach and saturating the counter, so that our next
signalling write blocks until someone reads that eventfd. Such a write
releases the GIL (native end; ``os.eventfd_write`` does too), so only that
thread waits, and :meth:`Ring.drain_eventfds` releases it.

Peer death
----------
The ring cannot tell a slow peer from a dead one: its owner pairs it with
something that can -- the control socket (readable at EOF) or a pidfd of the
peer (``os.pidfd_open``, readable when the process exits) -- and passes that
fd as ``also=`` to a wait, which then returns :data:`Ready.ALSO` when that
fd becomes readable while the ring still holds nothing for the waiter.

Asynchronous waits sleep in the event loop, which never polls. On asyncio
(and uvloop) each eventfd the ring waits on gets a private epoll, holding
it and the ``also`` fd, that stays registered with the loop between waits
(:class:`_LoopWatch`): its reader drains the eventfd and wakes the waiting
task, so a wait costs no ``epoll_ctl`` -- registering a reader for every
wait and removing it after (``anyio.wait_readable``) was two system calls
and most of the cost of an async hand-off (issue 16). Between waits the
eventfd is drained as soon as it fires and an ``also`` fd that fires with
nobody waiting leaves the epoll until the next wait, so a level-triggered
reader never runs the loop hot. The loop only ever sees that private epoll,
never a fd shared with the peer: closing it removes it from the loop's
interest list, whoever holds the eventfds. Other loops (trio) use
``anyio.wait_readable`` on the eventfd, or on an epoll holding it and
``also``.
"""
from __future__ import annotations

import enum
import errno
import fcntl
import math
import mmap
import os
import platform
import select
import stat
import struct
import time
from dataclasses import dataclass

import asyncio

import anyio
from anyio import WouldBlock

MAGIC = b"nnrt-fmq"
VERSION = 1
LINE = 128                 # two 64-byte cache lines: adjacent-line prefetch pulls pairs
WRITE_OFFSET = LINE
SPACE_WAITER_OFFSET = LINE + 8      # producer's "wake me when space frees" flag
READ_OFFSET = 2 * LINE
DATA_WAITER_OFFSET = 2 * LINE + 8   # consumer's "wake me when a frame arrives" flag
HEADER_SIZE = 3 * LINE     # data area starts here
PREFIX = 8                 # u32 length + u32 (length ^ 0xFFFFFFFF)
MIN_CAPACITY = 64
MAX_CAPACITY = 1 << 30
_M64 = (1 << 64) - 1
_CHECK = 0xFFFFFFFF

_HEADER = "<8sIIQQ"        # magic, version, header size, capacity, max frame
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL

# x86 is TSO: the orderings the ring needs are free. Elsewhere a syscall that
# passes through the scheduler is the barrier (see "Memory ordering" above).
_FENCE = None if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686") \
    else os.sched_yield

_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", 8)   # <linux/fs.h>

_DEFAULT_SPIN = 20e-6 if (os.cpu_count() or 1) >= 4 else 0.0

try:   # optional: built by setup.py when a C compiler is there
    from . import _native
except ImportError:
    _native = None

NATIVE_AVAILABLE = _native is not None
# The whole wait of read_or in C (a helper built from an older _native.c
# lacks it: the Python loop then does the same).
_NATIVE_READ_OR = _native is not None and hasattr(_native.Shared, "take_blocking_or")
# ... and its spin, the GIL released (a burst server's REQUEST_SPIN).
_NATIVE_SPIN = _native is not None and hasattr(_native.Shared, "take_spinning_or")
_ALSO = -7    # take_blocking_or: ``also`` became readable, no frame


class RingError(Exception):
    """Base of the ring's own errors."""


class FrameTooLarge(RingError, ValueError):
    """A frame exceeds the ring's maximum frame size (at most half the ring)."""


class RingCorrupted(RingError):
    """The peer's counter or a frame prefix is impossible: the stream is out of
    sync and the ring cannot be used any more."""


class RingClosed(RingError):
    """The ring was closed by this process."""


class Ready(enum.Enum):
    """What ended a wait: the ring's condition, or the ``also`` fd."""

    RING = "ring"
    ALSO = "also"


@dataclass(frozen=True, slots=True)
class RingStatistics:
    capacity: int
    max_frame: int
    native: bool             # this end uses the fenced handshake (else always-signal)
    bytes_used: int          # as seen from this process, at the time of the call
    frames_written: int      # by this process
    frames_read: int         # by this process


def _pad(n: int) -> int:
    return PREFIX + ((n + 7) & ~7)


def _drain(fd: int) -> None:
    """Reset an eventfd to 0 without ever blocking, whatever its flags (the
    peer shares the description and could clear O_NONBLOCK): RWF_NOWAIT,
    honoured by eventfds since Linux 5.12; a plain read before that."""
    try:
        os.preadv(fd, [bytearray(8)], -1, _RWF_NOWAIT)
    except BlockingIOError:   # already drained (the counter was 0)
        pass
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        try:
            os.eventfd_read(fd)
        except BlockingIOError:
            pass


def _signal(fd: int) -> None:
    """Add 1 to an eventfd. EAGAIN means the counter is saturated: the fd is
    readable already, which is all a wake-up is (see "Wake-ups")."""
    try:
        os.eventfd_write(fd, 1)
    except BlockingIOError:
        pass


def _check_eventfd(fd: int, what: str) -> None:
    """RingError unless ``fd`` is a non-blocking, non-semaphore eventfd.

    The kernel tells an eventfd by its fdinfo (``eventfd-count``). It must be
    non-blocking already: setting O_NONBLOCK here would change the peer's
    open file description too (it is shared through SCM_RIGHTS), and a
    blocking one lets any holder wedge our writes by saturating the counter.
    A semaphore eventfd never drains in one read, so a waiter would spin."""
    try:
        with open(f"/proc/self/fdinfo/{fd}", "rb") as f:
            info = f.read()
    except OSError as e:
        raise RingError(f"{what} (fd {fd}) is not an open file descriptor: {e}") from None
    fields = dict(line.split(b":", 1) for line in info.splitlines() if b":" in line)
    if b"eventfd-count" not in fields:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = "?"
        raise RingError(f"{what} (fd {fd}) is not an eventfd but {target}")
    if fields.get(b"eventfd-semaphore", b"0").strip() != b"0":
        raise RingError(f"{what} (fd {fd}) is a semaphore eventfd (EFD_SEMAPHORE); "
                        f"a ring needs a plain one")
    if not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_NONBLOCK:
        raise RingError(f"{what} (fd {fd}) is blocking: create it with EFD_NONBLOCK")


def _check_memfd(fd: int) -> int:
    """The size of ``fd`` if it is a memfd sealed against resizing, else RingError."""
    try:
        st = os.fstat(fd)
    except OSError as e:
        raise RingError(f"the ring's memory (fd {fd}) is not an open file descriptor: "
                        f"{e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise RingError(f"the ring's memory (fd {fd}) is not a memfd (mode {st.st_mode:#o})")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as e:
        raise RingError(f"the ring's memory (fd {fd}) is not a sealable memfd: {e}") from None
    if seals & (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW) != \
            fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW:
        raise RingError(f"the ring's memfd (fd {fd}) is not sealed against resizing "
                        f"(F_SEAL_SHRINK | F_SEAL_GROW)")
    return st.st_size


def _poll_ms(deadline: float | None) -> int | None:
    if deadline is None:
        return None
    return max(0, math.ceil((deadline - time.monotonic()) * 1000))


_FREE_RECHECK = 0.01      # seconds a reading of the run queue stays good
_free_checked = -1.0
_free = False


def _core_free() -> bool:
    """Whether a spinning waiter would burn a core nobody else wants now:
    the kernel's count of runnable threads (the fourth field of
    /proc/loadavg, the caller itself included) is at most the cores this
    process may run on. Read at most every 10 ms. The load *average* was
    used before; it lags by a minute and counts the spinner itself, so a
    spin turned itself off (and back on) over minutes rather than
    following who wants the cores now."""
    global _free_checked, _free
    now = time.monotonic()
    if now - _free_checked < _FREE_RECHECK:
        return _free
    _free_checked = now
    try:
        # (Opened each time: a descriptor kept open would be one more that a
        # service's fd accounting sees.)
        fd = os.open("/proc/loadavg", os.O_RDONLY | os.O_CLOEXEC)
        try:
            running = int(os.read(fd, 128).split()[3].split(b"/")[0])
        finally:
            os.close(fd)
        _free = running <= _cores()
    except (OSError, ValueError, IndexError):
        _free = False       # no way to tell: do not spin
    return _free


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except OSError:
        return os.cpu_count() or 1


class Ring:
    """An SPSC frame ring in a memfd; see the module docstring.

    Make one with :meth:`create`, hand :meth:`fds` to the peer (fork or
    ``SCM_RIGHTS``), and rebuild it there with :meth:`attach`. One process
    writes, the other reads. Sync methods: ``write``/``write_nowait``,
    ``read``/``read_nowait``, ``wait_read_blocking``/``wait_write_blocking``; async:
    ``wait_read``/``wait_write`` (anyio: asyncio and trio) and
    ``read_async``/``write_async``. ``x_nowait`` raises ``WouldBlock``;
    blocking forms raise ``TimeoutError`` when ``timeout`` seconds pass.

    ``spin`` is how long (seconds) a *blocking* waiter re-checks the ring
    before sleeping: by default 20 µs on machines with at least 4 cores and
    0 on smaller ones, where spinning only delays the peer sharing the core;
    even then it spins only while a core is free (:func:`_core_free`). A
    native ``read_or`` spins in C with the GIL released. Async waits never
    spin (they would stall the event loop).
    ``native`` picks the protocol of this end: None uses the C helper when
    it was built, False forces the pure-Python always-signal protocol (both
    ends may differ: they interoperate).
    """

    def __init__(self, memfd: int, data_efd: int, space_efd: int, *,
                 spin: float | None = None, native: bool | None = None):
        # Private: use create() or attach(). Takes ownership of the three fds.
        self._fds = (memfd, data_efd, space_efd)
        self._data_efd = data_efd
        self._space_efd = space_efd
        self._closed = True          # until the mapping is in place
        self._native = None
        size = os.fstat(memfd).st_size
        if size < HEADER_SIZE:
            raise RingError(f"fd {memfd} is not an fmq ring: {size} bytes, "
                            f"smaller than the {HEADER_SIZE}-byte header")
        self._mm = mmap.mmap(memfd, size)
        magic, version, header_size, capacity, max_frame = \
            struct.unpack_from(_HEADER, self._mm, 0)
        problem = None
        if magic != MAGIC:
            problem = f"magic {magic!r} is not {MAGIC!r}"
        elif version != VERSION:
            problem = f"version {version} is not {VERSION}"
        elif header_size != HEADER_SIZE:
            problem = f"header size {header_size} is not {HEADER_SIZE}"
        elif not MIN_CAPACITY <= capacity <= MAX_CAPACITY or capacity & (capacity - 1):
            problem = f"capacity {capacity} is not a power of two in [{MIN_CAPACITY}, {MAX_CAPACITY}]"
        elif size != HEADER_SIZE + capacity:
            problem = f"size {size} is not header {HEADER_SIZE} + capacity {capacity}"
        elif _pad(max_frame) > capacity // 2:
            problem = f"max frame {max_frame} exceeds half the ring of {capacity} bytes"
        else:
            # Each end starts from the shared counters (then trusts only its
            # own copy): they must be aligned and at most a ring apart, or
            # the first frame would be read or written out of bounds.
            w = struct.unpack_from("<Q", self._mm, WRITE_OFFSET)[0]
            r = struct.unpack_from("<Q", self._mm, READ_OFFSET)[0]
            if w % 8 or r % 8 or (w - r) & _M64 > capacity:
                problem = (f"counters write {w} and read {r} are impossible for a "
                           f"{capacity}-byte ring")
        if problem:
            self._mm.close()
            raise RingError(f"fd {memfd} is not a usable fmq ring: {problem}")
        if native and _native is None:
            self._mm.close()
            raise RingError("the native fmq helper is not built (nnrt/fmq/_native.c)")
        self.capacity = capacity
        self.max_frame = max_frame
        self._mask = capacity - 1
        self._data = HEADER_SIZE
        self._counters = memoryview(self._mm)[:HEADER_SIZE].cast("Q")
        self._wi = WRITE_OFFSET // 8
        self._ri = READ_OFFSET // 8
        if native is not False and _native is not None:
            # The C object keeps this end's counters; a native end clears its
            # own waiter flag (create() leaves it at 1, "always wake me") the
            # first time it acts in its role.
            self._native = _native.Shared(self._mm, capacity, max_frame, HEADER_SIZE,
                                          WRITE_OFFSET, READ_OFFSET, SPACE_WAITER_OFFSET,
                                          DATA_WAITER_OFFSET, data_efd, space_efd)
            self._frame_ready = self._native.frame_ready
            self._space_free = self._native.space_free
        # Each side trusts only its local copy of its own counter.
        self._w = self._counters[self._wi]
        self._r = self._counters[self._ri]
        self._spin = _DEFAULT_SPIN if spin is None else float(spin)
        self._spin_ns = int(self._spin * 1e9)
        # One epoll per (eventfd, also fd) pair, made on first use and kept:
        # creating it for every wait cost tens of microseconds per frame.
        self._epolls: dict[tuple[int, int], select.epoll] = {}
        self._watches: dict[int, _LoopWatch] = {}   # eventfd -> its asyncio watch
        self._pollers: dict[tuple[int, int | None], select.poll] = {}
        self._frames_written = 0
        self._frames_read = 0
        self._closed = False

    # ----------------------------------------------------------- lifecycle

    @classmethod
    def create(cls, capacity: int = 1 << 16, max_frame: int | None = None, *,
               spin: float | None = None, native: bool | None = None,
               name: str = "nnrt-fmq", for_test_initial_counter: int = 0) -> "Ring":
        """A new ring of ``capacity`` bytes (a power of two, 64 B .. 1 GiB).

        ``max_frame`` (payload bytes) defaults to the most that fits in half
        the ring. ``for_test_initial_counter`` starts both counters there, to
        exercise the wrap of the index mask and of 2**64.
        """
        if isinstance(capacity, bool) or not isinstance(capacity, int) \
                or not MIN_CAPACITY <= capacity <= MAX_CAPACITY or capacity & (capacity - 1):
            raise ValueError(f"capacity {capacity!r} must be a power of two between "
                             f"{MIN_CAPACITY} and {MAX_CAPACITY}")
        largest = capacity // 2 - PREFIX
        if max_frame is None:
            max_frame = largest
        if isinstance(max_frame, bool) or not isinstance(max_frame, int) \
                or not 0 <= max_frame <= largest:
            raise ValueError(f"max_frame {max_frame!r} must be between 0 and {largest} (half "
                             f"the {capacity}-byte ring less the {PREFIX}-byte frame prefix)")
        if for_test_initial_counter % 8:
            raise ValueError("for_test_initial_counter must be a multiple of 8")
        fds = []
        try:
            memfd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            fds.append(memfd)
            os.ftruncate(memfd, HEADER_SIZE + capacity)
            with mmap.mmap(memfd, HEADER_SIZE) as mm:
                struct.pack_into(_HEADER, mm, 0, MAGIC, VERSION, HEADER_SIZE, capacity, max_frame)
                start = for_test_initial_counter & _M64
                for offset, value in ((WRITE_OFFSET, start), (READ_OFFSET, start),
                                      # waiters start as "always wake me", the
                                      # pure-Python protocol's permanent state
                                      (SPACE_WAITER_OFFSET, 1), (DATA_WAITER_OFFSET, 1)):
                    mm[offset:offset + 8] = value.to_bytes(8, "little")
            # A peer must not be able to shrink the file under our mapping (SIGBUS).
            fcntl.fcntl(memfd, fcntl.F_ADD_SEALS, _SEALS)
            for _ in range(2):
                # Non-blocking: a write to a saturated counter then fails with
                # EAGAIN ("already signalled") instead of blocking; every wait
                # polls for readiness before it drains.
                fds.append(os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK))
            return cls(*fds, spin=spin, native=native)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise

    @classmethod
    def attach(cls, memfd: int, data_efd: int, space_efd: int, *,
               spin: float | None = None, native: bool | None = None) -> "Ring":
        """Rebuild a ring from fds received from the peer; takes ownership of
        them once it returns (on an error they stay the caller's).

        Every fd is checked for what it claims to be, since the peer may be
        hostile (:class:`RingError` with the reason otherwise): the memfd must
        carry the shrink/grow seals :meth:`create` sets (the peer cannot
        truncate it under our mapping: no SIGBUS), and its header, size and
        counters must be possible; each eventfd must be an eventfd, plain
        (not EFD_SEMAPHORE) and already non-blocking (we never change its
        flags: the open file description is shared with the peer)."""
        _check_memfd(memfd)
        _check_eventfd(data_efd, "the ring's data eventfd")
        _check_eventfd(space_efd, "the ring's space eventfd")
        if len({memfd, data_efd, space_efd}) != 3:
            raise RingError(f"the ring's fds {memfd}, {data_efd}, {space_efd} are not distinct")
        return cls(memfd, data_efd, space_efd, spin=spin, native=native)

    def drain_eventfds(self) -> None:
        """Reset both eventfds without blocking. A thread of ours blocked in
        a signalling write -- possible only if the peer cleared O_NONBLOCK on
        the shared description and saturated the counter -- then returns.
        For tearing a ring down: it takes wake-ups the peer may be owed."""
        self._check_open()
        _drain(self._data_efd)
        _drain(self._space_efd)

    def fds(self) -> tuple[int, int, int]:
        """``(memfd, data_eventfd, space_eventfd)`` to send to the peer (the
        ring keeps owning them; duplicate or send, do not close)."""
        self._check_open()
        return self._fds

    def close(self) -> None:
        """Unmap and close the fds. Idempotent. Cancel any task waiting on this
        ring first: its eventfd is closed under it."""
        if self._closed:
            return
        self._closed = True
        for watch in self._watches.values():
            watch.close()
        self._watches.clear()
        for ep in self._epolls.values():
            ep.close()
        self._epolls.clear()
        self._pollers.clear()
        if self._native is not None:
            self._native.release()
        self._counters.release()
        self._mm.close()
        for fd in self._fds:
            os.close(fd)

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "Ring":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def statistics(self) -> RingStatistics:
        self._check_open()
        used = (self._counters[self._wi] - self._counters[self._ri]) & _M64
        written, read = self._frames_written, self._frames_read
        if self._native is not None:
            _, _, written, read = self._native.stats()
        return RingStatistics(self.capacity, self.max_frame, self._native is not None, used,
                              written, read)

    def _check_open(self) -> None:
        if self._closed:
            raise RingClosed("the ring is closed")

    # ------------------------------------------------------------ producer

    def _check_frame(self, frame):
        """``frame`` as a flat byte buffer (bytes as is), size-checked."""
        if frame.__class__ is bytes:
            if len(frame) > self.max_frame:
                return self._check_frame(memoryview(frame))
            return frame
        mv = memoryview(frame)
        if mv.ndim != 1 or mv.format != "B":
            mv = mv.cast("B")   # raises TypeError for a non-contiguous buffer
        if mv.nbytes > self.max_frame:
            raise FrameTooLarge(
                f"frame of {mv.nbytes} bytes exceeds the ring's maximum frame of "
                f"{self.max_frame} bytes (a frame may use at most half of the "
                f"{self.capacity}-byte ring, prefix included)")
        return mv

    def _try_write(self, mv) -> bool:
        if self._native is not None:
            rc = self._native.put(mv)
            if rc:
                return self._native_code(rc)
            return True
        n = len(mv)
        need = _pad(n)
        w = self._w
        used = (w - self._counters[self._ri]) & _M64
        if used > self.capacity or used & 7:
            raise RingCorrupted(f"peer's read counter is {used} bytes behind the write "
                                f"counter, impossible in a {self.capacity}-byte ring")
        if self.capacity - used < need:
            return False
        mm, mask, base = self._mm, self._mask, self._data
        pos = w & mask
        mm[base + pos:base + pos + PREFIX] = (n | ((n ^ _CHECK) << 32)).to_bytes(8, "little")
        start = (pos + PREFIX) & mask
        first = min(n, self.capacity - start)
        mm[base + start:base + start + first] = mv[:first]
        if first < n:
            mm[base:base + n - first] = mv[first:]
        if _FENCE:
            _FENCE()                   # payload stores before the counter store
        self._w = w = (w + need) & _M64
        self._counters[self._wi] = w   # publish: one aligned 8-byte store
        _signal(self._data_efd)   # after publishing, always: no lost wake-up
        self._frames_written += 1
        return True

    def _native_code(self, rc) -> bool:
        """Turn a status code of the C helper into False (full) or an error."""
        if rc == -1:
            return False
        if rc == -6:
            raise RingClosed("the ring is closed")
        if rc == -5:
            raise FrameTooLarge(f"frame exceeds the ring's maximum frame of {self.max_frame} bytes")
        what = "counter" if rc == -2 else "frame prefix"
        raise RingCorrupted(f"the peer's {what} is impossible for a {self.capacity}-byte ring "
                            f"(stream out of sync)")

    def write_nowait(self, frame) -> None:
        """Publish ``frame`` (bytes-like) or raise ``WouldBlock`` if it does not fit now."""
        if self._native is not None and not self._native.put(frame):
            return None     # fast path: published
        self._check_open()
        if not self._try_write(self._check_frame(frame)):
            raise WouldBlock
        return None

    def write(self, frame, timeout: float | None = None) -> None:
        """Publish ``frame``, waiting for space up to ``timeout`` seconds."""
        if self._native is not None and not self._native.put(frame):
            return          # fast path: published
        self._check_open()
        mv = self._check_frame(frame)
        if self._try_write(mv):
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        need = _pad(len(mv))
        while not self._try_write(mv):
            self._sleep_blocking(self._space_efd, True, None, deadline,
                             lambda: self._space_free() >= need)

    async def write_async(self, frame) -> None:
        """Publish ``frame``, awaiting space (bound it with a cancel scope)."""
        self._check_open()
        mv = self._check_frame(frame)
        while not self._try_write(mv):
            await self.wait_write(len(mv))

    def _need(self, nbytes: int) -> int:
        if nbytes > self.max_frame:    # would wait for room that can never be used
            raise FrameTooLarge(f"frame of {nbytes} bytes exceeds the ring's maximum frame of "
                                f"{self.max_frame} bytes")
        return _pad(nbytes)

    def _space_free(self) -> int:
        return self.capacity - ((self._w - self._counters[self._ri]) & _M64)

    def wait_write_blocking(self, nbytes: int, timeout: float | None = None,
                        also: int | None = None) -> Ready:
        """Block until a frame of ``nbytes`` fits (RING) or ``also`` is readable (ALSO)."""
        self._check_open()
        need = self._need(nbytes)
        deadline = None if timeout is None else time.monotonic() + timeout
        return self._sleep_blocking(self._space_efd, True, also, deadline,
                                lambda: self._space_free() >= need)

    async def wait_write(self, nbytes: int, also: int | None = None) -> Ready:
        """Await room for a frame of ``nbytes`` (RING) or ``also`` readable (ALSO)."""
        self._check_open()
        need = self._need(nbytes)
        return await self._sleep_async(self._space_efd, True, also,
                                       lambda: self._space_free() >= need)

    # ------------------------------------------------------------ consumer

    def _frame_ready(self) -> bool:
        return self._counters[self._wi] != self._r

    def _took(self, frame):
        """What the C helper's take returned: bytes or None, else an error."""
        if frame is None or frame.__class__ is bytes:
            return frame
        self._native_code(frame)
        raise AssertionError(f"unexpected code {frame} from the native helper")

    def _try_read(self):
        if self._native is not None:
            return self._took(self._native.take())
        r = self._r
        avail = (self._counters[self._wi] - r) & _M64
        if not avail:
            return None
        if avail > self.capacity or avail & 7:
            raise RingCorrupted(f"peer's write counter is {avail} bytes ahead of the read "
                                f"counter, impossible in a {self.capacity}-byte ring")
        if _FENCE:
            _FENCE()                   # counter load before the payload loads
        mm, mask, base = self._mm, self._mask, self._data
        pos = r & mask
        prefix = int.from_bytes(mm[base + pos:base + pos + PREFIX], "little")
        n = prefix & _CHECK
        if prefix >> 32 != n ^ _CHECK or n > self.max_frame or _pad(n) > avail:
            raise RingCorrupted(f"frame prefix {prefix:#018x} at index {pos} is not a valid "
                                f"frame header ({avail} bytes published)")
        start = base + ((pos + PREFIX) & mask)
        first = min(n, base + self.capacity - start)
        if first == n:
            frame = mm[start:start + n]
        else:
            frame = mm[start:start + first] + mm[base:base + n - first]
        if _FENCE:
            _FENCE()                   # payload loads before the counter store
        self._r = r = (r + _pad(n)) & _M64
        self._counters[self._ri] = r
        _signal(self._space_efd)
        self._frames_read += 1
        return frame

    def read_nowait(self) -> bytes:
        """The next frame, or ``WouldBlock`` if the ring is empty."""
        if self._native is not None:
            frame = self._native.take()
            if frame.__class__ is bytes:
                return frame
        self._check_open()
        frame = self._try_read()
        if frame is None:
            raise WouldBlock
        return frame

    def read(self, timeout: float | None = None) -> bytes:
        """The next frame, waiting up to ``timeout`` seconds."""
        if timeout is None and self._native is not None and not self._spin:
            # The whole check-announce-recheck-sleep loop in one C call, the
            # GIL released while asleep in poll(2): the latency floor of the eventfd.
            frame = self._native.take_blocking()
            if frame.__class__ is bytes:
                return frame
            self._took(frame)
        self._check_open()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            frame = self._try_read()
            if frame is not None:
                return frame
            self._sleep_blocking(self._data_efd, False, None, deadline,
                             self._frame_ready)

    def read_or(self, also: int) -> bytes | None:
        """The next frame, blocking until one is published; None once the fd
        ``also`` is readable while the ring holds none (a ready frame wins).
        A serving thread's whole wait: with the native helper the spin (if
        any, while a core is free), check, announce, sleep, drain and copy
        are one C call, the GIL released while spinning or asleep -- no
        Python between the wake-up and the frame."""
        native = self._native
        if native is not None and _NATIVE_SPIN and self._spin and _core_free():
            # Watch the ring for a while before sleeping, the GIL released
            # (a serving thread whose app sends its next frame soon): the
            # frame then costs neither side a wake-up.
            frame = native.take_spinning_or(also, self._spin_ns)
            if frame.__class__ is bytes:
                return frame
            if frame == _ALSO:
                return None
            self._took(frame)
        elif _NATIVE_READ_OR and native is not None:
            # (No spin, or a helper built before it had one: no spin then
            # either -- a Python spin would hold the GIL all along.)
            frame = native.take_blocking_or(also)
            if frame.__class__ is bytes:
                return frame
            if frame == _ALSO:
                return None
            self._took(frame)
        self._check_open()
        while True:
            frame = self._try_read()
            if frame is not None:
                return frame
            if self._sleep_blocking(self._data_efd, False, also, None,
                                    self._frame_ready) is Ready.ALSO:
                return None

    async def read_async(self) -> bytes:
        """The next frame, awaited without blocking the event loop."""
        self._check_open()
        while True:
            frame = self._try_read()
            if frame is not None:
                return frame
            await self._sleep_async(self._data_efd, False, None,
                                    self._frame_ready)

    def wait_read_blocking(self, timeout: float | None = None, also: int | None = None) -> Ready:
        """Block until a frame is ready (RING) or ``also`` is readable (ALSO)."""
        self._check_open()
        deadline = None if timeout is None else time.monotonic() + timeout
        return self._sleep_blocking(self._data_efd, False, also, deadline,
                                self._frame_ready)

    async def wait_read(self, also: int | None = None) -> Ready:
        """Await a frame (RING) or ``also`` readable (ALSO), whichever is first;
        a ready frame wins over ``also``."""
        self._check_open()
        return await self._sleep_async(self._data_efd, False, also,
                                       self._frame_ready)

    # --------------------------------------------------------------- waits
    #
    # Every wait is: check; spin (if configured); announce; re-check; sleep on
    # the eventfd; drain; retire; loop. With the native helper, announce is a
    # store plus a full fence and the peer signals only announced waiters.
    # Without it, announce and retire do nothing: the flag stays at 1 (as
    # create() left it) and the peer signals every frame.

    def _announce(self, space: bool) -> None:
        if self._native is not None:
            self._native.announce(space)

    def _retire(self, space: bool) -> None:
        if self._native is not None:
            self._native.retire(space)

    def _spin_until(self, ready) -> bool:
        if self._spin <= 0 or not _core_free():
            return False
        end = time.perf_counter() + self._spin
        while time.perf_counter() < end:
            if ready():
                return True
        return False

    def _sleep_blocking(self, efd: int, space: bool, also: int | None, deadline, ready) -> Ready:
        """Check, announce, re-check, sleep on the eventfd, drain (see "Wake-ups")."""
        # The eventfds are non-blocking (a read(2) cannot be the sleep): poll
        # for readiness, then drain.
        poller = self._poller(efd, also)
        while True:
            if ready() or self._spin_until(ready):
                return Ready.RING
            self._announce(space)
            try:
                if ready():
                    return Ready.RING
                events = poller.poll(_poll_ms(deadline))
            finally:
                self._retire(space)
            also_ready = False
            for fd, _ in events:
                if fd == efd:
                    _drain(efd)
                elif fd == also:
                    also_ready = True
            if also_ready and not ready():
                return Ready.ALSO
            if not events and deadline is not None and time.monotonic() >= deadline:
                if ready():
                    return Ready.RING
                raise TimeoutError("timed out waiting on the ring")
            self._check_open()

    def _poller(self, efd: int, also: int | None):
        """The kept poll object watching ``efd`` (and ``also``): a blocking
        waiter (a burst's serving thread) waits once per frame, and building
        and registering a fresh one each time was a measurable share of it."""
        poller = self._pollers.get((efd, also))
        if poller is None:
            poller = select.poll()
            poller.register(efd, select.POLLIN)
            if also is not None:
                poller.register(also, select.POLLIN)
            self._pollers[(efd, also)] = poller
        return poller

    def _epoll(self, efd: int, also: int) -> select.epoll:
        """The kept epoll watching ``efd`` and ``also`` (which must stay open
        while this ring is waited on with it, as a burst's wake fd does)."""
        ep = self._epolls.get((efd, also))
        if ep is None:
            ep = select.epoll(2, select.EPOLL_CLOEXEC)
            ep.register(efd, select.EPOLLIN)
            ep.register(also, select.EPOLLIN)
            self._epolls[(efd, also)] = ep
        return ep

    def _watch(self, efd: int) -> "_LoopWatch | None":
        """The asyncio watch of ``efd`` on the running loop; None on another
        kind of loop (trio), or while a watch of another live loop exists."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return None
        watch = self._watches.get(efd)
        if watch is not None and watch.loop is not loop:
            if not watch.loop.is_closed():
                return None
            watch.close()
            watch = None
        if watch is None:
            watch = self._watches[efd] = _LoopWatch(loop, efd)
        return watch

    async def _sleep_async(self, efd: int, space: bool, also: int | None, ready) -> Ready:
        # Never spins, whatever ``spin`` says: a spin here would stall every
        # other task of the event loop (issue 16). Only blocking waiters,
        # which own their thread, spin.
        if ready():
            return Ready.RING     # (before looking up the loop's watch: often)
        watch = self._watch(efd)
        while True:
            if ready():
                return Ready.RING
            self._announce(space)
            try:
                if ready():
                    return Ready.RING
                if watch is not None:    # (its reader drains the eventfd)
                    efd_ready = False
                    also_ready = await watch.wait(also, ready) is Ready.ALSO
                elif also is None:
                    await anyio.wait_readable(efd)
                    efd_ready, also_ready = True, False
                else:
                    efd_ready, also_ready = await _wait_either(self._epoll(efd, also),
                                                               efd, also)
            finally:
                self._retire(space)
            if efd_ready:
                _drain(efd)
            if also_ready and not ready():
                return Ready.ALSO
            self._check_open()


class _LoopWatch:
    """An asyncio loop's reader, kept between waits, on a private epoll
    holding one of a ring's eventfds and (during a wait that gives one) an
    ``also`` fd. One task waits at a time (the ring has one consumer and one
    producer). Runs on the loop's thread, but ``close``."""

    __slots__ = ("loop", "efd", "ep", "also", "future", "ready", "closing")

    def __init__(self, loop: asyncio.AbstractEventLoop, efd: int):
        self.loop = loop
        self.efd = efd
        self.ep = select.epoll(2, select.EPOLL_CLOEXEC)
        self.also: int | None = None        # in ``ep`` besides ``efd``
        self.future: asyncio.Future | None = None
        self.ready = None
        self.closing = False
        try:
            self.ep.register(efd, select.EPOLLIN)
            loop.add_reader(self.ep.fileno(), self._on_readable)
        except BaseException:
            self.ep.close()
            raise

    async def wait(self, also: int | None, ready) -> Ready:
        """Until ``ready()`` after the eventfd fired (RING), or ``also`` is
        readable (ALSO); a stale wake-up of the eventfd does not end it."""
        if also != self.also:
            if self.also is not None:
                self._forget_also()
            if also is not None:
                self.ep.register(also, select.EPOLLIN)
                self.also = also
        self.ready = ready
        self.future = future = self.loop.create_future()
        try:
            return await future
        finally:
            self.future = self.ready = None

    def _on_readable(self) -> None:
        if self.closing:
            self._close_on_loop()
            return
        # Drained whether it fired or ``also`` did (so that it is not
        # readable again until signalled): asking the epoll which one fired
        # first was one more system call on every frame. Only when the ring
        # has nothing for the waiter does ``also`` matter.
        _drain(self.efd)
        future = self.future
        waiting = future is not None and not future.done()
        if waiting and self.ready():
            future.set_result(Ready.RING)
            return
        if self.also is None:
            return
        efd = self.efd
        also_ready = any(fd != efd for fd, _ in self.ep.poll(0))
        if waiting:
            if also_ready:
                future.set_result(Ready.ALSO)
        elif also_ready:
            # Readable with nobody waiting (its owner's peer died, say): out
            # of the epoll until the next wait, or the loop would run hot.
            self._forget_also()

    def _forget_also(self) -> None:
        try:
            self.ep.unregister(self.also)
        except OSError:   # closed by its owner since: the epoll dropped it then
            pass
        self.also = None

    def _close_on_loop(self) -> None:
        if self.ep.closed:
            return
        if not self.loop.is_closed():
            self.loop.remove_reader(self.ep.fileno())
        self.ep.close()

    def close(self) -> None:
        """Leave the loop and close the epoll; from any thread. From another
        thread while the loop runs, that happens on the loop's thread (its
        reader map is not thread-safe), soon: the epoll stays until then,
        and its reader only closes it."""
        try:
            on_loop = asyncio.get_running_loop() is self.loop
        except RuntimeError:
            on_loop = False
        if on_loop or self.loop.is_closed() or not self.loop.is_running():
            self._close_on_loop()
            return
        self.closing = True
        try:
            self.loop.call_soon_threadsafe(self._close_on_loop)
        except RuntimeError:   # the loop closed meanwhile: so did its selector
            self.ep.close()


async def _wait_either(ep: select.epoll, efd: int, also: int) -> tuple[bool, bool]:
    """Sleep until ``efd`` or ``also`` is readable; say which are.

    ``ep`` is an epoll holding both: it is readable when either is, so the
    event loop waits on a single fd and no two tasks race."""
    await anyio.wait_readable(ep.fileno())
    ready = {fd for fd, _ in ep.poll(0)}
    return efd in ready, also in ready


__all__ = ["FrameTooLarge", "HEADER_SIZE", "MAGIC", "NATIVE_AVAILABLE", "PREFIX", "Ready", "Ring",
           "RingClosed", "RingCorrupted", "RingError", "RingStatistics", "VERSION", "WouldBlock"]
