"""The scheduler is a property of the seam, not of the reference driver: a
driver service running ``sample-float-fast`` (real processes) reports per-app
statistics, refuses a deadline it cannot meet and protects a HIGH execution
from a LOW flood of the same app within one of its steps; an in-process
driver that can never be interrupted (``Boundaries.NONE``) is still queued
and prioritised, and HIGH waits at most one LOW run. Everything is asserted
on the scheduler's own timestamps and counters."""
import os

import anyio
import numpy as np
import pytest

import nnrt
from nnrt import ErrorStatus, NnrtError, Priority
from nnrt.drivers.reference import ReferenceDevice
from nnrt.hal import Boundaries, DeviceType, Scheduling
from nnrt.qos import ScheduledDevice

from .test_qos_inprocess import DIMS, chain_model

HIGH, LOW = Priority.HIGH, Priority.LOW


async def _flood_then_high(rt, device: str, me, low, high, stop_after: int = 5):
    """Three LOW tasks of app ``me`` keep ``device`` busy; a HIGH execution
    is submitted ``stop_after`` times while a LOW one runs. Returns the LOW
    outputs."""
    x = np.zeros(DIMS, np.float32)
    stop = anyio.Event()
    low_results = []

    async def flood():
        while not stop.is_set():
            low_results.append((await low.execute([x])).outputs[0])

    async def low_running():
        return (await rt.statistics(device)).of(me, LOW).running == 1

    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(flood)
        for k in range(stop_after):
            for _ in range(2000):
                if await low_running():
                    break
                await anyio.sleep(0.001)
            await anyio.sleep(0.002 * (k + 1))
            r = await high.execute([np.full(16, k, np.float32)])
            assert r.outputs[0].tolist() == [k + 2.0] * 16
        stop.set()
    return low_results


async def test_a_sample_driver_service_has_the_full_qos(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.delenv("NNRT_DRIVERS", raising=False)
    async with nnrt.Runtime(spawn=[("npu", "sample-float-fast", "--app-key", "pid")]) as rt:
        low = await rt.compile(chain_model(30), priority=LOW, devices=["npu"])
        high = await rt.compile(chain_model(2, (16,)), priority=HIGH, devices=["npu"])
        me = ("pid", os.getpid())    # the service keys apps by peer pid here
        low_results = await _flood_then_high(rt, "npu", me, low, high)
        records = await rt.finished_jobs("npu")
        stats = await rt.statistics("npu")

        # Per-app statistics, from the service's scheduler.
        assert stats.of(me, HIGH).completed == 5
        assert stats.of(me, LOW).completed == len(low_results) > 0
        assert stats.of(me, LOW).preempted >= 1
        assert stats.of(("pid", 1), LOW).completed == 0     # nobody else's work

        # HIGH within one LOW step (the sample driver stops at operations).
        highs = [r for r in records if r.app == me and r.priority == HIGH]
        lows = [r for r in records if r.app == me and r.priority == LOW]
        longest_low_step = max(r.longest_step for r in lows)
        assert len(highs) == 5
        for h in highs:
            assert h.status == ErrorStatus.NONE and h.wait <= longest_low_step, \
                (h.wait, longest_low_step)
        assert all(np.array_equal(out, np.full(DIMS, 30.0, np.float32)) for out in low_results)

        # A deadline the driver cannot meet even when idle is refused, not
        # run. A long model, so that the deadline is still ahead when the
        # request reaches the service on a loaded machine.
        long = await rt.compile(chain_model(200), priority=LOW, devices=["npu"])
        x = np.zeros(DIMS, np.float32)
        await long.execute([x])                             # teaches its run time
        run_time = [r for r in await rt.finished_jobs("npu") if r.app == me][-1].ran
        before = (await rt.statistics("npu")).of(me, LOW)
        with pytest.raises(NnrtError) as e:
            await long.execute([x], deadline=nnrt.deadline_in(s=run_time / 3))
        assert e.value.status == ErrorStatus.MISSED_DEADLINE_PERSISTENT, e.value
        after = (await rt.statistics("npu")).of(me, LOW)
        assert after.completed == before.completed
        assert after.deadline_misses == before.deadline_misses + 1


class Uninterruptible(ReferenceDevice):
    """The reference kernels, declared as a driver the scheduler can never
    stop in the middle of a run (an accelerator's single job)."""

    type = DeviceType.ACCELERATOR

    def scheduling(self) -> Scheduling:
        return Scheduling(Boundaries.NONE, slots=1)


async def test_a_driver_without_boundaries_is_queued_and_prioritised_by_whole_runs():
    device = ScheduledDevice(Uninterruptible("whole-runs"))
    async with nnrt.Runtime(devices=[device]) as rt:
        low = await rt.compile(chain_model(30), priority=LOW)
        high = await rt.compile(chain_model(2, (16,)), priority=HIGH)
        me = os.getpid()              # in process: the front's default app key
        low_results = await _flood_then_high(rt, "whole-runs", me, low, high, stop_after=4)
    records = device.gate.finished_jobs()
    stats = device.gate.statistics()
    highs = [r for r in records if r.priority == HIGH]
    lows = [r for r in records if r.priority == LOW]
    assert len(highs) == 4 and lows
    assert stats.of(me, LOW).preempted == 0            # never stopped mid-run
    # One step per run: the whole time it held the slot (its run time plus
    # waking its thread, which the scheduler does not count as run time).
    assert all(r.preemptions == 0 and r.ran <= r.longest_step
               and r.longest_step == pytest.approx(r.finished_at - r.started_at) for r in lows)
    # A HIGH waits at most one whole LOW run: the time that run held the
    # slot, waking its thread included (its ``ran`` leaves that out, and a
    # loaded machine makes the difference larger than a HIGH's wait).
    longest_low_hold = max(r.longest_step for r in lows)
    for h in highs:
        assert h.status == ErrorStatus.NONE and h.wait <= longest_low_hold, \
            (h.wait, longest_low_hold)
    assert all(np.array_equal(out, np.full(DIMS, 30.0, np.float32)) for out in low_results)
