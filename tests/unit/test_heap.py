"""Giving freed heap back to the kernel after a peer leaves: many requests
while one is pending make one trim, and trims keep their interval however
often peers come and go (a connect/close loop must not buy a trim each)."""
import time

from nnrt.memory import heap


def test_give_back_soon_coalesces_and_keeps_its_interval(monkeypatch):
    trims = []
    monkeypatch.setattr(heap, "give_back_freed_memory", lambda: trims.append(time.monotonic()))
    monkeypatch.setattr(heap, "GIVE_BACK_INTERVAL", 0.1)
    monkeypatch.setattr(heap, "_given_back_at", 0.0)
    calls = 0
    deadline = time.monotonic() + 30          # a guard, not a timing
    while len(trims) < 3 and time.monotonic() < deadline:   # a peer leaving every ms
        heap.give_back_soon()
        calls += 1
        time.sleep(0.001)
    while heap._give_back_pending and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not heap._give_back_pending and len(trims) >= 3
    # Sleeps never end early, so the interval is a lower bound whatever the
    # load; the calls in between were folded into those trims.
    assert all(b - a >= 0.1 for a, b in zip(trims, trims[1:]))
    assert calls > len(trims)


async def test_an_idle_service_gives_freed_memory_back_once_per_idle_spell(monkeypatch):
    import anyio
    from nnrt.drivers.reference import ReferenceDevice
    from nnrt.service import server
    from nnrt.qos import ScheduledDevice

    given = []
    monkeypatch.setattr(server, "give_back_soon", lambda: given.append(1))
    service = server.DriverService(ScheduledDevice(ReferenceDevice()))

    async def until(n):
        with anyio.fail_after(30):        # a guard, not a timing
            while len(given) < n:
                await anyio.sleep(0.005)
    async with anyio.create_task_group() as tg:
        tg.start_soon(service.give_back_when_idle, 0.01)
        await until(1)
        await anyio.sleep(0.1)            # ten more idle intervals: nothing new to give back
        assert len(given) == 1
        service._calls += 1               # a call came: the next idle spell gives back again
        await until(2)
        service.burst_counters.executions += 1
        await until(3)
        tg.cancel_scope.cancel()
