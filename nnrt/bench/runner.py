"""``nnrt bench``: latency, throughput, per-stage cost, accuracy and
placement per model x device x mode.

Each case compiles the model for one device (with the reference CPU device
beside it when the device does not take every operation, as NNAPI falls
back), warms up, then runs ``runs`` executions (or for ``seconds``) one
after another, each timed from the app's call to its result, with the
driver's timing asked for so the latency can be cut into stages. Accuracy
is checked once per case on a fresh state: against the reference driver
(the oracle) and against the LiteRT outputs (``<stem>.out<i>.npy``) when they
lie beside the model.
"""
from __future__ import annotations

import glob
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import anyio
import numpy as np

import nnrt
from ..runtime import partition
from .machine import LoadSampler, MachineInfo
from .results import ERROR, MISS, OK, Accuracy, Case, Sample

MODES = ("execute", "burst", "fenced", "sync")
_MISSES = (nnrt.ErrorStatus.MISSED_DEADLINE_TRANSIENT, nnrt.ErrorStatus.MISSED_DEADLINE_PERSISTENT)


@dataclass
class BenchConfig:
    models: list[str]
    devices: list[str] | None = None        # None: every device the runtime finds
    modes: list[str] = field(default_factory=lambda: ["execute", "burst"])
    runs: int | None = 50
    seconds: float | None = None            # instead of runs
    warmup: int = 3
    deadline_ms: float | None = None
    priority: str = "MEDIUM"
    spawn: list[str] = field(default_factory=list)
    discover: bool = True
    seed: int = 0


@dataclass
class BenchResult:
    config: BenchConfig
    machine: MachineInfo
    cases: list[Case]
    command: str = ""

    def to_json(self) -> dict:
        return {"command": self.command, "config": asdict(self.config),
                "machine": self.machine.to_json(), "cases": [c.to_json() for c in self.cases]}


# -- models and their data -------------------------------------------------------

def load_model(path: str) -> nnrt.Model:
    if not path.endswith(".tflite"):
        raise nnrt.NnrtError(nnrt.ErrorStatus.INVALID_ARGUMENT,
                             f"{path}: nnrt bench reads .tflite models")
    import nnrt.tflite
    return nnrt.tflite.load(path)


def _numbered(pattern: str, tag: str) -> list[str]:
    found = glob.glob(pattern)
    key = re.compile(rf"\.{tag}(\d+)\.npy$")
    found = [f for f in found if key.search(f)]
    return sorted(found, key=lambda f: int(key.search(f).group(1)))


def reference_files(path: str) -> tuple[list[str], list[str]]:
    """Input and LiteRT output files beside a model: ``<stem>.in<i>.npy`` and
    ``<stem>.out<i>.npy``, or the first ``<stem>.<case>.in<i>.npy`` set."""
    stem = glob.escape(path[: -len(".tflite")] if path.endswith(".tflite") else path)
    ins = _numbered(f"{stem}.in*.npy", "in")
    if ins:
        return ins, _numbered(f"{stem}.out*.npy", "out")
    cases = sorted({f[: f.rindex(".in")] for f in _numbered(f"{stem}.*.in*.npy", "in")})
    if not cases:
        return [], []
    case = glob.escape(cases[0])
    return _numbered(f"{case}.in*.npy", "in"), _numbered(f"{case}.out*.npy", "out")


def random_input(info, rng: np.random.Generator) -> np.ndarray:
    shape = tuple(1 if d is None else d for d in info.shape)
    if info.dtype.kind == "f":
        return rng.uniform(-1, 1, shape).astype(info.dtype)
    if info.dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(info.dtype)
    limits = np.iinfo(info.dtype)
    return rng.integers(max(limits.min, -128), min(limits.max, 255) + 1, shape).astype(info.dtype)


def litert_reference_outputs(path: str) -> list[str]:
    """``<stem>.ref_out<i>.npy``: LiteRT's outputs with its reference kernels
    (BUILTIN_REF), which a bit-faithful numpy driver should match more
    closely than XNNPACK's ``.out`` files (shared/models/README.md)."""
    stem = glob.escape(path[: -len(".tflite")] if path.endswith(".tflite") else path)
    return _numbered(f"{stem}.ref_out*.npy", "ref_out")


def model_inputs(path: str, compiled, seed: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The inputs to run with (beside the model, else random) and the LiteRT
    outputs to compare with (empty when there are none)."""
    ins, outs = reference_files(path)
    if len(ins) == len(compiled.inputs):
        return [np.load(f) for f in ins], [np.load(f) for f in outs]
    rng = np.random.default_rng(seed)
    return [random_input(info, rng) for info in compiled.inputs], []


def compare(got: list[np.ndarray], want: list[np.ndarray], against: str,
            quant_steps: list[bool] | None = None,
            beside: list[np.ndarray] | None = None) -> Accuracy:
    """Largest difference per output; within tolerance means floats within
    1e-3 of the largest reference magnitude (at least 1) and integers within
    one quantization step -- or no further from ``want`` than ``beside`` is
    (another implementation's outputs for the same inputs: XNNPACK's, when
    ``want`` are LiteRT's reference kernels, which XNNPACK itself does not
    meet on every model)."""
    if beside is not None and len(beside) == len(want):
        yardstick = compare(beside, want, against).max_diff
    else:
        yardstick = [0.0] * len(want)
    diffs, unit, ok, top1 = [], "abs", True, None
    for a, b, allowed in zip(got, want, yardstick):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape:
            return Accuracy(against, [float("inf")], "shape", None, False)
        if a.dtype.kind in "iub" and b.dtype.kind in "iub":
            d = float(np.max(np.abs(a.astype(np.int64) - b.astype(np.int64)))) if a.size else 0.0
            unit = "LSB" if a.dtype.kind != "b" else "abs"
            ok &= d <= max(1, allowed)
        else:
            a64, b64 = a.astype(np.float64), b.astype(np.float64)
            d = float(np.max(np.abs(a64 - b64))) if a.size else 0.0
            scale = max(1.0, float(np.max(np.abs(b64))) if b.size else 1.0)
            ok &= d <= max(1e-3 * scale, allowed)
        diffs.append(d)
    first = (np.asarray(got[0]), np.asarray(want[0])) if got and want else None
    if first is not None and first[0].ndim == 2 and first[0].shape[0] == 1 \
            and first[0].shape[1] > 1:
        top1 = bool(np.argmax(first[0]) == np.argmax(first[1]))
    return Accuracy(against, diffs, unit, top1, bool(ok))


# -- one case ----------------------------------------------------------------------

class _Clock:
    def __init__(self, t0: float):
        self.t0 = t0

    def since(self) -> float:
        return time.monotonic() - self.t0


def _sample(clock: _Clock, start: float, result=None, error: nnrt.NnrtError | None = None,
            timing=None) -> Sample:
    latency = time.monotonic() - start
    if error is not None:
        status = MISS if error.status in _MISSES else ERROR
        return Sample(clock.since(), latency, status)
    timing = timing if timing is not None else (result.timing if result is not None else None)
    on_device = in_driver = None
    if timing is not None and timing.on_device is not None:
        on_device, in_driver = timing.on_device / 1e6, timing.in_driver / 1e6
    return Sample(clock.since(), latency, OK, on_device, in_driver)


async def _execute_fenced(compiled, inputs, deadline):
    fence, callback = await compiled.execute_fenced(inputs, measure_timing=True,
                                                    deadline=deadline)
    await fence.wait_signaled()
    return await callback.result()


class _Modes:
    """One execution in each mode; ``__aenter__`` opens what a mode keeps
    open (a burst session)."""

    def __init__(self, compiled, mode: str):
        self.compiled, self.mode = compiled, mode
        self._burst = None

    async def __aenter__(self):
        if self.mode == "burst":
            self._burst = await self.compiled.burst().__aenter__()
        return self

    async def __aexit__(self, *exc):
        if self._burst is not None:
            await self._burst.__aexit__(*exc)

    async def run(self, inputs, deadline):
        if self.mode == "execute":
            return await self.compiled.execute(inputs, measure_timing=True, deadline=deadline)
        if self.mode == "burst":
            return await self._burst.execute(inputs, measure_timing=True, deadline=deadline)
        if self.mode == "fenced":
            return await _execute_fenced(self.compiled, inputs, deadline)
        # sync: a blocking app thread that waits for each execution (what a
        # synchronous caller pays: the hop into the runtime's loop and back).
        return await anyio.to_thread.run_sync(
            lambda: anyio.from_thread.run(lambda: self.compiled.execute(
                inputs, measure_timing=True, deadline=deadline)))


async def _preemptions(rt, device) -> int:
    stats = await rt.statistics(device)
    return 0 if stats is None else sum(c.preempted for c in stats.classes)


async def run_case(rt, path: str, model: nnrt.Model, device, mode: str, config: BenchConfig,
                   clock: _Clock, reference: list[np.ndarray] | None,
                   progress: Callable[[Case, int, int | None], None]) -> Case:
    name = os.path.basename(path).removesuffix(".tflite")
    case = Case(name, device.name, mode, priority=config.priority, warmup=config.warmup,
                deadline=None if config.deadline_ms is None else config.deadline_ms / 1e3)
    hal = model.hal_model
    supported = await rt.supported_operations(model, [device])
    devices = [device] if all(supported) else [device, rt.cpu]
    if rt.cpu in devices and device is not rt.cpu:
        flags = [await d.supported_operations(hal) for d in devices]
    else:
        flags = [supported]
    chosen, _ = partition.place(hal, devices, flags, nnrt.ExecutionPreference.FAST_SINGLE_ANSWER)
    for d in chosen:
        case.placement[d.name] = case.placement.get(d.name, 0) + 1
    compiled = await rt.compile(model, devices=devices, priority=nnrt.Priority[config.priority])
    try:
        inputs, litert = model_inputs(path, compiled, config.seed)
        # Accuracy on a fresh state (stateful models carry state between runs).
        compiled.reset_state()
        first = await compiled.execute(inputs)
        if reference is not None and device is not rt.cpu:
            case.accuracy.append(compare(first.outputs, reference, "reference device"))
        if litert:
            case.accuracy.append(compare(first.outputs, litert, "LiteRT (.out*.npy)"))
            ref_kernels = litert_reference_outputs(path)
            if len(ref_kernels) == len(litert):
                case.accuracy.append(compare(first.outputs, [np.load(f) for f in ref_kernels],
                                             "LiteRT reference kernels (.ref_out*.npy)",
                                             beside=litert))
        preempted_before = await _preemptions(rt, device)
        async with _Modes(compiled, mode) as runner:
            for _ in range(config.warmup):
                try:
                    await runner.run(inputs, None)
                except nnrt.NnrtError:
                    pass
            total = config.runs if config.seconds is None else None
            start = time.monotonic()
            stop = None if config.seconds is None else start + config.seconds
            while (len(case.samples) < total) if total is not None else time.monotonic() < stop:
                t = time.monotonic()
                deadline = None if case.deadline is None else t + case.deadline
                try:
                    result = await runner.run(inputs, deadline)
                    case.samples.append(_sample(clock, t, result))
                except nnrt.NnrtError as e:
                    case.samples.append(_sample(clock, t, error=e))
                progress(case, len(case.samples), total)
            case.wall = time.monotonic() - start
        case.preemptions = await _preemptions(rt, device) - preempted_before
    finally:
        compiled.close()
    return case


# -- the whole benchmark ----------------------------------------------------------------

class _Progress:
    """A live display on a terminal (rich), plain lines otherwise."""

    def __init__(self, live: bool):
        self.live = live
        self._progress = None
        self._task = None
        self._last = 0.0

    def __enter__(self):
        if self.live:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
            self._progress = Progress(TextColumn("{task.description}"), BarColumn(),
                                      TextColumn("{task.fields[status]}"), TimeElapsedColumn())
            self._progress.__enter__()
        return self

    def __exit__(self, *exc):
        if self._progress is not None:
            self._progress.__exit__(*exc)

    def start(self, label: str, total: int | None) -> None:
        if self._progress is not None:
            self._task = self._progress.add_task(label, total=total, status="warming up")
        else:
            print(f"{label}: running", flush=True)

    def update(self, case: Case, done: int, total: int | None) -> None:
        now = time.monotonic()
        if now - self._last < 0.2:
            return
        self._last = now
        s = case.stats()
        p50 = "-" if s.p50 is None else f"{s.p50 * 1e3:.2f} ms"
        if self._progress is not None:
            self._progress.update(self._task, completed=done,
                                  status=f"{done} runs  p50 {p50}  misses {s.misses}")

    def done(self, case: Case) -> None:
        s = case.stats()
        line = (f"{case.label}: {s.runs} runs, p50 {_ms(s.p50)} p99 {_ms(s.p99)} ms, "
                f"misses {s.misses}, errors {s.errors}" if case.error is None
                else f"{case.label}: {case.error}")
        if self._progress is not None:
            self._progress.update(self._task, completed=s.runs, status="done")
            self._progress.console.print(line)
        else:
            print(line, flush=True)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.2f}"


async def run_bench(config: BenchConfig, *, live: bool | None = None,
                    runtime_devices=None) -> BenchResult:
    """Run every case of ``config``. ``runtime_devices`` replaces discovery
    (tests use test-double drivers)."""
    for mode in config.modes:
        if mode not in MODES:
            raise nnrt.NnrtError(nnrt.ErrorStatus.INVALID_ARGUMENT,
                                 f"mode {mode!r} is not one of {', '.join(MODES)}")
    live = sys.stdout.isatty() if live is None else live
    sampler = LoadSampler().start()
    clock = _Clock(time.monotonic())
    cases: list[Case] = []
    kwargs = ({"devices": runtime_devices} if runtime_devices is not None
              else {"spawn": config.spawn, "discover": config.discover})
    try:
        async with nnrt.Runtime(**kwargs) as rt:
            devices = ([rt.device(n) for n in config.devices] if config.devices
                       else rt.devices)
            with _Progress(live) as progress:
                for path in config.models:
                    model = load_model(path)
                    reference = None
                    if any(d is not rt.cpu for d in devices):
                        oracle = await rt.compile(model, devices=[rt.cpu])
                        inputs, _ = model_inputs(path, oracle, config.seed)
                        reference = (await oracle.execute(inputs)).outputs
                        oracle.close()
                    for device in devices:
                        for mode in config.modes:
                            label = f"{os.path.basename(path)} · {device.name} · {mode}"
                            progress.start(label, config.runs if config.seconds is None else None)
                            try:
                                case = await run_case(rt, path, model, device, mode, config,
                                                      clock, reference, progress.update)
                            except nnrt.NnrtError as e:
                                case = Case(os.path.basename(path).removesuffix(".tflite"),
                                            device.name, mode, error=f"{e.status.name}: {e.message}")
                            cases.append(case)
                            progress.done(case)
    finally:
        machine = sampler.stop()
    return BenchResult(config, machine, cases)


def summary_rows(result: BenchResult) -> list[list[str]]:
    rows = []
    for c in result.cases:
        s = c.stats()
        acc = "; ".join(f"{_SHORT.get(a.against, a.against)} "
                        f"{max(a.max_diff):.3g}{'' if a.unit == 'abs' else ' ' + a.unit}"
                        f"{'' if a.top1_match is None else (' top1 ok' if a.top1_match else ' top1 differs')}"
                        for a in c.accuracy) or "-"
        place = ", ".join(f"{d} {n}" for d, n in c.placement.items()) or "-"
        if c.error is not None:
            rows.append([c.model, c.device, c.mode, "-", "-", "-", "-", "-", "-", "-", "-",
                         c.error[:60]])
            continue
        rows.append([c.model, c.device, c.mode, str(s.runs), _ms(s.p50), _ms(s.p90), _ms(s.p99),
                     _ms(s.max), "-" if s.throughput is None else f"{s.throughput:.1f}",
                     f"{s.misses}/{s.errors}", place, acc])
    return rows


_SHORT = {"reference device": "ref", "LiteRT (.out*.npy)": "LiteRT",
          "LiteRT reference kernels (.ref_out*.npy)": "LiteRT-ref"}
SUMMARY_HEADER = ["model", "device", "mode", "runs", "p50 ms", "p90 ms", "p99 ms", "max ms",
                  "runs/s", "miss/err", "operations on", "accuracy (max diff)"]
