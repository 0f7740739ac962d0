"""The driver-service protocol without sockets: every message round-trips,
framing and the call-stream state machine refuse what they must."""
import math
import os
from dataclasses import fields

import anyio
import struct

import pytest

import nnrt
from nnrt import ErrorStatus, NnrtError, OperandType as T, OperationType as Op, Priority
from nnrt.hal import (AppDeclaration, BufferRole, Capabilities, DeviceType, ExecutionPreference, ExecutionResult,
                              OutputShape, PerformanceInfo, RequestArgument, Timing)
from nnrt.service import protocol as p
from nnrt.service.protocol import codecs
from nnrt.qos.scheduler import AppStatistics, ClassStatistics, JobRecord, SchedulerStatistics
from nnrt.model.extensions import Extension, ExtensionOperandTypeInfo
from nnrt.model.graph import ChannelQuant, DataLocation, ExtensionPrefix, Operand
from nnrt.model.types import OperandLifeTime as L
from nnrt.memory import as_buffer
from pathlib import Path
from tests.conftest import MODELS



def wire_model():
    m = nnrt.Model()
    a = m.add_operand(T.TENSOR_FLOAT32, [1, 4])
    b = m.add_operand(T.TENSOR_FLOAT32, [1, 4])
    act = m.add_operand(T.INT32)
    m.set_operand_value(act, 0)
    out = m.add_operand(T.TENSOR_FLOAT32, [1, 4])
    m.add_operation(Op.ADD, [a, b, act], [out])
    m.identify_inputs_and_outputs([a, b], [out])
    hal = m.finish().hal_model
    # Exercise every optional field of an operand too.
    extra = Operand(T.TENSOR_QUANT8_SYMM_PER_CHANNEL, (2, 1), 0.0, 0, L.CONSTANT_REFERENCE,
                    DataLocation(0, 0, 2), ChannelQuant(0, (0.5, 0.25)), b"\x01\x02")
    main = hal.main.__class__(hal.main.operands + (extra,), hal.main.operations,
                              hal.main.input_indexes, hal.main.output_indexes)
    pools = (p.WirePool(0, 7, False, 4096, 8192, 16, 64),)
    return hal.__class__(main, (main,), hal.operand_values, pools, True,
                         (ExtensionPrefix("com.example", 3),))


def sample_messages():
    model = wire_model()
    arg = RequestArgument(False, DataLocation(0, 0, 16), (1, 4))
    caps = Capabilities(PerformanceInfo(0.5, 1), PerformanceInfo(1, 2),
                        {T.TENSOR_FLOAT32: PerformanceInfo(0.25, math.inf)},
                        PerformanceInfo(3, 4), PerformanceInfo(5, 6))
    result = ExecutionResult(ErrorStatus.OUTPUT_INSUFFICIENT_SIZE,
                             (OutputShape((2, 3), False),), Timing(5, 9), "too small")
    return [
        p.Hello(1),
        p.Query(2, p.Method.CAPABILITIES),
        p.Query(3, p.Method.SUPPORTED_EXTENSIONS),
        p.Query(4, p.Method.NUMBER_OF_CACHE_FILES),
        p.SupportedOperations(5, model),
        p.PrepareModel(6, model, ExecutionPreference.LOW_POWER, Priority.HIGH, 12.5),
        p.PrepareModel(7, model, ExecutionPreference.SUSTAINED_SPEED, Priority.LOW, None),
        p.Execute(8, 99, (arg, RequestArgument(True)), (arg,),
                  (p.WirePool(3, 9, True, 0, 4096, 0, 32), p.WirePool(4, None, False, 0, 64, 8, 8)),
                  (1, 2), True, 100.0, 2.0),
        p.ReleaseModel(9, 99),
        p.Cancel(10, 8),
        p.Reply(1, p.Method.HELLO, value=p.DeviceInfo("dev", DeviceType.GPU, "v1", 30)),
        p.Reply(2, p.Method.CAPABILITIES, value=caps),
        p.Reply(3, p.Method.SUPPORTED_EXTENSIONS, value=[
            Extension("com.example.a"),
            Extension("com.example.b", (ExtensionOperandTypeInfo(2, True, 4),), ((1, "OP"),))]),
        p.Reply(4, p.Method.NUMBER_OF_CACHE_FILES, value=(1, 2)),
        p.Reply(5, p.Method.SUPPORTED_OPERATIONS, value=[True, False]),
        p.Reply(6, p.Method.PREPARE_MODEL, value=42),
        p.Reply(7, p.Method.PREPARE_MODEL, ErrorStatus.INVALID_ARGUMENT, "bad model"),
        p.Reply(8, p.Method.EXECUTE, result.status, result.message, result),
        p.Reply(9, p.Method.RELEASE_MODEL),
        p.Reply(10, p.Method.CANCEL),
        p.Reply(0, p.Method.ERROR, ErrorStatus.INVALID_ARGUMENT, "did not decode"),
        p.Hello(11, app=AppDeclaration("camera", "/srv/apps/cam.py")),
    ]


def frame_body(frame: bytes) -> bytes:
    return frame[p.FRAME_HEADER_SIZE:]


@pytest.mark.parametrize("message", sample_messages(), ids=lambda m: type(m).__name__)
def test_every_message_round_trips(message):
    frame, fds = p.encode(message)
    length, nfds = struct.unpack_from("<IB", frame)
    assert length == len(frame) - p.FRAME_HEADER_SIZE and nfds == len(fds)
    assert p.decode_body(frame_body(frame), fds) == message


def test_fds_travel_beside_the_frame_in_pool_order():
    execute = sample_messages()[7]
    frame, fds = p.encode(execute)
    assert fds == [9]
    assert p.encode(sample_messages()[4])[1] == [7]


def test_truncated_and_padded_bodies_raise_the_protocol_error():
    for message in sample_messages():
        frame, fds = p.encode(message)
        body = frame_body(frame)
        for cut in range(len(body)):
            with pytest.raises(p.ProtocolError):
                p.decode_body(body[:cut], fds)
        with pytest.raises(p.ProtocolError, match="trailing"):
            p.decode_body(body + b"\0", fds)


def test_fd_count_must_match_what_the_message_uses():
    frame, fds = p.encode(sample_messages()[7])
    with pytest.raises(p.ProtocolError, match="more fds"):
        p.decode_body(frame_body(frame), [])
    with pytest.raises(p.ProtocolError, match="fds came"):
        p.decode_body(frame_body(frame), fds + [11])


@pytest.mark.parametrize("body, needle", [
    (struct.pack("<BBQ", 3, 1, 0), "kind"),
    (struct.pack("<BBQ", 1, 200, 0), "unknown method"),
    (struct.pack("<BBQ", 1, 0, 0), "ERROR is a reply"),
    (struct.pack("<BBQI", 2, 2, 0, 77), "not a ErrorStatus"),
    (struct.pack("<BBQIIB", 2, 0, 0, 0, 0, 0), "ERROR reply with status NONE"),
    (struct.pack("<BBQQIIIQI", 1, p.Method.EXECUTE, 0, 1, 0xFFFFFFFF, 0, 0, 0, 0), "count"),
])
def test_bad_bodies_name_what_is_wrong(body, needle):
    with pytest.raises(p.ProtocolError, match=needle) as e:
        p.decode_body(body)
    assert e.value.status == ErrorStatus.INVALID_ARGUMENT
    assert isinstance(e.value, NnrtError)


def test_non_finite_deadline_is_refused():
    frame, _ = p.encode(p.ReleaseModel(1, 1))
    msg = p.Execute(1, 1, (), (), (), (), False, math.nan, None)
    frame, fds = p.encode(msg)
    with pytest.raises(p.ProtocolError, match="deadline"):
        p.decode_body(frame_body(frame), fds)


def test_connection_reassembles_frames_fed_byte_by_byte():
    server = p.Connection("server")
    calls = sample_messages()[:9]
    stream, all_fds = b"", []
    for m in calls:
        frame, fds = p.encode(m)
        stream += frame
        all_fds += fds
    got = []
    server.receive_data(stream[:1], all_fds)  # fds arrive with the first byte
    for i in range(1, len(stream)):
        while (event := server.next_event()) is not None:
            got.append(event)
        server.receive_data(stream[i:i + 1])
    while (event := server.next_event()) is not None:
        got.append(event)
    assert got == calls
    assert server.state is p.State.READY


def test_state_machine_is_a_table_and_refuses_calls_before_hello():
    assert p.transition(p.State.IDLE, p.Event.HELLO) is p.State.READY
    with pytest.raises(p.ProtocolError, match="CALL is not allowed in state IDLE"):
        p.transition(p.State.IDLE, p.Event.CALL)
    with pytest.raises(p.ProtocolError, match="HELLO is not allowed in state READY"):
        p.transition(p.State.READY, p.Event.HELLO)
    server = p.Connection("server")
    server.receive_data(p.encode(p.ReleaseModel(5, 1))[0])
    event = server.next_event()
    assert isinstance(event, p.Malformed) and event.call_id == 5
    assert "IDLE" in event.error.message
    client = p.Connection("client")
    with pytest.raises(p.ProtocolError):
        client.send(p.ReleaseModel(1, 1))
    client.send(p.Hello(1))
    with pytest.raises(p.ProtocolError):
        client.send(p.Hello(2))


def test_a_service_refuses_replies_and_a_client_refuses_calls():
    server = p.Connection("server")
    server.receive_data(p.encode(p.Reply(3, p.Method.RELEASE_MODEL))[0])
    assert isinstance(server.next_event(), p.Malformed)
    client = p.Connection("client")
    client.receive_data(p.encode(p.Hello(3))[0])
    assert isinstance(client.next_event(), p.Malformed)


def test_oversized_frame_breaks_the_connection():
    server = p.Connection("server")
    server.receive_data(struct.pack("<IB", p.MAX_FRAME + 1, 0) + b"x" * 10)
    with pytest.raises(p.ProtocolError, match="exceeds"):
        server.next_event()
    assert server.state is p.State.CLOSED


def test_frame_announcing_missing_fds_breaks_the_connection():
    server = p.Connection("server")
    body = struct.pack("<BBQI", 1, p.Method.HELLO, 1, 1)
    server.receive_data(struct.pack("<IB", len(body), 2) + body, [5])
    with pytest.raises(p.ProtocolError, match="announces 2 fds"):
        server.next_event()
    assert server.take_fds() == [5]


def test_eof_closes_the_call_stream():
    server = p.Connection("server")
    server.receive_data(b"")
    assert server.state is p.State.CLOSED


def test_counts_are_bounded_by_the_smallest_element_not_a_guess():
    # Smallest operands (a scalar without location) and smallest arguments
    # (no value) packed back to back must still decode.
    from nnrt.model.graph import HalModel, Subgraph
    operands = tuple(Operand(T.INT32) for _ in range(50))
    model = HalModel(Subgraph(operands, (), (), ()))
    message = p.SupportedOperations(1, model)
    frame, fds = p.encode(message)
    assert p.decode_body(frame_body(frame), fds) == message
    args = tuple(RequestArgument(True) for _ in range(50))
    message = p.Execute(2, 1, args, (), ())
    frame, fds = p.encode(message)
    assert p.decode_body(frame_body(frame), fds) == message


def statistics_value():
    stats = SchedulerStatistics(2, 1, (ClassStatistics(
        ("pid", 42), Priority.HIGH, 1, 1, 5, 2, 1, 0, 0, 0.001, None, 0.25),),
        (AppStatistics(("pid", 42), "camera", 3.0, Priority.MEDIUM, "camera cam.py pid 42"),))
    job = JobRecord(("uid", 7), Priority.LOW, None, 3, 1.0, None, 2.0, 0.5, 1, 0.1,
                    ErrorStatus.MISSED_DEADLINE_TRANSIENT, "late")
    return p.StatisticsValue(stats, (job,))


def test_the_statistics_records_wire_layout_is_pinned_to_the_protocol_version():
    """The wire form of the scheduler's records is made from their fields: a
    field added, removed, retyped or moved changes the wire, so it must come
    with a new PROTOCOL_VERSION (and this list)."""
    layout = {cls.__name__: [(f.name, str(f.type)) for f in fields(cls)]
              for cls in (ClassStatistics, JobRecord, AppStatistics)}
    assert (p.PROTOCOL_VERSION, layout) == (6, {
        "AppStatistics": [("app", "Hashable"), ("rule", "str"), ("weight", "float"),
                          ("max_priority", "Priority"), ("who", "str")],
        "ClassStatistics": [("app", "Hashable"), ("priority", "Priority"), ("queued", "int"),
                            ("running", "int"), ("completed", "int"), ("preempted", "int"),
                            ("deadline_misses", "int"), ("cancelled", "int"),
                            ("failed", "int"), ("wait_p50", "float | None"),
                            ("wait_p99", "float | None"), ("run_time", "float")],
        "JobRecord": [("app", "Hashable"), ("priority", "Priority"), ("model", "Hashable"),
                      ("seq", "int"), ("submitted_at", "float"),
                      ("started_at", "float | None"), ("finished_at", "float"),
                      ("ran", "float"), ("preemptions", "int"), ("longest_step", "float"),
                      ("status", "ErrorStatus"), ("message", "str")]})
    # The job record's fixed fields go in one struct, its model key not at all.
    assert codecs._JOB.plan[1][0].format == "<IQddddQdI"


def test_statistics_reply_round_trips():
    from nnrt.drivers.reference import ReferenceDevice
    for value in (statistics_value(), p.StatisticsValue(None, ()),
                  p.StatisticsValue(None, (JobRecord("app", Priority.MEDIUM, None, 1, 0.0, 0.5,
                                                     1.0, 0.5, 0, 0.5, ErrorStatus.NONE,
                                                     ""),)),
                  p.StatisticsValue(None, (JobRecord(("remote", "camera"), Priority.MEDIUM,
                                                     None, 1, 0.0, 0.5, 1.0, 0.5, 0, 0.5,
                                                     ErrorStatus.NONE, ""),))):
        data, fds = p.encode(p.Reply(9, p.Method.STATISTICS, ErrorStatus.NONE, "", value))
        assert p.decode_body(data[p.FRAME_HEADER_SIZE:], fds).value == value
        for cut in range(p.FRAME_HEADER_SIZE, len(data) - 1):
            with pytest.raises(p.ProtocolError):
                p.decode_body(data[p.FRAME_HEADER_SIZE:cut], [])
    assert anyio.run(ReferenceDevice().finished_jobs) == ()  # no scheduler of its own


def test_a_job_record_with_an_unknown_priority_or_status_is_refused():
    value = statistics_value()
    job = value.jobs[0]
    data, fds = p.encode(p.Reply(9, p.Method.STATISTICS, ErrorStatus.NONE, "", value))
    fixed = codecs._JOB.plan[1][0]
    at = data.index(fixed.pack(job.priority, job.seq, job.submitted_at, math.nan,
                               job.finished_at, job.ran, job.preemptions, job.longest_step,
                               job.status))
    status_at = at + fixed.size - 4
    for where, value, what in ((at, 7, "JobRecord priority: 7 is not a Priority"),
                               (status_at, 99999, "JobRecord status: 99999 is not a ErrorStatus")):
        bad = data[:where] + struct.pack("<I", value) + data[where + 4:]
        with pytest.raises(p.ProtocolError, match=what):
            p.decode_body(bad[p.FRAME_HEADER_SIZE:], fds)


def test_every_method_has_one_codec_and_sample_messages_cover_it():
    covered = {m.method for m in sample_messages() + all_method_messages()}
    assert set(p.CODECS) == set(p.Method) == covered


def all_method_messages():
    """A call and a successful reply of every method the samples above leave out."""
    pool = p.WirePool(2, 11, True, 0, 4096, 0, 4096)
    info = p.FencedInfo(ExecutionResult(ErrorStatus.NONE, (OutputShape((1,)),), Timing(1, 2)),
                        Timing(3, 4), Timing(5, 6))
    return [
        p.Query(11, p.Method.STATISTICS),
        p.Reply(11, p.Method.STATISTICS, value=statistics_value()),
        p.ExecuteFenced(12, 7, (), (), (pool,), (), False, None, None, (5,), 0.5, 6),
        p.Reply(12, p.Method.EXECUTE_FENCED, value=info),
        p.ConfigureBurst(13, 42, (3, 4, 5, 6, 7, 8)),
        p.Reply(13, p.Method.CONFIGURE_BURST, value=77),
        p.ReleaseBurst(14, 9),
        p.Reply(14, p.Method.RELEASE_BURST),
        p.FreeBurstSlots(15, 9, (1, 5)),
        p.Reply(15, p.Method.FREE_BURST_SLOTS),
        p.GetMemories(16, 9, (2,)),
        p.Reply(16, p.Method.GET_MEMORIES, value=(pool,)),
        p.BurstEnded(17, 9, "its ring is out of sync"),
        p.Reply(17, p.Method.BURST_ENDED),
        p.PrepareModelCaching(18, wire_model(), ExecutionPreference.LOW_POWER, Priority.HIGH,
                              3.5, (4,), (5,), b"t" * 32),
        p.Reply(18, p.Method.PREPARE_MODEL_CACHING, value=5),
        p.PrepareModelFromCache(19, Priority.MEDIUM, None, (4,), (5,), b"t" * 32),
        p.Reply(19, p.Method.PREPARE_MODEL_FROM_CACHE,
                value=p.FromCache(ErrorStatus.NONE, model_id=6)),
        p.Allocate(20, (0, 4), (7, 8), (BufferRole(0, 1, 0.5),),
                   (BufferRole(1, 0), BufferRole(0, 0, 1.0))),
        p.Reply(20, p.Method.ALLOCATE, value=p.Allocated(5, 11, 64 + 2 * 16)),
        p.Reply(20, p.Method.ALLOCATE, value=p.Allocated(6)),
        p.CopyBuffer(21, p.Method.COPY_TO, 5, pool),
        p.Reply(21, p.Method.COPY_TO),
        p.CopyBuffer(22, p.Method.COPY_FROM, 5, pool, (2, 3)),
        p.Reply(22, p.Method.COPY_FROM),
        p.ReleaseBuffer(23, 5),
        p.Reply(23, p.Method.RELEASE_BUFFER),
        # a request naming a driver buffer by token among its shared-memory pools
        p.Execute(24, 7, (RequestArgument(False, DataLocation(1, 0, 0)),),
                  (RequestArgument(False, DataLocation(0, 0, 16)),),
                  (pool, p.WireToken(5)), (), False, None, None),
        p.CreateExecution(25, 7, (RequestArgument(False, DataLocation(0, 0, 16), (1, 4)),),
                          (RequestArgument(False, DataLocation(0, 16, 16)),), (pool,), (),
                          True, None, 0.5),
        p.Reply(25, p.Method.CREATE_EXECUTION, value=12),
        p.Compute(26, 12, 123.5),
        p.Compute(27, 12, None),
        p.Reply(26, p.Method.COMPUTE, value=ExecutionResult(
            ErrorStatus.NONE, (OutputShape((1, 4)),), Timing(7, 9))),
        p.ReleaseExecution(28, 12),
        p.Reply(28, p.Method.RELEASE_EXECUTION),
    ]


def test_an_allocate_reply_carries_its_mirror_fd_and_owns_it():
    frame, fds = p.encode(p.Reply(20, p.Method.ALLOCATE, value=p.Allocated(5, 11, 96)))
    assert fds == [11]
    reply = p.decode_body(frame_body(frame), [42])
    assert reply.value == p.Allocated(5, 42, 96) and p.reply_fds_of(reply) == (42,)
    with pytest.raises(p.ProtocolError, match="more fds"):
        p.decode_body(frame_body(frame), [])
    frame, fds = p.encode(p.Reply(20, p.Method.ALLOCATE, value=p.Allocated(5)))
    assert fds == [] and p.reply_fds_of(p.decode_body(frame_body(frame), [])) == ()
    bad, _ = p.encode(p.Reply(20, p.Method.ALLOCATE, value=p.Allocated(5, 11, 0)))
    with pytest.raises(p.ProtocolError, match="0 bytes"):
        p.decode_body(frame_body(bad), [42])
    # an error reply holds no value, hence no fd
    err = p.error_reply(20, p.Method.ALLOCATE, ErrorStatus.INVALID_ARGUMENT, "no")
    assert p.reply_fds_of(p.decode_body(frame_body(p.encode(err)[0]), [])) == ()


def test_a_token_pool_is_only_a_request_pool_and_never_zero():
    pool = p.WirePool(2, 11, True, 0, 4096, 0, 4096)
    for message in (p.Reply(1, p.Method.GET_MEMORIES, value=(p.WireToken(5),)),
                    p.CopyBuffer(1, p.Method.COPY_TO, 5, p.WireToken(5))):
        frame, fds = p.encode(message)
        with pytest.raises(p.ProtocolError, match="kind 2"):
            p.decode_body(frame_body(frame), fds)
    frame, fds = p.encode(p.Execute(1, 7, (), (), (pool, p.WireToken(0)), (), False, None,
                                    None))
    with pytest.raises(p.ProtocolError, match="token 0"):
        p.decode_body(frame_body(frame), fds)


def test_connections_count_what_they_frame():
    client, server = p.Connection("client"), p.Connection("server")
    data, fds = client.send(p.Hello(1))
    server.receive_data(data, fds)
    assert server.next_event() == p.Hello(1)
    reply, _ = server.send(p.Reply(1, p.Method.HELLO,
                                   value=p.DeviceInfo("d", DeviceType.CPU, "v", 30)))
    assert client.statistics() == p.WireStatistics(1, len(data), 0, 0, 0)
    assert server.statistics() == p.WireStatistics(1, len(reply), 0, 1, len(data))


@pytest.mark.parametrize("message", all_method_messages(), ids=lambda m: type(m).__name__)
def test_every_other_method_round_trips_and_refuses_cuts(message):
    frame, fds = p.encode(message)
    body = frame_body(frame)
    assert p.decode_body(body, fds) == message
    for cut in range(len(body)):
        with pytest.raises(p.ProtocolError):
            p.decode_body(body[:cut], fds)
    with pytest.raises(p.ProtocolError, match="trailing"):
        p.decode_body(body + b"\0", fds)


def test_cache_calls_refuse_a_wrong_token_or_too_many_files():
    good = p.PrepareModelFromCache(1, Priority.MEDIUM, None, (4,), (), b"t" * 32)
    frame, fds = p.encode(good)
    body = frame_body(frame)
    short = body.replace(b"\x20\x00\x00\x00" + b"t" * 32, b"\x1f\x00\x00\x00" + b"t" * 31)
    with pytest.raises(p.ProtocolError, match="cache token of 31 bytes"):
        p.decode_body(short, fds)
    many = p.PrepareModelFromCache(1, Priority.MEDIUM, None, tuple(range(33)), (), b"t" * 32)
    frame, fds = p.encode(many)
    with pytest.raises(p.ProtocolError, match="33 model cache files exceed 32"):
        p.decode_body(frame_body(frame), fds)
    # A refusal's reason crosses the wire with its reply.
    refused = p.error_reply(2, p.Method.PREPARE_MODEL_FROM_CACHE, ErrorStatus.GENERAL_FAILURE,
                            "no")
    assert refused.value == p.FromCache(ErrorStatus.GENERAL_FAILURE, "no")
    frame, fds = p.encode(refused)
    assert p.decode_body(frame_body(frame), fds) == refused


def test_a_model_encoded_for_a_cache_file_round_trips_with_its_pools_inline():
    import nnrt.tflite
    model = nnrt.tflite.load(MODELS / "generated" / "mobilenet_v1_0.25_128_int8.tflite").hal_model
    decoded = p.decode_model(p.encode_model(model))
    assert decoded.main == model.main and decoded.referenced == model.referenced
    assert bytes(decoded.operand_values) == bytes(model.operand_values)
    assert [bytes(as_buffer(a)) for a in decoded.pools] == \
        [bytes(as_buffer(b)) for b in model.pools]
    data = p.encode_model(model)
    for cut in (0, 1, len(data) // 2, len(data) - 1):
        with pytest.raises(p.ProtocolError):
            p.decode_model(data[:cut])


def test_error_replies_carry_what_the_codec_says():
    dead = p.error_reply(3, p.Method.EXECUTE, ErrorStatus.DEAD_OBJECT, "gone")
    assert dead.value == ExecutionResult(ErrorStatus.DEAD_OBJECT, message="gone")
    fenced = p.error_reply(4, p.Method.EXECUTE_FENCED, ErrorStatus.DEAD_OBJECT, "gone")
    assert fenced.value.result.status == ErrorStatus.DEAD_OBJECT
    assert p.error_reply(5, p.Method.PREPARE_MODEL, ErrorStatus.DEAD_OBJECT, "gone").value is None
    for reply in (dead, fenced):
        frame, fds = p.encode(reply)
        assert p.decode_body(frame_body(frame), fds) == reply


# -- the state of calls in flight lives in the connection objects ---------------------

def _answer(conn, reply):
    conn.receive_data(*p.encode(reply))
    return conn.next_event()


def test_client_connection_numbers_calls_and_hands_replies_to_their_tokens():
    client = p.ClientConnection()
    call_id, frame, _ = client.call(lambda cid: p.Hello(cid), "hello token")
    assert p.decode_body(frame_body(frame)) == p.Hello(call_id)
    q_id, _, _ = client.call(lambda cid: p.Query(cid, p.Method.CAPABILITIES), "query token")
    assert q_id != call_id
    event = _answer(client, p.Reply(q_id, p.Method.CAPABILITIES, ErrorStatus.GENERAL_FAILURE,
                                    "no"))
    assert event == p.Answer("query token", event.reply) and event.reply.call_id == q_id
    # A reply nobody waits for (answered already, or abandoned) has no token.
    assert _answer(client, p.Reply(q_id, p.Method.CAPABILITIES, ErrorStatus.GENERAL_FAILURE,
                                   "again")).token is None
    # CANCEL only for a call still pending.
    assert client.cancel(q_id) is None
    data, _ = client.cancel(call_id)
    assert p.decode_body(frame_body(data)).target == call_id
    client.abandon(call_id)
    assert _answer(client, p.Reply(call_id, p.Method.HELLO, ErrorStatus.INVALID_ARGUMENT,
                                   "late")).token is None


def test_a_dead_client_connection_fails_every_pending_call_with_its_token():
    from nnrt.memory import Memory
    from nnrt.memory.staging import Place
    client = p.ClientConnection()
    client.call(lambda cid: p.Hello(cid), "hello")
    with Memory.create(64) as mem:
        client.execute("run", 5, (), (), (Place(mem, 0, 64),), False, None, None)
        answers = {a.token: a.reply for a in client.fail("the service died")}
    assert set(answers) == {"hello", "run"} and client.dead == "the service died"
    assert answers["hello"].status == ErrorStatus.DEAD_OBJECT
    assert answers["run"].value == ExecutionResult(ErrorStatus.DEAD_OBJECT,
                                                   message="the service died")
    assert client.fail("again") == []


def test_client_pool_cache_sends_an_fd_once_and_releases_closed_memories():
    from nnrt.memory import Memory
    from nnrt.memory.staging import Place
    client = p.ClientConnection()
    client.send(p.Hello(1))

    def execute(*mems):
        call_id, frame, fds = client.execute(None, 5, (), (), tuple(Place(m, 0, m.size)
                                                                   for m in mems),
                                             False, None, None)
        return call_id, p.decode_body(frame_body(frame), fds), fds

    a, b = Memory.create(64), Memory.create(128)
    call_id, first, fds = execute(a)
    assert fds == [a.fileno()] and first.pools[0].fd == a.fileno()
    # The call failed: the service may not have mapped it, so the fd goes again.
    _answer(client, p.error_reply(call_id, p.Method.EXECUTE, ErrorStatus.GENERAL_FAILURE, "x"))
    call_id, again, fds = execute(a)
    assert fds == [a.fileno()] and again.pools[0].pool_id == first.pools[0].pool_id
    _answer(client, p.reply_for(again, ExecutionResult(ErrorStatus.NONE)))
    _, by_id, fds = execute(a, b)
    assert by_id.pools[0].fd is None and by_id.pools[1].fd == b.fileno()
    a.close()
    _, released, _ = execute(b)
    assert released.release == (first.pools[0].pool_id,)
    # Another prepared model has its own cache; releasing a model drops it.
    _, other, fds = client.execute(None, 6, (), (), (Place(b, 0, b.size),), False, None, None)
    assert fds == [b.fileno()]
    data, _ = client.release_model(6)
    assert p.decode_body(frame_body(data)) == p.ReleaseModel(p.decode_body(frame_body(data)).call_id, 6)
    b.close()


def test_server_connection_keeps_cancel_targets_its_own_calls_and_the_pool_cache():
    server = p.ServerConnection()
    server.receive_data(*p.encode(p.Hello(1)))
    assert server.next_event() == p.Hello(1)
    server.running(7, "scope of call 7")
    assert server.cancel_target(p.Cancel(8, 7)) == "scope of call 7"
    server.finished(7)
    assert server.cancel_target(p.Cancel(9, 7)) is None
    # Our GET_MEMORIES: the client's reply comes back with our token.
    call_id, frame, _ = server.call(lambda cid: p.GetMemories(cid, 3, (1,)), "waiting task")
    reply = p.Reply(call_id, p.Method.GET_MEMORIES, ErrorStatus.INVALID_ARGUMENT, "no slot")
    assert _answer(server, reply) == p.Answer("waiting task", reply)
    assert _answer(server, reply) == p.Answer(None, reply)
    # The pool cache of each prepared model.
    assert server.cache_pool(5, 1, "pool 1") == []
    assert server.cache_pool(5, 1, "pool 1 again") == ["pool 1"]
    assert server.cached_pool(5, 1) == "pool 1 again" and server.cached_pool(6, 1) is None
    for k in range(2, p.MAX_CACHED_POOLS + 1):
        server.cache_pool(5, k, k)
    with pytest.raises(p.ProtocolError, match="cached"):
        server.cache_pool(5, p.MAX_CACHED_POOLS + 1, "one too many")
    assert server.release_pools(5, (1, 2, 999)) == ["pool 1 again", 2]
    assert len(server.drop_model(5)) == p.MAX_CACHED_POOLS - 2
    assert server.drop_model(5) == []


def _execute(call_id, model_id=1):
    return p.Execute(call_id, model_id, (), (), (), (), False, None, None)


def test_cancel_before_registration_is_applied_when_the_handler_registers():
    """Issue 23: an EXECUTE and its CANCEL read in one go reached the read
    loop before the EXECUTE's handler task had registered its cancel scope,
    and the CANCEL was dropped (the client then waited up to 10 s)."""
    server = p.ServerConnection()
    frames = [p.encode(m)[0] for m in (p.Hello(1), _execute(2), p.Cancel(3, 2), _execute(4),
                                       p.Cancel(5, 99))]
    server.receive_data(b"".join(frames))
    assert server.next_event() == p.Hello(1)
    assert server.next_event() == _execute(2)
    assert server.cancel_target(server.next_event()) is None   # not registered yet: kept
    assert server.next_event() == _execute(4)
    assert server.cancel_target(server.next_event()) is None   # unknown call: ignored
    assert server.running(2, "scope 2") is True        # the handler cancels it at once
    assert server.running(4, "scope 4") is False
    assert server.cancel_target(p.Cancel(6, 4)) == "scope 4"
    for call_id in (2, 4, 99):
        server.finished(call_id)
    # Nothing is kept for calls that finished, refused ones included.
    assert server.running(2, "a new call 2") is False
    server.finished(2)
    assert server.cancel_target(p.Cancel(7, 2)) is None


def test_unclaimed_fds_beyond_the_limit_break_the_connection():
    server = p.ServerConnection(max_fds=p.MAX_FDS)
    hello = p.encode(p.Hello(1))[0]
    server.receive_data(hello[:3], list(range(100, 100 + p.MAX_FDS)))
    assert server.next_event() is None and server.held == (p.MAX_FDS, 3)
    server.receive_data(b"", [7])     # one fd more, still no frame to claim any
    with pytest.raises(p.ProtocolError, match="no frame claims") as e:
        server.next_event()
    assert e.value.status == ErrorStatus.RESOURCE_EXHAUSTED_PERSISTENT
    assert server.state is p.State.CLOSED
    assert len(server.take_fds()) == p.MAX_FDS + 1


def test_a_frame_over_the_connection_limit_is_refused_before_its_bytes_arrive():
    server = p.ServerConnection(max_frame=1 << 20)
    server.receive_data(struct.pack("<IB", (1 << 20) + 1, 0) + b"x" * 10)
    with pytest.raises(p.ProtocolError, match="limit of 1048576 bytes") as e:
        server.next_event()
    assert e.value.status == ErrorStatus.RESOURCE_EXHAUSTED_PERSISTENT
    ok = p.ServerConnection(max_frame=1 << 20)
    ok.receive_data(struct.pack("<IB", 1 << 20, 0) + b"x" * 10)
    assert ok.next_event() is None and ok.held == (0, 15)


def test_the_client_keeps_the_services_last_word_as_the_reason():
    client = p.ClientConnection()
    client.receive_data(p.encode(p.Reply(0, p.Method.ERROR,
                                         ErrorStatus.RESOURCE_EXHAUSTED_TRANSIENT,
                                         "too many connections"))[0])
    assert client.next_event().token is None
    assert client.farewell == "too many connections"


def test_a_hello_of_another_version_decodes_to_its_version_and_a_bad_name_is_malformed():
    """The service can say which versions met, whatever the other version's
    HELLO carries; a declared name outside its alphabet never reaches it."""
    w = codecs._Writer(codecs._BODY.pack(p.Kind.CALL, p.Method.HELLO, 9))
    w.u32(p.PROTOCOL_VERSION - 1)
    w.u64(12345)                    # whatever the other version sends after it
    body = bytes(w.out)
    assert p.decode_body(body) == p.Hello(9, p.PROTOCOL_VERSION - 1)
    w = codecs._Writer(codecs._BODY.pack(p.Kind.CALL, p.Method.HELLO, 9))
    w.u32(p.PROTOCOL_VERSION)
    w.str_("cam\x1b[2J")            # a terminal escape in status, were it let through
    w.str_("")
    body = bytes(w.out)
    with pytest.raises(p.ProtocolError, match="app name"):
        p.decode_body(body)


@pytest.mark.parametrize("scope,admins,sees", [
    ("owner", (), {"owner", "root"}), ("owner", (4242,), {"owner", "root", "admin"}),
    ("own", (), set()), ("own", (4242,), {"admin"}),
    ("all", (), {"owner", "root", "admin", "other"})])
def test_who_sees_every_apps_statistics(scope, admins, sees):
    """The service's own user and root see every app by default, with no
    flag; any other uid its own app, unless an --admin-uid."""
    from nnrt.drivers.reference import ReferenceDevice
    from nnrt.service.server import DriverService, PeerCredentials
    service = DriverService(ReferenceDevice(), statistics=scope, admin_uids=admins)
    owner = os.getuid()
    other = next(u for u in range(1000, 70000) if u not in (owner, 4242))
    uids = {"owner": owner, "root": 0, "admin": 4242, "other": other}
    assert {who for who, uid in uids.items()
            if service.sees_all_apps(PeerCredentials(1, uid, uid))} == sees
