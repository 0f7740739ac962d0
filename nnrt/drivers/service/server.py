"""The driver service host: one :class:`~nnrt.drivers.hal.Device` served on a
Unix stream socket (``nnrt driver serve``).

Theory of operation
-------------------
``serve`` accepts connections; each gets a :class:`ServiceConnection` whose
reader task feeds received bytes and SCM_RIGHTS fds into the sans-I/O
:class:`~.protocol.Connection` and starts one handler task per call, so many
executions of one client run at once (the driver's async ``execute``). A
handler always answers its call id: a result, or the ``NnrtError`` status it
raised; a driver bug becomes GENERAL_FAILURE, never a dead service.

The peer's identity (uid, pid) comes from SO_PEERCRED when it connects.
Prepared models and the pools mapped for them belong to the connection that
made them: their ids are unique across the service, but a connection looks
them up only among its own, so naming another connection's object is
INVALID_ARGUMENT. When the connection closes, its running calls are
cancelled and everything it owned is released.

Every fd received is either mapped (``Memory.from_fd`` duplicates it) or not
used, and in both cases the received fd is closed by the handler that got
it. A request pool sent with a non-zero ``pool_id`` is mapped once and
cached for that prepared model until the client releases the id (the client
drives the cache, see ``protocol``), so steady-state executions pass no fds.

Runs on anyio (the asyncio backend and uvloop when the CLI starts it); the
socket is waited on with ``anyio.wait_readable``/``wait_writable``, i.e.
``loop.add_reader`` on asyncio.
"""
from __future__ import annotations

import array
import inspect
import itertools
import os
import socket
import stat
import struct
from dataclasses import dataclass

import anyio

from ...errors import ErrorStatus, NnrtError, invalid
from ...memory import Memory
from ...memory.shared import PROT_READ, PROT_RW
from ...model.graph import Model
from ...vlog import vlog
from ..hal import Device, ExecutionResult, PreparedModel, Request
from . import protocol as p

_RECV_SIZE = 1 << 16
# Per connection: calls being handled at once, and prepared models alive.
# Beyond them a call is refused (RESOURCE_EXHAUSTED_*), so one app cannot
# exhaust the service's tasks or fds for the others.
MAX_CALLS_IN_FLIGHT = 1024
MAX_MODELS_PER_CONNECTION = 1024
_CMSG_SPACE = socket.CMSG_SPACE(p.MAX_FDS * 4)


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


def peer_credentials(sock: socket.socket) -> PeerCredentials:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return PeerCredentials(*struct.unpack("3i", raw))


class DriverService:
    """A device and the connections it serves. Queries are asked of the
    device once: a device answers them the same for its whole life."""

    def __init__(self, device: Device, app_key: str = "uid"):
        if app_key not in ("uid", "pid"):
            raise invalid(f"app key {app_key!r} is neither 'uid' nor 'pid'")
        self.device = device
        self.app_key = app_key
        # A driver with per-app queues (the reference driver's scheduler)
        # takes the calling app's identity with each preparation.
        self._takes_app = "app" in inspect.signature(device.prepare_model).parameters
        self.info = p.DeviceInfo(device.name, device.type, device.version_string,
                                 device.feature_level)
        self.answers = {
            p.Method.CAPABILITIES: device.capabilities(),
            p.Method.SUPPORTED_EXTENSIONS: list(device.supported_extensions()),
            p.Method.NUMBER_OF_CACHE_FILES: tuple(device.number_of_cache_files_needed()),
        }
        self._ids = itertools.count(1)
        self.connections: set[ServiceConnection] = set()
        self._connections_total = 0
        self._calls = 0
        self._malformed = 0

    def app_of(self, peer: "PeerCredentials"):
        """The key of the peer's queue: its uid (default) or its pid."""
        return (self.app_key, peer.uid if self.app_key == "uid" else peer.pid)

    def next_id(self) -> int:
        return next(self._ids)

    def statistics(self) -> ServiceStatistics:
        return ServiceStatistics(len(self.connections), self._connections_total, self._calls,
                                 self._malformed,
                                 sum(len(c.models) for c in self.connections))

    async def handle_connection(self, sock: socket.socket) -> None:
        conn = ServiceConnection(self, sock)
        self.connections.add(conn)
        self._connections_total += 1
        try:
            await conn.run()
        finally:
            self.connections.discard(conn)


class _Prepared:
    """A prepared model of one connection, with the pools mapped for it."""

    def __init__(self, prepared: PreparedModel, model_pools: list[Memory]):
        self.prepared = prepared
        self.model_pools = model_pools
        self.request_pools: dict[int, Memory] = {}

    def close(self) -> None:
        for m in (*self.model_pools, *self.request_pools.values()):
            m.close()
        self.model_pools.clear()
        self.request_pools.clear()


class ServiceConnection:
    def __init__(self, service: DriverService, sock: socket.socket):
        self.service = service
        self.sock = sock
        sock.setblocking(False)
        self.peer = peer_credentials(sock)
        self.proto = p.Connection("server")
        self.models: dict[int, _Prepared] = {}
        self._send_lock = anyio.Lock()
        self._alive = True
        self._in_flight = 0

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
            for entry in self.models.values():
                entry.close()
            self.models.clear()
            self.sock.close()
            vlog("driver", "%s: connection from pid %d closed", self.service.info.name,
                 self.peer.pid)

    async def _read_loop(self, tg) -> None:
        while True:
            await anyio.wait_readable(self.sock)
            try:
                data, ancdata, flags, _ = self.sock.recvmsg(_RECV_SIZE, _CMSG_SPACE,
                                                            socket.MSG_CMSG_CLOEXEC)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                return
            fds = _fds_of(ancdata)
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
                if isinstance(event, p.Malformed):
                    self.service._malformed += 1
                    for fd in event.fds:
                        os.close(fd)
                    await self._reply(p.Reply(event.call_id, p.Method.ERROR, event.error.status,
                                              event.error.message))
                    continue
                self.service._calls += 1
                if self._in_flight >= MAX_CALLS_IN_FLIGHT:
                    for fd in _fds_in(event):
                        os.close(fd)
                    await self._reply(_error_reply(
                        event, ErrorStatus.RESOURCE_EXHAUSTED_TRANSIENT,
                        f"more than {MAX_CALLS_IN_FLIGHT} calls in flight on one connection"))
                    continue
                self._in_flight += 1
                tg.start_soon(self._handle, event)

    async def _reply(self, reply: p.Reply) -> None:
        if not self._alive:
            return
        try:
            data, _fds = self.proto.send(reply)
        except p.ProtocolError as e:  # a reply too big for a frame
            data, _fds = self.proto.send(p.Reply(reply.call_id, p.Method.ERROR,
                                                 ErrorStatus.GENERAL_FAILURE, e.message))
        view = memoryview(data)
        async with self._send_lock:
            while view:
                try:
                    sent = self.sock.send(view, socket.MSG_NOSIGNAL)
                except (BlockingIOError, InterruptedError):
                    await anyio.wait_writable(self.sock)
                    continue
                except OSError:
                    self._alive = False  # the reader sees the EOF and cleans up
                    return
                view = view[sent:]

    async def _handle(self, call) -> None:
        fds = _fds_in(call)
        method = call.method
        try:
            if isinstance(call, p.Execute):
                result = await self._execute(call)
                reply = p.Reply(call.call_id, method, result.status, result.message, result)
            else:
                reply = p.Reply(call.call_id, method, value=await self._call(call))
        except NnrtError as e:
            reply = _error_reply(call, e.status, e.message)
        except anyio.get_cancelled_exc_class():
            raise
        except Exception as e:  # a driver bug must not take the service down
            reply = _error_reply(call, ErrorStatus.GENERAL_FAILURE,
                                 f"{type(e).__name__} in the driver: {e}")
        finally:
            self._in_flight -= 1
            for fd in fds:
                os.close(fd)
        await self._reply(reply)

    async def _call(self, call):
        service = self.service
        if isinstance(call, p.Hello):
            if call.protocol_version != p.PROTOCOL_VERSION:
                raise invalid(f"protocol version {call.protocol_version} is not "
                              f"{p.PROTOCOL_VERSION}")
            return service.info
        if isinstance(call, p.Query):
            return service.answers[call.method]
        if isinstance(call, p.SupportedOperations):
            model, memories = _map_model(call.model)
            try:
                # A driver's answer may take a while for a big model: keep the
                # loop serving other connections meanwhile.
                flags = [bool(x) for x in await anyio.to_thread.run_sync(
                    service.device.supported_operations, model)]
            finally:
                for m in memories:
                    m.close()
            if len(flags) != len(model.main.operations):
                raise NnrtError(ErrorStatus.GENERAL_FAILURE,
                                f"the driver answered {len(flags)} flags for "
                                f"{len(model.main.operations)} operations")
            return flags
        if isinstance(call, p.PrepareModel):
            if len(self.models) >= MAX_MODELS_PER_CONNECTION:
                raise NnrtError(ErrorStatus.RESOURCE_EXHAUSTED_PERSISTENT,
                                f"more than {MAX_MODELS_PER_CONNECTION} prepared models on one "
                                f"connection; release some")
            model, memories = _map_model(call.model)
            kwargs = {"app": service.app_of(self.peer)} if service._takes_app else {}
            try:
                prepared = await service.device.prepare_model(model, call.preference,
                                                              call.priority, call.deadline,
                                                              **kwargs)
            except BaseException:
                for m in memories:
                    m.close()
                raise
            model_id = service.next_id()
            self.models[model_id] = _Prepared(prepared, memories)
            return model_id
        if isinstance(call, p.ReleaseModel):
            self._own(call.model_id).close()
            del self.models[call.model_id]
            return None
        raise invalid(f"method {call.method.name} is not served")  # pragma: no cover

    def _own(self, model_id: int) -> _Prepared:
        entry = self.models.get(model_id)
        if entry is None:
            raise invalid(f"prepared model {model_id} does not belong to this connection")
        return entry

    async def _execute(self, call: p.Execute) -> ExecutionResult:
        entry = self._own(call.model_id)
        for pool_id in call.release:
            m = entry.request_pools.pop(pool_id, None)
            if m is not None:
                m.close()
        transient: list[Memory] = []
        try:
            pools = []
            for k, wp in enumerate(call.pools):
                pools.append(self._request_pool(entry, wp, k, transient))
            request = Request(call.inputs, call.outputs, tuple(pools))
            return await entry.prepared.execute(request, call.measure, call.deadline,
                                                call.loop_timeout)
        finally:
            for m in transient:
                m.close()

    def _request_pool(self, entry: _Prepared, wp: p.WirePool, k: int, transient: list):
        if wp.fd is not None:
            mem = Memory.from_fd(wp.fd, wp.fd_offset, wp.map_size,
                                 PROT_RW if wp.writable else PROT_READ)
            if wp.pool_id == 0:
                transient.append(mem)
            else:
                old = entry.request_pools.pop(wp.pool_id, None)
                if old is not None:
                    old.close()
                if len(entry.request_pools) >= p.MAX_CACHED_POOLS:
                    mem.close()
                    raise invalid(f"request pool {k}: more than {p.MAX_CACHED_POOLS} pools "
                                  f"cached for one prepared model; release some")
                entry.request_pools[wp.pool_id] = mem
        elif wp.map_size == 0:
            return bytearray(0)
        else:
            mem = entry.request_pools.get(wp.pool_id)
            if mem is None or wp.pool_id == 0:
                raise invalid(f"request pool {k}: pool id {wp.pool_id} is not mapped for this "
                              f"prepared model and came without an fd")
            if mem.size != wp.map_size or mem.writable != wp.writable:
                raise invalid(f"request pool {k}: pool id {wp.pool_id} was mapped with "
                              f"{mem.size} bytes ({'rw' if mem.writable else 'ro'}), not "
                              f"{wp.map_size} ({'rw' if wp.writable else 'ro'})")
        return mem.view()[wp.offset:wp.offset + wp.length]


def _map_model(model: Model) -> tuple[Model, list[Memory]]:
    """The model with its WirePool constants mapped read-only."""
    memories, views = [], []
    try:
        for k, wp in enumerate(model.pools):
            if wp.fd is None:
                if wp.map_size:
                    raise invalid(f"model pool {k} came without an fd")
                views.append(b"")
                continue
            mem = Memory.from_fd(wp.fd, wp.fd_offset, wp.map_size, PROT_READ)
            memories.append(mem)
            views.append(mem.view()[wp.offset:wp.offset + wp.length])
    except BaseException:
        for m in memories:
            m.close()
        raise
    return Model(model.main, model.referenced, model.operand_values, tuple(views),
                 model.relax_computation_float32_to_float16, model.extension_prefixes), memories


def _error_reply(call, status: ErrorStatus, message: str) -> p.Reply:
    if isinstance(call, p.Execute):
        return p.Reply(call.call_id, call.method, status, message,
                       ExecutionResult(status, message=message))
    return p.Reply(call.call_id, call.method, status, message)


def _fds_in(call) -> list[int]:
    pools = ()
    if isinstance(call, (p.SupportedOperations, p.PrepareModel)):
        pools = call.model.pools
    elif isinstance(call, p.Execute):
        pools = call.pools
    return [wp.fd for wp in pools if wp.fd is not None]


def _fds_of(ancdata) -> list[int]:
    fds = array.array("i")
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    return list(fds)


def listen(socket_path: str) -> socket.socket:
    """A listening Unix stream socket at ``socket_path``. A stale socket file
    (nobody accepting) is replaced; a live one is refused."""
    os.makedirs(os.path.dirname(socket_path) or ".", mode=0o700, exist_ok=True)
    try:
        st = os.stat(socket_path)
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
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise invalid(f"cannot listen on {socket_path}: {e}") from None
    sock.setblocking(False)
    return sock


async def serve(device: Device, socket_path: str, *, app_key: str = "uid",
                task_status=anyio.TASK_STATUS_IGNORED) -> None:
    """Serve ``device`` on ``socket_path`` until cancelled; the socket file
    is removed on the way out. ``app_key`` ("uid" or "pid") says which peer
    credential keys an app's queue. ``task_status.started`` gets the
    :class:`DriverService` (for ``statistics()``)."""
    service = DriverService(device, app_key)
    listener = listen(socket_path)
    vlog("driver", "%s: listening on %s", device.name, socket_path)
    try:
        async with anyio.create_task_group() as tg:
            task_status.started(service)
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
                tg.start_soon(service.handle_connection, sock)
    finally:
        listener.close()
        try:
            os.unlink(socket_path)
        except FileNotFoundError:
            pass
