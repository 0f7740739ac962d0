"""The one staging arena and memory-slot cache of every service client (the
burst controller and the control connection's executions):
nnrt.memory.staging."""
import gc

import numpy as np
import pytest

from nnrt import ErrorStatus, NnrtError
from nnrt.hal import RequestArgument
from nnrt.memory import Memory
from nnrt.memory.staging import ALIGN, ArenaPool, SlotCache, Stager, stage
from nnrt.model.graph import DataLocation


def arg(pool, offset, length):
    return RequestArgument(False, DataLocation(pool, offset, length))


def test_staged_pools_share_one_arena_and_outputs_come_back():
    arenas = ArenaPool("test-arena", max_free=1)
    x = np.arange(4, dtype=np.float32)
    out = np.zeros(4, np.float32)
    with Memory.create(64) as mem:
        staging = stage((x.view(np.uint8), mem, out.view(np.uint8)),
                        (arg(0, 0, 16), arg(1, 0, 16)), (arg(2, 0, 16),), arenas)
        places = staging.places
        assert places[1].memory is mem and (places[1].offset, places[1].length) == (0, 64)
        assert places[0].memory is places[2].memory is staging.arena
        assert (places[0].offset, places[2].offset) == (0, ALIGN) and staging.bytes_in == 16
        arena = staging.arena
        assert np.frombuffer(arena.view()[:16], np.float32).tolist() == [0, 1, 2, 3]
        arena.view()[ALIGN:ALIGN + 16] = np.full(4, 7, np.float32).tobytes()
        assert staging.copy_out() == 16 and out.tolist() == [7] * 4
        staging.finish()
        again = stage((x.view(np.uint8),), (arg(0, 0, 16),), (), arenas)
        assert again.arena is arena            # reused
        again.finish(reuse=False)              # the peer may still write it: closed
        assert arena.closed
    arenas.close()


@pytest.mark.parametrize("pools, inputs, outputs, needle", [
    ((np.zeros(4, np.float32),), (arg(0, 8, 16),), (), "outside pool 0 of 16 bytes"),
    ((np.zeros(4, np.float32),), (), (arg(0, -4, 4),), "outside pool 0"),
    ((b"readonly",), (), (arg(0, 0, 8),), "read-only"),
    ((np.zeros((4, 4), np.float32)[:, 0],), (), (), "contiguous"),
])
def test_stage_refuses_what_no_driver_would_catch(pools, inputs, outputs, needle):
    with pytest.raises(NnrtError, match=needle) as e:
        stage(pools, inputs, outputs, ArenaPool("test-arena", 1))
    assert e.value.status == ErrorStatus.INVALID_ARGUMENT


def test_a_closed_memory_is_refused():
    mem = Memory.create(64)
    mem.close()
    with pytest.raises(NnrtError, match="closed Memory"):
        stage((mem,), (), (), ArenaPool("test-arena", 1))


def test_slot_cache_frees_closed_and_collected_memories_and_evicts_the_oldest():
    cache = SlotCache()
    a, b, c = Memory.create(64), Memory.create(64), Memory.create(64)
    sa, sb, sc = cache.slot(a), cache.slot(b), cache.slot(c)
    assert len({sa, sb, sc}) == 3 and cache.slot(a) == sa and len(cache) == 3
    assert cache.memory(sb) is b
    b.close()
    assert cache.memory(sb) is None
    del c
    gc.collect()
    assert cache.take_freed() == sorted([sb, sc]) and len(cache) == 1
    d = Memory.create(64)
    sd = cache.slot(d)
    assert cache.evict(2, keep={sa}) == [sd] and cache.slot(d) != sd  # a new slot afterwards
    a.close()
    d.close()


def test_slot_cache_learns_of_closes_without_scanning_and_forgets_evicted_memories():
    cache = SlotCache()
    mems = [Memory.create(64) for _ in range(4)]
    slots = [cache.slot(m) for m in mems]
    assert cache.take_freed() == []
    mems[2].close()
    assert cache.take_freed() == [slots[2]]
    assert cache.take_freed() == []          # freed once
    # An evicted memory is no longer the cache's: closing it frees nothing,
    # and it holds no close callback of the cache any more.
    assert cache.evict(3, keep={slots[0], slots[3]}) == [slots[1]]
    assert mems[1]._on_close == []
    mems[1].close()
    assert cache.take_freed() == []
    # Given a slot again (a new one), its close is noticed.
    again = Memory.create(64)
    s = cache.slot(again)
    again.close()
    assert cache.take_freed() == [s]
    for m in mems:
        m.close()
    assert cache.take_freed() == sorted([slots[0], slots[3]])


def test_a_request_laid_out_as_the_last_is_staged_by_copying_its_bytes_only():
    arenas = ArenaPool("test-arena", max_free=1)
    stager = Stager(arenas)
    x = np.arange(4, dtype=np.float32)
    out = np.zeros(4, np.float32)
    inputs, outputs = (arg(0, 0, 16),), (arg(1, 0, 16),)
    first = stager.stage((x, out), inputs, outputs)
    places = first.places
    assert stager.kept_places is places and stager.layouts == 1
    first.finish()
    y, out2 = np.full(4, 9, np.float32), np.zeros(4, np.float32)
    again = stager.stage((y, out2), inputs, outputs)   # other arrays, same layout
    assert again.places is places and stager.layouts == 1 and again.bytes_in == 16
    assert np.frombuffer(again.arena.view()[:16], np.float32).tolist() == [9] * 4
    again.arena.view()[ALIGN:ALIGN + 16] = np.full(4, 5, np.float32).tobytes()
    assert again.copy_out() == 16 and out2.tolist() == [5] * 4 and out.tolist() == [0] * 4
    again.finish(reuse=False)                  # cancelled: the arena is closed
    third = stager.stage((y, out2), inputs, outputs)
    assert third.places is not places and stager.layouts == 1   # new arena, same checks
    assert third.places[0].memory is third.arena and not third.arena.closed
    third.finish()
    # Anything else is staged in full: new argument tuples, another size, a
    # read-only output (refused as stage() refuses it), a Memory pool.
    stager.stage((y, out2), (arg(0, 0, 16),), outputs).finish()
    assert stager.layouts == 2
    with pytest.raises(NnrtError, match="read-only"):
        stager.stage((y, b"\0" * 16), inputs, outputs)
    with pytest.raises(NnrtError, match="outside pool 0"):
        stager.stage((np.zeros(2, np.float32), out2), inputs, outputs)
    with Memory.create(64) as mem:
        staged = stager.stage((mem,), (arg(0, 0, 16),), ())
        assert staged.arena is None and stager.layouts == 3
        # No Memory kept: what the stager keeps is the last staged layout's.
        assert stager.kept_places is not None
        assert all(place.memory is not mem for place in stager.kept_places)
        staged.finish()
    arenas.close()


def test_the_stager_keeps_its_arena_between_frames_and_gives_it_back_on_a_new_layout():
    arenas = ArenaPool("test-arena", max_free=1)
    stager = Stager(arenas)
    x, out = np.arange(4, dtype=np.float32), np.zeros(4, np.float32)
    inputs, outputs = (arg(0, 0, 16),), (arg(1, 0, 16),)
    first = stager.stage((x, out), inputs, outputs)
    arena = first.arena
    first.finish()
    other = arenas.take(16)          # the stager kept its arena: not in the pool
    assert other is not arena
    arenas.give_back(other)
    again = stager.stage((x, out), inputs, outputs)
    assert again.arena is arena and stager.layouts == 1
    again.finish()
    # Another layout: the kept arena goes back to the pool and is taken from there.
    changed = stager.stage((x, out), (arg(0, 0, 16),), outputs)
    assert stager.layouts == 2 and changed.arena in (arena, other)
    changed.finish()
    # A frame of the new layout with an output pool of another size: staged
    # in full, its copy back into the new buffer.
    wide = np.zeros(8, np.float32)
    staged = stager.stage((x, wide), (arg(0, 0, 16),), (arg(1, 0, 16),))
    assert stager.layouts == 3
    staged.arena.view()[staged.places[1].offset:staged.places[1].offset + 16] = \
        np.full(4, 3, np.float32).tobytes()
    assert staged.copy_out() == 32 and wide.tolist() == [3] * 4 + [0] * 4
    staged.finish()
    stager.close()                   # the arena it kept is closed with it
    assert stager.kept_places is None
    arenas.close()
    assert arena.closed and other.closed
