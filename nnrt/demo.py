"""`make demo` / `nnrt demo`: a simulated camera loop on a driver service.

A driver service is spawned (the reference driver in its own process, apps
told apart by pid). This app runs a HIGH-priority detector on every frame of
a synthetic 30 fps camera through a burst, each frame with a deadline of one
frame period, while a LOW-priority background model of the same app keeps the
device busy; a second app process competes at MEDIUM priority. A live line
shows progress; the end is a summary table (frames, p50/p99 latency per
model, deadline misses, preemptions, per-app share of device time) and, with
``--report PATH.html``, a self-contained HTML report with latency charts.
"""
from __future__ import annotations

import argparse
import html
import json
import os
import statistics as stats
import subprocess
import sys
import time
from dataclasses import dataclass, field

import anyio
import numpy as np

import nnrt
from nnrt import OperandType as T, OperationType as Op

FPS = 30
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
                                    devices=["npu"])
        x = np.random.default_rng(2).random(BACKGROUND, dtype=np.float32)
        runs, latencies = 0, []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            start = time.monotonic()
            await compiled.execute([x])
            latencies.append(time.monotonic() - start)
            runs += 1
    print(json.dumps({"runs": runs, "latencies": latencies, "pid": os.getpid()}), flush=True)


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

    def row(self) -> list[str]:
        lat = sorted(self.latencies)
        p50 = f"{stats.median(lat) * 1e3:.1f}" if lat else "-"
        p99 = f"{lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3:.1f}" if lat else "-"
        return [self.name, self.app, self.priority, str(len(lat) + self.misses + self.errors),
                p50, p99, str(self.misses)]


async def camera_loop(seconds: float, report: str | None) -> int:
    async with nnrt.Runtime(spawn=[("npu", "reference", "--app-key", "pid")],
                            discover=False) as rt:
        npu = rt.device("npu")
        print(f"driver service: {npu.name} ({npu.version_string}) at {npu.socket_path}")
        detector = await rt.compile(detector_model(), priority=nnrt.Priority.HIGH,
                                    devices=["npu"])
        background = await rt.compile(chain_model(30, seed=2), priority=nnrt.Priority.LOW,
                                      devices=["npu"])
        other = subprocess.Popen([sys.executable, "-m", "nnrt.demo", "--competitor",
                                  npu.socket_path, "--seconds", str(seconds)],
                                 stdout=subprocess.PIPE, text=True)
        high = Series("detector", "HIGH", f"demo (pid {os.getpid()})")
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
                    await background.execute([x_low])
                    low.latencies.append(time.monotonic() - t0)
                    low.times.append(time.monotonic() - start)
                except nnrt.NnrtError:
                    low.errors += 1

        live = sys.stdout.isatty()

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
                        await burst.execute([frames[frame % len(frames)]],
                                            deadline=t0 + period)
                        high.latencies.append(time.monotonic() - t0)
                        high.times.append(time.monotonic() - start)
                    except nnrt.NnrtError as e:
                        if e.status in (nnrt.ErrorStatus.MISSED_DEADLINE_TRANSIENT,
                                        nnrt.ErrorStatus.MISSED_DEADLINE_PERSISTENT):
                            high.misses += 1
                        else:
                            high.errors += 1
                    frame += 1
        if live:
            print()
        out, _ = other.communicate(timeout=60)
        comp = json.loads(out.strip().splitlines()[-1])
        medium = Series("competitor", "MEDIUM", f"app 2 (pid {comp['pid']})",
                        latencies=comp["latencies"])
        statistics = await rt.statistics(npu)
    preemptions = sum(c.preempted for c in statistics.classes)
    share = {}
    for c in statistics.classes:
        share[c.app] = share.get(c.app, 0.0) + c.run_time
    total = sum(share.values()) or 1.0
    rows = [s.row() for s in (high, low, medium)]
    _print_table(["model", "app", "priority", "runs", "p50 ms", "p99 ms", "deadline misses"],
                 rows)
    print(f"preemptions: {preemptions}")
    print("share of device time: " + ", ".join(
        f"{_app_name(app, os.getpid(), comp['pid'])} {t / total:.0%}"
        for app, t in sorted(share.items(), key=lambda kv: str(kv[0]))))
    if report:
        _write_report(report, [high, low, medium], rows, preemptions, share, total,
                      os.getpid(), comp["pid"], seconds)
        print(f"report written to {report}")
    return 0


def _app_name(app, me: int, other: int) -> str:
    pid = app[1] if isinstance(app, tuple) and len(app) == 2 else app
    return {me: "demo", other: "app 2"}.get(pid, str(app))


def _print_table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[k]) for r in rows)) for k, h in enumerate(header)]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))


def _svg_chart(series: list[Series], seconds: float, width=760, height=260) -> str:
    """Latency over time as an inline SVG line chart (no scripts, no network)."""
    colors = {"detector": "#d62728", "background": "#1f77b4", "competitor": "#2ca02c"}
    top = max((max(s.latencies) for s in series if s.latencies), default=0.001) * 1e3 * 1.1
    left, bottom = 50, height - 30

    def xy(t, ms):
        return (left + (width - left - 10) * min(t / seconds, 1.0),
                bottom - (bottom - 10) * min(ms / top, 1.0))

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}">',
             f'<line x1="{left}" y1="{bottom}" x2="{width - 10}" y2="{bottom}" stroke="#444"/>',
             f'<line x1="{left}" y1="10" x2="{left}" y2="{bottom}" stroke="#444"/>',
             f'<text x="5" y="20" font-size="11">{top:.0f} ms</text>',
             f'<text x="5" y="{bottom}" font-size="11">0</text>',
             f'<text x="{width - 60}" y="{height - 8}" font-size="11">{seconds:g} s</text>']
    for k, s in enumerate(series):
        if not s.times:
            continue
        points = " ".join(f"{x:.1f},{y:.1f}" for x, y in
                          (xy(t, lat * 1e3) for t, lat in zip(s.times, s.latencies)))
        color = colors.get(s.name, "#555")
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.2" '
                     f'points="{points}"/>')
        parts.append(f'<text x="{left + 10 + 150 * k}" y="{height - 8}" font-size="12" '
                     f'fill="{color}">{html.escape(s.name)} ({s.priority})</text>')
    parts.append("</svg>")
    return "".join(parts)


def _write_report(path, series, rows, preemptions, share, total, me, other, seconds) -> None:
    table = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>"
                    for r in rows)
    shares = "".join(f"<li>{html.escape(_app_name(a, me, other))}: {t / total:.0%}</li>"
                     for a, t in share.items())
    timed = [s for s in series if s.times]
    doc = f"""<!doctype html><html><head><meta charset="utf-8"><title>nnrt camera loop</title>
<style>body{{font-family:sans-serif;margin:2em}}td,th{{padding:4px 10px;border-bottom:1px solid #ddd}}</style>
</head><body><h1>nnrt camera loop</h1>
<p>{seconds:g} s at {FPS} fps; detector deadline one frame period ({1000 / FPS:.1f} ms).</p>
<table><tr><th>model</th><th>app</th><th>priority</th><th>runs</th><th>p50 ms</th><th>p99 ms</th>
<th>deadline misses</th></tr>{table}</table>
<p>Preemptions: {preemptions}</p><p>Share of device time:</p><ul>{shares}</ul>
<h2>Latency over time</h2>{_svg_chart(timed, seconds)}
</body></html>"""
    with open(path, "w") as f:
        f.write(doc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nnrt demo", description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="length of the camera loop")
    parser.add_argument("--report", metavar="PATH.html", help="write an HTML report")
    parser.add_argument("--competitor", metavar="SOCKET", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.competitor:
        anyio.run(competitor, args.competitor, args.seconds)
        return 0
    return anyio.run(camera_loop, args.seconds, args.report)


if __name__ == "__main__":
    sys.exit(main())
