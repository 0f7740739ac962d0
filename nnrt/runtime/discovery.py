"""Finding driver services: ``NNRT_DRIVERS``, the config file, and services
the runtime spawns itself.

- ``NNRT_DRIVERS`` holds absolute socket paths separated by ``:`` or ``,``,
  remote services (``grpc://HOST:PORT``, ``grpcs://HOST:PORT``) and pools
  of remote services (``pool:NAME=TARGET+TARGET...``) separated by ``,``.
- ``$XDG_CONFIG_HOME/nnrt/drivers.conf`` (``~/.config`` when unset) lists one
  of these per line; ``#`` starts a comment.
- ``Runtime(spawn=["sample-float-fast", ("gpu0", "reference")])`` starts
  ``nnrt driver serve`` child processes on sockets in a private temporary
  folder and stops them when the runtime closes.

A configured service that does not answer is left out (logged at WARNING
on the ``nnrt.manager`` logger; ``Runtime.services`` and ``nnrt devices``
list each one's state), and an open runtime connects to it again once a new
socket appears on its path (``Reconnector``): one broken service must not keep an app from running on the
others or on the CPU. "Does not answer" includes a socket that accepts and
then stays silent: connecting, HELLO and the device queries together get
``CONNECT_TIMEOUT`` seconds (``NNRT_CONNECT_TIMEOUT`` overrides it); each
later control call ``CALL_TIMEOUT`` (``NNRT_CALL_TIMEOUT``).

Whom an app talks to. An app sends a service its models and its memories,
so it connects only to a socket owned by its own user (or root) in a folder
nobody else can write to (or a sticky one, like /tmp, where nobody else can
replace our file) -- the rule ssh applies to its files. Anything else is
left out with a message, unless the socket's owner is listed in
``NNRT_TRUSTED_USERS`` (user names or uids, separated by commas): that is
how an app opts in to a service an operator runs as another user.

Spawned services get ``--parent-pid``: they stop when the app's process
dies, however it dies (see ``nnrt driver serve``).
"""
from __future__ import annotations

import os
import pwd
import signal
import stat
import subprocess
import sys
import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import anyio

from ..service.client import CALL_TIMEOUT, CONNECT_TIMEOUT, ServiceDevice
from ..errors import ErrorStatus, NnrtError, invalid
from ..hal import AppDeclaration, Device
from ..vlog import vlog

_log = logging.getLogger("nnrt.manager")

SPAWN_TIMEOUT = 20.0  # seconds for a spawned service to start listening


def config_file(environ=os.environ) -> Path:
    base = environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "nnrt" / "drivers.conf"


def _remote():
    """The remote client module, loaded (with gRPC) only when a remote
    service is configured or asked for."""
    from ..service.remote import client
    return client


def _pool():
    from ..service.remote import pool
    return pool


POOL_PREFIX = "pool:"


def is_remote(entry: str) -> bool:
    """Whether a configured entry names a remote service (``grpc://``,
    ``grpcs://``) or a pool of them (``pool:NAME=...``) rather than a
    socket path."""
    return entry.startswith(("grpc://", "grpcs://", POOL_PREFIX))


def _check_remote(entry: str) -> None:
    """INVALID_ARGUMENT for a remote entry that does not parse."""
    if entry.startswith(POOL_PREFIX):
        _pool().parse_pool(entry)
    else:
        _remote().parse_target(entry)


def _split_drivers(value: str) -> list[str]:
    """NNRT_DRIVERS' entries: separated by ``,``, and socket paths also by
    ``:`` (a remote entry keeps its own ``:``s)."""
    entries = []
    for piece in value.split(","):
        piece = piece.strip()
        entries += [piece] if is_remote(piece) else [p for p in piece.split(":") if p.strip()]
    return entries


def configured_sockets(environ=os.environ) -> list[str]:
    """Socket paths and remote services (``grpc://HOST:PORT``,
    ``grpcs://HOST:PORT``) from NNRT_DRIVERS (separated by ``,``; paths also
    by ``:``), then from the config file, without repeats. Entries that
    cannot be either (a relative path, not text) are left out with a
    WARNING naming them."""
    paths = _split_drivers(environ.get("NNRT_DRIVERS", ""))
    conf = config_file(environ)
    if conf.exists():
        try:
            raw = conf.read_bytes()
        except OSError as e:
            _log.warning("cannot read %s: %s", conf, e.strerror)
            raw = b""
        for number, line in enumerate(raw.splitlines(), 1):
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError:
                _log.warning("%s line %d is not UTF-8 text: left out", conf, number)
                continue
            text = text.split("#", 1)[0].strip()
            if text:
                paths.append(text)
    seen, unique = set(), []
    for p in paths:
        p = p.strip()
        if is_remote(p):
            try:
                _check_remote(p)
            except NnrtError as e:
                _log.warning("driver service %r: %s: left out", p, e.message)
                continue
        elif not os.path.isabs(p):
            _log.warning("driver service %r is not an absolute socket path: left out", p)
            continue
        if p not in seen:
            seen.add(p)
            unique.append(p)
    return unique


def trusted_uids(environ=os.environ) -> frozenset[int]:
    """Our uid, root, and the users named in ``NNRT_TRUSTED_USERS``."""
    uids = {os.geteuid(), 0}
    for entry in environ.get("NNRT_TRUSTED_USERS", "").split(","):
        entry = entry.strip()
        if not entry:
            continue
        try:
            uids.add(int(entry) if entry.isdigit() else pwd.getpwnam(entry).pw_uid)
        except KeyError:
            vlog("manager", "NNRT_TRUSTED_USERS names %r, which is no user", entry)
    return frozenset(uids)


def check_socket(path: str, environ=os.environ) -> None:
    """DEVICE_UNAVAILABLE unless ``path`` is a socket an app may trust: owned
    by a trusted user, in a folder that only trusted users can change."""
    trusted = trusted_uids(environ)
    try:
        st = os.stat(path)
    except OSError as e:
        raise NnrtError(ErrorStatus.DEVICE_UNAVAILABLE,
                        f"no driver service at {path}: {e.strerror}") from None
    if not stat.S_ISSOCK(st.st_mode):
        raise NnrtError(ErrorStatus.DEVICE_UNAVAILABLE, f"{path} is not a socket")
    if st.st_uid not in trusted:
        raise Refused(ErrorStatus.DEVICE_UNAVAILABLE,
                        f"the socket {path} belongs to uid {st.st_uid}, another user: not "
                        f"connecting (to trust that user's services, add it to "
                        f"NNRT_TRUSTED_USERS)")
    # The folder named and, through symbolic links, the folder the socket is in.
    for folder in dict.fromkeys((os.path.dirname(os.path.abspath(path)),
                                 os.path.dirname(os.path.realpath(path)))):
        fst = os.stat(folder)
        if fst.st_uid not in trusted or (fst.st_mode & 0o022 and not fst.st_mode & stat.S_ISVTX):
            raise Refused(ErrorStatus.DEVICE_UNAVAILABLE,
                            f"the folder {folder} of {path} (uid {fst.st_uid}, mode "
                            f"{stat.S_IMODE(fst.st_mode):04o}) can be changed by another user, "
                            f"who could replace the socket: not connecting")


def connect_timeout(environ=os.environ) -> float:
    """``NNRT_CONNECT_TIMEOUT`` (seconds) when it is a positive number, else
    ``CONNECT_TIMEOUT``."""
    return _seconds(environ, "NNRT_CONNECT_TIMEOUT", CONNECT_TIMEOUT)


def call_timeout(environ=os.environ) -> float:
    """``NNRT_CALL_TIMEOUT`` (seconds) when it is a positive number, else
    ``CALL_TIMEOUT``: how long a control call to a connected service waits."""
    return _seconds(environ, "NNRT_CALL_TIMEOUT", CALL_TIMEOUT)


def _seconds(environ, name: str, default: float) -> float:
    raw = environ.get(name)
    if raw:
        try:
            value = float(raw)
        except ValueError:
            value = 0.0
        if value > 0:
            return value
        vlog("manager", "%s=%r is not a positive number of seconds; using %g", name, raw,
             default)
    return default


async def connect(path: str, environ=os.environ, timeout: float | None = None,
                  app: AppDeclaration | None = None) -> ServiceDevice:
    """A proxy of the service at ``path``, after :func:`check_socket`,
    connected as ``app`` (default: ``AppDeclaration.for_process``);
    DEVICE_UNAVAILABLE when it does not answer HELLO and the device queries
    within ``timeout`` seconds (default ``NNRT_CONNECT_TIMEOUT`` or
    ``CONNECT_TIMEOUT``)."""
    check_socket(path, environ)
    return await ServiceDevice.connect(
        path, timeout=connect_timeout(environ) if timeout is None else timeout,
        call_timeout=call_timeout(environ),
        app=AppDeclaration.for_process(None, environ) if app is None else app)


def remote_credentials(target: str, environ=os.environ) -> dict:
    """What this process presents to a remote service: for a ``grpcs://``
    target the CA (``NNRT_REMOTE_CA``; default the system's roots) and
    client certificate and key (``NNRT_REMOTE_CERT``, ``NNRT_REMOTE_KEY``)
    files; for any target the token in ``NNRT_REMOTE_TOKEN_FILE``.
    DEVICE_UNAVAILABLE when a named file cannot be read."""
    def read(name: str) -> bytes | None:
        path = environ.get(name)
        if not path:
            return None
        try:
            with open(path, "rb") as f:
                return f.read(1 << 20)
        except OSError as e:
            raise NnrtError(ErrorStatus.DEVICE_UNAVAILABLE,
                            f"{name}={path}: {e.strerror}") from None

    token = read("NNRT_REMOTE_TOKEN_FILE")
    token = token.decode("utf-8", "replace").strip() if token else None
    _, tls = _remote().parse_target(target)
    if not tls:
        return {"token": token}
    return {"token": token, "tls": _remote().ClientTls(read("NNRT_REMOTE_CA"), read("NNRT_REMOTE_CERT"),
                                             read("NNRT_REMOTE_KEY"))}


async def connect_remote(target: str, environ=os.environ,
                         timeout: float | None = None) -> Device:
    """A ``RemoteDevice`` of the service at ``target``, with this
    process's credentials (:func:`remote_credentials`); Refused when the
    service does not take them, DEVICE_UNAVAILABLE when nobody answers
    within ``timeout`` seconds (default ``NNRT_CONNECT_TIMEOUT``)."""
    remote = _remote()
    try:
        return await remote.RemoteDevice.connect(
            target, timeout=connect_timeout(environ) if timeout is None else timeout,
            call_timeout=call_timeout(environ), **remote_credentials(target, environ))
    except remote.RemoteRefused as e:
        raise Refused(e.status, e.message) from None


async def connect_pool(entry: str, environ=os.environ) -> Device:
    """The ``PoolDevice`` of ``pool:NAME=TARGET+...``, each member connected
    with this process's credentials; DEVICE_UNAVAILABLE when no member
    answers."""
    pool = _pool()
    name, targets = pool.parse_pool(entry)
    return await pool.PoolDevice.connect(name, targets,
                                         connect=lambda t: connect_remote(t, environ))


async def connect_configured(environ=os.environ) -> list[ServiceDevice]:
    return await Reconnector(environ).connect_all()


class Refused(NnrtError):
    """A socket that is there but not trusted (its owner or folder)."""


@dataclass(frozen=True)
class ServiceState:
    """A configured driver service as last seen by a runtime."""

    path: str
    state: str          # "up", "unreachable" or "refused"
    reason: str = ""    # why it is not up
    device: str = ""    # the device name when up
    members: tuple = ()  # a pool's: each member's state (pool.MemberState)

    def __str__(self) -> str:
        return f"{self.path}: {self.state}" + (f" ({self.device})" if self.device else "") + \
            (f": {self.reason}" if self.reason else "") + \
            "".join(f"\n    member {m}" for m in self.members)


def _identity(path: str):
    """What changes when a service comes back: a new socket file."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_mtime_ns)


RETRY_INTERVAL = 1.0   # seconds between attempts on a socket that refused at once


class Reconnector:
    """The configured services of one runtime: connects to them, remembers
    each one's state, and reconnects to one that is not up once a new socket
    file appears on its path (the service restarted) -- checked by a stat
    per missing service when asked (``Runtime.compile``), not by a timer.

    A socket file that is there but refused at once (a service between
    ``bind`` and ``listen``, or a stale file whose service comes back by
    another way) is tried again every ``RETRY_INTERVAL`` seconds; one that
    made us wait for the connect timeout only when its file changes, so a
    silent socket never stalls compilations twice."""

    def __init__(self, environ=os.environ, app: AppDeclaration | None = None,
                 remote=(), configured: bool = True, pool: str | None = None):
        """``remote``: remote services (``[grpc://|grpcs://]HOST:PORT``) to
        connect to besides the configured ones (``configured=False``: only
        these); with ``pool``, they are the members of one pool device of
        that name instead."""
        self._environ = environ
        self._app = app
        self._paths = configured_sockets(environ) if configured else []
        entries = []
        for target in remote:
            if not isinstance(target, str):
                raise invalid(f"a remote device is a 'HOST:PORT' string, not {target!r}")
            _remote().parse_target(target)
            entries.append(target if is_remote(target) else f"grpcs://{target}")
        if pool is not None:
            entries = [_pool().pool_entry(pool, entries)]
        for entry in entries:
            if entry not in self._paths:
                self._paths.append(entry)
        self._states: dict[str, ServiceState] = {}
        self._devices: dict[str, ServiceDevice] = {}
        self._seen: dict[str, object] = {}     # path -> socket identity at the last attempt
        self._retry_at: dict[str, float] = {}  # path -> when a quickly refused one is tried again

    @property
    def configured(self) -> bool:
        """Whether any service is configured (else there is nothing to watch)."""
        return bool(self._paths)

    def states(self) -> list[ServiceState]:
        for path, device in self._devices.items():
            if not device.alive and self._states[path].state == "up":
                self._states[path] = ServiceState(path, "unreachable",
                                                  f"the service {device.name} died")
            elif path.startswith(POOL_PREFIX) and device.alive:
                self._states[path] = ServiceState(path, "up", device=device.name,
                                                  members=tuple(device.members()))
        return [self._states[p] for p in self._paths]

    async def _try(self, path: str) -> Device | None:
        self._seen[path] = _identity(path)
        start = time.monotonic()
        try:
            if path.startswith(POOL_PREFIX):
                device = await connect_pool(path, self._environ)
            elif is_remote(path):
                device = await connect_remote(path, self._environ)
            else:
                device = await connect(path, self._environ, app=self._app)
        except NnrtError as e:
            kind = "refused" if isinstance(e, Refused) else "unreachable"
            self._states[path] = ServiceState(path, kind, e.message)
            took = time.monotonic() - start
            if is_remote(path):
                # No file tells when a host is back: try again after a while,
                # longer after an attempt that had to wait (a silent host).
                self._retry_at[path] = time.monotonic() + max(RETRY_INTERVAL, 4 * took)
            elif took < RETRY_INTERVAL / 2:
                self._retry_at[path] = time.monotonic() + RETRY_INTERVAL
            else:
                self._retry_at.pop(path, None)
            _log.warning("leaving out the driver service at %s: %s", path, e.message)
            return None
        self._retry_at.pop(path, None)
        self._states[path] = ServiceState(path, "up", device=device.name)
        self._devices[path] = device
        return device

    async def connect_all(self) -> list[ServiceDevice]:
        return [d for p in self._paths if (d := await self._try(p)) is not None]

    async def reconnect(self) -> list[ServiceDevice]:
        """Devices of services that are back since the last attempt."""
        added = []
        for path in self._paths:
            device = self._devices.get(path)
            if device is not None and device.alive:
                if path.startswith(POOL_PREFIX):   # its members that are down, when due
                    await device.reconnect()
                continue
            if is_remote(path):    # no file to watch: tried again at its retry time
                if time.monotonic() < self._retry_at.get(path, 0.0):
                    continue
            else:
                identity = _identity(path)
                if identity is None or (identity == self._seen.get(path) and
                                        time.monotonic() < self._retry_at.get(path,
                                                                              float("inf"))):
                    continue
            if device is not None:
                device.close()
                del self._devices[path]
            new = await self._try(path)
            if new is not None:
                added.append(new)
        return added


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


async def spawn(specs, folder: str, app: AppDeclaration | None = None
                ) -> tuple[list[SpawnedService], list[ServiceDevice]]:
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
                 "--socket", path, "--parent-pid", str(os.getpid()), *extra],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)
            services.append(SpawnedService(name, driver, path, process))
        for service in services:
            devices.append(await _connect_when_up(service, app))
    except BaseException:
        for d in devices:
            d.close()
        for s in services:
            s.stop()
        raise
    return services, devices


async def _connect_when_up(service: SpawnedService,
                           app: AppDeclaration | None) -> ServiceDevice:
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
                return await connect(service.socket_path, app=app)
            except NnrtError:
                pass
        if time.monotonic() > deadline:
            raise NnrtError(ErrorStatus.DEVICE_UNAVAILABLE,
                            f"driver service {service.name} did not start listening within "
                            f"{SPAWN_TIMEOUT:g} s")
        await anyio.sleep(0.02)


# The app's private folder of the services it spawns; the last of them to
# stop removes it (nnrt driver serve --parent-pid), so a killed app leaves
# nothing behind.
SPAWN_FOLDER_PREFIX = "nnrt-services-"


def private_folder() -> tempfile.TemporaryDirectory:
    return tempfile.TemporaryDirectory(prefix=SPAWN_FOLDER_PREFIX)
