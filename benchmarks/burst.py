"""Burst executions on an out-of-process driver service, against the other
ways of running the same request, all measured in one run in interleaved
batches (issue 8, benchmarks (b) and (c)):

(b) a tiny model (ADD of two 1x4 float tensors): ``burst.execute`` against
    ``prepared.execute`` over the socket on the same service, and against
    the in-process reference device (``execute``, and ``execute_synchronously``
    alone: the driver's own fixed cost, paid by every path). Goal: the burst
    round trip at least 3x faster than ``execute`` over the socket; also
    printed: the cost each path adds above the driver alone.
(c) a 1x224x224x3 float input (x + x into a same-sized output) through a
    burst with input and output in an nnrt Memory (zero copy) against the
    same as numpy arrays (copied into the controller's arena and back).

    .venv/bin/python benchmarks/burst.py [--rounds 2000] [--batches 5]

The service is started as ``python -m nnrt driver serve`` (uvloop when
installed); this client runs on uvloop too when it is installed.
"""
from __future__ import annotations

import argparse
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
from nnrt.drivers.service.client import ServiceDevice  # noqa: E402
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


def start_service(path: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "nnrt", "driver", "serve", "bench",
                             "--socket", path, "--driver", "reference"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    ready, _, _ = select.select([proc.stdout], [], [], 30)
    if not ready or b"listening" not in proc.stdout.readline():
        proc.kill()
        raise SystemExit(f"the service did not start: {proc.stderr.read()!r}")
    return proc


async def timed(run, rounds: int) -> list[float]:
    samples = []
    for _ in range(rounds):
        t = time.perf_counter()
        result = await run()
        samples.append(time.perf_counter() - t)
        if result.status != nnrt.ErrorStatus.NONE:
            raise SystemExit(f"an execution failed: {result}")
    return samples


async def measure(cases: dict, rounds: int, batches: int) -> dict[str, list[float]]:
    """Interleaved batches, so load changes hit every case alike."""
    samples = {name: [] for name in cases}
    for run in cases.values():        # warm up: slots mapped, arenas sized
        await timed(run, 20)
    for _ in range(batches):
        for name, run in cases.items():
            samples[name] += await timed(run, max(1, rounds // batches))
    return samples


def report(title: str, samples: dict[str, list[float]], baseline: str) -> dict[str, float]:
    p50s = {name: statistics.median(s) * 1e6 for name, s in samples.items()}
    print(f"\n{title}")
    print(f"{'path':44} {'p50 us':>9} {'p99 us':>9} {'p50 / ' + baseline:>24}")
    for name, s in samples.items():
        s = sorted(s)
        p99 = s[min(len(s) - 1, int(len(s) * 0.99))] * 1e6
        print(f"{name:44} {p50s[name]:9.1f} {p99:9.1f} {p50s[name] / p50s[baseline]:24.2f}")
    return p50s


async def main(rounds: int, batches: int) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "bench.sock")
        proc = start_service(path)
        try:
            dev = await ServiceDevice.connect(path)
            try:
                await bench(dev, rounds, batches)
            finally:
                dev.close()
        finally:
            proc.terminate()
            proc.wait(10)


async def bench(dev: ServiceDevice, rounds: int, batches: int) -> None:
    print(f"{rounds} rounds per path in {batches} interleaved batches, "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}")
    # (b) the tiny model
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
    async def driver_alone():
        return local.execute_synchronously(request)

    async with await remote.configure_burst() as burst:
        p50 = report("(b) ADD of two 1x4 tensors", await measure({
            "execute over the socket (numpy pools)": lambda: remote.execute(request),
            "burst (numpy pools, staged)": lambda: burst.execute(request),
            "burst (Memory pool, zero copy)": lambda: burst.execute(mem_request),
            "in-process reference device": lambda: local.execute(request),
            "driver alone (in-process, synchronous)": driver_alone,
        }, rounds, batches), "execute over the socket (numpy pools)")
    socket_p50 = p50["execute over the socket (numpy pools)"]
    ratio = socket_p50 / p50["burst (numpy pools, staged)"]
    print(f"goal: burst round trip >= 3x faster than execute over the socket: {ratio:.2f}x "
          f"({'met' if ratio >= 3 else 'not met'}); with a Memory pool "
          f"{socket_p50 / p50['burst (Memory pool, zero copy)']:.2f}x")
    # What each path adds to the driver's own work (validation, scheduler,
    # kernel), which neither path can save.
    floor = p50["driver alone (in-process, synchronous)"]
    socket_cost = socket_p50 - floor
    burst_cost = p50["burst (numpy pools, staged)"] - floor
    print(f"above the driver alone ({floor:.0f} us): execute over the socket adds "
          f"{socket_cost:.0f} us, the burst {burst_cost:.0f} us: "
          f"{socket_cost / max(burst_cost, 1e-9):.2f}x less transport cost")

    # (c) a camera frame
    dims = (1, 224, 224, 3)
    frame_model = await dev.prepare_model(add_model(dims, self_add=True))
    frame = np.random.default_rng(0).standard_normal(dims).astype(np.float32)
    frame_out = np.zeros(dims, np.float32)
    big = Memory.create(2 * frame.nbytes)
    big.array(np.float32, dims)[:] = frame
    async with await frame_model.configure_burst() as burst:
        p50 = report(f"(c) x + x of a 1x224x224x3 float frame ({frame.nbytes} bytes in, "
                     f"as many out)", await measure({
                         "burst, input and output in a Memory": lambda: burst.execute(
                             memory_request(big, dims)),
                         "burst, numpy arrays (copied in and out)": lambda: burst.execute(
                             numpy_request([frame], [frame_out])),
                     }, max(50, rounds // 10), batches), "burst, input and output in a Memory")
    saved = (p50["burst, numpy arrays (copied in and out)"]
             - p50["burst, input and output in a Memory"])
    print(f"zero copy saves {saved:.0f} us per frame "
          f"({p50['burst, numpy arrays (copied in and out)'] / p50['burst, input and output in a Memory']:.2f}x)")
    np.testing.assert_array_equal(frame_out, frame + frame)
    np.testing.assert_array_equal(big.array(np.float32, dims, frame.nbytes), frame + frame)
    mem.close()
    big.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--batches", type=int, default=5)
    args = parser.parse_args()
    try:
        import uvloop  # noqa: F401
        options = {"use_uvloop": True}
    except ImportError:
        options = {}
    anyio.run(main, args.rounds, args.batches, backend="asyncio", backend_options=options)
