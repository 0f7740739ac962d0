"""Burst sessions without a service process: the HAL default for in-process
drivers, the burst messages of the control protocol, and the burst server's
loop over real rings in one process (the service process is in
tests/integration/test_burst.py)."""
import os
import struct

import anyio
import numpy as np
import pytest

import nnrt
from nnrt import ErrorStatus, OperandType as T, OperationType as Op
from nnrt.burst import wire
from nnrt.burst.server import BurstServer
from nnrt.hal import BurstSession, Request, RequestArgument
from nnrt.drivers.reference import ReferenceDevice
from nnrt.service import protocol as p
from nnrt.fmq import Ring
from nnrt.memory import Memory
from nnrt.model.graph import DataLocation


def add_model():
    m = nnrt.Model()
    a = m.add_operand(T.TENSOR_FLOAT32, [1, 4])
    b = m.add_operand(T.TENSOR_FLOAT32, [1, 4])
    act = m.add_operand(T.INT32)
    m.set_operand_value(act, 0)
    out = m.add_operand(T.TENSOR_FLOAT32, [1, 4])
    m.add_operation(Op.ADD, [a, b, act], [out])
    m.identify_inputs_and_outputs([a, b], [out])
    return m.finish().hal_model


# -- the HAL default ------------------------------------------------------------

async def test_an_in_process_burst_is_the_prepared_models_execute():
    prepared = await ReferenceDevice().prepare_model(add_model())
    session = await prepared.configure_burst()
    assert isinstance(session, BurstSession)
    x = np.arange(4, dtype=np.float32)
    out = np.zeros(4, np.float32)
    request = Request((RequestArgument(False, DataLocation(0, 0, 16), (1, 4)),
                       RequestArgument(False, DataLocation(0, 0, 16), (1, 4))),
                      (RequestArgument(False, DataLocation(1, 0, 16)),),
                      (x.view(np.uint8), out.view(np.uint8)))
    result = await session.execute(request)
    assert result.status == ErrorStatus.NONE and out.tolist() == [0, 2, 4, 6]
    session.close()
    session.close()
    assert (await session.execute(request)).status == ErrorStatus.INVALID_ARGUMENT


# -- protocol messages ------------------------------------------------------------

def burst_messages():
    return [
        p.ConfigureBurst(1, 42, (3, 4, 5, 6, 7, 8)),
        p.ReleaseBurst(2, 9),
        p.FreeBurstSlots(3, 9, (1, 5, 7)),
        p.GetMemories(4, 9, (2,)),
        p.BurstEnded(5, 9, "its ring is out of sync"),
        p.Reply(1, p.Method.CONFIGURE_BURST, value=77),
        p.Reply(2, p.Method.RELEASE_BURST),
        p.Reply(4, p.Method.GET_MEMORIES, value=(p.WirePool(2, 11, True, 0, 4096, 0, 4096),)),
        p.Reply(5, p.Method.GET_MEMORIES, ErrorStatus.INVALID_ARGUMENT, "slot 3 is unknown"),
    ]


@pytest.mark.parametrize("message", burst_messages(), ids=lambda m: type(m).__name__)
def test_burst_messages_round_trip_and_refuse_every_truncation(message):
    frame, fds = p.encode(message)
    body = frame[p.FRAME_HEADER_SIZE:]
    assert p.decode_body(body, fds) == message
    for cut in range(len(body)):
        with pytest.raises(p.ProtocolError):
            p.decode_body(body[:cut], fds)


def test_configure_burst_carries_exactly_six_fds():
    frame, fds = p.encode(burst_messages()[0])
    assert fds == [3, 4, 5, 6, 7, 8]
    with pytest.raises(p.ProtocolError, match="more fds"):
        p.decode_body(frame[p.FRAME_HEADER_SIZE:], fds[:5])
    with pytest.raises(p.ProtocolError, match="6 ring fds"):
        p.encode(p.ConfigureBurst(1, 42, (3, 4)))


def test_get_memories_is_the_one_call_a_service_makes():
    server, client = p.Connection("server"), p.Connection("client")
    client.send(p.Hello(1))
    # service -> client: GET_MEMORIES is accepted as a call
    data, fds = server.send(p.GetMemories(1, 9, (2, 3)))
    client.receive_data(data, fds)
    assert client.next_event() == p.GetMemories(1, 9, (2, 3))
    # client -> service: its reply, with the fds
    reply = p.Reply(1, p.Method.GET_MEMORIES, value=(p.WirePool(2, 5, False, 0, 64, 0, 64),))
    data, fds = client.send(reply)
    assert fds == [5]
    server.receive_data(*p.encode(p.Hello(1)))
    assert isinstance(server.next_event(), p.Hello)
    server.receive_data(data, fds)
    assert server.next_event() == reply
    # ... but no other reply goes client -> service, no other call the other way.
    with pytest.raises(p.ProtocolError):
        client.send(p.Reply(2, p.Method.EXECUTE))
    with pytest.raises(p.ProtocolError):
        server.send(p.ReleaseModel(3, 1))
    server.receive_data(*p.encode(p.Reply(2, p.Method.RELEASE_MODEL)))
    assert isinstance(server.next_event(), p.Malformed)
    client.receive_data(*p.encode(p.ReleaseBurst(3, 1)))
    assert isinstance(client.next_event(), p.Malformed)


def test_slot_lists_are_bounded():
    body = struct.pack("<BBQQI", p.Kind.CALL, p.Method.GET_MEMORIES, 1, 9, p.MAX_BURST_SLOTS + 1)
    body += b"\0" * 4 * (p.MAX_BURST_SLOTS + 1)
    with pytest.raises(p.ProtocolError, match="burst slots"):
        p.decode_body(body)


# -- the server loop over real rings --------------------------------------------------

class Rig:
    """A BurstServer on rings whose other ends this test drives."""

    def __init__(self, prepared, memories):
        self.requests = Ring.create(1 << 19)
        self.results = Ring.create(1 << 18)
        self.memories = memories
        self.fetches = []

        async def fetch(slots):
            self.fetches.append(slots)
            m = self.memories
            return {s: Memory.from_fd(m[s].fileno(), 0, m[s].size) for s in slots if s in m}

        self.server = BurstServer(1, prepared, Ring.attach(*map(os.dup, self.requests.fds())),
                                  Ring.attach(*map(os.dup, self.results.fds())), fetch)

    async def call(self, frame: bytes) -> wire.BurstResult:
        await self.requests.write_async(frame)
        return wire.decode_result(await self.results.read_async())


def add_request(serial, slot=1):
    a = wire.BurstArgument(False, 0, 0, 16, (1, 4))
    out = wire.BurstArgument(False, 0, 32, 16, ())
    return wire.encode_request(wire.BurstRequest(serial, (a, a), (out,), (slot,)))


async def test_the_server_serves_in_order_fetches_once_and_frees():
    prepared = await ReferenceDevice().prepare_model(add_model())
    mem = Memory.create(64)
    mem.array(np.float32, 4)[:] = [1, 2, 3, 4]
    rig = Rig(prepared, {1: mem})
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(rig.server.run)
            for serial in (1, 2, 3):
                result = await rig.call(add_request(serial))
                assert (result.serial, result.status) == (serial, ErrorStatus.NONE)
            assert mem.array(np.float32, 4, 32).tolist() == [2, 4, 6, 8]
            assert rig.fetches == [(1,)]  # fetched once, cached after
            # A frame that does not decode fails alone, with its serial if readable.
            bad = add_request(4)[:-1]
            result = await rig.call(bad)
            assert (result.serial, result.status) == (4, ErrorStatus.INVALID_ARGUMENT)
            assert (await rig.call(b"junk")).serial == 0
            # An unknown slot the controller cannot give: INVALID_ARGUMENT.
            result = await rig.call(add_request(5, slot=2))
            assert result.status == ErrorStatus.INVALID_ARGUMENT and "[2]" in result.message
            assert (await rig.call(add_request(6))).status == ErrorStatus.NONE
            stats = rig.server.statistics()
            assert (stats.executions, stats.malformed, stats.get_memories_calls,
                    stats.slots_mapped) == (7, 2, 2, 1)
            rig.server.free([1])
            assert rig.server.statistics().slots_mapped == 0
            assert (await rig.call(add_request(7))).status == ErrorStatus.NONE
            assert rig.fetches[-1] == (1,)  # freed, so fetched again
            rig.server.stop()
    assert rig.server.closed and rig.server.statistics().slots_mapped == 0
    rig.requests.close()
    rig.results.close()
    mem.close()


async def test_a_corrupted_ring_ends_the_server():
    prepared = await ReferenceDevice().prepare_model(add_model())
    rig = Rig(prepared, {})
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(rig.server.run)
            # The producer's write counter jumps past the capacity: out of sync.
            counters = memoryview(rig.requests._mm).cast("Q")
            counters[128 // 8] = 1 << 40
            os.eventfd_write(rig.requests.fds()[1], 1)
            counters.release()
    assert rig.server.closed
    rig.requests.close()
    rig.results.close()


# -- layouts and run frames of the wire format --------------------------------------

def test_a_layout_definition_and_its_runs_round_trip():
    arg = wire.BurstArgument(False, 0, 16, 16, (1, 4))
    for layout in (0, 1, wire.MAX_LAYOUTS):
        request = wire.BurstRequest(5, (arg,), (arg,), (3,), True, 2.5, 0.5, layout)
        assert wire.decode_frame(wire.encode_request(request)) == request
    for deadline in (None, 0.0, 7.25):
        run = wire.BurstRun(2**64 - 1, 3, deadline)
        data = wire.encode_run(run)
        assert len(data) == 32 and wire.decode_frame(data) == wire.decode(data) == run
    with pytest.raises(wire.BurstProtocolError, match="layout"):
        wire.encode_request(wire.BurstRequest(5, (arg,), (arg,), (3,),
                                              layout=wire.MAX_LAYOUTS + 1))
    for layout in (0, wire.MAX_LAYOUTS + 1):
        with pytest.raises(wire.BurstProtocolError, match="layout"):
            wire.encode_run(wire.BurstRun(1, layout))
    with pytest.raises(wire.BurstProtocolError, match="deadline"):
        wire.encode_run(wire.BurstRun(1, 1, float("nan")))


def test_a_run_frame_is_refused_unless_it_is_exactly_canonical():
    data = bytearray(wire.encode_run(wire.BurstRun(9, 2)))
    for offset, value in ((4, 1), (6, 8), (24, 0), (26, 1), (28, 1)):
        bad = bytearray(data)
        struct.pack_into("<H", bad, offset, value)   # version, flags, layout 0, padding
        with pytest.raises(wire.BurstProtocolError):
            wire.decode_frame(bytes(bad))
    no_deadline_flag = bytearray(data)
    struct.pack_into("<d", no_deadline_flag, 16, 1.0)   # a deadline without its flag
    with pytest.raises(wire.BurstProtocolError, match="deadline"):
        wire.decode_frame(bytes(no_deadline_flag))
    for cut in (data[:-1], bytes(data) + b"\0"):
        with pytest.raises(wire.BurstProtocolError):
            wire.decode_frame(bytes(cut))


