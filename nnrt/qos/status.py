"""What ``nnrt driver status`` shows: one row per app of a device's
scheduler, from its statistics and its recent finished jobs, and the
reload of a service's policy file (``nnrt driver serve --policy``).
Formatting only; the CLI does the I/O."""
from __future__ import annotations

from typing import Hashable, Iterable

from ..handoff import run_in_worker
from .policy import Policy
from .scheduler import JobRecord, SchedulerStatistics

_MISSES = ("MISSED_DEADLINE_TRANSIENT", "MISSED_DEADLINE_PERSISTENT")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def _app_name(app: Hashable) -> str:
    if isinstance(app, tuple) and len(app) == 2:
        return f"{app[0]} {app[1]}"
    return str(app)


def render(device: str, stats: SchedulerStatistics | None,
           jobs: Iterable[JobRecord] = ()) -> str:
    """A table: per app its policy rule, weight and priority cap, its queue
    depth (waiting, held included), running
    jobs, share of the device time (since it was first seen, and over the
    recent finished jobs), queue waits p50/p99 (worst of its priorities),
    preemptions and deadline misses."""
    if stats is None:
        return f"{device}: no scheduler"
    apps: dict = {}
    for c in stats.classes:
        a = apps.setdefault(c.app, dict(queued=0, running=0, run=0.0, p50=None, p99=None,
                                        preempted=0, misses=0, done=0))
        a["queued"] += c.queued
        a["running"] += c.running
        a["run"] += c.run_time
        a["preempted"] += c.preempted
        a["misses"] += c.deadline_misses
        a["done"] += c.completed
        for k, v in (("p50", c.wait_p50), ("p99", c.wait_p99)):
            if v is not None:
                a[k] = v if a[k] is None else max(a[k], v)
    recent: dict = {}
    for r in jobs:
        recent[r.app] = recent.get(r.app, 0.0) + r.ran
    total = sum(a["run"] for a in apps.values()) or 1.0
    recent_total = sum(recent.values()) or 1.0
    policy = {a.app: a for a in stats.apps}
    def who(app) -> str:
        rule = policy.get(app)
        return rule.who if rule and rule.who else _app_name(app)

    # As wide as the longest app's name (the pid at its end must show), to a
    # bound: a long script name is cut at its start.
    width = min(48, max([16, *(len(who(app)) for app in apps)]))
    lines = [f"{device}: {stats.busy}/{stats.slots} slot(s) busy, {len(apps)} app(s)",
             f"{'app':<{width}} {'rule':<12} {'weight':>6} {'cap':<6} {'queued':>6} {'run':>3} "
             f"{'share':>6} {'recent':>6} {'wait p50':>8} {'wait p99':>8} {'done':>7} "
             f"{'preempt':>7} {'misses':>6}"]
    for app, a in sorted(apps.items(), key=lambda kv: -kv[1]["run"]):
        rule = policy.get(app)
        name = who(app)
        name = name if len(name) <= width else "…" + name[-(width - 1):]
        lines.append(f"{name:<{width}} {rule.rule if rule else '-':<12.12} "
                     f"{f'{rule.weight:g}' if rule else '-':>6} "
                     f"{rule.max_priority.name if rule else '-':<6} "
                     f"{a['queued']:>6} {a['running']:>3} "
                     f"{100 * a['run'] / total:>5.1f}% "
                     f"{100 * recent.get(app, 0.0) / recent_total:>5.1f}% "
                     f"{_ms(a['p50']):>8} {_ms(a['p99']):>8} {a['done']:>7} "
                     f"{a['preempted']:>7} {a['misses']:>6}")
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
