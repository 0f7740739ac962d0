"""A camera app on nnrt: face detection on every frame of a 30 fps camera,
through a burst, each frame with a deadline of one period; or, with
``--flood``, a background app that keeps the device busy with LOW pose
detection. It runs on whatever devices the runtime finds (a driver service
listed in ``NNRT_DRIVERS`` first) and says, every second, how many frames it
got through, how many it dropped, and where the model runs now.

    NNRT_APP_NAME=camera python examples/camera_app.py --seconds 10
    NNRT_APP_NAME=batch python examples/camera_app.py --flood --seconds 10

The walk-through in docs/guide/camera-app.md runs two of them against one
service, kills the service and restarts it.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import anyio
import numpy as np

import nnrt
import nnrt.tflite
from nnrt import ErrorStatus, Priority

MODELS = Path(__file__).resolve().parents[1].parent / "shared" / "models" / "mediapipe"
PERIOD = 1 / 30


def _load(name: str, models: Path):
    path = models / f"{name}.tflite"
    return nnrt.tflite.load(str(path)), np.load(models / f"{name}.in0.npy")


async def camera(compiled, frame, seconds: float) -> None:
    """One frame per period through a burst; a frame that misses its
    deadline or fails is dropped, and the loop goes on."""
    done = dropped = 0
    report_at = time.monotonic() + 1
    start = anyio.current_time()
    async with compiled.burst() as burst:
        for k in range(int(seconds / PERIOD)):
            await anyio.sleep_until(start + k * PERIOD)
            try:
                await burst.execute([frame], deadline=nnrt.deadline_in(ms=PERIOD * 1000))
                done += 1
            except nnrt.NnrtError as e:
                if e.status not in (ErrorStatus.MISSED_DEADLINE_TRANSIENT,
                                    ErrorStatus.MISSED_DEADLINE_PERSISTENT,
                                    ErrorStatus.DEAD_OBJECT):
                    raise
                dropped += 1
            if time.monotonic() >= report_at:
                report_at += 1
                _report(compiled, done, dropped)
    _report(compiled, done, dropped)


async def flood(compiled, frame, seconds: float) -> None:
    """Back to back, as fast as the device takes them."""
    done = failed = 0
    end = time.monotonic() + seconds
    report_at = time.monotonic() + 1
    while time.monotonic() < end:
        try:
            await compiled.execute([frame])
            done += 1
        except nnrt.NnrtError as e:
            if e.status != ErrorStatus.DEAD_OBJECT:
                raise
            failed += 1
            await anyio.sleep(PERIOD)
        if time.monotonic() >= report_at:
            report_at += 1
            _report(compiled, done, failed)
    _report(compiled, done, failed)


def _report(compiled, done: int, dropped: int) -> None:
    where = ", ".join(d.name for d in compiled.devices)
    print(f"{done} frames, {dropped} dropped, on {where}", flush=True)


async def main(args) -> None:
    name, priority = ("pose_detection", Priority.LOW) if args.flood \
        else ("face_detection_short_range", Priority.HIGH)
    model, frame = _load(name, args.models)
    async with nnrt.Runtime(app=args.app) as rt:
        compiled = await rt.compile(model, priority=priority)
        run = flood if args.flood else camera
        await run(compiled, frame, args.seconds)
        for move in compiled.placement.fallbacks:
            print(f"moved: {move.detail}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flood", action="store_true",
                        help="the background app: LOW pose detection back to back")
    parser.add_argument("--seconds", type=float, default=10.0, help="how long (default: 10)")
    parser.add_argument("--app", default=None,
                        help="the app's name for the services' policy (default: NNRT_APP_NAME)")
    parser.add_argument("--models", type=Path, default=MODELS,
                        help=f"the mediapipe models' folder (default: {MODELS})")
    try:
        anyio.run(main, parser.parse_args())
    except KeyboardInterrupt:
        sys.exit(130)
