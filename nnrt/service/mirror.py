"""A service buffer's mirror: its last written contents in a sealed memfd the
client holds, so they outlive the service (the "CPU rerun" of memory domains).

Theory of operation
-------------------
A buffer of fully known dimensions (``nbytes`` of contents) gets, at
ALLOCATE, a memfd of ``HEADER + 2 * nbytes`` bytes that the service creates,
sizes and seals against shrinking and growing (``Memory.create``), and whose
fd goes to the allocating connection alone, in the ALLOCATE reply — a
mirror is never shared between connections, let alone apps. The layout::

    [0, 8)     magic  b"NNRTMIR1"
    [8, 16)    nbytes (u64, little-endian): the size of one half
    [16]       current: 0 or 1, the half holding complete contents;
               0xFF while the buffer was never written
    [64, 64 + nbytes)              half 0
    [64 + nbytes, 64 + 2 * nbytes) half 1

The service is the only writer (:class:`MirrorWriter`): after every write of
the buffer (an execution that had it as an output, a COPY_FROM) it copies
the contents into the half that is *not* current, then publishes by storing
the one ``current`` byte — a single-byte store cannot tear. A service killed
mid-copy therefore leaves ``current`` naming the previous complete contents;
one killed after the store leaves the new ones. The reply of that execution
is sent only after the publish, so whatever the client saw succeed is in the
mirror. Two writes of one buffer are serialized by the writer's lock (the
registry already keeps the buffer itself whole; this keeps the halves
whole).

The client reads the mirror (:func:`read_mirror`) only once the service is
dead — its connection failed with DEAD_OBJECT, so the writer's stores are
all done and visible (the kernel's process exit orders them before the
reader's EOF). It checks the header (magic, size, the current byte) and
copies the half out; a malformed mirror is "nothing to recover", never an
exception of another kind.

Why not the alternatives: copying the state back to the app after every
execution crosses it into the app each time (the thing memory domains
avoid); keeping the contents *only* in the memfd would put a memory the
client can write under the driver's inputs — with a mirror the driver never
reads it, so a client that scribbles on its fd corrupts only its own
recovery copy and cannot disturb the service (the seals stop truncation, so
no SIGBUS either). The price is one copy of each written buffer inside the
service per execution.

A buffer whose dimensions are not fully known at ALLOCATE has no mirror:
its size changes from execution to execution, and a new memfd per resize
would have to reach the client inside an EXECUTE reply. Its contents die
with the service (the execution fails with DEAD_OBJECT).
"""
from __future__ import annotations

import struct

import anyio

from ..errors import NnrtError
from ..memory import Memory
from ..memory.shared import PROT_READ

HEADER = 64
MAGIC = b"NNRTMIR1"
NONE_WRITTEN = 0xFF
_HEAD = struct.Struct("<8sQB")
_CURRENT = 16


def mirror_size(nbytes: int) -> int:
    return HEADER + 2 * nbytes


class MirrorWriter:
    """The service's side of one buffer's mirror."""

    def __init__(self, buffer, nbytes: int):
        self.buffer = buffer              # the HAL Buffer it mirrors
        self.nbytes = nbytes
        self.memory = Memory.create(mirror_size(nbytes), "nnrt-buffer-mirror")
        _HEAD.pack_into(self.memory.view(), 0, MAGIC, nbytes, NONE_WRITTEN)
        self._lock = anyio.Lock()

    def fileno(self) -> int:
        return self.memory.fileno()

    @property
    def size(self) -> int:
        return self.memory.size

    async def refresh(self) -> None:
        """Copy the buffer's contents (HAL ``copy_to``) into the half that
        is not current, then publish it."""
        async with self._lock:
            if self.memory.closed:   # released meanwhile
                return
            view = self.memory.view()
            current = view[_CURRENT]
            half = 1 if current == 0 else 0
            start = HEADER + half * self.nbytes
            region = view[start:start + self.nbytes]
            try:
                await self.buffer.copy_to(region)
            finally:
                region.release()
            # The publishing store: one byte, after every byte of the half.
            view[_CURRENT] = half

    def close(self) -> None:
        self.memory.close()


def read_mirror(fd: int, nbytes: int) -> bytes | None:
    """The complete contents a dead service last published in the mirror
    ``fd`` (``nbytes`` of them), or None when there are none (never
    written, or the mirror is not what it should be)."""
    try:
        with Memory.from_fd(fd, 0, None, PROT_READ) as mem:
            view = mem.view()
            if mem.size != mirror_size(nbytes):
                return None
            magic, size, current = _HEAD.unpack_from(view, 0)
            if magic != MAGIC or size != nbytes or current not in (0, 1):
                return None
            start = HEADER + current * nbytes
            return bytes(view[start:start + nbytes])
    except NnrtError:
        return None
