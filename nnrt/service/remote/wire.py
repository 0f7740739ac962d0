"""The remote HAL's values, both ways: HAL values <-> the messages of
``nnrt_remote_v1.proto``. Pure functions, no I/O; the server and the client
(:mod:`.server`, :mod:`.client`) are the transports around them.

A request crosses as a layout (one :class:`Argument` per input and output:
no-value flag, dimensions, byte length) and the input bytes, one string per
input; the server gives every argument a pool of its own, so offsets and the
app's pools never cross. Outputs come back the same way, one string each.
An argument in a driver buffer (memory domains: a
:class:`~nnrt.memory.DeviceToken` pool) crosses as its token alone, with
no bytes either way: the buffer stays on the serving host.
Deadlines cross as the time left (:func:`remaining`), re-anchored on the
receiver's monotonic clock (:func:`deadline_of`): the two hosts' clocks
never need to agree.
"""
from __future__ import annotations

import math
import time

from ...errors import ErrorStatus, NnrtError, invalid
from ...hal import ExecutionResult, RequestArgument, Timing
from ...hal.types import OutputShape, check_deadline
from ...memory import DeviceToken
from ...memory.shared import pool_view
from ...model.graph import DataLocation
from ...qos.scheduler import SchedulerLoad
from . import nnrt_remote_v1_pb2 as pb

# Bytes of one message either way: a model, or a request's inputs or
# outputs. Bigger is refused by gRPC itself (RESOURCE_EXHAUSTED) before
# anything is decoded.
MAX_MESSAGE = 64 << 20
MAX_ARGUMENTS = 1 << 16     # inputs or outputs of one request
MAX_DIMENSIONS = 64         # of one argument


def remaining(deadline: float | None, now: float | None = None) -> pb.Deadline | None:
    """``deadline`` (absolute ``time.monotonic()`` seconds, or None) as the
    nanoseconds left now; INVALID_ARGUMENT for anything else (NaN)."""
    deadline = check_deadline(deadline)
    if deadline is None:
        return None
    if math.isinf(deadline):
        return None if deadline > 0 else pb.Deadline(remaining_ns=-(1 << 62))
    now = time.monotonic() if now is None else now
    return pb.Deadline(remaining_ns=int((deadline - now) * 1e9))


def deadline_of(message, now: float | None = None) -> float | None:
    """The absolute deadline, on this host's monotonic clock, of a message's
    ``deadline`` (a :class:`pb.Deadline`); None when it has none."""
    if not message.HasField("deadline"):
        return None
    now = time.monotonic() if now is None else now
    return now + message.deadline.remaining_ns / 1e9


def timeout_of(deadline: float | None, floor: float) -> float:
    """The gRPC timeout (seconds) of a call: the time to ``deadline``, but
    at least ``floor`` (a missed deadline is the server's answer to give,
    with its status, not a transport timeout)."""
    if deadline is None or not math.isfinite(deadline):
        return floor
    return max(floor, deadline - time.monotonic())


def token_of(pools, a: RequestArgument) -> int:
    """The driver buffer's token when argument ``a`` is one (its pool a
    :class:`DeviceToken`), else 0."""
    loc = a.location
    if a.has_no_value or loc is None or not 0 <= loc.pool_index < len(pools):
        return 0
    pool = pools[loc.pool_index]
    return pool.token if isinstance(pool, DeviceToken) else 0


def arguments(request, args) -> list[pb.Argument]:
    """Inputs or outputs (``RequestArgument``) of ``request`` as wire
    arguments; one in a driver buffer as its token."""
    out = []
    for a in args:
        token = token_of(request.pools, a)
        out.append(pb.Argument(has_no_value=a.has_no_value, dimensions=a.dimensions,
                               length=0 if a.has_no_value or token else a.location.length,
                               token=token))
    return out


def _region(request, a: RequestArgument, what: str) -> memoryview:
    """The bytes of a request argument's region (none for a driver
    buffer's); INVALID_ARGUMENT for a location outside the request's pools."""
    loc = a.location
    if token_of(request.pools, a):
        if loc.offset or loc.length:
            raise invalid(f"{what}: a driver buffer is used whole: offset and length must "
                          f"be 0, not {loc.offset} and {loc.length}")
        return memoryview(b"")
    if loc is None or not 0 <= loc.pool_index < len(request.pools):
        raise invalid(f"{what} is in pool {None if loc is None else loc.pool_index} of "
                      f"{len(request.pools)}")
    view = pool_view(request.pools[loc.pool_index], loc.pool_index)
    if loc.offset < 0 or loc.length < 0 or loc.offset + loc.length > len(view):
        raise invalid(f"{what}: bytes [{loc.offset}, {loc.offset + loc.length}) of pool "
                      f"{loc.pool_index}, which has {len(view)}")
    return view[loc.offset:loc.offset + loc.length]


def check_request(request) -> None:
    """INVALID_ARGUMENT unless every region of ``request`` lies in its pools."""
    for k, a in enumerate(request.inputs):
        if not a.has_no_value:
            _region(request, a, f"input {k}")
    for k, a in enumerate(request.outputs):
        if not a.has_no_value:
            _region(request, a, f"output {k}")


def input_data(request) -> list[bytes]:
    """The bytes of each input region of a HAL request (empty: no value);
    INVALID_ARGUMENT for a region outside its pools."""
    return [b"" if a.has_no_value else bytes(_region(request, a, f"input {k}"))
            for k, a in enumerate(request.inputs)]


def copy_outputs(request, data) -> None:
    """Write the reply's output bytes into the request's output regions."""
    if len(data) != len(request.outputs):
        raise NnrtError(ErrorStatus.GENERAL_FAILURE,
                        f"the remote device sent {len(data)} outputs for "
                        f"{len(request.outputs)}")
    for k, (a, blob) in enumerate(zip(request.outputs, data)):
        if a.has_no_value or token_of(request.pools, a):
            continue
        if len(blob) != a.location.length:
            raise NnrtError(ErrorStatus.GENERAL_FAILURE,
                            f"the remote device sent {len(blob)} bytes for output {k} of "
                            f"{a.location.length}")
        _region(request, a, f"output {k}")[:] = blob


def layout(inputs, outputs) -> tuple[tuple[RequestArgument, ...], tuple[RequestArgument, ...],
                                     list[bytearray]]:
    """The server's side of a layout: each argument in a pool of its own
    (inputs first), and those pools, outputs zeroed; an argument naming a
    driver buffer gets a :class:`DeviceToken` pool (whose token the server
    checks is its caller's). INVALID_ARGUMENT for a layout out of bounds."""
    if len(inputs) > MAX_ARGUMENTS or len(outputs) > MAX_ARGUMENTS:
        raise invalid(f"{len(inputs)} inputs and {len(outputs)} outputs: at most "
                      f"{MAX_ARGUMENTS} each")
    total = sum(a.length for a in inputs) + sum(a.length for a in outputs)
    if total > MAX_MESSAGE:
        raise invalid(f"the request's regions hold {total} bytes, more than {MAX_MESSAGE}")
    pools: list[bytearray] = []

    def one(a: pb.Argument, what: str) -> RequestArgument:
        if len(a.dimensions) > MAX_DIMENSIONS:
            raise invalid(f"{what}: {len(a.dimensions)} dimensions")
        if a.has_no_value:
            if a.length:
                raise invalid(f"{what} has no value but {a.length} bytes")
            return RequestArgument(has_no_value=True)
        if a.token:
            if a.length:
                raise invalid(f"{what} is driver buffer {a.token} but has {a.length} bytes")
            pools.append(DeviceToken(a.token))
            return RequestArgument(False, DataLocation(len(pools) - 1, 0, 0),
                                   tuple(a.dimensions))
        pools.append(bytearray(a.length))
        return RequestArgument(False, DataLocation(len(pools) - 1, 0, a.length),
                               tuple(a.dimensions))

    ins = tuple(one(a, f"input {k}") for k, a in enumerate(inputs))
    outs = tuple(one(a, f"output {k}") for k, a in enumerate(outputs))
    return ins, outs, pools


def fill_inputs(inputs: tuple[RequestArgument, ...], pools, data) -> None:
    """Copy each input's bytes into its pool; INVALID_ARGUMENT when the
    bytes do not fit the layout."""
    if len(data) != len(inputs):
        raise invalid(f"{len(data)} input byte strings for {len(inputs)} inputs")
    for k, (a, blob) in enumerate(zip(inputs, data)):
        length = 0 if a.has_no_value else a.location.length
        if len(blob) != length:
            raise invalid(f"input {k}: {len(blob)} bytes for a region of {length}")
        if length:
            pools[a.location.pool_index][:] = blob


def outputs_of(outputs: tuple[RequestArgument, ...], pools) -> list[bytes]:
    """The bytes of each output's pool (none for a driver buffer's)."""
    return [b"" if a.has_no_value or token_of(pools, a) else bytes(pools[a.location.pool_index])
            for a in outputs]


def pool_bytes(pools) -> int:
    """The bytes of a layout's pools (a driver buffer's are counted as the buffer's)."""
    return sum(0 if isinstance(pool, DeviceToken) else len(pool) for pool in pools)


def reply_of(result: ExecutionResult, data=(), *, reply: pb.ExecutionReply | None = None,
             load=None) -> pb.ExecutionReply:
    """``result`` (and the output bytes ``data``) written into ``reply``, a
    field of the message that carries it (a new one when None); ``load`` (a
    ``SchedulerLoad``, or None) travels with it. In place: handing a
    finished message to a parent's constructor or to a repeated field's
    ``append`` copies it, which for megabytes of outputs costs more than the
    round trip (upb: ~1 ms for 150 KB), where setting a bytes field copies
    the bytes once."""
    if reply is None:
        reply = pb.ExecutionReply()
    reply.status = int(result.status)
    reply.message = result.message
    for s in result.output_shapes:
        reply.output_shapes.add(dimensions=s.dimensions, is_sufficient=s.is_sufficient)
    reply.on_device_us = result.timing.on_device
    reply.in_driver_us = result.timing.in_driver
    if result.status == ErrorStatus.NONE:
        reply.output_data.extend(data)
    if load is not None:
        service = load.service_time
        reply.load.queued = min(load.queued, _U32)
        reply.load.running = min(load.running, _U32)
        reply.load.slots = min(load.slots, _U32)
        reply.load.service_us = 0 if service is None else max(1, round(service * 1e6))
    return reply


_U32 = (1 << 32) - 1


def load_of(reply: pb.ExecutionReply) -> SchedulerLoad | None:
    """The load a reply carries, or None when it carries none (or one of
    0 slots, which means nothing)."""
    if not reply.HasField("load") or reply.load.slots == 0:
        return None
    load = reply.load
    return SchedulerLoad(load.queued, load.running, load.slots,
                         load.service_us / 1e6 if load.service_us else None)


def result_of(reply: pb.ExecutionReply) -> ExecutionResult:
    try:
        status = ErrorStatus(reply.status)
    except ValueError:
        return ExecutionResult(ErrorStatus.GENERAL_FAILURE,
                               message=f"the remote device answered status {reply.status}")
    return ExecutionResult(status, tuple(OutputShape(tuple(s.dimensions), s.is_sufficient)
                                         for s in reply.output_shapes),
                           Timing(reply.on_device_us, reply.in_driver_us), reply.message)


def loop_timeout_of(value: float) -> float | None:
    """A wire loop timeout (0: the default) as the HAL's argument."""
    if not math.isfinite(value) or value < 0:
        raise invalid(f"loop timeout {value!r} is not a number of seconds")
    return value or None
