"""Hypothesis over the driver-service decoders: any bytes either decode or
raise the protocol error (an NnrtError with INVALID_ARGUMENT), never
anything else — whole messages, cut at every byte, with trailing garbage,
with bytes flipped."""
import struct

from hypothesis import given, settings, strategies as st

import nnrt
from nnrt import ErrorStatus, OperandType as T, OperationType as Op, Priority
from nnrt.hal import (BufferRole, Capabilities, DeviceType, ExecutionPreference, ExecutionResult,
                      OutputShape, PerformanceInfo, RequestArgument, Timing)
from nnrt.service import protocol as p
from nnrt.qos.scheduler import ClassStatistics, JobRecord, SchedulerStatistics
from nnrt.hal.cache import CacheReject
from nnrt.model.extensions import Extension, ExtensionOperandTypeInfo
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


def _extension_model():
    """Two extensions, an extension tensor constant and extension data."""
    from tests.unit.test_extensions import example_model
    return example_model().hal_model


ARG = RequestArgument(False, DataLocation(0, 0, 16), (2, 2))
POOL = p.WirePool(1, 4, True, 0, 4096, 0, 64)
PERF = PerformanceInfo(1.0, 2.0)
STATISTICS = p.StatisticsValue(
    SchedulerStatistics(1, 1, (ClassStatistics(
        ("uid", 1000), Priority.HIGH, 1, 0, 3, 1, 0, 0, 0, 0.002, None, 0.5),)),
    (JobRecord(("pid", 7), Priority.LOW, None, 4, 1.0, 1.5, 2.0, 0.5, 0, 0.25,
               ErrorStatus.NONE, "ok"),))
# A call (where the method has one) and a reply of every method of the codec
# table: test_every_codec_is_fuzzed keeps this list complete.
MESSAGES = [
    p.Hello(1),
    p.Reply(1, p.Method.HELLO, value=p.DeviceInfo("dev", DeviceType.CPU, "1.0", 30)),
    p.Query(2, p.Method.CAPABILITIES),
    p.Reply(2, p.Method.CAPABILITIES,
            value=Capabilities(PERF, PERF, {T.TENSOR_FLOAT32: PERF}, PERF, PERF)),
    p.Query(3, p.Method.SUPPORTED_EXTENSIONS),
    p.Reply(3, p.Method.SUPPORTED_EXTENSIONS, value=[
        Extension("com.example.ext", (ExtensionOperandTypeInfo(1, False, 4),), ((0, "OP"),))]),
    p.Query(4, p.Method.NUMBER_OF_CACHE_FILES),
    p.Reply(4, p.Method.NUMBER_OF_CACHE_FILES, value=(1, 2)),
    p.Query(5, p.Method.STATISTICS),
    p.Reply(5, p.Method.STATISTICS, value=STATISTICS),
    p.SupportedOperations(3, _model()),
    p.SupportedOperations(3, _extension_model()),
    p.Reply(3, p.Method.SUPPORTED_OPERATIONS, value=[True, False]),
    p.PrepareModel(4, _model(), ExecutionPreference.FAST_SINGLE_ANSWER, Priority.MEDIUM, 1.5),
    p.Reply(4, p.Method.PREPARE_MODEL, value=12),
    p.Execute(5, 7, (ARG, ARG), (ARG,), (POOL,), (9,), True, None, 2.0),
    p.Reply(5, p.Method.EXECUTE, ErrorStatus.NONE, "",
            ExecutionResult(ErrorStatus.NONE, (OutputShape((2, 2)),))),
    p.ExecuteFenced(6, 7, (ARG,), (ARG,), (POOL,), (), False, 3.0, None, (5, 6), 0.5, 8),
    p.Reply(6, p.Method.EXECUTE_FENCED, value=p.FencedInfo(
        ExecutionResult(ErrorStatus.NONE, (OutputShape((2, 2)),), Timing(1, 2)),
        Timing(3, 4), Timing(5, 6))),
    p.ReleaseModel(7, 7),
    p.Reply(7, p.Method.RELEASE_MODEL),
    p.ConfigureBurst(8, 7, (3, 4, 5, 6, 7, 8)),
    p.Reply(8, p.Method.CONFIGURE_BURST, value=2),
    p.ReleaseBurst(9, 2),
    p.Reply(9, p.Method.RELEASE_BURST),
    p.FreeBurstSlots(10, 2, (1, 2, 3)),
    p.Reply(10, p.Method.FREE_BURST_SLOTS),
    p.GetMemories(11, 2, (4,)),
    p.Reply(11, p.Method.GET_MEMORIES, value=(POOL,)),
    p.BurstEnded(12, 2, "its ring is out of sync"),
    p.Reply(12, p.Method.BURST_ENDED),
    p.Cancel(13, 5),
    p.Reply(13, p.Method.CANCEL),
    p.Allocate(20, (0, 2), (7,), (BufferRole(0, 0, 0.5),), (BufferRole(0, 0),)),
    p.Reply(20, p.Method.ALLOCATE, value=p.Allocated(3, 10, 64 + 2 * 16)),
    p.Reply(20, p.Method.ALLOCATE, value=p.Allocated(4)),
    p.CopyBuffer(21, p.Method.COPY_TO, 3, POOL),
    p.Reply(21, p.Method.COPY_TO),
    p.CopyBuffer(22, p.Method.COPY_FROM, 3, POOL, (2, 2)),
    p.Reply(22, p.Method.COPY_FROM),
    p.ReleaseBuffer(23, 3),
    p.Reply(23, p.Method.RELEASE_BUFFER),
    p.Execute(24, 7, (RequestArgument(False, DataLocation(1, 0, 0)),), (ARG,),
              (POOL, p.WireToken(3)), (), False, None, None),
    p.Reply(0, p.Method.ERROR, ErrorStatus.INVALID_ARGUMENT, "did not decode"),
    p.PrepareModelCaching(14, _model(), ExecutionPreference.FAST_SINGLE_ANSWER, Priority.LOW,
                          None, (5,), (6, 7), bytes(range(32))),
    p.Reply(14, p.Method.PREPARE_MODEL_CACHING, value=13),
    p.PrepareModelFromCache(15, Priority.HIGH, 2.5, (5,), (), b"\xff" * 32),
    p.Reply(15, p.Method.PREPARE_MODEL_FROM_CACHE, ErrorStatus.GENERAL_FAILURE, "cache corrupt",
            p.FromCache(ErrorStatus.GENERAL_FAILURE, "cache corrupt",
                        reason=CacheReject.CORRUPT)),
    p.CreateExecution(30, 7, (ARG, ARG), (ARG,), (POOL,), (), True, None, 2.0),
    p.Reply(30, p.Method.CREATE_EXECUTION, value=41),
    p.Compute(31, 41, 12.5),
    p.Reply(31, p.Method.COMPUTE, ErrorStatus.NONE, "",
            ExecutionResult(ErrorStatus.NONE, (OutputShape((2, 2)),), Timing(3, 5))),
    p.ReleaseExecution(32, 41),
    p.Reply(32, p.Method.RELEASE_EXECUTION),
]
FRAMES = [p.encode(m) for m in MESSAGES]


def test_every_codec_is_fuzzed():
    calls = {m.method for m in MESSAGES if not isinstance(m, p.Reply)}
    replies = {m.method for m in MESSAGES if isinstance(m, p.Reply)}
    assert replies == set(p.CODECS)
    assert calls == {method for method, codec in p.CODECS.items() if codec.get_call}
    for (frame, fds), message in zip(FRAMES, MESSAGES):
        assert p.decode_body(frame[p.FRAME_HEADER_SIZE:], fds) == message


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


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(range(len(FRAMES))), max_size=6), st.data())
def test_client_connection_fed_frames_and_garbage_yields_events_or_the_protocol_error(
        picks, data):
    """The client's side, with calls pending: replies become Answers (with
    the token of a pending call, or None), anything else a Malformed event,
    a service call, or the protocol error."""
    conn = p.ClientConnection()
    conn.call(lambda cid: p.Hello(cid), "hello")
    for k in range(2, 16):
        conn.call(lambda cid: p.Query(cid, p.Method.CAPABILITIES), k)
    stream = b"".join(FRAMES[i][0] for i in picks) + data.draw(st.binary(max_size=32))
    try:
        for start in range(0, len(stream), 7):
            conn.receive_data(stream[start:start + 7], [])
            while (event := conn.next_event()) is not None:
                assert isinstance(event, (p.Answer, p.Malformed, p.GetMemories, p.BurstEnded))
    except p.ProtocolError as e:
        assert e.status == ErrorStatus.INVALID_ARGUMENT
        assert conn.state is p.State.CLOSED


def test_every_cut_of_every_frame_exhaustively():
    for frame, fds in FRAMES:
        body = frame[p.FRAME_HEADER_SIZE:]
        for cut in range(len(body)):
            _decode_or_protocol_error(body[:cut], fds)
            _decode_or_protocol_error(body[:cut] + struct.pack("<I", 0xFFFFFFFF), fds)
