"""What a benchmark measured: value types shared by the runner, the stress
mode, the report and the demo (plain data, JSON-ready)."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

OK, MISS, ERROR = "ok", "miss", "error"
STAGES = ("app + transport", "queue + parked", "on device")


@dataclass
class Sample:
    """One execution. Times in seconds; ``t`` is when it ended, from the
    start of the benchmark. ``on_device``/``in_driver`` are the timing the
    driver reported (None when not measured)."""

    t: float
    latency: float
    status: str = OK
    on_device: float | None = None
    in_driver: float | None = None

    def stages(self) -> tuple[float, float, float] | None:
        """The latency cut into STAGES from the timings nnrt measures: the
        driver's time on the device, its time beyond that (the scheduler's
        queue and preempted spells: ``in_driver`` counts from the call into
        the QoS front), and the rest (runtime staging, transport: socket or
        burst ring, the app's event loop)."""
        if self.status != OK or self.on_device is None or self.in_driver is None:
            return None
        on_device = min(self.on_device, self.latency)
        in_driver = min(max(self.in_driver, on_device), self.latency)
        return self.latency - in_driver, in_driver - on_device, on_device


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 1]) of sorted values."""
    if not sorted_values:
        return None
    k = max(0, min(len(sorted_values) - 1, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[k]


@dataclass
class Stats:
    runs: int
    ok: int
    misses: int
    errors: int
    p50: float | None
    p90: float | None
    p99: float | None
    max: float | None
    throughput: float | None     # successful executions per second of wall time
    stages: dict[str, float] = field(default_factory=dict)   # mean seconds per stage


@dataclass
class Accuracy:
    """Largest difference of each output against a baseline: absolute for
    floats, in quantization steps (LSB) for integer outputs."""

    against: str                 # "reference device" or "LiteRT (.out*.npy)"
    max_diff: list[float]
    unit: str                    # "abs" or "LSB"
    top1_match: bool | None      # argmax equal, for classifier-shaped outputs
    within_tolerance: bool


@dataclass
class Case:
    """One model x device x mode (or, in the demo, one app's model)."""

    model: str
    device: str
    mode: str
    priority: str = "MEDIUM"
    app: str = "bench"
    deadline: float | None = None          # seconds per execution
    samples: list[Sample] = field(default_factory=list)
    wall: float = 0.0                      # seconds the measured runs took
    warmup: int = 0
    accuracy: list[Accuracy] = field(default_factory=list)
    placement: dict[str, int] = field(default_factory=dict)   # device -> operations
    preemptions: int = 0
    error: str | None = None

    @property
    def label(self) -> str:
        return f"{self.model} · {self.device} · {self.mode}"

    def stats(self) -> Stats:
        ok = sorted(s.latency for s in self.samples if s.status == OK)
        misses = sum(s.status == MISS for s in self.samples)
        errors = sum(s.status == ERROR for s in self.samples)
        cut = [st for st in (s.stages() for s in self.samples) if st is not None]
        stages = {}
        if cut:
            # Means, not medians: the means of the stages add up to the mean
            # latency, medians of parts do not add up to anything.
            for k, name in enumerate(STAGES):
                stages[name] = sum(c[k] for c in cut) / len(cut)
        return Stats(len(self.samples), len(ok), misses, errors, percentile(ok, 0.5),
                     percentile(ok, 0.9), percentile(ok, 0.99), ok[-1] if ok else None,
                     len(ok) / self.wall if self.wall > 0 else None, stages)

    def to_json(self) -> dict:
        d = asdict(self)
        d["stats"] = asdict(self.stats())
        return d


@dataclass
class StressResult:
    model: str
    device: str
    verdict: str             # SUCCESS, FAILURE, CRASH or HANG
    runs: int
    seconds: float
    detail: str              # why, in a line
    last_output: str = ""    # the child's last lines, for anything but SUCCESS


@dataclass
class ShareSeries:
    """Each app's share of one device over time (fractions of the device per
    time bin), from the scheduler's finished jobs."""

    device: str
    bin_seconds: float
    times: list[float]                     # bin starts, seconds from the benchmark start
    shares: dict[str, list[float]]         # app -> fraction per bin


def share_over_time(device: str, jobs, t0: float, names: dict | None = None,
                    bin_seconds: float = 0.5) -> ShareSeries:
    """Spread each finished job's device time (``ran``) evenly over its
    [started, finished] span and sum it per app and time bin. ``jobs`` are
    the scheduler's JobRecords; ``t0`` is the benchmark start on the same
    clock (``time.monotonic``, which every process of the machine shares)."""
    ran = [j for j in jobs if j.started_at is not None and j.ran > 0]
    if not ran:
        return ShareSeries(device, bin_seconds, [], {})
    end = max(j.finished_at for j in ran) - t0
    bins = max(1, math.ceil(end / bin_seconds))
    shares: dict[str, list[float]] = {}
    for j in ran:
        app = (names or {}).get(j.app, str(j.app))
        row = shares.setdefault(app, [0.0] * bins)
        a, b = j.started_at - t0, j.finished_at - t0
        rate = j.ran / (b - a) if b > a else 0.0
        for k in range(max(0, int(a // bin_seconds)), min(bins, int(b // bin_seconds) + 1)):
            lo, hi = max(a, k * bin_seconds), min(b, (k + 1) * bin_seconds)
            if hi > lo:
                row[k] += rate * (hi - lo) / bin_seconds
    return ShareSeries(device, bin_seconds, [k * bin_seconds for k in range(bins)],
                       {app: [min(v, 1.0) for v in row] for app, row in shares.items()})
