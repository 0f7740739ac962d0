"""The litert driver in a driver service process, behind the service's QoS
scheduler: a HIGH execution of a small model submitted while LOW MobileNet
executions of the same app flood the service starts within one LOW segment
(plus 2 ms), by the service scheduler's own timestamps; the LOW results are
still LiteRT's."""
import os

import anyio
import numpy as np
import pytest

pytest.importorskip("ai_edge_litert")

import nnrt  # noqa: E402
from nnrt import ErrorStatus, Priority  # noqa: E402
import nnrt.tflite  # noqa: E402

from .test_qos_inprocess import chain_model  # noqa: E402

async def test_high_waits_at_most_one_litert_segment_behind_a_low_mobilenet_flood(
        monkeypatch, tmp_path, shared_model):
    path, image, expected = shared_model("generated/mobilenet_v2_1.0_224_int8")
    expected = expected.astype(np.int32)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.delenv("NNRT_DRIVERS", raising=False)
    mobilenet = nnrt.tflite.load(path)
    # Segments of about 1 ms: MobileNet v2 (2-4 ms here) runs in several.
    async with nnrt.Runtime(spawn=[("cpu-fast", "litert", "--app-key", "pid",
                                    "--segment-ms", "1")], litert=False) as rt:
        low = await rt.compile(mobilenet, priority=Priority.LOW, devices=["cpu-fast"])
        high = await rt.compile(chain_model(2, (16,)), priority=Priority.HIGH,
                                devices=["cpu-fast"])
        me = ("pid", os.getpid())
        stop = anyio.Event()
        low_results = []

        async def flood():
            while not stop.is_set():
                low_results.append((await low.execute([image])).outputs[0])

        async def low_running():
            return (await rt.statistics("cpu-fast")).of(me, Priority.LOW).running == 1

        async with anyio.create_task_group() as tg:
            for _ in range(6):
                tg.start_soon(flood)
            for k in range(8):
                for _ in range(2000):
                    if await low_running():
                        break
                await anyio.sleep(0.001 * (k + 1))
                r = await high.execute([np.full(16, k, np.float32)])
                assert r.outputs[0].tolist() == [k + 2.0] * 16
            stop.set()
        records = await rt.finished_jobs("cpu-fast")
        stats = await rt.statistics("cpu-fast")
    highs = [r for r in records if r.app == me and r.priority == Priority.HIGH]
    lows = [r for r in records if r.app == me and r.priority == Priority.LOW]
    assert len(highs) == 8 and lows
    # A HIGH waits at most one step of the LOW it found running (slot time,
    # from the scheduler's records): a segment when that run began with
    # other jobs waiting -- the flood keeps several queued -- and the whole
    # run when it began with none (the driver then runs it uncut).
    for h in highs:
        assert h.status == ErrorStatus.NONE
        running = [r for r in lows if r.started_at is not None
                   and r.started_at <= h.submitted_at < r.finished_at]
        step = max((r.longest_step for r in running), default=0.0)
        assert h.wait <= step + 0.002, (h.wait, step)
    assert stats.of(me, Priority.LOW).preempted >= 1
    assert low_results
    for out in low_results:
        assert np.abs(out.astype(np.int32) - expected).max() <= 1
