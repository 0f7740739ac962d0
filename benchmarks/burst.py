"""The per-frame hot path (issues 8 and 16): every way of running the same
tiny request, with the floors beside it, measured in one run in interleaved
batches, under each event loop.

(a) ADD of two 1x4 float tensors, per path: p50 and p99, and the p50 as a
    ratio to the *eventfd floor* (a Python eventfd ping-pong between two
    processes, blocking reads: the least any cross-process hand-off costs
    from Python) and to the *driver alone* (the reference driver's bound
    execution, ``create_execution`` once then ``execute_synchronously``, in
    process: the work every path pays). Paths: the driver alone; ``await compiled.execute`` in
    process on that driver (the runtime and the QoS front); ``execute`` on
    a driver service over the socket (HAL and ``compiled.execute``); a burst to the
    service (HAL session with numpy pools and with a Memory pool, and
    ``compiled.burst()``; bound executions, and one-shot frames); and the eventfd ping-pong with the app awaiting
    its eventfd on the event loop (the floor an async app can reach).
    Goals (issue 16): driver alone <= 15 us; in-process compiled.execute
    <= driver alone + 25 us; burst (HAL, numpy pools, default asyncio loop)
    <= 2.5x the eventfd floor and >= 3x faster than execute over the socket.
    The burst's ratio is also printed against the awaited floor (the ~47 us
    the issue quoted as "the floor" was that one).
(b) where one burst frame's time goes: timestamps at each hand-off, in the
    app and in the service (a traced service: same code, with timestamps
    recorded around the burst server's waits, its decode, the QoS front, the
    driver and the result write), medians over the traced frames.
(c) a 1x224x224x3 float input (x + x) through a burst with input and output
    in a Memory (zero copy) against the same as numpy arrays (copied).
(d) where one ``execute`` over the socket goes, from nnrt's own trace
    (``NNRT_TRACE``: the app's and the service's trace points on one
    CLOCK_MONOTONIC timeline), back to back and paced at 30 fps (a camera
    loop: every thread on the path has gone idle between two frames).

    .venv/bin/python benchmarks/burst.py [--rounds 2000] [--batches 5]
        [--loops asyncio,uvloop,trio] [--no-frame]

Each loop runs in its own process-wide pass with a service of its own
(``python -m nnrt driver serve``, uvloop when installed; the burst's serving
thread does not use the service's loop).
"""
from __future__ import annotations

import argparse
import bisect
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import anyio  # noqa: E402
import numpy as np  # noqa: E402

import nnrt  # noqa: E402
from nnrt import OperandType as T, OperationType as Op  # noqa: E402
from nnrt.hal import Request, RequestArgument  # noqa: E402
from nnrt.drivers.reference import ReferenceDevice  # noqa: E402
from nnrt.service.client import ServiceDevice  # noqa: E402
from nnrt.memory import Memory  # noqa: E402
from nnrt.model.graph import DataLocation  # noqa: E402


def add_model(dims, self_add=False):
    m = nnrt.Model()
    a = m.add_operand(T.TENSOR_FLOAT32, list(dims))
    b = a if self_add else m.add_operand(T.TENSOR_FLOAT32, list(dims))
    act = m.add_operand(T.INT32)
    m.set_operand_value(act, 0)
    out = m.add_operand(T.TENSOR_FLOAT32, list(dims))
    m.add_operation(Op.ADD, [a, b, act], [out])
    m.identify_inputs_and_outputs([a] if self_add else [a, b], [out])
    return m.finish().hal_model


def numpy_request(inputs, outputs):
    pools = [a.reshape(-1).view(np.uint8) for a in (*inputs, *outputs)]
    args = [RequestArgument(False, DataLocation(k, 0, a.nbytes),
                            tuple(a.shape) if k < len(inputs) else ())
            for k, a in enumerate((*inputs, *outputs))]
    return Request(tuple(args[:len(inputs)]), tuple(args[len(inputs):]), tuple(pools))


def memory_request(mem: Memory, dims, n_inputs=1):
    size = 4 * int(np.prod(dims))
    ins = tuple(RequestArgument(False, DataLocation(0, 0, size), tuple(dims))
                for _ in range(n_inputs))
    return Request(ins, (RequestArgument(False, DataLocation(0, size, size)),), (mem,))


def start_service(path: str, trace: str | None = None) -> subprocess.Popen:
    """A driver service on ``path``; with ``trace`` (a file), the traced one
    of stage (b), which writes its hand-off timestamps there when its burst
    is released."""
    cmd = [sys.executable, "-m", "nnrt", "driver", "serve", "bench", "--socket", path,
           "--driver", "reference"]
    if trace is not None:
        cmd = [sys.executable, __file__, "--serve-traced", trace, "--", *cmd[3:]]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    ready, _, _ = select.select([proc.stdout], [], [], 30)
    if not ready or b"listening" not in proc.stdout.readline():
        proc.kill()
        raise SystemExit(f"the service did not start: {proc.stderr.read()!r}")
    return proc


# --- the floors -------------------------------------------------------------

_ECHO = """
import os, sys
a, b = int(sys.argv[1]), int(sys.argv[2])
while True:
    if os.eventfd_read(a) > 1:
        break
    os.eventfd_write(b, 1)
"""


class EventfdEcho:
    """A second process that answers each write of eventfd ``ping`` with a
    write of ``pong``: the floor of a cross-process hand-off from Python."""

    def __init__(self, awaited: bool = False):
        # The awaited variant's pong is non-blocking from the start (uvloop
        # makes any fd it watches non-blocking; the blocking floor needs its own).
        self.ping = os.eventfd(0, os.EFD_CLOEXEC)
        self.pong = os.eventfd(0, os.EFD_CLOEXEC | (os.EFD_NONBLOCK if awaited else 0))
        self.proc = subprocess.Popen([sys.executable, "-c", _ECHO, str(self.ping),
                                      str(self.pong)], pass_fds=(self.ping, self.pong))

    def blocking(self) -> None:
        os.eventfd_write(self.ping, 1)
        os.eventfd_read(self.pong)          # blocks in read(2): the floor

    async def awaited(self) -> None:
        os.eventfd_write(self.ping, 1)
        await anyio.wait_readable(self.pong)
        os.eventfd_read(self.pong)

    def close(self) -> None:
        os.eventfd_write(self.ping, 2)
        self.proc.wait(10)
        for fd in (self.ping, self.pong):
            os.close(fd)


class _Done:
    status = nnrt.ErrorStatus.NONE


DONE = _Done()


# --- measuring --------------------------------------------------------------

async def timed(run, rounds: int) -> list[float]:
    samples = []
    for _ in range(rounds):
        t = time.perf_counter()
        result = await run()
        samples.append(time.perf_counter() - t)
        status = getattr(result, "status", nnrt.ErrorStatus.NONE)
        if status != nnrt.ErrorStatus.NONE:
            raise SystemExit(f"an execution failed: {result}")
    return samples


async def measure(cases: dict, rounds: int, batches: int) -> dict[str, list[float]]:
    """Interleaved batches, so load changes hit every case alike."""
    samples = {name: [] for name in cases}
    for run in cases.values():        # warm up: slots mapped, arenas sized
        await timed(run, 50)
    for _ in range(batches):
        for name, run in cases.items():
            samples[name] += await timed(run, max(1, rounds // batches))
    return samples


def p(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(len(s) * q))] * 1e6


def report(title: str, samples: dict[str, list[float]], floor: str, driver: str
           ) -> dict[str, float]:
    p50s = {name: statistics.median(s) * 1e6 for name, s in samples.items()}
    print(f"\n{title}")
    print(f"{'path':52} {'p50 us':>8} {'p99 us':>8} {'/ floor':>8} {'/ driver':>9}")
    for name, s in samples.items():
        print(f"{name:52} {p50s[name]:8.1f} {p(s, 0.99):8.1f} "
              f"{p50s[name] / p50s[floor]:8.2f} {p50s[name] / p50s[driver]:9.2f}")
    return p50s


FLOOR = "eventfd ping-pong, 2 processes (the floor)"
AWAITED = "eventfd ping-pong, app awaits on the loop"
DRIVER = "driver alone (a bound execution's execute_synchronously)"
INPROC = "await compiled.execute, in process"
SOCKET_HAL = "execute over the socket (HAL, numpy pools)"
SOCKET = "await compiled.execute over the socket"
BURST = "burst to the service (HAL, numpy pools, bound)"
BURST_MEM = "burst to the service (HAL, Memory pool, bound)"
BURST_ONE_SHOT = "burst to the service (HAL, numpy pools, one-shot)"
BURST_COMPILED = "await burst.compute (compiled.burst(), bound)"


async def main(rounds: int, batches: int, loop: str, frame: bool, breakdown: bool) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "bench.sock")
        proc = start_service(path)
        echo, echo_awaited = EventfdEcho(), EventfdEcho(awaited=True)
        try:
            dev = await ServiceDevice.connect(path)
            dev2 = await ServiceDevice.connect(path)
            try:
                await bench(dev, dev2, echo, echo_awaited, rounds, batches, loop)
                if frame:
                    await bench_frame(dev, rounds, batches)
            finally:
                dev.close()
                dev2.close()
        finally:
            echo.close()
            echo_awaited.close()
            proc.terminate()
            proc.wait(10)
        if breakdown:
            await bench_breakdown(folder, max(200, rounds // 4))


def idle_cpus() -> str:
    """How this machine's idle CPUs wait, when the kernel says: it decides
    what waking a process on the other core costs. A virtual machine's
    guest whose idle vCPUs halt at once (haltpoll with
    ``guest_halt_poll_ns`` 0) is woken through its host; on the 2-vCPU VM
    nnrt was measured on, that made the eventfd floor, and a burst's
    hand-off back to the app, 90-320 us instead of about 10."""
    def read(path: str) -> str | None:
        try:
            return Path(path).read_text().strip()
        except OSError:
            return None
    driver = read("/sys/devices/system/cpu/cpuidle/current_driver")
    if driver is None:
        return "idle CPUs: not reported"
    poll = read("/sys/module/haltpoll/parameters/guest_halt_poll_ns")
    return f"idle CPUs: {driver}" + ("" if poll is None else f", guest_halt_poll_ns {poll}")


async def bench(dev, dev2, echo: EventfdEcho, echo_awaited: EventfdEcho, rounds: int, batches: int, loop: str) -> None:
    print(f"\n=== {loop}: {rounds} rounds per path in {batches} interleaved batches, "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}; {idle_cpus()}")
    tiny = add_model((1, 4))
    remote = await dev.prepare_model(tiny)
    local = await ReferenceDevice().prepare_model(tiny)
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    y = np.ones((1, 4), np.float32)
    out = np.zeros((1, 4), np.float32)
    request = numpy_request([x, y], [out])
    mem = Memory.create(64)
    mem.array(np.float32, 4)[:] = 1
    mem_request = memory_request(mem, (1, 4), 2)
    model = public_add_model()

    bound_locally = local.create_execution(request)   # bound once, as a frame loop would

    async def driver_alone():
        return bound_locally.execute_synchronously()

    async def floor():
        echo.blocking()
        return DONE

    async def awaited():
        await echo_awaited.awaited()
        return DONE

    # The in-process path runs on the reference driver, the driver of the
    # "driver alone" floor (the default placement would be LiteRT when
    # installed): the ratio is then the cost of the runtime and the QoS front.
    async with nnrt.Runtime(devices=[ReferenceDevice()], discover=False) as rt_local, \
            nnrt.Runtime(devices=[dev2], discover=False) as rt_remote:
        in_process = await rt_local.compile(model)
        over_socket = await rt_remote.compile(model)
        assert [d.name for d in over_socket.devices] == [dev2.name], over_socket.devices
        async with await remote.configure_burst() as burst, over_socket.burst() as cburst:
            bound, bound_mem = burst.create_execution(request), burst.create_execution(mem_request)
            execution = over_socket.create_execution([x, y])
            samples = await measure({
                FLOOR: floor,
                AWAITED: awaited,
                DRIVER: driver_alone,
                INPROC: lambda: in_process.execute([x, y]),
                SOCKET_HAL: lambda: remote.execute(request),
                SOCKET: lambda: over_socket.execute([x, y]),
                BURST: bound.execute,
                BURST_MEM: bound_mem.execute,
                BURST_ONE_SHOT: lambda: burst.execute(request),
                BURST_COMPILED: lambda: cburst.compute(execution),
            }, rounds, batches)
    mem.close()
    p50 = report(f"(a) ADD of two 1x4 tensors [{loop}]", samples, FLOOR, DRIVER)
    # This VM switches between a fast and a slow phase (the driver alone at
    # ~9 and ~15 us) within a run, and a gap over the driver grows with the
    # phase: the in-process batch beside each driver-alone batch (a few ms
    # apart) shows the gap within one phase; the goal line below takes the
    # whole run's medians, as the issue states it.
    n = max(1, rounds // batches)
    pairs = [(statistics.median(samples[DRIVER][k:k + n]) * 1e6,
              statistics.median(samples[INPROC][k:k + n]) * 1e6)
             for k in range(0, len(samples[DRIVER]), n)]
    print("in process - driver alone, batch by batch (driver alone): " + ", ".join(
        f"{i - d:+.1f} ({d:.1f})" for d, i in pairs))
    goals = [
        ("driver alone <= 15 us", p50[DRIVER] <= 15, f"{p50[DRIVER]:.1f} us"),
        ("in-process compiled.execute <= driver alone + 25 us",
         p50[INPROC] <= p50[DRIVER] + 25, f"driver alone + {p50[INPROC] - p50[DRIVER]:.1f} us"),
        ("burst <= 2.5x the eventfd floor", p50[BURST] <= 2.5 * p50[FLOOR],
         f"{p50[BURST] / p50[FLOOR]:.2f}x"),
        # The same goal against the awaited floor (the app awaiting its
        # eventfd on the loop, as a burst's app does), printed beside it:
        # issue 16 quoted a floor of ~47 us, which is this one, not the
        # blocking ping-pong above.
        ("burst <= 2.5x the awaited eventfd floor", p50[BURST] <= 2.5 * p50[AWAITED],
         f"{p50[BURST] / p50[AWAITED]:.2f}x"),
        ("burst >= 3x faster than execute over the socket", p50[SOCKET_HAL] >= 3 * p50[BURST],
         f"{p50[SOCKET_HAL] / p50[BURST]:.2f}x (compiled: "
         f"{p50[SOCKET] / p50[BURST_COMPILED]:.2f}x)"),
    ]
    for what, met, value in goals:
        print(f"goal [{loop}]: {what}: {value} ({'met' if met else 'not met'})")


def public_add_model():
    m = nnrt.Model()
    a = m.add_operand(T.TENSOR_FLOAT32, [1, 4])
    b = m.add_operand(T.TENSOR_FLOAT32, [1, 4])
    act = m.add_operand(T.INT32)
    m.set_operand_value(act, 0)
    out = m.add_operand(T.TENSOR_FLOAT32, [1, 4])
    m.add_operation(Op.ADD, [a, b, act], [out])
    m.identify_inputs_and_outputs([a, b], [out])
    return m.finish()


async def bench_frame(dev, rounds: int, batches: int) -> None:
    dims = (1, 224, 224, 3)
    frame_model = await dev.prepare_model(add_model(dims, self_add=True))
    frame = np.random.default_rng(0).standard_normal(dims).astype(np.float32)
    frame_out = np.zeros(dims, np.float32)
    big = Memory.create(2 * frame.nbytes)
    big.array(np.float32, dims)[:] = frame
    async with await frame_model.configure_burst() as burst:
        samples = await measure({
            "burst, input and output in a Memory": lambda: burst.execute(
                memory_request(big, dims)),
            "burst, numpy arrays (copied in and out)": lambda: burst.execute(
                numpy_request([frame], [frame_out])),
        }, max(50, rounds // 10), batches)
    print(f"\n(c) x + x of a 1x224x224x3 float frame ({frame.nbytes} bytes in, as many out)")
    p50 = {}
    for name, s in samples.items():
        p50[name] = statistics.median(s) * 1e6
        print(f"{name:52} {p50[name]:8.1f} {p(s, 0.99):8.1f}")
    a, b = p50["burst, input and output in a Memory"], p50["burst, numpy arrays (copied in and out)"]
    print(f"zero copy saves {b - a:.0f} us per frame ({b / a:.2f}x)")
    np.testing.assert_array_equal(frame_out, frame + frame)
    np.testing.assert_array_equal(big.array(np.float32, dims, frame.nbytes), frame + frame)
    big.close()


# --- (b) the per-stage breakdown ------------------------------------------------

# (label, from stamp, to stamp); app stamps are taken in this process, the
# others in the traced service (CLOCK_MONOTONIC is one clock for both). A
# hand-off is timed from just before the ring write to the peer's wake-up:
# the eventfd write that wakes the peer may also preempt the writer (the
# woken process can take its core), so a stamp taken after the write says
# when the writer ran again, not when the frame arrived.
STAGES = [
    ("app: copy the inputs in, encode the run frame", "app_start", "app_encoded"),
    ("hand-off app -> service: publish, signal, thread wakes + reads", "app_encoded",
     "srv_woke"),
    ("service: decode the frame", "srv_woke", "srv_decoded"),
    ("service: find the layout, call the front", "srv_decoded", "front_in"),
    ("QoS front: submit + claim (gate lock)", "front_in", "driver_in"),
    ("driver: run the bound request, write outputs", "driver_in", "driver_out"),
    ("QoS front: finish (gate lock)", "driver_out", "front_out"),
    ("service: encode the result", "front_out", "srv_encoded"),
    ("hand-off service -> app: publish, signal, loop wakes", "srv_encoded", "app_read"),
    ("app: decode, copy outputs back, return", "app_read", "app_end"),
]


def install_service_trace(trace_path: str) -> None:
    """Wrap the burst server's hand-offs with timestamps (the traced service
    of stage (b)); written to ``trace_path`` when the burst is released."""
    import json

    from nnrt.burst import server as burst_server, wire
    from nnrt.drivers import reference
    from nnrt.fmq import Ring
    from nnrt.qos import front, gate

    frames: list[dict] = []
    now = time.perf_counter_ns

    def wrap(cls, name, before=None, after=None, accumulate=None):
        original = getattr(cls, name)

        def traced(*args, **kwargs):
            if before:
                frames[-1][before] = now() if frames else None
            t = now()
            try:
                return original(*args, **kwargs)
            finally:
                if accumulate and frames:
                    f = frames[-1]
                    f[accumulate] = f.get(accumulate, 0) + now() - t
                if after and frames:
                    frames[-1][after] = now()
        setattr(cls, name, traced)

    original_read_or = Ring.read_or

    def read_or(self, *args, **kwargs):
        frame = original_read_or(self, *args, **kwargs)
        if frame is not None:       # not the stop eventfd: a frame to serve
            frames.append({"srv_woke": now()})
        return frame
    Ring.read_or = read_or
    wrap(burst_server, "decode_frame", after="srv_decoded")
    wrap(front.ScheduledExecution, "execute_synchronously", before="front_in",
         after="front_out")
    wrap(reference.ReferenceExecution, "execute_synchronously", before="driver_in",
         after="driver_out")
    wrap(gate.ExecutionGate, "checkpoint", accumulate="gate_checkpoints")
    wrap(Ring, "write_nowait", before="srv_encoded")
    original_close = burst_server.BurstServer.close

    def close(self):
        original_close(self)
        with open(trace_path, "w") as f:
            json.dump(frames, f)
    burst_server.BurstServer.close = close


async def bench_breakdown(folder: str, frames: int) -> None:
    import json

    path = os.path.join(folder, "traced.sock")
    trace_path = os.path.join(folder, "trace.json")
    proc = start_service(path, trace=trace_path)
    try:
        dev = await ServiceDevice.connect(path)
        try:
            remote = await dev.prepare_model(add_model((1, 4)))
            x = np.arange(4, dtype=np.float32).reshape(1, 4)
            y = np.ones((1, 4), np.float32)
            out = np.zeros((1, 4), np.float32)
            request = numpy_request([x, y], [out])
            app: list[dict] = []
            now = time.perf_counter_ns
            async with await remote.configure_burst() as burst:
                bound = burst.create_execution(request)   # its frames: run frames
                for _ in range(50):
                    await bound.execute()
                requests, results = burst._requests, burst._results
                write, read = requests.write_nowait, results.read_nowait

                def traced_write(frame):
                    app[-1]["app_encoded"] = now()
                    write(frame)

                def traced_read():
                    frame = read()
                    app[-1]["app_read"] = now()
                    return frame
                requests.write_nowait, results.read_nowait = traced_write, traced_read
                for _ in range(frames):
                    app.append({"app_start": now()})
                    await bound.execute()
                    app[-1]["app_end"] = now()
            await wait_for_file(trace_path)
        finally:
            dev.close()
    finally:
        proc.terminate()
        proc.wait(10)
    with open(trace_path) as f:
        service = json.load(f)[-frames:]
    rows = [{**a, **s} for a, s in zip(app, service)]
    rows = [r for r in rows if all(r.get(k) for _, a, b in STAGES for k in (a, b))]
    print(f"\n(b) one burst frame, stage by stage: medians of {len(rows)} traced frames "
          f"(ADD 1x4, numpy pools), load average {os.getloadavg()[0]:.2f}")
    print(f"{'stage':62} {'p50 us':>8} {'share':>6}")
    total = statistics.median((r["app_end"] - r["app_start"]) / 1e3 for r in rows)
    for label, a, b in STAGES:
        d = statistics.median((r[b] - r[a]) / 1e3 for r in rows)
        print(f"{label:62} {d:8.1f} {d / total:6.0%}")
    gate_us = statistics.median(r.get("gate_checkpoints", 0) / 1e3 for r in rows)
    print(f"{'  of which in the gate checkpoint (in the driver)':62} {gate_us:8.1f}")
    print(f"{'whole frame (app: execute called -> returned)':62} {total:8.1f}")
    await driver_warm_and_cold()
    await bench_socket_breakdown(folder, frames)


# (label, the trace event that starts the stage, the one that ends it):
# "app start"/"app end" are the benchmark's own marks around the call.
SOCKET_STAGES = [
    ("app: stage pools in shared memory, encode the call", "app start", "client: send"),
    ("hand-off app -> service: socket, the service's loop wakes", "client: send",
     "service: readable"),
    ("service: read, decode, start the call's task", "service: readable",
     "service: handler starts"),
    ("service: request pools, QoS front: submit", "service: handler starts", "queue wait"),
    ("QoS front: queue wait, hand-off to a job thread", "queue wait", "scheduled run"),
    ("driver: validate, run, write outputs", "scheduled run", "scheduled run end"),
    ("finish, reply from the job thread, the app's reader wakes", "scheduled run end",
     "client: received"),
    ("app: decode, the app's loop wakes, copy outputs back", "client: received", "app end"),
]


async def bench_socket_breakdown(folder: str, frames: int) -> None:
    import json

    from nnrt import trace

    trace_path = os.path.join(folder, "socket-trace.json")
    path = os.path.join(folder, "socket-traced.sock")
    trace.start(trace_path)      # this process, and the service: it inherits NNRT_TRACE
    marks: dict[str, list[tuple[int, int]]] = {"back to back": [], "30 fps": []}
    try:
        proc = start_service(path)
        try:
            dev = await ServiceDevice.connect(path)
            try:
                remote = await dev.prepare_model(add_model((1, 4)))
                x = np.arange(4, dtype=np.float32).reshape(1, 4)
                request = numpy_request([x, x], [np.zeros((1, 4), np.float32)])
                for _ in range(50):
                    await remote.execute(request)
                for pace, n in (("back to back", frames), ("30 fps", 90)):
                    for _ in range(n):
                        t0 = time.monotonic_ns()
                        await remote.execute(request)
                        marks[pace].append((t0 // 1000, time.monotonic_ns() // 1000))
                        if pace == "30 fps":
                            await anyio.sleep(max(0.0, 1 / 30 - (time.monotonic_ns() - t0) / 1e9))
            finally:
                dev.close()
        finally:
            proc.terminate()     # its trace fragment is written as it exits
            proc.wait(10)
    finally:
        trace.stop()             # merges the fragments into trace_path
        os.environ.pop(trace.ENV, None)
        os.environ.pop(trace.OWNER_ENV, None)
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    starts: dict[str, list[float]] = {}
    for e in events:
        if e.get("ph") in ("i", "b", "X"):
            starts.setdefault(e["name"], []).append(e["ts"])
            if e["ph"] == "X":
                starts.setdefault(e["name"] + " end", []).append(e["ts"] + e["dur"])
    for times in starts.values():
        times.sort()

    def first(name, t0, t1):
        times = starts.get(name, [])
        k = bisect.bisect_left(times, t0)
        return times[k] if k < len(times) and times[k] <= t1 else None

    columns = {}
    for pace, spans in marks.items():
        rows = []
        for t0, t1 in spans:
            at = {"app start": t0, "app end": t1}
            for _, a, b in SOCKET_STAGES:
                for name in (a, b):
                    if name not in at:
                        at[name] = first(name, t0, t1)
            if all(v is not None for v in at.values()):
                rows.append(at)
        columns[pace] = rows
    print(f"\n(d) one execute over the socket (HAL, numpy pools, ADD 1x4), stage by stage: "
          f"medians of {len(columns['back to back'])} and {len(columns['30 fps'])} traced calls, "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"{'stage':62} {'back to back':>13} {'30 fps':>8}")
    for label, a, b in SOCKET_STAGES + [("whole call", "app start", "app end")]:
        cells = [statistics.median(r[b] - r[a] for r in rows) if rows else float("nan")
                 for rows in columns.values()]
        print(f"{label:62} {cells[0]:13.1f} {cells[1]:8.1f}")


async def driver_warm_and_cold(rounds: int = 2000) -> None:
    """The driver alone in a tight loop (the floor of the table) against the
    same call after its thread slept as long as a burst frame's (caches and
    clocks gone cold, as in the service's burst thread)."""
    local = await ReferenceDevice().prepare_model(add_model((1, 4)))
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    bound = local.create_execution(numpy_request([x, x], [np.zeros((1, 4), np.float32)]))
    for gap in (0.0, 200e-6):
        samples = []
        for _ in range(rounds):
            if gap:
                time.sleep(gap)
            t = time.perf_counter()
            bound.execute_synchronously()
            samples.append(time.perf_counter() - t)
        label = (f"driver alone, {gap * 1e6:.0f} us asleep between calls" if gap
                 else "driver alone, back to back")
        print(f"{label:62} {statistics.median(samples) * 1e6:8.1f}")


async def wait_for_file(path: str) -> None:
    for _ in range(500):
        if os.path.exists(path) and os.path.getsize(path):
            return
        await anyio.sleep(0.01)
    raise SystemExit("the traced service wrote no trace")


def run_loop(loop: str, args) -> None:
    backend, options = "asyncio", {}
    if loop == "uvloop":
        options = {"use_uvloop": True}
    elif loop == "trio":
        backend = "trio"
    anyio.run(main, args.rounds, args.batches, loop, args.frame, args.breakdown and
              loop == "asyncio", backend=backend, backend_options=options)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--serve-traced":
        install_service_trace(sys.argv[2])
        from nnrt.cli import main as cli_main
        sys.exit(cli_main(sys.argv[sys.argv.index("--") + 1:]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--batches", type=int, default=5)
    parser.add_argument("--loops", default="asyncio,uvloop,trio")
    parser.add_argument("--no-frame", dest="frame", action="store_false")
    parser.add_argument("--no-breakdown", dest="breakdown", action="store_false")
    args = parser.parse_args()
    for name in args.loops.split(","):
        run_loop(name, args)
