"""Hypothesis over the driver-service decoders: any bytes either decode or
raise the protocol error (an NnrtError with INVALID_ARGUMENT), never
anything else — whole messages, cut at every byte, with trailing garbage,
with bytes flipped."""
import struct

from hypothesis import given, settings, strategies as st

import nnrt
from nnrt import ErrorStatus, OperandType as T, OperationType as Op, Priority
from nnrt.hal import ExecutionPreference, ExecutionResult, OutputShape, RequestArgument
from nnrt.drivers.service import protocol as p
from nnrt.model.graph import DataLocation


def _model():
    m = nnrt.Model()
    a = m.add_operand(T.TENSOR_FLOAT32, [2, 2])
    b = m.add_operand(T.TENSOR_FLOAT32, [2, 2])
    w = m.add_operand(T.TENSOR_FLOAT32, [2, 2])
    m.set_operand_value(w, [[1.0] * 2] * 2)
    act = m.add_operand(T.INT32)
    m.set_operand_value(act, 0)
    t = m.add_operand(T.TENSOR_FLOAT32, [2, 2])
    out = m.add_operand(T.TENSOR_FLOAT32, [2, 2])
    m.add_operation(Op.ADD, [a, b, act], [t])
    m.add_operation(Op.MUL, [t, w, act], [out])
    m.identify_inputs_and_outputs([a, b], [out])
    hal = m.finish().hal_model
    return hal.__class__(hal.main, (), hal.operand_values,
                         (p.WirePool(0, 3, False, 0, 4096, 0, 16),))


ARG = RequestArgument(False, DataLocation(0, 0, 16), (2, 2))
MESSAGES = [
    p.Hello(1),
    p.Query(2, p.Method.CAPABILITIES),
    p.SupportedOperations(3, _model()),
    p.PrepareModel(4, _model(), ExecutionPreference.FAST_SINGLE_ANSWER, Priority.MEDIUM, 1.5),
    p.Execute(5, 7, (ARG, ARG), (ARG,), (p.WirePool(1, 4, True, 0, 4096, 0, 64),), (9,), True,
              None, 2.0),
    p.ReleaseModel(6, 7),
    p.Reply(5, p.Method.EXECUTE, ErrorStatus.NONE, "",
            ExecutionResult(ErrorStatus.NONE, (OutputShape((2, 2)),))),
    p.Reply(4, p.Method.PREPARE_MODEL, value=12),
]
FRAMES = [p.encode(m) for m in MESSAGES]


def _decode_or_protocol_error(body: bytes, fds) -> None:
    try:
        p.decode_body(body, fds)
    except p.ProtocolError as e:
        assert e.status == ErrorStatus.INVALID_ARGUMENT


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=300), st.lists(st.integers(0, 100), max_size=3))
def test_random_bodies_decode_or_raise_the_protocol_error(body, fds):
    _decode_or_protocol_error(body, fds)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(range(len(FRAMES))), st.data())
def test_every_cut_and_trailing_garbage(index, data):
    frame, fds = FRAMES[index]
    body = frame[p.FRAME_HEADER_SIZE:]
    cut = data.draw(st.integers(0, len(body)))
    garbage = data.draw(st.binary(max_size=16))
    _decode_or_protocol_error(body[:cut], fds)
    _decode_or_protocol_error(body + garbage, fds)


@settings(max_examples=500, deadline=None)
@given(st.sampled_from(range(len(FRAMES))), st.data())
def test_mutated_bodies_decode_or_raise_the_protocol_error(index, data):
    frame, fds = FRAMES[index]
    body = bytearray(frame[p.FRAME_HEADER_SIZE:])
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(body) - 1))
        body[pos] = data.draw(st.integers(0, 255))
    _decode_or_protocol_error(bytes(body), fds)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=8))
def test_connection_fed_random_chunks_yields_events_or_the_protocol_error(chunks):
    conn = p.Connection("server")
    try:
        for chunk in chunks:
            conn.receive_data(chunk or b"\0")
            while (event := conn.next_event()) is not None:
                assert isinstance(event, (p.Malformed, *p.Call.__args__))
    except p.ProtocolError as e:
        assert e.status == ErrorStatus.INVALID_ARGUMENT
        assert conn.state is p.State.CLOSED


def test_every_cut_of_every_frame_exhaustively():
    for frame, fds in FRAMES:
        body = frame[p.FRAME_HEADER_SIZE:]
        for cut in range(len(body)):
            _decode_or_protocol_error(body[:cut], fds)
            _decode_or_protocol_error(body[:cut] + struct.pack("<I", 0xFFFFFFFF), fds)
