"""The driver-service control protocol, without I/O.

Theory of operation
-------------------
A connection carries *frames* both ways over a Unix stream socket::

    frame  = u32 body_length | u8 fd_count | body
    body   = u8 kind (CALL=1, REPLY=2) | u8 method | u64 call_id | payload

Little-endian throughout. ``body_length`` is at most :data:`MAX_FRAME` and
``fd_count`` at most :data:`MAX_FDS`; a frame breaking either cannot be
skipped safely (the byte stream has lost its framing), so the connection is
closed. The fds of a frame travel beside its bytes as SCM_RIGHTS ancillary
data; the kernel delivers them no later than the frame's first byte, so the
receiver queues fds as they arrive and each frame takes ``fd_count`` of them
from the front of the queue.

A frame whose framing is sound but whose body does not decode (unknown kind
or method, truncated payload, an enum value out of range, trailing bytes)
becomes a :class:`Malformed` event: the service answers INVALID_ARGUMENT for
that call id and keeps the connection. Decoding any bytes either returns a
message or raises :class:`ProtocolError` (an ``NnrtError`` with
INVALID_ARGUMENT) — never anything else; every count and length is bounded
by what is left of the frame and by fixed caps.

The client calls, the service replies; a reply names the call id it answers,
and many calls may be in flight at once (replies come in completion order).
The first call is HELLO; the call stream's states and their transitions are
the table :data:`TRANSITIONS`. The one exception to "the client calls" is
:data:`SERVICE_CALLS` (a burst server asking for memories, or telling that a
burst ended): the service numbers those calls itself and the client replies.

Memory pools (the HAL model's constant pools and a request's pools) are
:class:`WirePool` entries. The client numbers each shared memory it sends by
``pool_id`` (0 = not cached) and sends its fd the first time; later
executions of the same prepared model name the id only, and ``release``
lists ids the client has forgotten. Both sides thereby agree on the cache
without the service ever asking.
"""
from __future__ import annotations

import enum
import math
import struct
from dataclasses import dataclass, field
from typing import Any

from ...errors import ErrorStatus, NnrtError
from ...model.graph import (ChannelQuant, DataLocation, ExtensionPrefix, HalModel, Operand,
                            Operation, Subgraph)
from ...model.types import OperandLifeTime, OperandType, OperationType
from ...hal.types import Priority
from ...qos.scheduler import ClassStatistics, JobRecord, SchedulerStatistics
from ...hal import (Capabilities, DeviceType, ExecutionPreference, ExecutionResult, OutputShape,
                   PerformanceInfo, RequestArgument, Timing)

PROTOCOL_VERSION = 1
MAX_FRAME = 64 << 20     # bytes of one frame body
MAX_FDS = 64             # fds beside one frame (SCM_RIGHTS allows 253)
MAX_COUNT = 1 << 20      # elements of any list
MAX_STRING = 1 << 16     # bytes of any string
MAX_CACHED_POOLS = 256   # request pools a service caches per prepared model

_FRAME = struct.Struct("<IB")
_BODY = struct.Struct("<BBQ")
FRAME_HEADER_SIZE = _FRAME.size


class ProtocolError(NnrtError):
    """A message that does not decode, or a call the state machine refuses."""

    def __init__(self, message: str):
        super().__init__(ErrorStatus.INVALID_ARGUMENT, message)


class Kind(enum.IntEnum):
    CALL = 1
    REPLY = 2


class Method(enum.IntEnum):
    ERROR = 0      # reply only: the answer to a call that did not decode
    HELLO = 1
    CAPABILITIES = 2
    SUPPORTED_EXTENSIONS = 3
    NUMBER_OF_CACHE_FILES = 4
    SUPPORTED_OPERATIONS = 5
    PREPARE_MODEL = 6
    EXECUTE = 7
    RELEASE_MODEL = 8
    EXECUTE_FENCED = 9        # fences in, result fence in; reply once settled: FencedInfo
    # 10 is not used
    CONFIGURE_BURST = 11      # the six fds of two fmq rings; reply: the burst id
    RELEASE_BURST = 12
    FREE_BURST_SLOTS = 13     # the app released these memories: unmap them
    GET_MEMORIES = 14         # service -> client: the fds of unknown burst slots
    BURST_ENDED = 15          # service -> client: a burst ended on the service's side
    STATISTICS = 16           # the scheduler's counters and its recent finished jobs
    CANCEL = 17               # stop the EXECUTE started by another call; empty reply


# Calls the service makes to the client (the burst server asking the
# controller for memories, HAL ``IBurstCallback.getMemories``): their call
# ids are the service's own, and the client answers them with a REPLY.
SERVICE_CALLS = frozenset({Method.GET_MEMORIES, Method.BURST_ENDED})


# Methods whose reply carries a value whatever its status: an execution
# reports shapes and timing even when it failed.
_ALWAYS_VALUED = (Method.EXECUTE, Method.EXECUTE_FENCED)


# -- messages -----------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class WirePool:
    """A shared-memory region as it crosses the socket. ``fd`` is set when
    the fd travels with this message, None when the peer already holds
    ``pool_id``. The pool the driver sees is ``[offset, offset+length)`` of
    the ``map_size`` bytes mapped at ``fd_offset`` of the fd."""

    pool_id: int
    fd: int | None
    writable: bool
    fd_offset: int
    map_size: int
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    name: str
    type: DeviceType
    version_string: str
    feature_level: int
    protocol_version: int = PROTOCOL_VERSION


@dataclass(frozen=True, slots=True)
class Hello:
    call_id: int
    protocol_version: int = PROTOCOL_VERSION
    method = Method.HELLO


@dataclass(frozen=True, slots=True)
class Query:
    """A device query without arguments (CAPABILITIES, SUPPORTED_EXTENSIONS,
    NUMBER_OF_CACHE_FILES)."""

    call_id: int
    method: Method


@dataclass(frozen=True, slots=True)
class SupportedOperations:
    call_id: int
    model: HalModel   # pools are WirePool entries
    method = Method.SUPPORTED_OPERATIONS


@dataclass(frozen=True, slots=True)
class PrepareModel:
    call_id: int
    model: HalModel   # pools are WirePool entries
    preference: ExecutionPreference
    priority: Priority
    deadline: float | None
    method = Method.PREPARE_MODEL


@dataclass(frozen=True, slots=True)
class Execute:
    call_id: int
    model_id: int
    inputs: tuple[RequestArgument, ...]
    outputs: tuple[RequestArgument, ...]
    pools: tuple[WirePool, ...]
    release: tuple[int, ...] = ()   # pool ids the service may forget (before this call)
    measure: bool = False
    deadline: float | None = None
    loop_timeout: float | None = None
    method = Method.EXECUTE


@dataclass(frozen=True, slots=True)
class ExecuteFenced:
    """HAL ``executeFenced``: an :class:`Execute` that starts once every
    fence of ``wait_for`` (eventfds, travelling as SCM_RIGHTS) is signaled;
    the service then signals ``fence``, an eventfd the *client* created and
    sent with the call, and replies with a :class:`FencedInfo`.

    Why the client makes the result fence (the HAL's driver returns one):
    the caller can chain the next stage on it at once, without waiting for
    a reply, so a pipeline of fenced calls costs no round trip per stage.
    The client does not wait for the reply before returning; it is the
    callback's info. The pools are used until the fence is signaled, so each
    must be a shared memory (fd or cached id), never staged by the client."""

    call_id: int
    model_id: int
    inputs: tuple[RequestArgument, ...]
    outputs: tuple[RequestArgument, ...]
    pools: tuple[WirePool, ...]
    release: tuple[int, ...] = ()
    measure: bool = False
    deadline: float | None = None
    loop_timeout: float | None = None
    wait_for: tuple[int, ...] = ()          # fence fds, received with the call
    timeout_after_fence: float | None = None
    fence: int | None = None                # the result fence's fd (required on the wire)
    method = Method.EXECUTE_FENCED


@dataclass(frozen=True, slots=True)
class FencedInfo:
    """The value of an EXECUTE_FENCED reply, sent once the execution has
    settled and its fence is signaled (HAL ``IFencedExecutionCallback``)."""

    result: ExecutionResult        # status, output shapes, the run's own timing, message
    timing_launched: Timing
    timing_fenced: Timing


@dataclass(frozen=True, slots=True)
class ConfigureBurst:
    """Open a burst on a prepared model. ``ring_fds`` are the request
    ring's (memfd, data eventfd, space eventfd) and then the result ring's,
    created by the client and received with the call (see nnrt.burst)."""

    call_id: int
    model_id: int
    ring_fds: tuple[int, ...]     # 6 fds
    method = Method.CONFIGURE_BURST


@dataclass(frozen=True, slots=True)
class ReleaseBurst:
    call_id: int
    burst_id: int
    method = Method.RELEASE_BURST


@dataclass(frozen=True, slots=True)
class FreeBurstSlots:
    """The client forgot these slots of a burst; the service unmaps them."""

    call_id: int
    burst_id: int
    slots: tuple[int, ...]
    method = Method.FREE_BURST_SLOTS


@dataclass(frozen=True, slots=True)
class GetMemories:
    """Service -> client: the memories behind ``slots`` of a burst. The
    reply's value is one :class:`WirePool` per slot (``pool_id`` = the
    slot, its fd travelling with the reply)."""

    call_id: int
    burst_id: int
    slots: tuple[int, ...]
    method = Method.GET_MEMORIES


BURST_RING_FDS = 6
MAX_BURST_SLOTS = 1024   # slots named in one FREE_BURST_SLOTS or GET_MEMORIES


@dataclass(frozen=True, slots=True)
class BurstEnded:
    """Service -> client: the burst ended without RELEASE_BURST (its ring
    went out of sync, or its prepared model was released); ``reason`` says
    which. The client fails the burst's pending and later executions."""

    call_id: int
    burst_id: int
    reason: str
    method = Method.BURST_ENDED


@dataclass(frozen=True, slots=True)
class Cancel:
    """The caller stopped waiting for the EXECUTE it sent as call ``target``:
    the service withdraws it, or stops it at its next operation boundary.
    CANCEL is acknowledged at once with an empty reply; the EXECUTE's own
    reply (cancelled, or its result if it had already finished) follows once
    the driver has let go of the request's pools, which is what tells the
    client it may reuse them. An unknown or finished ``target`` is ignored."""

    call_id: int
    target: int
    method = Method.CANCEL


@dataclass(frozen=True, slots=True)
class ReleaseModel:
    call_id: int
    model_id: int
    method = Method.RELEASE_MODEL


@dataclass(frozen=True, slots=True)
class Reply:
    """The answer to call ``call_id``. ``value`` is present when ``status`` is
    NONE — and always for EXECUTE (an ExecutionResult) and EXECUTE_FENCED
    (a FencedInfo)."""

    call_id: int
    method: Method
    status: ErrorStatus = ErrorStatus.NONE
    message: str = ""
    value: Any = None


@dataclass(frozen=True, slots=True)
class Malformed:
    """A well-framed body that did not decode; answer INVALID_ARGUMENT."""

    call_id: int
    method: int
    error: ProtocolError
    fds: tuple[int, ...] = field(default=())  # received with it; the caller closes them


Call = (Hello | Query | SupportedOperations | PrepareModel | Execute | ReleaseModel
        | ExecuteFenced | Cancel)

_QUERIES = (Method.CAPABILITIES, Method.SUPPORTED_EXTENSIONS, Method.NUMBER_OF_CACHE_FILES,
            Method.STATISTICS)


@dataclass(frozen=True, slots=True)
class StatisticsValue:
    """The reply to STATISTICS: None when the driver has no scheduler."""

    statistics: SchedulerStatistics | None
    jobs: tuple[JobRecord, ...] = ()


MAX_JOB_RECORDS = 4096


# -- the call stream's state machine -----------------------------------------

class State(enum.Enum):
    IDLE = "IDLE"        # connected, no HELLO yet
    READY = "READY"      # HELLO done: any call may follow
    CLOSED = "CLOSED"    # EOF or a fatal protocol error


class Event(enum.Enum):
    HELLO = "HELLO"
    CALL = "CALL"
    CLOSE = "CLOSE"


TRANSITIONS: dict[tuple[State, Event], State] = {
    (State.IDLE, Event.HELLO): State.READY,
    (State.IDLE, Event.CLOSE): State.CLOSED,
    (State.READY, Event.CALL): State.READY,
    (State.READY, Event.CLOSE): State.CLOSED,
    (State.CLOSED, Event.CLOSE): State.CLOSED,
}


def transition(state: State, event: Event) -> State:
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise ProtocolError(f"{event.value} is not allowed in state {state.value}") from None


class Connection:
    """One side of a connection: feed it bytes and fds, pull events; ask it
    to encode what you send. ``role`` is "client" or "server"."""

    def __init__(self, role: str):
        if role not in ("client", "server"):
            raise ValueError(role)
        self.role = role
        self.state = State.IDLE
        self._buffer = bytearray()
        self._fds: list[int] = []

    # receiving

    def receive_data(self, data: bytes, fds=()) -> None:
        """Bytes (and the fds that came with them) from the peer; b"" = EOF."""
        if not data and not fds:
            self.state = transition(self.state, Event.CLOSE)
            return
        self._buffer += data
        self._fds.extend(fds)

    def next_event(self):
        """The next complete message (a Call on the server, a Reply on the
        client), a :class:`Malformed` frame, or None when more bytes are
        needed. Raises :class:`ProtocolError` when the framing is broken;
        the connection is then CLOSED (its queued fds are returned by
        :meth:`take_fds`)."""
        if self.state is State.CLOSED and not self._buffer:
            return None
        if len(self._buffer) < _FRAME.size:
            return None
        length, nfds = _FRAME.unpack_from(self._buffer)
        if length > MAX_FRAME or nfds > MAX_FDS:
            self.state = State.CLOSED
            raise ProtocolError(f"frame of {length} bytes with {nfds} fds exceeds the limits "
                                f"({MAX_FRAME} bytes, {MAX_FDS} fds)")
        if len(self._buffer) < _FRAME.size + length:
            return None
        if nfds > len(self._fds):
            self.state = State.CLOSED
            raise ProtocolError(f"frame announces {nfds} fds, {len(self._fds)} arrived")
        body = bytes(self._buffer[_FRAME.size:_FRAME.size + length])
        del self._buffer[:_FRAME.size + length]
        fds, self._fds = self._fds[:nfds], self._fds[nfds:]
        try:
            message = decode_body(body, fds)
        except ProtocolError as e:
            call_id, method = _peek_ids(body)
            return Malformed(call_id, method, e, tuple(fds))
        if self.role == "server":
            if isinstance(message, Reply) and message.method in SERVICE_CALLS:
                return message    # the client answering a call of ours
            if isinstance(message, Reply):
                return Malformed(message.call_id, message.method,
                                 ProtocolError("a service does not take replies"), tuple(fds))
            event = Event.HELLO if isinstance(message, Hello) else Event.CALL
            try:
                self.state = transition(self.state, event)
            except ProtocolError as e:
                return Malformed(message.call_id, message.method, e, tuple(fds))
        elif not isinstance(message, Reply) and message.method not in SERVICE_CALLS:
            return Malformed(message.call_id, message.method,
                             ProtocolError("a client does not take calls"), tuple(fds))
        return message

    def take_fds(self) -> list[int]:
        """Fds received but not handed out with a message (close them)."""
        fds, self._fds = self._fds, []
        return fds

    # sending

    def send(self, message) -> tuple[bytes, list[int]]:
        """The frame for ``message`` and the fds to send beside it."""
        if self.role == "client":
            if isinstance(message, Reply):
                if message.method not in SERVICE_CALLS:
                    raise ProtocolError("a client sends replies only to the service's calls")
            else:
                event = Event.HELLO if isinstance(message, Hello) else Event.CALL
                self.state = transition(self.state, event)
        elif not isinstance(message, Reply) and message.method not in SERVICE_CALLS:
            raise ProtocolError("a service sends only replies and service calls")
        return encode(message)

    def close(self) -> None:
        self.state = transition(self.state, Event.CLOSE)


# -- encoding -----------------------------------------------------------------

class _Writer:
    __slots__ = ("parts", "fds")

    def __init__(self):
        self.parts: list[bytes] = []
        self.fds: list[int] = []

    def pack(self, fmt: str, *values) -> None:
        self.parts.append(struct.pack(fmt, *values))

    def u8(self, v: int) -> None: self.pack("<B", v)
    def u32(self, v: int) -> None: self.pack("<I", v)
    def i32(self, v: int) -> None: self.pack("<i", v)
    def u64(self, v: int) -> None: self.pack("<Q", v)
    def f64(self, v: float) -> None: self.pack("<d", v)

    def bytes_(self, v) -> None:
        v = bytes(v)
        self.u32(len(v))
        self.parts.append(v)

    def str_(self, v: str) -> None:
        self.bytes_(v.encode("utf-8"))

    def u32s(self, values) -> None:
        values = list(values)
        self.u32(len(values))
        self.parts.append(struct.pack(f"<{len(values)}I", *values))

    def opt_f64(self, v: float | None) -> None:
        self.u8(v is not None)
        if v is not None:
            self.f64(v)


def encode(message) -> tuple[bytes, list[int]]:
    """Frame bytes and the fds that travel beside them."""
    w = _Writer()
    if isinstance(message, Reply):
        w.parts.append(_BODY.pack(Kind.REPLY, message.method, message.call_id))
        _encode_reply(w, message)
    else:
        w.parts.append(_BODY.pack(Kind.CALL, message.method, message.call_id))
        _encode_call(w, message)
    body = b"".join(w.parts)
    if len(body) > MAX_FRAME or len(w.fds) > MAX_FDS:
        raise ProtocolError(f"message of {len(body)} bytes and {len(w.fds)} fds exceeds the "
                            f"frame limits ({MAX_FRAME} bytes, {MAX_FDS} fds)")
    return _FRAME.pack(len(body), len(w.fds)) + body, w.fds


def _encode_call(w: _Writer, m) -> None:
    if isinstance(m, Hello):
        w.u32(m.protocol_version)
    elif isinstance(m, Query):
        pass
    elif isinstance(m, SupportedOperations):
        _encode_model(w, m.model)
    elif isinstance(m, PrepareModel):
        _encode_model(w, m.model)
        w.u32(m.preference)
        w.u32(m.priority)
        w.opt_f64(m.deadline)
    elif isinstance(m, (Execute, ExecuteFenced)):
        w.u64(m.model_id)
        for args in (m.inputs, m.outputs):
            w.u32(len(args))
            for a in args:
                _encode_argument(w, a)
        _encode_pools(w, m.pools)
        w.u32(len(m.release))
        for pool_id in m.release:
            w.u64(pool_id)
        w.u8(bool(m.measure))
        w.opt_f64(m.deadline)
        w.opt_f64(m.loop_timeout)
        if isinstance(m, ExecuteFenced):
            w.u32(len(m.wait_for))
            w.fds.extend(m.wait_for)
            w.opt_f64(m.timeout_after_fence)
            if m.fence is None:
                raise TypeError("EXECUTE_FENCED needs the result fence's fd")
            w.fds.append(m.fence)
    elif isinstance(m, ReleaseModel):
        w.u64(m.model_id)
    elif isinstance(m, ConfigureBurst):
        if len(m.ring_fds) != BURST_RING_FDS:
            raise ProtocolError(f"CONFIGURE_BURST takes {BURST_RING_FDS} ring fds, "
                                f"not {len(m.ring_fds)}")
        w.u64(m.model_id)
        w.fds.extend(m.ring_fds)
    elif isinstance(m, ReleaseBurst):
        w.u64(m.burst_id)
    elif isinstance(m, Cancel):
        w.u64(m.target)
    elif isinstance(m, BurstEnded):
        w.u64(m.burst_id)
        w.str_(m.reason)
    elif isinstance(m, (FreeBurstSlots, GetMemories)):
        w.u64(m.burst_id)
        w.u32s(m.slots)
    else:
        raise TypeError(f"not a protocol message: {m!r}")


def _encode_reply(w: _Writer, m: Reply) -> None:
    w.u32(m.status)
    w.str_(m.message)
    has_value = m.status == ErrorStatus.NONE or m.method in _ALWAYS_VALUED
    w.u8(has_value)
    if not has_value:
        return
    v = m.value
    if m.method == Method.HELLO:
        w.str_(v.name)
        w.u32(v.type)
        w.str_(v.version_string)
        w.u32(v.feature_level)
        w.u32(v.protocol_version)
    elif m.method == Method.CAPABILITIES:
        _encode_capabilities(w, v)
    elif m.method == Method.SUPPORTED_EXTENSIONS:
        w.u32(len(v))
        for name in v:
            w.str_(name)
    elif m.method == Method.NUMBER_OF_CACHE_FILES:
        w.u32(v[0])
        w.u32(v[1])
    elif m.method == Method.STATISTICS:
        _encode_statistics(w, v)
    elif m.method == Method.SUPPORTED_OPERATIONS:
        w.bytes_(bytes(bool(x) for x in v))
    elif m.method == Method.PREPARE_MODEL:
        w.u64(v)
    elif m.method == Method.EXECUTE:
        w.u32(len(v.output_shapes))
        for s in v.output_shapes:
            w.u32s(s.dimensions)
            w.u8(s.is_sufficient)
        w.u64(v.timing.on_device)
        w.u64(v.timing.in_driver)
    elif m.method == Method.EXECUTE_FENCED:
        r = v.result
        w.u32(len(r.output_shapes))
        for s in r.output_shapes:
            w.u32s(s.dimensions)
            w.u8(s.is_sufficient)
        for t in (r.timing, v.timing_launched, v.timing_fenced):
            w.u64(t.on_device)
            w.u64(t.in_driver)
    elif m.method == Method.RELEASE_MODEL:
        pass
    elif m.method == Method.CONFIGURE_BURST:
        w.u64(v)
    elif m.method == Method.GET_MEMORIES:
        _encode_pools(w, v)


def _encode_app(w: _Writer, app) -> None:
    # Service app keys are ("uid", n) or ("pid", n); anything else travels as text.
    if isinstance(app, tuple) and len(app) == 2 and isinstance(app[0], str) \
            and isinstance(app[1], int) and app[1] >= 0:
        w.u8(1)
        w.str_(app[0])
        w.u64(app[1])
    else:
        w.u8(0)
        w.str_(str(app))


def _opt_f64(w: _Writer, v: float | None) -> None:
    w.f64(math.nan if v is None else v)


def _encode_statistics(w: _Writer, v: StatisticsValue) -> None:
    st = v.statistics
    w.u8(st is not None)
    if st is not None:
        w.u32(st.slots)
        w.u32(st.busy)
        w.u32(len(st.classes))
        for c in st.classes:
            _encode_app(w, c.app)
            w.u32(c.priority)
            for n in (c.queued, c.running, c.completed, c.preempted, c.deadline_misses,
                      c.cancelled, c.failed):
                w.u32(n)
            _opt_f64(w, c.wait_p50)
            _opt_f64(w, c.wait_p99)
            w.f64(c.run_time)
    jobs = v.jobs[-MAX_JOB_RECORDS:]
    w.u32(len(jobs))
    for j in jobs:
        _encode_app(w, j.app)
        w.u32(j.priority)
        w.u64(j.seq)
        w.f64(j.submitted_at)
        _opt_f64(w, j.started_at)
        w.f64(j.finished_at)
        w.f64(j.ran)
        w.u32(j.preemptions)
        w.f64(j.longest_step)
        w.u32(j.status)
        w.str_(j.message)


def _encode_perf(w: _Writer, p: PerformanceInfo) -> None:
    w.f64(p.exec_time)
    w.f64(p.power_usage)


def _encode_capabilities(w: _Writer, c: Capabilities) -> None:
    _encode_perf(w, c.relaxed_float32_to_float16_scalar)
    _encode_perf(w, c.relaxed_float32_to_float16_tensor)
    w.u32(len(c.operand_performance))
    for t, p in c.operand_performance.items():
        w.u32(t)
        _encode_perf(w, p)
    _encode_perf(w, c.if_performance)
    _encode_perf(w, c.while_performance)


def _encode_location(w: _Writer, loc: DataLocation | None) -> None:
    w.u8(loc is not None)
    if loc is not None:
        w.i32(loc.pool_index)
        w.u32(loc.offset)
        w.u32(loc.length)


def _encode_argument(w: _Writer, a: RequestArgument) -> None:
    w.u8(a.has_no_value)
    _encode_location(w, a.location)
    w.u32s(a.dimensions)


def _encode_pools(w: _Writer, pools) -> None:
    w.u32(len(pools))
    for p in pools:
        if not isinstance(p, WirePool):
            raise TypeError(f"pools must be WirePool entries on the wire, got {type(p).__name__}")
        w.u64(p.pool_id)
        w.u8(p.fd is not None)
        w.u8(p.writable)
        w.u64(p.fd_offset)
        w.u64(p.map_size)
        w.u64(p.offset)
        w.u64(p.length)
        if p.fd is not None:
            w.fds.append(p.fd)


def _encode_subgraph(w: _Writer, s: Subgraph) -> None:
    w.u32(len(s.operands))
    for o in s.operands:
        w.u32(o.type)
        w.u32s(o.dimensions)
        w.f64(o.scale)
        w.i32(o.zero_point)
        w.u8(o.lifetime)
        _encode_location(w, o.location)
        w.u8(o.channel_quant is not None)
        if o.channel_quant is not None:
            w.u32(o.channel_quant.channel_dim)
            w.u32(len(o.channel_quant.scales))
            for s_ in o.channel_quant.scales:
                w.f64(s_)
        w.u8(o.extra_params is not None)
        if o.extra_params is not None:
            w.bytes_(o.extra_params)
    w.u32(len(s.operations))
    for op in s.operations:
        w.u32(op.type)
        w.u32s(op.inputs)
        w.u32s(op.outputs)
    w.u32s(s.input_indexes)
    w.u32s(s.output_indexes)


def _encode_model(w: _Writer, m: HalModel) -> None:
    _encode_subgraph(w, m.main)
    w.u32(len(m.referenced))
    for s in m.referenced:
        _encode_subgraph(w, s)
    w.bytes_(m.operand_values)
    _encode_pools(w, m.pools)
    w.u8(m.relax_computation_float32_to_float16)
    w.u32(len(m.extension_prefixes))
    for e in m.extension_prefixes:
        w.str_(e.name)
        w.u32(e.prefix)


# -- decoding -----------------------------------------------------------------

class _Reader:
    """Bounds-checked reads from one frame body; every failure is a ProtocolError."""

    __slots__ = ("data", "pos", "fds", "fd_pos")

    def __init__(self, data: bytes, fds):
        self.data = data
        self.pos = 0
        self.fds = list(fds)
        self.fd_pos = 0

    def unpack(self, s: struct.Struct, what: str):
        if self.pos + s.size > len(self.data):
            raise ProtocolError(f"message truncated in {what} (at byte {self.pos} of "
                                f"{len(self.data)})")
        values = s.unpack_from(self.data, self.pos)
        self.pos += s.size
        return values

    def u8(self, what: str) -> int: return self.unpack(_U8, what)[0]
    def u32(self, what: str) -> int: return self.unpack(_U32, what)[0]
    def i32(self, what: str) -> int: return self.unpack(_I32, what)[0]
    def u64(self, what: str) -> int: return self.unpack(_U64, what)[0]
    def f64(self, what: str) -> float: return self.unpack(_F64, what)[0]

    def flag(self, what: str) -> bool:
        v = self.u8(what)
        if v > 1:
            raise ProtocolError(f"{what}: flag byte {v} is neither 0 nor 1")
        return bool(v)

    def count(self, what: str, element_size: int = 1) -> int:
        n = self.u32(what)
        if n > MAX_COUNT or n * element_size > len(self.data) - self.pos:
            raise ProtocolError(f"{what}: count {n} exceeds what the message holds")
        return n

    def bytes_(self, what: str, limit: int = MAX_FRAME) -> bytes:
        n = self.u32(what)
        if n > limit or n > len(self.data) - self.pos:
            raise ProtocolError(f"{what}: length {n} exceeds what the message holds")
        v = self.data[self.pos:self.pos + n]
        self.pos += n
        return v

    def str_(self, what: str) -> str:
        raw = self.bytes_(what, MAX_STRING)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ProtocolError(f"{what}: not UTF-8") from None

    def u32s(self, what: str) -> tuple[int, ...]:
        n = self.count(what, 4)
        v = struct.unpack_from(f"<{n}I", self.data, self.pos)
        self.pos += 4 * n
        return v

    def opt_f64(self, what: str) -> float | None:
        return self.f64(what) if self.flag(what) else None

    def enum(self, cls, what: str):
        v = self.u32(what)
        try:
            return cls(v)
        except ValueError:
            raise ProtocolError(f"{what}: {v} is not a {cls.__name__}") from None

    def fd(self, what: str) -> int:
        if self.fd_pos >= len(self.fds):
            raise ProtocolError(f"{what}: the message names more fds than came with it")
        self.fd_pos += 1
        return self.fds[self.fd_pos - 1]


_U8, _U32, _I32, _U64, _F64 = (struct.Struct(f) for f in ("<B", "<I", "<i", "<Q", "<d"))


def _peek_ids(body: bytes) -> tuple[int, int]:
    """(call id, method) of a body that did not decode, 0 where unreadable."""
    if len(body) >= _BODY.size:
        _kind, method, call_id = _BODY.unpack_from(body)
        return call_id, method
    return 0, 0


def decode_body(body: bytes, fds=()):
    """A message from one frame body and its fds, or ProtocolError."""
    r = _Reader(body, fds)
    kind, method, call_id = r.unpack(_BODY, "message header")
    if kind not in (Kind.CALL, Kind.REPLY):
        raise ProtocolError(f"message kind {kind} is neither CALL nor REPLY")
    try:
        method = Method(method)
    except ValueError:
        raise ProtocolError(f"unknown method {method}") from None
    if kind == Kind.CALL:
        if method == Method.ERROR:
            raise ProtocolError("ERROR is a reply, not a call")
        message = _decode_call(r, method, call_id)
    else:
        message = _decode_reply(r, method, call_id)
    if r.pos != len(body):
        raise ProtocolError(f"{method.name}: {len(body) - r.pos} bytes of trailing garbage")
    if r.fd_pos != len(r.fds):
        raise ProtocolError(f"{method.name}: {len(r.fds)} fds came with a message that "
                            f"uses {r.fd_pos}")
    return message


def _decode_call(r: _Reader, method: Method, call_id: int):
    if method == Method.HELLO:
        return Hello(call_id, r.u32("protocol version"))
    if method in _QUERIES:
        return Query(call_id, method)
    if method == Method.SUPPORTED_OPERATIONS:
        return SupportedOperations(call_id, _decode_model(r))
    if method == Method.PREPARE_MODEL:
        model = _decode_model(r)
        return PrepareModel(call_id, model, r.enum(ExecutionPreference, "preference"),
                            r.enum(Priority, "priority"), _finite(r.opt_f64("deadline"), "deadline"))
    if method in (Method.EXECUTE, Method.EXECUTE_FENCED):
        model_id = r.u64("prepared model id")
        args = []
        for kind in ("input", "output"):
            n = r.count(f"{kind} count", 6)
            args.append(tuple(_decode_argument(r, f"{kind} {k}") for k in range(n)))
        pools = _decode_pools(r, "request")
        n = r.count("release count", 8)
        release = tuple(r.u64("released pool id") for _ in range(n))
        fields = (call_id, model_id, args[0], args[1], pools, release, r.flag("measure"),
                  _finite(r.opt_f64("deadline"), "deadline"),
                  _finite(r.opt_f64("loop timeout"), "loop timeout"))
        if method == Method.EXECUTE:
            return Execute(*fields)
        n = r.u32("wait_for fence count")
        if n > MAX_FDS:
            raise ProtocolError(f"wait_for fence count {n} exceeds {MAX_FDS}")
        wait_for = tuple(r.fd(f"wait_for fence {k}") for k in range(n))
        timeout = _finite(r.opt_f64("timeout after fence"), "timeout after fence")
        if timeout is not None and timeout < 0:
            raise ProtocolError(f"timeout after fence {timeout} is negative")
        return ExecuteFenced(*fields, wait_for, timeout, r.fd("result fence"))
    if method == Method.RELEASE_MODEL:
        return ReleaseModel(call_id, r.u64("prepared model id"))
    if method == Method.CONFIGURE_BURST:
        model_id = r.u64("prepared model id")
        return ConfigureBurst(call_id, model_id,
                              tuple(r.fd(f"burst ring fd {k}") for k in range(BURST_RING_FDS)))
    if method == Method.RELEASE_BURST:
        return ReleaseBurst(call_id, r.u64("burst id"))
    if method == Method.CANCEL:
        return Cancel(call_id, r.u64("cancelled call id"))
    if method == Method.BURST_ENDED:
        burst_id = r.u64("burst id")
        return BurstEnded(call_id, burst_id, r.str_("reason"))
    if method in (Method.FREE_BURST_SLOTS, Method.GET_MEMORIES):
        burst_id = r.u64("burst id")
        slots = r.u32s("burst slots")
        if len(slots) > MAX_BURST_SLOTS:
            raise ProtocolError(f"{len(slots)} burst slots exceed {MAX_BURST_SLOTS}")
        cls = FreeBurstSlots if method == Method.FREE_BURST_SLOTS else GetMemories
        return cls(call_id, burst_id, slots)
    raise ProtocolError(f"method {method.name} has no call form")  # pragma: no cover


def _finite(v: float | None, what: str) -> float | None:
    if v is not None and not math.isfinite(v):
        raise ProtocolError(f"{what} {v} is not a finite number")
    return v


def _decode_reply(r: _Reader, method: Method, call_id: int) -> Reply:
    status = r.enum(ErrorStatus, "status")
    message = r.str_("error message")
    has_value = r.flag("value flag")
    if method == Method.ERROR and status == ErrorStatus.NONE:
        raise ProtocolError("an ERROR reply with status NONE")
    if has_value != (status == ErrorStatus.NONE or method in _ALWAYS_VALUED):
        raise ProtocolError(f"{method.name} reply with status {status.name} "
                            f"{'has' if has_value else 'lacks'} a value")
    if not has_value:
        return Reply(call_id, method, status, message)
    value: Any = None
    if method == Method.HELLO:
        value = DeviceInfo(r.str_("device name"), r.enum(DeviceType, "device type"),
                           r.str_("version string"), r.u32("feature level"),
                           r.u32("protocol version"))
    elif method == Method.CAPABILITIES:
        value = _decode_capabilities(r)
    elif method == Method.SUPPORTED_EXTENSIONS:
        n = r.count("extension count", 4)
        value = [r.str_("extension name") for _ in range(n)]
    elif method == Method.NUMBER_OF_CACHE_FILES:
        value = (r.u32("model cache files"), r.u32("data cache files"))
    elif method == Method.STATISTICS:
        value = _decode_statistics(r)
    elif method == Method.SUPPORTED_OPERATIONS:
        raw = r.bytes_("supported flags")
        if any(b > 1 for b in raw):
            raise ProtocolError("supported flags: a byte is neither 0 nor 1")
        value = [bool(b) for b in raw]
    elif method == Method.PREPARE_MODEL:
        value = r.u64("prepared model id")
    elif method == Method.EXECUTE:
        n = r.count("output shape count", 5)
        shapes = tuple(OutputShape(r.u32s("output dimensions"), r.flag("is sufficient"))
                       for _ in range(n))
        timing = Timing(r.u64("on-device time"), r.u64("in-driver time"))
        value = ExecutionResult(status, shapes, timing, message)
    elif method == Method.EXECUTE_FENCED:
        n = r.count("output shape count", 5)
        shapes = tuple(OutputShape(r.u32s("output dimensions"), r.flag("is sufficient"))
                       for _ in range(n))
        timing, launched, fenced = (Timing(r.u64(f"{w} on-device time"),
                                           r.u64(f"{w} in-driver time"))
                                    for w in ("run", "launched", "fenced"))
        value = FencedInfo(ExecutionResult(status, shapes, timing, message), launched, fenced)
    elif method == Method.CONFIGURE_BURST:
        value = r.u64("burst id")
    elif method == Method.GET_MEMORIES:
        value = _decode_pools(r, "burst memory")
    return Reply(call_id, method, status, message, value)


def _decode_perf(r: _Reader, what: str) -> PerformanceInfo:
    exec_time, power = r.f64(f"{what} exec_time"), r.f64(f"{what} power_usage")
    if math.isnan(exec_time) or math.isnan(power) or exec_time < 0 or power < 0:
        raise ProtocolError(f"{what}: performance ({exec_time}, {power}) is not a "
                            f"non-negative number")
    return PerformanceInfo(exec_time, power)


def _decode_app(r: "_Reader"):
    if r.flag("app key form"):
        return (r.str_("app key kind"), r.u64("app key id"))
    return r.str_("app key")


def _decode_opt_f64(r: "_Reader", what: str) -> float | None:
    v = r.f64(what)
    return None if math.isnan(v) else v


def _decode_statistics(r: "_Reader") -> StatisticsValue:
    st = None
    if r.flag("statistics flag"):
        slots, busy = r.u32("slots"), r.u32("busy slots")
        n = r.count("class count", 30)
        classes = []
        for _ in range(n):
            app = _decode_app(r)
            priority = r.enum(Priority, "priority")
            counts = [r.u32("counter") for _ in range(7)]
            classes.append(ClassStatistics(app, priority, *counts,
                                           _decode_opt_f64(r, "wait p50"),
                                           _decode_opt_f64(r, "wait p99"),
                                           r.f64("run time")))
        st = SchedulerStatistics(slots, busy, tuple(classes))
    n = r.count("job count", 50)
    if n > MAX_JOB_RECORDS:
        raise ProtocolError(f"job count {n} exceeds {MAX_JOB_RECORDS}")
    jobs = []
    for _ in range(n):
        app = _decode_app(r)
        priority = r.enum(Priority, "priority")
        jobs.append(JobRecord(app, priority, None, r.u64("job seq"), r.f64("submitted at"),
                              _decode_opt_f64(r, "started at"), r.f64("finished at"),
                              r.f64("run time"), r.u32("preemptions"), r.f64("longest step"),
                              r.enum(ErrorStatus, "job status"), r.str_("job message")))
    return StatisticsValue(st, tuple(jobs))


def _decode_capabilities(r: _Reader) -> Capabilities:
    scalar = _decode_perf(r, "relaxed scalar performance")
    tensor = _decode_perf(r, "relaxed tensor performance")
    n = r.count("operand performance count", 20)
    table = {}
    for _ in range(n):
        t = r.enum(OperandType, "operand performance type")
        table[t] = _decode_perf(r, f"{t.name} performance")
    return Capabilities(scalar, tensor, table, _decode_perf(r, "IF performance"),
                        _decode_perf(r, "WHILE performance"))


def _decode_location(r: _Reader, what: str) -> DataLocation | None:
    if not r.flag(f"{what} location flag"):
        return None
    return DataLocation(r.i32(f"{what} pool index"), r.u32(f"{what} offset"),
                        r.u32(f"{what} length"))


def _decode_argument(r: _Reader, what: str) -> RequestArgument:
    no_value = r.flag(f"{what} has_no_value")
    loc = _decode_location(r, what)
    if loc is not None and loc.pool_index < 0:
        raise ProtocolError(f"{what}: pool index {loc.pool_index} is negative")
    return RequestArgument(no_value, loc, r.u32s(f"{what} dimensions"))


def _decode_pools(r: _Reader, what: str) -> tuple[WirePool, ...]:
    n = r.count(f"{what} pool count", 42)
    pools = []
    for k in range(n):
        w = f"{what} pool {k}"
        pool_id = r.u64(f"{w} id")
        has_fd = r.flag(f"{w} fd flag")
        writable = r.flag(f"{w} writable flag")
        fd_offset, map_size, offset, length = (r.u64(f"{w} {x}") for x in
                                               ("fd offset", "map size", "offset", "length"))
        if offset + length > map_size:
            raise ProtocolError(f"{w}: region [{offset}, {offset + length}) lies outside "
                                f"its {map_size}-byte mapping")
        if map_size == 0 and has_fd:
            raise ProtocolError(f"{w}: an fd with an empty mapping")
        fd = r.fd(w) if has_fd else None
        pools.append(WirePool(pool_id, fd, writable, fd_offset, map_size, offset, length))
    return tuple(pools)


def _decode_subgraph(r: _Reader, what: str) -> Subgraph:
    n = r.count(f"{what} operand count", 24)
    operands = []
    for k in range(n):
        w = f"{what} operand {k}"
        t = r.enum(OperandType, f"{w} type")
        dims = r.u32s(f"{w} dimensions")
        scale = r.f64(f"{w} scale")
        zero_point = r.i32(f"{w} zero point")
        lifetime_raw = r.u8(f"{w} lifetime")
        try:
            lifetime = OperandLifeTime(lifetime_raw)
        except ValueError:
            raise ProtocolError(f"{w} lifetime: {lifetime_raw} is not an OperandLifeTime") from None
        loc = _decode_location(r, w)
        cq = None
        if r.flag(f"{w} channel quant flag"):
            dim = r.u32(f"{w} channel dim")
            m = r.count(f"{w} channel scale count", 8)
            cq = ChannelQuant(dim, tuple(r.f64(f"{w} channel scale") for _ in range(m)))
        extra = r.bytes_(f"{w} extra params") if r.flag(f"{w} extra params flag") else None
        operands.append(Operand(t, dims, scale, zero_point, lifetime, loc, cq, extra))
    n = r.count(f"{what} operation count", 12)
    operations = []
    for k in range(n):
        t = r.enum(OperationType, f"{what} operation {k} type")
        operations.append(Operation(t, r.u32s(f"{what} operation {k} inputs"),
                                    r.u32s(f"{what} operation {k} outputs")))
    return Subgraph(tuple(operands), tuple(operations), r.u32s(f"{what} inputs"),
                    r.u32s(f"{what} outputs"))


def _decode_model(r: _Reader) -> HalModel:
    main = _decode_subgraph(r, "main subgraph")
    n = r.count("subgraph count", 16)
    referenced = tuple(_decode_subgraph(r, f"subgraph {k}") for k in range(n))
    values = r.bytes_("operand values")
    pools = _decode_pools(r, "model")
    relax = r.flag("relax flag")
    n = r.count("extension prefix count", 8)
    prefixes = tuple(ExtensionPrefix(r.str_("extension name"), r.u32("extension prefix"))
                     for _ in range(n))
    return HalModel(main, referenced, values, pools, relax, prefixes)
