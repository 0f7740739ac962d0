"""A camera frame through a remote burst (gRPC, issue 42) against a local
burst (Unix socket + shared-memory rings) and LiteRT direct.

    .venv/bin/python benchmarks/remote.py [--rounds 300] [--model NAME] [--host 127.0.0.2]

Two ``litert`` driver services, started for the run: one on a Unix socket
(spawned by the runtime), one on gRPC (``nnrt driver serve --listen
HOST:0 --insecure``, HOST a loopback address standing for another host).
In one process, alternating call by call in a shuffled order each round (so
machine load hits every way alike), 1 thread everywhere:

- ``litert direct``: LiteRT's Interpreter, set_tensor / invoke / get_tensor.
- ``local burst``: a reusable execution computed through ``compiled.burst()``
  on the Unix-socket service.
- ``remote burst``: the same on the gRPC service (one bidirectional stream;
  each frame carries the input's bytes, since a camera frame changes).

Each frame's input is a new random image (a camera's frames differ), the
same for every way in a round. Prints per way the median and p99 (ms); the
ratio of medians to LiteRT direct; and the transport cost of each burst
(frame time minus the driver's own ``in_driver`` time, per frame, median),
remote over local. Outputs are checked against LiteRT direct's once.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import subprocess
import sys
import time

import numpy as np

import nnrt
import nnrt.tflite
from models import MODELS, direct as litert_direct   # benchmarks/models.py

DEFAULT_MODEL = "generated/mobilenet_v2_1.0_224_int8"


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def start_remote(host: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "nnrt", "driver", "serve", "remote-litert",
                             "--driver", "litert", "--listen", f"{host}:0", "--insecure"],
                            stdout=subprocess.PIPE)
    line = proc.stdout.readline().decode()
    if "listening" not in line:
        proc.kill()
        sys.exit(f"the remote service did not start: {line!r}")
    return proc, line.split()[-1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=300, help="alternating rounds")
    ap.add_argument("--model", default=DEFAULT_MODEL,
                    help="a shared model under ../shared/models (without .tflite)")
    ap.add_argument("--host", default="127.0.0.2", help="the loopback address of the 'remote' host")
    args = ap.parse_args(argv)
    path = MODELS / f"{args.model}.tflite"
    if not path.exists():
        ap.error(f"{path} is not there")
    server, target = start_remote(args.host)
    loop = asyncio.new_event_loop()
    rt = nnrt.Runtime(spawn=[("local-litert", "litert")], remote=[target], discover=False)
    try:
        loop.run_until_complete(rt.__aenter__())
        times, transport = loop.run_until_complete(bench(rt, path, args.model, args.rounds))
        report(args.model, args.rounds, times, transport)
    finally:
        loop.run_until_complete(rt.__aexit__(None, None, None))
        loop.close()
        server.send_signal(signal.SIGTERM)
        server.wait(10)
    return 0


async def bench(rt, path, name, rounds):
    model = nnrt.tflite.load(str(path))
    x = np.load(MODELS / f"{name}.in0.npy")
    rng = np.random.default_rng(0)
    info = np.iinfo(x.dtype) if x.dtype.kind in "iu" else None

    def new_frame() -> np.ndarray:
        if info is not None:
            return rng.integers(info.min, info.max, x.shape, dtype=x.dtype, endpoint=True)
        return rng.random(x.shape, dtype=np.float32).astype(x.dtype)

    frame = x.copy()                      # every way reads its input from here
    direct = litert_direct(path, [frame])
    want = direct()
    ways = {}
    bursts = []
    for way, device in (("local burst", "local-litert"), ("remote burst", "remote-litert")):
        compiled = await rt.compile(model, devices=[device])
        burst = await compiled.burst().__aenter__()
        bursts.append(burst)
        execution = compiled.create_execution([frame], measure_timing=True)
        ways[way] = (burst, execution)
    for way, (burst, execution) in ways.items():
        got = (await burst.compute(execution)).outputs
        for g, w in zip(got, want):
            if not np.array_equal(g, w):
                sys.exit(f"{way} gave outputs that differ from LiteRT direct's")

    async def timed(way):
        if way == "litert direct":
            start = time.perf_counter()
            direct()
            return time.perf_counter() - start, None
        burst, execution = ways[way]
        start = time.perf_counter()
        result = await burst.compute(execution)
        took = time.perf_counter() - start
        in_driver = result.timing.in_driver if result.timing else None
        return took, (None if in_driver is None else took - in_driver / 1e6)

    names = ["litert direct", *ways]
    for _ in range(max(10, rounds // 10)):       # warm-up, not recorded
        frame[:] = new_frame()
        for way in names:
            await timed(way)
    times = {way: [] for way in names}
    transport = {way: [] for way in ways}
    shuffle = random.Random(0).shuffle
    for _ in range(rounds):
        frame[:] = new_frame()
        order = list(names)
        shuffle(order)
        for way in order:
            took, cost = await timed(way)
            times[way].append(took)
            if cost is not None:
                transport[way].append(cost)
    for burst in bursts:
        await burst.__aexit__(None, None, None)
    return times, transport


def report(name, rounds, times, transport) -> None:
    med = {way: statistics.median(v) for way, v in times.items()}
    base = med["litert direct"]
    print(f"{name}: {rounds} alternating rounds, a new input each round, 1 thread; "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"  {'way':<14} {'median ms':>10} {'p99 ms':>9} {'/ direct':>9} {'transport ms':>13}")
    for way, v in times.items():
        cost = f"{statistics.median(transport[way]) * 1e3:13.3f}" if transport.get(way) else ""
        print(f"  {way:<14} {med[way] * 1e3:10.3f} {_p99(v) * 1e3:9.3f} "
              f"{med[way] / base:8.2f}x {cost}")
    if transport["local burst"] and transport["remote burst"]:
        local, remote = (statistics.median(transport[w]) for w in ("local burst", "remote burst"))
        print(f"  transport cost, remote burst / local burst: {remote / local:.2f}x "
              f"(frame time minus in_driver time)")


if __name__ == "__main__":
    sys.exit(main())
