"""A service buffer's mirror (nnrt.service.mirror): a writer
SIGKILLed at any moment leaves the previous complete contents readable; the
memfd is sealed so a client holding it cannot resize it under the service;
a mirror the client scribbled on reads as "nothing to recover"."""
import fcntl
import os
import signal
import time

import anyio
import numpy as np
import pytest

from nnrt.service.mirror import HEADER, MirrorWriter, read_mirror
from nnrt.hal import Buffer

NBYTES = 1 << 20   # a megabyte a write: a kill lands mid-copy most of the time


class Counting(Buffer):
    """A buffer whose k-th contents are NBYTES bytes of value k (mod 251, never 0)."""

    token = 1

    def __init__(self, die_in_write: int = 0):
        self.k = 0
        self.die_in_write = die_in_write   # SIGKILL itself halfway through this write

    async def copy_to(self, memory) -> None:
        self.k += 1
        data = np.frombuffer(memory, np.uint8)
        if self.k == self.die_in_write:
            data[:len(data) // 2] = self.k % 251 or 1
            os.kill(os.getpid(), signal.SIGKILL)
        data[:] = self.k % 251 or 1

    async def copy_from(self, memory, dimensions=()) -> None:
        raise AssertionError("a mirror only reads its buffer")


@pytest.mark.service
def test_a_writer_killed_at_any_moment_leaves_one_whole_contents():
    writer = MirrorWriter(Counting(), NBYTES)
    try:
        assert read_mirror(writer.fileno(), NBYTES) is None   # never written
        for delay in np.linspace(0.01, 0.2, 12):
            pid = os.fork()
            if pid == 0:   # the writer: refresh forever until killed
                try:
                    async def forever():
                        while True:
                            await writer.refresh()
                    anyio.run(forever)
                finally:
                    os._exit(1)
            time.sleep(delay)
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            data = read_mirror(writer.fileno(), NBYTES)
            if data is None:   # killed before its first publish
                continue
            values = np.unique(np.frombuffer(data, np.uint8))
            assert len(values) == 1 and values[0] != 0, values[:8]
    finally:
        writer.close()


@pytest.mark.parametrize("die_in_write", [1, 2, 3, 7])
@pytest.mark.service
def test_a_writer_killed_halfway_through_a_write_leaves_the_one_before(die_in_write):
    writer = MirrorWriter(Counting(die_in_write), NBYTES)
    try:
        pid = os.fork()
        if pid == 0:
            try:
                async def until_killed():
                    while True:
                        await writer.refresh()
                anyio.run(until_killed)
            finally:
                os._exit(1)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        data = read_mirror(writer.fileno(), NBYTES)
        if die_in_write == 1:
            assert data is None   # nothing was ever complete
        else:
            assert data == bytes([die_in_write - 1]) * NBYTES
    finally:
        writer.close()


def test_a_mirror_is_sealed_and_a_scribbled_one_recovers_nothing():
    async def main():
        writer = MirrorWriter(Counting(), 16)
        try:
            fd = writer.fileno()
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW
            for size in (0, HEADER, writer.size + 4096):
                with pytest.raises(PermissionError):
                    os.ftruncate(fd, size)
            await writer.refresh()
            await writer.refresh()
            assert read_mirror(fd, 16) == bytes([2]) * 16
            assert read_mirror(fd, 8) is None            # not the size it was made for
            os.pwrite(fd, b"\x07", 16)                   # a "current" half that is none
            assert read_mirror(fd, 16) is None
            os.pwrite(fd, b"\x00", 16)
            assert read_mirror(fd, 16) == bytes([1]) * 16   # the other, older half
            os.pwrite(fd, b"garbage!", 0)
            assert read_mirror(fd, 16) is None
            await writer.refresh()   # the writer never reads what the client wrote
        finally:
            writer.close()
    anyio.run(main)
