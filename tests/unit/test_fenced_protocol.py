"""The fenced-execution message of the driver-service protocol
(EXECUTE_FENCED and its FencedInfo reply): round trips, fds beside the frame, and
hypothesis over cut, padded and mutated bodies ("decode or raise the
protocol error, never anything else")."""
import math
import struct

import pytest
from hypothesis import given, settings, strategies as st

from nnrt.hal import ExecutionResult, OutputShape, RequestArgument, Timing
from nnrt.service import protocol as p
from nnrt.errors import ErrorStatus
from nnrt.model.graph import DataLocation

ARG = RequestArgument(False, DataLocation(0, 0, 32), (1, 8))
POOLS = (p.WirePool(3, 9, False, 0, 4096, 0, 32), p.WirePool(4, None, True, 0, 4096, 32, 32))
INFO = p.FencedInfo(ExecutionResult(ErrorStatus.NONE, (OutputShape((1, 8)),), Timing(5, 9)),
                    Timing(5, 40), Timing(5, 20))
FAILED = p.FencedInfo(ExecutionResult(ErrorStatus.DEVICE_UNAVAILABLE, (), Timing(),
                                      "an input fence was signaled with error"),
                      Timing(), Timing())
MESSAGES = [
    p.ExecuteFenced(1, 7, (ARG,), (ARG,), POOLS, (2,), True, 100.0, 2.0, (11, 12), 0.5, 13),
    p.ExecuteFenced(2, 7, (ARG, RequestArgument(True)), (ARG,), POOLS, fence=14),
    p.Reply(3, p.Method.EXECUTE_FENCED, ErrorStatus.NONE, "", INFO),
    p.Reply(3, p.Method.EXECUTE_FENCED, FAILED.result.status, FAILED.result.message, FAILED),
]
FRAMES = [p.encode(m) for m in MESSAGES]


def body(frame: bytes) -> bytes:
    return frame[p.FRAME_HEADER_SIZE:]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_fenced_messages_round_trip(message):
    frame, fds = p.encode(message)
    assert p.decode_body(body(frame), fds) == message


def test_fence_fds_travel_after_the_pool_fds():
    # pool fd, the wait_for fences in order, then the result fence
    assert FRAMES[0][1] == [9, 11, 12, 13]
    assert FRAMES[1][1] == [9, 14]
    assert FRAMES[2][1] == []  # the reply carries no fd


def test_a_fenced_call_needs_its_result_fence():
    with pytest.raises(TypeError):
        p.encode(p.ExecuteFenced(1, 7, (), (), ()))


def test_a_fenced_call_missing_its_fence_fds_is_refused():
    frame, fds = FRAMES[0]
    with pytest.raises(p.ProtocolError, match="wait_for fence"):
        p.decode_body(body(frame), fds[:1])
    with pytest.raises(p.ProtocolError, match="result fence"):
        p.decode_body(body(frame), fds[:3])


def test_negative_or_non_finite_timeout_after_fence_is_refused():
    for bad in (-1.0, math.inf):
        frame, fds = p.encode(p.ExecuteFenced(1, 7, (), (), (), timeout_after_fence=bad,
                                              fence=3))
        with pytest.raises(p.ProtocolError, match="timeout after fence"):
            p.decode_body(body(frame), fds)


def test_a_fenced_reply_always_carries_its_info():
    raw = struct.pack("<BBQIIB", p.Kind.REPLY, p.Method.EXECUTE_FENCED, 1,
                      ErrorStatus.GENERAL_FAILURE, 0, 0)
    with pytest.raises(p.ProtocolError, match="lacks a value"):
        p.decode_body(raw)


def _decode_or_protocol_error(raw: bytes, fds) -> None:
    try:
        p.decode_body(raw, fds)
    except p.ProtocolError as e:
        assert e.status == ErrorStatus.INVALID_ARGUMENT


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(range(len(FRAMES))), st.data())
def test_cut_padded_and_mutated_fenced_messages_decode_or_raise(index, data):
    frame, fds = FRAMES[index]
    raw = bytearray(body(frame))
    cut = data.draw(st.integers(0, len(raw)))
    _decode_or_protocol_error(bytes(raw[:cut]), fds)
    _decode_or_protocol_error(bytes(raw) + data.draw(st.binary(max_size=16)), fds)
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    _decode_or_protocol_error(bytes(raw), data.draw(st.lists(st.integers(0, 50), max_size=4)))
