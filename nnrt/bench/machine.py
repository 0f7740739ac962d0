"""The machine a benchmark ran on, and how busy it was meanwhile.

Timings on a shared machine are only as good as the machine was quiet: the
report shows the CPU, the load average and the share of time the host stole
from this VM (``steal`` in /proc/stat) over the run, so a noisy run is
visible as such instead of passing for a slow runtime.
"""
from __future__ import annotations

import os
import platform
import threading
import time
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True, slots=True)
class CpuTimes:
    """Cumulative jiffies of all CPUs (the first line of /proc/stat)."""

    busy: int
    idle: int
    steal: int

    @property
    def total(self) -> int:
        return self.busy + self.idle + self.steal


def parse_proc_stat(text: str) -> CpuTimes:
    for line in text.splitlines():
        if line.startswith("cpu "):
            v = [int(x) for x in line.split()[1:]]
            v += [0] * (8 - len(v))
            user, nice, system, idle, iowait, irq, softirq, steal = v[:8]
            # guest time is already counted in user (kernel docs), so not added.
            return CpuTimes(user + nice + system + irq + softirq, idle + iowait, steal)
    raise ValueError("no aggregate 'cpu' line in /proc/stat")


def cpu_times() -> CpuTimes | None:
    try:
        with open("/proc/stat") as f:
            return parse_proc_stat(f.read())
    except (OSError, ValueError):
        return None


def shares(before: CpuTimes, after: CpuTimes) -> tuple[float, float]:
    """(busy, steal) fractions of the CPU time between two samples."""
    total = after.total - before.total
    if total <= 0:
        return 0.0, 0.0
    return (after.busy - before.busy) / total, (after.steal - before.steal) / total


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@dataclass
class LoadSample:
    t: float            # seconds since the sampler started
    load1: float        # 1-minute load average
    busy: float         # fraction of all CPUs busy since the previous sample
    steal: float        # fraction stolen by the host since the previous sample


@dataclass
class MachineInfo:
    cpu: str
    cpus: int
    python: str
    numpy: str
    kernel: str
    load_start: tuple[float, float, float]
    load_end: tuple[float, float, float] = (0.0, 0.0, 0.0)
    busy: float = 0.0      # over the whole run
    steal: float = 0.0     # over the whole run
    samples: list[LoadSample] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        return (f"{self.cpu}, {self.cpus} CPUs; load average {self.load_start[0]:.2f} -> "
                f"{self.load_end[0]:.2f}; CPU busy {self.busy:.0%}, stolen by the host "
                f"{self.steal:.1%}")


class LoadSampler:
    """Samples the load average and /proc/stat every ``period`` seconds on a
    thread, from ``start()`` to ``stop()``, which returns the MachineInfo."""

    def __init__(self, period: float = 0.5):
        import numpy
        self.period = period
        self.info = MachineInfo(cpu_model(), os.cpu_count() or 1, platform.python_version(),
                                numpy.__version__, platform.release(), os.getloadavg())
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._first: CpuTimes | None = None
        self._t0 = 0.0

    def start(self) -> "LoadSampler":
        self._t0 = time.monotonic()
        self._first = cpu_times()
        self._thread = threading.Thread(target=self._run, name="nnrt-bench-load", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        previous = self._first
        while not self._stop.wait(self.period):
            now = cpu_times()
            if previous is not None and now is not None:
                busy, steal = shares(previous, now)
                self.info.samples.append(LoadSample(time.monotonic() - self._t0,
                                                    os.getloadavg()[0], busy, steal))
            previous = now

    def stop(self) -> MachineInfo:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.info.load_end = os.getloadavg()
        last = cpu_times()
        if self._first is not None and last is not None:
            self.info.busy, self.info.steal = shares(self._first, last)
        return self.info
