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
by what is left of the frame and by fixed caps (the reader is
:class:`nnrt.wirecodec.Reader`, shared with the burst wire format).

Codecs. Each method has one :class:`Codec` in :data:`CODECS`, the one table
that says how its call and its reply's value cross the wire, which fds its
call carries, and what value an error reply still carries. Encoding and
decoding look the codec up by ``Method``; a new method is one entry here and
one handler in the service.

The client calls, the service replies; a reply names the call id it answers,
and many calls may be in flight at once (replies come in completion order).
The first call is HELLO; the call stream's states and their transitions are
the table :data:`TRANSITIONS`. The one exception to "the client calls" is
:data:`SERVICE_CALLS` (a burst server asking for memories, or telling that a
burst ended): the service numbers those calls itself and the client replies.

State. Everything that decides what goes on the wire lives in the connection
objects, not in the transports: :class:`ClientConnection` numbers calls,
keeps the pending ones (with the caller's opaque token), builds CANCEL for
them, keeps the pool-id cache of each prepared model and the burst registry,
and fails everything pending when the connection dies;
:class:`ServerConnection` keeps the cancel targets of running executions,
its own calls to the client (GET_MEMORIES) and the pools cached for each
prepared model. Neither does I/O or takes a lock: a transport that touches
one from several threads serializes its calls.

Memory pools (the HAL model's constant pools and a request's pools) are
:class:`WirePool` entries. The client numbers each shared memory it sends by
``pool_id`` (0 = not cached) and sends its fd the first time; later
executions of the same prepared model name the id only, and ``release``
lists ids the client has forgotten. Both sides thereby agree on the cache
without the service ever asking: the client's :class:`ClientConnection`
decides, in the order the frames go out, and the service follows.
"""
from __future__ import annotations

import enum
import itertools
import math
import struct
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from ...errors import ErrorStatus, NnrtError
from ...hal import (NO_TIMING, Capabilities, DeviceType, ExecutionPreference, ExecutionResult,
                    OutputShape, PerformanceInfo, RequestArgument, Timing)
from ...hal.cache import MAX_CACHE_FILES, TOKEN_SIZE, CacheReject
from ...hal.types import BufferRole, Priority
from ...memory import DeviceToken, as_buffer
from ...memory.staging import SlotCache
from ...model.graph import (ChannelQuant, DataLocation, ExtensionPrefix, HalModel, Operand,
                            Operation, Subgraph)
from ...model.extensions import (Extension, ExtensionOperandTypeInfo, is_extension_code,
                                 operand_type, operation_type)
from ...model.types import OperandLifeTime, OperandType, OperationType
from ...wirecodec import Reader, Writer

# 2: memory domains (ALLOCATE..RELEASE_BUFFER, token pools, the mirror fd
# of an ALLOCATE reply), compilation caching (PREPARE_MODEL_CACHING,
# PREPARE_MODEL_FROM_CACHE) and the ERROR to call id 0 before a close: a
# client and a service of different versions refuse each other at HELLO.
PROTOCOL_VERSION = 3
MAX_FRAME = 64 << 20     # bytes of one frame body
MAX_FDS = 64             # fds beside one frame (SCM_RIGHTS allows 253)
MAX_COUNT = 1 << 20      # elements of any list
MAX_STRING = 1 << 16     # bytes of any string
MAX_CACHED_POOLS = 256   # request pools a service caches per prepared model
# The client evicts its oldest pool ids well before the service's limit.
CLIENT_CACHED_POOLS = MAX_CACHED_POOLS - 32
BURST_RING_FDS = 6
MAX_BURST_SLOTS = 1024   # slots named in one FREE_BURST_SLOTS or GET_MEMORIES
MAX_JOB_RECORDS = 4096

_FRAME = struct.Struct("<IB")
_BODY = struct.Struct("<BBQ")
FRAME_HEADER_SIZE = _FRAME.size


class ProtocolError(NnrtError):
    """A message that does not decode, or a call the state machine refuses
    (INVALID_ARGUMENT); or a peer holding more than its limits allow
    (RESOURCE_EXHAUSTED_PERSISTENT, see :class:`ServerConnection`)."""

    def __init__(self, message: str, status: ErrorStatus = ErrorStatus.INVALID_ARGUMENT):
        super().__init__(status, message)


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
    # 20-29: memory domains (driver-managed buffers named by token)
    ALLOCATE = 20             # roles over prepared model ids; reply: the token (+ mirror fd)
    COPY_TO = 21              # buffer -> the shared memory whose fd comes with the call
    COPY_FROM = 22            # the shared memory whose fd comes with the call -> buffer
    RELEASE_BUFFER = 23
    # 30-39: compilation caching (the cache files travel as SCM_RIGHTS)
    PREPARE_MODEL_CACHING = 30     # PREPARE_MODEL that also writes the cache files
    PREPARE_MODEL_FROM_CACHE = 31  # reply: a FromCache (the model id, or why not)
    # 40-49: reusable executions (a request bound once in the service)
    CREATE_EXECUTION = 40     # an EXECUTE's request, its pools' fds with it; reply: the id
    COMPUTE = 41              # compute an execution by id; reply: as EXECUTE's
    RELEASE_EXECUTION = 42


# Calls the service makes to the client (the burst server asking the
# controller for memories, HAL ``IBurstCallback.getMemories``): their call
# ids are the service's own, and the client answers them with a REPLY.
SERVICE_CALLS = frozenset({Method.GET_MEMORIES, Method.BURST_ENDED})


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
class PrepareModelCaching(PrepareModel):
    """PREPARE_MODEL whose driver writes its artifacts into the cache files
    (fds opened by the app, received with the call; the service never opens
    a path). ``token`` is the step's 32-byte cache token."""

    cache_model: tuple[int, ...] = ()
    cache_data: tuple[int, ...] = ()
    token: bytes = b""
    method = Method.PREPARE_MODEL_CACHING


@dataclass(frozen=True, slots=True)
class PrepareModelFromCache:
    """HAL ``prepareModelFromCache``: no model, only the cache files' fds."""

    call_id: int
    priority: Priority
    deadline: float | None
    cache_model: tuple[int, ...]
    cache_data: tuple[int, ...]
    token: bytes
    method = Method.PREPARE_MODEL_FROM_CACHE


@dataclass(frozen=True, slots=True)
class FromCache:
    """The value of a PREPARE_MODEL_FROM_CACHE reply: the prepared model's
    id, or (status GENERAL_FAILURE) the reason the driver refused the files,
    which the app's runtime counts (None: another failure)."""

    status: ErrorStatus
    message: str = ""
    model_id: int = 0
    reason: CacheReject | None = None


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
class ExecuteFenced(Execute):
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

    wait_for: tuple[int, ...] = ()          # fence fds, received with the call
    timeout_after_fence: float | None = None
    fence: int | None = None                # the result fence's fd (required on the wire)
    method = Method.EXECUTE_FENCED


@dataclass(frozen=True, slots=True)
class CreateExecution(Execute):
    """A reusable execution (NNAPI ``createReusableExecution``): the
    request of an :class:`Execute` (its ``deadline`` unused), validated and
    bound to the driver once. Every pool comes with its fd and pool id 0:
    the service maps them for the execution alone, for its whole life, apart
    from the prepared model's pool cache. The reply is the execution id."""

    method = Method.CREATE_EXECUTION


@dataclass(frozen=True, slots=True)
class Compute:
    """Compute execution ``execution_id`` once more: the reply is an
    :class:`ExecutionResult`, as EXECUTE's; CANCEL stops it as it stops one."""

    call_id: int
    execution_id: int
    deadline: float | None = None
    method = Method.COMPUTE


@dataclass(frozen=True, slots=True)
class ReleaseExecution:
    call_id: int
    execution_id: int
    method = Method.RELEASE_EXECUTION


@dataclass(frozen=True, slots=True)
class FencedInfo:
    """The value of an EXECUTE_FENCED reply, sent once the execution has
    settled and its fence is signaled (HAL ``IFencedExecutionCallback``)."""

    result: ExecutionResult        # status, output shapes, the run's own timing, message
    timing_launched: Timing
    timing_fenced: Timing

    @property
    def status(self) -> ErrorStatus:
        return self.result.status

    @property
    def message(self) -> str:
        return self.result.message


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
class WireToken:
    """A request pool naming a driver buffer by its token: the data stays
    in the service (memory domains)."""

    token: int


@dataclass(frozen=True, slots=True)
class Allocate:
    """HAL ``allocate``: roles index ``model_ids`` (prepared models of the
    caller's connection); each role is (model index, io index, frequency)."""

    call_id: int
    dimensions: tuple[int, ...]
    model_ids: tuple[int, ...]
    input_roles: tuple[BufferRole, ...]
    output_roles: tuple[BufferRole, ...]
    method = Method.ALLOCATE


@dataclass(frozen=True, slots=True)
class Allocated:
    """The value of an ALLOCATE reply: the buffer's token and, for a buffer
    of fully known size, its mirror — a sealed memfd of ``mirror_size``
    bytes (its fd travels with the reply; the client owns it) where the
    service keeps the buffer's last written contents, for the client to
    read after the service died (see nnrt.drivers.service.mirror)."""

    token: int
    mirror_fd: int | None = None
    mirror_size: int = 0


@dataclass(frozen=True, slots=True)
class CopyBuffer:
    """COPY_TO (buffer -> ``pool``) or COPY_FROM (``pool`` -> buffer, shaped
    ``dimensions``); ``pool`` is a WirePool whose fd travels with the call."""

    call_id: int
    method: Method
    token: int
    pool: WirePool
    dimensions: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class ReleaseBuffer:
    call_id: int
    token: int
    method = Method.RELEASE_BUFFER


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
        | ExecuteFenced | Cancel | PrepareModelCaching | PrepareModelFromCache
        | CreateExecution | Compute | ReleaseExecution)


# -- statistics on the wire ---------------------------------------------------
#
# The protocol's own types: the service converts its scheduler's statistics
# into these and the client converts them back (at the edge, in server.py
# and client.py), so a change of the scheduler's dataclasses never changes
# the wire silently. An app key is ("uid", n) / ("pid", n) or text.

@dataclass(frozen=True, slots=True)
class WireClassStatistics:
    app: Any
    priority: Priority
    queued: int
    running: int
    completed: int
    preempted: int
    deadline_misses: int
    cancelled: int
    failed: int
    wait_p50: float | None
    wait_p99: float | None
    run_time: float


@dataclass(frozen=True, slots=True)
class WireSchedulerStatistics:
    slots: int
    busy: int
    classes: tuple[WireClassStatistics, ...]


@dataclass(frozen=True, slots=True)
class WireJobRecord:
    app: Any
    priority: Priority
    seq: int
    submitted_at: float
    started_at: float | None
    finished_at: float
    ran: float
    preemptions: int
    longest_step: float
    status: ErrorStatus
    message: str


@dataclass(frozen=True, slots=True)
class StatisticsValue:
    """The reply to STATISTICS: ``statistics`` is None when the driver has
    no scheduler; ``jobs`` are its recent finished jobs."""

    statistics: WireSchedulerStatistics | None
    jobs: tuple[WireJobRecord, ...] = ()


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


# -- the bytes: reader and writer ----------------------------------------------

_MEMBERS: dict[type, dict] = {}    # per enum class read off the wire: its members by value


def _member(cls, value: int, what: str):
    """``cls(value)`` from a table (an Enum call costs a look-up through its
    metaclass: per field of up to 256 job records in a STATISTICS reply);
    ProtocolError for a value that is none of its members."""
    members = _MEMBERS.get(cls)
    if members is None:
        members = _MEMBERS[cls] = {m.value: m for m in cls}
    member = members.get(value)
    if member is None:
        raise ProtocolError(f"{what}: {value} is not a {cls.__name__}")
    return member


class _Reader(Reader):
    """The shared bounds-checked reader, plus this protocol's compound
    fields (flags, counted lists, strings, enums, fds beside the frame)."""

    __slots__ = ("fds", "fd_pos")

    def __init__(self, data: bytes, fds):
        super().__init__(data, ProtocolError)
        self.fds = list(fds)
        self.fd_pos = 0

    def flag(self, what: str) -> bool:
        v = self.u8(what)
        if v > 1:
            raise ProtocolError(f"{what}: flag byte {v} is neither 0 nor 1")
        return bool(v)

    def count(self, what: str, element_size: int = 1) -> int:
        """A u32 count of elements at least ``element_size`` bytes each."""
        n = self.u32(what)
        if n > MAX_COUNT or n * element_size > self.left:
            raise ProtocolError(f"{what}: count {n} exceeds what the message holds")
        return n

    def bytes_(self, what: str, limit: int = MAX_FRAME) -> bytes:
        n = self.u32(what)
        if n > limit or n > self.left:
            raise ProtocolError(f"{what}: length {n} exceeds what the message holds")
        return self.raw(n, what)

    def str_(self, what: str) -> str:
        try:
            return self.bytes_(what, MAX_STRING).decode("utf-8")
        except UnicodeDecodeError:
            raise ProtocolError(f"{what}: not UTF-8") from None

    def u32s(self, what: str) -> tuple[int, ...]:
        return self.u32_array(self.count(what, 4), what)

    def opt_f64(self, what: str) -> float | None:
        return self.f64(what) if self.flag(what) else None

    def finite(self, what: str) -> float | None:
        v = self.opt_f64(what)
        if v is not None and not math.isfinite(v):
            raise ProtocolError(f"{what} {v} is not a finite number")
        return v

    def nan_or_f64(self, what: str) -> float | None:
        v = self.f64(what)
        return None if math.isnan(v) else v

    def enum(self, cls, what: str):
        return _member(cls, self.u32(what), what)

    def fd(self, what: str) -> int:
        if self.fd_pos >= len(self.fds):
            raise ProtocolError(f"{what}: the message names more fds than came with it")
        self.fd_pos += 1
        return self.fds[self.fd_pos - 1]


class _Writer(Writer):
    __slots__ = ("fds",)

    def __init__(self, head: bytes):
        super().__init__(head)
        self.fds: list[int] = []

    def flag(self, v) -> None:
        self.out += b"\x01" if v else b"\x00"

    def bytes_(self, v) -> None:
        v = bytes(v)
        self.u32(len(v))
        self.raw(v)

    def str_(self, v: str) -> None:
        self.bytes_(v.encode("utf-8"))

    def u32s(self, values) -> None:
        values = tuple(values)
        self.u32(len(values))
        self.u32_array(values)

    def opt_f64(self, v: float | None) -> None:
        self.u8(v is not None)
        if v is not None:
            self.f64(v)

    def nan_or_f64(self, v: float | None) -> None:
        self.f64(math.nan if v is None else v)


# -- codecs of the fields that several messages share -------------------------

def _put_location(w: _Writer, loc: DataLocation | None) -> None:
    w.flag(loc is not None)
    if loc is not None:
        w.i32(loc.pool_index)
        w.u32(loc.offset)
        w.u32(loc.length)


def _get_location(r: _Reader, what: str) -> DataLocation | None:
    if not r.flag(f"{what} location flag"):
        return None
    return DataLocation(r.i32(f"{what} pool index"), r.u32(f"{what} offset"),
                        r.u32(f"{what} length"))


# A pool's kind byte: mapped by id (no fd), its fd comes with the message,
# or a driver buffer's token (memory domains; request pools only).
_POOL_CACHED, _POOL_FD, _POOL_TOKEN = 0, 1, 2


def _put_pools(w: _Writer, pools) -> None:
    w.u32(len(pools))
    for p in pools:
        if isinstance(p, WireToken):
            w.u64(p.token)
            w.u8(_POOL_TOKEN)
            continue
        if not isinstance(p, WirePool):
            raise TypeError(f"pools must be WirePool entries on the wire, got {type(p).__name__}")
        w.u64(p.pool_id)
        w.u8(_POOL_FD if p.fd is not None else _POOL_CACHED)
        w.flag(p.writable)
        for v in (p.fd_offset, p.map_size, p.offset, p.length):
            w.u64(v)
        if p.fd is not None:
            w.fds.append(p.fd)


def _get_pools(r: _Reader, what: str, tokens: bool = False) -> tuple:
    """WirePools (and, with ``tokens``, WireTokens: a request's pools)."""
    n = r.count(f"{what} pool count", 9)
    pools = []
    for k in range(n):
        w = f"{what} pool {k}"
        pool_id = r.u64(f"{w} id")
        kind = r.u8(f"{w} kind")
        if kind == _POOL_TOKEN and tokens:
            if pool_id == 0:
                raise ProtocolError(f"{w}: buffer token 0")
            pools.append(WireToken(pool_id))
            continue
        if kind not in (_POOL_CACHED, _POOL_FD):
            raise ProtocolError(f"{w}: pool kind {kind} is not valid here")
        has_fd = kind == _POOL_FD
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


def _pool_fds(pools) -> tuple[int, ...]:
    return tuple(wp.fd for wp in pools if isinstance(wp, WirePool) and wp.fd is not None)


def _put_subgraph(w: _Writer, s: Subgraph) -> None:
    w.u32(len(s.operands))
    for o in s.operands:
        w.u32(o.type)
        w.u32s(o.dimensions)
        w.f64(o.scale)
        w.i32(o.zero_point)
        w.u8(o.lifetime)
        _put_location(w, o.location)
        w.flag(o.channel_quant is not None)
        if o.channel_quant is not None:
            w.u32(o.channel_quant.channel_dim)
            w.u32(len(o.channel_quant.scales))
            w.f64_array(o.channel_quant.scales)
        w.flag(o.extra_params is not None)
        if o.extra_params is not None:
            w.bytes_(o.extra_params)
    w.u32(len(s.operations))
    for op in s.operations:
        w.u32(op.type)
        w.u32s(op.inputs)
        w.u32s(op.outputs)
    w.u32s(s.input_indexes)
    w.u32s(s.output_indexes)


def _get_subgraph(r: _Reader, what: str) -> Subgraph:
    n = r.count(f"{what} operand count", 24)
    operands = []
    for k in range(n):
        w = f"{what} operand {k}"
        # Extension types are resolved once the prefix map is read (_get_model).
        t = r.u32(f"{w} type")
        if not is_extension_code(t):
            t = _enum(OperandType, t, f"{w} type")
        dims = r.u32s(f"{w} dimensions")
        scale = r.f64(f"{w} scale")
        zero_point = r.i32(f"{w} zero point")
        lifetime_raw = r.u8(f"{w} lifetime")
        try:
            lifetime = OperandLifeTime(lifetime_raw)
        except ValueError:
            raise ProtocolError(f"{w} lifetime: {lifetime_raw} is not an OperandLifeTime") from None
        loc = _get_location(r, w)
        cq = None
        if r.flag(f"{w} channel quant flag"):
            dim = r.u32(f"{w} channel dim")
            m = r.count(f"{w} channel scale count", 8)
            cq = ChannelQuant(dim, r.f64_array(m, f"{w} channel scales"))
        extra = r.bytes_(f"{w} extra params") if r.flag(f"{w} extra params flag") else None
        operands.append(Operand(t, dims, scale, zero_point, lifetime, loc, cq, extra))
    n = r.count(f"{what} operation count", 12)
    operations = []
    for k in range(n):
        t = r.u32(f"{what} operation {k} type")
        if not is_extension_code(t):
            t = _enum(OperationType, t, f"{what} operation {k} type")
        operations.append(Operation(t, r.u32s(f"{what} operation {k} inputs"),
                                    r.u32s(f"{what} operation {k} outputs")))
    return Subgraph(tuple(operands), tuple(operations), r.u32s(f"{what} inputs"),
                    r.u32s(f"{what} outputs"))


def _put_model(w: _Writer, m: HalModel, put_pools=_put_pools) -> None:
    _put_subgraph(w, m.main)
    w.u32(len(m.referenced))
    for s in m.referenced:
        _put_subgraph(w, s)
    w.bytes_(m.operand_values)
    put_pools(w, m.pools)
    w.flag(m.relax_computation_float32_to_float16)
    w.u32(len(m.extension_prefixes))
    for e in m.extension_prefixes:
        w.str_(e.name)
        w.u32(e.prefix)


def _get_model(r: _Reader, get_pools=lambda r: _get_pools(r, "model")) -> HalModel:
    main = _get_subgraph(r, "main subgraph")
    n = r.count("subgraph count", 16)
    referenced = tuple(_get_subgraph(r, f"subgraph {k}") for k in range(n))
    values = r.bytes_("operand values", r.left)
    pools = get_pools(r)
    relax = r.flag("relax flag")
    n = r.count("extension prefix count", 8)
    prefixes = tuple(ExtensionPrefix(r.str_("extension name"), r.u32("extension prefix"))
                     for _ in range(n))
    mapping = {e.prefix: e.name for e in prefixes}
    try:
        main = _resolve_extension_types(main, mapping)
        referenced = tuple(_resolve_extension_types(s, mapping) for s in referenced)
    except NnrtError as e:
        raise ProtocolError(e.message) from None
    return HalModel(main, referenced, values, pools, relax, prefixes)


def _put_inline_pools(w: _Writer, pools) -> None:
    w.u32(len(pools))
    for pool in pools:
        w.bytes_(as_buffer(pool))


def _get_inline_pools(r: _Reader) -> tuple[bytes, ...]:
    return tuple(r.bytes_(f"pool {k}", r.left) for k in range(r.count("pool count", 4)))


def encode_model(model: HalModel) -> bytes:
    """``model`` as bytes, its constant pools inline: what a driver keeps of
    a model in its cache files (:func:`decode_model` reads it back)."""
    w = _Writer(b"")
    _put_model(w, model, _put_inline_pools)
    return w.value()


def decode_model(data) -> HalModel:
    """The model :func:`encode_model` wrote, its pools as bytes; ProtocolError
    for bytes that do not hold one."""
    r = _Reader(data, ())
    model = _get_model(r, _get_inline_pools)
    r.finish("cached model")
    return model


def _enum(cls, v: int, what: str):
    try:
        return cls(v)
    except ValueError:
        raise ProtocolError(f"{what}: {v} is not a {cls.__name__}") from None


def _resolve_extension_types(sub: Subgraph, prefixes: dict[int, str]) -> Subgraph:
    """Turn the raw extension codes (plain ints) of ``sub`` into extension
    types, given the model's prefix map; INVALID_ARGUMENT for an unknown
    prefix or an extension this process does not know."""
    if not any(type(x.type) is int for x in (*sub.operands, *sub.operations)):
        return sub
    operands = tuple(replace(o, type=operand_type(o.type, prefixes)) if type(o.type) is int
                     else o for o in sub.operands)
    operations = tuple(replace(op, type=operation_type(op.type, prefixes))
                       if type(op.type) is int else op for op in sub.operations)
    return replace(sub, operands=operands, operations=operations)


def with_pools(model: HalModel, pools) -> HalModel:
    """``model`` with other constant pools: WirePools on the way out, the
    mapped memories on the way in."""
    return HalModel(model.main, model.referenced, model.operand_values, tuple(pools),
                    model.relax_computation_float32_to_float16, model.extension_prefixes)


def _put_perf(w: _Writer, p: PerformanceInfo) -> None:
    w.f64(p.exec_time)
    w.f64(p.power_usage)


def _get_perf(r: _Reader, what: str) -> PerformanceInfo:
    exec_time, power = r.f64(f"{what} exec_time"), r.f64(f"{what} power_usage")
    if math.isnan(exec_time) or math.isnan(power) or exec_time < 0 or power < 0:
        raise ProtocolError(f"{what}: performance ({exec_time}, {power}) is not a "
                            f"non-negative number")
    return PerformanceInfo(exec_time, power)


def _put_shapes_and_timings(w: _Writer, shapes, timings) -> None:
    w.u32(len(shapes))
    for s in shapes:
        w.u32s(s.dimensions)
        w.flag(s.is_sufficient)
    for t in timings:
        w.u64(t.on_device)
        w.u64(t.in_driver)


_RUN = ("run on-device time", "run in-driver time")
_FENCED = (_RUN, ("launched on-device time", "launched in-driver time"),
           ("fenced on-device time", "fenced in-driver time"))


def _get_shapes_and_timings(r: _Reader, timings):
    """Output shapes, then one Timing per (on-device, in-driver) label pair."""
    n = r.count("output shape count", 5)
    shapes = tuple(OutputShape(r.u32s("output dimensions"), r.flag("is sufficient"))
                   for _ in range(n))
    return shapes, [Timing(r.u64(on_device), r.u64(in_driver))
                    for on_device, in_driver in timings]


def _put_app(w: _Writer, app) -> None:
    # Service app keys are ("uid", n) or ("pid", n); anything else travels as text.
    if isinstance(app, tuple) and len(app) == 2 and isinstance(app[0], str) \
            and isinstance(app[1], int) and app[1] >= 0:
        w.u8(1)
        w.str_(app[0])
        w.u64(app[1])
    else:
        w.u8(0)
        w.str_(str(app))


def _get_app(r: _Reader):
    if r.flag("app key form"):
        return (r.str_("app key kind"), r.u64("app key id"))
    return r.str_("app key")


def _slots_of(r: _Reader) -> tuple[int, ...]:
    slots = r.u32s("burst slots")
    if len(slots) > MAX_BURST_SLOTS:
        raise ProtocolError(f"{len(slots)} burst slots exceed {MAX_BURST_SLOTS}")
    return slots


# -- one codec per method ---------------------------------------------------------

def _nothing(w, m) -> None:
    pass


def _put_hello(w: _Writer, m: Hello) -> None:
    w.u32(m.protocol_version)


def _put_device_info(w: _Writer, v: DeviceInfo) -> None:
    w.str_(v.name)
    w.u32(v.type)
    w.str_(v.version_string)
    w.u32(v.feature_level)
    w.u32(v.protocol_version)


def _get_device_info(r: _Reader, status, message) -> DeviceInfo:
    return DeviceInfo(r.str_("device name"), r.enum(DeviceType, "device type"),
                      r.str_("version string"), r.u32("feature level"),
                      r.u32("protocol version"))


def _put_capabilities(w: _Writer, c: Capabilities) -> None:
    _put_perf(w, c.relaxed_float32_to_float16_scalar)
    _put_perf(w, c.relaxed_float32_to_float16_tensor)
    w.u32(len(c.operand_performance))
    for t, p in c.operand_performance.items():
        w.u32(t)
        _put_perf(w, p)
    _put_perf(w, c.if_performance)
    _put_perf(w, c.while_performance)


def _get_capabilities(r: _Reader, status, message) -> Capabilities:
    scalar = _get_perf(r, "relaxed scalar performance")
    tensor = _get_perf(r, "relaxed tensor performance")
    n = r.count("operand performance count", 20)
    table = {}
    for _ in range(n):
        t = r.enum(OperandType, "operand performance type")
        table[t] = _get_perf(r, f"{t.name} performance")
    return Capabilities(scalar, tensor, table, _get_perf(r, "IF performance"),
                        _get_perf(r, "WHILE performance"))


def _put_extensions(w: _Writer, extensions) -> None:
    w.u32(len(extensions))
    for ext in extensions:
        w.str_(ext.name)
        w.u32(len(ext.operand_types))
        for info in ext.operand_types:
            w.u32(info.type)
            w.flag(info.is_tensor)
            w.u32(info.byte_size)
        w.u32(len(ext.operation_names))
        for within, name in ext.operation_names:
            w.u32(within)
            w.str_(name)


def _get_extension(r: _Reader, k: int) -> Extension:
    what = f"extension {k}"
    name = r.str_(f"{what} name")
    types = tuple(ExtensionOperandTypeInfo(r.u32(f"{what} operand type"),
                                           r.flag(f"{what} is-tensor flag"),
                                           r.u32(f"{what} byte size"))
                  for _ in range(r.count(f"{what} operand type count", 9)))
    names = tuple((r.u32(f"{what} operation type"), r.str_(f"{what} operation name"))
                  for _ in range(r.count(f"{what} operation count", 8)))
    try:
        return Extension(name, types, names)
    except NnrtError as e:
        raise ProtocolError(f"{what}: {e.message}") from None


def _get_extensions(r: _Reader, status, message) -> list[Extension]:
    return [_get_extension(r, k) for k in range(r.count("extension count", 12))]


def _put_cache_files(w: _Writer, v) -> None:
    w.u32(v[0])
    w.u32(v[1])


def _get_cache_files(r: _Reader, status, message) -> tuple[int, int]:
    return (r.u32("model cache files"), r.u32("data cache files"))


def _put_flags(w: _Writer, v) -> None:
    w.bytes_(bytes(bool(x) for x in v))


def _get_flags(r: _Reader, status, message) -> list[bool]:
    raw = r.bytes_("supported flags")
    if any(b > 1 for b in raw):
        raise ProtocolError("supported flags: a byte is neither 0 nor 1")
    return [bool(b) for b in raw]


def _put_id(w: _Writer, v: int) -> None:
    w.u64(v)


def _get_id(what: str):
    return lambda r, status, message: r.u64(what)


def _put_prepare(w: _Writer, m: PrepareModel) -> None:
    _put_model(w, m.model)
    w.u32(m.preference)
    w.u32(m.priority)
    w.opt_f64(m.deadline)


def _get_prepare(r: _Reader, call_id: int, method: Method) -> PrepareModel:
    model = _get_model(r)
    return PrepareModel(call_id, model, r.enum(ExecutionPreference, "preference"),
                        r.enum(Priority, "priority"), r.finite("deadline"))


def _put_cache_fds(w: _Writer, m) -> None:
    for fds in (m.cache_model, m.cache_data):
        w.u32(len(fds))
        w.fds.extend(fds)
    w.bytes_(m.token)


def _get_cache_fds(r: _Reader) -> tuple[tuple[int, ...], tuple[int, ...], bytes]:
    fds = []
    for what in ("model", "data"):
        n = r.u32(f"{what} cache file count")
        if n > MAX_CACHE_FILES:
            raise ProtocolError(f"{n} {what} cache files exceed {MAX_CACHE_FILES}")
        fds.append(tuple(r.fd(f"{what} cache file {k}") for k in range(n)))
    token = r.bytes_("cache token", TOKEN_SIZE)
    if len(token) != TOKEN_SIZE:
        raise ProtocolError(f"a cache token of {len(token)} bytes, not {TOKEN_SIZE}")
    return fds[0], fds[1], token


def _put_prepare_caching(w: _Writer, m: PrepareModelCaching) -> None:
    _put_prepare(w, m)
    _put_cache_fds(w, m)


def _get_prepare_caching(r: _Reader, call_id: int, method: Method) -> PrepareModelCaching:
    m = _get_prepare(r, call_id, method)
    model_fds, data_fds, token = _get_cache_fds(r)
    return PrepareModelCaching(call_id, m.model, m.preference, m.priority, m.deadline,
                               model_fds, data_fds, token)


def _put_from_cache(w: _Writer, m: PrepareModelFromCache) -> None:
    w.u32(m.priority)
    w.opt_f64(m.deadline)
    _put_cache_fds(w, m)


def _get_from_cache(r: _Reader, call_id: int, method: Method) -> PrepareModelFromCache:
    priority, deadline = r.enum(Priority, "priority"), r.finite("deadline")
    return PrepareModelFromCache(call_id, priority, deadline, *_get_cache_fds(r))


_REJECTS = tuple(CacheReject)


def _put_from_cache_value(w: _Writer, v: FromCache) -> None:
    w.u64(v.model_id)
    w.u8(0 if v.reason is None else 1 + _REJECTS.index(v.reason))


def _get_from_cache_value(r: _Reader, status, message) -> FromCache:
    model_id = r.u64("prepared model id")
    code = r.u8("cache reject reason")
    if code > len(_REJECTS):
        raise ProtocolError(f"cache reject reason {code} is unknown")
    return FromCache(status, message, model_id, None if code == 0 else _REJECTS[code - 1])


def _put_execute(w: _Writer, m: Execute) -> None:
    w.u64(m.model_id)
    for args in (m.inputs, m.outputs):
        w.u32(len(args))
        for a in args:
            w.flag(a.has_no_value)
            _put_location(w, a.location)
            w.u32s(a.dimensions)
    _put_pools(w, m.pools)
    w.u32(len(m.release))
    for pool_id in m.release:
        w.u64(pool_id)
    w.flag(m.measure)
    w.opt_f64(m.deadline)
    w.opt_f64(m.loop_timeout)


def _get_argument(r: _Reader, what: str) -> RequestArgument:
    no_value = r.flag(f"{what} has_no_value")
    loc = _get_location(r, what)
    if loc is not None and loc.pool_index < 0:
        raise ProtocolError(f"{what}: pool index {loc.pool_index} is negative")
    return RequestArgument(no_value, loc, r.u32s(f"{what} dimensions"))


def _get_execute(r: _Reader, call_id: int, method: Method) -> Execute:
    model_id = r.u64("prepared model id")
    args = []
    for kind in ("input", "output"):
        n = r.count(f"{kind} count", 6)
        args.append(tuple(_get_argument(r, f"{kind} {k}") for k in range(n)))
    pools = _get_pools(r, "request", tokens=True)
    release = tuple(r.u64("released pool id") for _ in range(r.count("release count", 8)))
    return Execute(call_id, model_id, args[0], args[1], pools, release, r.flag("measure"),
                   r.finite("deadline"), r.finite("loop timeout"))


def _put_execute_fenced(w: _Writer, m: ExecuteFenced) -> None:
    _put_execute(w, m)
    w.u32(len(m.wait_for))
    w.fds.extend(m.wait_for)
    w.opt_f64(m.timeout_after_fence)
    if m.fence is None:
        raise TypeError("EXECUTE_FENCED needs the result fence's fd")
    w.fds.append(m.fence)


def _get_execute_fenced(r: _Reader, call_id: int, method: Method) -> ExecuteFenced:
    e = _get_execute(r, call_id, method)
    n = r.u32("wait_for fence count")
    if n > MAX_FDS:
        raise ProtocolError(f"wait_for fence count {n} exceeds {MAX_FDS}")
    wait_for = tuple(r.fd(f"wait_for fence {k}") for k in range(n))
    timeout = r.finite("timeout after fence")
    if timeout is not None and timeout < 0:
        raise ProtocolError(f"timeout after fence {timeout} is negative")
    return ExecuteFenced(e.call_id, e.model_id, e.inputs, e.outputs, e.pools, e.release,
                         e.measure, e.deadline, e.loop_timeout, wait_for, timeout,
                         r.fd("result fence"))


def _get_create_execution(r: _Reader, call_id: int, method: Method) -> CreateExecution:
    e = _get_execute(r, call_id, method)
    return CreateExecution(e.call_id, e.model_id, e.inputs, e.outputs, e.pools, e.release,
                           e.measure, e.deadline, e.loop_timeout)


def _put_compute(w: _Writer, m: Compute) -> None:
    w.u64(m.execution_id)
    w.opt_f64(m.deadline)


def _get_compute(r: _Reader, call_id: int, method: Method) -> Compute:
    return Compute(call_id, r.u64("execution id"), r.finite("deadline"))


def _put_result(w: _Writer, v: ExecutionResult) -> None:
    _put_shapes_and_timings(w, v.output_shapes, (v.timing,))


def _get_result(r: _Reader, status, message) -> ExecutionResult:
    shapes, (timing,) = _get_shapes_and_timings(r, (_RUN,))
    return ExecutionResult(status, shapes, timing, message)


def _put_fenced_info(w: _Writer, v: FencedInfo) -> None:
    _put_shapes_and_timings(w, v.result.output_shapes,
                            (v.result.timing, v.timing_launched, v.timing_fenced))


def _get_fenced_info(r: _Reader, status, message) -> FencedInfo:
    shapes, (timing, launched, fenced) = _get_shapes_and_timings(r, _FENCED)
    return FencedInfo(ExecutionResult(status, shapes, timing, message), launched, fenced)


def _put_configure_burst(w: _Writer, m: ConfigureBurst) -> None:
    if len(m.ring_fds) != BURST_RING_FDS:
        raise ProtocolError(f"CONFIGURE_BURST takes {BURST_RING_FDS} ring fds, "
                            f"not {len(m.ring_fds)}")
    w.u64(m.model_id)
    w.fds.extend(m.ring_fds)


def _get_configure_burst(r: _Reader, call_id: int, method: Method) -> ConfigureBurst:
    model_id = r.u64("prepared model id")
    return ConfigureBurst(call_id, model_id,
                          tuple(r.fd(f"burst ring fd {k}") for k in range(BURST_RING_FDS)))


def _put_burst_slots(w: _Writer, m) -> None:
    w.u64(m.burst_id)
    w.u32s(m.slots)


def _get_burst_slots(cls):
    def get(r: _Reader, call_id: int, method: Method):
        burst_id = r.u64("burst id")
        return cls(call_id, burst_id, _slots_of(r))
    return get


def _put_burst_ended(w: _Writer, m: BurstEnded) -> None:
    w.u64(m.burst_id)
    w.str_(m.reason)


def _get_burst_ended(r: _Reader, call_id: int, method: Method) -> BurstEnded:
    burst_id = r.u64("burst id")
    return BurstEnded(call_id, burst_id, r.str_("reason"))


def _put_statistics(w: _Writer, v: StatisticsValue) -> None:
    st = v.statistics
    w.flag(st is not None)
    if st is not None:
        w.u32(st.slots)
        w.u32(st.busy)
        w.u32(len(st.classes))
        for c in st.classes:
            _put_app(w, c.app)
            w.u32(c.priority)
            for n in (c.queued, c.running, c.completed, c.preempted, c.deadline_misses,
                      c.cancelled, c.failed):
                w.u32(n)
            w.nan_or_f64(c.wait_p50)
            w.nan_or_f64(c.wait_p99)
            w.f64(c.run_time)
    jobs = v.jobs[-MAX_JOB_RECORDS:]
    w.u32(len(jobs))
    for j in jobs:
        _put_app(w, j.app)
        w.u32(j.priority)
        w.u64(j.seq)
        w.f64(j.submitted_at)
        w.nan_or_f64(j.started_at)
        w.f64(j.finished_at)
        w.f64(j.ran)
        w.u32(j.preemptions)
        w.f64(j.longest_step)
        w.u32(j.status)
        w.str_(j.message)


def _get_statistics(r: _Reader, status, message) -> StatisticsValue:
    st = None
    if r.flag("statistics flag"):
        slots, busy = r.u32("slots"), r.u32("busy slots")
        classes = []
        for _ in range(r.count("class count", 30)):
            app = _get_app(r)
            priority = r.enum(Priority, "priority")
            counts = [r.u32("counter") for _ in range(7)]
            classes.append(WireClassStatistics(app, priority, *counts, r.nan_or_f64("wait p50"),
                                               r.nan_or_f64("wait p99"), r.f64("run time")))
        st = WireSchedulerStatistics(slots, busy, tuple(classes))
    n = r.count("job count", 50)
    if n > MAX_JOB_RECORDS:
        raise ProtocolError(f"job count {n} exceeds {MAX_JOB_RECORDS}")
    jobs = []
    for _ in range(n):
        # The fixed fields in one unpack: a reply carries up to 256 records,
        # and reading them field by field took ~12 us each (issue 15).
        app = _get_app(r)
        (priority, seq, submitted, started, finished, ran, preemptions, longest,
         status) = r.take(_JOB_FIXED, "job record")
        jobs.append(WireJobRecord(app, _member(Priority, priority, "priority"),
                                  seq, submitted, None if math.isnan(started) else started,
                                  finished, ran, preemptions, longest,
                                  _member(ErrorStatus, status, "job status"),
                                  r.str_("job message")))
    return StatisticsValue(st, tuple(jobs))


# A job record after its app key, as _put_statistics writes it: priority,
# seq, submitted at, started at (NaN: never), finished at, run time,
# preemptions, longest step, status.
_JOB_FIXED = struct.Struct("<IQddddIdI")


def _put_roles(w: _Writer, roles) -> None:
    w.u32(len(roles))
    for role in roles:
        w.u32(role.model_index)
        w.u32(role.io_index)
        w.f64(role.frequency)


def _get_roles(r: _Reader, what: str) -> tuple[BufferRole, ...]:
    return tuple(BufferRole(r.u32(f"{what} model index"), r.u32(f"{what} io index"),
                            r.f64(f"{what} frequency"))
                 for _ in range(r.count(f"{what} count", 16)))


def _put_allocate(w: _Writer, m: Allocate) -> None:
    w.u32s(m.dimensions)
    w.u32(len(m.model_ids))
    for model_id in m.model_ids:
        w.u64(model_id)
    _put_roles(w, m.input_roles)
    _put_roles(w, m.output_roles)


def _get_allocate(r: _Reader, call_id: int, method: Method) -> Allocate:
    dims = r.u32s("buffer dimensions")
    ids = tuple(r.u64("prepared model id") for _ in range(r.count("prepared model count", 8)))
    return Allocate(call_id, dims, ids, _get_roles(r, "input role"), _get_roles(r, "output role"))


def _put_allocated(w: _Writer, v: Allocated) -> None:
    w.u64(v.token)
    w.flag(v.mirror_fd is not None)
    if v.mirror_fd is not None:
        w.u64(v.mirror_size)
        w.fds.append(v.mirror_fd)


def _get_allocated(r: _Reader, status: ErrorStatus, message: str) -> Allocated:
    token = r.u64("buffer token")
    if not r.flag("mirror flag"):
        return Allocated(token)
    size = r.u64("mirror size")
    if size == 0:
        raise ProtocolError("ALLOCATE: a mirror of 0 bytes")
    return Allocated(token, r.fd("buffer mirror"), size)


def _put_copy(w: _Writer, m: CopyBuffer) -> None:
    w.u64(m.token)
    _put_pools(w, (m.pool,))
    w.u32s(m.dimensions)


def _get_copy(r: _Reader, call_id: int, method: Method) -> CopyBuffer:
    token = r.u64("buffer token")
    pools = _get_pools(r, "copy")
    if len(pools) != 1 or pools[0].fd is None:
        raise ProtocolError(f"{method.name}: takes one shared memory, sent with its fd")
    dims = r.u32s("copy dimensions")
    if method == Method.COPY_TO and dims:
        raise ProtocolError("COPY_TO takes no dimensions")
    return CopyBuffer(call_id, method, token, pools[0], dims)


def _execution_error(status: ErrorStatus, message: str) -> ExecutionResult:
    return ExecutionResult(status, message=message)


def _fenced_error(status: ErrorStatus, message: str) -> FencedInfo:
    return FencedInfo(ExecutionResult(status, message=message), NO_TIMING, NO_TIMING)


@dataclass(frozen=True, slots=True)
class Codec:
    """How one method crosses the wire.

    ``put_call``/``get_call`` write and read a call's payload (None: the
    method has no call form). ``put_value``/``get_value`` do the same for
    the value of a successful reply (None: the reply carries no value).
    ``error_value`` is the value an error reply still carries (an execution
    reports shapes and timing even when it failed); ``fds`` lists the fds a
    decoded call holds, which its receiver owns and closes; ``value_fds``
    the same for a reply's value."""

    put_call: Callable[[_Writer, Any], None] | None
    get_call: Callable[[_Reader, int, Method], Any] | None
    put_value: Callable[[_Writer, Any], None] | None = None
    get_value: Callable[[_Reader, ErrorStatus, str], Any] | None = None
    error_value: Callable[[ErrorStatus, str], Any] | None = None
    fds: Callable[[Any], tuple[int, ...]] = lambda call: ()
    value_fds: Callable[[Any], tuple[int, ...]] = lambda value: ()


def _query(r: _Reader, call_id: int, method: Method) -> Query:
    return Query(call_id, method)


def _get_u64_call(cls, what: str):
    return lambda r, call_id, method: cls(call_id, r.u64(what))


CODECS: dict[Method, Codec] = {
    Method.ERROR: Codec(None, None),
    Method.HELLO: Codec(_put_hello, lambda r, cid, m: Hello(cid, r.u32("protocol version")),
                        _put_device_info, _get_device_info),
    Method.CAPABILITIES: Codec(_nothing, _query, _put_capabilities, _get_capabilities),
    Method.SUPPORTED_EXTENSIONS: Codec(_nothing, _query, _put_extensions, _get_extensions),
    Method.NUMBER_OF_CACHE_FILES: Codec(_nothing, _query, _put_cache_files, _get_cache_files),
    Method.STATISTICS: Codec(_nothing, _query, _put_statistics, _get_statistics),
    Method.SUPPORTED_OPERATIONS: Codec(
        lambda w, m: _put_model(w, m.model),
        lambda r, cid, m: SupportedOperations(cid, _get_model(r)),
        _put_flags, _get_flags, fds=lambda call: _pool_fds(call.model.pools)),
    Method.PREPARE_MODEL: Codec(_put_prepare, _get_prepare, _put_id,
                                _get_id("prepared model id"),
                                fds=lambda call: _pool_fds(call.model.pools)),
    Method.EXECUTE: Codec(_put_execute, _get_execute, _put_result, _get_result,
                          _execution_error, fds=lambda call: _pool_fds(call.pools)),
    Method.EXECUTE_FENCED: Codec(
        _put_execute_fenced, _get_execute_fenced, _put_fenced_info, _get_fenced_info,
        _fenced_error, fds=lambda call: (*_pool_fds(call.pools), *call.wait_for, call.fence)),
    Method.RELEASE_MODEL: Codec(lambda w, m: w.u64(m.model_id),
                                _get_u64_call(ReleaseModel, "prepared model id")),
    Method.CONFIGURE_BURST: Codec(_put_configure_burst, _get_configure_burst, _put_id,
                                  _get_id("burst id"), fds=lambda call: call.ring_fds),
    Method.RELEASE_BURST: Codec(lambda w, m: w.u64(m.burst_id),
                                _get_u64_call(ReleaseBurst, "burst id")),
    Method.FREE_BURST_SLOTS: Codec(_put_burst_slots, _get_burst_slots(FreeBurstSlots)),
    Method.GET_MEMORIES: Codec(_put_burst_slots, _get_burst_slots(GetMemories),
                               _put_pools, lambda r, status, message: _get_pools(r, "burst memory"),
                               value_fds=_pool_fds),
    Method.BURST_ENDED: Codec(_put_burst_ended, _get_burst_ended),
    Method.CANCEL: Codec(lambda w, m: w.u64(m.target),
                         _get_u64_call(Cancel, "cancelled call id")),
    Method.ALLOCATE: Codec(_put_allocate, _get_allocate, _put_allocated, _get_allocated,
                           value_fds=lambda v: () if v.mirror_fd is None else (v.mirror_fd,)),
    Method.COPY_TO: Codec(_put_copy, _get_copy, fds=lambda call: _pool_fds((call.pool,))),
    Method.COPY_FROM: Codec(_put_copy, _get_copy, fds=lambda call: _pool_fds((call.pool,))),
    Method.RELEASE_BUFFER: Codec(lambda w, m: w.u64(m.token),
                                 _get_u64_call(ReleaseBuffer, "buffer token")),
    Method.PREPARE_MODEL_CACHING: Codec(
        _put_prepare_caching, _get_prepare_caching, _put_id, _get_id("prepared model id"),
        fds=lambda call: (*_pool_fds(call.model.pools), *call.cache_model, *call.cache_data)),
    Method.PREPARE_MODEL_FROM_CACHE: Codec(
        _put_from_cache, _get_from_cache, _put_from_cache_value, _get_from_cache_value,
        lambda status, message: FromCache(status, message),
        fds=lambda call: (*call.cache_model, *call.cache_data)),
    Method.CREATE_EXECUTION: Codec(_put_execute, _get_create_execution, _put_id,
                                   _get_id("execution id"), fds=lambda call: _pool_fds(call.pools)),
    Method.COMPUTE: Codec(_put_compute, _get_compute, _put_result, _get_result,
                          _execution_error),
    Method.RELEASE_EXECUTION: Codec(lambda w, m: w.u64(m.execution_id),
                                    _get_u64_call(ReleaseExecution, "execution id")),
}
assert set(CODECS) == set(Method), "every method has its codec"


def _has_value(method: Method, status: ErrorStatus) -> bool:
    return status == ErrorStatus.NONE or CODECS[method].error_value is not None


def error_reply(call_id: int, method: Method, status: ErrorStatus, message: str) -> Reply:
    """The reply refusing call ``call_id`` of ``method`` with ``status``
    (with the value an execution's error reply carries)."""
    codec = CODECS[method]
    value = codec.error_value(status, message) if codec.error_value is not None else None
    return Reply(call_id, method, status, message, value)


def reply_for(call, value) -> Reply:
    """The reply answering ``call`` with ``value``: an execution's reply takes
    its status and message from the value, any other is NONE."""
    if CODECS[call.method].error_value is not None:
        return Reply(call.call_id, call.method, value.status, value.message, value)
    return Reply(call.call_id, call.method, value=value)


def fds_of(call) -> tuple[int, ...]:
    """The fds a decoded call holds (its receiver closes them)."""
    return tuple(CODECS[call.method].fds(call))


def reply_fds_of(reply: Reply) -> tuple[int, ...]:
    """The fds a decoded reply's value holds (its receiver owns them)."""
    if reply.value is None or not _has_value(reply.method, reply.status):
        return ()
    return tuple(CODECS[reply.method].value_fds(reply.value))


# -- encoding and decoding whole messages --------------------------------------------

def encode(message) -> tuple[bytes, list[int]]:
    """Frame bytes and the fds that travel beside them."""
    reply = isinstance(message, Reply)
    try:
        codec = CODECS[message.method]
    except (AttributeError, KeyError):
        raise TypeError(f"not a protocol message: {message!r}") from None
    w = _Writer(_BODY.pack(Kind.REPLY if reply else Kind.CALL, message.method, message.call_id))
    if not reply and codec.put_call is None:
        raise TypeError(f"{message.method.name} has no call form")
    try:
        if reply:
            w.u32(message.status)
            w.str_(message.message)
            has_value = _has_value(message.method, message.status)
            w.flag(has_value)
            if has_value and codec.put_value is not None:
                codec.put_value(w, message.value)
        else:
            codec.put_call(w, message)
    except (struct.error, OverflowError, ValueError) as e:
        # An argument the wire cannot carry (a negative offset, a string
        # deadline): the caller's mistake, refused before anything is sent.
        raise ProtocolError(f"{message.method.name}: an argument cannot be encoded: {e}") \
            from None
    body = w.out
    if len(body) > MAX_FRAME or len(w.fds) > MAX_FDS:
        raise ProtocolError(f"message of {len(body)} bytes and {len(w.fds)} fds exceeds the "
                            f"frame limits ({MAX_FRAME} bytes, {MAX_FDS} fds)")
    return _FRAME.pack(len(body), len(w.fds)) + body, w.fds


def _peek_ids(body: bytes) -> tuple[int, int]:
    """(call id, method) of a body that did not decode, 0 where unreadable."""
    if len(body) >= _BODY.size:
        _kind, method, call_id = _BODY.unpack_from(body)
        return call_id, method
    return 0, 0


def decode_body(body: bytes, fds=()):
    """A message from one frame body and its fds, or ProtocolError."""
    r = _Reader(body, fds)
    kind, method, call_id = r.take(_BODY, "message header")
    if kind not in (Kind.CALL, Kind.REPLY):
        raise ProtocolError(f"message kind {kind} is neither CALL nor REPLY")
    try:
        method = Method(method)
    except ValueError:
        raise ProtocolError(f"unknown method {method}") from None
    codec = CODECS[method]
    if kind == Kind.CALL:
        if codec.get_call is None:
            raise ProtocolError(f"{method.name} is a reply, not a call")
        message = codec.get_call(r, call_id, method)
    else:
        message = _decode_reply(r, method, call_id, codec)
    r.finish(method.name)
    if r.fd_pos != len(r.fds):
        raise ProtocolError(f"{method.name}: {len(r.fds)} fds came with a message that "
                            f"uses {r.fd_pos}")
    return message


def _decode_reply(r: _Reader, method: Method, call_id: int, codec: Codec) -> Reply:
    status = r.enum(ErrorStatus, "status")
    message = r.str_("error message")
    has_value = r.flag("value flag")
    if method == Method.ERROR and status == ErrorStatus.NONE:
        raise ProtocolError("an ERROR reply with status NONE")
    if has_value != _has_value(method, status):
        raise ProtocolError(f"{method.name} reply with status {status.name} "
                            f"{'has' if has_value else 'lacks'} a value")
    value = None
    if has_value and codec.get_value is not None:
        value = codec.get_value(r, status, message)
    return Reply(call_id, method, status, message, value)


# -- connections ---------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class WireStatistics:
    """What one side of a connection framed: whole frames (headers
    included) and the fds beside them. Tensor data never travels in a
    frame (it lives in shared memory or in the driver), which tests assert
    on these counts."""

    frames_sent: int
    bytes_sent: int
    fds_sent: int
    frames_received: int
    bytes_received: int


class Connection:
    """One side of a connection, framing and the call stream only: feed it
    bytes and fds, pull events; ask it to encode what you send. ``role`` is
    "client" or "server". :class:`ClientConnection` and
    :class:`ServerConnection` add the state of calls in flight."""

    def __init__(self, role: str, max_fds: int | None = None, max_frame: int = MAX_FRAME):
        if role not in ("client", "server"):
            raise ValueError(role)
        self.role = role
        self.state = State.IDLE
        self._buffer = bytearray()
        self._fds: list[int] = []
        self._counts = [0, 0, 0, 0, 0]   # WireStatistics, in its field order
        # What the peer may make us hold: fds no frame has claimed yet, and
        # the bytes of a frame (at most MAX_FRAME, the protocol's own cap).
        self.max_fds = max_fds
        self.max_frame = min(max_frame, MAX_FRAME)

    @property
    def held(self) -> tuple[int, int]:
        """``(fds, bytes)`` received and not yet handed out with a message:
        the unclaimed fds and the bytes of an unfinished frame."""
        return len(self._fds), len(self._buffer)

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
            self._check_fds()
            return None
        length, nfds = _FRAME.unpack_from(self._buffer)
        if length > MAX_FRAME or nfds > MAX_FDS:
            self.state = State.CLOSED
            raise ProtocolError(f"frame of {length} bytes with {nfds} fds exceeds the limits "
                                f"({MAX_FRAME} bytes, {MAX_FDS} fds)")
        if length > self.max_frame:
            self.state = State.CLOSED
            raise ProtocolError(f"frame of {length} bytes exceeds this connection's limit of "
                                f"{self.max_frame} bytes", ErrorStatus.RESOURCE_EXHAUSTED_PERSISTENT)
        if len(self._buffer) < _FRAME.size + length:
            self._check_fds()
            return None
        if nfds > len(self._fds):
            self.state = State.CLOSED
            raise ProtocolError(f"frame announces {nfds} fds, {len(self._fds)} arrived")
        body = bytes(self._buffer[_FRAME.size:_FRAME.size + length])
        del self._buffer[:_FRAME.size + length]
        self._counts[3] += 1
        self._counts[4] += _FRAME.size + length
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

    def _check_fds(self) -> None:
        # Checked when no complete frame is left: a well-behaved peer's fds
        # arrive with its frames' first bytes, so only fds sent beyond what
        # its frames claim (or ahead of a frame that never comes) pile up.
        if self.max_fds is not None and len(self._fds) > self.max_fds:
            self.state = State.CLOSED
            raise ProtocolError(f"{len(self._fds)} fds received that no frame claims, more "
                                f"than this connection's limit of {self.max_fds}",
                                ErrorStatus.RESOURCE_EXHAUSTED_PERSISTENT)

    def drop_buffer(self) -> int:
        """Forget the bytes of an unfinished frame (the connection is
        closing); how many there were."""
        held, self._buffer = len(self._buffer), bytearray()
        return held

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
        data, fds = encode(message)
        self._counts[0] += 1
        self._counts[1] += len(data)
        self._counts[2] += len(fds)
        return data, fds

    def statistics(self) -> WireStatistics:
        """Frames, bytes and fds this side sent and received so far."""
        return WireStatistics(*self._counts)

    def close(self) -> None:
        self.state = transition(self.state, Event.CLOSE)


@dataclass(frozen=True, slots=True)
class Answer:
    """A reply to one of our own calls, with the token its caller left when
    it made the call (None: nobody waits for it any more)."""

    token: Any
    reply: Reply


@dataclass(slots=True)
class _Pending:
    token: Any
    method: Method
    model_id: int = 0
    new_pools: tuple[int, ...] = ()   # pool ids whose fd went with this call


class _ModelPools:
    """The client's pool cache of one prepared model: the ids of the
    Memories it sent, and which of them the service holds mapped."""

    __slots__ = ("slots", "held")

    def __init__(self):
        self.slots = SlotCache()
        self.held: set[int] = set()


_KEEPS_POOLS = (ErrorStatus.NONE, ErrorStatus.OUTPUT_INSUFFICIENT_SIZE)


class ClientConnection(Connection):
    """The client's side: calls are numbered here and wait here (with the
    caller's token) until their reply; pool ids are decided here, in the
    order the frames go out, so both sides agree on the service's cache."""

    def __init__(self):
        super().__init__("client")
        self._call_ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._pools: dict[int, _ModelPools] = {}
        self.bursts: dict[int, Any] = {}   # burst id -> the controller answering for it
        self.dead: str | None = None       # why the connection ended
        # What the service said when it closed the connection on us (an
        # ERROR reply to call id 0: a broken frame, a limit, a refusal).
        self.farewell: str | None = None

    def call(self, build: Callable[[int], Any], token) -> tuple[int, bytes, list[int]]:
        """Number the call ``build(call_id)`` makes and keep ``token`` until
        its reply: ``(call_id, frame, fds)``."""
        call_id = next(self._call_ids)
        message = build(call_id)
        data, fds = self.send(message)
        self._pending[call_id] = _Pending(token, message.method)
        return call_id, data, fds

    def notify(self, build: Callable[[int], Any]) -> tuple[bytes, list[int]]:
        """A call whose reply nobody waits for."""
        return self.send(build(next(self._call_ids)))

    def cancel(self, call_id: int) -> tuple[bytes, list[int]] | None:
        """CANCEL of call ``call_id``, None if it is answered already."""
        if call_id not in self._pending:
            return None
        return self.notify(lambda cid: Cancel(cid, call_id))

    def abandon(self, call_id: int) -> None:
        """The caller stopped waiting for ``call_id``: its reply will be dropped."""
        entry = self._pending.pop(call_id, None)
        if entry is not None:
            self._forget_new_pools(entry)

    def execute(self, token, model_id: int, inputs, outputs, places, measure: bool,
                deadline, loop_timeout, fenced: dict | None = None
                ) -> tuple[int, bytes, list[int]]:
        """EXECUTE (or, with ``fenced`` = the extra fields, EXECUTE_FENCED)
        of the request whose pools lie at ``places`` (``Place``s; None for an
        empty pool). Pools pass by fd the first time this prepared model
        sees them and by id afterwards; closed, collected and evicted ones
        are released with this call."""
        cache = self._pools.setdefault(model_id, _ModelPools())
        release = cache.slots.take_freed()
        in_use = {cache.slots.slot(place.memory) for place in places
                  if place is not None and not isinstance(place, DeviceToken)}
        release += cache.slots.evict(CLIENT_CACHED_POOLS, in_use)
        release = [s for s in release if s in cache.held]
        cache.held.difference_update(release)
        pools, new = [], []
        for place in places:
            if place is None:
                pools.append(WirePool(0, None, True, 0, 0, 0, 0))
                continue
            if isinstance(place, DeviceToken):   # a driver buffer: only its token travels
                pools.append(WireToken(place.token))
                continue
            mem = place.memory
            pool_id = cache.slots.slot(mem)
            fd = None
            if pool_id not in cache.held:
                cache.held.add(pool_id)
                new.append(pool_id)
                fd = mem.fileno()
            pools.append(WirePool(pool_id, fd, mem.writable, mem.fd_offset, mem.size,
                                  place.offset, place.length))
        call_id = next(self._call_ids)
        fields = (call_id, model_id, tuple(inputs), tuple(outputs), tuple(pools),
                  tuple(release), bool(measure), deadline, loop_timeout)
        message = Execute(*fields) if fenced is None else ExecuteFenced(*fields, **fenced)
        try:
            data, fds = self.send(message)
        except BaseException:
            cache.held.difference_update(new)
            raise
        self._pending[call_id] = _Pending(token, message.method, model_id, tuple(new))
        return call_id, data, fds

    def create_execution(self, token, model_id: int, inputs, outputs, places, measure: bool,
                         loop_timeout) -> tuple[int, bytes, list[int]]:
        """CREATE_EXECUTION of the request whose pools lie at ``places``
        (``Place``s of Memories, None for an empty pool): each pool's fd goes
        with it, for the execution alone (pool id 0, not the prepared
        model's cache)."""
        pools = tuple(WirePool(0, None, True, 0, 0, 0, 0) if place is None else
                      WirePool(0, place.memory.fileno(), place.memory.writable,
                               place.memory.fd_offset, place.memory.size, place.offset,
                               place.length)
                      for place in places)
        return self.call(lambda cid: CreateExecution(cid, model_id, tuple(inputs),
                                                     tuple(outputs), pools, (), bool(measure),
                                                     None, loop_timeout), token)

    def compute(self, token, execution_id: int, deadline) -> tuple[int, bytes, list[int]]:
        return self.call(lambda cid: Compute(cid, execution_id, deadline), token)

    def release_execution(self, execution_id: int) -> tuple[bytes, list[int]]:
        return self.notify(lambda cid: ReleaseExecution(cid, execution_id))

    def release_model(self, model_id: int) -> tuple[bytes, list[int]]:
        """RELEASE_MODEL; the model's pool cache goes with it."""
        self._pools.pop(model_id, None)
        return self.notify(lambda cid: ReleaseModel(cid, model_id))

    def _forget_new_pools(self, entry: _Pending) -> None:
        # The service may not have mapped what came with a call that failed
        # (or that nobody waits for): send those fds again next time.
        cache = self._pools.get(entry.model_id)
        if cache is not None:
            cache.held.difference_update(entry.new_pools)

    def next_event(self):
        """As :meth:`Connection.next_event`, a reply to a call of ours as an
        :class:`Answer`."""
        event = super().next_event()
        if isinstance(event, Reply):
            entry = self._pending.pop(event.call_id, None)
            if entry is None:
                if event.call_id == 0 and event.method is Method.ERROR:
                    self.farewell = event.message
                return Answer(None, event)
            if entry.new_pools and event.status not in _KEEPS_POOLS:
                self._forget_new_pools(entry)
            return Answer(entry.token, event)
        return event

    def fail(self, message: str) -> list[Answer]:
        """The connection died: every pending call's DEAD_OBJECT reply, with
        its token. Later calls must not be made (``dead`` says why)."""
        if self.dead is None:
            self.dead = message
        pending, self._pending = self._pending, {}
        return [Answer(e.token, error_reply(call_id, e.method, ErrorStatus.DEAD_OBJECT,
                                            self.dead))
                for call_id, e in pending.items()]


_CANCELLABLE = (Method.EXECUTE, Method.COMPUTE)   # (not fenced: its fence settles it)


class ServerConnection(Connection):
    """The service's side: the cancel targets of running executions, its
    own calls to the client (GET_MEMORIES, BURST_ENDED) awaiting a reply,
    the request pools cached for each prepared model, and the bursts open
    on this connection. ``max_fds`` and ``max_frame`` bound what the client
    can make the service hold (see :meth:`Connection.next_event`).

    Cancel targets. An EXECUTE (or COMPUTE) is a cancel target from the moment it is
    decoded, before any handler runs: its handler registers its cancel
    handle later (:meth:`running`), and a CANCEL that arrives in between is
    recorded and applied then, never lost. Invariant: ``_running`` holds
    exactly the EXECUTEs and COMPUTEs decoded and not yet :meth:`finished` (the
    transport calls ``finished`` for every call it took, refused or not),
    and ``_cancelled`` is a subset of its keys; so both are bounded by the
    calls in flight (``test_protocol.py::test_cancel_before_registration``).
    """

    def __init__(self, max_fds: int | None = None, max_frame: int = MAX_FRAME):
        super().__init__("server", max_fds, max_frame)
        self.bursts: dict[int, Any] = {}        # burst id -> the task serving it
        self._running: dict[int, Any] = {}      # EXECUTE call id -> its cancel handle or None
        self._cancelled: set[int] = set()       # cancelled before their handle was registered
        self._call_ids = itertools.count(1)     # ids of our calls to the client
        self._pending: dict[int, Any] = {}      # our call id -> the caller's token
        self._pools: dict[int, dict[int, Any]] = {}   # model id -> pool id -> mapped pool

    # cancel targets

    def running(self, call_id: int, handle) -> bool:
        """EXECUTE ``call_id`` runs; ``handle`` is what CANCEL cancels. True
        when a CANCEL came first: the caller cancels ``handle`` at once."""
        self._running[call_id] = handle
        cancelled = call_id in self._cancelled
        self._cancelled.discard(call_id)
        return cancelled

    def finished(self, call_id: int) -> None:
        """Call ``call_id`` is answered (any method; a no-op unless EXECUTE or COMPUTE)."""
        self._running.pop(call_id, None)
        self._cancelled.discard(call_id)
        assert self._cancelled <= self._running.keys()

    def cancel_target(self, cancel: Cancel):
        """The handle CANCEL names, or None: not registered yet (the CANCEL
        is kept for :meth:`running`), or unknown or finished (ignored)."""
        if cancel.target not in self._running:
            return None
        handle = self._running[cancel.target]
        if handle is None:
            self._cancelled.add(cancel.target)
        return handle

    # our calls to the client

    def call(self, build: Callable[[int], Any], token) -> tuple[int, bytes, list[int]]:
        call_id = next(self._call_ids)
        data, fds = self.send(build(call_id))
        self._pending[call_id] = token
        return call_id, data, fds

    def notify(self, build: Callable[[int], Any]) -> tuple[bytes, list[int]]:
        return self.send(build(next(self._call_ids)))

    def abandon(self, call_id: int) -> None:
        self._pending.pop(call_id, None)

    def next_event(self):
        event = super().next_event()
        if isinstance(event, Reply):
            return Answer(self._pending.pop(event.call_id, None), event)
        if isinstance(event, (Execute, Compute)) and event.method in _CANCELLABLE:
            self._running.setdefault(event.call_id, None)
        return event

    def reply(self, reply: Reply) -> tuple[bytes, list[int]]:
        """The frame of ``reply``; one too big for a frame becomes an ERROR."""
        try:
            return self.send(reply)
        except ProtocolError as e:
            return self.send(Reply(reply.call_id, Method.ERROR, ErrorStatus.GENERAL_FAILURE,
                                   e.message))

    # the pool cache

    def cached_pool(self, model_id: int, pool_id: int):
        return self._pools.get(model_id, {}).get(pool_id)

    def cache_pool(self, model_id: int, pool_id: int, pool) -> list:
        """Keep ``pool`` as ``pool_id`` of ``model_id``; the pools it
        replaces (the caller closes them). ProtocolError beyond
        :data:`MAX_CACHED_POOLS`."""
        pools = self._pools.setdefault(model_id, {})
        old = pools.pop(pool_id, None)
        if len(pools) >= MAX_CACHED_POOLS:
            raise ProtocolError(f"more than {MAX_CACHED_POOLS} pools cached for one "
                                f"prepared model; release some")
        pools[pool_id] = pool
        return [] if old is None else [old]

    def release_pools(self, model_id: int, pool_ids) -> list:
        """Forget ``pool_ids`` of ``model_id``; the pools (the caller closes them)."""
        pools = self._pools.get(model_id, {})
        return [m for m in (pools.pop(i, None) for i in pool_ids) if m is not None]

    def drop_model(self, model_id: int) -> list:
        """Forget every pool of ``model_id``; the pools (the caller closes them)."""
        return list(self._pools.pop(model_id, {}).values())
