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
               f64 loop_timeout u16 n_inputs u16 n_outputs u16 n_slots u16 0
               argument * (n_inputs + n_outputs)  u32 slot * n_slots
    argument = u8 has_no_value u8 rank u16 0 u32 pool_index u64 offset
               u64 length u32 dimension * rank
    result   = "NBRS" u16 version u16 0 u64 serial u32 status
               u16 n_outputs u16 message_length u64 on_device u64 in_driver
               shape * n_outputs  message (UTF-8)
    shape    = u8 is_sufficient u8 rank u16 0 u32 dimension * rank

Request ``flags``: bit 0 measure timing, bit 1 a deadline is present, bit 2 a
loop timeout is present; an absent value is encoded as 0.0. An argument's
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

VERSION = 1
REQUEST_MAGIC = b"NBRQ"
RESULT_MAGIC = b"NBRS"
UINT64_MAX = 2**64 - 1
MAX_ARGUMENTS = 1024      # per direction (inputs, outputs)
MAX_SLOTS = 1024
MAX_RANK = 16
MAX_MESSAGE = 1024        # bytes of UTF-8 in a result's message

_MEASURE, _HAS_DEADLINE, _HAS_LOOP_TIMEOUT = 1, 2, 4
_REQUEST_FLAGS = _MEASURE | _HAS_DEADLINE | _HAS_LOOP_TIMEOUT

_REQ_HEAD = struct.Struct("<4sHHQddHHHH")
_ARG_HEAD = struct.Struct("<BBHIQQ")
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
    w = Writer(_REQ_HEAD.pack(REQUEST_MAGIC, VERSION, flags,
                              _check_uint(request.serial, 64, "serial"), deadline,
                              loop_timeout, len(inputs), len(outputs), len(slots), 0))
    for kind, args in (("input", inputs), ("output", outputs)):
        for k, arg in enumerate(args):
            _encode_argument(w, arg, f"{kind} {k}", len(slots))
    for k, slot in enumerate(slots):
        w.u32(_check_uint(slot, 32, f"slot {k}"))
    return w.value()


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
     reserved) = rd.take(_REQ_HEAD, "request header")
    _check_header(magic, version, REQUEST_MAGIC)
    if flags & ~_REQUEST_FLAGS:
        raise BurstProtocolError(f"unknown request flags {flags:#x}")
    if reserved:
        raise BurstProtocolError(f"reserved field is {reserved}, not 0")
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
                        loop_timeout if flags & _HAS_LOOP_TIMEOUT else None)


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


def decode(data) -> BurstRequest | BurstResult:
    """Parse either kind of message, told apart by its magic."""
    view = _view(data)
    if bytes(view[:4]) == RESULT_MAGIC:
        return _decode_guarded(view, _decode_result)
    return _decode_guarded(view, _decode_request)


def _decode_guarded(data, parse):
    rd = _Reader(_view(data))
    try:
        return parse(rd)
    except struct.error as e:  # a bug in the bounds checks above; still a protocol error
        raise BurstProtocolError(f"malformed at byte {rd.pos}: {e}") from None


# ------------------------------------------------------------------ caches
#
# A burst sends the same request layout frame after frame: only the serial
# and the deadline change (and the same result, but for its serial and
# timings). These caches keep encode/decode of the rest off the per-frame
# path. They give what encode_*/decode_* give (the same bytes, the same
# message); on a hit only the fields that vary are checked again, the rest
# being equal to a message already checked.

_SERIAL_DEADLINE = struct.Struct("<Qd")   # at offset 8 of a request
_VARYING = slice(8, 24)
# A result's serial (offset 8) and timings (offsets 24 and 32) change from
# frame to frame; its status, shapes and message, the rest, seldom do.
_RES_SERIAL = struct.Struct("<Q")
_RES_TIMES = struct.Struct("<QQ")
_RES_VARYING = struct.Struct("<Q8xQQ")    # serial, (8 bytes), timings: at offset 8 (unpack
                                          # only: packing it would zero the 8 bytes)
_ZERO8 = bytes(8)                         # a deadline of +0.0, the "absent" encoding


def _u64(value, what: str) -> int:
    """``_check_uint(value, 64, what)``, an int in range checked first (per frame)."""
    if value.__class__ is int and 0 <= value <= UINT64_MAX:
        return value
    return _check_uint(value, 64, what)


class _Cache:
    """A bounded dict of encodings or messages, the oldest dropped first."""

    __slots__ = ("_size", "_entries")

    def __init__(self, size: int):
        self._size = size
        self._entries: dict = {}

    def get(self, key):
        return self._entries.get(key)

    def put(self, key, value):
        if len(self._entries) >= self._size:
            self._entries.pop(next(iter(self._entries)))
        self._entries[key] = value
        return value


class RequestEncoder:
    """``encode_request`` with a cache of the encoding of each layout. The
    last layout is also recognised by the identity of its argument tuples
    (the burst controller hands the same ones over while the layout holds),
    without hashing every argument again."""

    def __init__(self, size: int = 16):
        self._cache = _Cache(size)
        # (key, the last frame's bytes: its template with serial and deadline
        # written in) of the last encoding.
        self._last: tuple | None = None

    def encode(self, request: BurstRequest) -> bytes:
        if not isinstance(request, BurstRequest):
            raise BurstProtocolError(f"{type(request).__name__} is not a BurstRequest")
        return bytes(self.encode_fields(request.serial, request.inputs, request.outputs,
                                        request.slots, request.measure_timing,
                                        request.deadline, request.loop_timeout))

    def encode_fields(self, serial, inputs, outputs, slots, measure_timing=False,
                      deadline=None, loop_timeout=None) -> bytes | bytearray:
        """``encode`` of the request these fields make, without making it.
        The bytes may be a buffer this encoder writes again at its next call:
        use them (write them to the ring) before that."""
        measure_timing = bool(measure_timing)
        last = self._last
        if last is not None and last[0][0] is inputs and last[0][1] is outputs \
                and last[0][2:] == (slots, measure_timing, deadline is None, loop_timeout):
            buf = last[1]
        else:
            request = BurstRequest(serial, inputs, outputs, slots, measure_timing, deadline,
                                   loop_timeout)
            key = (inputs, outputs, slots, measure_timing, deadline is None, loop_timeout)
            try:
                template = self._cache.get(key)
            except TypeError:      # an unhashable field (a list): no caching
                return encode_request(request)
            if template is None:
                template = self._cache.put(key, encode_request(request))
                self._last = (key, bytearray(template))
                return template
            self._last = (key, buf := bytearray(template))
        _SERIAL_DEADLINE.pack_into(
            buf, 8, _u64(serial, "serial"),
            0.0 if deadline is None else _check_seconds(deadline, "deadline"))
        return buf


class ResultEncoder:
    """``encode_result`` with a cache of the encoding of each (status,
    output shapes, message): a hit checks and writes the serial and the
    two timings only."""

    def __init__(self, size: int = 16):
        self._cache = _Cache(size)
        # (status, output shapes, message, the last frame's bytes) of the
        # last encoding: a result with that very shapes tuple (a burst
        # server hands the same one back while shapes hold) is found
        # without hashing it.
        self._last: tuple | None = None

    def encode(self, result: BurstResult) -> bytes:
        if not isinstance(result, BurstResult):
            raise BurstProtocolError(f"{type(result).__name__} is not a BurstResult")
        return bytes(self.encode_fields(result.serial, result.status, result.output_shapes,
                                        result.on_device, result.in_driver, result.message))

    def encode_fields(self, serial, status, output_shapes=(), on_device=UINT64_MAX,
                      in_driver=UINT64_MAX, message="") -> bytes | bytearray:
        """``encode`` of the result these fields make, without making it.
        The bytes may be a buffer this encoder writes again at its next call:
        use them (write them to the ring) before that."""
        last = self._last
        if last is not None and last[1] is output_shapes and last[0] is status \
                and last[2] == message:
            buf = last[3]
        else:
            result = BurstResult(serial, status, output_shapes, on_device, in_driver, message)
            try:
                key = (status, output_shapes, message)
                template = self._cache.get(key)
            except TypeError:      # an unhashable field (a list): no caching
                return encode_result(result)
            if template is None:
                template = self._cache.put(key, encode_result(result))
                self._last = (*key, bytearray(template))
                return template
            self._last = (*key, buf := bytearray(template))
        _RES_SERIAL.pack_into(buf, 8, _u64(serial, "serial"))
        _RES_TIMES.pack_into(buf, 24, _u64(on_device, "on_device time"),
                             _u64(in_driver, "in_driver time"))
        return buf


class _CachedDecoder:
    """Decoding with a cache keyed by every byte of a message but those of
    the fields that vary: a hit re-checks those fields only (the rest of the
    bytes are those of a message that decoded)."""

    _HEAD: struct.Struct
    _FIXED: tuple      # (start, end) of the bytes that are the key (end None: to the end)

    def __init__(self, size: int = 16):
        self._cache = _Cache(size)
        # (size, ((start, bytes), ...) of the key's pieces, message) of the
        # last frame: a frame of the same kind is recognised by comparing
        # those pieces in place (bytes.startswith at an offset: no slice,
        # no key built and hashed), which is what comparing keys does.
        self._last: tuple | None = None

    def decode(self, data):
        message, raw = self._cached(data)
        return message if raw is None else self._from_hit(message, raw)

    def _cached(self, data):
        """(the message of this frame's kind, the frame's bytes); (the
        message decoded from this very frame, None) on a miss."""
        if data.__class__ is bytes and len(data) >= self._HEAD.size:
            raw = data     # what the ring hands over: no view, no second copy
            last = self._last
            if last is not None and len(raw) == last[0]:
                for start, piece in last[1]:
                    if not raw.startswith(piece, start):
                        break
                else:
                    return last[2], raw
        else:
            view = _view(data)
            if len(view) < self._HEAD.size:
                return self._decode(view), None
            raw = bytes(view)
        key = self._key(raw)
        hit = self._cache.get(key)
        if hit is None:
            message = self._cache.put(key, self._decode(raw))
            self._last = (len(raw), tuple((a, raw[a:b]) for a, b in self._FIXED), message)
            return message, None
        self._last = (len(raw), tuple((a, raw[a:b]) for a, b in self._FIXED), hit)
        return hit, raw


class RequestDecoder(_CachedDecoder):
    """``decode_request`` with a cache keyed by everything but the serial and
    the deadline."""

    _HEAD = _REQ_HEAD
    _FIXED = ((0, _VARYING.start), (_VARYING.stop, None))
    _decode = staticmethod(decode_request)
    _key = staticmethod(lambda raw: raw[:_VARYING.start] + raw[_VARYING.stop:])

    @staticmethod
    def _varying(hit: BurstRequest, raw: bytes) -> tuple[int, float | None]:
        if hit.deadline is None:
            # Absent: the field must be +0.0, i.e. eight zero bytes.
            if not raw.startswith(_ZERO8, 16):
                raise BurstProtocolError("no deadline, but the deadline field is not 0.0")
            return _RES_SERIAL.unpack_from(raw, 8)[0], None
        serial, deadline = _SERIAL_DEADLINE.unpack_from(raw, 8)
        return serial, _check_seconds(deadline, "deadline")

    @classmethod
    def _from_hit(cls, hit: BurstRequest, raw: bytes) -> BurstRequest:
        serial, deadline = cls._varying(hit, raw)
        return BurstRequest(serial, hit.inputs, hit.outputs, hit.slots, hit.measure_timing,
                            deadline, hit.loop_timeout)

    def decode_parts(self, data) -> tuple[BurstRequest, int, float | None]:
        """``decode`` without making the message: (the request of this
        frame's layout -- one object for all its frames while cached, its
        serial and deadline those of the first --, this frame's serial, this
        frame's deadline). What varies is checked as ``decode`` checks it."""
        request, raw = self._cached(data)
        if raw is None:
            return request, request.serial, request.deadline
        return (request, *self._varying(request, raw))


class ResultDecoder(_CachedDecoder):
    """``decode_result`` with a cache keyed by everything but the serial and
    the timings (any u64 is a valid value of those three)."""

    _HEAD = _RES_HEAD
    _FIXED = ((0, 8), (16, 24), (40, None))
    _decode = staticmethod(decode_result)
    _key = staticmethod(lambda raw: raw[:8] + raw[16:24] + raw[40:])

    @staticmethod
    def _from_hit(hit: BurstResult, raw: bytes) -> BurstResult:
        serial, = _RES_SERIAL.unpack_from(raw, 8)
        on_device, in_driver = _RES_TIMES.unpack_from(raw, 24)
        return BurstResult(serial, hit.status, hit.output_shapes, on_device, in_driver,
                           hit.message)

    def decode_parts(self, data) -> tuple[BurstResult, int, int, int]:
        """``decode`` without making the message: (the result of this
        frame's kind -- one object for all such frames while cached, its
        serial and timings those of the first --, this frame's serial,
        on_device and in_driver)."""
        result, raw = self._cached(data)
        if raw is None:
            return result, result.serial, result.on_device, result.in_driver
        return (result, *_RES_VARYING.unpack_from(raw, 8))


__all__ = ["BurstArgument", "BurstOutputShape", "BurstProtocolError", "BurstRequest",
           "BurstResult", "MAX_ARGUMENTS", "MAX_MESSAGE", "MAX_RANK", "MAX_REQUEST_SIZE",
           "MAX_RESULT_SIZE", "MAX_SLOTS", "RequestDecoder", "RequestEncoder", "ResultDecoder",
           "ResultEncoder", "UINT64_MAX",
           "decode", "decode_request",
           "decode_result", "encode_request", "encode_result"]
