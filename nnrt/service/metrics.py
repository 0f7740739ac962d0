"""A driver service's per-app figures as a Prometheus metrics endpoint
(``nnrt driver serve ... --metrics HOST:PORT``), for local and remote apps
alike, the way Triton serves its metrics.

Every figure is the service's own accounting, read at scrape time: the
scheduler's statistics (queue depth, running jobs, share, waits, deadline
misses, preemptions: what ``nnrt driver status`` shows) and what each app
holds under the service's limits (connections, models, bursts, mapped
bytes: :meth:`DriverService.holdings`). Apps are labelled as the status
table names them (``pid 1234``, ``remote camera``).

The HTTP server is prometheus-client's (a thread per scrape). A scrape
takes its snapshot on the service's event loop, where the service's state
lives, waiting at most ``SNAPSHOT_TIMEOUT`` seconds; the loop never waits
for a scraper.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..errors import ErrorStatus, NnrtError, invalid
from ..qos.status import app_name, per_app
from .address import is_loopback, split_address

SNAPSHOT_TIMEOUT = 5.0
HELD = ("connections", "models", "bursts", "mapped_bytes")


@dataclass(frozen=True)
class _Snapshot:
    device: str
    statistics: object          # SchedulerStatistics or None
    held: dict                  # resource -> {app: amount}


class ServiceCollector:
    """The collector of one :class:`~nnrt.service.server.DriverService`."""

    def __init__(self, service, loop: asyncio.AbstractEventLoop):
        self.service = service
        self.loop = loop

    async def _snapshot(self) -> _Snapshot:
        service = self.service
        held = {}
        for resource in HELD:
            amounts: dict = {}
            for app, _, amount in service.holdings(resource):
                amounts[app] = amounts.get(app, 0) + amount
            held[resource] = amounts
        return _Snapshot(service.device.name, await service.device.statistics(), held)

    def collect(self):
        snap = asyncio.run_coroutine_threadsafe(self._snapshot(), self.loop).result(
            SNAPSHOT_TIMEOUT)
        device = snap.device
        labels = ["device", "app"]
        gauges = {name: GaugeMetricFamily(f"nnrt_app_{name}", text, labels=labels)
                  for name, text in (
                      ("queued", "jobs waiting for a slot (held ones included)"),
                      ("running", "jobs holding a slot"),
                      ("weight", "the app's weight in the policy"),
                      ("share", "fraction of the device time the app used since first seen"),
                      ("wait_p50_seconds", "median queue wait of recent jobs (worst priority)"),
                      ("wait_p99_seconds", "99th percentile queue wait of recent jobs"),
                      *((r, f"{r.replace('_', ' ')} the app holds") for r in HELD))}
        counters = {name: CounterMetricFamily(f"nnrt_app_{name}", text, labels=labels)
                    for name, text in (
                        ("completed", "jobs finished in time"),
                        ("deadline_misses", "jobs refused, aborted or late on their deadline"),
                        ("preemptions", "times a running job gave its slot back"),
                        ("cancelled", "jobs cancelled"),
                        ("failed", "jobs that failed otherwise"),
                        ("run_seconds", "device seconds used"))}
        slots = GaugeMetricFamily("nnrt_device_slots", "executions the device runs at once",
                                  labels=["device"])
        busy = GaugeMetricFamily("nnrt_device_busy_slots", "slots running a job now",
                                 labels=["device"])
        apps: dict = {}
        stats = snap.statistics
        if stats is not None:
            slots.add_metric([device], stats.slots)
            busy.add_metric([device], stats.busy)
            figures = per_app(stats)
            total = sum(a.run_time for a in figures.values())
            weights = {rule.app: rule.weight for rule in stats.apps}
            for app, a in figures.items():
                apps[app] = {"queued": a.queued, "running": a.running,
                             "completed": a.completed, "deadline_misses": a.deadline_misses,
                             "preemptions": a.preempted, "cancelled": a.cancelled,
                             "failed": a.failed, "run_seconds": a.run_time,
                             "share": a.run_time / total if total else 0.0}
                for name, value in (("wait_p50_seconds", a.wait_p50),
                                    ("wait_p99_seconds", a.wait_p99),
                                    ("weight", weights.get(app))):
                    if value is not None:
                        apps[app][name] = value
        for resource, held in snap.held.items():
            for app, amount in held.items():
                apps.setdefault(app, {})[resource] = amount
        for app, values in apps.items():
            key = [device, app_name(app)]
            for name, value in values.items():
                (counters[name] if name in counters else gauges[name]).add_metric(key, value)
        yield slots
        yield busy
        yield from gauges.values()
        yield from counters.values()


def check_metrics_address(address: str, tls: bool) -> None:
    """INVALID_ARGUMENT for ``--metrics`` on an address that is not
    loopback, unless the endpoint is HTTPS (``tls``)."""
    split_address(address)
    if not tls and not is_loopback(address):
        raise invalid(f"--metrics serves plain HTTP on loopback addresses only, not on "
                      f"{address}: the figures name every app; give --listen with "
                      f"--tls-cert and --tls-key to serve them over HTTPS")


def serve_metrics(service, address: str, loop: asyncio.AbstractEventLoop, *,
                  certfile: str | None = None, keyfile: str | None = None,
                  client_cafile: str | None = None):
    """Start serving ``service``'s metrics on ``address`` (HTTPS with a
    certificate, and client certificates signed by ``client_cafile`` when
    given); returns the HTTP server (``server_port``: the port bound;
    ``shutdown()`` stops it)."""
    check_metrics_address(address, certfile is not None)
    host, port = split_address(address)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServiceCollector(service, loop))
    try:
        server, _ = start_http_server(port, host, registry, certfile=certfile, keyfile=keyfile,
                                      client_cafile=client_cafile,
                                      client_auth_required=client_cafile is not None)
    except OSError as e:
        raise NnrtError(ErrorStatus.DEVICE_UNAVAILABLE,
                        f"cannot serve metrics on {address}: {e.strerror}") from None
    return server
