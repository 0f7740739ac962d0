"""The driver service host: one :class:`~nnrt.hal.Device` served on a
Unix stream socket (``nnrt driver serve``).

Theory of operation
-------------------
``serve`` accepts connections; each gets a :class:`ServiceConnection`, a
thin transport: its reader task feeds received bytes and SCM_RIGHTS fds into
the sans-I/O :class:`~.protocol.ServerConnection` — which keeps the cancel
targets, our own calls to the client and the request-pool cache — and starts
one handler task per call, the handler found by method in :data:`_HANDLERS`,
so many executions of one client run at once (the driver's async
``execute``). A handler always answers its call id: a result, or the
``NnrtError`` status it raised; a driver bug becomes GENERAL_FAILURE, never
a dead service.

The peer's identity (uid, pid) comes from SO_PEERCRED when it connects.
Prepared models and the pools mapped for them belong to the connection that
made them: their ids are unique across the service, but a connection looks
them up only among its own, so naming another connection's object is
INVALID_ARGUMENT. When the connection closes, its running calls are
cancelled and everything it owned is released. CANCEL names one EXECUTE call
of the connection: its handler's cancel scope is cancelled (the driver
withdraws or stops the job) and the call is answered "cancelled" once the
driver has let go of its pools.

Every fd received is either mapped (``Memory.from_fd`` duplicates it) or not
used, and in both cases the received fd is closed by the handler that got
it. A request pool sent with a non-zero ``pool_id`` is mapped once and
cached for that prepared model (in the connection object) until the client
releases the id (the client drives the cache, see ``protocol``), so
steady-state executions pass no fds.

Fenced executions (EXECUTE_FENCED): the wait_for fences and the result
fence (made by the client) arrive as fds; the pools must be shared memory.
The handler hands the request to the driver's ``execute_fenced`` with the
connection's task group, which waits for the fences through their fds'
readability (never blocking the loop) and then runs the driver's
``execute`` (its scheduler, like any execution). When it settles the
handler signals the result fence, then replies with the info. A refused
call, or a connection closing meanwhile, signals the result fence with the
error: other processes may be waiting on it.

Bursts (CONFIGURE_BURST): the client sends the fds of two fmq rings; the
connection attaches them and runs a :class:`~nnrt.burst.server.BurstServer`
as a task of its task group (so a closing connection ends it). Unknown
slots are asked of the client with a call of ours, GET_MEMORIES, whose
reply the read loop hands to the waiting task; a burst that ends on our
side (ring out of sync, model released) is reported with BURST_ENDED.

Replies. Every reply is written by the connection's event loop: a job's
thread hands its result to the loop (the awaiting handler task), which
writes it under the send lock. The socket is only ever written from the
loop, so a client that stops reading blocks its own replies, nobody's
thread.

Runs on anyio (the asyncio backend and uvloop when the CLI starts it); the
socket is waited on with ``anyio.wait_readable``/``wait_writable``, i.e.
``loop.add_reader`` on asyncio.
"""
from __future__ import annotations

import contextlib
import itertools
import math
import os
import socket
import stat
import struct
from dataclasses import dataclass, fields, replace

import anyio

from ..burst.server import REQUEST_SPIN, BurstCounters, BurstServer
from ..memory.heap import give_back_soon
from ..errors import ErrorStatus, NnrtError, invalid
from ..fence.sync_fence import SyncFence
from ..fmq import Ring, RingError
from ..memory import DeviceToken, Memory
from ..memory.shared import PROT_READ, PROT_RW
from ..model.extensions import uses_extensions
from ..model.graph import HalModel
from ..vlog import vlog
from .. import trace
from ..hal import Buffer, BufferDesc, Device, ExecutionResult, PreparedModel, Request
from ..hal.allowlist import check_peer
from ..hal.buffers import MAX_BUFFER_BYTES, fully_specified, merge_dimensions
from ..hal.cache import CacheFiles, CacheReject, CacheRejected
from ..qos import ScheduledDevice
from ..qos.scheduler import DEFAULT_SETTINGS, AppSettings
from . import protocol as p
from .mirror import MirrorWriter
from .scm import received_fds, rights

_RECV_SIZE = 1 << 16
# Per connection: calls being handled at once, and prepared models alive.
# Beyond them a call is refused (RESOURCE_EXHAUSTED_*), so one app cannot
# exhaust the service's tasks or fds for the others.
MAX_CALLS_IN_FLIGHT = 1024
MAX_MODELS_PER_CONNECTION = 1024
MAX_BUFFERS_PER_CONNECTION = 1024   # driver buffers (memory domains) alive
MAX_EXECUTIONS_PER_CONNECTION = 1024   # reusable executions alive
# Pools mapped for a connection's reusable executions, all together: each
# holds an fd and a mapping, and the fds are every app's (RLIMIT_NOFILE).
MAX_EXECUTION_POOLS_PER_CONNECTION = 256
_CMSG_SPACE = socket.CMSG_SPACE(p.MAX_FDS * 4)
# Seconds without a call or a burst frame after which a service gives its
# freed heap back (DriverService.give_back_when_idle).
IDLE_GIVE_BACK = 5.0
# After a call refused for a limit (RESOURCE_EXHAUSTED_*), the service reads
# nothing more from that connection for a while, doubling with each refusal
# in a row up to a second: refusing costs the service's loop what serving
# costs, so an app hammering a limit (a flood of 1 GiB requests refused,
# thousands a second) would otherwise take loop time from every other app.
_REFUSED_PAUSE = 0.01
_REFUSED_PAUSE_MOST = 1.0


@dataclass(frozen=True, slots=True)
class ServiceLimits:
    """What one connection, one app and all of them together may make a
    service hold (``nnrt driver serve --limit NAME=N``). Beyond a limit the
    connection (or the call) is refused with RESOURCE_EXHAUSTED_* and a
    message naming the limit; everyone else goes on being served.

    *Unclaimed fds* arrived by SCM_RIGHTS ahead of (or beyond) the frames
    that claim them; *frame bytes* are those of frames not yet complete;
    each burst is a thread of the service. ``client_answer_ms`` bounds
    how long a call of the service's to a client (GET_MEMORIES, for a
    burst's slots) waits: a client that never answers costs its own burst
    frame, not one of the service's threads for ever.

    Connections, prepared models, bursts and the bytes of the app's memories
    the service maps for requests (executions, reusable executions, burst
    slots) are also counted per app (over all its connections; a policy
    rule's ``connections``, ``models`` and ``bursts`` override the
    ``*_per_app`` defaults) and per user: all the apps of one uid together
    never take more than ``100 - reserve_percent`` percent of a service-wide
    limit, so with ``--app-key pid`` a user who starts many processes still
    leaves the rest to other users."""

    fds_per_connection: int = 128
    fds: int = 1024
    frame_bytes_per_connection: int = 16 << 20
    frame_bytes: int = 128 << 20
    connections_per_app: int = 64
    connections: int = 512
    models_per_app: int = 1024
    models: int = 8192
    bursts_per_connection: int = 32
    bursts_per_app: int = 64
    bursts: int = 256
    mapped_bytes_per_app: int = 1 << 30
    mapped_bytes: int = 4 << 30
    mapped_memories_per_app: int = 512      # each an fd and a mapping in the service
    mapped_memories: int = 4096
    reserve_percent: int = 25
    client_answer_ms: int = 10_000

    def __post_init__(self):
        for name in self.names():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise invalid(f"limit {name} = {value!r} is not a positive integer")
        if self.reserve_percent > 90:
            raise invalid(f"limit reserve_percent = {self.reserve_percent} is above 90")
        if self.fds_per_connection < p.MAX_FDS:
            raise invalid(f"limit fds_per_connection = {self.fds_per_connection} is below "
                          f"the {p.MAX_FDS} fds one frame may carry")

    def per_user(self, resource: str) -> int:
        """How much of the service-wide ``resource`` one user's apps may hold."""
        total = getattr(self, resource)
        return max(1, total - total * self.reserve_percent // 100)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def parse(cls, items) -> "ServiceLimits":
        """From ``NAME=N`` strings (the CLI's ``--limit``)."""
        values = {}
        for item in items:
            name, sep, value = item.partition("=")
            name = name.strip().replace("-", "_")
            if not sep or name not in cls.names():
                raise invalid(f"--limit {item!r}: expected NAME=N with NAME one of "
                              f"{', '.join(cls.names())}")
            try:
                values[name] = int(value.replace("_", ""), 0)
            except ValueError:
                raise invalid(f"--limit {item!r}: {value!r} is not an integer") from None
        return cls(**values)


def default_socket_path(name: str) -> str:
    """Where ``nnrt driver serve NAME`` listens unless told otherwise:
    ``$XDG_RUNTIME_DIR/nnrt/NAME.sock``, else ``/tmp/nnrt-UID/NAME.sock``."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    folder = os.path.join(base, "nnrt") if base else f"/tmp/nnrt-{os.getuid()}"
    return os.path.join(folder, f"{name}.sock")


@dataclass(frozen=True, slots=True)
class PeerCredentials:
    pid: int
    uid: int
    gid: int


@dataclass(frozen=True, slots=True)
class ServiceStatistics:
    connections_open: int
    connections_total: int
    calls: int
    malformed: int
    prepared_models: int


@dataclass(frozen=True, slots=True)
class BurstStatistics:
    """Burst sessions of a service (``DriverService.burst_statistics()``)."""

    bursts_open: int
    bursts_total: int
    executions: int
    get_memories_calls: int   # round trips to a controller for unknown slots
    slots_fetched: int        # slots mapped after such a call
    slots_mapped: int         # slots mapped now, over all open bursts
    layouts: int = 0          # request layouts turned into driver arguments (once per
                              # layout of a burst, not once per frame)


# Who sees every app's work in STATISTICS (``nnrt driver status``); any other
# caller sees its own app's.
STATISTICS_SCOPES = {
    "owner": "the service's own user, root and --admin-uid",
    "own": "--admin-uid only",
    "all": "every caller",
}


# Who holds a remote session in the per-user accounting: every remote app
# together, as one user (a remote app has no uid on this host).
REMOTE_USER = ("remote", None)


def _held(conn: "ServiceConnection", resource: str) -> int:
    """How much of ``resource`` a local connection holds."""
    if resource == "connections":
        return 1
    if resource in ("mapped_bytes", "mapped_memories"):
        return getattr(conn, resource)
    return len(getattr(conn, resource))


def peer_credentials(sock: socket.socket) -> PeerCredentials:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return PeerCredentials(*struct.unpack("3i", raw))


class DriverService:
    """A device and the connections it serves. Queries are asked of the
    device once: a device answers them the same for its whole life."""

    def __init__(self, device: Device, app_key: str = "pid",
                 limits: ServiceLimits = ServiceLimits(), statistics: str = "owner",
                 admin_uids=()):
        if app_key not in ("uid", "pid"):
            raise invalid(f"app key {app_key!r} is neither 'uid' nor 'pid'")
        if statistics not in STATISTICS_SCOPES:
            raise invalid(f"statistics scope {statistics!r} is none of "
                          f"{', '.join(STATISTICS_SCOPES)}")
        # Every served driver sits behind the per-app scheduler, which runs no
        # app's work on the service's shared event loop (inline_bound=0).
        self.device = device if device.scheduling().fronted \
            else ScheduledDevice(device, inline_bound=0)
        self.app_key = app_key
        self.limits = limits
        # Who sees every app's work in STATISTICS: everyone ("all"); the
        # service's own user, root and the operator's uids ("owner"); or the
        # operator's uids alone ("own"). Any other app sees its own (issue 23).
        self.statistics_scope = statistics
        self.admin_uids = frozenset(admin_uids) | (
            {0, os.getuid()} if statistics == "owner" else set())
        self._held: dict[ServiceConnection, tuple[int, int]] = {}   # (fds, bytes) per connection
        self._held_total = [0, 0]
        self.info = p.DeviceInfo(device.name, device.type, device.version_string,
                                 device.feature_level)
        self.answers = {
            p.Method.CAPABILITIES: device.capabilities(),
            p.Method.SUPPORTED_EXTENSIONS: list(device.supported_extensions()),
            p.Method.NUMBER_OF_CACHE_FILES: tuple(device.number_of_cache_files_needed()),
        }
        self._ids = itertools.count(1)
        self.connections: set[ServiceConnection] = set()
        # Remote sessions (nnrt.service.remote.server), counted with the
        # connections against the same limits: each has ``app`` and
        # ``held(resource)``.
        self.remote_holders: set = set()
        self._connections_total = 0
        self._calls = 0
        self._malformed = 0
        self.burst_counters = BurstCounters()
        # token -> the mirror of a buffer (see mirror.py), refreshed by any
        # connection whose execution writes the buffer; owned by the
        # connection that allocated it.
        self.mirrors: dict[int, MirrorWriter] = {}

    def app_of(self, peer: "PeerCredentials"):
        """The key of the peer's queue: its pid (default: each process its
        own share) or its uid (every process of a user one app)."""
        return (self.app_key, peer.uid if self.app_key == "uid" else peer.pid)

    def next_id(self) -> int:
        return next(self._ids)

    def sees_all_apps(self, peer: "PeerCredentials") -> bool:
        return self.statistics_scope == "all" or peer.uid in self.admin_uids

    def refuse_connection(self, peer: "PeerCredentials") -> str | None:
        """Why a new connection of ``peer`` is over a limit, or None."""
        return self.over_limit(peer, "connections")

    def over_limit(self, peer: "PeerCredentials", resource: str, more: int = 1) -> str | None:
        """Why ``more`` of ``resource`` for the local ``peer``'s app is over a
        limit, or None (see :meth:`over_limit_of`)."""
        return self.over_limit_of(self.app_of(peer), ("uid", peer.uid), resource, more)

    def over_limit_of(self, app, user, resource: str, more: int = 1) -> str | None:
        """Why ``more`` of ``resource`` ("connections", "models", "bursts",
        "mapped_bytes" or "mapped_memories") for ``app`` of ``user`` is over a
        limit -- the service's, its user's share of it, or the app's own (its
        policy rule's, else the service's ``*_per_app``) -- or None.

        One accounting for both transports: a local connection is held by
        ``("uid", UID)``; a remote session (in :attr:`remote_holders`, its
        ``app`` ``("remote", NAME)``) by :data:`REMOTE_USER`, so all remote
        apps together leave the reserve to local users as one user's do."""
        holdings = self.holdings(resource)
        limits = self.limits
        total = sum(n for _, _, n in holdings)
        if total + more > getattr(limits, resource):
            return (f"the service holds {total} {resource}, its limit "
                    f"({resource}={getattr(limits, resource)})")
        users = sum(n for _, u, n in holdings if u == user)
        if users + more > limits.per_user(resource):
            who = "the remote apps" if user == REMOTE_USER else f"the apps of uid {user[1]}"
            return (f"{who} hold {users} {resource}, "
                    f"{100 - limits.reserve_percent}% of the service's {resource} limit; the "
                    f"rest is kept for other users (reserve_percent={limits.reserve_percent})")
        mine = sum(n for a, _, n in holdings if a == app)
        own = None if resource.startswith("mapped_") else getattr(self._rule_of(app), resource)
        limit = getattr(limits, f"{resource}_per_app") if own is None else own
        if mine + more > limit:
            rule = self._rule_of(app)
            where = (f"{resource}_per_app={limit}" if own is None
                     else f"{resource} = {limit} in policy rule {rule.name!r}")
            return f"app {app[0]} {app[1]} holds {mine} {resource}, its limit ({where})"
        return None

    def holdings(self, resource: str) -> list[tuple]:
        """``(app, user, amount)`` of ``resource`` per local connection and
        remote session (see :meth:`over_limit_of`)."""
        holdings = [(self.app_of(c.peer), ("uid", c.peer.uid), _held(c, resource))
                    for c in self.connections]
        return holdings + [(h.app, REMOTE_USER, h.held(resource)) for h in self.remote_holders]

    def app_holds_nothing(self, app) -> bool:
        """Whether no local connection and no remote session of ``app`` is open."""
        return not any(self.app_of(c.peer) == app for c in self.connections) and \
            not any(h.app == app for h in self.remote_holders)

    def _rule_of(self, app) -> AppSettings:
        """What the policy of the service's scheduler gives ``app``."""
        device = self.device
        return device.settings_of(app) if isinstance(device, ScheduledDevice) \
            else DEFAULT_SETTINGS

    def hold(self, conn: "ServiceConnection", fds: int, nbytes: int) -> str | None:
        """``conn`` holds ``fds`` unclaimed fds and ``nbytes`` bytes of
        unfinished frames now; why that puts the service over a limit, or
        None. (The per-connection limits are the protocol core's.)"""
        old_fds, old_bytes = self._held.pop(conn, (0, 0))
        self._held_total[0] += fds - old_fds
        self._held_total[1] += nbytes - old_bytes
        if fds or nbytes:
            self._held[conn] = (fds, nbytes)
        total_fds, total_bytes = self._held_total
        if fds and total_fds > self.limits.fds:
            return (f"the service holds {total_fds} fds no frame has claimed, over its limit "
                    f"(fds={self.limits.fds})")
        if nbytes and total_bytes > self.limits.frame_bytes:
            return (f"the service holds {total_bytes} bytes of unfinished frames, over its "
                    f"limit (frame_bytes={self.limits.frame_bytes})")
        return None

    async def give_back_when_idle(self, interval: float = IDLE_GIVE_BACK) -> None:
        """Forever: after ``interval`` seconds in which no call and no burst
        frame came, give the heap's freed memory back to the kernel, once per
        idle spell. The allocator keeps freed memory for the next run
        (nnrt.memory.heap): right while apps work, but an idle service
        should shrink back to its idle footprint."""
        seen = given = None
        while True:
            await anyio.sleep(interval)
            work = (self._calls, self.burst_counters.executions)
            if work == seen and work != given:
                give_back_soon()
                given = work
            seen = work

    async def statistics_for(self, app) -> p.StatisticsValue:
        """The scheduler's statistics and recent jobs as STATISTICS (and the
        remote ``Status``) answer them: every app's when ``app`` is None,
        else that app's alone."""
        statistics = await self.device.statistics()
        jobs = await self.device.finished_jobs()
        if app is not None:
            if statistics is not None:
                statistics = replace(statistics, classes=tuple(
                    c for c in statistics.classes if c.app == app), apps=tuple(
                    a for a in statistics.apps if a.app == app))
            jobs = [j for j in jobs if j.app == app]
        return p.StatisticsValue(statistics, tuple(jobs))

    def statistics(self) -> ServiceStatistics:
        return ServiceStatistics(len(self.connections), self._connections_total, self._calls,
                                 self._malformed,
                                 sum(len(c.models) for c in self.connections))

    def burst_statistics(self) -> "BurstStatistics":
        c = self.burst_counters
        return BurstStatistics(sum(len(conn.bursts) for conn in self.connections), c.opened,
                               c.executions, c.get_memories_calls, c.slots_fetched,
                               sum(b.statistics().slots_mapped for conn in self.connections
                                   for b in conn.bursts.values()), c.layouts)

    async def handle_connection(self, sock: socket.socket) -> None:
        conn = ServiceConnection(self, sock)
        refusal = self.refuse_connection(conn.peer)
        if refusal is not None:
            vlog("driver", "%s: refusing pid %d: %s", self.info.name, conn.peer.pid, refusal)
            await conn.refuse(ErrorStatus.RESOURCE_EXHAUSTED_TRANSIENT, refusal)
            return
        self.connections.add(conn)
        self._connections_total += 1
        try:
            await conn.run()
        finally:
            self.connections.discard(conn)
            self.hold(conn, 0, 0)
            app = self.app_of(conn.peer)
            if self.app_holds_nothing(app):
                self.device.forget_app(app)   # an exited app leaves the statistics


class _Prepared:
    """A prepared model of one connection, with its constant pools (its
    request pools are cached in the connection's protocol state)."""

    def __init__(self, prepared: PreparedModel, model: HalModel | None, model_pools: list[Memory]):
        # ``model`` is None for a model prepared from a cache: the service
        # never saw its graph (its buffers then get no mirror, known_buffer_size).
        self.prepared = prepared
        self.model = model
        self.model_pools = model_pools

    def close(self) -> None:
        for m in self.model_pools:
            m.close()
        self.model_pools.clear()


class _Bound:
    """A reusable execution of one connection: the driver's execution and
    the memories its pools are mapped from (its own mappings, closed after
    the execution lets go of them)."""

    def __init__(self, model_id: int, execution, memories: list[Memory]):
        self.model_id = model_id
        self.execution = execution
        self.memories = memories
        self.computing = False

    def close(self) -> None:
        execution, self.execution = self.execution, None
        if execution is not None:
            execution.release()
        del execution           # its views of the memories go first
        for m in self.memories:
            m.close()
        self.memories = []


class ServiceConnection:
    """The transport of one client: a reader task feeding the sans-I/O
    :class:`~.protocol.ServerConnection` (which holds the cancel targets,
    our calls to the client and the pool cache) and one handler task per
    call, found in :data:`_HANDLERS` by method."""

    def __init__(self, service: DriverService, sock: socket.socket):
        self.service = service
        self.sock = sock
        sock.setblocking(False)
        self.peer = peer_credentials(sock)
        limits = service.limits
        self.proto = p.ServerConnection(limits.fds_per_connection,
                                        limits.frame_bytes_per_connection)
        self.models: dict[int, _Prepared] = {}
        self.buffers: dict[int, Buffer] = {}   # token -> a driver buffer this connection made
        self.executions: dict[int, _Bound] = {}   # id -> a reusable execution it made
        self.mapped_bytes = 0   # of the app's memories mapped for requests, now
        self.mapped_memories = 0   # the same memories (each an fd and a mapping)
        self._send_lock = anyio.Lock()
        self._alive = True
        self._in_flight = 0
        self._refused_in_a_row = 0
        self._read_after = 0.0      # monotonic time before which nothing is read
        self._tg = None  # the connection's task group, home of fenced executions and bursts

    @property
    def bursts(self) -> dict[int, BurstServer]:
        """Burst sessions of this connection (each a task in its task group)."""
        return self.proto.bursts

    async def run(self) -> None:
        vlog("driver", "%s: connection from pid %d uid %d", self.service.info.name,
             self.peer.pid, self.peer.uid)
        try:
            async with anyio.create_task_group() as tg:
                try:
                    await self._read_loop(tg)
                finally:
                    # The client is gone (or broke the framing): nobody is
                    # left to answer, so stop its calls.
                    tg.cancel_scope.cancel()
        finally:
            self._alive = False
            for fd in self.proto.take_fds():
                os.close(fd)
            for bound in self.executions.values():
                bound.close()
            self.executions.clear()
            for model_id, entry in self.models.items():
                entry.close()
                for m in self.proto.drop_model(model_id):
                    m.close()
            self.models.clear()
            for token in list(self.buffers):
                self._drop_buffer(token)
            for burst in self.bursts.values():  # their tasks were cancelled with the group
                burst.close()
            self.bursts.clear()
            self.sock.close()
            self.proto.drop_buffer()
            # The heap keeps freed memory otherwise (nnrt.memory.heap):
            # what a departed app's frames, models and connection held goes
            # back to the kernel, on a worker thread (a trim of a big heap
            # takes milliseconds the loop owes other apps).
            give_back_soon()
            vlog("driver", "%s: connection from pid %d closed", self.service.info.name,
                 self.peer.pid)

    async def refuse(self, status: ErrorStatus, message: str) -> None:
        """Tell the client why before its connection is closed (an ERROR
        reply to call id 0, which the client keeps as the reason)."""
        with anyio.move_on_after(1):
            await self._reply(p.Reply(0, p.Method.ERROR, status, message))
        self.sock.close()

    async def _read_loop(self, tg) -> None:
        self._tg = tg
        while True:
            pause = self._read_after - anyio.current_time()
            if pause > 0:
                await anyio.sleep(pause)
            await anyio.wait_readable(self.sock)
            trace.instant("service: readable")
            try:
                data, ancdata, flags, _ = self.sock.recvmsg(_RECV_SIZE, _CMSG_SPACE,
                                                            socket.MSG_CMSG_CLOEXEC)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                return
            fds = received_fds(ancdata)
            if flags & socket.MSG_CTRUNC:
                # Some fds were dropped by the kernel: the frames they
                # belong to can no longer be matched with their fds.
                for fd in fds:
                    os.close(fd)
                await self._reply(p.Reply(0, p.Method.ERROR, ErrorStatus.INVALID_ARGUMENT,
                                          f"more than {p.MAX_FDS} fds in one message"))
                return
            if not data:
                for fd in fds:
                    os.close(fd)
                return
            self.proto.receive_data(data, fds)
            while True:
                try:
                    event = self.proto.next_event()
                except p.ProtocolError as e:
                    self.service._malformed += 1
                    await self._reply(p.Reply(0, p.Method.ERROR, e.status, e.message))
                    return
                if event is None:
                    break
                await self._on_event(event, tg)
            held_fds, held_bytes = self.proto.held
            over = self.service.hold(self, held_fds, held_bytes)
            if over is not None:
                vlog("driver", "%s: closing the connection of pid %d: %s",
                     self.service.info.name, self.peer.pid, over)
                await self._reply(p.Reply(0, p.Method.ERROR,
                                          ErrorStatus.RESOURCE_EXHAUSTED_TRANSIENT, over))
                return

    async def _on_event(self, event, tg) -> None:
        if isinstance(event, p.Malformed):
            self.service._malformed += 1
            for fd in event.fds:
                os.close(fd)
            await self._reply(p.Reply(event.call_id, p.Method.ERROR, event.error.status,
                                      event.error.message))
        elif isinstance(event, p.Answer):  # the client answering a call of ours
            if event.token is not None:
                event.token.deliver(event.reply)
            else:   # nobody waits (cancelled): drop what came with it
                _close_reply_fds(event.reply)
        elif isinstance(event, p.Cancel):
            scope = self.proto.cancel_target(event)
            if scope is not None:
                scope.cancel()
            # Acknowledged at once; the cancelled call answers for itself.
            await self._reply(p.reply_for(event, None))
        elif self._in_flight >= MAX_CALLS_IN_FLIGHT:
            self.service._calls += 1
            self.proto.finished(event.call_id)
            for fd in p.fds_of(event):
                os.close(fd)
            await self._reply(p.error_reply(
                event.call_id, event.method, ErrorStatus.RESOURCE_EXHAUSTED_TRANSIENT,
                f"more than {MAX_CALLS_IN_FLIGHT} calls in flight on one connection"))
        else:
            pause = self._read_after - anyio.current_time()
            if pause > 0:   # frames that came in one read with a refused call wait too
                await anyio.sleep(pause)
            self.service._calls += 1
            self._in_flight += 1
            tg.start_soon(self._handle, event)

    async def _reply(self, reply: p.Reply) -> None:
        if self._alive:
            await self._send(*self.proto.reply(reply))

    async def _send(self, data: bytes, fds) -> None:
        async with self._send_lock:
            view, anc = memoryview(data), rights(fds)
            while view:   # (anc: the fds, riding with the first bytes)
                try:
                    sent = self.sock.sendmsg([view], anc, socket.MSG_NOSIGNAL) \
                        if self._alive else len(view)
                except (BlockingIOError, InterruptedError):
                    sent = 0
                except OSError:
                    self._alive = False  # the reader sees the EOF and cleans up
                    sent = len(view)
                view = view[sent:]
                if sent:
                    anc = []
                if view:
                    await anyio.wait_writable(self.sock)

    async def _handle(self, call) -> None:
        """Answer ``call`` with its handler's value, or the error it raised;
        a driver bug becomes GENERAL_FAILURE, never a dead service."""
        trace.instant("service: handler starts")
        try:
            try:
                reply = p.reply_for(call, await _HANDLERS[call.method](self, call))
            except NnrtError as e:
                reply = p.error_reply(call.call_id, call.method, e.status, e.message)
            except anyio.get_cancelled_exc_class():
                raise
            except Exception as e:  # a driver bug must not take the service down
                reply = p.error_reply(call.call_id, call.method, ErrorStatus.GENERAL_FAILURE,
                                      f"{type(e).__name__} in the driver: {e}")
        finally:
            self._in_flight -= 1
            self.proto.finished(call.call_id)
            for fd in p.fds_of(call):
                os.close(fd)
        self._count_refusal(reply.status)
        await self._reply(reply)

    def _count_refusal(self, status: ErrorStatus) -> None:
        if status in (ErrorStatus.RESOURCE_EXHAUSTED_TRANSIENT,
                      ErrorStatus.RESOURCE_EXHAUSTED_PERSISTENT):
            pause = min(_REFUSED_PAUSE * 2 ** self._refused_in_a_row, _REFUSED_PAUSE_MOST)
            self._refused_in_a_row += 1
            self._read_after = anyio.current_time() + pause
        elif status == ErrorStatus.NONE:
            self._refused_in_a_row = 0

    # -- handlers: one per method the service serves -----------------------------

    async def _hello(self, call: p.Hello) -> p.DeviceInfo:
        if call.protocol_version != p.PROTOCOL_VERSION:
            raise invalid(f"protocol version {call.protocol_version} is not "
                          f"{p.PROTOCOL_VERSION}")
        service = self.service
        if service.app_key == "pid":   # a uid's processes may each declare another
            service.device.introduce_app(service.app_of(self.peer), call.app)
        return service.info

    async def _query(self, call: p.Query):
        return self.service.answers[call.method]

    async def _statistics(self, call: p.Query) -> p.StatisticsValue:
        # Live counters, not a fixed answer. An app sees its own classes and
        # jobs only (their pids, priorities and timings are its business),
        # unless the operator opened the whole service to it.
        service = self.service
        return await service.statistics_for(
            None if service.sees_all_apps(self.peer) else service.app_of(self.peer))

    async def _supported_operations(self, call: p.SupportedOperations) -> list[bool]:
        model, memories = _map_model(call.model)
        try:
            flags = [bool(x) for x in await self.service.device.supported_operations(model)]
        finally:
            for m in memories:
                m.close()
        if len(flags) != len(model.main.operations):
            raise NnrtError(ErrorStatus.GENERAL_FAILURE,
                            f"the driver answered {len(flags)} flags for "
                            f"{len(model.main.operations)} operations")
        return flags

    def _check_model_room(self) -> None:
        if len(self.models) >= MAX_MODELS_PER_CONNECTION:
            raise NnrtError(ErrorStatus.RESOURCE_EXHAUSTED_PERSISTENT,
                            f"more than {MAX_MODELS_PER_CONNECTION} prepared models on one "
                            f"connection; release some")
        refusal = self.service.over_limit(self.peer, "models")
        if refusal is not None:
            raise NnrtError(ErrorStatus.RESOURCE_EXHAUSTED_PERSISTENT, refusal)

    async def _prepare_model(self, call: p.PrepareModel) -> int:
        service = self.service
        self._check_model_room()
        model, memories = _map_model(call.model)
        try:
            # Extensions only for allowlisted apps, judged by the peer's
            # kernel-reported executable, never by what the app says.
            check_peer(self.peer.pid, uses_extensions(model))
            prepared = await service.device.prepare_model(
                model, call.preference, call.priority, call.deadline,
                _cache_files(call) if call.method is p.Method.PREPARE_MODEL_CACHING else None,
                app=service.app_of(self.peer))
        except BaseException:
            for m in memories:
                m.close()
            raise
        model_id = service.next_id()
        self.models[model_id] = _Prepared(prepared, model, memories)
        return model_id

    async def _prepare_model_from_cache(self, call: p.PrepareModelFromCache) -> p.FromCache:
        """The driver reads the app's cache fds (it never opens a path); a
        refusal says why, for the app's counters."""
        service = self.service
        self._check_model_room()
        try:
            offered = {e.name for e in service.device.supported_extensions()}
            if offered:
                # Without the model we cannot tell whether it uses an
                # extension: only an allowlisted app prepares from a cache
                # here; any other compiles afresh, through the usual check.
                try:
                    check_peer(self.peer.pid, offered)
                except NnrtError as e:
                    raise CacheRejected(CacheReject.UNUSABLE, e.message) from None
            prepared = await service.device.prepare_model_from_cache(
                _cache_files(call), call.priority, call.deadline, app=service.app_of(self.peer))
        except CacheRejected as e:
            return p.FromCache(e.status, e.message, reason=e.reason)
        model_id = service.next_id()
        self.models[model_id] = _Prepared(prepared, None, [])
        return p.FromCache(ErrorStatus.NONE, model_id=model_id)

    async def _release_model(self, call: p.ReleaseModel) -> None:
        self._own(call.model_id)
        for execution_id in [k for k, b in self.executions.items()
                             if b.model_id == call.model_id]:
            self.executions.pop(execution_id).close()
        self._own(call.model_id).close()
        del self.models[call.model_id]
        for m in self.proto.drop_model(call.model_id):
            m.close()
        for burst in list(self.bursts.values()):
            if burst.model_id == call.model_id:
                burst.stop("its prepared model was released")

    async def _cancellable(self, call, run) -> ExecutionResult:
        """``await run()`` for an EXECUTE or COMPUTE, under a cancel scope
        that the call's CANCEL cancels (one that came first cancels it at
        once); a cancelled one answers so, once the driver has let go of
        its pools (the scheduler's execute returns only then)."""
        with anyio.CancelScope() as scope:
            if self.proto.running(call.call_id, scope):
                scope.cancel()   # the CANCEL came before this task ran
            try:
                return await run()
            finally:
                self.proto.finished(call.call_id)
        return ExecutionResult(ErrorStatus.GENERAL_FAILURE,
                               message="the execution was cancelled by its caller")

    @trace.traced("service: execute")
    async def _execute(self, call: p.Execute) -> ExecutionResult:
        async def run() -> ExecutionResult:
            entry = self._own(call.model_id)
            with self._request(entry, call) as request:
                result = await entry.prepared.execute(request, call.measure, call.deadline,
                                                      call.loop_timeout)
            if result.status == ErrorStatus.NONE:
                await self._refresh_mirrors(call)
            return result
        return await self._cancellable(call, run)

    async def _create_execution(self, call: p.CreateExecution) -> int:
        """Bind a request once (the driver's ``create_execution``): its pools
        mapped for it alone, from the fds that came with the call."""
        if len(self.executions) >= MAX_EXECUTIONS_PER_CONNECTION:
            raise NnrtError(ErrorStatus.RESOURCE_EXHAUSTED_PERSISTENT,
                            f"more than {MAX_EXECUTIONS_PER_CONNECTION} executions on one "
                            f"connection; release some")
        entry = self._own(call.model_id)
        held = sum(len(b.memories) for b in self.executions.values())
        memories: list[Memory] = []
        by_file: dict[tuple, Memory] = {}   # one mapping per memory, however many pools name it
        pools: list = []
        try:
            for k, wp in enumerate(call.pools):
                if isinstance(wp, p.WireToken):
                    raise invalid(f"request pool {k}: a reusable execution binds shared "
                                  f"memory, not a driver buffer (run it with EXECUTE)")
                if wp.fd is None:
                    if wp.map_size:
                        raise invalid(f"request pool {k} came without its fd")
                    pools.append(bytearray(0))
                    continue
                st = os.fstat(wp.fd)
                key = (st.st_dev, st.st_ino, wp.fd_offset, wp.map_size, wp.writable)
                mem = by_file.get(key)
                if mem is None:
                    if held + len(memories) >= MAX_EXECUTION_POOLS_PER_CONNECTION:
                        raise NnrtError(ErrorStatus.RESOURCE_EXHAUSTED_PERSISTENT,
                                        f"the connection's executions map "
                                        f"{held + len(memories)} memories, the limit of "
                                        f"{MAX_EXECUTION_POOLS_PER_CONNECTION}; release some")
                    mem = by_file[key] = self._map_request_memory(wp, f"request pool {k}")
                    memories.append(mem)
                pools.append(mem.view()[wp.offset:wp.offset + wp.length])
            execution = entry.prepared.create_execution(
                Request(call.inputs, call.outputs, tuple(pools)), call.measure,
                call.loop_timeout)
        except BaseException:
            pools.clear()   # the views go before the mappings
            for m in memories:
                m.close()
            raise
        execution_id = self.service.next_id()
        self.executions[execution_id] = _Bound(call.model_id, execution, memories)
        return execution_id

    @trace.traced("service: compute")
    async def _compute(self, call: p.Compute) -> ExecutionResult:
        async def run() -> ExecutionResult:
            bound = self.executions.get(call.execution_id)
            if bound is None:
                raise invalid(f"execution {call.execution_id} is not one of this connection's")
            if bound.computing:
                raise NnrtError(ErrorStatus.INVALID_ARGUMENT,
                                f"execution {call.execution_id} is computing already")
            bound.computing = True
            try:
                return await bound.execution.execute(call.deadline)
            finally:
                bound.computing = False
        return await self._cancellable(call, run)

    async def _release_execution(self, call: p.ReleaseExecution) -> None:
        bound = self.executions.get(call.execution_id)
        if bound is None:
            raise invalid(f"execution {call.execution_id} is not one of this connection's")
        if bound.computing:   # (its compute returns first: then it goes)
            raise NnrtError(ErrorStatus.INVALID_ARGUMENT,
                            f"execution {call.execution_id} is computing")
        del self.executions[call.execution_id]
        bound.close()

    async def _execute_fenced(self, call: p.ExecuteFenced) -> p.FencedInfo:
        """Run a fenced execution and signal the client's result fence: with
        the execution's status when it settles, with the error when the call
        is refused or the connection goes away (so nobody, in any process,
        waits on it forever). The FencedInfo is the reply, sent after."""
        result_fence = _adopt_fence(call.fence, "the result fence")
        status = ErrorStatus.GENERAL_FAILURE
        try:
            info = await self._run_fenced(call)
            status = info.result.status
            return info
        except NnrtError as e:
            status = e.status
            raise
        finally:
            try:
                if status is ErrorStatus.NONE:
                    result_fence.signal()
                else:
                    result_fence.signal_error(status)
            except NnrtError:
                pass  # the client signaled it itself: it is not waiting for us
            result_fence.close()

    async def _run_fenced(self, call: p.ExecuteFenced) -> p.FencedInfo:
        """The driver's ``execute_fenced`` (in the connection's task group)
        waits for the input fences through their fds, never blocking the
        loop, then runs the request through the driver's ``execute``, i.e.
        its scheduler; this waits for its outcome."""
        entry = self._own(call.model_id)
        fences: list[SyncFence] = []
        try:
            with self._request(entry, call) as request:
                for k, fd in enumerate(call.wait_for):
                    fences.append(_adopt_fence(fd, f"wait_for fence {k}"))
                fence, callback = await entry.prepared.execute_fenced(
                    self._tg, request, fences, call.measure, call.deadline, call.loop_timeout,
                    call.timeout_after_fence)
                fence.close()  # the client's fence is the one it waits on
                _status, launched, fenced = await callback.wait_execution_info()
                result = callback.get_result()
                if result.status == ErrorStatus.NONE:
                    await self._refresh_mirrors(call)
                return p.FencedInfo(result, launched, fenced)
        finally:
            for f in fences:  # the engine waits on its own duplicates
                f.close()

    @contextlib.contextmanager
    def _request(self, entry: _Prepared, call: p.Execute):
        """The HAL request of an EXECUTE or EXECUTE_FENCED: released pool
        ids forgotten first, then each pool mapped (cached by id when the
        client numbered it) or taken from the cache."""
        for m in self.proto.release_pools(call.model_id, call.release):
            m.close()
        transient: list[Memory] = []
        try:
            pools = tuple(self._request_pool(call.model_id, wp, k, transient)
                          for k, wp in enumerate(call.pools))
            yield Request(call.inputs, call.outputs, pools)
        finally:
            for m in transient:
                m.close()

    def _request_pool(self, model_id: int, wp: p.WirePool, k: int, transient: list):
        if isinstance(wp, p.WireToken):
            # The driver checks, on this use, that the token is a buffer of
            # the prepared model's app and that the use is one of its roles.
            return DeviceToken(wp.token)
        if wp.fd is not None:
            mem = self._map_request_memory(wp, f"request pool {k}")
            if wp.pool_id == 0:
                transient.append(mem)
            else:
                try:
                    replaced = self.proto.cache_pool(model_id, wp.pool_id, mem)
                except p.ProtocolError as e:
                    mem.close()
                    raise invalid(f"request pool {k}: {e.message}") from None
                for old in replaced:
                    old.close()
        elif wp.map_size == 0:
            return bytearray(0)
        else:
            mem = self.proto.cached_pool(model_id, wp.pool_id)
            if mem is None or wp.pool_id == 0:
                raise invalid(f"request pool {k}: pool id {wp.pool_id} is not mapped for this "
                              f"prepared model and came without an fd")
            if mem.size != wp.map_size or mem.writable != wp.writable:
                raise invalid(f"request pool {k}: pool id {wp.pool_id} was mapped with "
                              f"{mem.size} bytes ({'rw' if mem.writable else 'ro'}), not "
                              f"{wp.map_size} ({'rw' if wp.writable else 'ro'})")
        return mem.view()[wp.offset:wp.offset + wp.length]

    # -- memory domains: driver buffers named by token --------------------------

    async def _allocate(self, call: p.Allocate) -> p.Allocated:
        if len(self.buffers) >= MAX_BUFFERS_PER_CONNECTION:
            raise NnrtError(ErrorStatus.RESOURCE_EXHAUSTED_PERSISTENT,
                            f"more than {MAX_BUFFERS_PER_CONNECTION} buffers on one "
                            f"connection; release some")
        entries = [self._own(model_id) for model_id in call.model_ids]
        buffer, token = await self.service.device.allocate(
            BufferDesc(call.dimensions), [e.prepared for e in entries], call.input_roles,
            call.output_roles, app=self.service.app_of(self.peer))
        self.buffers[token] = buffer
        nbytes = known_buffer_size(call.dimensions, call.input_roles, call.output_roles,
                                   [e.model for e in entries])
        if nbytes is None or nbytes > MAX_BUFFER_BYTES:   # no mirror: see known_buffer_size
            return p.Allocated(token)
        try:
            mirror = MirrorWriter(buffer, nbytes)
        except NnrtError:
            self._drop_buffer(token)
            raise
        self.service.mirrors[token] = mirror
        return p.Allocated(token, mirror.fileno(), mirror.size)

    async def _refresh_mirrors(self, call) -> None:
        """After a successful execution: the mirrors of the buffers it wrote."""
        for arg in call.outputs:
            loc = arg.location
            if arg.has_no_value or loc is None or not 0 <= loc.pool_index < len(call.pools):
                continue
            pool = call.pools[loc.pool_index]
            if isinstance(pool, p.WireToken):
                await self._refresh_mirror(pool.token)

    async def _refresh_mirror(self, token: int) -> None:
        mirror = self.service.mirrors.get(token)
        if mirror is not None:
            await mirror.refresh()

    def _drop_buffer(self, token: int) -> None:
        self.buffers.pop(token).release()
        mirror = self.service.mirrors.pop(token, None)
        if mirror is not None:
            mirror.close()

    def _buffer(self, token: int) -> Buffer:
        buffer = self.buffers.get(token)
        if buffer is None:
            raise invalid(f"token {token} names no buffer of this connection")
        return buffer

    async def _copy(self, call: p.CopyBuffer) -> None:
        buffer = self._buffer(call.token)
        wp = call.pool
        to_memory = call.method == p.Method.COPY_TO
        if to_memory and not wp.writable:
            raise invalid("COPY_TO: the destination memory is not writable")
        with Memory.from_fd(wp.fd, wp.fd_offset, wp.map_size,
                            PROT_RW if to_memory else PROT_READ, require_sealed=True) as mem:
            region = mem.view()[wp.offset:wp.offset + wp.length]
            try:
                if to_memory:
                    await buffer.copy_to(region)
                else:
                    await buffer.copy_from(region, call.dimensions)
            finally:
                region.release()
        if not to_memory:
            await self._refresh_mirror(call.token)

    async def _release_buffer(self, call: p.ReleaseBuffer) -> None:
        self._buffer(call.token)
        self._drop_buffer(call.token)

    # -- bursts (see nnrt.burst.server) ---------------------------------------

    async def _configure_burst(self, call: p.ConfigureBurst) -> int:
        entry = self._own(call.model_id)
        limits = self.service.limits
        if len(self.bursts) >= limits.bursts_per_connection:
            raise NnrtError(ErrorStatus.RESOURCE_EXHAUSTED_PERSISTENT,
                            f"{len(self.bursts)} bursts open on this connection, its limit "
                            f"(bursts_per_connection={limits.bursts_per_connection}); "
                            f"release some")
        refusal = self.service.over_limit(self.peer, "bursts")
        if refusal is not None:
            raise NnrtError(ErrorStatus.RESOURCE_EXHAUSTED_TRANSIENT, refusal)
        rings = []
        try:
            for k in (0, 3):
                # attach takes ownership of the fds it is given; the received
                # ones are closed by the handler (p.fds_of).
                fds = [os.dup(fd) for fd in call.ring_fds[k:k + 3]]
                try:
                    # The request ring's reader is the burst's serving
                    # thread: it watches for the next frame a while first.
                    rings.append(Ring.attach(*fds, spin=REQUEST_SPIN if k == 0 else None))
                except BaseException:
                    for fd in fds:
                        os.close(fd)
                    raise
        except (RingError, OSError) as e:
            for ring in rings:
                ring.close()
            raise invalid(f"CONFIGURE_BURST: the ring fds are not usable fmq rings: {e}") from None
        burst_id = self.service.next_id()
        burst = BurstServer(burst_id, entry.prepared, rings[0], rings[1],
                            lambda slots: self._burst_memories(burst_id, slots),
                            self.service.burst_counters,
                            f"{self.service.info.name} burst {burst_id}", call.model_id)
        self.bursts[burst_id] = burst
        self._tg.start_soon(self._run_burst, burst)
        return burst_id

    async def _release_burst(self, call: p.ReleaseBurst) -> None:
        burst = self.bursts.pop(call.burst_id, None)
        if burst is None:
            raise invalid(f"burst {call.burst_id} does not belong to this connection")
        burst.stop()

    async def _free_burst_slots(self, call: p.FreeBurstSlots) -> None:
        burst = self.bursts.get(call.burst_id)
        if burst is not None:  # a burst that has ended has nothing left to free
            burst.free(call.slots)

    async def _run_burst(self, burst: BurstServer) -> None:
        try:
            await burst.run()
        finally:
            if self.bursts.get(burst.burst_id) is burst:
                del self.bursts[burst.burst_id]
            if burst.end_reason is not None and self._alive:
                # Ended on our side: the controller must not wait for results.
                # (Its reply is dropped: nobody waits for it.)
                frame = self.proto.notify(
                    lambda cid: p.BurstEnded(cid, burst.burst_id, burst.end_reason))
                with anyio.CancelScope(shield=True):
                    await self._send(*frame)

    async def _burst_memories(self, burst_id: int, slots: tuple[int, ...]) -> dict[int, Memory]:
        """Ask the client for the memories behind ``slots`` (GET_MEMORIES)."""
        reply = await self._call_client(lambda cid: p.GetMemories(cid, burst_id, slots))
        pools = reply.value if reply.status == ErrorStatus.NONE and reply.value else ()
        mapped: dict[int, Memory] = {}
        try:
            if reply.status != ErrorStatus.NONE:
                raise NnrtError(ErrorStatus.INVALID_ARGUMENT,
                                f"the client could not give burst slots {list(slots)}: "
                                f"{reply.message}")
            for wp in pools:
                if wp.fd is None or wp.pool_id not in slots or wp.pool_id in mapped:
                    raise invalid(f"GET_MEMORIES: the client answered slot {wp.pool_id} "
                                  f"{'without an fd' if wp.fd is None else 'unasked or twice'}")
                mapped[wp.pool_id] = self._map_request_memory(wp, f"burst slot {wp.pool_id}")
        except BaseException:
            for m in mapped.values():
                m.close()
            raise
        finally:
            _close_reply_fds(reply)
        return mapped

    async def _call_client(self, build) -> p.Reply:
        """Send the client a call of ours and await its reply, at most
        the ``client_answer_ms`` limit."""
        box = _ClientReply()
        call_id, data, fds = self.proto.call(build, box)
        bound = self.service.limits.client_answer_ms / 1000
        try:
            with anyio.move_on_after(bound):
                if self._alive:
                    await self._send(data, fds)
                if not self._alive:
                    raise NnrtError(ErrorStatus.DEAD_OBJECT, "the client has gone")
                await box.event.wait()
        finally:
            self.proto.abandon(call_id)
        if box.reply is None:
            raise NnrtError(ErrorStatus.GENERAL_FAILURE,
                            f"the client did not answer within {bound:g} s (limit "
                            f"client_answer_ms)")
        return box.reply

    def _map_request_memory(self, wp: p.WirePool, what: str) -> Memory:
        """Map an app's memory for a request (an execution's, a reusable
        execution's, a burst slot), counted against the app's and the
        service's ``mapped_bytes`` until it is closed: a request of huge
        memories is refused for that app (RESOURCE_EXHAUSTED_TRANSIENT)
        before the service maps it."""
        service = self.service
        refusal = service.over_limit(self.peer, "mapped_bytes", wp.map_size) \
            or service.over_limit(self.peer, "mapped_memories")
        if refusal is not None:
            raise NnrtError(ErrorStatus.RESOURCE_EXHAUSTED_TRANSIENT,
                            f"{what} ({wp.map_size} bytes): {refusal}")
        mem = Memory.from_fd(wp.fd, wp.fd_offset, wp.map_size,
                             PROT_RW if wp.writable else PROT_READ, require_sealed=True)
        self.mapped_bytes += mem.size
        self.mapped_memories += 1
        mem.call_on_close(lambda size=mem.size: self._unmapped(size))
        return mem

    def _unmapped(self, size: int) -> None:
        self.mapped_bytes -= size
        self.mapped_memories -= 1

    def _own(self, model_id: int) -> _Prepared:
        entry = self.models.get(model_id)
        if entry is None:
            raise invalid(f"prepared model {model_id} does not belong to this connection")
        return entry


def _cache_files(call) -> CacheFiles:
    return CacheFiles(call.cache_model, call.cache_data, call.token)


# What the service does for each call it serves: a new method is one codec
# in protocol.CODECS and one handler here. CANCEL is answered by the read
# loop itself (it must not wait behind the calls it cancels), and the
# service's own calls (SERVICE_CALLS) are the client's to serve.
_HANDLERS = {
    p.Method.HELLO: ServiceConnection._hello,
    p.Method.CAPABILITIES: ServiceConnection._query,
    p.Method.SUPPORTED_EXTENSIONS: ServiceConnection._query,
    p.Method.NUMBER_OF_CACHE_FILES: ServiceConnection._query,
    p.Method.STATISTICS: ServiceConnection._statistics,
    p.Method.SUPPORTED_OPERATIONS: ServiceConnection._supported_operations,
    p.Method.PREPARE_MODEL: ServiceConnection._prepare_model,
    p.Method.PREPARE_MODEL_CACHING: ServiceConnection._prepare_model,
    p.Method.PREPARE_MODEL_FROM_CACHE: ServiceConnection._prepare_model_from_cache,
    p.Method.EXECUTE: ServiceConnection._execute,
    p.Method.EXECUTE_FENCED: ServiceConnection._execute_fenced,
    p.Method.RELEASE_MODEL: ServiceConnection._release_model,
    p.Method.CONFIGURE_BURST: ServiceConnection._configure_burst,
    p.Method.RELEASE_BURST: ServiceConnection._release_burst,
    p.Method.FREE_BURST_SLOTS: ServiceConnection._free_burst_slots,
    p.Method.ALLOCATE: ServiceConnection._allocate,
    p.Method.COPY_TO: ServiceConnection._copy,
    p.Method.COPY_FROM: ServiceConnection._copy,
    p.Method.RELEASE_BUFFER: ServiceConnection._release_buffer,
    p.Method.CREATE_EXECUTION: ServiceConnection._create_execution,
    p.Method.COMPUTE: ServiceConnection._compute,
    p.Method.RELEASE_EXECUTION: ServiceConnection._release_execution,
}
assert set(_HANDLERS) | p.SERVICE_CALLS | {p.Method.ERROR, p.Method.CANCEL} == set(p.Method)


class _ClientReply:
    """The token of a call of ours to the client: its reply, once here."""

    __slots__ = ("event", "reply")

    def __init__(self):
        self.event = anyio.Event()
        self.reply: p.Reply | None = None

    def deliver(self, reply: p.Reply) -> None:
        if self.reply is None:
            self.reply = reply
            self.event.set()
        else:
            _close_reply_fds(reply)


def _close_reply_fds(reply: p.Reply) -> None:
    for fd in p.reply_fds_of(reply):
        os.close(fd)


def known_buffer_size(dimensions, input_roles, output_roles, models) -> int | None:
    """The bytes of a buffer the driver just allocated with ``dimensions``
    for these roles (``BufferRole``s indexing ``models``, HAL models), when
    its dimensions (the desc's and every role operand's) are all known;
    None otherwise, or when a role's model is None (it came from a cache:
    there is no graph to size it by)."""
    if any(models[role.model_index] is None for role in (*input_roles, *output_roles)):
        return None
    dims, element = tuple(dimensions), 0
    for kind, roles in (("input", input_roles), ("output", output_roles)):
        for role in roles:
            main = models[role.model_index].main
            indexes = main.input_indexes if kind == "input" else main.output_indexes
            operand = main.operands[indexes[role.io_index]]
            dims = merge_dimensions(dims, operand.dimensions, f"allocate: {kind} role")
            element = operand.type.element_size
    return element * math.prod(dims) if fully_specified(dims) else None


def _map_model(model: HalModel) -> tuple[HalModel, list[Memory]]:
    """The model with its WirePool constants mapped read-only."""
    memories, views = [], []
    try:
        for k, wp in enumerate(model.pools):
            if wp.fd is None:
                if wp.map_size:
                    raise invalid(f"model pool {k} came without an fd")
                views.append(b"")
                continue
            mem = Memory.from_fd(wp.fd, wp.fd_offset, wp.map_size, PROT_READ, require_sealed=True)
            memories.append(mem)
            views.append(mem.view()[wp.offset:wp.offset + wp.length])
    except BaseException:
        for m in memories:
            m.close()
        raise
    return p.with_pools(model, views), memories


def _adopt_fence(fd: int, what: str) -> SyncFence:
    """A handle of our own on a received fence fd (the handler closes the
    received fd). INVALID_ARGUMENT unless it is an open eventfd."""
    own = os.dup(fd)
    try:
        return SyncFence.from_fd(own)
    except NnrtError as e:
        os.close(own)  # from_fd leaves a refused fd to its caller
        raise invalid(f"{what}: {e.message}") from None
    except BaseException:
        os.close(own)
        raise


def listen(socket_path: str, group: str | None = None) -> socket.socket:
    """A listening Unix stream socket at ``socket_path``, reachable only by
    the service's own user, or also by the members of ``group``.

    The folder must belong to the service's user and be writable by nobody
    else, or anyone could replace the socket (and receive an app's calls);
    a missing folder is created 0700 (0710 and chgrp'd with ``group``). The
    socket is 0600 (0660 and chgrp'd with ``group``), set before ``listen``
    so that no one can connect while the umask decided its mode. A stale
    socket file (nobody accepting) is replaced; a live one is refused. Any
    refusal is INVALID_ARGUMENT saying what to change."""
    gid = None if group is None else _group_id(group)
    _secure_folder(os.path.dirname(os.path.abspath(socket_path)), gid)
    try:
        st = os.lstat(socket_path)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(st.st_mode):
            raise invalid(f"{socket_path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(socket_path)
        except OSError:
            os.unlink(socket_path)
        else:
            raise invalid(f"a service is already listening on {socket_path}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(socket_path)
        # connect(2) needs write permission on the socket file: until listen()
        # nobody can connect at all, so set the mode (and group) first.
        os.chmod(socket_path, 0o600 if gid is None else 0o660)
        if gid is not None:
            os.chown(socket_path, -1, gid)
        sock.listen(128)
    except OSError as e:
        sock.close()
        try:
            os.unlink(socket_path)
        except OSError:
            pass
        raise invalid(f"cannot listen on {socket_path}: {e}") from None
    sock.setblocking(False)
    return sock


def _group_id(group: str) -> int:
    """The gid of ``group`` (a name or a number), INVALID_ARGUMENT when the
    service's user cannot hand a file to it."""
    import grp

    try:
        gid = int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
    except KeyError:
        raise invalid(f"--group {group}: no such group") from None
    if os.geteuid() != 0 and gid != os.getegid() and gid not in os.getgroups():
        raise invalid(f"--group {group}: the service's user (uid {os.geteuid()}) is not a "
                      f"member of it, so it cannot give its socket to that group")
    return gid


def _secure_folder(folder: str, gid: int | None) -> None:
    """Create ``folder`` 0700 (0710 for ``gid``) or check an existing one:
    ours, a real folder, writable by nobody else, and reachable by ``gid``."""
    mode = 0o700 if gid is None else 0o710
    try:
        os.makedirs(os.path.dirname(folder), exist_ok=True)
        os.mkdir(folder, mode)
    except FileExistsError:
        pass
    except OSError as e:
        raise invalid(f"cannot create the socket folder {folder}: {e}") from None
    else:
        os.chmod(folder, mode)  # the umask may have taken bits away
        if gid is not None:
            os.chown(folder, -1, gid)
    st = os.lstat(folder)
    if stat.S_ISLNK(st.st_mode):
        raise invalid(f"the socket folder {folder} is a symbolic link; give the real folder "
                      f"with --socket")
    if not stat.S_ISDIR(st.st_mode):
        raise invalid(f"the socket folder {folder} is not a folder")
    if st.st_uid != os.geteuid():
        raise invalid(f"the socket folder {folder} belongs to uid {st.st_uid}, not to this "
                      f"service's user (uid {os.geteuid()}): another user may have made it to "
                      f"take over the socket. Remove it, or choose a folder of your own with "
                      f"--socket")
    if st.st_mode & 0o022:
        raise invalid(f"the socket folder {folder} is writable by other users (mode "
                      f"{stat.S_IMODE(st.st_mode):04o}), who could replace the socket: "
                      f"chmod go-w {folder}")
    if gid is not None:
        # Members of the group must be able to walk down to the socket.
        path = folder
        while True:
            st = os.stat(path)
            if not (st.st_mode & 0o001 or (st.st_mode & 0o010 and st.st_gid == gid)):
                raise invalid(f"members of group {gid} cannot reach a socket in {folder}: "
                              f"{path} (mode {stat.S_IMODE(st.st_mode):04o}, group "
                              f"{st.st_gid}) does not let them through; use a folder such as "
                              f"/run/nnrt (root creates it, then chown it to this user)")
            parent = os.path.dirname(path)
            if parent == path:
                break
            path = parent


async def serve(device: Device, socket_path: str, *, app_key: str = "pid",
                group: str | None = None, limits: ServiceLimits = ServiceLimits(),
                statistics: str = "owner", admin_uids=(),
                task_status=anyio.TASK_STATUS_IGNORED) -> None:
    """Serve ``device`` on ``socket_path`` until cancelled; the socket file
    is removed on the way out. ``app_key`` ("uid" or "pid") says which peer
    credential keys an app's queue; ``group`` names a group whose members
    may connect too (see :func:`listen`; default: only the service's user);
    ``limits`` bound what connections may hold; ``statistics`` ("owner",
    "own" or "all": see ``STATISTICS_SCOPES``) and ``admin_uids`` say who sees
    every app's work in STATISTICS.
    ``task_status.started`` gets the :class:`DriverService` (for
    ``statistics()``)."""
    service = DriverService(device, app_key, limits, statistics, admin_uids)
    listener = listen(socket_path, group)
    vlog("driver", "%s: listening on %s", device.name, socket_path)
    try:
        async with anyio.create_task_group() as tg:
            task_status.started(service)
            tg.start_soon(service.give_back_when_idle)
            while True:
                await anyio.wait_readable(listener)
                try:
                    sock, _ = listener.accept()
                except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                    continue
                except OSError as e:  # EMFILE and friends: keep serving the others
                    vlog("driver", "%s: accept failed: %s", device.name, e)
                    await anyio.sleep(0.01)
                    continue
                tg.start_soon(_serve_connection, service, sock)
    finally:
        listener.close()
        try:
            os.unlink(socket_path)
        except FileNotFoundError:
            pass


async def _serve_connection(service: DriverService, sock: socket.socket) -> None:
    """One connection, fenced off: whatever escapes its handling (a bug, an
    fd of the wrong kind, a resource error) closes that connection and is
    logged; it never reaches the task group serving everyone else."""
    try:
        await service.handle_connection(sock)
    except Exception as e:
        vlog("driver", "%s: dropping a connection after %s: %s", service.info.name,
             type(e).__name__, e)
    except BaseExceptionGroup as group:  # errors stay here; cancellation goes on
        errors, others = group.split(Exception)
        if errors is not None:
            vlog("driver", "%s: dropping a connection after %r", service.info.name, errors)
        if others is not None:
            raise others from None
    finally:
        sock.close()
