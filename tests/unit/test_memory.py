"""nnrt.memory: memfd, POSIX shm and fd-mapped pools, numpy views."""
import mmap
import fcntl
import os

import numpy as np
import pytest

from nnrt import ErrorStatus, NnrtError
from nnrt.memory import Memory
from nnrt.memory.shared import PROT_READ


def test_memfd_memory_is_zeroed_and_writable_through_views():
    with Memory.create(64) as mem:
        assert mem.size == 64 and mem.writable and mem.fileno() >= 0
        assert bytes(mem.view()) == b"\0" * 64
        a = mem.array(np.float32, (2, 4))
        a[:] = np.arange(8, dtype=np.float32).reshape(2, 4)
        assert mem.array(np.float32, 4, offset=16).tolist() == [4, 5, 6, 7]
        assert bytes(mem.view()[:4]) == np.float32(0).tobytes()


def test_memfd_size_is_sealed_against_shrinking():
    with Memory.create(4096) as mem:
        with pytest.raises(OSError):
            os.ftruncate(mem.fileno(), 0)


def test_from_fd_shares_the_pages_and_handles_unaligned_offsets():
    with Memory.create(3 * mmap.ALLOCATIONGRANULARITY) as mem:
        offset = mmap.ALLOCATIONGRANULARITY + 8
        with Memory.from_fd(mem.fileno(), offset, 16) as other:
            other.array(np.int32, 4)[:] = [1, 2, 3, 4]
            assert mem.array(np.int32, 4, offset=offset).tolist() == [1, 2, 3, 4]
            assert other.fd_offset == offset and other.size == 16
        # from_fd duplicated the fd: the original still works
        assert mem.array(np.int32, 1, offset=offset)[0] == 1


def test_from_fd_read_only_gives_a_read_only_view():
    with Memory.create(32) as mem, Memory.from_fd(mem.fileno(), prot=PROT_READ) as ro:
        assert ro.size == 32 and not ro.writable and ro.view().readonly
        with pytest.raises(ValueError):
            ro.array(np.uint8, 4)[0] = 1


def test_from_fd_refuses_a_region_past_the_end_of_the_file():
    with Memory.create(32) as mem:
        with pytest.raises(NnrtError) as e:
            Memory.from_fd(mem.fileno(), 16, 32)
        assert e.value.status == ErrorStatus.INVALID_ARGUMENT
        assert "outside" in e.value.message


@pytest.mark.parametrize("call", [lambda: Memory.create(0), lambda: Memory.create(-1),
                                  lambda: Memory.create(1.5), lambda: Memory.from_fd(-1),
                                  lambda: Memory.from_fd(10 ** 6, 0, 16)])
def test_bad_arguments_are_invalid_argument(call):
    with pytest.raises(NnrtError) as e:
        call()
    assert e.value.status == ErrorStatus.INVALID_ARGUMENT


def test_array_outside_the_region_is_invalid_argument():
    with Memory.create(16) as mem:
        with pytest.raises(NnrtError):
            mem.array(np.float32, 5)
        with pytest.raises(NnrtError):
            mem.array(np.float32, 1, offset=16)


def test_posix_shm_is_named_until_closed():
    import posix_ipc
    mem = Memory.create_shm(128)
    name = mem.name
    assert name
    peer = posix_ipc.SharedMemory(name)  # a peer opens it by name
    try:
        with Memory.from_fd(peer.fd, 0, 128) as seen:
            mem.array(np.uint8, 3)[:] = [7, 8, 9]
            assert seen.array(np.uint8, 3).tolist() == [7, 8, 9]
    finally:
        peer.close_fd()
    mem.close()
    with pytest.raises(posix_ipc.ExistentialError):
        posix_ipc.SharedMemory(name)


def test_close_releases_the_fd_even_with_live_numpy_views():
    mem = Memory.create(16)
    fd = mem.fileno()
    view = mem.array(np.uint8, 16)
    mem.close()
    assert mem.closed
    with pytest.raises(OSError):
        os.fstat(fd)
    view[0] = 1  # the mapping lives as long as the view does
    with pytest.raises(NnrtError):
        mem.view()
    mem.close()  # idempotent


def test_as_buffer_gives_bytes_of_a_memory_or_any_buffer():
    from nnrt.memory import as_buffer
    with Memory.create(8) as mem:
        assert as_buffer(mem).nbytes == 8
    assert as_buffer(np.zeros(3, np.float32)).nbytes == 12
    assert as_buffer(b"abc").tobytes() == b"abc"


def test_create_seals_the_size_of_what_it_makes():
    with Memory.create(64) as mem:
        seals = fcntl.fcntl(mem.fileno(), fcntl.F_GET_SEALS)
        assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW
        with pytest.raises(PermissionError):
            os.ftruncate(mem.fileno(), 16)


@pytest.mark.parametrize("kind", ["unsealed memfd", "memfd sealed against growing only",
                                  "regular file", "posix shm", "eventfd"])
def test_require_sealed_refuses_what_could_shrink_and_says_how_to_seal(kind, tmp_path):
    import posix_ipc
    shm = None
    if kind == "regular file":
        fd = os.open(tmp_path / "f", os.O_CREAT | os.O_RDWR)
    elif kind == "posix shm":
        shm = posix_ipc.SharedMemory(None, posix_ipc.O_CREX, size=64)
        fd = os.dup(shm.fd)
        shm.close_fd()
    elif kind == "eventfd":
        fd = os.eventfd(0)
    else:
        fd = os.memfd_create("m", os.MFD_ALLOW_SEALING)
    if kind in ("regular file", "unsealed memfd", "memfd sealed against growing only"):
        os.ftruncate(fd, 64)
    if "growing" in kind:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_GROW)
    try:
        with pytest.raises(NnrtError) as e:
            Memory.from_fd(fd, 0, 64, require_sealed=True)
        assert e.value.status == ErrorStatus.INVALID_ARGUMENT
        assert "F_SEAL_SHRINK" in e.value.message and "Memory.create" in e.value.message
    finally:
        os.close(fd)
        if shm is not None:
            shm.unlink()


def test_require_sealed_maps_a_memfd_sealed_against_shrinking():
    fd = os.memfd_create("m", os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, 64)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        with Memory.from_fd(fd, 0, 64, require_sealed=True) as mem:
            assert mem.size == 64
    finally:
        os.close(fd)
    with Memory.create(32) as mem, Memory.from_fd(mem.fileno(), require_sealed=True) as seen:
        assert seen.size == 32
