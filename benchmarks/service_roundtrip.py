"""Round trip of a tiny model (ADD of two 1x4 float32) through ``execute``
on an out-of-process driver service against the same on the in-process
reference device: the cost of the socket path, measured in one run.

Three paths, each timed sequentially (one execution in flight):

* ``in-process``   the reference device's ``await execute`` (the baseline)
* ``service/numpy``  the client proxy with numpy pools (staged into the
  reusable shared-memory arena, outputs copied back)
* ``service/Memory`` the client proxy with one ``nnrt.memory.Memory`` pool
  (passed by fd once, by id afterwards: zero copy)

It prints median and p99 per path in microseconds and each service path's
median ratio to the baseline.

    .venv/bin/python benchmarks/service_roundtrip.py [--runs N] [--uvloop]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import nnrt
from nnrt import OperandType as T, OperationType as Op
from nnrt.hal import ErrorStatus, Request, RequestArgument
from nnrt.drivers.reference import ReferenceDevice
from nnrt.service.client import ServiceDevice
from nnrt.memory import Memory
from nnrt.model.graph import DataLocation


def add_model():
    m = nnrt.Model()
    a = m.add_operand(T.TENSOR_FLOAT32, [1, 4])
    b = m.add_operand(T.TENSOR_FLOAT32, [1, 4])
    act = m.add_operand(T.INT32)
    m.set_operand_value(act, 0)
    out = m.add_operand(T.TENSOR_FLOAT32, [1, 4])
    m.add_operation(Op.ADD, [a, b, act], [out])
    m.identify_inputs_and_outputs([a, b], [out])
    return m.finish().hal_model


def loc(pool, offset=0):
    return RequestArgument(False, DataLocation(pool, offset, 16), ())


async def timed(prepared, request, runs):
    for _ in range(max(runs // 10, 20)):  # warm up (and fill the pool caches)
        await prepared.execute(request)
    samples = []
    for _ in range(runs):
        start = time.perf_counter_ns()
        result = await prepared.execute(request)
        samples.append((time.perf_counter_ns() - start) / 1000)
        assert result.status == ErrorStatus.NONE, result.message
    samples.sort()
    return statistics.median(samples), samples[min(len(samples) - 1, int(0.99 * len(samples)))]


async def main(runs: int) -> None:
    model = add_model()
    x = np.arange(4, dtype=np.float32)
    y = np.ones(4, np.float32)
    out = np.zeros(4, np.float32)
    numpy_request = Request((loc(0), loc(1)), (loc(2),),
                            (x.view(np.uint8), y.view(np.uint8), out.view(np.uint8)))
    mem = Memory.create(48)
    mem.array(np.float32, 4)[:] = x
    mem.array(np.float32, 4, 16)[:] = y
    memory_request = Request((loc(0, 0), loc(0, 16)), (loc(0, 32),), (mem,))

    local = await ReferenceDevice().prepare_model(model)
    rows = [("in-process", *await timed(local, numpy_request, runs))]

    with tempfile.TemporaryDirectory() as folder:
        path = str(Path(folder) / "bench.sock")
        proc = subprocess.Popen([sys.executable, "-m", "nnrt", "driver", "serve", "bench",
                                 "--socket", path], stdout=subprocess.PIPE)
        try:
            proc.stdout.readline()
            device = await ServiceDevice.connect(path)
            prepared = await device.prepare_model(model)
            rows.append(("service/numpy", *await timed(prepared, numpy_request, runs)))
            rows.append(("service/Memory", *await timed(prepared, memory_request, runs)))
            assert mem.array(np.float32, 4, 32).tolist() == (x + y).tolist()
            device.close()
        finally:
            proc.terminate()
            proc.wait()
    base = rows[0][1]
    print(f"ADD 1x4 round trip through execute, {runs} runs each (microseconds)")
    print(f"{'path':<16}{'median':>10}{'p99':>10}{'ratio':>8}")
    for name, median, p99 in rows:
        print(f"{name:<16}{median:>10.1f}{p99:>10.1f}{median / base:>8.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--uvloop", action="store_true", help="run the client on uvloop")
    args = parser.parse_args()
    if args.uvloop:
        import uvloop
        uvloop.run(main(args.runs))
    else:
        asyncio.run(main(args.runs))
