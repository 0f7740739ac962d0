"""A driver service on gRPC (``nnrt driver serve NAME --listen HOST:PORT``):
the remote HAL of ``nnrt_remote_v1.proto`` in front of the same scheduled
device the Unix socket serves, so apps on other hosts are queued, weighed
and capped with the local ones.

Theory of operation
-------------------
:func:`serve_remote` runs a ``grpc.aio`` server on the service's own event
loop (asyncio, uvloop when the CLI starts it) with three services: nnrt's
``Remote``, the standard ``grpc.health.v1.Health`` (SERVING while up) and
server reflection. Each call of ``Remote`` is one coroutine calling the
scheduled device (:class:`nnrt.qos.ScheduledDevice`) as the local server's
handlers do; the driver's work runs on the scheduler's threads, never on
the loop.

Who calls. Every call is authenticated before anything else is read: with
``--client-ca`` the TLS layer has verified the client's certificate, whose
common name names the app; with ``--token-file`` the call's
``authorization: Bearer TOKEN`` metadata must be one of the file's tokens
(compared in constant time), whose name names the app; on a plaintext
listener (``--insecure``, loopback only unless forced) the app is the
peer's address. The scheduler keys the app ``("remote", name)``; a policy
rule matches it with ``remote = "name"`` (:mod:`nnrt.qos.policy`).

What a caller owns. A client opens a ``Session`` stream first; every other
call names that session, which belongs to the app that opened it (naming
another app's session is PERMISSION_DENIED, an unknown one NOT_FOUND).
Prepared models and reusable executions belong to a session; when its
stream ends -- the client closed it, its process died, its connection was
reset or its keepalive pings stopped -- the server releases all of it.

Memory domains. ``Allocate`` asks the device for a driver buffer for
roles of the session's prepared models; the buffer is the session's, and
its token stands for an input or output of Execute, CreateExecution and a
burst's layout (``Argument.token``) only in that session: a token of
another session (another app's, or the same app's other connection) is
INVALID_ARGUMENT before the driver sees it, and the driver checks the
app and the role on every use. No bytes of it cross until the client
copies (``CopyTo``, ``CopyFrom``: raw bytes).

One account with the local socket. The servicer counts against the
:class:`~nnrt.service.server.DriverService` of the same process
(:meth:`~nnrt.service.server.DriverService.over_limit_of`). A session is
one of the app's ``connections``, and its models are ``models``. Its burst
streams are ``bursts``. The request bytes its reusable executions and burst
layouts keep are ``mapped_bytes``, and so are its driver buffers' bytes (as
allocated when their dimensions are known then, else the most copied into
them). All remote apps together are one user for ``reserve_percent``.

A client that stops reading. A burst runs one frame at a time, and the
handler reads the next frame only after it has written the result.
``grpc.aio`` finishes that write only when HTTP/2 flow control lets the
bytes go. So a stream whose client stops reading holds one result, plus
the frames that the receive window (``lookahead_bytes``) already took, and
nothing more. The client's sending stalls as well. Nothing else waits on
that stream (``test_a_client_that_never_reads_its_burst_stalls_its_own_stream_only``).

Failures stay in their call. A message that does not decode, a layout out
of bounds, a model the driver refuses: the call's status says so (as an
``ExecutionReply`` status for executions, as a gRPC status otherwise); a
driver bug is GENERAL_FAILURE; nothing reaches the other calls. gRPC
bounds every message (``MAX_MESSAGE``) before it is decoded.
"""
from __future__ import annotations

import asyncio
import hmac
import itertools
import os
import stat
from dataclasses import dataclass, field

import anyio
import grpc
from grpc_health.v1 import _async as health_async
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ...errors import ErrorStatus, NnrtError, invalid
from ...handoff import run_in_worker
from ...hal import BufferDesc, BufferRole, ExecutionPreference, ExecutionResult, Request
from ...hal.buffers import MAX_BUFFER_BYTES
from ...hal.cache import CacheRejected
from ...hal.types import Priority
from ...memory import DeviceToken
from ...model.extensions import uses_extensions
from ...vlog import vlog
from ..protocol import (ProtocolError, decode_model, encode_capabilities, encode_extensions,
                        encode_statistics)
from ..address import is_loopback
from ..server import REMOTE_USER, DriverService, known_buffer_size
from . import cache as remote_cache
from . import nnrt_remote_v1_pb2 as pb
from . import nnrt_remote_v1_pb2_grpc as pb_grpc
from . import wire

MAX_MODELS_PER_SESSION = 1024
MAX_EXECUTIONS_PER_SESSION = 1024
MAX_BURSTS_PER_SESSION = 64
MAX_LAYOUTS_PER_BURST = 64
MAX_BUFFERS_PER_SESSION = 1024    # driver buffers (memory domains) alive
MAX_TOKEN_FILE = 1 << 16
# gRPC's HTTP/2 keepalive on the server side: ping an idle client, and
# allow clients to ping as often as nnrt's client does (every 1 s).
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", wire.MAX_MESSAGE + (1 << 20)),
    ("grpc.max_send_message_length", wire.MAX_MESSAGE + (1 << 20)),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.ping_timeout_ms", 5_000),   # see the client's options
    ("grpc.http2.min_ping_interval_without_data_ms", 500),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    # A stream's receive window: a camera frame (150 KB) arrives without
    # waiting for a WINDOW_UPDATE round trip (the default window is 64 KiB).
    ("grpc.http2.lookahead_bytes", 4 << 20),
]


@dataclass(frozen=True)
class Listener:
    """How ``--listen`` serves: the address and who may call."""

    address: str                       # HOST:PORT
    cert: bytes | None = None          # PEM: --tls-cert
    key: bytes | None = None           # PEM: --tls-key
    client_ca: bytes | None = None     # PEM: --client-ca (mutual TLS)
    tokens: dict[str, bytes] = field(default_factory=dict)   # name -> token: --token-file
    insecure: bool = False
    # Remote apps (certificate or token names) that see every app's work in
    # Status (--admin-remote), as --admin-uid does for local ones.
    admins: frozenset[str] = frozenset()

    def __post_init__(self):
        if (self.cert is None) != (self.key is None):
            raise invalid("--tls-cert and --tls-key go together")
        if self.client_ca is not None and self.cert is None:
            raise invalid("--client-ca needs --tls-cert and --tls-key")
        if self.cert is None and not self.insecure:
            raise invalid(f"--listen {self.address}: give --tls-cert and --tls-key, or "
                          f"--insecure for plaintext")
        if self.cert is not None and self.insecure:
            raise invalid("--insecure and --tls-cert exclude each other")
        if self.insecure and not is_loopback(self.address):
            raise invalid(f"--insecure serves plaintext on loopback addresses only, not on "
                          f"{self.address}: anyone on the network could read the tensors "
                          f"and run models; use --tls-cert and --tls-key")

    def credentials(self) -> grpc.ServerCredentials | None:
        if self.cert is None:
            return None
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.client_ca,
            require_client_auth=self.client_ca is not None)


def load_tokens(path: str) -> dict[str, bytes]:
    """The tokens of a ``--token-file``: one ``NAME TOKEN`` per line (``#``
    starts a comment). The file must be the service user's and readable by
    nobody else, as ssh asks of its keys."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise invalid(f"cannot read the token file {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_TOKEN_FILE:
            raise invalid(f"the token file {path} is not a regular file of at most "
                          f"{MAX_TOKEN_FILE} bytes")
        if st.st_mode & 0o077 or st.st_uid != os.geteuid():
            raise invalid(f"the token file {path} (mode {stat.S_IMODE(st.st_mode):04o}, uid "
                          f"{st.st_uid}) must be yours and readable by you alone: chmod 600")
        text = os.read(fd, MAX_TOKEN_FILE + 1).decode("utf-8", "replace")
    finally:
        os.close(fd)
    tokens: dict[str, bytes] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or len(parts[1]) < 16:
            raise invalid(f"{path} line {number}: expected NAME TOKEN (a token of 16 "
                          f"characters or more)")
        tokens[parts[0]] = parts[1].encode()
    if not tokens:
        raise invalid(f"the token file {path} holds no token")
    return tokens


class _Session:
    """What one client session made: prepared models, bound executions and
    driver buffers. The service counts it as it counts a local connection
    (:meth:`DriverService.over_limit_of`): one of ``connections``, its
    prepared models as ``models``, its burst streams as ``bursts``, and the
    bytes of the request pools its reusable executions and burst layouts
    keep between calls, and of its driver buffers, as ``mapped_bytes``."""

    def __init__(self, app):
        self.app = app
        self.models: dict[int, object] = {}      # id -> PreparedModel
        self.graphs: dict[int, object] = {}      # id -> its HalModel (sizes buffers)
        self.executions: dict[int, _Bound] = {}
        self.bursts: set[_Burst] = set()     # burst streams open
        self.buffers: dict[int, _Kept] = {}      # token -> a driver buffer of this session

    def held(self, resource: str) -> int:
        if resource == "connections":
            return 1
        if resource == "models":
            return len(self.models)
        if resource == "bursts":
            return len(self.bursts)
        if resource == "mapped_bytes":
            return sum(b.nbytes for b in self.executions.values()) + \
                sum(b.nbytes for burst in self.bursts for b in burst.layouts.values()) + \
                sum(k.nbytes for k in self.buffers.values())
        if resource == "mapped_memories":
            return 0    # the pools are the server's own: no fd, no mapping of the app's
        raise AssertionError(f"no resource {resource!r}")

    def close(self) -> None:
        for bound in self.executions.values():
            bound.close()
        self.executions.clear()
        for kept in self.buffers.values():
            kept.buffer.release()
        self.buffers.clear()
        for prepared in self.models.values():
            prepared.release()
        self.models.clear()
        self.graphs.clear()


@dataclass(eq=False)
class _Kept:
    """A driver buffer of a session and the bytes it is counted for."""

    buffer: object      # nnrt.hal.Buffer
    nbytes: int


class _Bound:
    """A reusable execution: the driver's execution bound to pools of the
    server's own, which each compute fills with the inputs that came."""

    def __init__(self, model_id: int, execution, inputs, outputs, pools):
        self.model_id = model_id
        self.execution = execution
        self.inputs, self.outputs, self.pools = inputs, outputs, pools
        self.nbytes = wire.pool_bytes(pools)
        self.computing = False

    def close(self) -> None:
        execution, self.execution = self.execution, None
        if execution is not None:
            execution.release()


class _Refused(Exception):
    """A call refused with a gRPC status (the servicer aborts with it)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


_STATUS_CODES = {
    ErrorStatus.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorStatus.RESOURCE_EXHAUSTED_PERSISTENT: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorStatus.RESOURCE_EXHAUSTED_TRANSIENT: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorStatus.MISSED_DEADLINE_PERSISTENT: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorStatus.MISSED_DEADLINE_TRANSIENT: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorStatus.DEVICE_UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
}


def _guarded(method):
    """A servicer method whose failures become the call's status: an
    NnrtError its status (its ErrorStatus name leads the details, so the
    client gets it back), a refusal its code, anything else -- a bug --
    GENERAL_FAILURE; never an exception out of the server."""
    async def guarded(self, request, context):
        try:
            return await method(self, request, context)
        except _Refused as e:
            await context.abort(e.code, str(e))
        except NnrtError as e:
            await context.abort(_STATUS_CODES.get(e.status, grpc.StatusCode.INTERNAL),
                                f"{e.status.name}: {e.message}")
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as e:   # a driver bug must not take the service down
            vlog("driver", "remote %s failed: %s: %s", method.__name__, type(e).__name__, e)
            await context.abort(grpc.StatusCode.INTERNAL,
                                f"GENERAL_FAILURE: {type(e).__name__} in the driver: {e}")
    guarded.__name__ = method.__name__
    return guarded


class RemoteServicer(pb_grpc.RemoteServicer):
    """nnrt's ``Remote`` service over one (scheduled) device."""

    def __init__(self, service: DriverService, listener: Listener):
        self.service = service   # its limits and accounting, shared with the local socket
        self.device = device = service.device
        self.listener = listener
        self.sessions: dict[int, _Session] = {}
        self._ids = itertools.count(1)
        self.info = pb.DeviceInfo(
            name=device.name, type=int(device.type), version_string=device.version_string,
            feature_level=device.feature_level,
            capabilities=encode_capabilities(device.capabilities()),
            extensions=encode_extensions(list(device.supported_extensions())),
            model_cache_files=device.number_of_cache_files_needed()[0],
            data_cache_files=device.number_of_cache_files_needed()[1])

    # -- who calls ------------------------------------------------------------------

    def app_of(self, context) -> tuple[str, str]:
        """The caller's app key, ``("remote", name)``; UNAUTHENTICATED for a
        caller this listener does not know."""
        listener = self.listener
        if listener.tokens:
            presented = b""
            for key, value in context.invocation_metadata() or ():
                if key == "authorization" and isinstance(value, str) \
                        and value.startswith("Bearer "):
                    presented = value[len("Bearer "):].encode()
            # Every token is compared, in constant time, whichever matches.
            found = None
            for name, token in listener.tokens.items():
                if hmac.compare_digest(presented, token):
                    found = name
            if found is None:
                raise _Refused(grpc.StatusCode.UNAUTHENTICATED,
                               "no valid token (authorization: Bearer TOKEN)")
            return ("remote", found)
        if listener.client_ca is not None:
            names = context.auth_context().get("x509_common_name") or ()
            if not names:
                raise _Refused(grpc.StatusCode.UNAUTHENTICATED,
                               "the client certificate has no common name")
            return ("remote", names[0].decode("utf-8", "replace"))
        host = context.peer().rsplit(":", 1)[0]
        return ("remote", f"peer {host}")

    def _session(self, request, context) -> _Session:
        app = self.app_of(context)
        session = self.sessions.get(request.session)
        if session is None:
            raise _Refused(grpc.StatusCode.NOT_FOUND, f"no session {request.session}: open "
                                                      f"one with Session first")
        if session.app != app:
            raise _Refused(grpc.StatusCode.PERMISSION_DENIED,
                           f"session {request.session} is another app's")
        return session

    def _model(self, session: _Session, model_id: int):
        prepared = session.models.get(model_id)
        if prepared is None:
            raise invalid(f"model {model_id} is not one of this session's")
        return prepared

    # -- calls ----------------------------------------------------------------------

    @_guarded
    async def GetInfo(self, request, context):
        self.app_of(context)
        return self.info

    async def Session(self, request, context):
        try:
            app = self.app_of(context)
        except _Refused as e:
            await context.abort(e.code, str(e))
        refusal = self.service.over_limit_of(app, REMOTE_USER, "connections")
        if refusal is not None:
            vlog("driver", "%s: refusing a session of %s: %s", self.device.name, app[1], refusal)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"RESOURCE_EXHAUSTED_TRANSIENT: {refusal}")
        session_id = next(self._ids)
        session = self.sessions[session_id] = _Session(app)
        self.service.remote_holders.add(session)
        vlog("driver", "%s: remote session %d of %s", self.device.name, session_id, app[1])
        try:
            yield pb.SessionEvent(session=session_id)
            await asyncio.Event().wait()     # until the client goes: then cancelled
        finally:
            del self.sessions[session_id]
            self.service.remote_holders.discard(session)
            session.close()
            if self.service.app_holds_nothing(app):
                self.device.forget_app(app)
            vlog("driver", "%s: remote session %d ended", self.device.name, session_id)

    @_guarded
    async def SupportedOperations(self, request, context):
        self._session(request, context)
        model = _decode_model(request.model)
        flags = [bool(x) for x in await self.device.supported_operations(model)]
        return pb.SupportedOperationsReply(supported=flags)

    def _check_model_room(self, session: _Session) -> None:
        _check_cap(session.models, MAX_MODELS_PER_SESSION, "prepared models")
        refusal = self.service.over_limit_of(session.app, REMOTE_USER, "models")
        if refusal is not None:
            raise NnrtError(ErrorStatus.RESOURCE_EXHAUSTED_PERSISTENT, refusal)

    async def _prepare(self, session: _Session, request, cache) -> int:
        """PrepareModel's work (``cache``: the driver's files, or None): the
        new model's id."""
        self._check_model_room(session)
        model = _decode_model(request.model)
        if uses_extensions(model):
            # The allowlist judges a local app by its executable; a remote
            # app has none the service can see.
            raise invalid("models that use vendor extensions are not served to remote apps")
        preference = _enum(ExecutionPreference, request.preference, "preference")
        priority = _enum(Priority, request.priority, "priority")
        prepared = await self.device.prepare_model(
            model, preference, priority, wire.deadline_of(request), cache, app=session.app)
        return self._register(session, request.session, prepared, model)

    def _register(self, session: _Session, session_id: int, prepared, model=None) -> int:
        if session_id not in self.sessions:    # the session ended meanwhile
            prepared.release()
            raise _Refused(grpc.StatusCode.NOT_FOUND, f"session {session_id} ended")
        model_id = next(self._ids)
        session.models[model_id] = prepared
        session.graphs[model_id] = model    # None from a cache: no graph to size buffers by
        return model_id

    @_guarded
    async def PrepareModel(self, request, context):
        session = self._session(request, context)
        return pb.PrepareModelReply(model_id=await self._prepare(session, request, None))

    @_guarded
    async def ReleaseModel(self, request, context):
        session = self._session(request, context)
        prepared = self._model(session, request.model_id)
        for execution_id in [k for k, b in session.executions.items()
                             if b.model_id == request.model_id]:
            session.executions.pop(execution_id).close()
        del session.models[request.model_id]
        del session.graphs[request.model_id]
        prepared.release()
        return pb.Empty()

    @_guarded
    async def Execute(self, request, context):
        session = self._session(request, context)
        prepared = self._model(session, request.model_id)
        deadline = wire.deadline_of(request)
        try:
            inputs, outputs, pools = wire.layout(request.inputs, request.outputs)
            _check_tokens(session, pools)
            wire.fill_inputs(inputs, pools, request.input_data)
            loop_timeout = wire.loop_timeout_of(request.loop_timeout)
        except NnrtError as e:
            return wire.reply_of(ExecutionResult(e.status, message=e.message))
        result = await prepared.execute(Request(inputs, outputs, tuple(pools)),
                                        request.measure, deadline, loop_timeout)
        return wire.reply_of(result, wire.outputs_of(outputs, pools), load=self.device.load())

    @_guarded
    async def CreateExecution(self, request, context):
        session = self._session(request, context)
        _check_cap(session.executions, MAX_EXECUTIONS_PER_SESSION, "executions")
        prepared = self._model(session, request.model_id)
        inputs, outputs, pools = wire.layout(request.inputs, request.outputs)
        _check_tokens(session, pools)
        self._check_room(session, pools)
        execution = prepared.create_execution(Request(inputs, outputs, tuple(pools)),
                                              request.measure,
                                              wire.loop_timeout_of(request.loop_timeout))
        execution_id = next(self._ids)
        session.executions[execution_id] = _Bound(request.model_id, execution, inputs,
                                                  outputs, pools)
        return pb.CreateExecutionReply(execution_id=execution_id)

    def _check_room(self, session: _Session, pools=(), nbytes: int = 0) -> None:
        """RESOURCE_EXHAUSTED_TRANSIENT if keeping ``pools`` (and ``nbytes``
        more) between calls puts the session's app over its ``mapped_bytes``."""
        refusal = self.service.over_limit_of(session.app, REMOTE_USER, "mapped_bytes",
                                             wire.pool_bytes(pools) + nbytes)
        if refusal is not None:
            raise NnrtError(ErrorStatus.RESOURCE_EXHAUSTED_TRANSIENT, refusal)

    @_guarded
    async def Compute(self, request, context):
        session = self._session(request, context)
        bound = session.executions.get(request.execution_id)
        if bound is None:
            raise invalid(f"execution {request.execution_id} is not one of this session's")
        if bound.computing:
            raise invalid(f"execution {request.execution_id} is computing already")
        deadline = wire.deadline_of(request)
        try:
            wire.fill_inputs(bound.inputs, bound.pools, request.input_data)
        except NnrtError as e:
            return wire.reply_of(ExecutionResult(e.status, message=e.message))
        bound.computing = True
        try:
            result = await bound.execution.execute(deadline)
        finally:
            bound.computing = False
        return wire.reply_of(result, wire.outputs_of(bound.outputs, bound.pools),
                             load=self.device.load())

    async def Burst(self, request_iterator, context):
        """Frames in, results out, one at a time. A frame's failure is its
        result's status; the stream goes on."""
        burst = None
        try:
            async for frame in request_iterator:
                if burst is None:
                    try:
                        session = self._session(frame, context)
                        if len(session.bursts) >= MAX_BURSTS_PER_SESSION:
                            raise _Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                           f"{MAX_BURSTS_PER_SESSION} bursts in one session")
                        refusal = self.service.over_limit_of(session.app, REMOTE_USER,
                                                             "bursts")
                        if refusal is not None:
                            raise _Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                           f"RESOURCE_EXHAUSTED_TRANSIENT: {refusal}")
                        prepared = self._model(session, frame.model_id)
                    except _Refused as e:
                        await context.abort(e.code, str(e))
                    except NnrtError as e:
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                            f"{e.status.name}: {e.message}")
                    burst = _Burst(self, session, frame.session, frame.model_id, prepared)
                    session.bursts.add(burst)
                out = pb.BurstResult(serial=frame.serial)
                try:
                    if frame.model_id not in burst.session.models:
                        raise invalid(f"model {frame.model_id} was released")
                    result, data = await burst.run(frame)
                except NnrtError as e:
                    result, data = ExecutionResult(e.status, message=e.message), ()
                except Exception as e:   # a driver bug: this frame fails, not the service
                    result, data = ExecutionResult(
                        ErrorStatus.GENERAL_FAILURE,
                        message=f"{type(e).__name__} in the driver: {e}"), ()
                # In place: no copy of the outputs.
                wire.reply_of(result, data, reply=out.result, load=self.device.load())
                yield out
        finally:
            if burst is not None:
                burst.session.bursts.discard(burst)
                burst.close()

    @_guarded
    async def Status(self, request, context):
        app = self.app_of(context)
        sees_all = self.service.statistics_scope == "all" or app[1] in self.listener.admins
        value = await self.service.statistics_for(None if sees_all else app)
        return pb.StatusReply(device=self.device.name, statistics=encode_statistics(value))

    @_guarded
    async def ReleaseExecution(self, request, context):
        session = self._session(request, context)
        bound = session.executions.get(request.execution_id)
        if bound is None:
            raise invalid(f"execution {request.execution_id} is not one of this session's")
        if bound.computing:
            raise invalid(f"execution {request.execution_id} is computing")
        del session.executions[request.execution_id]
        bound.close()
        return pb.Empty()

    # -- compilation caching (the app keeps the files; see .cache) -------------------

    def _cache_files_needed(self) -> tuple[int, int]:
        needed = tuple(self.device.number_of_cache_files_needed())
        if needed == (0, 0):
            raise invalid(f"device {self.device.name} keeps no compilation cache")
        return needed

    @_guarded
    async def PrepareModelCaching(self, request, context):
        session = self._session(request.prepare, context)
        token = remote_cache.check_token(request.token)
        with remote_cache.Scratch(self._cache_files_needed(), token) as scratch:
            model_id = await self._prepare(session, request.prepare, scratch.files)
            sealed = await run_in_worker(scratch.sealed, session.app[1])
        if sealed is None:
            vlog("driver", "%s: model %d: no cache files to return", self.device.name,
                 model_id)
        return pb.PrepareModelCachingReply(model_id=model_id, cache=sealed)

    @_guarded
    async def PrepareModelFromCache(self, request, context):
        session = self._session(request, context)
        self._check_model_room(session)
        priority = _enum(Priority, request.priority, "priority")
        deadline = wire.deadline_of(request)
        needed = self._cache_files_needed()
        token = remote_cache.check_token(request.cache.token)
        try:
            with remote_cache.Scratch(needed, token) as scratch:
                # A seal that holds means this server wrote the files for
                # this app from a model PrepareModelCaching accepted, so it
                # passed the check on extensions there (the local service,
                # which cannot tell who wrote an app's files, asks its
                # allowlist here).
                await run_in_worker(lambda: scratch.fill(
                    remote_cache.unsealed(session.app[1], request.cache, needed)))
                prepared = await self.device.prepare_model_from_cache(
                    scratch.files, priority, deadline, app=session.app)
        except CacheRejected as e:
            vlog("driver", "%s: refusing the cache files of %s: %s", self.device.name,
                 session.app[1], e.message)
            return pb.PrepareModelFromCacheReply(reject=e.reason.value,
                                                 message=e.message.removeprefix(
                                                     f"cache {e.reason.value}: "))
        return pb.PrepareModelFromCacheReply(
            model_id=self._register(session, request.session, prepared))

    # -- memory domains: driver buffers kept here, named by token -------------------

    @_guarded
    async def Allocate(self, request, context):
        session = self._session(request, context)
        _check_cap(session.buffers, MAX_BUFFERS_PER_SESSION, "buffers")
        if len(request.dimensions) > wire.MAX_DIMENSIONS:
            raise invalid(f"allocate: {len(request.dimensions)} dimensions")
        prepared = [self._model(session, model_id) for model_id in request.model_ids]
        roles = [[BufferRole(r.model_index, r.io_index, r.frequency) for r in rs]
                 for rs in (request.input_roles, request.output_roles)]
        desc = BufferDesc(tuple(request.dimensions))
        # The driver checks the roles (models, indexes, types) first.
        buffer, token = await self.device.allocate(desc, prepared, *roles, app=session.app)
        try:
            nbytes = known_buffer_size(desc.dimensions, *roles,
                                       [session.graphs.get(m) for m in request.model_ids]) or 0
            if nbytes > MAX_BUFFER_BYTES:
                raise NnrtError(ErrorStatus.RESOURCE_EXHAUSTED_PERSISTENT,
                                f"allocate: {nbytes} bytes, more than a buffer may hold "
                                f"({MAX_BUFFER_BYTES})")
            self._check_room(session, nbytes=nbytes)
            if request.session not in self.sessions:    # the session ended meanwhile
                raise _Refused(grpc.StatusCode.NOT_FOUND, f"session {request.session} ended")
        except BaseException:
            buffer.release()
            raise
        session.buffers[token] = _Kept(buffer, nbytes)
        return pb.AllocateReply(token=token)

    @_guarded
    async def CopyTo(self, request, context):
        kept = _kept(self._session(request, context), request.token)
        if request.length > wire.MAX_MESSAGE:
            raise invalid(f"copy_to: {request.length} bytes, more than a message carries "
                          f"({wire.MAX_MESSAGE})")
        data = bytearray(request.length)
        await kept.buffer.copy_to(data)
        return pb.BufferData(data=bytes(data))

    @_guarded
    async def CopyFrom(self, request, context):
        session = self._session(request, context)
        kept = _kept(session, request.token)
        if len(request.dimensions) > wire.MAX_DIMENSIONS:
            raise invalid(f"copy_from: {len(request.dimensions)} dimensions")
        grown = len(request.data) - kept.nbytes
        if grown > 0:
            self._check_room(session, nbytes=grown)
        await kept.buffer.copy_from(memoryview(request.data), tuple(request.dimensions))
        kept.nbytes = max(kept.nbytes, len(request.data))
        return pb.Empty()

    @_guarded
    async def ReleaseBuffer(self, request, context):
        session = self._session(request, context)
        _kept(session, request.token)
        session.buffers.pop(request.token).buffer.release()
        return pb.Empty()


class _Burst:
    """One burst stream: its layouts, each bound once to an execution on
    pools of the server's own, which keep the inputs of that layout's last
    frame (a frame sends only the inputs that changed)."""

    def __init__(self, servicer: RemoteServicer, session: _Session, session_id: int,
                 model_id: int, prepared):
        self.servicer = servicer
        self.session = session
        self.session_id = session_id
        self.model_id = model_id
        self.prepared = prepared
        self.layouts: dict[int, _Bound] = {}

    def bind(self, frame) -> _Bound:
        bound = self.layouts.get(frame.layout_id)
        if frame.HasField("layout"):
            if bound is not None:
                raise invalid(f"layout {frame.layout_id} was sent before")
            if len(self.layouts) >= MAX_LAYOUTS_PER_BURST:
                raise NnrtError(ErrorStatus.RESOURCE_EXHAUSTED_PERSISTENT,
                                f"more than {MAX_LAYOUTS_PER_BURST} layouts in one burst")
            layout = frame.layout
            inputs, outputs, pools = wire.layout(layout.inputs, layout.outputs)
            _check_tokens(self.session, pools)
            self.servicer._check_room(self.session, pools)
            execution = self.prepared.create_execution(
                Request(inputs, outputs, tuple(pools)), layout.measure,
                wire.loop_timeout_of(layout.loop_timeout))
            bound = self.layouts[frame.layout_id] = _Bound(self.model_id, execution, inputs,
                                                           outputs, pools)
        elif bound is None:
            raise invalid(f"layout {frame.layout_id} was never sent")
        return bound

    async def run(self, frame) -> tuple[ExecutionResult, list[bytes]]:
        """The frame's result and its output bytes."""
        if frame.session != self.session_id or frame.model_id != self.model_id:
            raise invalid("a burst's frames all name its session and model")
        bound = self.bind(frame)
        deadline = wire.deadline_of(frame)
        for change in frame.changed:
            if change.index >= len(bound.inputs) or bound.inputs[change.index].has_no_value \
                    or wire.token_of(bound.pools, bound.inputs[change.index]):
                raise invalid(f"changed input {change.index} is no input with bytes of its own")
            pool = bound.pools[bound.inputs[change.index].location.pool_index]
            if len(change.data) != len(pool):
                raise invalid(f"input {change.index}: {len(change.data)} bytes for a region "
                              f"of {len(pool)}")
            pool[:] = change.data
        result = await bound.execution.execute(deadline)
        return result, wire.outputs_of(bound.outputs, bound.pools)

    def close(self) -> None:
        for bound in self.layouts.values():
            bound.close()
        self.layouts.clear()


def _check_cap(held, cap: int, what: str) -> None:
    """RESOURCE_EXHAUSTED_PERSISTENT when a session holds ``cap`` of ``what`` already."""
    if len(held) >= cap:
        raise NnrtError(ErrorStatus.RESOURCE_EXHAUSTED_PERSISTENT,
                        f"more than {cap} {what} in one session; release some")


def _check_tokens(session: _Session, pools) -> None:
    """INVALID_ARGUMENT unless every driver buffer a layout names is one of
    ``session``'s (the driver then checks the app and the role)."""
    for pool in pools:
        if isinstance(pool, DeviceToken):
            _kept(session, pool.token)


def _kept(session: _Session, token: int) -> _Kept:
    """Driver buffer ``token`` of ``session``; INVALID_ARGUMENT when it names
    none of this session's (another's, or one released)."""
    kept = session.buffers.get(token)
    if kept is None:
        raise invalid(f"token {token} names no buffer of this session")
    return kept


def _decode_model(data: bytes):
    try:
        return decode_model(data)
    except ProtocolError as e:
        raise invalid(f"the model does not decode: {e.message}") from None


def _enum(cls, value: int, what: str):
    try:
        return cls(value)
    except ValueError:
        raise invalid(f"{what} {value} is not a {cls.__name__}") from None


async def serve_remote(service: DriverService, listener: Listener, *,
                       task_status=None) -> None:
    """Serve ``service``'s (scheduled) device on ``listener`` until
    cancelled, its remote apps under the service's limits with the local
    ones. ``task_status.started`` gets the port bound (useful with port 0)."""
    device = service.device
    server = grpc.aio.server(options=SERVER_OPTIONS)
    servicer = RemoteServicer(service, listener)
    pb_grpc.add_RemoteServicer_to_server(servicer, server)
    health = health_async.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    names = (pb.DESCRIPTOR.services_by_name["Remote"].full_name,
             health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    credentials = listener.credentials()
    try:
        port = server.add_secure_port(listener.address, credentials) if credentials \
            else server.add_insecure_port(listener.address)
    except RuntimeError as e:
        raise NnrtError(ErrorStatus.DEVICE_UNAVAILABLE,
                        f"cannot listen on {listener.address}: {e}") from None
    await server.start()
    for name in ("", names[0]):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    vlog("driver", "%s: listening on %s (%s)", device.name, listener.address,
         "TLS" if credentials else "plaintext")
    try:
        if task_status is not None:
            task_status.started(port)
        await server.wait_for_termination()
    finally:
        # Shielded: the service is being cancelled, and the server's calls
        # (sessions) must end so their models are released.
        with anyio.CancelScope(shield=True):
            await health.enter_graceful_shutdown()
            await server.stop(0.5)
