"""What keeping freed memory in the process (``nnrt/memory/heap.py``) is
worth: a chain of ``--ops`` ADD/MUL operations on a ``--size`` x ``--size``
float32 tensor through the reference device's ``execute_synchronously``,
on the main thread and on another thread, in two child processes: one with
glibc's default allocator settings (``NNRT_KEEP_FREED_MEMORY=0``, the
baseline) and one with nnrt's. Children alternate, ``--rounds`` times each,
so both see the same machine load; it prints the medians and the ratio.

    .venv/bin/python benchmarks/heap.py [--ops 30] [--size 512] [--runs 40] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(ops: int, size: int, runs: int) -> dict:
    import numpy as np

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from qos_priority import chain

    from nnrt.hal import Request, RequestArgument
    from nnrt.model.graph import DataLocation
    from nnrt.memory.heap import keep_freed_memory
    from nnrt.drivers.reference import ReferenceDevice

    import anyio
    prepared = anyio.run(ReferenceDevice().prepare_model, chain(ops, (size, size)).hal_model)
    x = np.ones((size, size), np.float32)
    out = bytearray(x.nbytes)
    request = Request((RequestArgument(False, DataLocation(0, 0, x.nbytes)),),
                      (RequestArgument(False, DataLocation(1, 0, x.nbytes)),),
                      (x.reshape(-1).view(np.uint8), out))

    def median_run() -> float:
        prepared.execute_synchronously(request)    # warm up
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            prepared.execute_synchronously(request)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    on_other = []
    worker = threading.Thread(target=lambda: on_other.append(median_run()))
    main = median_run()
    worker.start()
    worker.join()
    return {"applied": keep_freed_memory(), "main": main, "thread": on_other[0]}


def run_child(args, keep: bool) -> dict:
    env = dict(os.environ, NNRT_KEEP_FREED_MEMORY="1" if keep else "0")
    out = subprocess.run([sys.executable, __file__, "--child", "--ops", str(args.ops),
                          "--size", str(args.size), "--runs", str(args.runs)],
                         env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", type=int, default=30)
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--runs", type=int, default=40, help="executions per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="child processes per setting")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.ops, args.size, args.runs)))
        return
    results = {False: [], True: []}
    for _ in range(args.rounds):
        for keep in (False, True):
            results[keep].append(run_child(args, keep))
    if not all(r["applied"] for r in results[True]):
        print("nnrt's settings were not applied (no mallopt in this libc?)")
    ms = 1e3
    print(f"{args.ops}-operation chain on {args.size}x{args.size} float32, "
          f"median of {args.runs} runs x {args.rounds} processes (ms per execution)")
    print(f"{'thread':8s} {'glibc defaults':>15s} {'nnrt settings':>14s} {'speed-up':>9s}")
    for where in ("main", "thread"):
        base = statistics.median(r[where] for r in results[False]) * ms
        kept = statistics.median(r[where] for r in results[True]) * ms
        print(f"{where:8s} {base:15.2f} {kept:14.2f} {base / kept:8.2f}x")


if __name__ == "__main__":
    main()
