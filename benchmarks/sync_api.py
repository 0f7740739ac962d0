"""Per-call cost of the synchronous API against awaited ``compiled.execute``.

    .venv/bin/python benchmarks/sync_api.py [--n 1000]

Compiles one small model (ADD of two [1, 4] tensors on the reference CPU
device) once per API and runs it N times each way per round, interleaved in
chunks of 100 so machine load hits both alike; prints the per-call median
over the chunks and the ratio (the goal: SyncCompiledModel.execute <= 1.2x awaited execute).
Also runs the sync loop from a thread while another event loop runs in the
main thread, as in a notebook.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time

import numpy as np

import nnrt
from nnrt import OperandType as T, OperationType as Op


def add_model() -> nnrt.Model:
    m = nnrt.Model()
    a = m.add_operand(T.TENSOR_FLOAT32, [1, 4])
    b = m.add_operand(T.TENSOR_FLOAT32, [1, 4])
    act = m.add_operand(T.INT32)
    m.set_operand_value(act, 0)
    out = m.add_operand(T.TENSOR_FLOAT32, [1, 4])
    m.add_operation(Op.ADD, [a, b, act], [out])
    m.identify_inputs_and_outputs([a, b], [out])
    return m.finish()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=1000, help="executions per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--uvloop", action="store_true",
                        help="run the awaited baseline on uvloop")
    args = parser.parse_args()
    model, x = add_model(), np.ones((1, 4), np.float32)

    # The loop asyncio.run / anyio.run give an app (SyncRuntime's kind too);
    # --uvloop measures against an app on uvloop instead.
    if args.uvloop:
        import uvloop
        loop = uvloop.new_event_loop()
    else:
        loop = asyncio.new_event_loop()
    rt_async = nnrt.Runtime()
    loop.run_until_complete(rt_async.__aenter__())
    compiled_async = loop.run_until_complete(rt_async.compile(model))

    async def awaited(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            await compiled_async.execute([x, x])
        return (time.perf_counter() - start) / n

    rt_sync = nnrt.SyncRuntime()
    compiled_sync = rt_sync.compile(model)
    rt_thread = nnrt.SyncRuntime(loop_thread=True)
    compiled_thread = rt_thread.compile(model)

    def sync(n: int, compiled=compiled_sync) -> float:
        start = time.perf_counter()
        for _ in range(n):
            compiled.execute([x, x])
        return (time.perf_counter() - start) / n

    loop.run_until_complete(awaited(50))
    sync(50)
    # Each round runs N executions each way in interleaved chunks, so a burst
    # of load from other processes hits both ways alike; the per-call cost is
    # the median over chunks.
    chunk = min(100, args.n)
    a_times, s_times, t_times = [], [], []
    for _ in range(args.rounds):
        for _ in range(args.n // chunk):
            a_times.append(loop.run_until_complete(awaited(chunk)))
            s_times.append(sync(chunk))
            t_times.append(sync(chunk, compiled_thread))
    a, s, t = (statistics.median(v) for v in (a_times, s_times, t_times))

    # From a thread while another event loop runs (a notebook's situation).
    other = asyncio.new_event_loop()
    stop = threading.Event()
    busy = threading.Thread(target=lambda: other.run_until_complete(_spin(stop)))
    busy.start()
    threaded = []
    worker = threading.Thread(target=lambda: threaded.append(sync(args.n)))
    worker.start()
    worker.join()
    stop.set()
    busy.join()

    rt_sync.close()
    rt_thread.close()
    loop.run_until_complete(rt_async.__aexit__(None, None, None))
    print(f"{args.n} executions x {args.rounds} rounds each way, interleaved in chunks of "
          f"{chunk} (median per call over chunks)")
    print(f"awaited compiled.execute      : {a * 1e6:8.1f} us")
    print(f"SyncCompiledModel.execute     : {s * 1e6:8.1f} us")
    print(f"  from a thread, other loop up: {threaded[0] * 1e6:8.1f} us")
    print(f"  SyncRuntime(loop_thread=True): {t * 1e6:7.1f} us ({t / a:.2f}x)")
    print(f"ratio sync / awaited          : {s / a:.2f}x (goal <= 1.20x)")


async def _spin(stop: threading.Event) -> None:
    while not stop.is_set():
        await asyncio.sleep(0.001)


if __name__ == "__main__":
    main()
