"""How fast every pending call learns that its driver service died.

Each round starts a service (`nnrt driver serve`), leaves pending on it
executions (queued behind a long one), a burst execution and a fenced
execution whose input fence is never signalled (its result fence's waiter
and its callback), SIGKILLs the service, and measures, for each of them,
the time from the kill to its DEAD_OBJECT. Prints p50/p99/max over all of
them (issue 23's goal: p99 under 100 ms over at least 300 kills) and the
load average beside it.

    python benchmarks/dead_object.py --kills 300
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import anyio
import numpy as np

import nnrt
from nnrt import ErrorStatus, NnrtError, OperandType as T, OperationType as Op
from nnrt.service.client import ServiceDevice
from nnrt.fence.sync_fence import SyncFence
from nnrt.hal import Request, RequestArgument
from nnrt.memory import Memory
from nnrt.model.graph import DataLocation

N = 1 << 18          # floats per operand
OPS = 24             # operations of the chain: one execution takes a while


def chain_model():
    m = nnrt.Model()
    x = m.add_operand(T.TENSOR_FLOAT32, [N])
    one = m.add_operand(T.TENSOR_FLOAT32, [N])
    m.set_operand_value(one, np.ones(N, np.float32))
    act = m.add_operand(T.INT32)
    m.set_operand_value(act, 0)
    cur = x
    for _ in range(OPS):
        out = m.add_operand(T.TENSOR_FLOAT32, [N])
        m.add_operation(Op.ADD, [cur, one, act], [out])
        cur = out
    m.identify_inputs_and_outputs([x], [cur])
    return m.finish().hal_model


def request(mem: Memory) -> Request:
    return Request((RequestArgument(False, DataLocation(0, 0, 4 * N), (N,)),),
                   (RequestArgument(False, DataLocation(0, 4 * N, 4 * N)),), (mem,))


def start(path: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "nnrt", "driver", "serve", "victim",
                             "--socket", path, "--driver", "reference"], stdout=subprocess.PIPE)
    if b"listening" not in proc.stdout.readline():
        proc.kill()
        raise RuntimeError("the service did not start")
    return proc


async def one_round(path: str, model, latencies: dict[str, list[float]],
                    freeze: bool = False) -> None:
    """Start a service, leave calls of every kind pending on it, SIGKILL it,
    and add how long after the kill each learnt of it (DEAD_OBJECT) to
    ``latencies``. With ``freeze`` the service is SIGSTOPped before the
    executions and the burst frame are sent, so all of them are certainly
    pending when it dies (tests/integration/test_hostile_limits.py); without,
    they are sent to a running service, which may have answered some."""
    proc = start(path)
    try:
        dev = await ServiceDevice.connect(path)
        prepared = await dev.prepare_model(model)
        mems = [Memory.create(8 * N) for _ in range(5)]
        burst = await prepared.configure_burst()
        killed = None
        done: dict[str, list[float]] = {k: [] for k in latencies}

        def record(kind, ok):
            if killed is not None and ok:
                done[kind].append(time.monotonic() - killed)

        async def execute(mem):
            r = await prepared.execute(request(mem))
            record("execute", r.status == ErrorStatus.DEAD_OBJECT)

        async def burst_execute(mem):
            r = await burst.execute(request(mem))
            record("burst", r.status == ErrorStatus.DEAD_OBJECT)

        gate = SyncFence.create()
        async with anyio.create_task_group() as tg:
            fence, callback = await prepared.execute_fenced(tg, request(mems[4]), [gate])

            async def fence_waiter():
                try:
                    await fence.wait_signaled()
                    record("fence", False)
                except NnrtError as e:
                    record("fence", e.status == ErrorStatus.DEAD_OBJECT)

            async def callback_waiter():
                status, _, _ = await callback.wait_execution_info()
                record("fenced callback", status == ErrorStatus.DEAD_OBJECT)

            if freeze:
                os.kill(proc.pid, signal.SIGSTOP)
            for mem in mems[:3]:
                tg.start_soon(execute, mem)
            tg.start_soon(burst_execute, mems[3])
            tg.start_soon(fence_waiter)
            tg.start_soon(callback_waiter)
            await anyio.sleep(0.05)    # everything is pending on the service now
            killed = time.monotonic()
            os.kill(proc.pid, signal.SIGKILL)
        for kind, values in done.items():
            latencies[kind].extend(values)
        burst.close()
        fence.close()
        gate.close()
        for mem in mems:
            mem.close()
        dev.close()
    finally:
        proc.kill()
        proc.wait()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=300)
    args = ap.parse_args(argv)
    model = chain_model()
    latencies: dict[str, list[float]] = {"execute": [], "burst": [], "fence": [],
                                         "fenced callback": []}
    path = os.path.join(tempfile.mkdtemp(prefix="nnrt-dead-"), "victim.sock")
    load_before = os.getloadavg()
    for _ in range(args.kills):
        anyio.run(one_round, path, model, latencies)
    load_after = os.getloadavg()
    every = sorted(v for values in latencies.values() for v in values)
    print(f"{args.kills} kills, {len(every)} pending calls failed with DEAD_OBJECT "
          f"(load average {load_before[0]:.2f} before, {load_after[0]:.2f} after)")
    for kind, values in [*latencies.items(), ("all", every)]:
        if values:
            values = sorted(values)
            p99 = values[min(len(values) - 1, int(0.99 * len(values)))]
            print(f"  {kind:16s} n={len(values):5d}  p50 {statistics.median(values) * 1e3:7.2f} ms"
                  f"  p99 {p99 * 1e3:7.2f} ms  max {values[-1] * 1e3:7.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
