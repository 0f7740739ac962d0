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
- ``gRPC echo``: gRPC's own cost for the same bytes, nothing of nnrt: a
  bidirectional stream to a ``grpc.aio`` server (started for the run, on the
  same HOST) that answers each message of the input's size with one of the
  outputs' size after sleeping as long as the remote driver computes
  (its median ``in_driver`` time in the warm-up: so the threads on both
  sides idle and wake as the remote burst's do), from a client built
  as the remote burst's is (a sync channel with its options, frames through
  a queue, a reader thread handing each answer to the awaiting task). Its
  transport is its time minus that sleep.
- ``gRPC aio echo``: the same echo from a ``grpc.aio`` client on the
  benchmark's event loop (write, then read; no thread of ours): what a
  client without the threads would pay (asyncio only; the remote device
  serves trio apps too, hence its threads).

Each frame's input is a new random image (a camera's frames differ), the
same for every way in a round. Prints per way the median and p99 (ms); the
ratio of medians to LiteRT direct; and the transport cost of each burst
(frame time minus the driver's own ``in_driver`` time, per frame, median),
remote over local, and the remote burst's transport against gRPC echo:
what nnrt adds over gRPC itself. Outputs are checked against LiteRT direct's
once.

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
import queue
import random
import signal
import statistics
import subprocess
import sys
import threading
import time

import grpc
import numpy as np

import nnrt
import nnrt.tflite
from models import MODELS, direct as litert_direct   # benchmarks/models.py
from nnrt.handoff import Waiter
from nnrt.service.remote.client import KEEPALIVE, channel_options
from nnrt.service.remote.server import SERVER_OPTIONS

DEFAULT_MODEL = "generated/mobilenet_v2_1.0_224_int8"


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def start_remote(host: str, name: str = "remote-litert",
                 core: int | None = None) -> tuple[subprocess.Popen, str]:
    """A litert service listening on ``host``, pinned to ``core`` when given."""
    pin = [] if core is None else ["taskset", "-c", str(core)]
    proc, address = start([*pin, sys.executable, "-m", "nnrt", "driver", "serve", name,
                           "--driver", "litert", "--listen", f"{host}:0", "--insecure"])
    return proc, f"grpc://{address}"


_ECHO = "/nnrt.bench.Echo/Stream"


async def serve_echo(host: str, answer_bytes: int, delay: float) -> None:
    """The gRPC echo server (``--serve-echo``): each message in, one of
    ``answer_bytes`` out ``delay`` seconds later; prints its port, then
    serves until killed."""
    answer = bytes(answer_bytes)

    async def stream(messages, context):
        async for _ in messages:
            await asyncio.sleep(delay)
            yield answer
    server = grpc.aio.server(options=SERVER_OPTIONS)
    handler = grpc.stream_stream_rpc_method_handler(stream)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "nnrt.bench.Echo", {"Stream": handler}),))
    port = server.add_insecure_port(f"{host}:0")
    await server.start()
    print(f"listening on {host}:{port}", flush=True)
    await server.wait_for_termination()


class EchoStream:
    """The client side of gRPC echo, built as ``RemoteBurst`` is."""

    def __init__(self, target: str):
        self.target = target
        self.channel = grpc.insecure_channel(target, channel_options(KEEPALIVE))
        self.frames: queue.SimpleQueue = queue.SimpleQueue()
        self.waiters: queue.SimpleQueue = queue.SimpleQueue()
        self.call = self.channel.stream_stream(_ECHO)(iter(self.frames.get, None))
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for answer in self.call:
                self.waiters.get().deliver(answer)
        except grpc.RpcError:
            pass    # closed at the end of the run

    async def frame(self, data: bytes) -> bytes:
        waiter = Waiter()
        self.waiters.put(waiter)
        self.frames.put(data)
        return await waiter.wait()

    def close(self) -> None:
        self.frames.put(None)
        self.channel.close()


class AioEchoStream:
    """The client side of gRPC echo on grpc.aio (made on the running loop)."""

    def __init__(self, target: str):
        self.channel = grpc.aio.insecure_channel(target, options=channel_options(KEEPALIVE))
        self.call = self.channel.stream_stream(_ECHO)()

    async def frame(self, data: bytes) -> bytes:
        await self.call.write(data)
        return await self.call.read()

    async def close(self) -> None:
        await self.call.done_writing()
        await self.channel.close()


def start(argv: list[str]) -> tuple[subprocess.Popen, str]:
    """A server process that prints ``listening ... HOST:PORT`` first."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE)
    line = proc.stdout.readline().decode()
    if "listening" not in line:
        proc.kill()
        sys.exit(f"{argv} did not start: {line!r}")
    return proc, line.split()[-1].removeprefix("grpc://")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=300, help="alternating rounds")
    ap.add_argument("--model", default=DEFAULT_MODEL,
                    help="a shared model under ../shared/models (without .tflite)")
    ap.add_argument("--host", default="127.0.0.2", help="the loopback address of the 'remote' host")
    ap.add_argument("--serve-echo", type=int, metavar="ANSWER_BYTES", help=argparse.SUPPRESS)
    ap.add_argument("--echo-delay", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--pool", action="store_true",
                    help="scale-out instead: streams over a pool of two pinned services vs one")
    ap.add_argument("--streams", type=int, default=8, help="--pool: concurrent streams")
    ap.add_argument("--frames", type=int, default=10, help="--pool: frames per stream per round")
    args = ap.parse_args(argv)
    if args.serve_echo is not None:
        asyncio.run(serve_echo(args.host, args.serve_echo, args.echo_delay))
        return 0
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
        times, transport = loop.run_until_complete(bench(rt, path, args.model, args.rounds,
                                                         args.host))
        report(args.model, args.rounds, times, transport)
    finally:
        loop.run_until_complete(rt.__aexit__(None, None, None))
        loop.close()
        server.send_signal(signal.SIGTERM)
        server.wait(10)
    return 0


async def bench(rt, path, name, rounds, host: str):
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
    echoes = {}
    delay = 0.0       # the echo server's, set once the bursts are warm
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
        if way in echoes:
            start = time.perf_counter()
            await echoes[way].frame(frame.tobytes())     # the bytes the remote burst sends
            took = time.perf_counter() - start
            return took, took - delay
        burst, execution = ways[way]
        start = time.perf_counter()
        result = await burst.compute(execution)
        took = time.perf_counter() - start
        in_driver = result.timing.in_driver if result.timing else None
        return took, (None if in_driver is None else took - in_driver / 1e6)

    in_driver = []
    for _ in range(max(10, rounds // 10)):       # warm-up, not recorded
        frame[:] = new_frame()
        for way in ("litert direct", *ways):
            await timed(way)
        in_driver.append((await ways["remote burst"][0].compute(
            ways["remote burst"][1])).timing.in_driver / 1e6)
    # The echo answers after the remote driver's own time, so its threads
    # idle and wake as the service's and the remote burst's do.
    delay = statistics.median(in_driver)
    answer_bytes = sum(y.nbytes for y in want)
    echo_server, echo_target = start([sys.executable, __file__, "--host", host,
                                      "--serve-echo", str(answer_bytes),
                                      "--echo-delay", repr(delay)])
    try:
        echoes["gRPC echo"] = EchoStream(echo_target)
        echoes["gRPC aio echo"] = AioEchoStream(echo_target)
        for _ in range(10):
            for way in echoes:
                await timed(way)
        return await _rounds(timed, ["litert direct", *ways, *echoes], ways, echoes, rounds,
                             frame, new_frame, bursts)
    finally:
        if "gRPC aio echo" in echoes:
            await echoes["gRPC aio echo"].close()
        if "gRPC echo" in echoes:
            echoes["gRPC echo"].close()
        echo_server.send_signal(signal.SIGTERM)
        echo_server.wait(10)


async def _rounds(timed, names, ways, echoes, rounds, frame, new_frame, bursts):
    times = {way: [] for way in names}
    transport = {way: [] for way in (*ways, *echoes)}
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
    print(f"  {'way':<15} {'median ms':>10} {'p99 ms':>9} {'/ direct':>9} {'transport ms':>13}")
    for way, v in times.items():
        cost = f"{statistics.median(transport[way]) * 1e3:13.3f}" if transport.get(way) else ""
        print(f"  {way:<15} {med[way] * 1e3:10.3f} {_p99(v) * 1e3:9.3f} "
              f"{med[way] / base:8.2f}x {cost}")
    if transport["local burst"] and transport["remote burst"]:
        local, remote = (statistics.median(transport[w]) for w in ("local burst", "remote burst"))
        print(f"  transport cost, remote burst / local burst: {remote / local:.2f}x "
              f"(frame time minus in_driver time)")
        floor = statistics.median(transport["gRPC echo"])
        print(f"  gRPC echo of the same bytes: {floor / local:.2f}x the local burst's "
              f"transport; the remote burst's is {remote / floor:.2f}x gRPC echo's, "
              f"{(remote - floor) * 1e3:.3f} ms more")
        aio = statistics.median(transport["gRPC aio echo"])
        print(f"  gRPC aio echo (no client threads): {aio / local:.2f}x the local burst's "
              f"transport")


if __name__ == "__main__":
    sys.exit(main())
