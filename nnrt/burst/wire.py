"""Burst wire format: pure encode/decode of request and result messages.

No I/O here: the controller and the server move these bytes through the
request and result rings (:mod:`nnrt.fmq`). ``decode*`` of any byte string
either returns a valid message or raises :class:`BurstProtocolError`
(INVALID_ARGUMENT) -- never another exception, never a hang: every count is
bounded before anything is allocated, and the message must be consumed
exactly (trailing bytes are an error). Encoding is canonical, so
``encode(decode(b)) == b`` for every ``b`` that decodes.

Layout (little-endian)::

    request  = "NBRQ" u16 version u16 flags u64 serial f64 deadline
               f64 loop_timeout u16 n_inputs u16 n_outputs u16 n_slots u16 layout
               argument * (n_inputs + n_outputs)  u32 slot * n_slots
    run      = "NBRL" u16 version u16 flags u64 serial f64 deadline
               u16 layout u16 0 u32 0
    argument = u8 has_no_value u8 rank u16 0 u32 pool_index u64 offset
               u64 length u32 dimension * rank
    result   = "NBRS" u16 version u16 0 u64 serial u32 status
               u16 n_outputs u16 message_length u64 on_device u64 in_driver
               shape * n_outputs  message (UTF-8)
    shape    = u8 is_sufficient u8 rank u16 0 u32 dimension * rank

Request ``flags``: bit 0 measure timing, bit 1 a deadline is present, bit 2 a
loop timeout is present; an absent value is encoded as 0.0. A request whose
``layout`` is not 0 also defines that layout (1 to ``MAX_LAYOUTS``): the
server keeps its arguments, slots, measure flag and loop timeout bound to
the driver (a reusable execution), replacing any earlier layout of that
number, and a *run* frame then computes it again with only its serial and
deadline (run ``flags``: bit 1 only). An argument's
``pool_index`` indexes the request's ``slots`` (as a HAL request's location
indexes its pools); the slot ids name memory pools the server caches. An
argument with no value carries zeros. Timing is microseconds with
``UINT64_MAX`` for "not measured".
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass

from ..errors import ErrorStatus, NnrtError
from ..wirecodec import Reader, Writer

VERSION = 2
REQUEST_MAGIC = b"NBRQ"
RUN_MAGIC = b"NBRL"
RESULT_MAGIC = b"NBRS"
UINT64_MAX = 2**64 - 1
MAX_ARGUMENTS = 1024      # per direction (inputs, outputs)
MAX_SLOTS = 1024
MAX_RANK = 16
MAX_MESSAGE = 1024        # bytes of UTF-8 in a result's message
MAX_LAYOUTS = 64          # layouts a burst keeps bound at once

_MEASURE, _HAS_DEADLINE, _HAS_LOOP_TIMEOUT = 1, 2, 4
_REQUEST_FLAGS = _MEASURE | _HAS_DEADLINE | _HAS_LOOP_TIMEOUT

_REQ_HEAD = struct.Struct("<4sHHQddHHHH")
_ARG_HEAD = struct.Struct("<BBHIQQ")
_RUN = struct.Struct("<4sHHQdHHI")
_RES_HEAD = struct.Struct("<4sHHQIHHQQ")
_SHAPE_HEAD = struct.Struct("<BBH")

# The largest messages the bounds allow: ring sizes are derived from these.
MAX_REQUEST_SIZE = (_REQ_HEAD.size + 2 * MAX_ARGUMENTS * (_ARG_HEAD.size + 4 * MAX_RANK)
                    + 4 * MAX_SLOTS)
MAX_RESULT_SIZE = (_RES_HEAD.size + MAX_ARGUMENTS * (_SHAPE_HEAD.size + 4 * MAX_RANK)
                   + MAX_MESSAGE)


class BurstProtocolError(NnrtError):
    """A burst message that cannot be encoded or decoded (INVALID_ARGUMENT)."""

    def __init__(self, message: str):
        super().__init__(ErrorStatus.INVALID_ARGUMENT, f"burst message: {message}")


@dataclass(frozen=True, slots=True)
class BurstArgument:
    """One input or output of a burst request: where its bytes live."""

    has_no_value: bool = False
    pool_index: int = 0          # index into BurstRequest.slots
    offset: int = 0
    length: int = 0
    dimensions: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class BurstRequest:
    serial: int
    inputs: tuple[BurstArgument, ...]
    outputs: tuple[BurstArgument, ...]
    slots: tuple[int, ...]
    measure_timing: bool = False
    deadline: float | None = None       # absolute time.monotonic() seconds
    loop_timeout: float | None = None   # seconds; None = the driver's default
    layout: int = 0                     # > 0: also define this layout (see the header)


@dataclass(frozen=True, slots=True)
class BurstRun:
    """Compute a layout a request defined again, with a new serial and deadline."""

    serial: int
    layout: int
    deadline: float | None = None


@dataclass(frozen=True, slots=True)
class BurstOutputShape:
    dimensions: tuple[int, ...]
    is_sufficient: bool = True


@dataclass(frozen=True, slots=True)
class BurstResult:
    serial: int
    status: ErrorStatus
    output_shapes: tuple[BurstOutputShape, ...] = ()
    on_device: int = UINT64_MAX          # microseconds; UINT64_MAX = not measured
    in_driver: int = UINT64_MAX
    message: str = ""


# ------------------------------------------------------------------ checks

def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_uint(value, bits: int, what: str) -> int:
    if not _is_int(value) or not 0 <= value < 1 << bits:
        raise BurstProtocolError(f"{what} {value!r} is not an unsigned {bits}-bit integer")
    return value


def _check_seconds(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value < 0:
        raise BurstProtocolError(f"{what} {value!r} is not a finite, non-negative number "
                                 f"of seconds")
    return float(value)


def _check_dims(dims, what: str) -> tuple[int, ...]:
    try:
        dims = tuple(dims)
    except TypeError:
        raise BurstProtocolError(f"{what}: dimensions {dims!r} are not a sequence") from None
    if len(dims) > MAX_RANK:
        raise BurstProtocolError(f"{what}: rank {len(dims)} exceeds {MAX_RANK}")
    for d in dims:
        _check_uint(d, 32, f"{what}: dimension")
    return dims


def _check_count(n: int, limit: int, what: str) -> None:
    if n > limit:
        raise BurstProtocolError(f"{n} {what} exceed the limit of {limit}")


# ------------------------------------------------------------------ encode

def _encode_argument(w: Writer, arg: BurstArgument, what: str, n_slots: int) -> None:
    if not isinstance(arg, BurstArgument):
        raise BurstProtocolError(f"{what} is {type(arg).__name__}, not a BurstArgument")
    if arg.has_no_value:
        if (arg.pool_index, arg.offset, arg.length, tuple(arg.dimensions)) != (0, 0, 0, ()):
            raise BurstProtocolError(f"{what} has no value but carries a location or dimensions")
        w.pack(_ARG_HEAD, 1, 0, 0, 0, 0, 0)
        return
    dims = _check_dims(arg.dimensions, what)
    index = _check_uint(arg.pool_index, 32, f"{what}: pool index")
    if index >= n_slots:
        raise BurstProtocolError(f"{what}: pool index {index} out of range ({n_slots} slots)")
    w.pack(_ARG_HEAD, 0, len(dims), 0, index, _check_uint(arg.offset, 64, f"{what}: offset"),
           _check_uint(arg.length, 64, f"{what}: length"))
    w.u32_array(dims)


def encode_request(request: BurstRequest) -> bytes:
    """The bytes of ``request``; BurstProtocolError if a field is out of range."""
    if not isinstance(request, BurstRequest):
        raise BurstProtocolError(f"{type(request).__name__} is not a BurstRequest")
    inputs, outputs, slots = tuple(request.inputs), tuple(request.outputs), tuple(request.slots)
    _check_count(len(inputs), MAX_ARGUMENTS, "inputs")
    _check_count(len(outputs), MAX_ARGUMENTS, "outputs")
    _check_count(len(slots), MAX_SLOTS, "slots")
    flags = _MEASURE if request.measure_timing else 0
    deadline = loop_timeout = 0.0
    if request.deadline is not None:
        flags |= _HAS_DEADLINE
        deadline = _check_seconds(request.deadline, "deadline")
    if request.loop_timeout is not None:
        flags |= _HAS_LOOP_TIMEOUT
        loop_timeout = _check_seconds(request.loop_timeout, "loop timeout")
    layout = _check_uint(request.layout, 16, "layout")
    if layout > MAX_LAYOUTS:
        raise BurstProtocolError(f"layout {layout} exceeds {MAX_LAYOUTS}")
    w = Writer(_REQ_HEAD.pack(REQUEST_MAGIC, VERSION, flags,
                              _check_uint(request.serial, 64, "serial"), deadline,
                              loop_timeout, len(inputs), len(outputs), len(slots), layout))
    for kind, args in (("input", inputs), ("output", outputs)):
        for k, arg in enumerate(args):
            _encode_argument(w, arg, f"{kind} {k}", len(slots))
    for k, slot in enumerate(slots):
        w.u32(_check_uint(slot, 32, f"slot {k}"))
    return w.value()


def encode_run(run: BurstRun) -> bytes:
    """The bytes of ``run``; BurstProtocolError if a field is out of range."""
    if not isinstance(run, BurstRun):
        raise BurstProtocolError(f"{type(run).__name__} is not a BurstRun")
    layout = _check_uint(run.layout, 16, "layout")
    if not 1 <= layout <= MAX_LAYOUTS:
        raise BurstProtocolError(f"layout {layout} is not 1 to {MAX_LAYOUTS}")
    if run.deadline is None:
        return _RUN.pack(RUN_MAGIC, VERSION, 0, _check_uint(run.serial, 64, "serial"), 0.0,
                         layout, 0, 0)
    return _RUN.pack(RUN_MAGIC, VERSION, _HAS_DEADLINE, _check_uint(run.serial, 64, "serial"),
                     _check_seconds(run.deadline, "deadline"), layout, 0, 0)


def encode_result(result: BurstResult) -> bytes:
    """The bytes of ``result``; BurstProtocolError if a field is out of range."""
    if not isinstance(result, BurstResult):
        raise BurstProtocolError(f"{type(result).__name__} is not a BurstResult")
    try:
        status = ErrorStatus(result.status)
    except ValueError:
        raise BurstProtocolError(f"status {result.status!r} is not an ErrorStatus") from None
    shapes = tuple(result.output_shapes)
    _check_count(len(shapes), MAX_ARGUMENTS, "output shapes")
    if not isinstance(result.message, str):
        raise BurstProtocolError(f"message {result.message!r} is not a string")
    message = result.message.encode("utf-8", "replace")
    if len(message) > MAX_MESSAGE:
        raise BurstProtocolError(f"message of {len(message)} bytes exceeds {MAX_MESSAGE}")
    w = Writer(_RES_HEAD.pack(RESULT_MAGIC, VERSION, 0,
                              _check_uint(result.serial, 64, "serial"), int(status),
                              len(shapes), len(message),
                              _check_uint(result.on_device, 64, "on_device time"),
                              _check_uint(result.in_driver, 64, "in_driver time")))
    for k, shape in enumerate(shapes):
        if not isinstance(shape, BurstOutputShape):
            raise BurstProtocolError(f"output shape {k} is {type(shape).__name__}, "
                                     f"not a BurstOutputShape")
        dims = _check_dims(shape.dimensions, f"output shape {k}")
        w.pack(_SHAPE_HEAD, 1 if shape.is_sufficient else 0, len(dims), 0)
        w.u32_array(dims)
    w.raw(message)
    return w.value()


# ------------------------------------------------------------------ decode

class _Reader(Reader):
    """The shared bounds-checked cursor, plus dimensions bounded by MAX_RANK."""

    __slots__ = ()

    def __init__(self, data: memoryview):
        super().__init__(data, BurstProtocolError)

    def dims(self, rank: int, what: str) -> tuple[int, ...]:
        if rank > MAX_RANK:
            raise BurstProtocolError(f"{what}: rank {rank} exceeds {MAX_RANK}")
        return self.u32_array(rank, f"{what} (rank {rank})")


def _view(data) -> memoryview:
    try:
        view = memoryview(data)
    except TypeError:
        raise BurstProtocolError(f"{type(data).__name__} is not a byte string") from None
    if view.ndim != 1 or view.itemsize != 1:
        try:
            view = view.cast("B")
        except TypeError:
            raise BurstProtocolError("the buffer is not contiguous bytes") from None
    return view


def _check_header(magic: bytes, version: int, expected: bytes) -> None:
    if magic != expected:
        raise BurstProtocolError(f"magic {magic!r} is not {expected!r}")
    if version != VERSION:
        raise BurstProtocolError(f"version {version} is not {VERSION}")


def _decode_argument(rd: _Reader, what: str, n_slots: int) -> BurstArgument:
    no_value, rank, reserved, index, offset, length = rd.take(_ARG_HEAD, what)
    if reserved:
        raise BurstProtocolError(f"{what}: reserved field is {reserved}, not 0")
    if no_value == 1:
        if (rank, index, offset, length) != (0, 0, 0, 0):
            raise BurstProtocolError(f"{what} has no value but carries a location or dimensions")
        return BurstArgument(has_no_value=True)
    if no_value != 0:
        raise BurstProtocolError(f"{what}: has_no_value is {no_value}, not 0 or 1")
    if index >= n_slots:
        raise BurstProtocolError(f"{what}: pool index {index} out of range ({n_slots} slots)")
    return BurstArgument(False, index, offset, length, rd.dims(rank, what))


def _decode_request(rd: _Reader) -> BurstRequest:
    (magic, version, flags, serial, deadline, loop_timeout, n_in, n_out, n_slots,
     layout) = rd.take(_REQ_HEAD, "request header")
    _check_header(magic, version, REQUEST_MAGIC)
    if flags & ~_REQUEST_FLAGS:
        raise BurstProtocolError(f"unknown request flags {flags:#x}")
    if layout > MAX_LAYOUTS:
        raise BurstProtocolError(f"layout {layout} exceeds {MAX_LAYOUTS}")
    _check_count(n_in, MAX_ARGUMENTS, "inputs")
    _check_count(n_out, MAX_ARGUMENTS, "outputs")
    _check_count(n_slots, MAX_SLOTS, "slots")
    if flags & _HAS_DEADLINE:
        deadline = _check_seconds(deadline, "deadline")
    elif deadline != 0.0 or math.copysign(1, deadline) < 0:
        raise BurstProtocolError("no deadline, but the deadline field is not 0.0")
    if flags & _HAS_LOOP_TIMEOUT:
        loop_timeout = _check_seconds(loop_timeout, "loop timeout")
    elif loop_timeout != 0.0 or math.copysign(1, loop_timeout) < 0:
        raise BurstProtocolError("no loop timeout, but the loop timeout field is not 0.0")
    inputs = tuple(_decode_argument(rd, f"input {k}", n_slots) for k in range(n_in))
    outputs = tuple(_decode_argument(rd, f"output {k}", n_slots) for k in range(n_out))
    slots = rd.u32_array(n_slots, f"{n_slots} slot ids")
    rd.finish("request")
    return BurstRequest(serial, inputs, outputs, slots, bool(flags & _MEASURE),
                        deadline if flags & _HAS_DEADLINE else None,
                        loop_timeout if flags & _HAS_LOOP_TIMEOUT else None, layout)


def _decode_run(rd: _Reader) -> BurstRun:
    magic, version, flags, serial, deadline, layout, pad, pad2 = rd.take(_RUN, "run frame")
    _check_header(magic, version, RUN_MAGIC)
    if flags & ~_HAS_DEADLINE:
        raise BurstProtocolError(f"unknown run flags {flags:#x}")
    if pad or pad2:
        raise BurstProtocolError("a reserved field of the run frame is not 0")
    if not 1 <= layout <= MAX_LAYOUTS:
        raise BurstProtocolError(f"layout {layout} is not 1 to {MAX_LAYOUTS}")
    if flags & _HAS_DEADLINE:
        deadline = _check_seconds(deadline, "deadline")
    elif deadline != 0.0 or math.copysign(1, deadline) < 0:
        raise BurstProtocolError("no deadline, but the deadline field is not 0.0")
    rd.finish("run frame")
    return BurstRun(serial, layout, deadline if flags & _HAS_DEADLINE else None)


def _decode_result(rd: _Reader) -> BurstResult:
    (magic, version, reserved, serial, status, n_out, n_message, on_device,
     in_driver) = rd.take(_RES_HEAD, "result header")
    _check_header(magic, version, RESULT_MAGIC)
    if reserved:
        raise BurstProtocolError(f"reserved field is {reserved}, not 0")
    try:
        status = ErrorStatus(status)
    except ValueError:
        raise BurstProtocolError(f"status {status} is not an ErrorStatus") from None
    _check_count(n_out, MAX_ARGUMENTS, "output shapes")
    _check_count(n_message, MAX_MESSAGE, "message bytes")
    shapes = []
    for k in range(n_out):
        sufficient, rank, pad = rd.take(_SHAPE_HEAD, f"output shape {k}")
        if sufficient > 1 or pad:
            raise BurstProtocolError(f"output shape {k}: malformed flags "
                                     f"({sufficient}, {pad})")
        shapes.append(BurstOutputShape(rd.dims(rank, f"output shape {k}"), bool(sufficient)))
    raw = rd.raw(n_message, "message")
    try:
        message = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise BurstProtocolError("message is not valid UTF-8") from None
    rd.finish("result")
    return BurstResult(serial, status, tuple(shapes), on_device, in_driver, message)


def decode_request(data) -> BurstRequest:
    """Parse a request; BurstProtocolError for anything else."""
    return _decode_guarded(data, _decode_request)


def decode_result(data) -> BurstResult:
    """Parse a result; BurstProtocolError for anything else."""
    return _decode_guarded(data, _decode_result)


def decode_frame(data) -> BurstRequest | BurstRun:
    """Parse what the request ring carries: a request or a run frame."""
    view = _view(data)
    if bytes(view[:4]) == RUN_MAGIC:
        return _decode_guarded(view, _decode_run)
    return _decode_guarded(view, _decode_request)


def decode(data) -> BurstRequest | BurstRun | BurstResult:
    """Parse any kind of message, told apart by its magic."""
    view = _view(data)
    if bytes(view[:4]) == RESULT_MAGIC:
        return _decode_guarded(view, _decode_result)
    return decode_frame(view)


def _decode_guarded(data, parse):
    rd = _Reader(_view(data))
    try:
        return parse(rd)
    except struct.error as e:  # a bug in the bounds checks above; still a protocol error
        raise BurstProtocolError(f"malformed at byte {rd.pos}: {e}") from None


__all__ = ["BurstArgument", "BurstOutputShape", "BurstProtocolError", "BurstRequest",
           "BurstResult", "BurstRun", "MAX_ARGUMENTS", "MAX_LAYOUTS", "MAX_MESSAGE", "MAX_RANK",
           "MAX_REQUEST_SIZE", "MAX_RESULT_SIZE", "MAX_SLOTS", "UINT64_MAX", "decode",
           "decode_frame", "decode_request", "decode_result", "encode_request", "encode_result",
           "encode_run"]
