"""The shared real models (../shared/models): LiteRT called directly against
nnrt's litert driver and the reference driver, in one process, one run.

Per model, median and p99 milliseconds per execution of:

* ``litert direct``: ``ai_edge_litert`` Interpreter on the ``.tflite`` file,
  1 thread: ``set_tensor``, ``invoke``, ``get_tensor`` per run (what a user
  would run instead of nnrt);
* ``driver``: the litert driver's ``execute_synchronously`` on a ready-made
  request, the NNAPI model imported from the same file by ``nnrt.tflite``
  (one copy in, one out);
* ``nnrt API``: ``await compiled.execute([x])`` on the in-process litert
  device (staging, the QoS front's worker thread, the driver, the result
  arrays);
* ``burst``: ``await burst.execute([x])`` through a burst session to a
  ``litert`` driver service (``nnrt driver serve --driver litert``, spawned
  once for the run);
* ``reference``: the same through the reference driver (fewer runs: slow);

and the ratios to LiteRT direct. Configurations are timed in alternating
blocks of ``BLOCK`` runs, in an order rotated block by block (each
interpreter keeps its own packed weights, so alternating run by run would
time cache misses; alternating blocks spreads a noisy spell on the shared
machine over all of them); the reference driver is timed after the others.
The litert driver runs with its default segmenting (segments of about 2 ms)
unless ``--segment-ms 0`` (one segment).

    .venv/bin/python benchmarks/models.py [--runs N] [--models GLOB] [--segment-ms MS]
                                          [--segments-of MODEL]

``--segments-of MODEL`` instead times MODEL end to end through the driver cut
into 1, 4 and 16 segments (the granularity cost in docs/design/scheduler.md). ``--ab``
instead times, per model, only LiteRT direct, the driver, and the driver's
own interpreter invoked bare (``set_tensor`` + ``invoke``), in alternating
blocks of 100: what the conversion costs (bare vs direct) and what the
driver's Python costs (driver vs bare).
"""
from __future__ import annotations

import argparse
import fnmatch
import time
from pathlib import Path

import anyio
import numpy as np

import nnrt
from nnrt.drivers.litert import LiteRTDevice
from nnrt.drivers.reference import ReferenceDevice
from nnrt.hal import Request, RequestArgument
from nnrt.model.graph import DataLocation
import nnrt.tflite

MODELS = Path(__file__).resolve().parents[2] / "shared" / "models"
NAMES = [
    "generated/mobilenet_v1_0.25_128_float32", "generated/mobilenet_v1_0.25_128_int8",
    "generated/mobilenet_v1_0.25_128_uint8", "generated/mobilenet_v1_1.0_224_int8",
    "generated/mobilenet_v2_0.35_96_float32", "generated/mobilenet_v2_0.35_96_int8",
    "generated/mobilenet_v2_1.0_224_int8", "conv/conv3x3_112x112x32to64_float32",
    "conv/conv3x3_112x112x32to64_int8", "mediapipe/face_detection_short_range",
    "mediapipe/hand_landmark_lite", "mediapipe/palm_detection_lite",
    "mediapipe/pose_detection", "generated/lstm_20x40_unrolled_float32",
    "generated/lstm_20x40_fused_float32", "generated/lstm_20x40_while_float32",
]


def request(hal, inputs: list[np.ndarray]) -> tuple[Request, list[np.ndarray]]:
    outputs = [np.empty(hal.main.operands[i].dimensions, hal.main.operands[i].type.dtype)
               for i in hal.main.output_indexes]
    arrays = [*inputs, *outputs]
    args = [RequestArgument(False, DataLocation(k, 0, a.nbytes)) for k, a in enumerate(arrays)]
    return (Request(tuple(args[:len(inputs)]), tuple(args[len(inputs):]),
                    tuple(a.reshape(-1).view(np.uint8) for a in arrays)), outputs)


def direct(path: Path, inputs: list[np.ndarray]):
    from ai_edge_litert.interpreter import Interpreter
    interp = Interpreter(model_path=str(path), num_threads=1)
    interp.allocate_tensors()
    ins = [d["index"] for d in interp.get_input_details()]
    outs = [d["index"] for d in interp.get_output_details()]

    def run():
        for index, x in zip(ins, inputs):
            interp.set_tensor(index, x)
        interp.invoke()
        return [interp.get_tensor(o) for o in outs]
    return run


BLOCK = 20


def stats(samples: list[float]) -> tuple[float, float]:
    a = np.sort(np.asarray(samples)) * 1e3
    return float(np.median(a)), float(a[min(len(a) - 1, int(np.ceil(0.99 * len(a))) - 1)])


async def bench_model(name: str, runs: int, segment_time: float | None, service_rt) -> list:
    path = Path(f"{MODELS / name}.tflite")
    stem = MODELS / name
    inputs = [np.load(p) for p in sorted(stem.parent.glob(stem.name + ".in*.npy"))]
    model = nnrt.tflite.load(path)
    hal = model.hal_model
    litert = LiteRTDevice(segment_time=segment_time)
    # A model with operations litert leaves to the reference driver (the
    # recurrent ones) runs partitioned: no driver-alone column then.
    whole = all(await litert.supported_operations(hal))
    prepared = litert.prepare_model_synchronously(hal) if whole else None
    req, _ = request(hal, inputs)
    results: dict[str, list[float]] = {"direct": [], "driver": [], "api": [], "burst": [],
                                       "reference": []}
    sync_calls = {"direct": direct(path, inputs)}
    if whole:
        sync_calls["driver"] = lambda: prepared.execute_synchronously(req)
    async with nnrt.Runtime(devices=[litert, ReferenceDevice()]) as rt, \
            nnrt.Runtime(devices=[ReferenceDevice()]) as ref_rt:
        compiled = await rt.compile(model)
        reference = await ref_rt.compile(model)
        served = await service_rt.compile(model, devices=["litert-service"] if whole else
                                          ["litert-service", service_rt.cpu.name])
        async with served.burst() as burst:
            async_calls = {"api": lambda: compiled.execute(inputs),
                           "burst": lambda: burst.execute(inputs)}
            for _ in range(5):       # warm up
                for fn in sync_calls.values():
                    fn()
                for fn in async_calls.values():
                    await fn()
            calls = [(key, fn, False) for key, fn in sync_calls.items()] + \
                [(key, fn, True) for key, fn in async_calls.items()]
            for block in range(max(1, runs // BLOCK)):
                # Rotate the order: whatever a configuration leaves behind
                # (a service thread still spinning) hits each one alike.
                k = block % len(calls)
                for key, fn, is_async in calls[k:] + calls[:k]:
                    for _ in range(BLOCK):
                        start = time.perf_counter()
                        if is_async:
                            await fn()
                        else:
                            fn()
                        results[key].append(time.perf_counter() - start)
            # The reference last and on its own: numpy's BLAS threads keep
            # spinning for a while after a call and would slow whatever ran next.
            await reference.execute(inputs)
            for _ in range(max(1, runs // BLOCK)):
                start = time.perf_counter()
                await reference.execute(inputs)
                results["reference"].append(time.perf_counter() - start)
        served.close()
    row = [name.split("/")[-1], prepared.segment_count if whole else "part"]
    base = stats(results["direct"])[0]
    for key in ("direct", "driver", "api", "burst", "reference"):
        med, p99 = stats(results[key]) if results[key] else (float("nan"), float("nan"))
        row += [med, p99] + ([] if key == "direct" else [med / base])
    return row


async def granularity(name: str, runs: int) -> None:
    path = Path(f"{MODELS / name}.tflite")
    stem = MODELS / name
    inputs = [np.load(p) for p in sorted(stem.parent.glob(stem.name + ".in*.npy"))]
    hal = nnrt.tflite.load(path).hal_model
    calls = {}
    for n in (1, 4, 16):
        prepared = LiteRTDevice(segments=n, segment_time=None).prepare_model_synchronously(hal)
        req, _ = request(hal, inputs)
        calls[prepared.segment_count] = (lambda p=prepared, r=req: p.execute_synchronously(r))
    samples = {n: [] for n in calls}
    for fn in calls.values():
        for _ in range(5):
            fn()
    for _ in range(max(1, runs // BLOCK)):
        for n, fn in calls.items():
            for _ in range(BLOCK):
                start = time.perf_counter()
                fn()
                samples[n].append(time.perf_counter() - start)
    base = stats(samples[1])[0]
    print(f"{name}: end to end through the litert driver, by segment count ({runs} runs each)")
    print("| segments | median ms | p99 ms | vs 1 segment |")
    print("|---:|---:|---:|---:|")
    for n, s in samples.items():
        med, p99 = stats(s)
        print(f"| {n} | {med:.3f} | {p99:.3f} | {med / base:.3f}x |")


def ab(names: list[str], runs: int) -> None:
    print(f"LiteRT direct vs the driver vs the driver's interpreter bare; {runs} runs each in "
          f"blocks of 100, median ms")
    print("| model | direct | driver | ratio | bare interpreter | ratio |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in names:
        path = Path(f"{MODELS / name}.tflite")
        stem = MODELS / name
        inputs = [np.load(p) for p in sorted(stem.parent.glob(stem.name + ".in*.npy"))]
        hal = nnrt.tflite.load(path).hal_model
        litert = LiteRTDevice(segment_time=None)
        if not all(anyio.run(litert.supported_operations, hal)):
            continue    # partitioned: no driver alone to time
        prepared = litert.prepare_model_synchronously(hal)
        req, _ = request(hal, inputs)
        interp = prepared.runner.interpreter_for_test(0)
        index = [d["index"] for d in interp.get_input_details()]

        def bare():
            for i, x in zip(index, inputs):
                interp.set_tensor(i, x)
            interp.invoke()

        calls = {"direct": direct(path, inputs),
                 "driver": lambda: prepared.execute_synchronously(req), "bare": bare}
        samples = {k: [] for k in calls}
        for fn in calls.values():
            for _ in range(10):
                fn()
        for _ in range(max(1, runs // 100)):
            for key, fn in calls.items():
                for _ in range(100):
                    start = time.perf_counter()
                    fn()
                    samples[key].append(time.perf_counter() - start)
        d, r, b = (float(np.median(samples[k])) * 1e3 for k in ("direct", "driver", "bare"))
        print(f"| {name.split('/')[-1]} | {d:.3f} | {r:.3f} | {r / d:.3f}x | {b:.3f} "
              f"| {b / d:.3f}x |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--models", default="*", help="fnmatch glob on model names")
    parser.add_argument("--segment-ms", type=float, default=2.0,
                        help="the driver's segment budget in ms (0: one segment)")
    parser.add_argument("--segments-of", metavar="MODEL",
                        help="time MODEL with 1, 4 and 16 segments instead")
    parser.add_argument("--ab", action="store_true",
                        help="time LiteRT direct, the driver and its bare interpreter only")
    args = parser.parse_args()
    if args.ab:
        ab([n for n in NAMES if fnmatch.fnmatch(n.split("/")[-1], args.models)], args.runs)
        return
    if args.segments_of:
        name = next(n for n in NAMES if n.endswith(args.segments_of))
        anyio.run(granularity, name, args.runs)
        return
    segment_time = args.segment_ms / 1e3 if args.segment_ms > 0 else None
    print(f"LiteRT direct (1 thread) vs nnrt litert driver vs reference driver; "
          f"{args.runs} runs each (reference: {max(1, args.runs // BLOCK)}), "
          f"median / p99 ms, ratio = median / LiteRT direct median")
    print("| model | segs | LiteRT direct | driver | ratio | nnrt API | ratio | burst to service "
          "| ratio | reference | ratio |")
    print("|---|---:|---|---|---:|---|---:|---|---:|---|---:|")
    names = [n for n in NAMES if fnmatch.fnmatch(n.split("/")[-1], args.models)]
    anyio.run(table, names, args.runs, segment_time)
    print("segs: the litert driver's segments; 'part': partitioned with the reference "
          "driver (no driver-alone column)")


async def table(names: list[str], runs: int, segment_time: float | None) -> None:
    async with nnrt.Runtime(spawn=[("litert-service", "litert")], discover=False,
                            litert=False) as service_rt:
        for name in names:
            row = await bench_model(name, runs, segment_time, service_rt)
            model, segs, dm, dp, drm, drp, drr, am, ap, ar, bm, bp, br, rm, rp, rr = row
            print(f"| {model} | {segs} | {dm:.3f} / {dp:.3f} | {drm:.3f} / {drp:.3f} | {drr:.2f}x "
                  f"| {am:.3f} / {ap:.3f} | {ar:.2f}x | {bm:.3f} / {bp:.3f} | {br:.2f}x "
                  f"| {rm:.2f} / {rp:.2f} | {rr:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
