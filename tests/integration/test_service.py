"""Driver services with real processes: `python -m nnrt driver serve` on a
Unix socket in a temporary folder, the client proxy over it, SIGKILL, a
second client process, and a flood of malformed frames."""
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time

import anyio
import numpy as np
import pytest

import nnrt
from nnrt import ErrorStatus, NnrtError, OperandType as T, OperationType as Op
from nnrt.hal import DeviceType, Request, RequestArgument
from nnrt.drivers.reference import ReferenceDevice
from nnrt.drivers.sample import make_driver
from nnrt.service import protocol as p
from nnrt.service.client import ServiceDevice
from nnrt.memory import Memory
from nnrt.model.graph import DataLocation
from tests.conftest import start_service, stop

GUARD = 5.0  # seconds; a guard against hangs, not a timing assertion


def add_model(dims=(1, 4), out_dims=None, op=Op.ADD):
    return public_add_model(dims, out_dims, op).hal_model


def public_add_model(dims=(1, 4), out_dims=None, op=Op.ADD) -> nnrt.Model:
    """``add_model`` as an app builds it (for ``Runtime.compile``)."""
    m = nnrt.Model()
    a = m.add_operand(T.TENSOR_FLOAT32, list(dims))
    b = m.add_operand(T.TENSOR_FLOAT32, list(dims))
    act = m.add_operand(T.INT32)
    m.set_operand_value(act, 0)
    out = m.add_operand(T.TENSOR_FLOAT32, list(out_dims if out_dims is not None else dims))
    m.add_operation(op, [a, b, act], [out])
    m.identify_inputs_and_outputs([a, b], [out])
    return m.finish()


def chain_model(n, length):
    """out = a + b + b + ... (``length`` ADDs): slow enough to be caught mid-run."""
    m = nnrt.Model()
    a = m.add_operand(T.TENSOR_FLOAT32, [n])
    b = m.add_operand(T.TENSOR_FLOAT32, [n])
    act = m.add_operand(T.INT32)
    m.set_operand_value(act, 0)
    prev = a
    for _ in range(length):
        t = m.add_operand(T.TENSOR_FLOAT32, [n])
        m.add_operation(Op.ADD, [prev, b, act], [t])
        prev = t
    m.identify_inputs_and_outputs([a, b], [prev])
    return m.finish().hal_model


def scale_model(n=64):
    """out = x * w with a constant w big enough to live in a model pool."""
    m = nnrt.Model()
    x = m.add_operand(T.TENSOR_FLOAT32, [1, n])
    w = m.add_operand(T.TENSOR_FLOAT32, [1, n])
    m.set_operand_value(w, np.arange(n, dtype=np.float32).reshape(1, n))
    act = m.add_operand(T.INT32)
    m.set_operand_value(act, 0)
    out = m.add_operand(T.TENSOR_FLOAT32, [1, n])
    m.add_operation(Op.MUL, [x, w, act], [out])
    m.identify_inputs_and_outputs([x], [out])
    hal = m.finish().hal_model
    assert hal.pools, "the constant must travel in a pool"
    return hal


def numpy_request(inputs, outputs):
    pools = [a.reshape(-1).view(np.uint8) for a in (*inputs, *outputs)]
    args = [RequestArgument(False, DataLocation(k, 0, a.nbytes),
                            tuple(a.shape) if k < len(inputs) else ())
            for k, a in enumerate((*inputs, *outputs))]
    return Request(tuple(args[:len(inputs)]), tuple(args[len(inputs):]), tuple(pools))


async def test_every_hal_call_over_the_socket(reference_service):
    local = ReferenceDevice("remote-reference")
    dev = await ServiceDevice.connect(str(reference_service))
    try:
        assert (dev.name, dev.type, dev.version_string, dev.feature_level) == \
               (local.name, local.type, local.version_string, local.feature_level)
        assert dev.capabilities() == local.capabilities()
        assert dev.supported_extensions() == local.supported_extensions()
        assert dev.number_of_cache_files_needed() == local.number_of_cache_files_needed()
        model = add_model()
        assert await dev.supported_operations(model) == [True]

        prepared = await dev.prepare_model(model)
        x = np.arange(4, dtype=np.float32).reshape(1, 4)
        y = np.full((1, 4), 2, np.float32)
        out = np.zeros((1, 4), np.float32)
        result = await prepared.execute(numpy_request([x, y], [out]), measure=True)
        assert result.status == ErrorStatus.NONE, result.message
        assert out.tolist() == (x + y).tolist()
        assert result.output_shapes[0].dimensions == (1, 4)
        assert result.timing.in_driver >= result.timing.on_device

        # Memory pools pass by fd once, by id afterwards; outputs land in place.
        with Memory.create(48) as mem:
            mem.array(np.float32, 4)[:] = [1, 2, 3, 4]
            mem.array(np.float32, 4, 16)[:] = 10
            loc = lambda off: RequestArgument(False, DataLocation(0, off, 16), ())  # noqa: E731
            req = Request((loc(0), loc(16)), (loc(32),), (mem,))
            for _ in range(3):
                mem.array(np.float32, 4, 32)[:] = 0
                result = await prepared.execute(req)
                assert result.status == ErrorStatus.NONE, result.message
                assert mem.array(np.float32, 4, 32).tolist() == [11, 12, 13, 14]

        # execute_synchronously blocks its thread, not the loop.
        out[:] = 0
        result = await anyio.to_thread.run_sync(prepared.execute_synchronously,
                                                numpy_request([x, y], [out]))
        assert result.status == ErrorStatus.NONE and out.tolist() == (x + y).tolist()

        # A model whose constant lives in a pool (sent as an fd).
        scaled = await dev.prepare_model(scale_model())
        xs = np.ones((1, 64), np.float32)
        outs = np.zeros((1, 64), np.float32)
        assert (await scaled.execute(numpy_request([xs], [outs]))).status == ErrorStatus.NONE
        assert outs.tolist() == [list(range(64))]

        # Dynamic output shape: too small a buffer reports the needed shape.
        dyn = await dev.prepare_model(add_model((1, 4), out_dims=(0, 0)))
        small = np.zeros(2, np.float32)
        result = await dyn.execute(numpy_request([x, y], [small]))
        assert result.status == ErrorStatus.OUTPUT_INSUFFICIENT_SIZE
        assert result.output_shapes[0].dimensions == (1, 4)
        assert not result.output_shapes[0].is_sufficient

        # Bad requests and bad models are INVALID_ARGUMENT; the connection lives on.
        bad = await prepared.execute(numpy_request([x[:, :2], y], [out]))
        assert bad.status == ErrorStatus.INVALID_ARGUMENT
        # A region past the end of a staged pool lies inside the (larger)
        # staging arena, so only the client can tell: it refuses it.
        past_end = Request((RequestArgument(False, DataLocation(0, 8, 16), ()),
                            RequestArgument(False, DataLocation(1, 0, 16), ())),
                           (RequestArgument(False, DataLocation(2, 0, 16), ()),),
                           (x.view(np.uint8), y.view(np.uint8), out.view(np.uint8)))
        bad = await prepared.execute(past_end)
        assert bad.status == ErrorStatus.INVALID_ARGUMENT and "outside pool 0" in bad.message
        broken = model.__class__(model.main.__class__(model.main.operands, model.main.operations,
                                                      (0, 1, 7), model.main.output_indexes))
        with pytest.raises(NnrtError) as e:
            await dev.prepare_model(broken)
        assert e.value.status == ErrorStatus.INVALID_ARGUMENT

        prepared.release()
        released = await prepared.execute(numpy_request([x, y], [out]))
        assert released.status == ErrorStatus.INVALID_ARGUMENT
        again = dev.for_test_prepared_model(prepared.model_id)
        result = await again.execute(numpy_request([x, y], [out]))
        assert result.status == ErrorStatus.INVALID_ARGUMENT
        assert "does not belong" in result.message
        assert dev.alive
    finally:
        dev.close()
    assert not dev.alive
    with pytest.raises(NnrtError) as e:
        await dev.prepare_model(add_model())
    assert e.value.status == ErrorStatus.DEAD_OBJECT


async def test_sample_driver_claims_and_refuses(tmp_path):
    path = tmp_path / "partial.sock"
    proc = start_service(path, "sample-partial")
    try:
        dev = await ServiceDevice.connect(str(path))
        local = make_driver("sample-partial")
        assert dev.type == DeviceType.ACCELERATOR
        assert dev.capabilities() == local.capabilities()
        m = nnrt.Model()
        a = m.add_operand(T.TENSOR_FLOAT32, [1, 4])
        b = m.add_operand(T.TENSOR_FLOAT32, [1, 4])
        act = m.add_operand(T.INT32)
        m.set_operand_value(act, 0)
        s = m.add_operand(T.TENSOR_FLOAT32, [1, 4])
        beta = m.add_operand(T.FLOAT32)
        m.set_operand_value(beta, 1.0)
        out = m.add_operand(T.TENSOR_FLOAT32, [1, 4])
        m.add_operation(Op.ADD, [a, b, act], [s])
        m.add_operation(Op.SOFTMAX, [s, beta], [out])
        m.identify_inputs_and_outputs([a, b], [out])
        hal = m.finish().hal_model
        assert await dev.supported_operations(hal) == await local.supported_operations(hal) \
            == [True, False]
        with pytest.raises(NnrtError) as e:
            await dev.prepare_model(hal)
        assert e.value.status == ErrorStatus.INVALID_ARGUMENT and "SOFTMAX" in e.value.message
        dev.close()
    finally:
        stop(proc)


async def test_many_concurrent_executes(reference_service):
    dev = await ServiceDevice.connect(str(reference_service))
    try:
        prepared = await dev.prepare_model(add_model())
        ys = np.ones((1, 4), np.float32)
        xs = [np.full((1, 4), k, np.float32) for k in range(200)]
        outs = [np.zeros((1, 4), np.float32) for _ in xs]
        results = [None] * len(xs)
        # The reference driver queues at most 32 waiting jobs per app (then
        # RESOURCE_EXHAUSTED_TRANSIENT): keep 24 in flight at a time.
        in_flight = anyio.CapacityLimiter(24)

        async def one(k):
            async with in_flight:
                results[k] = await prepared.execute(numpy_request([xs[k], ys], [outs[k]]))

        with anyio.fail_after(GUARD * 4):
            async with anyio.create_task_group() as tg:
                for k in range(len(xs)):
                    tg.start_soon(one, k)
        assert all(r.status == ErrorStatus.NONE for r in results)
        assert all(o.tolist() == [[k + 1.0] * 4] for k, o in enumerate(outs))
    finally:
        dev.close()


async def test_sigkill_mid_execution_fails_every_pending_call_with_dead_object(tmp_path):
    path = tmp_path / "victim.sock"
    proc = start_service(path)
    try:
        dev = await ServiceDevice.connect(str(path))
        n = 1 << 20  # 4 MiB per operand, 32 operations: each execution takes a while
        prepared = await dev.prepare_model(chain_model(n, 32))
        x = np.ones(n, np.float32)
        results = []
        first_done = anyio.Event()

        async def one():
            out = np.zeros(n, np.float32)
            results.append(await prepared.execute(numpy_request([x, x], [out])))
            first_done.set()

        with anyio.fail_after(GUARD * 4):
            async with anyio.create_task_group() as tg:
                for _ in range(24):  # under the reference driver's queue limit
                    tg.start_soon(one)
                await first_done.wait()
                os.kill(proc.pid, signal.SIGKILL)
                killed = time.monotonic()
        elapsed = time.monotonic() - killed
        statuses = [r.status for r in results]
        assert len(statuses) == 24
        assert set(statuses) <= {ErrorStatus.NONE, ErrorStatus.DEAD_OBJECT}
        assert statuses.count(ErrorStatus.DEAD_OBJECT) > 0
        assert elapsed < GUARD
        assert not dev.alive
        # Later calls fail at once, without touching the socket.
        late = await prepared.execute(numpy_request([x, x], [np.zeros(n, np.float32)]))
        assert late.status == ErrorStatus.DEAD_OBJECT
        with pytest.raises(NnrtError) as e:
            await dev.supported_operations(add_model())
        assert e.value.status == ErrorStatus.DEAD_OBJECT
        dev.close()
    finally:
        proc.kill()
        proc.wait()


OTHER_CLIENT = textwrap.dedent("""
    import asyncio, sys
    import numpy as np
    from nnrt.hal import Request, RequestArgument
    from nnrt.service.client import ServiceDevice
    from nnrt.model.graph import DataLocation

    async def main(path, model_id):
        dev = await ServiceDevice.connect(path)
        buf = np.zeros(12, np.float32).view(np.uint8)
        arg = lambda k: RequestArgument(False, DataLocation(0, 16 * k, 16), ())
        result = await dev.for_test_prepared_model(model_id).execute(
            Request((arg(0), arg(1)), (arg(2),), (buf,)))
        print(result.status.name, result.message)
        dev.close()

    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
""")


async def test_two_client_processes_cannot_use_each_others_prepared_models(reference_service):
    dev = await ServiceDevice.connect(str(reference_service))
    try:
        prepared = await dev.prepare_model(add_model())
        other = await anyio.run_process([sys.executable, "-c", OTHER_CLIENT,
                                         str(reference_service), str(prepared.model_id)],
                                        check=False)
        assert other.returncode == 0, other.stderr.decode()
        status, _, message = other.stdout.decode().strip().partition(" ")
        assert status == "INVALID_ARGUMENT", other.stdout
        assert "does not belong" in message
        # ... and the owner still uses it.
        x = np.ones((1, 4), np.float32)
        out = np.zeros((1, 4), np.float32)
        assert (await prepared.execute(numpy_request([x, x], [out]))).status == ErrorStatus.NONE
        assert out.tolist() == [[2.0] * 4]
    finally:
        dev.close()


def _read_reply(sock):
    """One reply frame, or None when the service closed the connection."""
    head = _read_exact(sock, p.FRAME_HEADER_SIZE)
    if head is None:
        return None
    length, _ = struct.unpack("<IB", head)
    body = _read_exact(sock, length)
    return None if body is None else p.decode_body(body)


def _read_exact(sock, n):
    data = b""
    while len(data) < n:
        try:
            chunk = sock.recv(n - len(data))
        except ConnectionResetError:
            return None
        if not chunk:
            return None
        data += chunk
    return data


def _fuzz_frames(rng, count):
    model = add_model()
    arg = RequestArgument(False, DataLocation(0, 0, 16), ())
    valid = [p.encode(m)[0][p.FRAME_HEADER_SIZE:] for m in (
        p.Hello(1), p.Query(2, p.Method.CAPABILITIES), p.ReleaseModel(3, 1),
        p.SupportedOperations(4, model),
        p.PrepareModel(5, model, nnrt.ExecutionPreference.LOW_POWER, nnrt.Priority.LOW, None),
        p.Execute(6, 1, (arg, arg), (arg,), (p.WirePool(1, None, True, 0, 48, 0, 48),)),
        p.Cancel(7, 6))]
    for _ in range(count):
        roll = rng.random()
        if roll < 0.4:
            body = rng.randbytes(rng.randrange(0, 64))
        elif roll < 0.97:
            body = bytearray(rng.choice(valid))
            for _ in range(rng.randrange(1, 4)):
                body[rng.randrange(len(body))] = rng.randrange(256)
            if rng.random() < 0.2:
                body = body[:rng.randrange(len(body))]
            elif rng.random() < 0.1:
                body += rng.randbytes(rng.randrange(1, 8))
        elif roll < 0.985:
            yield struct.pack("<IB", p.MAX_FRAME + rng.randrange(1, 1 << 20), 0), True
            continue
        else:
            body = rng.choice(valid)
            yield struct.pack("<IB", len(body), rng.randrange(1, 9)) + body, True
            continue
        yield struct.pack("<IB", len(body), 0) + bytes(body), False


def _fuzz(path, count, seed):
    rng = random.Random(seed)
    answered = dropped = 0
    sock = None
    for frame, fatal in _fuzz_frames(rng, count):
        if sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(GUARD)
            sock.connect(path)
            if rng.random() < 0.5:  # half the connections get past HELLO first
                sock.sendall(p.encode(p.Hello(0))[0])
                assert _read_reply(sock).status == ErrorStatus.NONE
        try:
            sock.sendall(frame)
            reply = _read_reply(sock)
        except (BrokenPipeError, ConnectionResetError):
            reply = None
        if reply is not None:
            answered += 1
        if reply is None or fatal:
            dropped += reply is None
            sock.close()
            sock = None
    if sock is not None:
        sock.close()
    return answered, dropped


async def test_service_survives_ten_thousand_random_and_mutated_frames(tmp_path):
    path = tmp_path / "fuzz.sock"
    proc = start_service(path)
    try:
        good = await ServiceDevice.connect(str(path))
        answered, dropped = await anyio.to_thread.run_sync(_fuzz, str(path), 10_000, 1234)
        assert answered + dropped >= 10_000 and answered > 9_000
        assert proc.poll() is None, "the service died"
        # The good client, connected all along, and a new one both still work.
        fresh = await ServiceDevice.connect(str(path))
        for dev in (good, fresh):
            prepared = await dev.prepare_model(add_model())
            x = np.ones((1, 4), np.float32)
            out = np.zeros((1, 4), np.float32)
            result = await prepared.execute(numpy_request([x, x], [out]))
            assert result.status == ErrorStatus.NONE and out.tolist() == [[2.0] * 4]
            dev.close()
    finally:
        stop(proc)


def test_malformed_frames_get_invalid_argument_and_huge_ones_close_only_that_connection(
        reference_service):
    def connect():
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(GUARD)
        s.connect(str(reference_service))
        return s

    with connect() as s:
        s.sendall(p.encode(p.Query(7, p.Method.CAPABILITIES))[0])  # before HELLO
        reply = _read_reply(s)
        assert (reply.call_id, reply.method, reply.status) == \
               (7, p.Method.ERROR, ErrorStatus.INVALID_ARGUMENT)
        assert "IDLE" in reply.message
        body = struct.pack("<BBQ", p.Kind.CALL, 99, 8)  # unknown method
        s.sendall(struct.pack("<IB", len(body), 0) + body)
        reply = _read_reply(s)
        assert reply.call_id == 8 and "unknown method" in reply.message
        s.sendall(p.encode(p.Hello(9))[0])
        assert _read_reply(s).value.name == "remote-reference"
        with connect() as other:
            other.sendall(struct.pack("<IB", 1 << 31, 0))
            reply = _read_reply(other)
            assert reply.status == ErrorStatus.INVALID_ARGUMENT and "exceeds" in reply.message
            assert _read_reply(other) is None  # closed
        s.sendall(p.encode(p.Query(10, p.Method.NUMBER_OF_CACHE_FILES))[0])
        # the first connection is unaffected (the reference keeps one model cache file)
        assert _read_reply(s).value == (1, 0)


def test_the_client_works_on_trio(reference_service):
    trio = pytest.importorskip("trio")

    async def main():
        dev = await ServiceDevice.connect(str(reference_service))
        prepared = await dev.prepare_model(add_model())
        x = np.ones((1, 4), np.float32)
        outs = [np.zeros((1, 4), np.float32) for _ in range(8)]
        results = []

        async def one(out):
            results.append(await prepared.execute(numpy_request([x, x], [out])))

        async with trio.open_nursery() as nursery:
            for out in outs:
                nursery.start_soon(one, out)
        dev.close()
        return results, outs

    results, outs = trio.run(main)
    assert [r.status for r in results] == [ErrorStatus.NONE] * 8
    assert all(o.tolist() == [[2.0] * 4] for o in outs)


async def test_peer_credentials_and_cleanup_when_a_client_goes(tmp_path):
    from nnrt.service.server import serve
    path = str(tmp_path / "inproc.sock")
    async with anyio.create_task_group() as tg:
        service = await tg.start(serve, ReferenceDevice("inproc"), path)
        dev = await ServiceDevice.connect(path)
        await dev.prepare_model(add_model())
        await dev.prepare_model(add_model())
        (conn,) = service.connections
        assert (conn.peer.pid, conn.peer.uid) == (os.getpid(), os.getuid())
        assert service.statistics().prepared_models == 2
        dev.close()
        with anyio.fail_after(GUARD):
            while service.connections:
                await anyio.sleep(0.01)
        stats = service.statistics()
        assert stats.prepared_models == 0 and stats.connections_total == 1
        tg.cancel_scope.cancel()
    assert not os.path.exists(path)


async def test_replies_to_a_client_that_stops_reading_wait_whole_and_block_nobody(tmp_path):
    """A client that sends 800 executions and reads nothing fills its socket:
    nothing blocks on it (another client's execution still runs on the one
    slot), its replies wait for its socket, and when the client reads, every
    reply is there, whole, once."""
    from nnrt.service.server import serve
    from nnrt.qos.front import ScheduledDevice
    from .test_hostile_bursts_and_memory import HostileApp, memory_request
    path = str(tmp_path / "inproc.sock")
    n = 800
    async with anyio.create_task_group() as tg:
        service = await tg.start(serve, ScheduledDevice(ReferenceDevice("inproc"), slots=1),
                                 path)
        # The raw client blocks: it runs on a thread, this loop serves.
        app = await anyio.to_thread.run_sync(HostileApp, path)
        witness = await ServiceDevice.connect(path)
        try:
            model_id = await anyio.to_thread.run_sync(app.prepare)
            with Memory.create(48) as mem:
                request = memory_request(mem)
                first = next(app.ids)

                def flood():
                    for k in range(n):
                        pool = p.WirePool(1, mem.fileno() if k == 0 else None, True,
                                          mem.fd_offset, mem.size, 0, mem.size)
                        app.send(p.Execute(first + k, model_id, request.inputs,
                                           request.outputs, (pool,), (), False, None, None))
                await anyio.to_thread.run_sync(flood)
                with anyio.fail_after(4 * GUARD):
                    while service.statistics().calls < n + 2 or any(
                            c._in_flight for c in service.connections):
                        await anyio.sleep(0.01)
                # Every execution ran, though the socket cannot take all replies.
                prepared = await witness.prepare_model(add_model())
                x = np.ones((1, 4), np.float32)
                out = np.zeros((1, 4), np.float32)
                with anyio.fail_after(GUARD):
                    result = await prepared.execute(numpy_request([x, x], [out]))
                assert result.status == ErrorStatus.NONE and out.tolist() == [[2.0] * 4]
                got = {}
                with anyio.fail_after(4 * GUARD):
                    while len(got) < n:
                        m = await anyio.to_thread.run_sync(app.next_message)
                        assert m.call_id not in got
                        got[m.call_id] = m
            assert sorted(got) == list(range(first, first + n))
            assert all(m.status == ErrorStatus.NONE for m in got.values())
        finally:
            app.close()
            witness.close()
        tg.cancel_scope.cancel()


def _one_op_model(op, type_, **quant):
    m = nnrt.Model()
    a = m.add_operand(type_, [1, 4], **quant)
    b = m.add_operand(type_, [1, 4], **quant)
    act = m.add_operand(T.INT32)
    m.set_operand_value(act, 0)
    out = m.add_operand(type_, [1, 4], **quant)
    m.add_operation(op, [a, b, act], [out])
    m.identify_inputs_and_outputs([a, b], [out])
    return m.finish().hal_model


@pytest.mark.parametrize("kind, float_add, quant_add, float_sub", [
    ("sample-float-fast", True, False, True),
    ("sample-float-slow", True, False, True),
    ("sample-minimal", True, True, False),
    ("sample-quant", False, True, False),
    ("sample-partial", True, True, True),
])
def test_sample_drivers_claim_what_their_table_says(kind, float_add, quant_add, float_sub):
    dev = make_driver(kind)
    quant = {"scale": 0.5, "zero_point": 0}

    def supported(model):
        return anyio.run(dev.supported_operations, model)
    assert supported(_one_op_model(Op.ADD, T.TENSOR_FLOAT32)) == [float_add]
    assert supported(_one_op_model(Op.ADD, T.TENSOR_QUANT8_ASYMM, **quant)) == [quant_add]
    assert supported(_one_op_model(Op.SUB, T.TENSOR_FLOAT32)) == [float_sub]
    perf = dev.capabilities().performance(T.TENSOR_FLOAT32)
    assert perf.exec_time == {"sample-float-fast": 0.5, "sample-float-slow": 2.0}.get(
        kind, perf.exec_time)


def test_fds_sent_with_malformed_or_refused_calls_are_closed(tmp_path):
    import array
    path = tmp_path / "fds.sock"
    proc = start_service(path)
    try:
        fd_dir = f"/proc/{proc.pid}/fd"
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(GUARD)
        s.connect(str(path))
        s.sendall(p.encode(p.Hello(1))[0])
        _read_reply(s)
        before = len(os.listdir(fd_dir))
        arg = RequestArgument(False, DataLocation(0, 0, 16), ())
        with Memory.create(64) as mem:
            fds = array.array("i", [mem.fileno()])
            garbage = struct.pack("<BBQ", p.Kind.CALL, p.Method.EXECUTE, 5) + b"\xff" * 7
            refused, _ = p.encode(p.Execute(6, 12345, (arg, arg), (arg,),
                                            (p.WirePool(1, mem.fileno(), True, 0, 64, 0, 64),)))
            for _ in range(50):
                for frame in (struct.pack("<IB", len(garbage), 1) + garbage, refused):
                    s.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
                    assert _read_reply(s).status == ErrorStatus.INVALID_ARGUMENT
        assert len(os.listdir(fd_dir)) == before
        s.close()
    finally:
        stop(proc)


def test_a_frame_larger_than_the_socket_buffer_does_not_block_the_sender():
    """The client writes what the socket takes at once and leaves the rest
    (with its own copies of the fds) to a worker thread: the caller returns
    before the service has read anything, and frames keep their order."""
    from nnrt.service.client import _Channel
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    channel = _Channel(ours, "a test peer")
    big = bytes(range(256)) * (16 << 12)        # 16 MiB, far more than the socket buffer
    r, w = os.pipe()
    try:
        def send_both():
            channel.send_only(lambda proto: (big, []))
            channel.send_only(lambda proto: (b"second", [r]))

        sender = threading.Thread(target=send_both)
        sender.start()
        sender.join(GUARD)
        assert not sender.is_alive(), "sending waited for the peer to read"
        os.close(r)     # the backlog holds its own duplicate until it is sent
        got, fds = bytearray(), []
        theirs.settimeout(GUARD)
        while len(got) < len(big) + 6:
            data, anc, _flags, _ = theirs.recvmsg(1 << 20, socket.CMSG_SPACE(16))
            assert data, "the channel closed the connection"
            if anc:
                fds += list(struct.unpack(f"{len(anc[0][2]) // 4}i", anc[0][2]))
                assert len(got) + len(data) > len(big), "the fd rides with its own frame"
            got += data
        assert bytes(got[:len(big)]) == big and bytes(got[len(big):]) == b"second"
        assert len(fds) == 1
        os.write(w, b"!")
        assert os.read(fds[0], 1) == b"!"
        os.close(fds[0])
    finally:
        os.close(w)
        channel.close()
        theirs.close()


async def test_a_compiled_model_collected_under_its_channels_send_lock_is_released_later(
        reference_service):
    # The collector runs a finalizer on whatever thread allocates, maybe one
    # inside the channel's send lock: releasing there would wait for itself.
    import gc
    import weakref
    from nnrt.service.client import ServicePreparedModel
    dev = await ServiceDevice.connect(str(reference_service))
    try:
        async with nnrt.Runtime(devices=[dev]) as rt:
            held = [await rt.compile(public_add_model())]
            [model_id] = [step.prepared.model_id for step in held[0]._steps]
            gone = weakref.ref(held[0])
            collected = threading.Event()

            def collect_under_the_lock():
                with dev._channel._lock:
                    held.clear()
                    gc.collect()
                    if gone() is None:
                        collected.set()

            collector = threading.Thread(target=collect_under_the_lock, daemon=True)
            collector.start()
            collector.join(GUARD)
            assert not collector.is_alive(), "the finalizer waited for the lock its thread held"
            assert collected.is_set()
            # The release went out once the lock was free: the service no
            # longer knows the model.
            x = np.ones((1, 4), np.float32)
            out = np.zeros((1, 4), np.float32)
            stale = ServicePreparedModel(dev, model_id)
            with anyio.fail_after(GUARD):
                while (result := await stale.execute(numpy_request([x, x], [out]))).status \
                        == ErrorStatus.NONE:
                    await anyio.sleep(0.01)
            assert result.status == ErrorStatus.INVALID_ARGUMENT, result
            # The channel is fine: a new compilation runs on it.
            again = await rt.compile(public_add_model())
            assert (await again.execute([x, x])).outputs[0].tolist() == [[2.0] * 4]
    finally:
        dev.close()


def test_the_service_keeps_what_it_set_up_out_of_the_garbage_collector(tmp_path):
    # A full pass of the collector walks every object it tracks: the ~40k of
    # the service's setup (modules, driver, policy), which live as long as it
    # does, stalled its loop and job threads 9-28 ms mid-execution. They are
    # frozen once it listens (docs/design/scheduler.md).
    path = str(tmp_path / "gc.sock")
    proc = subprocess.Popen([sys.executable, "-m", "nnrt", "driver", "serve", "gc", "--driver",
                             "reference", "--socket", path], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, NNRT_VLOG="driver"))
    try:
        assert "listening" in proc.stdout.readline()   # printed after the freeze
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=10)
    frozen = [int(line.split(": ")[-1].split()[0]) for line in err.splitlines()
              if "kept out of the garbage collector's passes" in line]
    assert len(frozen) == 1 and frozen[0] > 1000, err


async def test_an_app_that_leaves_leaves_the_statistics(tmp_path):
    """When an app's last connection closes, its rows go from STATISTICS
    (nnrt driver status) once its last job ends; its finished jobs stay in
    the recent history."""
    from nnrt.service.server import serve
    path = str(tmp_path / "leaving.sock")
    async with anyio.create_task_group() as tg:
        service = await tg.start(serve, ReferenceDevice("leaving"), path)
        first = await ServiceDevice.connect(path)
        prepared = await first.prepare_model(add_model())
        x = np.ones((1, 4), np.float32)
        out = np.zeros((1, 4), np.float32)
        assert (await prepared.execute(numpy_request([x, x], [out]))).status == ErrorStatus.NONE
        assert len((await first.statistics()).classes) == 1
        first.close()
        with anyio.fail_after(GUARD):
            while service.connections:
                await anyio.sleep(0.01)
        second = await ServiceDevice.connect(path)     # the same app (uid), back
        try:
            assert (await second.statistics()).classes == ()
            assert len(await second.finished_jobs()) == 1
        finally:
            second.close()
            tg.cancel_scope.cancel()
