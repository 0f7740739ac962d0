"""A HIGH execution behind a LOW MobileNet flood on a litert driver service.

One app keeps three LOW executions of MobileNet v2 (1.0, 224, int8) in
flight on a ``litert`` service (``nnrt driver serve --driver litert``) while
it runs a small HIGH model (two ADDs on 16 floats) every few milliseconds.
Printed, for each segment budget: the LOW segments' longest step by the
service scheduler's own timestamps, and the HIGH executions' queue wait (the
scheduler's: submission to start) and end-to-end latency, p50 / p99 — with
the same HIGH run on an idle service as the baseline.

    .venv/bin/python benchmarks/litert_preemption.py [--runs N] [--segment-ms MS ...]
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import anyio
import numpy as np

import nnrt
from nnrt import Priority
import nnrt.tflite

MODEL = Path(__file__).resolve().parents[2] / "shared" / "models" / "generated" / \
    "mobilenet_v2_1.0_224_int8"


def small_model() -> nnrt.Model:
    m = nnrt.Model()
    x = m.add_operand(nnrt.OperandType.TENSOR_FLOAT32, [16])
    one = m.add_operand(nnrt.OperandType.TENSOR_FLOAT32, [1])
    m.set_operand_value(one, np.ones(1, np.float32))
    act = m.add_operand(nnrt.OperandType.INT32)
    m.set_operand_value(act, 0)
    cur = x
    for _ in range(2):
        out = m.add_operand(nnrt.OperandType.TENSOR_FLOAT32, [16])
        m.add_operation(nnrt.OperationType.ADD, [cur, one, act], [out])
        cur = out
    m.identify_inputs_and_outputs([x], [cur])
    return m.finish()


def pct(values, q) -> float:
    return float(np.percentile(np.asarray(values) * 1e3, q))


async def measure(segment_ms: float, runs: int) -> None:
    mobilenet = nnrt.tflite.load(f"{MODEL}.tflite")
    image = np.load(f"{MODEL}.in0.npy")
    x = np.zeros(16, np.float32)
    spec = ("cpu-fast", "litert", "--app-key", "pid", "--segment-ms", str(segment_ms))
    async with nnrt.Runtime(spawn=[spec], discover=False, litert=False) as rt:
        low = await rt.compile(mobilenet, priority=Priority.LOW, devices=["cpu-fast"])
        high = await rt.compile(small_model(), priority=Priority.HIGH, devices=["cpu-fast"])
        me = ("pid", os.getpid())
        idle = []
        for _ in range(runs):
            start = time.perf_counter()
            await high.execute([x])
            idle.append(time.perf_counter() - start)
        stop = anyio.Event()
        flooded = []

        async def flood():
            while not stop.is_set():
                await low.execute([image])

        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(flood)
            await anyio.sleep(0.05)
            for k in range(runs):
                await anyio.sleep(0.001 + 0.003 * (k % 3))
                start = time.perf_counter()
                await high.execute([x])
                flooded.append(time.perf_counter() - start)
            stop.set()
        records = await rt.finished_jobs("cpu-fast")
    highs = [r for r in records if r.app == me and r.priority == Priority.HIGH][-runs:]
    lows = [r for r in records if r.app == me and r.priority == Priority.LOW]
    waits = [r.wait for r in highs]
    print(f"| {segment_ms:g} | {max(r.longest_step for r in lows) * 1e3:.2f} "
          f"| {np.median([r.ran for r in lows]) * 1e3:.2f} "
          f"| {pct(waits, 50):.2f} / {pct(waits, 99):.2f} "
          f"| {pct(flooded, 50):.2f} / {pct(flooded, 99):.2f} "
          f"| {pct(idle, 50):.2f} / {pct(idle, 99):.2f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--segment-ms", type=float, nargs="+", default=[2.0, 1.0, 0.5])
    args = parser.parse_args()
    print(f"HIGH (2 ADDs) behind 3 LOW MobileNet v2 1.0 int8 in flight, litert service, "
          f"{args.runs} HIGH runs; ms")
    print("| segment budget | longest LOW step | LOW job median | HIGH wait p50 / p99 "
          "| HIGH end to end p50 / p99 | HIGH alone p50 / p99 |")
    print("|---:|---:|---:|---|---|---|")
    for ms in args.segment_ms:
        anyio.run(measure, ms, args.runs)


if __name__ == "__main__":
    main()
