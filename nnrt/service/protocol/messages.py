"""The control protocol's messages: one frozen dataclass per call and reply
value, the ``Method`` and ``Kind`` enums, the bounds every decoder enforces,
and the call stream's state machine. No encoding here (:mod:`.codecs`) and
no connection state (:mod:`.connection`); the theory of operation is in the
package's docstring."""
from __future__ import annotations

import enum
import struct
from dataclasses import dataclass, field
from typing import Any

from ...errors import ErrorStatus, NnrtError
from ...hal import DeviceType, ExecutionPreference, ExecutionResult, RequestArgument, Timing
from ...hal.cache import CacheReject
from ...hal.types import AppDeclaration, BufferRole, Priority
from ...model.graph import HalModel

# 6: an app key of two strings (a remote app: ("remote", name), issue 42)
# crosses in STATISTICS as itself, not as its text.
# 5: HELLO carries the app's declaration (its name and script: AppDeclaration).
# 4: reusable executions (CREATE_EXECUTION, COMPUTE, RELEASE_EXECUTION), the
# scheduler's own records in STATISTICS, with each app's rule, weight and cap.
# 2: memory domains (ALLOCATE..RELEASE_BUFFER, token pools, the mirror fd
# of an ALLOCATE reply), compilation caching (PREPARE_MODEL_CACHING,
# PREPARE_MODEL_FROM_CACHE) and the ERROR to call id 0 before a close: a
# client and a service of different versions refuse each other at HELLO.
PROTOCOL_VERSION = 6
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
    app: AppDeclaration = AppDeclaration()   # what the app says it is
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
    read after the service died (see nnrt.service.mirror)."""

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


# -- statistics on the wire: the scheduler's own records (see codecs._RecordCodec) --

@dataclass(frozen=True, slots=True)
class StatisticsValue:
    """The reply to STATISTICS: ``statistics`` is None when the driver has
    no scheduler; ``jobs`` are its recent finished jobs."""

    statistics: Any   # nnrt.qos.SchedulerStatistics or None
    jobs: tuple = ()  # nnrt.qos.JobRecord, their ``model`` None on the client


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



__all__ = ["Allocate", "Allocated", "BURST_RING_FDS", "BurstEnded", "CLIENT_CACHED_POOLS", "Call",
           "Cancel", "Compute", "ConfigureBurst", "CopyBuffer", "CreateExecution", "DeviceInfo",
           "Event", "Execute", "ExecuteFenced", "FRAME_HEADER_SIZE", "FencedInfo",
           "FreeBurstSlots", "FromCache", "GetMemories", "Hello", "Kind", "MAX_BURST_SLOTS",
           "MAX_CACHED_POOLS", "MAX_COUNT", "MAX_FDS", "MAX_FRAME", "MAX_JOB_RECORDS",
           "MAX_STRING", "Malformed", "Method", "PROTOCOL_VERSION", "PrepareModel",
           "PrepareModelCaching", "PrepareModelFromCache", "ProtocolError", "Query",
           "ReleaseBuffer", "ReleaseBurst", "ReleaseExecution", "ReleaseModel", "Reply",
           "SERVICE_CALLS", "State", "StatisticsValue", "SupportedOperations", "TRANSITIONS",
           "WirePool", "WireToken", "transition"]
