"""Compilation caching: compile time cold vs warm, from a fresh process.

For MobileNet v2 (1.0, 224, int8) and MediaPipe's pose_detection, on the
reference and the LiteRT driver, in process and on a driver service
(``nnrt driver serve``, started once per driver and kept running), each
measurement is a *fresh app process* that loads the model and times:

* ``uncached``  ``rt.compile(model)`` without a cache folder (the baseline)
* ``cold``      ``rt.compile(model, cache_dir=...)`` into an empty folder
                (compiles and writes the cache files)
* ``warm``      the same call again, in another fresh process (prepares
                from the files)

and then the first execution's latency. The app's time to load the driver
and create its device (for litert: LiteRT's library, loaded with the
driver, not by the first compilation) comes first and is printed as its
own column ("driver load ms", from the warm runs). Each is the median of ``--rounds``
processes. It prints a table with the cold/warm compile ratio (goal: at
least 5x on LiteRT), the uncached/warm ratio, and the app process's CPU time
for the compile (in process: all the work; on a service: the app's share
only), which a loaded host disturbs less than wall time; and the load
average, which matters on a shared host.

    .venv/bin/python benchmarks/cache.py [--rounds 3] [--models mobilenet,pose]
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

MODELS = Path(os.environ.get("NNRT_MODELS", "/work/shared/models"))
MODEL_FILES = {
    "mobilenet_v2_int8": MODELS / "generated" / "mobilenet_v2_1.0_224_int8.tflite",
    "pose_detection": MODELS / "mediapipe" / "pose_detection.tflite",
}
DRIVERS = ("litert", "reference")


def child(args) -> None:
    """One app process: load, compile (timed), execute once (timed); JSON out."""
    import anyio
    import numpy as np
    import nnrt
    import nnrt.tflite
    from nnrt.service.client import ServiceDevice

    async def main():
        model = nnrt.tflite.load(args.model)
        # Loading the driver (its module and, for litert, LiteRT's library)
        # and creating the device: paid once per process, before any
        # compilation, cached or not; printed as its own column.
        start = time.perf_counter()
        if args.socket:
            device = await ServiceDevice.connect(args.socket)
        elif args.driver == "litert":
            from nnrt.drivers.litert.driver import LiteRTDevice
            device = LiteRTDevice()
        else:
            from nnrt.drivers.reference import ReferenceDevice
            device = ReferenceDevice()
        load_s = time.perf_counter() - start
        inputs = [np.zeros(o.dimensions, o.type.dtype) for o in
                  (model.hal_model.main.operands[i] for i in model.hal_model.main.input_indexes)]
        async with nnrt.Runtime(devices=[device], discover=False, litert=False) as rt:
            kwargs = {"cache_dir": args.cache_dir} if args.cache_dir else {}
            start, cpu = time.perf_counter(), time.process_time()
            compiled = await rt.compile(model, devices=[device.name], **kwargs)
            compile_s = time.perf_counter() - start
            compile_cpu = time.process_time() - cpu
            start = time.perf_counter()
            await compiled.execute(inputs)
            first_s = time.perf_counter() - start
            stats = rt.cache_statistics()
        print(json.dumps({"load": load_s, "compile": compile_s, "cpu": compile_cpu,
                          "first": first_s,
                          "hits": stats.hits,
                          "misses": stats.misses, "rejects": stats.rejected}))

    anyio.run(main)


def run_child(model: Path, driver: str, socket: str | None, cache_dir: str | None) -> dict:
    cmd = [sys.executable, __file__, "--child", "--model", str(model), "--driver", driver]
    if socket:
        cmd += ["--socket", socket]
    if cache_dir:
        cmd += ["--cache-dir", cache_dir]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def start_service(driver: str, folder: str) -> tuple[subprocess.Popen, str]:
    sock = os.path.join(folder, f"{driver}.sock")
    proc = subprocess.Popen([sys.executable, "-m", "nnrt", "driver", "serve", f"bench-{driver}",
                             "--driver", driver, "--socket", sock, "--parent-pid",
                             str(os.getpid())], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while not os.path.exists(sock):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the {driver} service did not start")
        time.sleep(0.05)
    return proc, sock


def measure(model: Path, driver: str, socket: str | None, rounds: int, folder: str) -> dict:
    samples = {"uncached": [], "cold": [], "warm": []}
    for r in range(rounds):
        cache_dir = os.path.join(folder, f"cache-{driver}-{model.stem}-{r}")
        shutil.rmtree(cache_dir, ignore_errors=True)
        samples["uncached"].append(run_child(model, driver, socket, None))
        cold = run_child(model, driver, socket, cache_dir)
        warm = run_child(model, driver, socket, cache_dir)
        if cold["misses"] < 1 or warm["hits"] < 1 or warm["rejects"]:
            raise SystemExit(f"{model.stem} on {driver}: the cache was not used as expected: "
                             f"cold {cold}, warm {warm}")
        samples["cold"].append(cold)
        samples["warm"].append(warm)
    return {mode: {k: statistics.median(s[k] for s in runs) for k in ("load", "compile", "cpu", "first")}
            for mode, runs in samples.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="fresh processes per measurement")
    ap.add_argument("--models", default=",".join(MODEL_FILES),
                    help=f"comma-separated, of {', '.join(MODEL_FILES)}")
    ap.add_argument("--drivers", default=",".join(DRIVERS))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--driver", help=argparse.SUPPRESS)
    ap.add_argument("--socket", help=argparse.SUPPRESS)
    ap.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    from rich.console import Console
    from rich.table import Table

    console = Console(width=190)
    table = Table(title=f"compilation cache: median of {args.rounds} fresh processes "
                        f"(load before: {os.getloadavg()[0]:.2f})")
    for col in ("model", "driver", "where", "driver load ms", "uncached ms", "cold ms", "warm ms",
                "cold/warm", "uncached/warm", "app CPU cold/warm ms", "CPU ratio",
                "1st exec cold ms", "1st exec warm ms"):
        table.add_column(col, justify="left" if col in ("model", "driver", "where")
                         else "right")
    with tempfile.TemporaryDirectory(prefix="nnrt-cache-bench-") as folder:
        services = {}
        try:
            for driver in args.drivers.split(","):
                services[driver] = start_service(driver, folder)
            for name in args.models.split(","):
                path = MODEL_FILES[name]
                for driver in args.drivers.split(","):
                    for where, socket in (("in process", None),
                                          ("service", services[driver][1])):
                        m = measure(path, driver, socket, args.rounds, folder)
                        ratio = m["cold"]["compile"] / m["warm"]["compile"]
                        table.add_row(name, driver, where,
                                      f"{m['warm']['load'] * 1e3:.0f}",
                                      f"{m['uncached']['compile'] * 1e3:.0f}",
                                      f"{m['cold']['compile'] * 1e3:.0f}",
                                      f"{m['warm']['compile'] * 1e3:.0f}",
                                      f"{ratio:.1f}x",
                                      f"{m['uncached']['compile'] / m['warm']['compile']:.1f}x",
                                      f"{m['cold']['cpu'] * 1e3:.0f} / "
                                      f"{m['warm']['cpu'] * 1e3:.0f}",
                                      f"{m['cold']['cpu'] / m['warm']['cpu']:.1f}x",
                                      f"{m['cold']['first'] * 1e3:.1f}",
                                      f"{m['warm']['first'] * 1e3:.1f}")
                        console.print(f"{name} {driver} {where}: cold/warm {ratio:.1f}x "
                                      f"(load {os.getloadavg()[0]:.2f})")
        finally:
            for proc, _ in services.values():
                proc.terminate()
                proc.wait()
    console.print(table)
    console.print(f"load average after: {os.getloadavg()[0]:.2f}; goal: warm compile at "
                  f"least 5x faster than cold on litert")


if __name__ == "__main__":
    main()
