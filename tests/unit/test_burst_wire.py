"""Burst wire format: round trips, bounds, and clear errors for bad messages."""
import math
import struct

import pytest

from nnrt.burst import wire
from nnrt.burst.wire import (BurstArgument, BurstOutputShape, BurstProtocolError, BurstRequest,
                             BurstResult, decode, decode_request, decode_result, encode_request,
                             encode_result)
from nnrt.errors import ErrorStatus, NnrtError


def request(**kw):
    base = dict(serial=41,
                inputs=(BurstArgument(False, 0, 0, 16, (1, 4)), BurstArgument(has_no_value=True)),
                outputs=(BurstArgument(False, 1, 64, 16, (1, 4)),),
                slots=(7, 3), measure_timing=True, deadline=1234.5, loop_timeout=2.0)
    base.update(kw)
    return BurstRequest(**base)


RESULT = BurstResult(41, ErrorStatus.OUTPUT_INSUFFICIENT_SIZE,
                     (BurstOutputShape((1, 8), False), BurstOutputShape((), True)),
                     on_device=12, in_driver=30, message="output 0 needs 32 bytes")


def test_request_round_trip_and_canonical_bytes():
    for r in (request(), request(deadline=None, loop_timeout=None, measure_timing=False),
              request(inputs=(), outputs=(), slots=()), request(serial=2**64 - 1)):
        data = encode_request(r)
        assert decode_request(data) == r
        assert decode(data) == r
        assert encode_request(decode_request(data)) == data


def test_result_round_trip():
    data = encode_result(RESULT)
    assert decode_result(data) == RESULT == decode(data)
    none = BurstResult(1, ErrorStatus.NONE)
    assert decode(encode_result(none)) == none
    assert none.on_device == none.in_driver == wire.UINT64_MAX


def test_protocol_error_is_an_invalid_argument_nnrt_error():
    with pytest.raises(NnrtError) as info:
        decode(b"junk")
    assert isinstance(info.value, BurstProtocolError)
    assert info.value.status == ErrorStatus.INVALID_ARGUMENT


def test_kinds_are_not_confused():
    with pytest.raises(BurstProtocolError, match="magic"):
        decode_request(encode_result(RESULT))
    with pytest.raises(BurstProtocolError, match="magic"):
        decode_result(encode_request(request()))


@pytest.mark.parametrize("data", [b"", b"NB", b"NBRQ", None, "NBRQ", 42, [1, 2]])
def test_non_messages_raise_the_protocol_error(data):
    with pytest.raises(BurstProtocolError):
        decode(data)


def test_bounds_are_checked_before_allocating():
    head = struct.pack("<4sHHQddHHHH", b"NBRQ", wire.VERSION, 0, 1, 0.0, 0.0, 65535, 0, 0, 0)
    with pytest.raises(BurstProtocolError, match="limit of 1024"):
        decode(head)
    arg = struct.pack("<BBHIQQ", 0, 200, 0, 0, 0, 0)
    one = struct.pack("<4sHHQddHHHH", b"NBRQ", wire.VERSION, 0, 1, 0.0, 0.0, 1, 0, 1, 0)
    with pytest.raises(BurstProtocolError, match="rank 200 exceeds 16"):
        decode(one + arg)
    res = struct.pack("<4sHHQIHHQQ", b"NBRS", wire.VERSION, 0, 1, 0, 0, 5000, 0, 0)
    with pytest.raises(BurstProtocolError, match="message bytes"):
        decode(res)


def test_field_checks_on_decode():
    good = bytearray(encode_request(request()))
    bad_version = bytearray(good); bad_version[4] = 9
    with pytest.raises(BurstProtocolError, match="version 9"):
        decode(bytes(bad_version))
    bad_flags = bytearray(good); bad_flags[6] = 0x80
    with pytest.raises(BurstProtocolError, match="flags"):
        decode(bytes(bad_flags))
    nan_deadline = bytearray(good); struct.pack_into("<d", nan_deadline, 16, math.nan)
    with pytest.raises(BurstProtocolError, match="deadline"):
        decode(bytes(nan_deadline))
    status = bytearray(encode_result(RESULT)); struct.pack_into("<I", status, 16, 77)
    with pytest.raises(BurstProtocolError, match="status 77"):
        decode(bytes(status))
    # pool index beyond the slot list
    r = encode_request(request(slots=(5,), outputs=()))
    with pytest.raises(BurstProtocolError, match="trailing|pool index"):
        decode(r.replace(struct.pack("<I", 5), struct.pack("<I", 5) * 2))


def test_encode_refuses_out_of_range_fields():
    with pytest.raises(BurstProtocolError, match="pool index 2 out of range"):
        encode_request(request(outputs=(BurstArgument(False, 2, 0, 4, (1,)),)))
    with pytest.raises(BurstProtocolError, match="deadline"):
        encode_request(request(deadline=math.inf))
    with pytest.raises(BurstProtocolError, match="serial"):
        encode_request(request(serial=-1))
    with pytest.raises(BurstProtocolError, match="rank 17"):
        encode_request(request(outputs=(BurstArgument(False, 0, 0, 4, (1,) * 17),)))
    with pytest.raises(BurstProtocolError, match="no value"):
        encode_request(request(inputs=(BurstArgument(True, 0, 0, 4),)))
    with pytest.raises(BurstProtocolError, match="ErrorStatus"):
        encode_result(BurstResult(1, 12345))
    with pytest.raises(BurstProtocolError, match="message"):
        encode_result(BurstResult(1, ErrorStatus.NONE, message="x" * 2000))


def test_largest_messages_fit_their_declared_maximum():
    dims = (2**32 - 1,) * wire.MAX_RANK
    arg = BurstArgument(False, 0, 2**64 - 1, 2**64 - 1, dims)
    big = BurstRequest(1, (arg,) * wire.MAX_ARGUMENTS, (arg,) * wire.MAX_ARGUMENTS,
                       tuple(range(wire.MAX_SLOTS)), True, 1.0, 1.0)
    data = encode_request(big)
    assert len(data) == wire.MAX_REQUEST_SIZE
    assert decode(data) == big
    res = BurstResult(1, ErrorStatus.NONE, (BurstOutputShape(dims),) * wire.MAX_ARGUMENTS,
                      message="m" * wire.MAX_MESSAGE)
    assert len(encode_result(res)) == wire.MAX_RESULT_SIZE
