"""Shared-memory pools: the ``Memory`` an app, the runtime and a driver
service all map.

Three ways to get one, as NNAPI has them:

* ``Memory.create(size)`` — an anonymous memfd (the ashmem analogue). Its size
  is sealed (``F_SEAL_SHRINK | F_SEAL_GROW``) so a peer that maps it can
  trust ``fstat``: nobody can shrink the file under the mapping and make the
  peer's next access a SIGBUS. This is the memory to give a driver service.
* ``Memory.create_shm(size)`` — named POSIX shared memory (posix-ipc), for a
  peer that opens it by ``name`` instead of receiving an fd. The name is
  unlinked when the Memory is closed.
* ``Memory.from_fd(fd, offset, size, prot)`` — a region of any mappable fd
  (``mmap_fd``); the fd is duplicated, the caller keeps its own.

Seals. A mapping of a file that shrinks under it faults (SIGBUS) on the next
access past the new end, and a signal in a driver service would end it for
every app. So a service maps only memfds sealed against shrinking:
``from_fd(..., require_sealed=True)`` (and :func:`check_sealed`) refuse
anything else with INVALID_ARGUMENT. Seals can be added but never removed,
so one check at mapping time holds for the mapping's life. POSIX shared
memory (``create_shm``) cannot be sealed: keep it for peers of your own.

A Memory is a buffer: ``view()`` gives a memoryview of the region (read-only
when mapped without PROT_WRITE), ``array(dtype, shape, offset)`` a numpy view,
``fileno()`` the fd to pass to another process. On Python 3.12+ the object
itself supports the buffer protocol (``__buffer__``); on 3.11 a Python class
cannot, so code that needs a buffer calls ``view()``.
"""
from __future__ import annotations

import errno
import fcntl
from dataclasses import dataclass
import mmap
import os
import stat
from typing import Sequence

import numpy as np

from ..errors import ErrorStatus, NnrtError, invalid

PROT_READ = mmap.PROT_READ
PROT_WRITE = mmap.PROT_WRITE
PROT_RW = PROT_READ | PROT_WRITE


class Memory:
    """A region of shared memory; close it (or use ``with``) when done."""

    def __init__(self, fd: int, fd_offset: int, size: int, prot: int, *, shm=None):
        # Private: use create / create_shm / from_fd. Takes ownership of fd.
        self._on_close: list = []
        self._fd = fd
        self.fd_offset = fd_offset
        self.size = size
        self.prot = prot
        self._shm = shm
        self.closed = False
        # mmap offsets must be multiples of the allocation granularity; map
        # from the aligned offset below and slice the region out.
        delta = fd_offset % mmap.ALLOCATIONGRANULARITY
        try:
            self._mmap = mmap.mmap(fd, size + delta, mmap.MAP_SHARED, prot,
                                   offset=fd_offset - delta)
        except (OSError, ValueError, OverflowError) as e:
            os.close(fd)
            if shm is not None:
                shm.unlink()
            raise NnrtError(ErrorStatus.INVALID_ARGUMENT,
                            f"cannot map {size} bytes at offset {fd_offset} of fd {fd}: {e}") from None
        self._view = memoryview(self._mmap)[delta:delta + size]

    # -- construction -------------------------------------------------------

    @classmethod
    def create(cls, size: int, name: str = "nnrt-memory") -> "Memory":
        """A new zero-filled memfd region of ``size`` bytes."""
        size = _check_size(size)
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        except OSError as e:
            os.close(fd)
            raise NnrtError(ErrorStatus.RESOURCE_EXHAUSTED_PERSISTENT,
                            f"cannot create a {size}-byte memfd: {e}") from None
        return cls(fd, 0, size, PROT_RW)

    @classmethod
    def create_shm(cls, size: int) -> "Memory":
        """A new named POSIX shared-memory region; ``name`` is its name until close."""
        import posix_ipc  # only this path needs it

        size = _check_size(size)
        try:
            shm = posix_ipc.SharedMemory(None, posix_ipc.O_CREX, mode=0o600, size=size)
        except (posix_ipc.Error, OSError, ValueError) as e:
            raise NnrtError(ErrorStatus.RESOURCE_EXHAUSTED_PERSISTENT,
                            f"cannot create {size} bytes of POSIX shared memory: {e}") from None
        fd = os.dup(shm.fd)
        shm.close_fd()
        return cls(fd, 0, size, PROT_RW, shm=shm)

    @classmethod
    def from_fd(cls, fd: int, offset: int = 0, size: int | None = None,
                prot: int = PROT_RW, *, require_sealed: bool = False) -> "Memory":
        """Map ``size`` bytes at ``offset`` of ``fd`` (default: to the end of
        the file). The fd is duplicated; the caller still owns ``fd``.

        With ``require_sealed`` (what a driver service uses for every fd an
        app sends it) the fd must be a memfd carrying ``F_SEAL_SHRINK``, so
        nobody can truncate it under the mapping; anything else is refused
        with INVALID_ARGUMENT (see :func:`check_sealed`). A Memory you give
        to a driver service must therefore come from :meth:`create`, or from
        a memfd you sealed yourself::

            fd = os.memfd_create("pool", os.MFD_ALLOW_SEALING)
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
            mem = nnrt.Memory.from_fd(fd)
        """
        if isinstance(fd, bool) or not isinstance(fd, int) or fd < 0:
            raise invalid(f"fd {fd!r} is not a file descriptor")
        if require_sealed:
            check_sealed(fd)
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise invalid(f"offset {offset!r} is not a non-negative integer")
        if prot not in (PROT_READ, PROT_RW):
            raise invalid(f"prot {prot!r} is neither PROT_READ nor PROT_READ | PROT_WRITE")
        try:
            st = os.fstat(fd)
        except OSError as e:
            raise invalid(f"fd {fd} cannot be mapped: {e}") from None
        if stat.S_ISREG(st.st_mode):
            # A region past the end of the file would map, then SIGBUS on access.
            if size is None:
                size = st.st_size - offset
            if offset + _check_size(size) > st.st_size:
                raise invalid(f"region [{offset}, {offset + size}) lies outside the "
                              f"{st.st_size}-byte file behind fd {fd}")
        elif size is None:
            raise invalid(f"fd {fd} is not a regular file: give the size to map")
        size = _check_size(size)
        return cls(os.dup(fd), offset, size, prot)

    # -- access -------------------------------------------------------------

    def fileno(self) -> int:
        self._check_open()
        return self._fd

    @property
    def name(self) -> str | None:
        """The POSIX shared-memory name (create_shm), else None."""
        return self._shm.name if self._shm is not None else None

    @property
    def writable(self) -> bool:
        return bool(self.prot & PROT_WRITE)

    def view(self) -> memoryview:
        """The region as a flat memoryview of bytes."""
        self._check_open()
        return self._view

    def __buffer__(self, flags):  # Python 3.12+: a Memory is itself a buffer
        return self.view()

    def array(self, dtype, shape: Sequence[int] | int, offset: int = 0) -> np.ndarray:
        """A numpy view of ``shape`` elements of ``dtype`` starting at byte ``offset``."""
        self._check_open()
        dtype = np.dtype(dtype)
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        if any(not isinstance(d, (int, np.integer)) or d < 0 for d in shape):
            raise invalid(f"shape {list(shape)} is not a list of non-negative integers")
        count = int(np.prod(shape, dtype=np.int64))
        if offset < 0 or offset + count * dtype.itemsize > self.size:
            raise invalid(f"{count} x {dtype} at offset {offset} does not fit in a "
                          f"{self.size}-byte memory")
        return np.frombuffer(self._view, dtype, count, offset).reshape(shape)

    def region(self, offset: int = 0, length: int | None = None,
               dimensions: Sequence[int] | None = None) -> "Region":
        """``[offset, offset + length)`` of this memory as an execution input or
        output (NNAPI's setInputFromMemory); ``dimensions`` fills in an
        operand's unknown dimensions."""
        self._check_open()
        length = self.size - offset if length is None else length
        if offset < 0 or length < 0 or offset + length > self.size:
            raise invalid(f"region [{offset}, {offset + length}) does not fit in a "
                          f"{self.size}-byte memory")
        return Region(self, int(offset), int(length),
                      None if dimensions is None else tuple(int(d) for d in dimensions))

    # -- lifetime -----------------------------------------------------------

    def close(self) -> None:
        """Release the fd (and the shm name). The mapping goes away now, or
        when the last numpy view onto it is dropped."""
        if self.closed:
            return
        self.closed = True
        for callback in self._on_close:
            callback()
        self._on_close.clear()
        try:
            self._view.release()
            self._mmap.close()
        except BufferError:
            pass  # views still exported: the mapping lives until they are gone
        os.close(self._fd)
        if self._shm is not None:
            try:
                self._shm.unlink()
            except Exception:  # already unlinked by someone else: nothing to undo
                pass

    def call_on_close(self, callback) -> None:
        """Call ``callback()`` (from the closing thread) when this memory is
        closed: it must be quick and must not raise (a cache queueing a slot
        to free is what it is for); at once if it is closed already."""
        if self.closed:
            callback()
            return
        self._on_close.append(callback)

    def cancel_on_close(self, callback) -> None:
        """Forget a ``callback`` given to :meth:`call_on_close` (if still there)."""
        try:
            self._on_close.remove(callback)
        except ValueError:
            pass

    def __enter__(self) -> "Memory":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if not getattr(self, "closed", True):
            try:
                self.close()
            except Exception:  # interpreter shutdown: the OS reclaims the fd anyway
                pass

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"fd {self._fd}"
        return f"<Memory {self.size} bytes, {state}>"

    def _check_open(self) -> None:
        if self.closed:
            raise invalid("the memory is closed")


@dataclass(frozen=True)
class Region:
    """A byte range of a Memory given to an execution: drivers read and write
    it in place (zero copy)."""

    memory: Memory
    offset: int
    length: int
    dimensions: tuple[int, ...] | None = None

    def array(self, dtype, shape: Sequence[int]) -> np.ndarray:
        return self.memory.array(dtype, shape, self.offset)


def as_buffer(pool) -> memoryview:
    """A flat byte memoryview of a pool: a Memory's region, or any object
    with the buffer protocol (so drivers accept both on Python 3.11)."""
    if isinstance(pool, Memory):
        return pool.view()
    return memoryview(pool).cast("B")


def pool_view(pool, k: int) -> memoryview:
    """``as_buffer`` of request pool ``k``, with INVALID_ARGUMENT (not the
    TypeError or ValueError of a cast) for an object that is not a
    contiguous buffer: a non-contiguous array, or no buffer at all."""
    try:
        return as_buffer(pool)
    except (TypeError, ValueError) as e:
        raise invalid(f"request pool {k} is not a contiguous buffer: {e}") from None


SEALS_NEEDED = fcntl.F_SEAL_SHRINK
_HOW_TO_SEAL = ("a driver service maps only memfds sealed against shrinking: use "
                "nnrt.Memory.create, or memfd_create(name, MFD_ALLOW_SEALING) and "
                "fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) before sending it")


def check_sealed(fd: int) -> None:
    """INVALID_ARGUMENT unless ``fd`` is a memfd sealed with ``F_SEAL_SHRINK``
    (its size can then never drop under a mapping of it). ``F_SEAL_GROW`` is
    not required: growing cannot fault a mapping."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as e:
        what = "not open" if e.errno == errno.EBADF else "not a memfd"
        raise invalid(f"fd {fd} is {what} ({e.strerror}); {_HOW_TO_SEAL}") from None
    if not seals & SEALS_NEEDED:
        raise invalid(f"memfd {fd} is not sealed against shrinking (seals {seals:#x}); "
                      f"{_HOW_TO_SEAL}")


def _check_size(size) -> int:
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size <= 0:
        raise invalid(f"memory size {size!r} is not a positive integer")
    return int(size)
