"""The client of a remote driver service: :class:`RemoteDevice`, a HAL
:class:`~nnrt.hal.Device` whose calls go over gRPC (``nnrt_remote_v1.proto``).

Theory of operation
-------------------
One :class:`RemoteDevice` owns one gRPC channel (one HTTP/2 connection) and
one session: :meth:`RemoteDevice.connect` asks ``GetInfo`` (the device's
answers to the queries, asked once: they never change) and opens the
``Session`` stream, whose first event names the session every later call
carries. A watcher thread then sits on that stream, as the local client's
reader thread sits on its socket: the stream ends only when the server or
the connection goes (a reset connection at once; a hung host when HTTP/2
keepalive pings go unanswered, ``keepalive`` seconds at most), and then the
device is dead: every call in flight is cancelled and answers DEAD_OBJECT,
every later call too, without touching the network, and the runtime moves
the app's models to the next device (the recovery rules of local services).

Calls are the channel's futures (``rpc.future``): their callbacks hand the
reply to the awaiting task through a :class:`~nnrt.handoff.Waiter` (asyncio
or trio), or a thread blocks on ``result()`` (``execute_synchronously``).
A cancelled task cancels its call; the server's coroutine is cancelled with
it, and with it the scheduler's job.

Executions send the request's layout and the bytes of its input regions,
and write the output bytes that come back into the request's output
regions (:mod:`.wire`). A reusable execution binds its layout on the server
with its first computation; each computation after that sends the inputs'
bytes and the deadline. Deadlines travel as the time left and as the gRPC
call's own deadline (a little later, so the server's answer -- with its
status -- usually comes first).

Every execution reply carries the serving device's load; the device keeps
the latest (:meth:`RemoteDevice.load_seen`), which a pool of hosts
(:mod:`.pool`, built from RemoteDevices) picks its member by.

Compilation caching: the app keeps its cache files on its own host; the
driver's files travel in the calls, sealed by the server for the app
(:mod:`.cache`).

Memory domains: :meth:`RemoteDevice.allocate` makes a driver buffer on the
serving host (:class:`RemoteBuffer`); a request naming it by token sends
the token alone, so its bytes stay there between executions until a copy
moves them (raw bytes). Its contents die with the host: a buffer has no
mirror on this side (:meth:`~nnrt.hal.Buffer.recover` answers None).
:meth:`RemoteDevice.traffic` counts the tensor bytes each way.
"""
from __future__ import annotations

import collections
import contextlib
import math
import queue
import statistics
import threading
import time
from dataclasses import dataclass, replace

import grpc

from ...errors import ErrorStatus, NnrtError, invalid
from ...handoff import Waiter, run_in_worker
from ...hal import (Buffer, BufferDesc, BurstExecution, BurstSession, Capabilities, Device,
                    DeviceType, Execution, ExecutionPreference, ExecutionResult, PreparedModel,
                    Request, Scheduling)
from ...hal.cache import MAX_CACHE_FILES, CacheFiles, CacheReject, CacheRejected, check_counts
from ...hal.types import Priority
from ...hal.validate import checked_flags
from ...memory import as_buffer
from ...model.graph import HalModel
from ...vlog import vlog
from ..protocol import (ProtocolError, decode_capabilities, decode_extensions,
                        decode_statistics, encode_model)
from . import cache as remote_cache
from . import nnrt_remote_v1_pb2 as pb
from . import nnrt_remote_v1_pb2_grpc as pb_grpc
from . import wire

CONNECT_TIMEOUT = 5.0    # seconds for the connection, GetInfo and the session
CALL_TIMEOUT = 60.0      # seconds any control call waits (a later deadline extends it)
KEEPALIVE = 2.0          # seconds: a host that answers no ping that long is dead
# Small calls timed at connect: their median is the device's round trip
# (``Capabilities.round_trip``), which partitioning weighs.
ROUND_TRIP_PINGS = 5
# Calls one RemoteDevice has on the network at once; more wait here, in
# order, so a runaway app queues on its own host, not on the serving one.
MAX_IN_FLIGHT = 32
# The gRPC deadline of an execution with a deadline is this much later than
# the deadline itself: the server's MISSED_DEADLINE comes back first.
_DEADLINE_SLACK = 0.5


@dataclass(frozen=True)
class ClientTls:
    """What a ``grpcs://`` connection presents and trusts (PEM bytes): the
    CA that signed the server's certificate (None: the system's roots), and
    for mutual TLS this client's certificate and key."""

    root_ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = None

    def __post_init__(self):
        if (self.cert is None) != (self.key is None):
            raise invalid("a client certificate and its key go together")

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.root_ca, self.key, self.cert)


def parse_target(target: str) -> tuple[str, bool]:
    """``grpc://HOST:PORT``, ``grpcs://HOST:PORT`` or ``HOST:PORT`` as
    (``HOST:PORT``, TLS or not); a bare address is TLS unless told."""
    for scheme, tls in (("grpcs://", True), ("grpc://", False)):
        if target.startswith(scheme):
            address = target[len(scheme):]
            break
    else:
        address, tls = target, True
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise invalid(f"remote device {target!r} is not [grpc://|grpcs://]HOST:PORT")
    return address, tls


@dataclass(frozen=True, slots=True)
class RemoteStatistics:
    """A remote device's calls: on the network now, and waiting here for
    one of its ``max_in_flight`` places (``RemoteDevice.remote_statistics()``)."""

    in_flight: int
    waiting: int
    max_in_flight: int


@dataclass(frozen=True, slots=True)
class RemoteTraffic:
    """Tensor bytes a remote device sent (inputs, copies into its buffers)
    and received (outputs, copies out of them) since it connected
    (``RemoteDevice.traffic()``); a driver buffer's token moves none."""

    bytes_sent: int
    bytes_received: int


class _Places:
    """At most ``limit`` calls at once; the others wait in arrival order,
    each on a :class:`~nnrt.handoff.Waiter` (a task of any loop, or a
    thread), and a call that ends hands its place to the first waiting."""

    def __init__(self, limit: int):
        self.limit = limit
        self.taken = 0
        self._lock = threading.Lock()
        self._waiting: collections.deque[Waiter] = collections.deque()

    def _take_or_queue(self, blocking: bool) -> Waiter | None:
        with self._lock:
            if self.taken < self.limit and not self._waiting:
                self.taken += 1
                return None
            waiter = Waiter(blocking=blocking)
            self._waiting.append(waiter)
            return waiter

    async def take(self) -> None:
        waiter = self._take_or_queue(False)
        if waiter is None:
            return
        try:
            await waiter.wait()
        except BaseException:
            with self._lock:
                handed = waiter.delivered
                if not handed:
                    self._waiting.remove(waiter)
            if handed:      # the place came with the cancellation: pass it on
                self.give()
            raise

    def take_blocking(self) -> None:
        waiter = self._take_or_queue(True)
        if waiter is not None:
            waiter.wait_blocking()

    def give(self) -> None:
        # Delivered under the lock (delivering only posts a wake-up), so a
        # waiter cancelled meanwhile sees at once whether it got the place.
        with self._lock:
            if self._waiting:
                self._waiting.popleft().deliver(True)   # the place goes to it: taken stays
            else:
                self.taken -= 1

    def statistics(self) -> RemoteStatistics:
        with self._lock:
            return RemoteStatistics(self.taken, len(self._waiting), self.limit)


class RemoteRefused(NnrtError):
    """A remote service that answered but does not take our credentials (a
    token or certificate it refuses, a TLS handshake that failed)."""

    def __init__(self, message: str):
        super().__init__(ErrorStatus.DEVICE_UNAVAILABLE, message)


def channel_options(keepalive: float) -> list:
    """The options of a channel to a remote service (and of the remote
    benchmark's gRPC echo, which times gRPC itself on the same terms)."""
    half = max(100, int(keepalive * 500))
    return [
        ("grpc.max_receive_message_length", wire.MAX_MESSAGE + (1 << 20)),
        ("grpc.max_send_message_length", wire.MAX_MESSAGE + (1 << 20)),
        # A ping every keepalive/2, answered within keepalive/2: a hung host
        # is found within `keepalive` seconds, idle or not. gRPC core sends
        # no new keepalive ping while another ping is unanswered and then
        # waits for that one's ping_timeout instead (60 s by default), so
        # that is bounded too.
        ("grpc.keepalive_time_ms", half),
        ("grpc.keepalive_timeout_ms", half),
        ("grpc.http2.ping_timeout_ms", half),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # A stream's receive window (the default is 64 KiB): outputs of a
        # frame arrive without a WINDOW_UPDATE round trip.
        ("grpc.http2.lookahead_bytes", 4 << 20),
        # Fail fast instead of reconnecting behind the caller's back: a dead
        # device is replaced by a new one (the runtime reconnects).
        ("grpc.enable_retries", 0),
    ]


def _round_trip(stub: pb_grpc.RemoteStub, metadata: tuple, timeout: float) -> float:
    """Seconds of a small call's round trip on the open connection: the
    median of ``ROUND_TRIP_PINGS`` GetInfo calls (the first call, which set
    up the connection, is not among them)."""
    times = []
    for _ in range(ROUND_TRIP_PINGS):
        start = time.perf_counter()
        stub.GetInfo(pb.GetInfoRequest(), timeout=timeout, metadata=metadata)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _status_of(error: grpc.RpcError) -> tuple[ErrorStatus, str]:
    """The HAL status a failed call stands for: the ErrorStatus name the
    server put first in the details, else one for the gRPC code."""
    code, details = error.code(), error.details() or ""
    name, sep, rest = details.partition(": ")
    if sep and name in ErrorStatus.__members__:
        return ErrorStatus[name], rest
    return _CODES.get(code, ErrorStatus.GENERAL_FAILURE), f"{code.name}: {details}"


_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT: ErrorStatus.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ErrorStatus.RESOURCE_EXHAUSTED_PERSISTENT,
    grpc.StatusCode.DEADLINE_EXCEEDED: ErrorStatus.MISSED_DEADLINE_TRANSIENT,
    grpc.StatusCode.UNAUTHENTICATED: ErrorStatus.DEVICE_UNAVAILABLE,
    grpc.StatusCode.PERMISSION_DENIED: ErrorStatus.DEVICE_UNAVAILABLE,
    grpc.StatusCode.INTERNAL: ErrorStatus.GENERAL_FAILURE,
}
# Codes that mean the server or the connection is gone.
_DEAD_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND})


def _channel(target: str, tls: ClientTls | None, token: str | None,
             keepalive: float) -> tuple[grpc.Channel, tuple]:
    """A channel to ``target`` and the metadata every call carries."""
    address, use_tls = parse_target(target)
    if tls is not None and not use_tls:
        raise invalid(f"{target}: TLS settings for a plaintext (grpc://) target")
    options = channel_options(keepalive)
    channel = grpc.secure_channel(address, (tls or ClientTls()).credentials(), options) \
        if use_tls else grpc.insecure_channel(address, options)
    return channel, ((("authorization", f"Bearer {token}"),) if token else ())


async def remote_status(target: str, *, tls: ClientTls | None = None, token: str | None = None,
                        timeout: float = CONNECT_TIMEOUT) -> tuple[str, object]:
    """The device name and the statistics (a ``StatisticsValue``: the
    scheduler's counters and recent jobs) of the remote service at
    ``target``, as far as it shows them to us (``nnrt driver status
    --remote``); DEVICE_UNAVAILABLE, saying why, when it does not answer
    within ``timeout`` seconds or refuses us."""
    channel, metadata = _channel(target, tls, token, KEEPALIVE)

    def ask():
        try:
            reply = pb_grpc.RemoteStub(channel).Status(pb.StatusRequest(), timeout=timeout,
                                                       metadata=metadata)
            return reply.device, decode_statistics(reply.statistics)
        except grpc.RpcError as e:
            raise NnrtError(ErrorStatus.DEVICE_UNAVAILABLE,
                            f"{e.code().name}: {e.details()}") from None
        except ProtocolError as e:
            raise NnrtError(ErrorStatus.DEVICE_UNAVAILABLE,
                            f"statistics that do not decode: {e.message}") from None
    try:
        return await run_in_worker(ask)
    finally:
        channel.close()


class RemoteDevice(Device):
    """A driver service on another host, seen through the HAL. Make one with
    :meth:`connect`."""

    def __init__(self, channel: grpc.Channel, stub: pb_grpc.RemoteStub, info: pb.DeviceInfo,
                 capabilities: Capabilities, extensions: list, target: str, metadata: tuple,
                 call_timeout: float, max_in_flight: int = MAX_IN_FLIGHT):
        self._channel = channel
        self._stub = stub
        self.name = info.name
        self.type = DeviceType(info.type)
        self.version_string = info.version_string
        self.feature_level = info.feature_level
        self.target = target
        self._capabilities = capabilities
        self._extensions = extensions
        # (0, 0) from a server that predates caching or offers none; a count
        # no driver may need reads as none.
        needed = (info.model_cache_files, info.data_cache_files)
        self._cache_files = needed if max(needed) <= MAX_CACHE_FILES else (0, 0)
        self._metadata = metadata
        self._call_timeout = call_timeout
        self._session_id = 0
        self._session_call = None
        self._lock = threading.Lock()
        self._pending: set = set()      # futures of the calls in flight
        self._places = _Places(max_in_flight)
        self._load: tuple | None = None    # (SchedulerLoad, when) of the latest reply
        self._sent = self._received = 0    # tensor bytes (see traffic)
        self.dead: NnrtError | None = None

    @classmethod
    async def connect(cls, target: str, *, tls: ClientTls | None = None,
                      token: str | None = None, timeout: float = CONNECT_TIMEOUT,
                      call_timeout: float = CALL_TIMEOUT,
                      keepalive: float = KEEPALIVE,
                      max_in_flight: int = MAX_IN_FLIGHT) -> "RemoteDevice":
        """Connect to the remote service at ``target``
        (``[grpc://|grpcs://]HOST:PORT``; ``grpcs`` and a bare address use
        TLS, with ``tls``'s CA and client certificate, else the system's
        roots), presenting ``token`` if given. DEVICE_UNAVAILABLE when
        nobody answers within ``timeout`` seconds, or the service refuses us
        (a certificate or token it does not take). At most ``max_in_flight``
        calls go out at once (executions, computations, control calls; a
        burst's frames go one at a time on their stream); more wait here."""
        for what, value in (("timeout", timeout), ("call_timeout", call_timeout),
                            ("keepalive", keepalive)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise invalid(f"{what} {value!r} is not a positive number of seconds")
        if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) \
                or max_in_flight < 1:
            raise invalid(f"max_in_flight {max_in_flight!r} is not a positive count")
        channel, metadata = _channel(target, tls, token, keepalive)
        stub = pb_grpc.RemoteStub(channel)
        try:
            device = await run_in_worker(lambda: cls._open(channel, stub, target, metadata, timeout,
                                                           call_timeout, max_in_flight))
        except BaseException:
            channel.close()
            raise
        vlog("driver", "connected to %s (%s) at %s", device.name, device.version_string, target)
        return device

    @classmethod
    def _open(cls, channel, stub, target, metadata, timeout, call_timeout,
              max_in_flight) -> "RemoteDevice":
        """The blocking part of :meth:`connect` (on a worker thread)."""
        try:
            info = stub.GetInfo(pb.GetInfoRequest(), timeout=timeout, metadata=metadata)
            capabilities = decode_capabilities(info.capabilities)
            extensions = decode_extensions(info.extensions)
            capabilities = replace(capabilities, round_trip=_round_trip(stub, metadata, timeout))
        except grpc.RpcError as e:
            if e.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                raise RemoteRefused(f"the remote driver service at {target} refused us: "
                                    f"{e.details()}") from None
            raise NnrtError(ErrorStatus.DEVICE_UNAVAILABLE,
                            f"the remote driver service at {target} did not answer: "
                            f"{e.code().name}: {e.details()}") from None
        except ProtocolError as e:
            raise NnrtError(ErrorStatus.DEVICE_UNAVAILABLE,
                            f"the remote driver service at {target} sent queries that do not "
                            f"decode: {e.message}") from None
        device = cls(channel, stub, info, capabilities, extensions, target, metadata,
                     call_timeout, max_in_flight)
        device._open_session(timeout)
        return device

    def _open_session(self, timeout: float) -> None:
        call = self._stub.Session(pb.SessionRequest(), metadata=self._metadata)
        self._session_call = call
        opened = threading.Event()
        first: list = []

        def watch() -> None:
            reason = "the session ended"
            try:
                for event in call:
                    if not first:
                        first.append(event.session)
                        opened.set()
            except grpc.RpcError as e:
                reason = f"{e.code().name}: {e.details()}"
            finally:
                opened.set()
                self._die(f"the remote driver service at {self.target} is gone ({reason})")

        threading.Thread(target=watch, name=f"nnrt-remote-{self.target}", daemon=True).start()
        if not opened.wait(timeout) or not first:
            call.cancel()
            reason = self.dead.message if self.dead is not None else \
                f"no session within {timeout:g} s"
            raise NnrtError(ErrorStatus.DEVICE_UNAVAILABLE, reason)
        self._session_id = first[0]

    # -- life ---------------------------------------------------------------------

    def _die(self, message: str) -> None:
        """The device is gone: every call in flight ends with DEAD_OBJECT."""
        with self._lock:
            if self.dead is not None:
                return
            self.dead = NnrtError(ErrorStatus.DEAD_OBJECT, message)
            pending = list(self._pending)
        vlog("driver", "%s", message)
        for future in pending:
            future.cancel()

    @property
    def alive(self) -> bool:
        return self.dead is None

    @property
    def session_id(self) -> int:
        """The session every call of this device names (the server's id)."""
        return self._session_id

    def close(self) -> None:
        """End the session (the server releases what it made for us) and
        the connection."""
        self._die(f"the remote device {self.name} was closed")
        if self._session_call is not None:
            self._session_call.cancel()
        self._channel.close()

    # -- calls --------------------------------------------------------------------

    def _start(self, rpc, request, timeout: float | None):
        with self._lock:
            if self.dead is not None:
                raise self.dead
            future = rpc.future(request, timeout=timeout, metadata=self._metadata)
            self._pending.add(future)
        return future

    def _finish(self, future):
        """The reply of a finished call, or the NnrtError it stands for."""
        with self._lock:
            self._pending.discard(future)
        if future.cancelled() and self.dead is not None:
            raise self.dead
        try:
            return future.result()
        except grpc.RpcError as e:
            if self.dead is not None:
                raise self.dead from None
            if e.code() in _DEAD_CODES:
                self._die(f"the remote driver service at {self.target} is gone "
                          f"({e.code().name}: {e.details()})")
                raise self.dead from None
            status, message = _status_of(e)
            raise NnrtError(status, message) from None
        except grpc.FutureCancelledError:
            raise NnrtError(ErrorStatus.DEAD_OBJECT if self.dead else ErrorStatus.GENERAL_FAILURE,
                            "the call was cancelled") from None

    async def call(self, rpc, request, timeout: float | None):
        """Await ``rpc(request)``: its reply, or the NnrtError it failed with,
        once one of the device's in-flight places is free. A cancelled
        caller cancels the call."""
        await self._places.take()
        try:
            future = self._start(rpc, request, timeout)
            waiter = Waiter()
            future.add_done_callback(waiter.deliver)
            try:
                await waiter.wait()
            except BaseException:
                future.cancel()
                with self._lock:
                    self._pending.discard(future)
                raise
            return self._finish(future)
        finally:
            self._places.give()

    def call_blocking(self, rpc, request, timeout: float | None):
        self._places.take_blocking()
        try:
            future = self._start(rpc, request, timeout)
            try:
                future.exception()      # waits; a cancelled future raises here
            except grpc.FutureCancelledError:
                pass
            return self._finish(future)
        finally:
            self._places.give()

    def _release_later(self, rpc, message) -> None:
        """Send a release (not awaited); nothing when the device is dead:
        the server released it all with the session."""
        if self.dead is not None:
            return
        try:
            self._start(rpc, message, self._call_timeout).add_done_callback(_forget(self))
        except NnrtError:
            pass   # dead meanwhile

    def remote_statistics(self) -> RemoteStatistics:
        """Calls on the network now and calls waiting here for a place."""
        return self._places.statistics()

    def _count(self, sent: int = 0, received: int = 0) -> None:
        with self._lock:
            self._sent += sent
            self._received += received

    def traffic(self) -> RemoteTraffic:
        """The tensor bytes sent and received so far."""
        with self._lock:
            return RemoteTraffic(self._sent, self._received)

    def _note_load(self, reply: pb.ExecutionReply) -> None:
        load = wire.load_of(reply)
        if load is not None:
            self._load = (load, time.monotonic())   # one reference swapped: no lock

    def load_seen(self) -> tuple:
        """The serving device's load as the latest execution reply brought
        it (``nnrt.qos.SchedulerLoad``) and its age in seconds; ``(None,
        inf)`` before any reply."""
        seen = self._load
        if seen is None:
            return None, math.inf
        return seen[0], time.monotonic() - seen[1]

    def _control_timeout(self, deadline: float | None = None) -> float:
        return wire.timeout_of(deadline, self._call_timeout)

    # -- the HAL ------------------------------------------------------------------

    def capabilities(self) -> Capabilities:
        return self._capabilities

    def supported_extensions(self) -> list:
        return list(self._extensions)

    def scheduling(self) -> Scheduling:
        # The serving host runs its own scheduler in front of its driver.
        return Scheduling(fronted=True)

    async def supported_operations(self, model: HalModel) -> list[bool]:
        reply = await self.call(self._stub.SupportedOperations,
                                pb.ModelBytes(session=self._session_id,
                                              model=encode_model(model)),
                                self._control_timeout())
        return checked_flags(reply.supported, model, self.name)

    def number_of_cache_files_needed(self) -> tuple[int, int]:
        return self._cache_files

    async def prepare_model(self, model: HalModel,
                            preference: ExecutionPreference = ExecutionPreference.FAST_SINGLE_ANSWER,
                            priority: Priority = Priority.MEDIUM, deadline: float | None = None,
                            cache: CacheFiles | None = None, *, app=None) -> "RemotePreparedModel":
        """Prepare ``model`` on the remote host. ``app`` is not sent: the
        server knows the caller by its certificate or token. With ``cache``
        the server returns its driver's cache files (sealed for this app),
        written here into the app's fds (see .cache)."""
        request = pb.PrepareModelRequest(session=self._session_id, model=encode_model(model),
                                         preference=int(preference), priority=int(priority),
                                         deadline=wire.remaining(deadline))
        if cache is None:
            reply = await self.call(self._stub.PrepareModel, request,
                                    self._control_timeout(deadline))
            return RemotePreparedModel(self, reply.model_id)
        check_counts(cache, self._cache_files)
        reply = await self.call(self._stub.PrepareModelCaching,
                                pb.PrepareModelCachingRequest(prepare=request, token=cache.token),
                                self._control_timeout(deadline))
        prepared = RemotePreparedModel(self, reply.model_id)
        try:
            await run_in_worker(remote_cache.write_app_files, cache,
                                reply.cache if reply.HasField("cache") else None)
        except OSError as e:   # only the next compilation's speed is lost
            vlog("compilation", "%s: could not write the cache files: %s", self.name, e)
        return prepared

    async def prepare_model_from_cache(self, cache: CacheFiles,
                                       priority: Priority = Priority.MEDIUM,
                                       deadline: float | None = None, *,
                                       app=None) -> "RemotePreparedModel":
        """The remote host prepares from the app's cache files, sent with
        the call; its refusal comes back as CacheRejected with its reason."""
        files = await run_in_worker(remote_cache.read_app_files, cache, self._cache_files)
        request = pb.PrepareModelFromCacheRequest(
            session=self._session_id, priority=int(priority), deadline=wire.remaining(deadline),
            cache=files)
        reply = await self.call(self._stub.PrepareModelFromCache, request,
                                self._control_timeout(deadline))
        if reply.reject:
            try:
                reason = CacheReject(reply.reject)
            except ValueError:
                reason = CacheReject.UNUSABLE
            raise CacheRejected(reason, reply.message)
        return RemotePreparedModel(self, reply.model_id)

    async def allocate(self, desc: BufferDesc, prepared_models, input_roles, output_roles, *,
                       app=None) -> tuple["RemoteBuffer", int]:
        """A driver buffer kept on the remote host for these roles of its
        prepared models (``Allocate``); only its token comes back. ``app``
        is not sent: the server knows the caller."""
        ids = []
        for k, prepared in enumerate(prepared_models):
            if not isinstance(prepared, RemotePreparedModel) or prepared.device is not self \
                    or prepared._released:
                raise invalid(f"allocate: prepared model {k} is not a live model of {self.name}")
            ids.append(prepared.model_id)
        with _as_invalid("allocate"):
            roles = [[pb.BufferRole(model_index=r.model_index, io_index=r.io_index,
                                    frequency=r.frequency) for r in rs]
                     for rs in (input_roles, output_roles)]
            request = pb.AllocateRequest(session=self._session_id,
                                         dimensions=tuple(desc.dimensions), model_ids=ids,
                                         input_roles=roles[0], output_roles=roles[1])
        reply = await self.call(self._stub.Allocate, request, self._control_timeout())
        return RemoteBuffer(self, reply.token), reply.token

    def __repr__(self) -> str:
        return (f"<RemoteDevice {self.name} at {self.target}, round trip "
                f"{self._capabilities.round_trip * 1e3:.2f} ms{'' if self.alive else ', dead'}>")


class RemotePreparedModel(PreparedModel):
    """A model prepared on a remote host; many executions may be in flight."""

    def __init__(self, device: RemoteDevice, model_id: int):
        self.device = device
        self.model_id = model_id
        self._released = False

    def _execute_request(self, request: Request, measure, deadline, loop_timeout):
        wire.check_request(request)
        return pb.ExecuteRequest(
            session=self.device._session_id, model_id=self.model_id,
            inputs=wire.arguments(request, request.inputs),
            outputs=wire.arguments(request, request.outputs),
            input_data=wire.input_data(request), measure=bool(measure),
            deadline=wire.remaining(deadline), loop_timeout=loop_timeout or 0.0)

    def _unusable(self) -> ExecutionResult | None:
        if self._released:
            return ExecutionResult(ErrorStatus.INVALID_ARGUMENT,
                                   message="the prepared model was released")
        if self.device.dead is not None:
            return ExecutionResult(ErrorStatus.DEAD_OBJECT, message=self.device.dead.message)
        return None

    async def execute(self, request: Request, measure: bool = False,
                      deadline: float | None = None,
                      loop_timeout: float | None = None) -> ExecutionResult:
        problem = self._unusable()
        if problem is not None:
            return problem
        try:
            message = self._execute_request(request, measure, deadline, loop_timeout)
            self.device._count(sent=_data_bytes(message.input_data))
            reply = await self.device.call(self.device._stub.Execute, message,
                                           _execution_timeout(deadline))
            return _finished(request, reply, self.device)
        except NnrtError as e:
            return ExecutionResult(e.status, message=e.message)

    def execute_synchronously(self, request: Request, measure: bool = False,
                              deadline: float | None = None,
                              loop_timeout: float | None = None, *,
                              checkpoint=None) -> ExecutionResult:
        """A blocking round trip (from a thread, not a coroutine).
        ``checkpoint`` is not taken: the remote scheduler decides."""
        if checkpoint is not None:
            return ExecutionResult(ErrorStatus.INVALID_ARGUMENT,
                                   message="a remote execution takes no outside checkpoint")
        problem = self._unusable()
        if problem is not None:
            return problem
        try:
            message = self._execute_request(request, measure, deadline, loop_timeout)
            self.device._count(sent=_data_bytes(message.input_data))
            reply = self.device.call_blocking(self.device._stub.Execute, message,
                                              _execution_timeout(deadline))
            return _finished(request, reply, self.device)
        except NnrtError as e:
            return ExecutionResult(e.status, message=e.message)

    def create_execution(self, request: Request, measure: bool = False,
                         loop_timeout: float | None = None) -> "RemoteExecution":
        return RemoteExecution(self, request, measure, loop_timeout)

    async def configure_burst(self) -> "RemoteBurst":
        """A burst stream to the remote host (see :class:`RemoteBurst`)."""
        problem = self._unusable()
        if problem is not None:
            raise NnrtError(problem.status, problem.message)
        return RemoteBurst(self)

    def release(self) -> None:
        """Release it on the remote host (not awaited). Idempotent."""
        if self._released:
            return
        self._released = True
        device = self.device
        device._release_later(device._stub.ReleaseModel,
                              pb.ModelRef(session=device._session_id, model_id=self.model_id))


def _forget(device: RemoteDevice):
    def done(future) -> None:
        with device._lock:
            device._pending.discard(future)
    return done


def _execution_timeout(deadline: float | None) -> float | None:
    """An execution has no transport timeout of its own (a hung host is
    keepalive's to find); with a deadline, the gRPC deadline follows it."""
    if deadline is None or not math.isfinite(deadline):
        return None
    return max(0.001, deadline - time.monotonic() + _DEADLINE_SLACK)


def _data_bytes(blobs) -> int:
    return sum(len(b) for b in blobs)


def _finished(request: Request, reply: pb.ExecutionReply,
              device: "RemoteDevice | None" = None) -> ExecutionResult:
    """The result of ``reply``, its outputs written into ``request``'s
    regions; ``device`` notes the load it carries."""
    if device is not None:
        device._note_load(reply)
        device._count(received=_data_bytes(reply.output_data))
    result = wire.result_of(reply)
    if result.status == ErrorStatus.NONE:
        wire.copy_outputs(request, reply.output_data)
    return result


class RemoteExecution(Execution):
    """A reusable execution on a remote host: the request's layout bound
    there with its first computation, then each computation sends the
    inputs' bytes and the deadline, and writes the outputs back. An error
    creating it is its first computation's result (the next one tries again)."""

    def __init__(self, prepared: RemotePreparedModel, request: Request, measure: bool,
                 loop_timeout: float | None):
        wire.check_request(request)
        self.prepared = prepared
        self.request = request
        self.measure = bool(measure)
        self.loop_timeout = loop_timeout
        self._id: int | None = None
        self._released = False

    def _create_request(self):
        device = self.prepared.device
        return pb.CreateExecutionRequest(
            session=device._session_id, model_id=self.prepared.model_id,
            inputs=wire.arguments(self.request, self.request.inputs),
            outputs=wire.arguments(self.request, self.request.outputs), measure=self.measure,
            loop_timeout=self.loop_timeout or 0.0)

    def _compute_request(self, deadline):
        data = wire.input_data(self.request)
        self.prepared.device._count(sent=_data_bytes(data))
        return pb.ComputeRequest(session=self.prepared.device._session_id,
                                 execution_id=self._id, input_data=data,
                                 deadline=wire.remaining(deadline))

    def _unusable(self) -> ExecutionResult | None:
        if self._released:
            return ExecutionResult(ErrorStatus.INVALID_ARGUMENT,
                                   message="the execution was released")
        return self.prepared._unusable()

    async def execute(self, deadline: float | None = None) -> ExecutionResult:
        problem = self._unusable()
        if problem is not None:
            return problem
        device = self.prepared.device
        try:
            if self._id is None:
                reply = await device.call(device._stub.CreateExecution, self._create_request(),
                                          device._control_timeout(deadline))
                self._id = reply.execution_id
            reply = await device.call(device._stub.Compute, self._compute_request(deadline),
                                      _execution_timeout(deadline))
            return _finished(self.request, reply, self.prepared.device)
        except NnrtError as e:
            return ExecutionResult(e.status, message=e.message)

    def execute_synchronously(self, deadline: float | None = None, *,
                              checkpoint=None) -> ExecutionResult:
        if checkpoint is not None:
            return ExecutionResult(ErrorStatus.INVALID_ARGUMENT,
                                   message="a remote execution takes no outside checkpoint")
        problem = self._unusable()
        if problem is not None:
            return problem
        device = self.prepared.device
        try:
            if self._id is None:
                reply = device.call_blocking(device._stub.CreateExecution,
                                             self._create_request(),
                                             device._control_timeout(deadline))
                self._id = reply.execution_id
            reply = device.call_blocking(device._stub.Compute, self._compute_request(deadline),
                                         _execution_timeout(deadline))
            return _finished(self.request, reply, self.prepared.device)
        except NnrtError as e:
            return ExecutionResult(e.status, message=e.message)

    def release(self) -> None:
        """Release it on the remote host (not awaited). Idempotent."""
        if self._released:
            return
        self._released = True
        device = self.prepared.device
        if self._id is not None and not self.prepared._released:
            device._release_later(device._stub.ReleaseExecution,
                                  pb.ExecutionRef(session=device._session_id,
                                                  execution_id=self._id))

    def __repr__(self) -> str:
        return f"<RemoteExecution {self._id} of model {self.prepared.model_id}>"


_END = object()   # ends a burst's stream of frames


class RemoteBurst(BurstSession):
    """A burst on a remote host: one bidirectional ``Burst`` stream. A frame
    names its request's layout (sent once, with the first frame that uses
    it: the server binds it once) and carries only the inputs whose bytes
    changed since that layout's last frame; the result carries the outputs.
    Frames go out in order through a queue the channel's thread reads; a
    reader thread hands each result to the task awaiting that serial. A
    cancelled frame still runs there (the stream is ordered); its result is
    dropped. When the stream fails, every frame waiting fails with it:
    DEAD_OBJECT when the host is gone."""

    def __init__(self, prepared: RemotePreparedModel):
        self.prepared = prepared
        device = prepared.device
        self._device = device
        self._frames: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._waiters: dict[int, Waiter] = {}
        self._serial = 0
        self._layouts: dict[bytes, tuple[int, list]] = {}   # layout -> (id, last inputs sent)
        self._ended: NnrtError | None = None
        self._closed = False
        with device._lock:
            if device.dead is not None:
                raise device.dead
            self._call = device._stub.Burst(iter(self._frames.get, _END),
                                            metadata=device._metadata)
            device._pending.add(self._call)
        threading.Thread(target=self._read, name=f"nnrt-remote-burst-{device.target}",
                         daemon=True).start()

    def _read(self) -> None:
        ended = NnrtError(ErrorStatus.GENERAL_FAILURE, "the burst ended")
        try:
            for result in self._call:
                with self._lock:
                    waiter = self._waiters.pop(result.serial, None)
                if waiter is not None:
                    waiter.deliver(result.result)
        except grpc.RpcError as e:
            device = self._device
            if e.code() in _DEAD_CODES:
                device._die(f"the remote driver service at {device.target} is gone "
                            f"({e.code().name}: {e.details()})")
            if device.dead is not None:
                ended = device.dead
            elif not self._closed:
                status, message = _status_of(e)
                ended = NnrtError(status, f"the burst ended: {message}")
        finally:
            with self._lock:
                self._ended = ended
                waiters, self._waiters = list(self._waiters.values()), {}
                with self._device._lock:
                    self._device._pending.discard(self._call)
            for waiter in waiters:
                waiter.deliver(None)

    def _frame(self, request: Request, layout: "_Layout", deadline) -> pb.BurstFrame:
        """The next frame; INVALID_ARGUMENT (before any state changes) for
        a request whose regions lie outside its pools or a bad deadline."""
        device = self._device
        wire.check_request(request)
        data = wire.input_data(request)
        left = wire.remaining(deadline)
        layout, key = layout
        known = self._layouts.get(key)
        frame = pb.BurstFrame(session=device._session_id, model_id=self.prepared.model_id,
                              deadline=left)
        if known is None:
            known = self._layouts[key] = (len(self._layouts) + 1, [None] * len(request.inputs))
            frame.layout.CopyFrom(layout)
        frame.layout_id, last = known
        for k, blob in enumerate(data):
            if blob != last[k] and not request.inputs[k].has_no_value \
                    and not wire.token_of(request.pools, request.inputs[k]):
                # add(), not append(ChangedInput(...)): appending a message
                # copies it (upb: ~0.7 ms for a 150 KB camera frame).
                frame.changed.add(index=k, data=blob)
                last[k] = blob
                device._count(sent=len(blob))
        return frame

    async def execute(self, request: Request, measure: bool = False,
                      deadline: float | None = None,
                      loop_timeout: float | None = None) -> ExecutionResult:
        return await self._run(request, _layout_of(request, measure, loop_timeout), deadline)

    async def _run(self, request: Request, layout: "_Layout", deadline) -> ExecutionResult:
        """A frame of ``request`` in ``layout`` (made once by a bound
        execution, :class:`_RemoteBurstExecution`, or per call by ``execute``)."""
        problem = self._unusable()
        if problem is not None:
            return problem
        waiter = Waiter()
        try:
            with self._lock:
                if self._ended is not None:
                    return ExecutionResult(self._ended.status, message=self._ended.message)
                frame = self._frame(request, layout, deadline)
                self._serial += 1
                frame.serial = self._serial
                self._waiters[frame.serial] = waiter
                self._frames.put(frame)
        except NnrtError as e:
            return ExecutionResult(e.status, message=e.message)
        reply = await waiter.wait()
        if reply is None:
            ended = self._ended
            return ExecutionResult(ended.status, message=ended.message)
        try:
            return _finished(request, reply, self._device)
        except NnrtError as e:
            return ExecutionResult(e.status, message=e.message)

    def _unusable(self) -> ExecutionResult | None:
        if self._closed:
            return ExecutionResult(ErrorStatus.INVALID_ARGUMENT,
                                   message="the burst session is closed")
        return self.prepared._unusable()

    def create_execution(self, request: Request, measure: bool = False,
                         loop_timeout: float | None = None) -> "_RemoteBurstExecution":
        """Each execution is a frame of this burst (its layout bound on the
        server by the first)."""
        if self._closed:
            raise NnrtError(ErrorStatus.INVALID_ARGUMENT, "the burst session is closed")
        return _RemoteBurstExecution(self, request, measure, loop_timeout)

    def close(self) -> None:
        """End the stream (the server lets go of the layouts). Idempotent."""
        if not self._closed:
            self._closed = True
            self._frames.put(_END)


_Layout = tuple  # (pb.Layout, its deterministic bytes: the key of the burst's layouts)


def _layout_of(request: Request, measure, loop_timeout) -> _Layout:
    layout = pb.Layout(inputs=wire.arguments(request, request.inputs),
                       outputs=wire.arguments(request, request.outputs), measure=bool(measure),
                       loop_timeout=loop_timeout or 0.0)
    return layout, layout.SerializeToString(deterministic=True)


class _RemoteBurstExecution(BurstExecution):
    """A request bound to a remote burst: each execution is a frame of it,
    its layout made once here (and bound on the server by the first frame)."""

    def __init__(self, burst: RemoteBurst, request: Request, measure: bool,
                 loop_timeout: float | None):
        wire.check_request(request)
        self.burst = burst
        self.request = request
        self.measure = measure
        self.loop_timeout = loop_timeout
        self._layout = _layout_of(request, measure, loop_timeout)

    async def execute(self, deadline: float | None = None) -> ExecutionResult:
        return await self.burst._run(self.request, self._layout, deadline)


@contextlib.contextmanager
def _as_invalid(what: str):
    """INVALID_ARGUMENT for values a message cannot carry (a negative
    index or dimension, a role that is no BufferRole)."""
    try:
        yield
    except (TypeError, ValueError, AttributeError) as e:
        raise invalid(f"{what}: {e}") from None


class RemoteBuffer(Buffer):
    """A driver buffer kept on a remote host (memory domains), named by its
    token; a copy moves its bytes over the connection, raw. Its contents
    die with the host (:meth:`recover` answers None)."""

    def __init__(self, device: RemoteDevice, token: int):
        self.device = device
        self.token = token
        self._released = False

    def _ref(self) -> dict:
        if self._released:
            raise invalid(f"buffer {self.token} was released")
        return dict(session=self.device._session_id, token=self.token)

    async def copy_to(self, memory) -> None:
        dst = as_buffer(memory)
        if dst.readonly:
            raise invalid(f"copy_to: the destination of buffer {self.token} is read-only")
        device = self.device
        reply = await device.call(device._stub.CopyTo,
                                  pb.CopyToRequest(length=dst.nbytes, **self._ref()),
                                  device._control_timeout())
        if len(reply.data) != dst.nbytes:
            raise NnrtError(ErrorStatus.GENERAL_FAILURE,
                            f"the remote device sent {len(reply.data)} bytes of buffer "
                            f"{self.token} for {dst.nbytes}")
        device._count(received=dst.nbytes)
        dst[:] = reply.data

    async def copy_from(self, memory, dimensions=()) -> None:
        data = as_buffer(memory).tobytes()
        device = self.device
        with _as_invalid("copy_from"):
            request = pb.CopyFromRequest(data=data, dimensions=tuple(dimensions), **self._ref())
        device._count(sent=len(data))
        await device.call(device._stub.CopyFrom, request, device._control_timeout())

    def release(self) -> None:
        """Release it on the remote host (not awaited). Idempotent."""
        if self._released:
            return
        self._released = True
        device = self.device
        device._release_later(device._stub.ReleaseBuffer,
                              pb.BufferRef(session=device._session_id, token=self.token))

    def __repr__(self) -> str:
        return f"<RemoteBuffer {self.token} on {self.device.name}>"
