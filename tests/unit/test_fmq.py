"""The fmq ring: frames, wrap-around, full/empty, limits, corruption, waits,
async waits on asyncio and trio, and an fd handoff to a second process."""
import asyncio
import fcntl
import mmap
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time

import anyio
import numpy as np
import pytest

from nnrt.fmq import (HEADER_SIZE, NATIVE_AVAILABLE, FrameTooLarge, Ready, Ring, RingClosed,
                      RingCorrupted, RingError, WouldBlock)
from nnrt.fmq.ring import DATA_WAITER_OFFSET, READ_OFFSET, SPACE_WAITER_OFFSET, WRITE_OFFSET

# The C helper is optional (setup.py): without a compiler its tests are skipped.
needs_native = pytest.mark.skipif(not NATIVE_AVAILABLE, reason="native helper not built")

PROTOCOLS = [pytest.param(True, id="native", marks=needs_native),
             pytest.param(False, id="always-signal")]


@pytest.fixture(params=PROTOCOLS)
def native(request):
    return request.param


def make(native, capacity=256, **kw):
    return Ring.create(capacity, native=native, **kw)


def peek_u64(ring, offset):
    with mmap.mmap(ring.fds()[0], HEADER_SIZE) as mm:
        return int.from_bytes(mm[offset:offset + 8], "little")


def poke_u64(ring, offset, value):
    with mmap.mmap(ring.fds()[0], HEADER_SIZE) as mm:
        mm[offset:offset + 8] = (value % 2**64).to_bytes(8, "little")


def test_frames_round_trip_in_order(native):
    with make(native) as ring:
        frames = [b"", b"a", b"0123456789abcdef", bytes(range(120))]
        for f in frames:
            ring.write_nowait(f)
        assert [ring.read_nowait() for _ in frames] == frames
        # any contiguous buffer is a frame; the reader always gets bytes
        ring.write_nowait(bytearray(b"xy"))
        ring.write_nowait(memoryview(b"xyz"))
        ring.write_nowait(np.arange(4, dtype=np.int32))
        assert ring.read_nowait() == b"xy"
        assert ring.read_nowait() == b"xyz"
        assert ring.read_nowait() == np.arange(4, dtype=np.int32).tobytes()


def test_empty_and_full(native):
    with make(native, 64) as ring:       # max frame 24, 8-byte prefix, 8-byte padding
        with pytest.raises(WouldBlock):
            ring.read_nowait()
        ring.write_nowait(b"x" * 24)     # 32 bytes
        ring.write_nowait(b"y" * 24)     # 64: full
        with pytest.raises(WouldBlock):
            ring.write_nowait(b"")
        assert ring.statistics().bytes_used == 64
        assert ring.read_nowait() == b"x" * 24
        ring.write_nowait(b"z")          # 16 bytes fit again
        assert ring.read_nowait() == b"y" * 24
        assert ring.read_nowait() == b"z"
        with pytest.raises(WouldBlock):
            ring.read_nowait()
        stats = ring.statistics()
        assert (stats.bytes_used, stats.frames_written, stats.frames_read) == (0, 3, 3)
        assert stats.native is native


def test_frames_larger_than_half_the_ring_are_refused(native):
    with make(native, 1024) as ring:
        assert ring.max_frame == 512 - 8
        ring.write_nowait(b"m" * ring.max_frame)
        with pytest.raises(FrameTooLarge, match=r"frame of 505 bytes exceeds .* maximum frame of "
                                                r"504 bytes .*half of the 1024-byte ring"):
            ring.write_nowait(b"m" * 505)
        with pytest.raises(FrameTooLarge):
            ring.write(b"m" * 4096, timeout=0)   # refused up front, not waited for
        with pytest.raises(FrameTooLarge):
            ring.wait_write_blocking(505, timeout=0)
        assert ring.read_nowait() == b"m" * 504
    with pytest.raises(ValueError, match="max_frame"):
        Ring.create(1024, max_frame=600)
    with make(native, 1024, max_frame=100) as ring:
        with pytest.raises(FrameTooLarge, match="maximum frame of 100"):
            ring.write_nowait(bytes(101))


@pytest.mark.parametrize("capacity", [0, 63, 100, 3 << 10, 2**31, True, "64"])
def test_capacity_must_be_a_power_of_two(capacity):
    with pytest.raises(ValueError, match="power of two"):
        Ring.create(capacity)


def test_wrap_around_splits_payloads_across_the_end(native):
    rng = np.random.default_rng(1)
    with make(native, 256) as ring:
        for k in range(600):
            frame = rng.integers(0, 256, int(rng.integers(0, ring.max_frame + 1)),
                                 dtype=np.uint8).tobytes()
            ring.write_nowait(frame)
            assert ring.read_nowait() == frame, k
        assert ring.statistics().frames_read == 600


@pytest.mark.parametrize("start", [256 - 8, 256 * 1000 - 16, 2**32 - 8, 2**64 - 24, 2**64 - 8])
def test_counters_near_the_wrap_of_the_index_mask(native, start):
    with make(native, 256, for_test_initial_counter=start) as ring:
        assert peek_u64(ring, WRITE_OFFSET) == start % 2**64
        frames = [bytes([i]) * (i * 7 % 100) for i in range(40)]
        pending = []
        for f in frames:
            while True:
                try:
                    ring.write_nowait(f)
                    pending.append(f)
                    break
                except WouldBlock:
                    assert ring.read_nowait() == pending.pop(0)
        while pending:
            assert ring.read_nowait() == pending.pop(0)
        w, r = peek_u64(ring, WRITE_OFFSET), peek_u64(ring, READ_OFFSET)
        assert w == r
        total = sum(8 + (len(f) + 7) // 8 * 8 for f in frames)
        assert w == (start + total) % 2**64   # counters only grow, modulo 2**64


def test_an_impossible_peer_counter_is_reported_not_followed(native):
    with make(native) as ring:
        ring.write_nowait(b"abc")
        poke_u64(ring, WRITE_OFFSET, peek_u64(ring, READ_OFFSET) + 4096)   # more than capacity
        with pytest.raises(RingCorrupted):
            ring.read_nowait()
    with make(native) as ring:
        ring.write_nowait(b"abc")
        poke_u64(ring, READ_OFFSET, peek_u64(ring, WRITE_OFFSET) + 8)      # reader ahead
        with pytest.raises(RingCorrupted):
            ring.write_nowait(b"x")


def test_a_bad_frame_prefix_is_reported(native):
    with make(native) as ring:
        ring.write_nowait(b"abcdefgh")
        with mmap.mmap(ring.fds()[0], HEADER_SIZE + ring.capacity) as mm:
            mm[HEADER_SIZE:HEADER_SIZE + 4] = (200).to_bytes(4, "little")   # check word mismatch
        with pytest.raises(RingCorrupted):
            ring.read_nowait()


def test_timeouts(native):
    with make(native, 64) as ring:
        t = time.monotonic()
        with pytest.raises(TimeoutError):
            ring.read(timeout=0.05)
        assert time.monotonic() - t >= 0.04
        ring.write(b"x" * 24)
        ring.write(b"x" * 24)
        with pytest.raises(TimeoutError):
            ring.write(b"y", timeout=0.05)
        with pytest.raises(TimeoutError):
            ring.wait_write_blocking(1, timeout=0.01)
        assert ring.read(timeout=0) == b"x" * 24
        assert ring.wait_write_blocking(24, timeout=0) is Ready.RING


def test_blocking_reader_and_writer_wake_each_other(native):
    """A writer blocked on a full ring wakes when the reader frees space, and
    a reader blocked on an empty ring wakes when a frame arrives."""
    n = 3000
    with make(native, 128) as ring:
        got = []

        def consumer():
            for _ in range(n):
                got.append(ring.read())
                if len(got) % 500 == 0:
                    time.sleep(0.01)    # let the producer fill the ring and block

        t = threading.Thread(target=consumer)
        t.start()
        for i in range(n):
            ring.write(i.to_bytes(4, "little") * (i % 13))
        t.join(10)
        assert not t.is_alive()
        assert got == [i.to_bytes(4, "little") * (i % 13) for i in range(n)]


@needs_native
@pytest.mark.parametrize("producer_native", [True, False])
def test_native_and_pure_python_ends_interoperate(producer_native):
    with Ring.create(128, native=producer_native) as producer:
        consumer = Ring.attach(*(os.dup(fd) for fd in producer.fds()),
                               native=not producer_native)
        got = []
        t = threading.Thread(target=lambda: got.extend(consumer.read() for _ in range(2000)))
        t.start()
        for i in range(2000):
            producer.write(bytes([i % 256]) * (i % 50))
        t.join(10)
        assert got == [bytes([i % 256]) * (i % 50) for i in range(2000)]
        consumer.close()


@needs_native
def test_native_ends_signal_only_announced_waiters():
    """The fenced handshake: no eventfd write while the peer is not waiting;
    a pure-Python waiter's flag stays 1, so it is always signalled."""
    with Ring.create(256, native=True) as ring:
        ring.write_nowait(b"a")
        assert ring.read_nowait() == b"a"
        assert peek_u64(ring, DATA_WAITER_OFFSET) == 0       # cleared on first use
        assert peek_u64(ring, SPACE_WAITER_OFFSET) == 0
        data_efd = ring.fds()[1]
        assert os.eventfd_read(data_efd) == 1   # "a" went out while the flag was still 1
        ring.write_nowait(b"b")
        os.set_blocking(data_efd, False)
        with pytest.raises(BlockingIOError):    # nobody waited: no wake-up was sent
            os.eventfd_read(data_efd)
        os.set_blocking(data_efd, True)
    with Ring.create(256, native=False) as ring:
        ring.write_nowait(b"a")
        ring.read_nowait()
        assert peek_u64(ring, DATA_WAITER_OFFSET) == 1
        assert os.eventfd_read(ring.fds()[1]) == 1


def test_wait_with_also_reports_which_fired(native):
    with make(native) as ring:
        also = os.eventfd(0, os.EFD_NONBLOCK)
        try:
            with pytest.raises(TimeoutError):
                ring.wait_read_blocking(timeout=0.01, also=also)
            os.eventfd_write(also, 1)
            assert ring.wait_read_blocking(timeout=1, also=also) is Ready.ALSO
            ring.write_nowait(b"f")
            assert ring.wait_read_blocking(timeout=1, also=also) is Ready.RING   # a frame wins
            assert ring.read_nowait() == b"f"
        finally:
            os.close(also)


def test_read_or_gives_a_frame_or_none_once_also_fires(native):
    with make(native) as reader, Ring.attach(*map(os.dup, reader.fds()), native=native) as peer:
        also = os.eventfd(0, os.EFD_NONBLOCK)
        try:
            peer.write_nowait(b"ready")
            assert reader.read_or(also) == b"ready"             # no wait at all
            os.eventfd_write(also, 1)
            peer.write_nowait(b"wins")
            assert reader.read_or(also) == b"wins"              # a frame wins over also
            assert reader.read_or(also) is None                 # then also: nothing to read
            os.eventfd_read(also)
            writer = threading.Timer(0.05, peer.write_nowait, (b"later",))
            writer.start()
            assert reader.read_or(also) == b"later"             # slept until it came
            writer.join()
            stopper = threading.Timer(0.05, os.eventfd_write, (also, 1))
            stopper.start()
            assert reader.read_or(also) is None                 # slept until also fired
            stopper.join()
        finally:
            os.close(also)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_async_waits(native, backend):
    async def main():
        with make(native, 128) as ring:
            also = os.eventfd(0, os.EFD_NONBLOCK)
            try:
                # a frame from another thread wakes the awaiting task
                threading.Timer(0.02, ring.write, (b"late",)).start()
                with anyio.fail_after(5):
                    assert await ring.read_async() == b"late"
                # the other fd wakes it too, and says so
                threading.Timer(0.02, os.eventfd_write, (also, 1)).start()
                with anyio.fail_after(5):
                    assert await ring.wait_read(also=also) is Ready.ALSO
                ring.write_nowait(b"now")
                assert await ring.wait_read(also=also) is Ready.RING
                assert ring.read_nowait() == b"now"
                # a full ring: write_async waits until a reader frees space
                await ring.write_async(b"x" * 56)
                await ring.write_async(b"x" * 56)
                threading.Timer(0.02, ring.read).start()
                with anyio.fail_after(5):
                    await ring.write_async(b"y")
                # a waiter can be cancelled
                with anyio.move_on_after(0.02) as scope:
                    await ring.wait_write(56)
                assert scope.cancelled_caught
            finally:
                os.close(also)
    anyio.run(main, backend=backend)


def test_close_is_idempotent_and_final(native):
    ring = make(native)
    ring.write_nowait(b"x")
    ring.close()
    ring.close()
    assert ring.closed
    for call in (lambda: ring.read_nowait(), lambda: ring.write_nowait(b"y"),
                 lambda: ring.read(timeout=0), lambda: ring.statistics(), lambda: ring.fds()):
        with pytest.raises(RingClosed):
            call()


def test_attach_refuses_what_is_not_a_ring(tmp_path):
    efds = [os.eventfd(0, os.EFD_NONBLOCK) for _ in range(2)]
    fd = os.memfd_create("x", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, HEADER_SIZE + 64)
    try:
        with pytest.raises(RingError, match="not sealed"):
            Ring.attach(fd, *efds)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        with pytest.raises(RingError, match="magic"):
            Ring.attach(fd, *efds)
        plain = os.open(tmp_path / "f", os.O_CREAT | os.O_RDWR)
        with pytest.raises(RingError, match="memfd"):
            Ring.attach(plain, *efds)
        os.close(plain)
    finally:
        for x in (fd, *efds):
            os.close(x)


def _not_an_eventfd(kind, tmp_path, keep):
    """An fd of ``kind`` standing where an eventfd should be; ``keep`` gets
    every fd to close."""
    if kind == "directory":
        fds = [os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)]
    elif kind == "/dev/null":
        fds = [os.open("/dev/null", os.O_RDWR)]
    elif kind == "socket":
        fds = [s.detach() for s in socket.socketpair()]
    elif kind == "pipe":
        fds = list(os.pipe())
    elif kind == "memfd":
        fds = [os.memfd_create("m")]
    elif kind == "blocking eventfd":
        fds = [os.eventfd(0)]
    else:
        fds = [os.eventfd(0, os.EFD_NONBLOCK | os.EFD_SEMAPHORE)]
    keep.extend(fds)
    return fds[0]


@pytest.mark.parametrize("kind", ["directory", "/dev/null", "socket", "pipe", "memfd",
                                  "blocking eventfd", "semaphore eventfd"])
@pytest.mark.parametrize("which", [1, 2])
def test_attach_refuses_an_eventfd_that_is_not_one(kind, which, tmp_path):
    """Whatever a hostile peer sends in an eventfd's place is refused with a
    RingError naming it, and the fds stay the caller's, flags untouched."""
    keep = []
    with Ring.create(256) as ring:
        fds = [os.dup(fd) for fd in ring.fds()]
        keep.extend(fds)
        fds[which] = _not_an_eventfd(kind, tmp_path, keep)
        flags = fcntl.fcntl(fds[which], fcntl.F_GETFL)
        try:
            with pytest.raises(RingError, match="eventfd"):
                Ring.attach(*fds)
            assert fcntl.fcntl(fds[which], fcntl.F_GETFL) == flags
        finally:
            for fd in keep:
                os.close(fd)


@pytest.mark.parametrize("kind", ["directory", "/dev/null", "socket", "pipe", "eventfd",
                                  "unsealed memfd", "memfd sealed against shrinking only"])
def test_attach_refuses_a_memfd_that_is_not_one(kind, tmp_path):
    keep = []
    with Ring.create(256) as ring:
        fds = [os.dup(fd) for fd in ring.fds()]
        keep.extend(fds)
        if kind == "eventfd":
            bad = os.eventfd(0, os.EFD_NONBLOCK)
            keep.append(bad)
        elif kind.startswith("unsealed") or kind.startswith("memfd"):
            bad = os.memfd_create("m", os.MFD_ALLOW_SEALING)
            os.ftruncate(bad, HEADER_SIZE + 256)
            os.write(bad, os.pread(fds[0], HEADER_SIZE, 0))
            if kind.startswith("memfd"):
                fcntl.fcntl(bad, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
            keep.append(bad)
        else:
            bad = _not_an_eventfd(kind, tmp_path, keep)
        try:
            with pytest.raises(RingError, match="memfd|memory"):
                Ring.attach(bad, fds[1], fds[2])
        finally:
            for fd in keep:
                os.close(fd)


@pytest.mark.parametrize("field,value,match", [
    ("capacity", 0, "capacity"), ("capacity", 100, "capacity"), ("capacity", 2**63, "capacity"),
    ("max_frame", 2**32, "max frame"), ("max_frame", 121, "max frame"),
    ("write", 3, "counters"), ("read", 2**64 - 1024, "counters"), ("write", 512, "counters"),
    ("version", 7, "version"), ("header", 0, "header size")])
def test_attach_refuses_hostile_header_values(field, value, match):
    """Header fields and initial counters a hostile creator could write give
    a RingError, never an out-of-bounds access or a hang."""
    import struct
    with Ring.create(256) as ring:
        memfd = ring.fds()[0]
        with mmap.mmap(memfd, HEADER_SIZE) as mm:
            if field == "capacity":
                struct.pack_into("<Q", mm, 16, value)
            elif field == "max_frame":
                struct.pack_into("<Q", mm, 24, value)
            elif field == "version":
                struct.pack_into("<I", mm, 8, value)
            elif field == "header":
                struct.pack_into("<I", mm, 12, value)
            else:
                struct.pack_into("<Q", mm, WRITE_OFFSET if field == "write" else READ_OFFSET,
                                 value)
        fds = [os.dup(fd) for fd in ring.fds()]
        try:
            with pytest.raises(RingError, match=match):
                Ring.attach(*fds)
        finally:
            for fd in fds:
                os.close(fd)


def test_a_tiny_max_frame_is_a_valid_ring_that_refuses_big_frames(native):
    """max_frame 0 is a legal header: the ring works, and a frame beyond it is
    FrameTooLarge (its user checks max_frame against what it must send)."""
    with Ring.create(64, max_frame=0) as ring:
        peer = Ring.attach(*(os.dup(fd) for fd in ring.fds()), native=native)
        try:
            assert peer.max_frame == 0
            peer.write_nowait(b"")
            assert ring.read_nowait() == b""
            with pytest.raises(FrameTooLarge):
                peer.write_nowait(b"x")
        finally:
            peer.close()


def test_a_saturated_eventfd_never_blocks_a_signalling_end(native):
    """A peer may saturate the counter of the eventfd we signal: the write
    fails with EAGAIN, which counts as "already signalled", and the frame
    still gets through."""
    with Ring.create(256, native=native) as ring:
        data_efd, space_efd = ring.fds()[1:]
        for efd in (data_efd, space_efd):
            os.eventfd_write(efd, 2**64 - 2)      # the largest count an eventfd holds
        done = threading.Event()

        def work():
            for i in range(50):
                ring.write_nowait(b"f%d" % i)
                assert ring.read_nowait() == b"f%d" % i
            done.set()
        t = threading.Thread(target=work, daemon=True)
        t.start()
        assert done.wait(5), "a write to a saturated eventfd blocked"
        # and a sleeping reader still wakes for a later frame
        t2 = threading.Timer(0.05, ring.write, (b"late",))
        t2.start()
        assert ring.read(timeout=5) == b"late"


CHILD = textwrap.dedent("""
    import os, socket, sys
    from nnrt.fmq import Ring
    sock = socket.socket(fileno=int(sys.argv[1]))
    _, fds, _, _ = socket.recv_fds(sock, 16, 6)
    requests, replies = Ring.attach(*fds[:3]), Ring.attach(*fds[3:])
    while True:
        frame = requests.read()
        if frame == b"quit":
            break
        replies.write(frame[::-1])
""")


@pytest.mark.service
def test_fd_handoff_to_a_second_process_and_peer_death():
    """Ring fds travel over SCM_RIGHTS to another process, which echoes
    frames; its exit is seen through a pidfd passed as ``also``."""
    requests, replies = Ring.create(4096), Ring.create(4096)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(theirs.fileno())],
                             pass_fds=[theirs.fileno()], env=env)
    theirs.close()
    pidfd = os.pidfd_open(child.pid)
    try:
        socket.send_fds(ours, [b"rings"], [*requests.fds(), *replies.fds()])
        for i in range(200):
            frame = os.urandom(i % 300)
            requests.write(frame)
            assert replies.wait_read_blocking(timeout=10, also=pidfd) is Ready.RING
            assert replies.read_nowait() == frame[::-1]
        requests.write(b"quit")
        assert replies.wait_read_blocking(timeout=10, also=pidfd) is Ready.ALSO   # it exited
        assert child.wait(10) == 0
    finally:
        child.kill()
        child.wait()
        os.close(pidfd)
        ours.close()
        requests.close()
        replies.close()


@pytest.mark.service
def test_the_ring_works_without_the_native_helper():
    """An install without a C compiler has no _native module: the ring then
    runs the pure-Python always-signal protocol."""
    code = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "nnrt.fmq._native":
                    raise ImportError("no compiler here")
        sys.meta_path.insert(0, Block())
        from nnrt.fmq import NATIVE_AVAILABLE, Ring, RingError
        assert not NATIVE_AVAILABLE
        with Ring.create(256) as ring:
            assert not ring.statistics().native
            ring.write(b"hello")
            assert ring.read(timeout=1) == b"hello"
        try:
            Ring.create(256, native=True)
        except RingError as e:
            assert "not built" in str(e)
        else:
            raise AssertionError("native=True without the helper was accepted")
        print("ok")
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


async def test_async_waits_never_spin_even_when_a_spin_is_configured():
    """Issue 16: a spin on the event loop stalls every other task; only
    blocking waiters (threads of their own) may spin."""
    import anyio
    from nnrt.fmq import Ring

    ring = Ring.create(4096, spin=0.01)
    peer = Ring.attach(*[os.dup(fd) for fd in ring.fds()])
    try:
        def no_spin(ready):
            raise AssertionError("an async wait spun")
        ring._spin_until = no_spin
        async with anyio.create_task_group() as tg:
            async def later():
                await anyio.sleep(0.01)
                peer.write_nowait(b"frame")
            tg.start_soon(later)
            assert await ring.read_async() == b"frame"
    finally:
        peer.close()
        ring.close()


def test_a_blocking_waiter_keeps_one_poll_object_per_fd_pair():
    from nnrt.fmq import Ring

    ring = Ring.create(4096, spin=0)
    try:
        for _ in range(3):
            with pytest.raises(TimeoutError):
                ring.wait_read_blocking(timeout=0.001)
        assert len(ring._pollers) == 1
    finally:
        ring.close()


# -- asyncio: a wait's epoll stays registered with the loop between waits ------------

def test_asyncio_waits_register_with_the_loop_once(native):
    async def main():
        loop = asyncio.get_running_loop()
        added = []
        add_reader = loop.add_reader
        loop.add_reader = lambda fd, cb, *args: (added.append(fd), add_reader(fd, cb, *args))
        also = os.eventfd(0, os.EFD_NONBLOCK)
        with make(native, 256) as ring:
            peer = Ring.attach(*[os.dup(fd) for fd in ring.fds()], native=native)
            try:
                for k in range(20):
                    threading.Timer(0.001, peer.write, (b"%d" % k,)).start()
                    with anyio.fail_after(5):
                        assert await ring.wait_read(also=also) is Ready.RING
                    assert ring.read_nowait() == b"%d" % k
            finally:
                peer.close()
        os.close(also)
        return added

    assert len(anyio.run(main)) == 1     # one reader, kept: no epoll_ctl per wait


def test_an_also_fd_readable_with_nobody_waiting_does_not_run_the_loop_hot(monkeypatch):
    from nnrt.fmq import ring as ring_module

    calls = []
    on_readable = ring_module._LoopWatch._on_readable
    monkeypatch.setattr(ring_module._LoopWatch, "_on_readable",
                        lambda self: (calls.append(1), on_readable(self)))

    async def main():
        also = os.eventfd(0, os.EFD_NONBLOCK)
        with Ring.create(256) as ring:
            os.eventfd_write(also, 1)            # readable for good: a dead peer
            assert await ring.wait_read(also=also) is Ready.ALSO
            before = len(calls)
            for _ in range(200):                 # 200 turns of the loop, nobody waiting
                await anyio.sleep(0)
            after = len(calls)
            # The next wait watches it again, and it still fires.
            assert await ring.wait_read(also=also) is Ready.ALSO
        os.close(also)
        return after - before

    assert anyio.run(main) <= 1


def test_closing_a_ring_from_another_thread_takes_its_epoll_off_the_loop():
    async def main():
        loop = asyncio.get_running_loop()
        ring = Ring.create(256)
        peer = Ring.attach(*[os.dup(fd) for fd in ring.fds()])
        try:
            async def write_once_it_waits():
                # Only a reader that has to wait sets up its loop watch: the
                # peer writes once it has (a timer instead lost that race
                # on a busy machine: the reader found the byte already there).
                while not ring._watches:
                    await anyio.sleep(0)
                peer.write(b"x")

            async def read():
                assert await ring.read_async() == b"x"

            with anyio.fail_after(5):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(read)
                    tg.start_soon(write_once_it_waits)
            (watch,) = ring._watches.values()
            fd = watch.ep.fileno()
            await anyio.to_thread.run_sync(ring.close)    # while the loop runs
            for _ in range(5):
                await anyio.sleep(0)
            assert watch.ep.closed
            assert not loop.remove_reader(fd)             # not registered any more
        finally:
            peer.close()

    anyio.run(main)


# -- a serving thread's spin (burst REQUEST_SPIN) -------------------------------------


@needs_native
def test_a_spinning_reader_takes_a_frame_without_any_wake_up(monkeypatch):
    """While it spins the reader has not announced itself, so the writer
    writes no eventfd; the spin runs with the GIL released (this thread
    writes the frame meanwhile)."""
    from nnrt.fmq import ring as ring_module

    monkeypatch.setattr(ring_module, "_core_free", lambda: True)
    with Ring.create(4096) as writer, \
            Ring.attach(*map(os.dup, writer.fds()), spin=30.0) as reader:
        stop = os.eventfd(0, os.EFD_NONBLOCK)
        data_efd = writer.fds()[1]
        try:
            writer.write_nowait(b"first")          # the flag create() set: signalled
            assert reader.read_or(stop) == b"first"
            os.eventfd_read(data_efd)
            got = []
            thread = threading.Thread(target=lambda: got.append(reader.read_or(stop)))
            thread.start()
            time.sleep(0.05)        # (order only: the thread is in its spin by now, or not
            writer.write_nowait(b"caught")   # yet in read_or; either way it takes it unsignalled)
            thread.join(10)
            assert got == [b"caught"]
            with pytest.raises(BlockingIOError):   # no wake-up was written
                os.eventfd_read(data_efd)
            assert peek_u64(writer, DATA_WAITER_OFFSET) == 0
        finally:
            os.close(stop)


@needs_native
def test_no_spin_where_no_core_is_free(monkeypatch):
    from nnrt.fmq import ring as ring_module

    monkeypatch.setattr(ring_module, "_core_free", lambda: False)
    with Ring.create(4096) as writer, \
            Ring.attach(*map(os.dup, writer.fds()), spin=30.0) as reader:
        stop = os.eventfd(0, os.EFD_NONBLOCK)
        try:
            writer.write_nowait(b"first")
            assert reader.read_or(stop) == b"first"
            got = []
            thread = threading.Thread(target=lambda: got.append(reader.read_or(stop)))
            thread.start()
            # It announces itself and sleeps at once (a spinner would not
            # announce for 30 s); the guard only bounds a failing run.
            guard = time.monotonic() + 10
            while peek_u64(writer, DATA_WAITER_OFFSET) != 1 and time.monotonic() < guard:
                time.sleep(0.001)
            assert peek_u64(writer, DATA_WAITER_OFFSET) == 1
            os.eventfd_write(stop, 1)
            thread.join(10)
            assert got == [None]
        finally:
            os.close(stop)


@needs_native
def test_closing_a_ring_under_a_spinning_reader_ends_its_read(monkeypatch):
    """close() from another thread waits for the spin to notice (it never
    unmaps under it) and the read ends with RingClosed, not a crash."""
    from nnrt.fmq import ring as ring_module

    monkeypatch.setattr(ring_module, "_core_free", lambda: True)
    writer = Ring.create(4096)
    reader = Ring.attach(*map(os.dup, writer.fds()), spin=30.0)
    stop = os.eventfd(0, os.EFD_NONBLOCK)
    outcome = []

    def read():
        try:
            outcome.append(reader.read_or(stop))
        except RingClosed as e:
            outcome.append(e)
    try:
        thread = threading.Thread(target=read)
        thread.start()
        time.sleep(0.05)
        reader.close()
        thread.join(10)
        assert not thread.is_alive() and len(outcome) == 1
        assert isinstance(outcome[0], RingClosed)
    finally:
        os.close(stop)
        writer.close()


def test_a_core_is_free_while_the_run_queue_leaves_one(monkeypatch):
    """The fourth field of /proc/loadavg (runnable threads, the caller
    included) against the cores this process may use; read again only
    after a while."""
    from nnrt.fmq import ring as ring_module

    monkeypatch.setattr(ring_module, "_free_checked", -1.0)
    monkeypatch.setattr(ring_module, "_cores", lambda: 10**6)
    assert ring_module._core_free() is True
    monkeypatch.setattr(ring_module, "_cores", lambda: 0)
    assert ring_module._core_free() is True            # the reading is still good
    monkeypatch.setattr(ring_module, "_free_checked", -1.0)
    assert ring_module._core_free() is False
