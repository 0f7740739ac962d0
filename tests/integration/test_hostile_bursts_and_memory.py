"""A hostile app against a real `nnrt driver serve` process: rings that are
too small, fds that are not what they claim, saturated and scribbled rings,
memfds that shrink under the service. After each attack the service is alive
and a second client, connected all along, still gets correct results; the
service's fd count is back where it started.

The hostile app speaks the control protocol with raw frames and real fds
(its own socket, eventfds, memfds, pipes, folders), as any program could.
"""
import array
import contextlib
import itertools
import os
import socket
import struct

import anyio
import numpy as np
import pytest

from nnrt import ErrorStatus
from nnrt.burst import wire
from nnrt.service import protocol as p
from nnrt.service.client import ServiceDevice
from nnrt.fmq import Ring
from nnrt.fmq.ring import READ_OFFSET
from nnrt.hal import Request, RequestArgument
from nnrt.memory import Memory
from nnrt.model.graph import DataLocation
import nnrt

from tests.conftest import start_service

from .test_service import GUARD, add_model, numpy_request

X = np.arange(4, dtype=np.float32).reshape(1, 4)


class HostileApp:
    """Raw frames and fds over the service's socket, read back in order."""

    def __init__(self, path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(GUARD)
        self.sock.connect(str(path))
        self.ids = itertools.count(1)
        self.others = []          # messages that were not the awaited reply
        assert self.call(lambda cid: p.Hello(cid)).status == ErrorStatus.NONE

    def send(self, message):
        data, fds = p.encode(message)
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        self.sock.sendmsg([data], anc)

    def next_message(self):
        head = self._exact(p.FRAME_HEADER_SIZE)
        length, _nfds = struct.unpack("<IB", head)
        return p.decode_body(self._exact(length))

    def call(self, build):
        call_id = next(self.ids)
        self.send(build(call_id))
        while True:
            message = self.next_message()
            if isinstance(message, p.Reply) and message.call_id == call_id:
                return message
            self.others.append(message)

    def prepare(self):
        reply = self.call(lambda cid: p.PrepareModel(
            cid, add_model(), nnrt.ExecutionPreference.FAST_SINGLE_ANSWER, nnrt.Priority.MEDIUM,
            None))
        assert reply.status == ErrorStatus.NONE, reply.message
        return reply.value

    def configure_burst(self, model_id, fds):
        return self.call(lambda cid: p.ConfigureBurst(cid, model_id, tuple(fds)))

    @contextlib.contextmanager
    def raw_burst(self, model_id):
        """A burst on two pure-Python rings of our own (their waiter flags
        stay at "always wake me"): ``(requests, results, burst id)``."""
        with Ring.create(1 << 16, native=False) as requests, \
                Ring.create(1 << 18, native=False) as results:
            reply = self.configure_burst(model_id, requests.fds() + results.fds())
            assert reply.status == ErrorStatus.NONE, reply.message
            yield requests, results, reply.value

    def close(self):
        self.sock.close()

    def _exact(self, n):
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            assert chunk, "the service closed the connection"
            data += chunk
        return data


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    path = tmp_path_factory.mktemp("hostile") / "reference.sock"
    proc = start_service(path, "reference", "hostile-reference")
    yield path, proc
    assert proc.poll() is None, "the service died"
    proc.terminate()
    assert proc.wait(10) == 0, "SIGTERM ends the service cleanly (no thread wedged)"
    assert not path.exists()


@pytest.fixture(scope="module")
def witness(service):
    """A second client, connected all along, with a prepared ADD."""
    path, _ = service

    async def connect():
        dev = await ServiceDevice.connect(str(path))
        prepared = await dev.prepare_model(add_model())
        # One execution now, so the witness's staging arena is mapped in the
        # service before any test counts the service's fds.
        await assert_still_served(service, prepared)
        return dev, prepared
    dev, prepared = anyio.run(connect)
    yield prepared
    dev.close()


async def assert_still_served(service, witness):
    _, proc = service
    assert proc.poll() is None, "the service died"
    out = np.zeros((1, 4), np.float32)
    with anyio.fail_after(GUARD):
        result = await witness.execute(numpy_request([X, X], [out]))
    assert result.status == ErrorStatus.NONE, result.message
    assert out.tolist() == (2 * X).tolist()


def fd_count(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


async def read_results(results, n):
    """The next ``n`` results of a raw burst's result ring, in order."""
    got = []
    with anyio.fail_after(GUARD):    # a guard against hangs, not a timing
        while len(got) < n:
            try:
                got.append(wire.decode_result(results.read_nowait()))
            except anyio.WouldBlock:
                await anyio.sleep(0.005)
    return got


async def settle_fds(pid, expected):
    """The service closes what it refused as the reply goes out: wait for it."""
    with anyio.move_on_after(GUARD):
        while fd_count(pid) != expected:
            await anyio.sleep(0.01)
    assert fd_count(pid) == expected


def not_an_eventfd(kind, tmp_path, keep):
    if kind == "directory":
        fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    elif kind == "/dev/null":
        fd = os.open("/dev/null", os.O_RDWR)
    elif kind == "socket":
        a, b = socket.socketpair()
        keep.append(b.detach())
        fd = a.detach()
    elif kind == "pipe":
        fd, w = os.pipe()
        keep.append(w)
    else:  # a blocking eventfd: any holder could saturate it and block our writes
        fd = os.eventfd(0)
    keep.append(fd)
    return fd


async def test_result_rings_too_small_for_a_result_are_refused(service, witness):
    """Crash of issue 23: max_frame 0, or a 64-byte ring, used to end the
    whole service with FrameTooLarge at the first result."""
    path, proc = service
    app = HostileApp(path)
    try:
        model_id = app.prepare()
        await assert_still_served(service, witness)   # its staging arena is mapped by now
        before = fd_count(proc.pid)
        for make in (lambda: Ring.create(1 << 18, max_frame=0), lambda: Ring.create(64),
                     lambda: Ring.create(1 << 12)):
            with Ring.create(1 << 12) as requests, make() as results:
                reply = app.configure_burst(model_id, requests.fds() + results.fds())
                assert reply.status == ErrorStatus.INVALID_ARGUMENT
                assert "result ring" in reply.message and str(wire.MAX_RESULT_SIZE) in reply.message
                # and a request written anyway gets no result and breaks nothing
                requests.write_nowait(wire.encode_request(wire.BurstRequest(1, (), (), ())))
            await assert_still_served(service, witness)
        await settle_fds(proc.pid, before)
    finally:
        app.close()


@pytest.mark.parametrize("kind", ["directory", "/dev/null", "socket", "pipe",
                                  "blocking eventfd"])
@pytest.mark.parametrize("slot", [1, 2, 4, 5])
async def test_a_ring_eventfd_that_is_not_one_is_refused(service, witness, kind, slot, tmp_path):
    """Crash of issue 23: Ring.attach never checked its eventfds."""
    path, proc = service
    app = HostileApp(path)
    keep = []
    try:
        model_id = app.prepare()
        await assert_still_served(service, witness)   # its staging arena is mapped by now
        before = fd_count(proc.pid)
        with Ring.create(1 << 12) as requests, Ring.create(1 << 18) as results:
            fds = list(requests.fds() + results.fds())
            fds[slot] = not_an_eventfd(kind, tmp_path, keep)
            reply = app.configure_burst(model_id, fds)
        assert reply.status == ErrorStatus.INVALID_ARGUMENT, reply
        assert "eventfd" in reply.message
        await assert_still_served(service, witness)
        await settle_fds(proc.pid, before)
    finally:
        for fd in keep:
            os.close(fd)
        app.close()


async def test_an_unsealed_ring_memfd_is_refused(service, witness):
    path, _ = service
    app = HostileApp(path)
    try:
        model_id = app.prepare()
        with Ring.create(1 << 12) as requests, Ring.create(1 << 18) as results:
            unsealed = os.memfd_create("ring", os.MFD_ALLOW_SEALING)
            try:
                os.ftruncate(unsealed, os.fstat(results.fds()[0]).st_size)
                os.write(unsealed, os.pread(results.fds()[0], 384, 0))
                reply = app.configure_burst(model_id, requests.fds() +
                                            (unsealed,) + results.fds()[1:])
            finally:
                os.close(unsealed)
        assert reply.status == ErrorStatus.INVALID_ARGUMENT and "sealed" in reply.message
        await assert_still_served(service, witness)
    finally:
        app.close()


async def test_saturated_eventfds_do_not_wedge_the_burst_thread(service, witness):
    """Wedge of issue 23: with blocking eventfds, a saturated counter froze
    the service's burst thread at its first signalling write (and its clean
    shutdown with it). Both eventfds the service writes are saturated here,
    and are kept so: the app never reads them."""
    path, _ = service
    app = HostileApp(path)
    try:
        model_id = app.prepare()
        # Pure-Python ends keep their waiter flags at "always wake me", so the
        # service signals on every frame, whatever the timing.
        with app.raw_burst(model_id) as (requests, results, burst_id):
            for efd in (requests.fds()[2], results.fds()[1]):   # the service signals these
                os.eventfd_write(efd, 2**64 - 2)
            n = 20
            for serial in range(1, n + 1):
                requests.write_nowait(wire.encode_request(wire.BurstRequest(serial, (), (), ())))
            got = await read_results(results, n)
            assert [r.serial for r in got] == list(range(1, n + 1))
            # no inputs for an ADD: each execution is refused by the driver, and answered
            assert {r.status for r in got} == {ErrorStatus.INVALID_ARGUMENT}
            assert app.call(lambda cid: p.ReleaseBurst(cid, burst_id)).status == ErrorStatus.NONE
        await assert_still_served(service, witness)
    finally:
        app.close()


async def test_a_ring_eventfd_made_blocking_later_wedges_only_that_burst_until_released(
        service, witness):
    """The app shares the eventfds' open file descriptions with the service:
    it can clear O_NONBLOCK after CONFIGURE_BURST and saturate the counters,
    so the service's next signalling write blocks. Only that burst's thread
    waits (the write releases the GIL): the service serves everyone, and
    RELEASE_BURST drains the eventfds so the thread returns and everything
    of the burst is closed."""
    path, proc = service
    app = HostileApp(path)
    try:
        model_id = app.prepare()
        await assert_still_served(service, witness)
        before = fd_count(proc.pid)
        with Ring.create(1 << 16, native=False) as requests, \
                Ring.create(1 << 18, native=False) as results:
            reply = app.configure_burst(model_id, requests.fds() + results.fds())
            burst_id = reply.value
            for efd in (requests.fds()[2], results.fds()[1]):   # the service signals these
                os.set_blocking(efd, True)                        # for both of us: one description
                os.eventfd_write(efd, 2**64 - 2)
            for serial in range(1, 4):
                requests.write_nowait(wire.encode_request(wire.BurstRequest(serial, (), (), ())))
            await anyio.sleep(0.2)          # the burst thread is blocked in write(2) by now
            for _ in range(3):
                await assert_still_served(service, witness)
            assert app.call(lambda cid: p.ReleaseBurst(cid, burst_id)).status == ErrorStatus.NONE
            await settle_fds(proc.pid, before)   # the thread returned: the rings are closed
        await assert_still_served(service, witness)
    finally:
        app.close()


async def test_a_scribbled_result_ring_ends_that_burst_and_tells_its_app(service, witness):
    """The app owns the result ring's read counter: an impossible value ends
    that burst (BURST_ENDED to the app), not the service."""
    path, _ = service
    app = HostileApp(path)
    try:
        model_id = app.prepare()
        with Ring.create(1 << 16) as requests, Ring.create(1 << 18) as results:
            reply = app.configure_burst(model_id, requests.fds() + results.fds())
            burst_id = reply.value
            counters = memoryview(results._mm).cast("Q")
            counters[READ_OFFSET // 8] = 1 << 40
            counters.release()
            requests.write_nowait(wire.encode_request(wire.BurstRequest(1, (), (), ())))
            ended = app.next_message()
            assert isinstance(ended, p.BurstEnded) and ended.burst_id == burst_id
            assert "out of sync" in ended.reason
        await assert_still_served(service, witness)
        # the same connection still works
        assert app.call(lambda cid: p.Query(cid, p.Method.CAPABILITIES)).status == \
            ErrorStatus.NONE
    finally:
        app.close()


def unsealed_memory(size=64):
    fd = os.memfd_create("unsealed", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    return fd, Memory.from_fd(fd)


def memory_request(mem, n=4):
    size = 4 * n
    return Request((RequestArgument(False, DataLocation(0, 0, size), (1, n)),
                    RequestArgument(False, DataLocation(0, size, size), (1, n))),
                   (RequestArgument(False, DataLocation(0, 2 * size, size)),), (mem,))


async def test_an_unsealed_request_pool_is_refused_and_truncating_it_harms_nobody(
        service, witness):
    """SIGBUS of issue 23: the service mapped an unsealed memfd; the app
    truncated it and the next execution killed the service."""
    path, _ = service
    dev = await ServiceDevice.connect(str(path))
    fd, mem = unsealed_memory()
    try:
        prepared = await dev.prepare_model(add_model())
        for _ in range(2):
            result = await prepared.execute(memory_request(mem))
            assert result.status == ErrorStatus.INVALID_ARGUMENT
            assert "F_SEAL_SHRINK" in result.message and "Memory.create" in result.message
            os.ftruncate(fd, 0)
            await assert_still_served(service, witness)
            os.ftruncate(fd, 64)
        with Memory.create(64) as sealed:   # what the message says to use works
            sealed.array(np.float32, 8)[:] = 1
            assert (await prepared.execute(memory_request(sealed))).status == ErrorStatus.NONE
            assert sealed.array(np.float32, 4, 32).tolist() == [2.0] * 4
    finally:
        mem.close()
        os.close(fd)
        dev.close()


async def test_an_unsealed_constant_pool_is_refused(service, witness):
    path, _ = service
    dev = await ServiceDevice.connect(str(path))
    fd, mem = unsealed_memory(16)
    try:
        m = nnrt.Model()
        a = m.add_operand(nnrt.OperandType.TENSOR_FLOAT32, [1, 4])
        b = m.add_operand(nnrt.OperandType.TENSOR_FLOAT32, [1, 4])
        act = m.add_operand(nnrt.OperandType.INT32)
        m.set_operand_value(act, 0)
        out = m.add_operand(nnrt.OperandType.TENSOR_FLOAT32, [1, 4])
        m.set_operand_value_from_memory(b, mem, 0, 16)
        m.add_operation(nnrt.OperationType.ADD, [a, b, act], [out])
        m.identify_inputs_and_outputs([a], [out])
        with pytest.raises(nnrt.NnrtError) as e:
            await dev.prepare_model(m.finish().hal_model)
        assert e.value.status == ErrorStatus.INVALID_ARGUMENT and "sealed" in e.value.message
        os.ftruncate(fd, 0)
        await assert_still_served(service, witness)
    finally:
        mem.close()
        os.close(fd)
        dev.close()


async def test_an_unsealed_burst_slot_fails_that_execution_and_the_burst_goes_on(
        service, witness):
    path, _ = service
    dev = await ServiceDevice.connect(str(path))
    fd, mem = unsealed_memory()
    try:
        prepared = await dev.prepare_model(add_model())
        async with await prepared.configure_burst() as session:
            result = await session.execute(memory_request(mem))
            assert result.status == ErrorStatus.INVALID_ARGUMENT and "sealed" in result.message
            os.ftruncate(fd, 0)
            with Memory.create(64) as sealed:
                sealed.array(np.float32, 8)[:] = 2
                assert (await session.execute(memory_request(sealed))).status == \
                    ErrorStatus.NONE
                assert sealed.array(np.float32, 4, 32).tolist() == [4.0] * 4
        await assert_still_served(service, witness)
    finally:
        mem.close()
        os.close(fd)
        dev.close()
