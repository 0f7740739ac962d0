"""What ``nnrt driver status`` shows: one row per app of a device's
scheduler, from its statistics and its recent finished jobs, and the
reload of a service's policy file (``nnrt driver serve --policy``).
Formatting only; the CLI does the I/O."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Hashable, Iterable

from ..handoff import run_in_worker
from .policy import Policy
from .scheduler import JobRecord, SchedulerStatistics

_MISSES = ("MISSED_DEADLINE_TRANSIENT", "MISSED_DEADLINE_PERSISTENT")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def app_name(app: Hashable) -> str:
    """An app key as the table (and the metrics) name it: ``pid 1234``, ``remote camera``."""
    if isinstance(app, tuple) and len(app) == 2:
        return f"{app[0]} {app[1]}"
    return str(app)


_HEADER = (f"{'rule':<12} {'weight':>6} {'cap':<6} {'queued':>6} {'run':>3} "
           f"{'share':>6} {'recent':>6} {'wait p50':>8} {'wait p99':>8} {'done':>7} "
           f"{'preempt':>7} {'misses':>6}")


@dataclass
class AppFigures:
    """One app's figures summed over its priorities (its waits: the worst
    priority's): what ``nnrt driver status`` and the metrics show."""

    queued: int = 0
    running: int = 0
    completed: int = 0
    preempted: int = 0
    deadline_misses: int = 0
    cancelled: int = 0
    failed: int = 0
    run_time: float = 0.0
    wait_p50: float | None = None
    wait_p99: float | None = None


_WORST = ("wait_p50", "wait_p99")     # the worst priority's; every other figure is a sum
_SUMMED = tuple(f.name for f in fields(AppFigures) if f.name not in _WORST)


def per_app(stats: SchedulerStatistics) -> dict:
    """``{app: AppFigures}`` of the scheduler's classes."""
    apps: dict = {}
    for c in stats.classes:
        a = apps.setdefault(c.app, AppFigures())
        for name in _SUMMED:
            setattr(a, name, getattr(a, name) + getattr(c, name))
        for name in _WORST:
            v = getattr(c, name)
            if v is not None:
                setattr(a, name, v if getattr(a, name) is None else max(getattr(a, name), v))
    return apps


def _rows(stats: SchedulerStatistics, jobs: Iterable[JobRecord]) -> list[tuple[str, str]]:
    """Per app (most device time first): its name and the columns of
    :data:`_HEADER` -- policy rule, weight and priority cap, queue depth
    (waiting, held included), running jobs, share of the device time (since
    it was first seen, and over the recent finished jobs), queue waits
    p50/p99 (worst of its priorities), jobs done, preemptions and deadline
    misses."""
    apps = per_app(stats)
    recent: dict = {}
    for r in jobs:
        recent[r.app] = recent.get(r.app, 0.0) + r.ran
    total = sum(a.run_time for a in apps.values()) or 1.0
    recent_total = sum(recent.values()) or 1.0
    policy = {a.app: a for a in stats.apps}
    rows = []
    for app, a in sorted(apps.items(), key=lambda kv: -kv[1].run_time):
        rule = policy.get(app)
        name = rule.who if rule and rule.who else app_name(app)
        rows.append((name, f"{rule.rule if rule else '-':<12.12} "
                           f"{f'{rule.weight:g}' if rule else '-':>6} "
                           f"{rule.max_priority.name if rule else '-':<6} "
                           f"{a.queued:>6} {a.running:>3} "
                           f"{100 * a.run_time / total:>5.1f}% "
                           f"{100 * recent.get(app, 0.0) / recent_total:>5.1f}% "
                           f"{_ms(a.wait_p50):>8} {_ms(a.wait_p99):>8} {a.completed:>7} "
                           f"{a.preempted:>7} {a.deadline_misses:>6}"))
    return rows


def _fit(name: str, width: int) -> str:
    # As wide as the longest app's name (the pid at its end must show), to a
    # bound: a long script name is cut at its start.
    return name if len(name) <= width else "…" + name[-(width - 1):]


def _width(names) -> int:
    return min(48, max([16, *(len(n) for n in names)]))


def render(device: str, stats: SchedulerStatistics | None,
           jobs: Iterable[JobRecord] = ()) -> str:
    """A table of the device's apps: one row each (see :func:`_rows`)."""
    if stats is None:
        return f"{device}: no scheduler"
    rows = _rows(stats, jobs)
    width = _width(name for name, _ in rows)
    lines = [f"{device}: {stats.busy}/{stats.slots} slot(s) busy, {len(rows)} app(s)",
             f"{'app':<{width}} {_HEADER}"]
    lines += [f"{_fit(name, width):<{width}} {cells}" for name, cells in rows]
    return "\n".join(lines)


def render_hosts(hosts: Iterable[tuple]) -> str:
    """One table of several services' apps (``nnrt driver status --remote``):
    ``hosts`` are ``(host, device, statistics, jobs)`` of a service that
    answered, or ``(host, reason)`` of one that did not -- a row saying so.
    The columns are :func:`render`'s after the host's and its device's (a
    share is of that host's device)."""
    lines, named = [], []
    for entry in hosts:
        if len(entry) == 2:
            named.append((entry[0], "", None, f"unreachable: {entry[1]}"))
            continue
        host, device, stats, jobs = entry
        if stats is None:
            named.append((host, device, None, "no scheduler"))
            continue
        busy = f"{stats.busy}/{stats.slots} busy"
        rows = _rows(stats, jobs)
        if not rows:
            named.append((host, device, None, f"{busy}, no app"))
        for name, cells in rows:
            named.append((host, f"{device} ({busy})", name, cells))
    hw = max([4, *(len(h) for h, *_ in named)])
    dw = max([6, *(len(d) for _, d, *_ in named)])
    width = _width(n for _, _, n, _ in named if n is not None)
    lines.append(f"{'host':<{hw}} {'device':<{dw}} {'app':<{width}} {_HEADER}")
    for host, device, name, cells in named:
        if name is None:
            lines.append(f"{host:<{hw}} {device:<{dw}} {cells}")
        else:
            lines.append(f"{host:<{hw}} {device:<{dw}} {_fit(name, width):<{width}} {cells}")
    return "\n".join(lines)


async def reload_policy(device, path: str) -> str:
    """Read ``path`` again and apply it to ``device`` (a ScheduledDevice);
    returns a line to log. The file is read on a worker thread, the policy
    applied on the caller's loop. A file that does not load leaves the old
    policy in place (an operator's typo must not take the service down)."""
    try:
        policy = await run_in_worker(Policy.load, path)
    except Exception as e:   # NnrtError from the parser, OSError: keep the old one
        return f"policy {path} not reloaded, keeping the previous one: {e}"
    device.set_policy(policy)
    return f"policy {path} reloaded: {len(policy.rules)} rule(s)"
