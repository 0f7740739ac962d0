"""What nnrt costs per inference over what a user would write instead.

    .venv/bin/python benchmarks/overhead.py [--rounds 300] [--models NAME ...] [--no-service]

For each shared model, in one process, alternating call by call so that
machine load hits every way alike (each round runs every way once, in a
shuffled order), 1 thread everywhere:

- ``litert direct``: LiteRT's Interpreter, set_tensor / invoke / get_tensor,
  on the caller's thread (what a script does).
- ``litert to_thread``: the same through ``anyio.to_thread.run_sync`` (what
  an async app does by hand).
- ``nnrt sync``: ``SyncRuntime`` ``compiled.execute`` on the in-process
  ``litert`` device.
- ``nnrt async``: ``await compiled.execute`` on the in-process ``litert``
  device.
- ``reusable sync`` / ``reusable async``: a reusable execution bound once to
  the input array (``compiled.create_execution([x])``), then
  ``execution.compute()`` per call, plain and awaited.
- ``service burst`` / ``service execute``: a ``litert`` driver service
  spawned by the runtime: a reusable execution computed through
  ``compiled.burst()`` (``burst.compute``), and a plain ``compiled.execute``.

Prints per way the median and p99 per call (ms) and the ratio of medians to
``litert direct`` (async ways also to ``litert to_thread``), measured in the
same run; the machine's load average before and after. Every way's outputs
are checked against LiteRT direct's once before timing.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time

import anyio
import numpy as np

import nnrt
import nnrt.tflite
from models import MODELS, direct as litert_direct   # benchmarks/models.py

DEFAULT_MODELS = [
    "generated/mobilenet_v1_0.25_128_float32", "generated/mobilenet_v2_0.35_96_float32",
    "generated/mobilenet_v2_1.0_224_int8", "generated/mobilenet_v1_1.0_224_int8",
    "mediapipe/face_detection_short_range", "mediapipe/hand_landmark_lite",
    "mediapipe/palm_detection_lite", "mediapipe/pose_detection",
]


def _same(got: list[np.ndarray], want: list[np.ndarray], way: str, name: str) -> None:
    for g, w in zip(got, want):
        if g.shape != w.shape or not np.allclose(g.astype(np.float64), w.astype(np.float64),
                                                 rtol=1e-4, atol=1e-4 * float(np.max(np.abs(w)) or 1)):
            sys.exit(f"{name}: {way} gave outputs that differ from LiteRT direct's")


def bench_model(name: str, rounds: int, service: bool, sync_rt: nnrt.SyncRuntime,
                loop: asyncio.AbstractEventLoop, rt: nnrt.Runtime) -> dict[str, list[float]]:
    path = MODELS / f"{name}.tflite"
    x = np.load(MODELS / f"{name}.in0.npy")
    model = nnrt.tflite.load(str(path))
    direct = litert_direct(path, [x])      # what a script does per inference
    want = direct()
    threaded = litert_direct(path, [x])
    # Every way has an interpreter of its own (its own compilation): a way
    # sharing one with the way timed before it would find its weights in
    # the cache, the others not.
    compiled = {way: loop.run_until_complete(rt.compile(model, devices=["litert"]))
                for way in ("nnrt async", "reusable async")}
    compiled.update((way, sync_rt.compile(model, devices=["litert"]))
                    for way in ("nnrt sync", "reusable sync"))
    # Each way: (whether it is awaited, the call). An awaited way is timed
    # inside the loop, around the await alone.
    calls = {
        "litert direct": (False, direct),
        "litert to_thread": (True, lambda: anyio.to_thread.run_sync(threaded)),
        "nnrt sync": (False, lambda: compiled["nnrt sync"].execute([x])),
        "nnrt async": (True, lambda: compiled["nnrt async"].execute([x])),
        # Bound once to the app's frame array (an app writes each new frame
        # into it): each call computes.
        "reusable sync": (False, compiled["reusable sync"].create_execution([x.copy()]).compute),
        "reusable async": (True, compiled["reusable async"].create_execution([x.copy()]).compute),
    }
    burst = None
    if service:
        for way in ("service burst", "service execute"):
            compiled[way] = loop.run_until_complete(rt.compile(model,
                                                               devices=["overhead-litert"]))
        burst = loop.run_until_complete(compiled["service burst"].burst().__aenter__())
        frame = compiled["service burst"].create_execution([x.copy()])
        calls["service burst"] = (True, lambda: burst.compute(frame))
        calls["service execute"] = (True, lambda: compiled["service execute"].execute([x]))

    async def awaited(call):
        start = time.perf_counter()
        got = await call()
        return time.perf_counter() - start, got

    def timed(is_awaited, call):
        def run() -> tuple[float, object]:
            if is_awaited:
                return loop.run_until_complete(awaited(call))
            start = time.perf_counter()
            got = call()
            return time.perf_counter() - start, got
        return run

    timers = {way: timed(*how) for way, how in calls.items()}
    for way, timer in timers.items():
        got = timer()[1]
        _same(list(got.outputs if isinstance(got, nnrt.Result) else got), want, way, name)
    ways = list(timers)
    for _ in range(max(10, rounds // 10)):          # warm-up, not recorded
        for way in ways:
            timers[way]()
    times: dict[str, list[float]] = {way: [] for way in ways}
    # A shuffled order each round (seeded: the same every run): in a fixed
    # cycle each way would always follow the same one, and the way after an
    # awaited one pays for the threads it leaves winding down.
    shuffle = random.Random(0).shuffle
    for _ in range(rounds):
        order = list(ways)
        shuffle(order)
        for way in order:
            times[way].append(timers[way]()[0])
    if burst is not None:
        loop.run_until_complete(burst.__aexit__(None, None, None))
    for c in compiled.values():
        c.close()
    return times


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


_AWAITED = ("nnrt async", "reusable async", "service burst", "service execute")


def report(name: str, times: dict[str, list[float]]) -> None:
    med = {way: statistics.median(v) for way, v in times.items()}
    base, thread = med["litert direct"], med["litert to_thread"]
    print(f"\n{name}")
    print(f"  {'way':<18} {'median ms':>10} {'p99 ms':>9} {'/ direct':>9} {'/ to_thread':>12}")
    for way, v in times.items():
        vs_thread = f"{med[way] / thread:11.2f}x" if way in _AWAITED else ""
        print(f"  {way:<18} {med[way] * 1e3:10.3f} {_p99(v) * 1e3:9.3f} "
              f"{med[way] / base:8.2f}x {vs_thread}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=300, help="alternating rounds per model")
    ap.add_argument("--models", nargs="+", default=DEFAULT_MODELS,
                    help="shared models by name under ../shared/models (without .tflite)")
    ap.add_argument("--no-service", action="store_true",
                    help="leave out the two ways through a litert driver service")
    args = ap.parse_args(argv)
    missing = [m for m in args.models if not (MODELS / f"{m}.tflite").exists()]
    if missing:
        ap.error(f"not among the shared models in {MODELS}: {', '.join(missing)}")
    service = not args.no_service
    loop = asyncio.new_event_loop()
    spawn = [("overhead-litert", "litert")] if service else []
    rt = nnrt.Runtime(spawn=spawn, discover=False)
    loop.run_until_complete(rt.__aenter__())
    load_before = os.getloadavg()
    print(f"{args.rounds} alternating rounds per model, 1 thread everywhere; "
          f"load average before {load_before[0]:.2f}")
    try:
        with nnrt.SyncRuntime(discover=False) as sync_rt:
            for name in args.models:
                report(name, bench_model(name, args.rounds, service, sync_rt, loop, rt))
    finally:
        loop.run_until_complete(rt.__aexit__(None, None, None))
        loop.close()
    print(f"\nload average after {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
