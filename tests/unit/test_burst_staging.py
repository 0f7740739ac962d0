"""The one staging arena and memory-slot cache of every service client (the
burst controller and the control connection's executions):
nnrt.memory.staging."""
import gc

import numpy as np
import pytest

from nnrt import ErrorStatus, NnrtError
from nnrt.hal import RequestArgument
from nnrt.memory import Memory
from nnrt.memory.staging import ALIGN, ArenaPool, SlotCache, bind, stage
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


def test_a_binding_places_its_pools_once_and_each_execution_moves_only_bytes():
    x = np.arange(4, dtype=np.float32)
    out = np.zeros(4, np.float32)
    bound = bind((x, out), (arg(0, 0, 16),), (arg(1, 0, 16),), "test-bound")
    arena = bound.arena
    assert [p.memory for p in bound.places] == [arena, arena]
    x[:] = 9                                 # the next frame, in the caller's array
    assert bound.copy_in() == 16
    assert np.frombuffer(arena.view()[:16], np.float32).tolist() == [9] * 4
    arena.view()[ALIGN:ALIGN + 16] = np.full(4, 5, np.float32).tobytes()
    assert bound.copy_out() == 16 and out.tolist() == [5] * 4
    bound.close()
    assert arena.closed and bound.copy_in() == 0
    bound.close()                            # idempotent
    # A Memory pool is placed as it is: nothing to copy.
    with Memory.create(64) as mem:
        bound = bind((mem,), (arg(0, 0, 16),), (arg(0, 16, 16),))
        assert bound.arena is None and bound.places[0].memory is mem
        assert bound.copy_in() == bound.copy_out() == 0
    # Refused as stage() refuses.
    with pytest.raises(NnrtError, match="read-only"):
        bind((x, b"\0" * 16), (arg(0, 0, 16),), (arg(1, 0, 16),))
    with pytest.raises(NnrtError, match="outside pool 0"):
        bind((np.zeros(2, np.float32), out), (arg(0, 0, 16),), (arg(1, 0, 16),))
