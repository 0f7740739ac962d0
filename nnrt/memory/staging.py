"""Request pools on their way to another process: one staging arena and one
memory-slot cache, for every client of a driver service (the control
connection's executions and the burst controller alike).

A pool that is a :class:`Memory` goes as it is: the other side maps it once
and names it by a *slot* id afterwards (:class:`SlotCache`). Any other pool
(a numpy array, bytes) is *staged*: copied into an arena, a Memory taken
from an :class:`ArenaPool` and reused across executions, and the outputs are
copied back once the result says they were written (:func:`stage`).

Why the arena's regions are checked here: the arena is larger than the pool
staged in it, so a region past the pool's end would still lie inside the
arena and no driver would refuse it.
"""
from __future__ import annotations

import collections
import functools
import itertools
import threading
import weakref

from ..errors import ErrorStatus, NnrtError
from .device import DeviceToken
from .shared import Memory, pool_view

ALIGN = 64   # every staged pool starts on a cache line of the arena


def _invalid(message: str) -> NnrtError:
    return NnrtError(ErrorStatus.INVALID_ARGUMENT, message)


class ArenaPool:
    """Arenas free for the next execution, at most ``max_free`` kept. Any
    thread may take and give back (a prepared model runs executions from
    the app's loop and from threads at once)."""

    def __init__(self, name: str, max_free: int):
        self.name = name
        self.max_free = max_free
        self._lock = threading.Lock()
        self._free: list[Memory] = []
        self.closed = False

    def take(self, size: int) -> Memory:
        """A free arena of at least ``size`` bytes, or a new one."""
        with self._lock:
            for i, arena in enumerate(self._free):
                if arena.size >= size:
                    return self._free.pop(i)
        return Memory.create(max(4096, 1 << (size - 1).bit_length()), self.name)

    def give_back(self, arena: Memory) -> None:
        """Keep ``arena`` for the next execution (or close it: too many, closed)."""
        with self._lock:
            if not self.closed and not arena.closed and len(self._free) < self.max_free:
                self._free.append(arena)
                return
        arena.close()

    def close(self) -> None:
        with self._lock:
            self.closed = True
            free, self._free = self._free, []
        for arena in free:
            arena.close()


class SlotCache:
    """Slot ids for the Memories sent to one peer, least recently used first.

    A Memory keeps its slot while it is open and alive; one closed or
    garbage collected is *freed* (``take_freed``), so the peer can unmap it.
    The cache holds weak references only: it never keeps a Memory alive."""

    def __init__(self):
        self._ids = itertools.count(1)
        self._slot_of: weakref.WeakKeyDictionary[Memory, int] = weakref.WeakKeyDictionary()
        self._memory_of: collections.OrderedDict[int, weakref.ref] = collections.OrderedDict()
        self._collected: collections.deque[int] = collections.deque()
        self._on_close: dict[int, functools.partial] = {}

    def __len__(self) -> int:
        return len(self._memory_of)

    def slot(self, mem: Memory) -> int:
        """The slot of ``mem`` (a new one on first use), now the most recent."""
        slot = self._slot_of.get(mem)
        if slot is None:
            slot = next(self._ids)
            self._slot_of[mem] = slot
            self._memory_of[slot] = weakref.ref(mem)
            # The finalizer and the close callback only queue: they may run
            # on any thread, at any time. Queued slots are all take_freed
            # looks at: O(freed) per execution, not O(slots) (issue 16).
            weakref.finalize(mem, self._collected.append, slot)
            on_close = self._on_close[slot] = functools.partial(self._collected.append, slot)
            mem.call_on_close(on_close)
        else:
            self._memory_of.move_to_end(slot)
        return slot

    def memory(self, slot: int) -> Memory | None:
        """The open Memory of ``slot``, or None."""
        ref = self._memory_of.get(slot)
        mem = ref() if ref is not None else None
        return None if mem is None or mem.closed else mem

    def take_freed(self) -> list[int]:
        """Forget and return the slots whose Memory was closed or collected."""
        if not self._collected:
            return []        # (every execution asks: most find nothing)
        freed = set()
        while self._collected:
            freed.add(self._collected.popleft())
        freed &= self._memory_of.keys()
        for slot in freed:
            self.forget(slot)
        return sorted(freed)

    def evict(self, limit: int, keep) -> list[int]:
        """Forget the least recently used slots (none of ``keep``) until
        fewer than ``limit`` remain; the slots forgotten."""
        evicted = []
        while len(self._memory_of) >= limit:
            slot = next((s for s in self._memory_of if s not in keep), None)
            if slot is None:
                break
            self.forget(slot)
            evicted.append(slot)
        return evicted

    def forget(self, slot: int) -> None:
        ref = self._memory_of.pop(slot, None)
        on_close = self._on_close.pop(slot, None)
        mem = ref() if ref is not None else None
        if mem is not None:
            self._slot_of.pop(mem, None)
            if on_close is not None:
                mem.cancel_on_close(on_close)

    def clear(self) -> None:
        for slot in list(self._memory_of):
            self.forget(slot)
        self._collected.clear()
        self._memory_of.clear()
        self._slot_of = weakref.WeakKeyDictionary()


class Place:
    """Where one request pool lives: ``length`` bytes at ``offset`` of
    ``memory`` (the pool itself, or the arena it was staged into)."""

    __slots__ = ("memory", "offset", "length")

    def __init__(self, memory: Memory, offset: int, length: int):
        self.memory = memory
        self.offset = offset
        self.length = length


class Staging:
    """The places of a request's pools; ``copy_out`` after a good result,
    then ``finish`` exactly once."""

    __slots__ = ("places", "arena", "_copy_back", "_arenas", "bytes_in")

    def __init__(self, places, arena, copy_back, arenas, bytes_in):
        self.places: tuple[Place, ...] = places
        self.arena: Memory | None = arena
        self._copy_back = copy_back      # (caller's output buffer, its offset in the arena)
        self._arenas = arenas            # where finish() gives the arena back
        self.bytes_in = bytes_in

    @property
    def staged(self) -> bool:
        return self.arena is not None

    def copy_out(self) -> int:
        """Copy the staged outputs back into the caller's buffers; the bytes copied."""
        if self.arena is None or self.arena.closed:
            return 0
        return _copy(self.arena.view(), self._copy_back, out=True)

    def finish(self, reuse: bool = True) -> None:
        """Give the arena back for the next execution; ``reuse=False`` when
        the peer may still write into it (a cancelled execution in flight)."""
        arena, self.arena = self.arena, None
        if arena is None:
            return
        if reuse:
            self._arenas.give_back(arena)
        else:
            arena.close()


def _pool_indexes(arguments) -> set[int]:
    return {a.location.pool_index for a in arguments
            if not a.has_no_value and a.location is not None}


def stage(pools, inputs, outputs, arenas: ArenaPool) -> Staging:
    """Place every pool of a request (``inputs``/``outputs`` are its
    arguments): a Memory as it is, anything else copied into one arena.
    INVALID_ARGUMENT for a closed Memory, a buffer that is not contiguous, a
    read-only output buffer, or an argument's region outside its staged pool."""
    return _stage(pools, inputs, outputs, arenas)[0]


def _stage(pools, inputs, outputs, arenas):
    """``stage``, and what a binding keeps of it: the staged pools (index ->
    (buffer, offset in the arena)) and the input and output pools."""
    output_pools, input_pools = _pool_indexes(outputs), _pool_indexes(inputs)
    staged: dict[int, tuple[memoryview, int]] = {}
    places: list[Place | None] = []
    total = 0
    for k, pool in enumerate(pools):
        if isinstance(pool, Memory):
            if pool.closed:
                raise _invalid(f"request pool {k} is a closed Memory")
            places.append(Place(pool, 0, pool.size))
            continue
        if isinstance(pool, DeviceToken):   # a driver buffer: nothing to place
            places.append(pool)
            continue
        raw = pool_view(pool, k)
        if k in output_pools and raw.readonly:
            raise _invalid(f"request pool {k} holds an output but is read-only")
        staged[k] = (raw, total)
        places.append(None)
        total += -(-max(raw.nbytes, 1) // ALIGN) * ALIGN
    for kind, arguments in ((("input", inputs), ("output", outputs)) if staged else ()):
        for i, a in enumerate(arguments):
            loc = a.location
            if a.has_no_value or loc is None or loc.pool_index not in staged:
                continue    # a Memory's regions are the driver's to check
            size = staged[loc.pool_index][0].nbytes
            if loc.offset < 0 or loc.length < 0 or loc.offset + loc.length > size:
                raise _invalid(f"{kind} {i}: region [{loc.offset}, {loc.offset + loc.length}) "
                               f"lies outside pool {loc.pool_index} of {size} bytes")
    arena, bytes_in = None, 0
    if staged:
        arena = arenas.take(total)
        view = arena.view()
        for k, (raw, base) in staged.items():
            places[k] = Place(arena, base, raw.nbytes)
            if k in input_pools and raw.nbytes:
                view[base:base + raw.nbytes] = raw
                bytes_in += raw.nbytes
    copy_back = [staged[k] for k in sorted(output_pools) if k in staged and staged[k][0].nbytes]
    return (Staging(tuple(places), arena, copy_back, arenas, bytes_in), staged, input_pools,
            output_pools)


def _copy(view: memoryview, pairs, out: bool) -> int:
    """Each ``(caller's buffer, its offset in the arena)`` of ``pairs`` out of
    the arena ``view`` into the buffer (``out``), or into the arena; the
    bytes copied."""
    copied = 0
    for raw, base in pairs:
        n = raw.nbytes
        if out:
            raw[:] = view[base:base + n]
        else:
            view[base:base + n] = raw
        copied += n
    return copied


class BoundPools:
    """A request's pools placed once, for every execution of a binding (a
    reusable burst execution): Memories as they are, the other pools in an
    arena of the binding's own. Each execution copies the input pools in
    (:meth:`copy_in`) and, after a good result, the outputs back
    (:meth:`copy_out`); the places never change. One execution at a time."""

    __slots__ = ("places", "arena", "_copy_in", "_copy_back")

    def __init__(self, places: tuple, arena: Memory | None, copy_in: list, copy_back: list):
        self.places = places
        self.arena = arena
        self._copy_in = copy_in       # (caller's input buffer, its offset in the arena)
        self._copy_back = copy_back   # (caller's output buffer, its offset in the arena)

    def copy_in(self) -> int:
        """Copy the input pools into the arena; the bytes copied."""
        return _copy(self.arena.view(), self._copy_in, out=False) if self._copy_in else 0

    def copy_out(self) -> int:
        """Copy the outputs back into the caller's buffers; the bytes copied."""
        return _copy(self.arena.view(), self._copy_back, out=True) if self._copy_back else 0

    def close(self) -> None:
        """Close the arena (the peer must be done with it). Idempotent."""
        arena, self.arena = self.arena, None
        self._copy_in = self._copy_back = []
        if arena is not None:
            arena.close()


class _NewArena:
    """What ``_stage`` takes an arena from, for a binding: a new one."""

    def __init__(self, name: str):
        self.name = name

    def take(self, size: int) -> Memory:
        return Memory.create(max(4096, size), self.name)


def bind(pools, inputs, outputs, name: str = "nnrt-bound-arena") -> BoundPools:
    """Place a request's pools once (:class:`BoundPools`), with the checks
    of :func:`stage`."""
    staging, staged, input_pools, _ = _stage(pools, inputs, outputs, _NewArena(name))
    copy_in = [(raw, base) for k, (raw, base) in staged.items()
               if k in input_pools and raw.nbytes]
    return BoundPools(staging.places, staging.arena, copy_in, list(staging._copy_back))


__all__ = ["ALIGN", "ArenaPool", "BoundPools", "Place", "SlotCache", "Staging", "bind", "stage"]
