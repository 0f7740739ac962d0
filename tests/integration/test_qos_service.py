"""The scheduler inside a driver service, with real processes: two client
processes flooding one service share it, and a HIGH execution submitted
while LOW executions of the same app keep the service busy starts within one
LOW operation's time, by the service scheduler's own timestamps (read back
through the STATISTICS call)."""
import json
import os
import subprocess
import sys
import textwrap

import anyio
import numpy as np

import nnrt
from nnrt import ErrorStatus, Priority

from .test_qos_inprocess import DIMS, chain_model, endless_model, wait_until

FLOODER = textwrap.dedent("""
    import json, os, sys, threading, time, anyio, numpy as np, nnrt
    sys.path.insert(0, {root!r})
    from tests.integration.test_qos_inprocess import DIMS, chain_model
    async def main():
        async with nnrt.Runtime(discover=True) as rt:
            compiled = await rt.compile(chain_model({ops}), priority=nnrt.Priority.LOW,
                                        devices=["npu"])
            x = np.zeros(DIMS, np.float32)
            runs = 0
            end = time.monotonic() + {seconds}
            def stop_when_told():   # a line (or EOF) on stdin: the test has seen enough
                nonlocal end
                sys.stdin.readline()
                end = 0.0
            threading.Thread(target=stop_when_told, daemon=True).start()
            async def flood():
                nonlocal runs
                while time.monotonic() < end:
                    await compiled.execute([x])
                    runs += 1
            async with anyio.create_task_group() as tg:
                for _ in range({inflight}):
                    tg.start_soon(flood)
        print(json.dumps({{"pid": os.getpid(), "runs": runs}}))
    anyio.run(main)
""")


def _env(socket_path, tmp_path):
    return dict(os.environ, NNRT_DRIVERS=socket_path, XDG_CONFIG_HOME=str(tmp_path))


async def test_two_client_processes_flooding_one_service_share_it(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.delenv("NNRT_DRIVERS", raising=False)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    async with nnrt.Runtime(spawn=[("npu", "reference", "--app-key", "pid",
                                    "--statistics", "all")]) as rt:   # both apps' jobs
        npu = rt.device("npu")
        env = _env(npu.socket_path, tmp_path)
        # The first app keeps three executions in flight, the second two.
        # A fair scheduler splits the device evenly between apps that both
        # have work in it; when one has none (its client is between two
        # round trips, which a busy machine stretches) the device goes on
        # with the other. So the shares are read from the scheduler's own
        # records, over the time both apps had work queued or running.
        procs = [subprocess.Popen([sys.executable, "-c", FLOODER.format(
                     root=root, seconds=3.0, inflight=n, ops=30)], env=env,
                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                     text=True) for n in (3, 2)]
        # The service keeps its latest 256 records: read them as they come.
        seen = {}
        while any(p.poll() is None for p in procs):
            seen.update((r.seq, r) for r in await rt.finished_jobs("npu"))
            await anyio.sleep(0.1)
        seen.update((r.seq, r) for r in await rt.finished_jobs("npu"))
        reports = [json.loads(p.communicate(timeout=60)[0].strip().splitlines()[-1])
                   for p in procs]
        assert all(p.returncode == 0 for p in procs)
    apps = [("pid", r["pid"]) for r in reports]
    times = _contended_run_time(sorted(seen.values(), key=lambda r: r.finished_at), apps)
    assert min(times) > 0.3, (times, reports)       # enough contended time to judge
    shares = [t / sum(times) for t in times]
    assert all(0.4 <= s <= 0.6 for s in shares), (shares, times, reports)


def _merge(intervals):
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _overlap(start, end, intervals) -> float:
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in intervals)


def _contended_run_time(records, apps) -> list[float]:
    """Each app's run time while every app of ``apps`` had work in the
    scheduler (a job submitted and not finished), from the scheduler's
    records. Only the time after the oldest record's finish is complete.""" 
    mine = [r for r in records if r.app in apps and r.started_at is not None]
    since = min(r.finished_at for r in mine)
    busy = {app: _merge((max(r.submitted_at, since), r.finished_at)
                        for r in mine if r.app == app and r.finished_at > since)
            for app in apps}
    both = busy[apps[0]]
    for app in apps[1:]:
        both = _merge((max(a, c), min(b, d)) for a, b in both for c, d in busy[app]
                      if min(b, d) > max(a, c))
    # A job preempted by another app spans more time than it ran: its run
    # time is spread evenly over its span (exact for jobs never preempted).
    return [sum(_overlap(max(r.started_at, since), r.finished_at, both)
                * (r.ran / (r.finished_at - r.started_at) if r.finished_at > r.started_at else 0.0)
                for r in mine if r.app == app) for app in apps]


async def test_high_starts_within_one_low_operation_in_a_service(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.delenv("NNRT_DRIVERS", raising=False)
    x = np.zeros(DIMS, np.float32)
    async with nnrt.Runtime(spawn=[("npu", "reference", "--app-key", "pid")]) as rt:
        low = await rt.compile(chain_model(30), priority=Priority.LOW, devices=["npu"])
        high = await rt.compile(chain_model(2, (16,)), priority=Priority.HIGH, devices=["npu"])
        me = ("pid", os.getpid())
        stop = anyio.Event()
        low_results = []

        async def flood():
            while not stop.is_set():
                low_results.append((await low.execute([x])).outputs[0])

        async def low_running():
            return (await rt.statistics("npu")).of(me, Priority.LOW).running == 1

        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(flood)
            for k in range(5):
                for _ in range(2000):
                    if await low_running():
                        break
                await anyio.sleep(0.002 * (k + 1))
                r = await high.execute([np.full(16, k, np.float32)])
                assert r.outputs[0].tolist() == [k + 2.0] * 16
            stop.set()
        records = await rt.finished_jobs("npu")
        stats = await rt.statistics("npu")
    highs = [r for r in records if r.app == me and r.priority == Priority.HIGH]
    lows = [r for r in records if r.app == me and r.priority == Priority.LOW]
    assert len(highs) == 5 and lows
    longest_low_op = max(r.longest_step for r in lows)
    for h in highs:
        assert h.status == ErrorStatus.NONE
        assert h.wait <= longest_low_op, (h.wait, longest_low_op)
    assert stats.of(me, Priority.LOW).preempted >= 1
    assert all(np.array_equal(out, np.full(DIMS, 30.0, np.float32)) for out in low_results)


async def test_cancelling_the_awaiting_task_cancels_the_execution_in_the_service(
        monkeypatch, tmp_path):
    """Issue 7 (4) across the socket: the client sends CANCEL and returns only
    once the service's driver has let go of the pools (the execution's own
    reply); the service frees the slot and keeps serving."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.delenv("NNRT_DRIVERS", raising=False)
    async with nnrt.Runtime(spawn=[("npu", "reference", "--app-key", "pid")]) as rt:
        me = ("pid", os.getpid())
        endless = await rt.compile(endless_model(), priority=Priority.LOW, devices=["npu"])
        quick = await rt.compile(chain_model(1, (4,)), priority=Priority.LOW, devices=["npu"])
        pool = nnrt.Memory.create(4, "endless-input")
        pool.array(np.float32, (1,))[:] = 1.0
        region = pool.region(0, 4)

        async def low():
            return (await rt.statistics("npu")).of(me, Priority.LOW)

        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: endless.execute([region], loop_timeout=10.0))
            for _ in range(5000):
                if (await low()).running == 1:
                    break
                await anyio.sleep(0.002)
            with anyio.move_on_after(0.05):          # this one waits in the queue
                await endless.execute([region], loop_timeout=10.0)
            tg.cancel_scope.cancel()                 # and this one runs its WHILE loop
        stats = await rt.statistics("npu")
        assert stats.busy == 0
        counts = stats.of(me, Priority.LOW)
        assert (counts.cancelled, counts.running, counts.queued) == (2, 0, 0)
        records = [r for r in await rt.finished_jobs("npu") if r.app == me]
        assert [r.status for r in records[-2:]] == [ErrorStatus.GENERAL_FAILURE] * 2
        assert all("cancelled" in r.message for r in records[-2:])
        # Stopped well before the 10 s loop timeout, and the pool is ours again.
        assert max(r.ran for r in records[-2:]) < 5.0
        pool.array(np.float32, (1,))[:] = 2.0
        r = await quick.execute([np.zeros(4, np.float32)])
        assert r.outputs[0].tolist() == [1.0] * 4
        pool.close()
