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

Scale-out (``--pool``)::

    .venv/bin/python benchmarks/remote.py --pool [--rounds 5] [--streams 8] [--frames 10]

Two ``litert`` services, on 127.0.0.2 and 127.0.0.3, each pinned to a core
of its own with ``taskset`` (cores 0 and 1). ``--streams`` concurrent
streams (bursts of the model, a reusable execution each, each frame a new
input) run ``--frames`` frames each, over a pool of the two services
(``PoolDevice``: each burst bound to the member with the shortest expected
wait) and over the first service alone (its ``RemoteDevice``), alternating
configuration by configuration in one process for ``--rounds`` rounds.
Prints each configuration's median throughput (frames per second) and the
CPU this client process spent per frame (it is not pinned: on a 2-core
machine it shares the servers' cores), where the pool's bursts went, and
the ratio pool / one server.
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


def start_remote(host: str, name: str = "remote-litert",
                 core: int | None = None) -> tuple[subprocess.Popen, str]:
    pin = [] if core is None else ["taskset", "-c", str(core)]
    proc = subprocess.Popen([*pin, sys.executable, "-m", "nnrt", "driver", "serve", name,
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
    ap.add_argument("--pool", action="store_true",
                    help="scale-out instead: streams over a pool of two pinned services vs one")
    ap.add_argument("--streams", type=int, default=8, help="--pool: concurrent streams")
    ap.add_argument("--frames", type=int, default=10, help="--pool: frames per stream per round")
    args = ap.parse_args(argv)
    path = MODELS / f"{args.model}.tflite"
    if not path.exists():
        ap.error(f"{path} is not there")
    if args.pool:
        return pool_main(path, args)
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


def pool_main(path, args) -> int:
    from nnrt.service.remote.client import RemoteDevice
    from nnrt.service.remote.pool import PoolDevice

    servers = [start_remote(host, f"litert-{core}", core)
               for core, host in enumerate(("127.0.0.2", "127.0.0.3"))]
    targets = [target for _, target in servers]

    async def run() -> None:
        pool = await PoolDevice.connect("pool", targets)
        single = await RemoteDevice.connect(targets[0])
        async with nnrt.Runtime(devices=[pool, single]) as rt:
            rates, spread, client = await bench_pool(rt, path, args)
        print(f"{args.model}: {args.streams} streams x {args.frames} frames, "
              f"{args.rounds} alternating rounds; services pinned to cores 0 and 1; "
              f"load average {os.getloadavg()[0]:.2f}")
        for way, values in rates.items():
            print(f"  {way:<12} {statistics.median(values):8.1f} frames/s median "
                  f"(min {min(values):.1f}, max {max(values):.1f}); this client's CPU "
                  f"{client[way] * 1e3:.2f} ms per frame")
        print(f"  the pool's bursts per member: {spread}")
        ratio = statistics.median(rates["pool of 2"]) / statistics.median(rates["1 server"])
        print(f"  throughput, pool of 2 / 1 server: {ratio:.2f}x")

    try:
        asyncio.run(run())
    finally:
        for proc, _ in servers:
            proc.send_signal(signal.SIGTERM)
            proc.wait(10)
    return 0


async def bench_pool(rt, path, args):
    model = nnrt.tflite.load(str(path))
    x = np.load(MODELS / f"{args.model}.in0.npy")
    rng = np.random.default_rng(0)
    info = np.iinfo(x.dtype) if x.dtype.kind in "iu" else None
    want = litert_direct(path, [x])()
    # Camera frames: each differs from the one before (the burst sends its
    # bytes), made before the timing so the client's CPU goes to serving.
    frames = [rng.integers(info.min, info.max, x.shape, dtype=x.dtype, endpoint=True)
              if info is not None else rng.random(x.shape, dtype=np.float32).astype(x.dtype)
              for _ in range(args.frames + 1)]
    ways = {}
    for way, device in (("pool of 2", "pool"), ("1 server", "litert-0")):
        compiled = await rt.compile(model, devices=[device])
        # Warm the interpreters (their first runs are slow) before the
        # bursts are placed by the members' service times.
        for _ in range(4):
            await asyncio.gather(*(compiled.execute([x]) for _ in range(args.streams)))
        streams = []
        for _ in range(args.streams):
            frame = x.copy()
            burst = await compiled.burst().__aenter__()
            execution = compiled.create_execution([frame])
            got = (await burst.compute(execution)).outputs
            if not all(np.array_equal(g, w) for g, w in zip(got, want)):
                sys.exit(f"{way} gave outputs that differ from LiteRT direct's")
            streams.append((frame, burst, execution))
        ways[way] = streams
    spread = {m.target: m.bursts for m in rt.device("pool").members()}

    async def stream(frame, burst, execution) -> None:
        for k in range(args.frames):
            frame[:] = frames[k]
            await burst.compute(execution)

    frames_per_round = args.streams * args.frames
    cpu = {way: 0.0 for way in ways}     # this process's CPU seconds (all its threads)

    async def timed(way) -> float:
        start, start_cpu = time.perf_counter(), time.process_time()
        await asyncio.gather(*(stream(*s) for s in ways[way]))
        cpu[way] += time.process_time() - start_cpu
        return frames_per_round / (time.perf_counter() - start)

    rates = {way: [] for way in ways}
    await timed("pool of 2")           # warm-up, not recorded
    await timed("1 server")
    cpu = dict.fromkeys(ways, 0.0)
    for k in range(args.rounds):
        for way in (list(ways) if k % 2 == 0 else list(ways)[::-1]):
            rates[way].append(await timed(way))
    client = {way: seconds / (args.rounds * frames_per_round) for way, seconds in cpu.items()}
    for streams in ways.values():
        for _, burst, _ in streams:
            await burst.__aexit__(None, None, None)
    return rates, spread, client


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
