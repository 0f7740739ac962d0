"""Memory domains over a real driver service process: the token travels,
the data does not. A buffer written by one execution is the next one's
input; another app's token, an undeclared role and a never-written buffer
are refused; a buffer of unknown dimensions is resized by the service;
copies go both ways through shared memory."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import nnrt
from nnrt import ErrorStatus, NnrtError, OperandType as T, OperationType as Op
from nnrt.service.client import ServiceDevice
from nnrt.hal import BufferDesc, BufferRole, Request, RequestArgument
from nnrt.memory import DeviceToken, Memory
from nnrt.model.graph import DataLocation
from tests.conftest import start_service, stop

N = 16384   # floats of state: 64 KiB, far more than any control message may carry


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    path = tmp_path_factory.mktemp("memdom") / "reference.sock"
    proc = start_service(path, "reference", "memdom-reference")
    yield path
    stop(proc)


@pytest.fixture(scope="module")
def pid_service(tmp_path_factory):
    """A service whose apps are processes (--app-key pid, the default said
    out loud), so a second process of ours is another app."""
    path = tmp_path_factory.mktemp("memdom-pid") / "reference.sock"
    proc = start_service(path, "reference", "memdom-pid", "--app-key", "pid")
    yield path
    stop(proc)


@pytest.fixture(scope="module")
def uid_service(tmp_path_factory):
    """A service whose apps are users (--app-key uid), so a second process
    of ours is the same app."""
    path = tmp_path_factory.mktemp("memdom-uid") / "reference.sock"
    proc = start_service(path, "reference", "memdom-uid", "--app-key", "uid")
    yield path
    stop(proc)


def add_model(dims):
    """out = state + x."""
    m = nnrt.Model()
    a = m.add_operand(T.TENSOR_FLOAT32, list(dims))
    b = m.add_operand(T.TENSOR_FLOAT32, list(dims))
    act = m.add_operand(T.INT32)
    m.set_operand_value(act, 0)
    out = m.add_operand(T.TENSOR_FLOAT32, list(dims))
    m.add_operation(Op.ADD, [a, b, act], [out])
    m.identify_inputs_and_outputs([a, b], [out])
    return m.finish().hal_model


def token_request(token, x: Memory, dims=()):
    """inputs (buffer, x), output: the same buffer."""
    return Request((RequestArgument(False, DataLocation(0, 0, 0)),
                    RequestArgument(False, DataLocation(1, 0, x.size), tuple(dims))),
                   (RequestArgument(False, DataLocation(0, 0, 0)),),
                   (DeviceToken(token), x))


async def test_state_stays_in_the_service_and_only_tokens_travel(service):
    device = await ServiceDevice.connect(str(service))
    try:
        prepared = await device.prepare_model(add_model((N,)))
        buffer, token = await device.allocate(BufferDesc(), [prepared], [BufferRole(0, 0)],
                                              [BufferRole(0, 0)])
        rng = np.random.default_rng(1)
        state = rng.standard_normal(N).astype(np.float32)
        with Memory.create(N * 4) as mem, Memory.create(N * 4) as x:
            mem.array(np.float32, N)[:] = state
            await buffer.copy_from(mem, (N,))
            before = device.wire_statistics()
            for _ in range(20):
                xs = rng.standard_normal(N).astype(np.float32)
                x.array(np.float32, N)[:] = xs
                result = await prepared.execute(token_request(token, x))
                assert result.status == ErrorStatus.NONE, result.message
                state = state + xs
            after = device.wire_statistics()
            sent = after.bytes_sent - before.bytes_sent
            received = after.bytes_received - before.bytes_received
            # 20 executions: each frame is a few hundred bytes of control,
            # nowhere near the 64 KiB of state or input.
            assert after.frames_sent - before.frames_sent == 20
            assert sent < 20 * 512 and received < 20 * 512, (sent, received)
            assert after.fds_sent - before.fds_sent == 1   # x's memfd, once: then by id
            mem.array(np.float32, N)[:] = 0
            await buffer.copy_to(mem)
            np.testing.assert_allclose(mem.array(np.float32, N), state, rtol=1e-6)
    finally:
        device.close()


async def test_undeclared_role_and_unwritten_buffer_are_refused(service):
    device = await ServiceDevice.connect(str(service))
    try:
        prepared = await device.prepare_model(add_model((4,)))
        _buffer, token = await device.allocate(BufferDesc((4,)), [prepared],
                                               [BufferRole(0, 0)], [])
        with Memory.create(16) as x:
            result = await prepared.execute(token_request(token, x))
            assert result.status == ErrorStatus.INVALID_ARGUMENT
            assert "never written" in result.message
        with pytest.raises(NnrtError) as e:
            await device.allocate(BufferDesc((5,)), [prepared], [BufferRole(0, 0)], [])
        assert e.value.status == ErrorStatus.INVALID_ARGUMENT
        buffer, token = await device.allocate(BufferDesc(), [prepared], [BufferRole(0, 0)], [])
        with Memory.create(16) as mem, Memory.create(16) as x:
            await buffer.copy_from(mem, (4,))
            # input 0 is declared, output 0 is not
            result = await prepared.execute(token_request(token, x))
            assert result.status == ErrorStatus.INVALID_ARGUMENT
            assert "not allocated for this use" in result.message
        buffer.release()
        with Memory.create(16) as mem:
            with pytest.raises(NnrtError) as e:
                await device.for_test_buffer(token).copy_to(mem)
            assert e.value.status == ErrorStatus.INVALID_ARGUMENT
        assert device.alive
    finally:
        device.close()


async def test_a_buffer_of_unknown_dimensions_is_resized(service):
    device = await ServiceDevice.connect(str(service))
    try:
        prepared = await device.prepare_model(add_model((0,)))
        buffer, token = await device.allocate(BufferDesc(), [prepared], [BufferRole(0, 0)],
                                              [BufferRole(0, 0)])
        for n in (3, 7, 2):
            with Memory.create(n * 4) as mem, Memory.create(n * 4) as x:
                mem.array(np.float32, n)[:] = np.arange(n)
                await buffer.copy_from(mem, (n,))
                x.array(np.float32, n)[:] = 10
                result = await prepared.execute(token_request(token, x, (n,)))
                assert result.status == ErrorStatus.NONE, result.message
                assert result.output_shapes[0].dimensions == (n,)
                await buffer.copy_to(mem)
                np.testing.assert_array_equal(mem.array(np.float32, n), np.arange(n) + 10)
        with Memory.create(12) as wrong:   # holds (2,) now: copy_to checks the size
            with pytest.raises(NnrtError, match="holds 8 bytes"):
                await buffer.copy_to(wrong)
    finally:
        device.close()


CHILD = textwrap.dedent("""
    import sys, anyio
    import nnrt
    from nnrt.service.client import ServiceDevice
    from nnrt.hal import Request, RequestArgument
    from nnrt.memory import DeviceToken, Memory
    from nnrt.model.graph import DataLocation
    from tests.integration.test_memory_domains_service import add_model, token_request

    async def main(path, token):
        device = await ServiceDevice.connect(path)
        prepared = await device.prepare_model(add_model((4,)))
        with Memory.create(16) as x:
            result = await prepared.execute(token_request(token, x))
        with Memory.create(16) as mem:
            try:
                await device.for_test_buffer(token).copy_to(mem)
                copied = "copied"
            except nnrt.NnrtError as e:
                copied = e.status.name
        print(result.status.name, copied, result.message)
        device.close()

    anyio.run(main, sys.argv[1], int(sys.argv[2]))
""")


@pytest.mark.parametrize("app_key", ["uid", "pid"])
async def test_another_connections_or_apps_token_is_refused(app_key, uid_service, pid_service):
    """With app key uid the child process is the same app, but its prepared
    model is not one of the buffer's roles and the buffer is not its
    connection's; with app key pid it is another app altogether (the
    driver's ownership check). Either way: refused, and the owner goes on."""
    path = uid_service if app_key == "uid" else pid_service
    device = await ServiceDevice.connect(str(path))
    try:
        prepared = await device.prepare_model(add_model((4,)))
        buffer, token = await device.allocate(BufferDesc(), [prepared], [BufferRole(0, 0)],
                                              [BufferRole(0, 0)])
        with Memory.create(16) as mem:
            await buffer.copy_from(mem, (4,))
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        out = subprocess.run([sys.executable, "-c", CHILD, str(path), str(token)],
                             capture_output=True, text=True, timeout=60, cwd=root)
        status, copied, message = out.stdout.split(" ", 2)
        assert status == "INVALID_ARGUMENT", out.stderr
        expected = "names no buffer of this app" if app_key == "pid" else "not allocated for"
        assert expected in message
        assert copied == "INVALID_ARGUMENT"
        with Memory.create(16) as x:
            result = await prepared.execute(token_request(token, x))
        assert result.status == ErrorStatus.NONE, result.message
    finally:
        device.close()


def state_model(n):
    """(state, x) -> (state + x, mean-free product state * x)."""
    m = nnrt.Model()
    state = m.add_operand(T.TENSOR_FLOAT32, [n])
    x = m.add_operand(T.TENSOR_FLOAT32, [n])
    act = m.add_operand(T.INT32)
    m.set_operand_value(act, 0)
    new = m.add_operand(T.TENSOR_FLOAT32, [n])
    prod = m.add_operand(T.TENSOR_FLOAT32, [n])
    m.add_operation(Op.ADD, [state, x, act], [new])
    m.add_operation(Op.MUL, [state, x, act], [prod])
    m.identify_inputs_and_outputs([state, x], [new, prod])
    return m.finish()


async def test_the_public_api_over_a_service_keeps_state_there():
    """rt.allocate over a spawned service: 20 executions alternate two device
    memories; the results equal numpy and the control messages carry no
    tensor data (their bytes stay far below one state's size)."""
    async with nnrt.Runtime(spawn=[("npu", "reference")], discover=False,
                            litert=False) as rt:
        npu = rt.device("npu")
        compiled = await rt.compile(state_model(N), devices=["npu"])
        desc = lambda: nnrt.MemoryDesc().add_input_role(compiled, 0).add_output_role(compiled, 0)
        a, b = await rt.allocate(desc()), await rt.allocate(desc())
        assert a.on_device and a.device is npu
        rng = np.random.default_rng(2)
        state = rng.standard_normal(N).astype(np.float32)
        with nnrt.Memory.create(N * 4) as mem, nnrt.Memory.create(N * 4) as xmem, \
                nnrt.Memory.create(N * 4) as pmem:
            mem.array(np.float32, N)[:] = state
            await nnrt.copy(mem, a)
            before = npu.wire_statistics()
            for k in range(20):
                xs = rng.standard_normal(N).astype(np.float32)
                xmem.array(np.float32, N)[:] = xs
                src, dst = (a, b) if k % 2 == 0 else (b, a)
                result = await compiled.execute([src, xmem.region()],
                                                outputs=[dst, pmem.region()])
                np.testing.assert_allclose(result.outputs[1], state * xs, rtol=1e-6)
                state = state + xs
            after = npu.wire_statistics()
            assert after.frames_sent - before.frames_sent == 20
            assert after.bytes_sent - before.bytes_sent < 20 * 512
            assert after.bytes_received - before.bytes_received < 20 * 512
            await assert_copies_hold(a, b, mem, state)


async def assert_copies_hold(a, b, mem: Memory, state: np.ndarray) -> None:
    """Device memory ``a`` holds ``state`` (copied out through ``mem``),
    and so does ``b`` after a device-to-device copy from ``a``."""
    n = state.size
    await nnrt.copy(a, mem)
    np.testing.assert_allclose(mem.array(np.float32, n), state, rtol=1e-5)
    await nnrt.copy(a, b)   # device to device, through one shared memory
    mem.array(np.float32, n)[:] = 0
    await nnrt.copy(b, mem)
    np.testing.assert_allclose(mem.array(np.float32, n), state, rtol=1e-5)


async def test_concurrent_use_of_one_buffer_never_tears_or_wedges(service):
    """Eight writers and eight readers of one buffer at once: every call
    answers, every read sees one whole write (never a mix), the service
    lives on."""
    device = await ServiceDevice.connect(str(service))
    try:
        prepared = await device.prepare_model(add_model((N,)))
        buffer, token = await device.allocate(BufferDesc(), [prepared], [BufferRole(0, 0)],
                                              [BufferRole(0, 0)])
        with Memory.create(N * 4) as mem:
            await buffer.copy_from(mem, (N,))
        import anyio
        reads = []

        async def write(k):
            # out = buffer + (k - buffer) would need two inputs: write k via copy_from
            with Memory.create(N * 4) as m:
                m.array(np.float32, N)[:] = k
                await buffer.copy_from(m, (N,))

        async def read():
            with Memory.create(N * 4) as x, Memory.create(N * 4) as out:
                req = Request((RequestArgument(False, DataLocation(0, 0, 0)),
                               RequestArgument(False, DataLocation(1, 0, x.size))),
                              (RequestArgument(False, DataLocation(2, 0, out.size)),),
                              (DeviceToken(token), x, out))
                result = await prepared.execute(req)
                assert result.status == ErrorStatus.NONE, result.message
                reads.append(np.unique(out.array(np.float32, N)))

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for k in range(8):
                    tg.start_soon(write, k + 1)
                    tg.start_soon(read)
        assert len(reads) == 8 and all(len(r) == 1 for r in reads), reads
        assert device.alive
    finally:
        device.close()


async def test_a_copy_from_an_unsealed_memfd_is_refused_and_the_service_goes_on(service):
    import os as _os
    device = await ServiceDevice.connect(str(service))
    try:
        prepared = await device.prepare_model(add_model((4,)))
        _buffer, token = await device.allocate(BufferDesc(), [prepared], [BufferRole(0, 0)], [])
        fd = _os.memfd_create("unsealed")
        _os.ftruncate(fd, 16)
        from nnrt.service import protocol as p
        from nnrt.service.client import _value
        wire = p.WirePool(0, fd, True, 0, 16, 0, 16)
        reply = await device._channel.call(
            lambda cid: p.CopyBuffer(cid, p.Method.COPY_FROM, token, wire, (4,)))
        _os.close(fd)
        assert reply.status == ErrorStatus.INVALID_ARGUMENT and "sealed" in reply.message
        with Memory.create(16) as mem:
            await device.for_test_buffer(token).copy_from(mem, (4,))   # a sealed one works
        assert device.alive
    finally:
        device.close()


def stateful_model(n):
    """state' = state + x; out = state' * x (state: input 1, output 1)."""
    m = nnrt.Model()
    x = m.add_operand(T.TENSOR_FLOAT32, [n])
    state = m.add_operand(T.TENSOR_FLOAT32, [n])
    act = m.add_operand(T.INT32)
    m.set_operand_value(act, 0)
    new = m.add_operand(T.TENSOR_FLOAT32, [n])
    out = m.add_operand(T.TENSOR_FLOAT32, [n])
    m.add_operation(Op.ADD, [state, x, act], [new])
    m.add_operation(Op.MUL, [new, x, act], [out])
    m.identify_inputs_and_outputs([x, state], [out, new])
    from nnrt.model.metadata import ModelMetadata, TensorInfo
    info = lambda name: TensorInfo(name, np.dtype(np.float32), (n,))
    m.set_metadata(ModelMetadata((info("x"), info("state")), (info("out"), info("new")),
                                 states=((1, 1),)))
    return m.finish()


@pytest.mark.parametrize("killed_at", [1, 9, 19])
async def test_after_a_sigkill_the_cpu_rerun_keeps_the_state(killed_at):
    """20 runs of a stateful model whose state lives in the service's
    buffers; the service is SIGKILLed before run ``killed_at``. That run
    reruns on the CPU from the buffer's last written contents (its
    mirror), and every result equals carrying the state in numpy. Before
    the kill the state never crossed into the app (control messages stay
    far below its size; one state transfer: the zeroing); the recovery is
    the one crossing after."""
    import signal
    async with nnrt.Runtime(spawn=[("npu", "reference")], discover=False, litert=False) as rt:
        npu = rt.device("npu")
        compiled = await rt.compile(stateful_model(N))
        assert [d.name for d in compiled.devices] == ["npu"]
        rng = np.random.default_rng(killed_at)
        xs = [rng.standard_normal(N).astype(np.float32) for _ in range(20)]
        state = np.zeros(N, np.float32)
        for k, x in enumerate(xs):
            if k == 1:
                before = npu.wire_statistics()
            if k == killed_at:
                after = npu.wire_statistics()
                # runs 1 .. k-1: one frame each way, a few hundred bytes, no fd
                assert after.frames_sent - before.frames_sent == k - 1
                assert after.fds_sent == before.fds_sent
                assert after.bytes_sent - before.bytes_sent <= (k - 1) * 512
                assert after.bytes_received - before.bytes_received <= (k - 1) * 512
                assert compiled.statistics().state_transfers == 1   # the zeroing only
                memories = compiled._signature.memories
                assert all(m.on_device for pair in memories for m in pair)
                rt._services[0].process.send_signal(signal.SIGKILL)
                rt._services[0].process.wait()
            got = (await compiled.execute([x])).outputs[0]
            state = state + x
            np.testing.assert_allclose(got, state * x, rtol=1e-5, err_msg=f"run {k}")
        stats = compiled.statistics()
        assert stats.executions == 20 and stats.failures == 0 and stats.fallbacks == 1
        assert stats.state_transfers == 2   # the zeroing, and the one recovery
        assert [d.name for d in compiled.devices] == [rt.cpu.name]
        assert compiled._signature.memories is memories   # the same memories, now shared
        assert not any(m.on_device for pair in memories for m in pair)


async def test_a_buffer_of_unknown_size_dies_with_its_service():
    """No mirror for a buffer whose size is not known at allocation: the
    execution that finds its service dead fails with DEAD_OBJECT (its
    contents cannot follow to the CPU), and later ones run there."""
    import signal
    m = nnrt.Model()
    x = m.add_operand(T.TENSOR_FLOAT32, [0])
    out = m.add_operand(T.TENSOR_FLOAT32, [0])
    m.add_operation(Op.RELU, [x], [out])
    m.identify_inputs_and_outputs([x], [out])
    async with nnrt.Runtime(spawn=[("npu", "reference")], discover=False, litert=False) as rt:
        compiled = await rt.compile(m.finish())
        assert [d.name for d in compiled.devices] == ["npu"]
        memory = await rt.allocate(nnrt.MemoryDesc().add_input_role(compiled, 0)
                                   .add_output_role(compiled, 0))
        assert memory.on_device and memory.declared == (0,)
        await compiled.execute([np.array([-1, 2, -3], np.float32)], outputs=[memory])
        assert memory.dimensions == (3,)
        rt._services[0].process.send_signal(signal.SIGKILL)
        rt._services[0].process.wait()
        with pytest.raises(NnrtError) as e:
            await compiled.execute([memory])
        assert e.value.status == ErrorStatus.DEAD_OBJECT
        assert memory.on_device   # nothing moved
        assert [d.name for d in compiled.devices] == [rt.cpu.name]
        np.testing.assert_array_equal(
            (await compiled.execute([np.array([-1, 1], np.float32)])).outputs[0], [0, 1])


async def test_each_allocation_gets_its_own_sealed_mirror_that_a_client_cannot_hurt(service):
    """A mirror is a memfd made for one allocation (never the same file for
    two buffers or two connections), sealed so its holder cannot resize it;
    a client scribbling over it changes nothing the service computes with
    and hurts only its own recovery copy."""
    from nnrt.service.mirror import read_mirror
    one = await ServiceDevice.connect(str(service))
    two = await ServiceDevice.connect(str(service))
    try:
        buffers = []
        for device in (one, one, two):
            prepared = await device.prepare_model(add_model((4,)))
            buffer, token = await device.allocate(BufferDesc(), [prepared], [BufferRole(0, 0)],
                                                  [BufferRole(0, 0)])
            buffers.append((prepared, buffer, token))
        inodes = {os.fstat(b._mirror_fd).st_ino for _p, b, _t in buffers}
        assert len(inodes) == 3
        prepared, buffer, token = buffers[0]
        fd = buffer._mirror_fd
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)
        with Memory.create(16) as mem, Memory.create(16) as x:
            mem.array(np.float32, 4)[:] = [1, 2, 3, 4]
            await buffer.copy_from(mem, (4,))
            os.pwrite(fd, b"\xff" * os.fstat(fd).st_size, 0)   # the whole mirror, header too
            assert read_mirror(fd, 16) is None
            x.array(np.float32, 4)[:] = 10
            result = await prepared.execute(token_request(token, x))
            assert result.status == ErrorStatus.NONE, result.message
            await buffer.copy_to(mem)
            np.testing.assert_array_equal(mem.array(np.float32, 4), [11, 12, 13, 14])
            # The service writes only a half and the current byte, never
            # the magic: a client that scribbled its header lost its own
            # recovery copy, and only that.
            assert read_mirror(fd, 16) is None
        assert buffer.recover() is None          # never a live service's contents
        assert one.alive and two.alive
    finally:
        one.close()
        two.close()
