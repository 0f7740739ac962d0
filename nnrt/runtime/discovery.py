"""Finding driver services: ``NNRT_DRIVERS``, the config file, and services
the runtime spawns itself.

- ``NNRT_DRIVERS`` holds socket paths separated by ``:`` (``os.pathsep``).
- ``$XDG_CONFIG_HOME/nnrt/drivers.conf`` (``~/.config`` when unset) lists one
  socket path per line; ``#`` starts a comment.
- ``Runtime(spawn=["sample-float-fast", ("gpu0", "reference")])`` starts
  ``nnrt driver serve`` child processes on sockets in a private temporary
  folder and stops them when the runtime closes.

A configured service that does not answer is left out (and logged under the
``manager`` tag): one broken service must not keep an app from running on the
others or on the CPU.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio

from ..drivers.service.client import ServiceDevice
from ..errors import ErrorStatus, NnrtError
from ..vlog import vlog

SPAWN_TIMEOUT = 20.0  # seconds for a spawned service to start listening


def config_file(environ=os.environ) -> Path:
    base = environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "nnrt" / "drivers.conf"


def configured_sockets(environ=os.environ) -> list[str]:
    """Socket paths from NNRT_DRIVERS, then from the config file, without repeats."""
    paths = [p for p in environ.get("NNRT_DRIVERS", "").split(os.pathsep) if p.strip()]
    conf = config_file(environ)
    if conf.exists():
        for line in conf.read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                paths.append(line)
    seen, unique = set(), []
    for p in paths:
        p = p.strip()
        if p not in seen:
            seen.add(p)
            unique.append(p)
    return unique


async def connect_configured(environ=os.environ) -> list[ServiceDevice]:
    devices = []
    for path in configured_sockets(environ):
        try:
            devices.append(await ServiceDevice.connect(path))
        except NnrtError as e:
            vlog("manager", "leaving out the driver service at %s: %s", path, e.message)
    return devices


class SpawnedService:
    """A driver service child process owned by a runtime."""

    def __init__(self, name: str, driver: str, socket_path: str, process: subprocess.Popen):
        self.name = name
        self.driver = driver
        self.socket_path = socket_path
        self.process = process

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


async def spawn(specs, folder: str) -> tuple[list[SpawnedService], list[ServiceDevice]]:
    """Start one service per spec (a driver kind, or a ``(name, driver kind,
    *extra serve arguments)`` tuple such as ``("npu", "reference", "--app-key",
    "pid")``) and connect to each. On any failure, stop what was started."""
    services: list[SpawnedService] = []
    devices: list[ServiceDevice] = []
    try:
        for spec in specs:
            name, driver, *extra = (spec, spec) if isinstance(spec, str) else tuple(spec)
            path = os.path.join(folder, f"{name}.sock")
            process = subprocess.Popen(
                [sys.executable, "-m", "nnrt", "driver", "serve", name, "--driver", driver,
                 "--socket", path, *extra],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)
            services.append(SpawnedService(name, driver, path, process))
        for service in services:
            devices.append(await _connect_when_up(service))
    except BaseException:
        for d in devices:
            d.close()
        for s in services:
            s.stop()
        raise
    return services, devices


async def _connect_when_up(service: SpawnedService) -> ServiceDevice:
    # Polling the socket path while the child starts is bounded and happens
    # once per service, at Runtime start; the alternative (a readiness pipe)
    # would need the service to know it was spawned.
    deadline = time.monotonic() + SPAWN_TIMEOUT
    while True:
        if service.process.poll() is not None:
            raise NnrtError(ErrorStatus.DEVICE_UNAVAILABLE,
                            f"driver service {service.name} ({service.driver}) exited with "
                            f"status {service.process.returncode} while starting")
        if os.path.exists(service.socket_path):
            try:
                return await ServiceDevice.connect(service.socket_path)
            except NnrtError:
                pass
        if time.monotonic() > deadline:
            raise NnrtError(ErrorStatus.DEVICE_UNAVAILABLE,
                            f"driver service {service.name} did not start listening within "
                            f"{SPAWN_TIMEOUT:g} s")
        await anyio.sleep(0.02)


def private_folder() -> tempfile.TemporaryDirectory:
    return tempfile.TemporaryDirectory(prefix="nnrt-services-")
