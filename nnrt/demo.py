"""`make demo` / `nnrt demo`: a simulated camera loop on a driver service.

A driver service is spawned (the reference driver in its own process, apps
told apart by pid). This app runs a HIGH-priority detector on every frame of
a synthetic 30 fps camera through a burst, each frame with a deadline of one
frame period, while a LOW-priority background model of the same app keeps the
device busy; a second app process competes at MEDIUM priority. A live line
shows progress; the end is a summary table (frames, p50/p99 latency per
model, deadline misses, preemptions, per-app share of device time) and, with
``--report PATH.html``, a self-contained HTML report with latency charts.

``nnrt demo --pipeline`` runs the face pipeline instead (examples/face_pipeline.py).
"""
from __future__ import annotations

import argparse
import json
import os
import runpy
import statistics as stats
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import numpy as np

import nnrt
from nnrt import OperandType as T, OperationType as Op
from nnrt.bench import report
from nnrt.bench.machine import LoadSampler
from nnrt.bench.results import ERROR, MISS, Case, Sample, share_over_time

FPS = 30
SERVICE = "cpu-service"   # the demo's driver service (the reference driver, in numpy)
FRAME = (1, 64, 64, 3)
BACKGROUND = (1, 40, 40, 32)


# --- models --------------------------------------------------------------------

class _Builder:
    """Small helper over nnrt.Model for the demo's networks."""

    def __init__(self, seed: int):
        self.m = nnrt.Model()
        self.rng = np.random.default_rng(seed)
        self._ints: dict[int, int] = {}

    def int(self, value: int) -> int:
        if value not in self._ints:
            self._ints[value] = self.m.add_operand(T.INT32)
            self.m.set_operand_value(self._ints[value], value)
        return self._ints[value]

    def tensor(self, dims) -> int:
        return self.m.add_operand(T.TENSOR_FLOAT32, list(dims))

    def const(self, array: np.ndarray) -> int:
        index = self.tensor(array.shape)
        self.m.set_operand_value(index, array.astype(np.float32))
        return index

    def conv(self, x: int, cin: int, cout: int, k: int, stride: int, out_dims, relu=True) -> int:
        w = self.const(self.rng.standard_normal((cout, k, k, cin)) * (1.0 / np.sqrt(k * k * cin)))
        b = self.const(np.zeros(cout))
        y = self.tensor(out_dims)
        self.m.add_operation(Op.CONV_2D, [x, w, b, self.int(1), self.int(stride), self.int(stride),
                                          self.int(1 if relu else 0)], [y])
        return y


def detector_model() -> nnrt.Model:
    """A small single-shot detector head: three convolutions, pooling, scores."""
    b = _Builder(1)
    x = b.tensor(FRAME)
    h = b.conv(x, 3, 16, 3, 2, (1, 32, 32, 16))
    h = b.conv(h, 16, 32, 3, 2, (1, 16, 16, 32))
    h = b.conv(h, 32, 32, 3, 1, (1, 16, 16, 32))
    pooled = b.tensor((1, 1, 1, 32))
    b.m.add_operation(Op.AVERAGE_POOL_2D, [h, b.int(2), b.int(1), b.int(1), b.int(16),
                                           b.int(16), b.int(0)], [pooled])
    flat_shape = b.m.add_operand(T.TENSOR_INT32, [2])
    b.m.set_operand_value(flat_shape, np.array([1, 32], np.int32))
    flat = b.tensor((1, 32))
    b.m.add_operation(Op.RESHAPE, [pooled, flat_shape], [flat])
    w = b.const(b.rng.standard_normal((8, 32)) * 0.2)
    bias = b.const(np.zeros(8))
    logits = b.tensor((1, 8))
    b.m.add_operation(Op.FULLY_CONNECTED, [flat, w, bias, b.int(0)], [logits])
    scores = b.tensor((1, 8))
    b.m.add_operation(Op.LOGISTIC, [logits], [scores])
    b.m.identify_inputs_and_outputs([x], [scores])
    return b.m.finish()


def chain_model(operations: int, seed: int) -> nnrt.Model:
    """A chain of 1x1 convolutions of similar cost (a background workload)."""
    b = _Builder(seed)
    x = b.tensor(BACKGROUND)
    h = x
    for _ in range(operations):
        h = b.conv(h, BACKGROUND[3], BACKGROUND[3], 1, 1, BACKGROUND)
    b.m.identify_inputs_and_outputs([x], [h])
    return b.m.finish()


# --- the competing app ----------------------------------------------------------

async def competitor(socket_path: str, seconds: float) -> None:
    """Second app: runs a MEDIUM model back to back, prints how many it ran."""
    os.environ["NNRT_DRIVERS"] = socket_path
    async with nnrt.Runtime() as rt:
        compiled = await rt.compile(chain_model(20, seed=3), priority=nnrt.Priority.MEDIUM,
                                    devices=[SERVICE])
        x = np.random.default_rng(2).random(BACKGROUND, dtype=np.float32)
        runs, latencies, finished = 0, [], []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            start = time.monotonic()
            await compiled.execute([x])
            latencies.append(time.monotonic() - start)
            finished.append(time.monotonic())   # CLOCK_MONOTONIC: the same in every process
            runs += 1
    print(json.dumps({"runs": runs, "latencies": latencies, "finished": finished,
                      "pid": os.getpid()}), flush=True)


# --- the camera loop ------------------------------------------------------------

@dataclass
class Series:
    name: str
    priority: str
    app: str
    latencies: list[float] = field(default_factory=list)   # seconds, successes
    times: list[float] = field(default_factory=list)       # when each finished, from start
    misses: int = 0
    errors: int = 0
    failures: list[tuple[float, float, str]] = field(default_factory=list)  # (t, latency, status)
    timings: list = field(default_factory=list)   # ExecutionTiming of each success, or None
    preemptions: int = 0
    deadline: float | None = None

    def case(self) -> Case:
        timings = self.timings or [None] * len(self.latencies)
        samples = [Sample(t, lat, on_device=None if tm is None else tm.on_device / 1e6,
                          in_driver=None if tm is None else tm.in_driver / 1e6)
                   for t, lat, tm in zip(self.times, self.latencies, timings)]
        samples += [Sample(t, lat, status) for t, lat, status in self.failures]
        samples.sort(key=lambda x: x.t)
        return Case(self.name, self.app, self.priority, priority=self.priority, app=self.app,
                    deadline=self.deadline, samples=samples, preemptions=self.preemptions,
                    wall=max((x.t for x in samples), default=0.0))

    def row(self) -> list[str]:
        lat = sorted(self.latencies)
        p50 = f"{stats.median(lat) * 1e3:.1f}" if lat else "-"
        p99 = f"{lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3:.1f}" if lat else "-"
        return [self.name, self.app, self.priority, str(len(lat) + self.misses + self.errors),
                p50, p99, str(self.misses)]


async def camera_loop(seconds: float, report_path: str | None) -> int:
    # The service runs the reference (numpy) driver: named for what it is.
    async with nnrt.Runtime(spawn=[(SERVICE, "reference", "--app-key", "pid",
                                   "--statistics", "all")],
                            discover=False) as rt:
        npu = rt.device(SERVICE)
        print(f"driver service: {npu.name} ({npu.version_string}) at {npu.socket_path}")
        detector = await rt.compile(detector_model(), priority=nnrt.Priority.HIGH,
                                    devices=[SERVICE])
        background = await rt.compile(chain_model(30, seed=2), priority=nnrt.Priority.LOW,
                                      devices=[SERVICE])
        other = subprocess.Popen([sys.executable, "-m", "nnrt.demo", "--competitor",
                                  npu.socket_path, "--seconds", str(seconds)],
                                 stdout=subprocess.PIPE, text=True)
        sampler = LoadSampler().start()
        high = Series("detector", "HIGH", f"demo (pid {os.getpid()})", deadline=1.0 / FPS)
        low = Series("background", "LOW", high.app)
        rng = np.random.default_rng(0)
        frames = [rng.random(FRAME, dtype=np.float32) for _ in range(8)]
        x_low = rng.random(BACKGROUND, dtype=np.float32)
        period = 1.0 / FPS
        start = time.monotonic()
        stop = start + seconds

        async def keep_busy():
            while time.monotonic() < stop:
                t0 = time.monotonic()
                try:
                    result = await background.execute([x_low], measure_timing=True)
                    low.latencies.append(time.monotonic() - t0)
                    low.timings.append(result.timing)
                    low.times.append(time.monotonic() - start)
                except nnrt.NnrtError:
                    low.errors += 1
                    low.failures.append((time.monotonic() - start, time.monotonic() - t0, ERROR))

        live = sys.stdout.isatty()
        jobs = {}   # the scheduler keeps only its recent jobs: collect them as they finish

        async def collect_jobs():
            for j in await rt.finished_jobs(npu):
                jobs[(j.app, j.seq)] = j

        async def progress():
            # A terminal gets one line rewritten in place; a log gets a line a second.
            while time.monotonic() < stop:
                await anyio.sleep(0.25 if live else 1.0)
                lat = high.latencies
                p50 = f"{stats.median(lat) * 1e3:5.1f}" if lat else "    -"
                print(f"{chr(13) if live else ''}{time.monotonic() - start:4.1f}s  "
                      f"frames {len(lat) + high.misses:4d}  detector p50 {p50} ms  "
                      f"misses {high.misses:3d}  background runs {len(low.latencies):4d}",
                      end="" if live else "\n", flush=True)
                await collect_jobs()

        async with anyio.create_task_group() as tg:
            tg.start_soon(keep_busy)
            tg.start_soon(progress)
            async with detector.burst() as burst:
                frame = 0
                while True:
                    due = start + frame * period
                    if due >= stop:
                        break
                    await anyio.sleep(max(0.0, due - time.monotonic()))
                    t0 = time.monotonic()
                    try:
                        result = await burst.execute([frames[frame % len(frames)]],
                                                     deadline=t0 + period, measure_timing=True)
                        high.latencies.append(time.monotonic() - t0)
                        high.timings.append(result.timing)
                        high.times.append(time.monotonic() - start)
                    except nnrt.NnrtError as e:
                        missed = e.status in (nnrt.ErrorStatus.MISSED_DEADLINE_TRANSIENT,
                                              nnrt.ErrorStatus.MISSED_DEADLINE_PERSISTENT)
                        if missed:
                            high.misses += 1
                        else:
                            high.errors += 1
                        high.failures.append((time.monotonic() - start, time.monotonic() - t0,
                                              MISS if missed else ERROR))
                    frame += 1
        if live:
            print()
        out, _ = other.communicate(timeout=60)
        comp = json.loads(out.strip().splitlines()[-1])
        medium = Series("competitor", "MEDIUM", f"app 2 (pid {comp['pid']})",
                        latencies=comp["latencies"],
                        times=[t - start for t in comp["finished"]])
        statistics = await rt.statistics(npu)
        await collect_jobs()
        machine = sampler.stop()
    preemptions = sum(c.preempted for c in statistics.classes)
    for series in (high, low):
        series.preemptions = sum(c.preempted for c in statistics.classes
                                 if c.app == _app_key(statistics, os.getpid())
                                 and c.priority.name == series.priority)
    # Device time per app over the run, from the jobs collected as they
    # finished (the competitor has exited by now: its rows left the
    # service's statistics, its jobs did not leave this record).
    share = {}
    for j in jobs.values():
        share[j.app] = share.get(j.app, 0.0) + j.ran
    total = sum(share.values()) or 1.0
    rows = [s.row() for s in (high, low, medium)]
    _print_table(["model", "app", "priority", "runs", "p50 ms", "p99 ms", "deadline misses"],
                 rows)
    print(f"preemptions: {preemptions}")
    print("share of device time: " + ", ".join(
        f"{_app_name(app, os.getpid(), comp['pid'])} {t / total:.0%}"
        for app, t in sorted(share.items(), key=lambda kv: str(kv[0]))))
    if report_path:
        names = {app: _app_name(app, os.getpid(), comp["pid"]) for app, _ in jobs}
        page = report.Page(
            "nnrt camera loop",
            intro=(f"{seconds:g} s of a {FPS} fps camera on a driver service ({npu.name}, "
                   f"reference driver, apps told apart by pid): the HIGH detector runs each "
                   f"frame through a burst with a deadline of one frame period "
                   f"({1000 / FPS:.1f} ms) while a LOW background model of the same app keeps "
                   f"the device busy and a second app competes at MEDIUM."),
            command=f"nnrt demo --seconds {seconds:g} --report {report_path}", machine=machine,
            cases=[high.case(), low.case(), medium.case()],
            share=[share_over_time(npu.name, list(jobs.values()), start, names)],
            facts=[f"Preemptions of LOW work by the detector: {preemptions}.",
                   "Share of device time over the run: " + ", ".join(
                       f"{_app_name(app, os.getpid(), comp['pid'])} {t / total:.0%}"
                       for app, t in sorted(share.items(), key=lambda kv: str(kv[0])))])
        report.write(report_path, page)
        print(f"report written to {report_path}")
    return 0


def _app_key(statistics, pid: int):
    """The scheduler's key of the app with process id ``pid`` (a pid, or a
    (uid, pid) pair, depending on the service's --app-key)."""
    for c in statistics.classes:
        if c.app == pid or (isinstance(c.app, tuple) and len(c.app) == 2 and c.app[1] == pid):
            return c.app
    return None


def _app_name(app, me: int, other: int) -> str:
    pid = app[1] if isinstance(app, tuple) and len(app) == 2 else app
    return {me: "demo", other: "app 2"}.get(pid, str(app))


def _print_table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[k]) for r in rows)) for k, h in enumerate(header)]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))


def face_pipeline(argv: list[str]) -> int:
    """``nnrt demo --pipeline``: the face pipeline, examples/face_pipeline.py
    of this checkout (its models are the checkout's and ../shared's)."""
    path = Path(__file__).resolve().parents[1] / "examples" / "face_pipeline.py"
    if not path.exists():
        print(f"nnrt demo --pipeline runs {path}, which is not here: run it from a checkout",
              file=sys.stderr)
        return 2
    return runpy.run_path(str(path))["main"](argv)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nnrt demo", description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="length of the camera loop")
    parser.add_argument("--report", metavar="PATH.html", help="write an HTML report")
    parser.add_argument("--pipeline", action="store_true",
                        help="instead: the face pipeline (examples/face_pipeline.py; its options "
                             "follow, see --pipeline --help)")
    parser.add_argument("--competitor", metavar="SOCKET", help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    if "--pipeline" in argv:
        return face_pipeline([a for a in argv if a != "--pipeline"])
    args = parser.parse_args(argv)
    if args.competitor:
        anyio.run(competitor, args.competitor, args.seconds)
        return 0
    return anyio.run(camera_loop, args.seconds, args.report)


if __name__ == "__main__":
    sys.exit(main())
