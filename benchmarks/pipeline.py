"""The face pipeline of examples/face_pipeline.py (issue 43) against what
users run today, on the same synthetic camera frames, in one run:

* ``litert 1t``     the three models one after another through LiteRT, 1
                    thread per interpreter, numpy resizing and cropping
                    between them (``LiteRTSequential``);
* ``litert 1t models``  the same, the three ``invoke`` calls alone (resize and
                    crop done beforehand: the strictest baseline);
* ``litert 2t``     as ``litert 1t`` with 2 threads per interpreter;
* ``mediapipe``     MediaPipe's face mesh + selfie segmentation solutions,
                    called per frame, in a process of a benchmark-only
                    environment (``--mediapipe-python``; skipped, saying why,
                    when it is not there);
* ``nnrt``          nnrt's pipeline in process (``Runtime(litert=2)``), frames
                    as fast as it takes them (``pipe.run``);
* ``nnrt camera``   the same pipeline, frames arriving one per period of a
                    ``--camera-fps`` camera (default 90), latency from arrival;
* ``nnrt seg@svc``  the same with segmentation on a litert driver service.

Configurations alternate round by round in this process (MediaPipe's runs
in its child between them). Then the flood: the pipeline (HIGH) on a shared
litert service (2 slots, a policy giving it weight 9 against the flooder's
1) alone, and while
another app floods that service with LOW pose detection, alternating.

Printed per configuration: frames per second (median over rounds), per-frame
latency p50/p99 (ms), frames dropped for their deadline; the ratios of nnrt
to each baseline; and ``uptime``'s load.

    .venv/bin/python benchmarks/pipeline.py [--frames 90] [--rounds 3]
        [--mediapipe-python .bench-mp/bin/python] [--deadline-ms 100]

The MediaPipe environment: ``python3.11 -m venv .bench-mp &&
.bench-mp/bin/pip install mediapipe==0.10.21`` (mediapipe pins numpy < 2:
not a dependency of nnrt).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import nnrt  # noqa: E402
from nnrt import Priority  # noqa: E402
from examples import face_pipeline as face  # noqa: E402

MEDIAPIPE_CHILD = r"""
import json, sys, time
import numpy as np
import mediapipe as mp
frames = np.load(sys.argv[1])
mesh = mp.solutions.face_mesh.FaceMesh(static_image_mode=False, max_num_faces=1)
seg = mp.solutions.selfie_segmentation.SelfieSegmentation(model_selection=0)
print("ready", flush=True)
for line in sys.stdin:
    times, faces = [], 0
    began = time.perf_counter()
    for frame in frames:
        t = time.perf_counter()
        found = mesh.process(frame).multi_face_landmarks
        seg.process(frame)
        times.append(time.perf_counter() - t)
        faces += found is not None
    total = time.perf_counter() - began
    print(json.dumps({"seconds": total, "latencies": times, "faces": faces}), flush=True)
"""

FLOODER = r"""
import anyio, sys, numpy as np, nnrt, nnrt.tflite
async def main():
    async with nnrt.Runtime(discover=True, litert=False, app="batch") as rt:
        model = nnrt.tflite.load(sys.argv[1])
        compiled = await rt.compile(model, priority=nnrt.Priority.LOW, devices=[sys.argv[2]])
        x = np.load(sys.argv[1].replace(".tflite", ".in0.npy"))
        async def loop():
            while True:
                await compiled.execute([x])
        print("flooding", flush=True)
        async with anyio.create_task_group() as tg:
            for _ in range(4):
                tg.start_soon(loop)
anyio.run(main)
"""


class Row:
    def __init__(self, name: str):
        self.name = name
        self.fps: list[float] = []
        self.latencies: list[float] = []
        self.dropped = 0
        self.note = ""

    def add(self, frames: int, seconds: float, latencies, dropped: int = 0) -> None:
        self.fps.append(frames / seconds)
        self.latencies += list(latencies)
        self.dropped += dropped

    @property
    def rate(self) -> float:
        return statistics.median(self.fps) if self.fps else float("nan")

    def line(self) -> str:
        if not self.fps:
            return f"{self.name:<22} {'-':>8}  {self.note}"
        lat = np.array(self.latencies) * 1e3
        return (f"{self.name:<22} {self.rate:8.1f} {np.percentile(lat, 50):8.2f} "
                f"{np.percentile(lat, 99):8.2f} {self.dropped:8d}  "
                f"(rounds: {', '.join(f'{f:.0f}' for f in self.fps)}) {self.note}")


def litert_round(row: Row, app: face.LiteRTSequential, frames) -> None:
    times = []
    began = time.perf_counter()
    for frame in frames:
        t = time.perf_counter()
        app.frame(frame)
        times.append(time.perf_counter() - t)
    row.add(len(frames), time.perf_counter() - began, times)


def litert_models_round(row: Row, app: face.LiteRTSequential, prepared) -> None:
    times = []
    began = time.perf_counter()
    for detect_input, crop, frame in prepared:
        t = time.perf_counter()
        app.detect(detect_input)
        app.invoke(app.models[1], crop)
        app.invoke(app.models[2], frame)
        times.append(time.perf_counter() - t)
    row.add(len(prepared), time.perf_counter() - began, times)


async def pipeline_round(row: Row, pipe, frames, deadline: float | None) -> None:
    """All frames as fast as the pipeline takes them (``pipe.run``)."""
    latencies, dropped = [], 0
    began = time.perf_counter()
    async for result in pipe.run(frames, deadline_per_frame=deadline):
        if result.dropped_at is None:
            latencies.append(result.latency)
        else:
            dropped += 1
    row.add(len(frames), time.perf_counter() - began, latencies, dropped)


async def paced_round(row: Row, pipe, frames, deadline: float, period: float) -> None:
    """One frame per ``period``, as a camera delivers them: a camera task
    submits each frame when it arrives (``submit_nowait``: a frame arriving
    while the pipeline is full is skipped, counted as dropped), this task
    awaits the results in order; a frame's latency runs from its arrival to
    its result."""
    latencies, dropped = [], 0
    skipped = 0
    send, receive = anyio.create_memory_object_stream(len(frames))
    began = time.perf_counter()

    async def camera():
        nonlocal skipped
        async with send:
            for k, frame in enumerate(frames):
                arrival = began + k * period
                await anyio.sleep(max(0.0, arrival - time.perf_counter()))
                try:
                    ticket = pipe.submit_nowait(frame, deadline=time.monotonic() + deadline)
                except anyio.WouldBlock:
                    skipped += 1
                    continue
                await send.send((arrival, ticket))

    async with anyio.create_task_group() as tg:
        tg.start_soon(camera)
        async with receive:
            async for arrival, ticket in receive:
                result = await ticket.result()
                if result.dropped_at is None:
                    latencies.append(time.perf_counter() - arrival)
                else:
                    dropped += 1
    row.add(len(frames) - skipped, time.perf_counter() - began, latencies, dropped + skipped)


class MediaPipe:
    """MediaPipe's solutions in a child process of their own environment."""

    def __init__(self, python: str | None, frames):
        self.proc = None
        self.why = None
        if not python or not Path(python).exists():
            self.why = f"no MediaPipe environment ({python or 'none given'}): see --help"
            return
        self.file = tempfile.NamedTemporaryFile(suffix=".npy", delete=False)
        np.save(self.file, np.stack([np.round(f[0] * 255).astype(np.uint8) for f in frames]))
        self.file.close()
        self.proc = subprocess.Popen([python, "-c", MEDIAPIPE_CHILD, self.file.name],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)
        if self.proc.stdout.readline().strip() != "ready":
            self.why = "the MediaPipe child did not start"
            self.close()

    def round(self, row: Row) -> None:
        if self.proc is None:
            row.note = self.why
            return
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        got = json.loads(self.proc.stdout.readline())
        row.add(len(got["latencies"]), got["seconds"], got["latencies"])
        row.note = f"face found on {got['faces']} of {len(got['latencies'])}"

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
            self.proc = None
            os.unlink(self.file.name)


def ratios(rows: dict[str, Row], ours: str, others) -> str:
    return "; ".join(f"{ours} / {o} = {rows[ours].rate / rows[o].rate:.2f}x"
                     for o in others if rows[o].fps and rows[ours].fps)


def header() -> str:
    return f"{'configuration':<22} {'fps':>8} {'p50 ms':>8} {'p99 ms':>8} {'dropped':>8}"


async def main_rows(args, frames) -> dict[str, Row]:
    rows = {n: Row(n) for n in ("litert 1t", "litert 1t models", "litert 2t", "mediapipe",
                                "nnrt", "nnrt camera", "nnrt seg@svc")}
    lite1, lite2 = face.LiteRTSequential(1), face.LiteRTSequential(2)
    prepared = []
    for frame in frames:
        box, _ = face.face_box(*lite1.detect(face.resize_bilinear(frame, face.DETECT) * 2 - 1))
        prepared.append((face.resize_bilinear(frame, face.DETECT) * 2 - 1,
                         face.roi_align(frame, box, face.CROP), frame))
    mediapipe = MediaPipe(args.mediapipe_python, frames)
    deadline = args.deadline_ms / 1000
    try:
        async with nnrt.Runtime(litert=2, discover=False) as rt, \
                nnrt.Runtime(litert=2, discover=False, spawn=[("seg", "litert")]) as rt_svc:
            pipes = []
            for runtime, devices in ((rt, None), (rt_svc, ["seg"])):
                compiled = await face.compile_all(runtime, devices)
                pipe = runtime.pipeline(face.stages(compiled), in_flight=2, outputs=face.OUTPUTS)
                async for _ in pipe.run(frames[:6]):     # warm: costs measured, lanes placed
                    pass
                pipes.append(pipe)
            for k in range(args.rounds):
                litert_round(rows["litert 1t"], lite1, frames)
                await pipeline_round(rows["nnrt"], pipes[0], frames, deadline)
                litert_models_round(rows["litert 1t models"], lite1, prepared)
                mediapipe.round(rows["mediapipe"])
                litert_round(rows["litert 2t"], lite2, frames)
                await pipeline_round(rows["nnrt seg@svc"], pipes[1], frames, deadline)
                # A camera: the latency a frame sees when frames arrive, not
                # when the pipeline asks for them.
                await paced_round(rows["nnrt camera"], pipes[0], frames, deadline,
                                  period=1 / args.camera_fps)
            rows["nnrt camera"].note = (f"frames arriving at {args.camera_fps:g} fps; dropped: "
                                        f"skipped while full, or past their deadline")
            for name, pipe in zip(("nnrt", "nnrt seg@svc"), pipes):
                stats = pipe.statistics()
                rows[name].note = f"lanes {stats.lanes}, placed again {stats.replaced}x"
                await pipe.aclose()
    finally:
        mediapipe.close()
    return rows


async def flood_rows(args, frames) -> dict[str, Row]:
    """The pipeline on a shared litert service, alone and beside a LOW flood."""
    rows = {n: Row(n) for n in ("nnrt on svc alone", "nnrt on svc flooded")}
    folder = tempfile.mkdtemp()
    socket, policy = os.path.join(folder, "npu.sock"), os.path.join(folder, "policy.toml")
    with open(policy, "w") as f:
        f.write(f'[default]\nmax_priority = "low"\n\n[[app]]\nname = "camera"\n'
                f'uid = {os.getuid()}\napp = "camera"\nweight = {args.camera_weight}\n'
                f'max_priority = "high"\n')
    service = subprocess.Popen([sys.executable, "-m", "nnrt", "driver", "serve", "npu",
                                "--driver", "litert", "--slots", "2", "--socket", socket,
                                "--policy", policy], stdout=subprocess.PIPE, text=True)
    flooder = None
    try:
        service.stdout.readline()
        os.environ["NNRT_DRIVERS"] = socket
        deadline = args.deadline_ms / 1000
        async with nnrt.Runtime(discover=True, litert=False, app="camera") as rt:
            compiled = await face.compile_all(rt, priority=Priority.HIGH)
            pipe = rt.pipeline(face.stages(compiled), in_flight=2, outputs=face.OUTPUTS)
            async for _ in pipe.run(frames[:6]):
                pass
            pose = str(face.SHARED / "pose_detection.tflite")
            for k in range(args.rounds):
                await pipeline_round(rows["nnrt on svc alone"], pipe, frames, deadline)
                flooder = subprocess.Popen([sys.executable, "-c", FLOODER, pose, "npu"],
                                           stdout=subprocess.PIPE, text=True,
                                           env=dict(os.environ, NNRT_APP_NAME="batch"))
                flooder.stdout.readline()               # "flooding"
                await anyio.sleep(0.3)
                await pipeline_round(rows["nnrt on svc flooded"], pipe, frames, deadline)
                flooder.terminate()
                flooder.wait(timeout=30)
                flooder = None
            rows["nnrt on svc flooded"].note = f"lanes {pipe.statistics().lanes}"
            await pipe.aclose()
    finally:
        os.environ.pop("NNRT_DRIVERS", None)
        if flooder is not None:
            flooder.terminate()
            flooder.wait(timeout=30)
        service.terminate()
        service.wait(timeout=30)
        shutil.rmtree(folder, ignore_errors=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=90, help="frames per round (default 90)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--deadline-ms", type=float, default=100.0,
                        help="each nnrt frame's deadline after its submission (default 100)")
    parser.add_argument("--mediapipe-python", default=str(ROOT / ".bench-mp" / "bin" / "python"),
                        help="python of an environment with mediapipe 0.10.21 "
                             "(default .bench-mp/bin/python)")
    parser.add_argument("--camera-fps", type=float, default=90.0,
                        help="the nnrt camera row's frame rate (default 90)")
    parser.add_argument("--no-flood", action="store_true", help="skip the flood section")
    parser.add_argument("--camera-weight", type=int, default=9,
                        help="the pipeline app's weight in the shared service's policy, the "
                             "flooder's is 1 (default 9: it may take 90%% of the device)")
    args = parser.parse_args()
    if args.frames < 10 or args.rounds < 1 or not args.camera_fps > 0:
        parser.error("--frames must be at least 10, --rounds at least 1, --camera-fps > 0")
    frames = face.camera(args.frames)
    print(f"face pipeline, {args.frames} frames of {face.SIZE}x{face.SIZE} per round, "
          f"{args.rounds} rounds; load before: {os.getloadavg()[0]:.2f}")
    rows = anyio.run(main_rows, args, frames)
    print(header())
    for row in rows.values():
        print(row.line())
    print(ratios(rows, "nnrt", ["litert 1t", "litert 1t models", "litert 2t", "mediapipe"]))
    print(ratios(rows, "nnrt seg@svc", ["litert 1t", "litert 2t"]))
    for name in ("nnrt", "nnrt camera"):
        row = rows[name]
        if row.latencies:
            period = 1e3 / rows["nnrt"].rate
            print(f"{name}: p99 latency = "
                  f"{np.percentile(np.array(row.latencies) * 1e3, 99) / period:.2f} frame periods "
                  f"of nnrt's rate ({period:.2f} ms)")
    if not args.no_flood:
        flood = anyio.run(flood_rows, args, frames)
        print(header())
        for row in flood.values():
            print(row.line())
        alone, flooded = flood["nnrt on svc alone"], flood["nnrt on svc flooded"]
        print(f"flooded / alone = {flooded.rate / alone.rate:.2f}x; dropped for deadline while "
              f"flooded: {flooded.dropped} (deadline {args.deadline_ms:g} ms)")
    print(f"load after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
