"""Memory domains on a remote device (issue 42): ``rt.allocate`` for a
model compiled for a ``RemoteDevice`` makes a driver buffer on the serving
host (``nnrt driver serve --listen`` as a real process on 127.0.0.2); its
token is all that crosses, so state and chained outputs stay there. The
buffer is its session's: another app's or another session's token is
refused; releasing it or ending the session frees it in the server's
accounting (``--limit mapped_bytes_per_app``); a hostile size is refused;
and the CTS "domain" mode passes over a few vectors."""
import anyio
import grpc
import numpy as np
import pytest

import nnrt
from nnrt import ErrorStatus, NnrtError
from nnrt.hal import BufferDesc, BufferRole, Request, RequestArgument
from nnrt.memory import Memory
from nnrt.model.graph import DataLocation
from nnrt.service.remote import nnrt_remote_v1_pb2 as pb
from nnrt.service.remote import nnrt_remote_v1_pb2_grpc as pb_grpc
from nnrt.service.remote.client import RemoteBuffer, RemoteDevice
from nnrt.testing import cts

from ..conftest import SHARED, start_remote_service, stop
from .test_memory_domains_service import (add_model, assert_copies_hold, state_model,
                                          token_request)

HOST = "127.0.0.2"   # "another host": loopback, never a routable address
BOUND = 10           # seconds: a guard against a hang, not a timing assertion
N = 4096             # floats of state: 16 KiB
TOKENS = {"state": "0123456789abcdef0001", "owner": "0123456789abcdef0002",
          "other": "0123456789abcdef0003", "bounded": "0123456789abcdef0004"}
# Per app: two buffers of N floats (32 KiB) and a reusable execution's
# kept pools (32 KiB) fit; four buffers do not.
LIMIT = 3 * N * 4 + 1024


@pytest.fixture(scope="module")
def far(tmp_path_factory):
    """A reference driver served on 127.0.0.2 to the apps of TOKENS."""
    tokens = tmp_path_factory.mktemp("rdomain") / "tokens"
    tokens.write_text("".join(f"{name} {token}\n" for name, token in TOKENS.items()))
    tokens.chmod(0o600)
    proc, target = start_remote_service(f"{HOST}:0", "reference", "far", "--insecure",
                                        "--token-file", str(tokens), "--limit",
                                        f"mapped_bytes_per_app={LIMIT}")
    yield target
    stop(proc)


async def connect(target, app) -> RemoteDevice:
    return await RemoteDevice.connect(target, token=TOKENS[app])


async def test_state_and_chained_outputs_stay_on_the_serving_host(far):
    """Ten executions alternate two device memories: the results equal
    numpy, and only the fresh input and the product crossed (the client's
    byte counts); a reusable execution and a burst take the memories too;
    copies go both ways, and between two memories."""
    device = await connect(far, "state")
    try:
        async with nnrt.Runtime(devices=[device], strict=True) as rt:
            compiled = await rt.compile(state_model(N))
            desc = lambda: (nnrt.MemoryDesc().add_input_role(compiled, 0)
                            .add_output_role(compiled, 0))
            a, b = await rt.allocate(desc()), await rt.allocate(desc())
            assert a.on_device and a.device is device and isinstance(a.buffer, RemoteBuffer)
            rng = np.random.default_rng(5)
            state = rng.standard_normal(N).astype(np.float32)
            with Memory.create(N * 4) as mem:
                mem.array(np.float32, N)[:] = state
                await nnrt.copy(mem, a)
                before = device.traffic()
                for k in range(10):
                    x = rng.standard_normal(N).astype(np.float32)
                    src, dst = (a, b) if k % 2 == 0 else (b, a)
                    result = await compiled.execute([src, x],
                                                    outputs=[dst, np.empty(N, np.float32)])
                    np.testing.assert_allclose(result.outputs[1], state * x, rtol=1e-6)
                    state = state + x
                after = device.traffic()
                # x out and the product back, ten times; the state never moved.
                assert after.bytes_sent - before.bytes_sent == 10 * N * 4
                assert after.bytes_received - before.bytes_received == 10 * N * 4

                # A reusable execution, bound once there, and a burst frame.
                x = np.ones(N, np.float32)
                product = np.empty(N, np.float32)
                execution = compiled.create_execution([a, x], outputs=[b, product],
                                                      reusable=True)
                await execution.compute()
                state = state + 1
                async with compiled.burst() as burst:
                    await burst.execute([b, x], outputs=[a, product])
                np.testing.assert_allclose(product, state, rtol=1e-6)   # b * 1
                state = state + 1
                execution.close()

                await assert_copies_hold(a, b, mem, state)
            a.close()
            b.close()
    finally:
        device.close()


async def test_a_model_prepared_from_the_apps_cache_takes_device_memories(far, tmp_path):
    """Compilation caching and memory domains together: the second compile
    comes from the app's cache files, so the server has no graph of the
    model to size a buffer by; a buffer for its roles still holds the
    state across executions."""
    device = await connect(far, "state")
    try:
        async with nnrt.Runtime(devices=[device], strict=True) as rt:
            (await rt.compile(state_model(N), cache_dir=tmp_path)).close()
            compiled = await rt.compile(state_model(N), cache_dir=tmp_path)
            assert rt.cache_statistics().hits == 1
            desc = lambda: (nnrt.MemoryDesc().add_input_role(compiled, 0)
                            .add_output_role(compiled, 0))
            a, b = await rt.allocate(desc()), await rt.allocate(desc())
            state = np.arange(N, dtype=np.float32)
            x = np.full(N, 2.0, np.float32)
            with Memory.create(N * 4) as mem:
                mem.array(np.float32, N)[:] = state
                await nnrt.copy(mem, a)
                await compiled.execute([a, x], outputs=[b, np.empty(N, np.float32)])
                await nnrt.copy(b, mem)
                np.testing.assert_array_equal(mem.array(np.float32, N), state + x)
            a.close()
            b.close()
    finally:
        device.close()


async def test_another_apps_or_sessions_token_is_refused(far):
    """The owner's token named by another app, and by another session of
    the same app: INVALID_ARGUMENT, never its data; the owner goes on."""
    owner, other, again = [await connect(far, app) for app in ("owner", "other", "owner")]
    try:
        mine = await owner.prepare_model(add_model((4,)))
        buffer, token = await owner.allocate(BufferDesc(), [mine], [BufferRole(0, 0)],
                                             [BufferRole(0, 0)])
        with Memory.create(16) as x:
            x.array(np.float32, 4)[:] = [1, 2, 3, 4]
            await buffer.copy_from(x, (4,))
            for device in (other, again):
                theirs = await device.prepare_model(add_model((4,)))
                result = await theirs.execute(token_request(token, x))
                assert result.status == ErrorStatus.INVALID_ARGUMENT
                assert "names no buffer of this session" in result.message
                with pytest.raises(NnrtError) as e:
                    await RemoteBuffer(device, token).copy_to(bytearray(16))
                assert e.value.status == ErrorStatus.INVALID_ARGUMENT
                # A role naming another session's model: not this session's.
                with pytest.raises(NnrtError) as e:
                    await device.allocate(BufferDesc(), [mine], [BufferRole(0, 0)], [])
                assert e.value.status == ErrorStatus.INVALID_ARGUMENT
                assert device.alive
            # An undeclared role (input 1) is refused by the driver.
            bad = token_request(token, x)
            bad = type(bad)(bad.inputs[::-1], bad.outputs, bad.pools)
            result = await mine.execute(bad)
            assert result.status == ErrorStatus.INVALID_ARGUMENT
            result = await mine.execute(token_request(token, x))
            assert result.status == ErrorStatus.NONE, result.message
            out = bytearray(16)
            await buffer.copy_to(out)
            assert np.frombuffer(out, np.float32).tolist() == [2, 4, 6, 8]
    finally:
        for device in (owner, other, again):
            device.close()


async def test_release_and_session_end_free_buffers_and_hostile_sizes_are_refused(far):
    """Buffers of known size count as the app's mapped_bytes: the fourth
    of N floats is over the limit until one is released; a new session
    gets all three once the old one ends. A size beyond any buffer (at
    allocate, or an execution's output), or a copy larger than a message,
    is refused and the service goes on."""
    device = await connect(far, "bounded")
    try:
        prepared = await device.prepare_model(add_model((N,)))
        desc, roles = BufferDesc(), ([BufferRole(0, 0)], [BufferRole(0, 0)])
        buffers = [await device.allocate(desc, [prepared], *roles) for _ in range(3)]
        with pytest.raises(NnrtError) as e:
            await device.allocate(desc, [prepared], *roles)
        assert e.value.status == ErrorStatus.RESOURCE_EXHAUSTED_TRANSIENT
        assert f"app remote bounded holds {3 * N * 4} mapped_bytes" in e.value.message
        buffer, token = buffers.pop()
        buffer.release()
        with pytest.raises(NnrtError) as e:   # released: its token names nothing
            await buffer.copy_to(bytearray(N * 4))
        assert e.value.status == ErrorStatus.INVALID_ARGUMENT
        buffers.append(await _allocate_when_freed(device, desc, prepared, roles))
        with pytest.raises(NnrtError) as e:   # freed there too
            await RemoteBuffer(device, token).copy_to(bytearray(N * 4))
        assert "names no buffer of this session" in e.value.message

        # Hostile sizes: a buffer of 2^30 floats (4 GiB), an execution's
        # output of as many into a buffer of open size, a copy of 2^40 bytes.
        dynamic = await device.prepare_model(add_model((0,)))
        with pytest.raises(NnrtError) as e:
            await device.allocate(BufferDesc((1 << 30,)), [dynamic],
                                  [BufferRole(0, 0)], [])
        assert e.value.status == ErrorStatus.RESOURCE_EXHAUSTED_PERSISTENT
        big, big_token = await device.allocate(BufferDesc(), [dynamic], [BufferRole(0, 0)],
                                               [BufferRole(0, 0)])
        with Memory.create(16) as x:   # an output of 2^30 floats into it
            request = token_request(big_token, x, (4,))
            huge = (RequestArgument(False, DataLocation(0, 0, 0), (1 << 30,)),)
            result = await dynamic.execute(Request((request.inputs[1], request.inputs[1]),
                                                   huge, request.pools))
        assert result.status == ErrorStatus.RESOURCE_EXHAUSTED_PERSISTENT, result.message
        address = far.removeprefix("grpc://")
        with grpc.insecure_channel(address) as channel:
            with pytest.raises(grpc.RpcError) as e:
                pb_grpc.RemoteStub(channel).CopyTo(
                    pb.CopyToRequest(session=device.session_id, token=big_token,
                                     length=1 << 40),
                    metadata=(("authorization", f"Bearer {TOKENS['bounded']}"),),
                    timeout=BOUND)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        big.release()
        assert device.alive
    finally:
        device.close()
    # The session ended: the server released its buffers, and a new
    # session of the app gets its three.
    device = await connect(far, "bounded")
    try:
        prepared = await device.prepare_model(add_model((N,)))
        await _allocate_when_freed(device, desc, prepared, roles)
        for _ in range(2):
            await device.allocate(desc, [prepared], *roles)
    finally:
        device.close()


async def _allocate_when_freed(device, desc, prepared, roles):
    """An allocation, retried while the server has not yet freed what a
    release or a session's end let go (both reach it asynchronously);
    bounded in count and time."""
    with anyio.fail_after(BOUND):
        for _ in range(200):
            try:
                return await device.allocate(desc, [prepared], *roles)
            except NnrtError as e:
                if e.status != ErrorStatus.RESOURCE_EXHAUSTED_TRANSIENT:
                    raise
            await anyio.sleep(0.05)
    raise AssertionError("the buffers were never freed")


async def test_a_killed_host_takes_its_buffers_with_it():
    """kill -9 of the serving host: an execution naming its memory and a
    copy out of it end with DEAD_OBJECT (the contents died there: a remote
    buffer has no mirror on the app's side), and nothing hangs."""
    proc, target = start_remote_service(f"{HOST}:0", "reference", "far", "--insecure")
    try:
        device = await RemoteDevice.connect(target)
        async with nnrt.Runtime(devices=[device], strict=True) as rt:
            compiled = await rt.compile(state_model(4))
            memory = await rt.allocate(nnrt.MemoryDesc().add_input_role(compiled, 0))
            with Memory.create(16) as mem:
                await nnrt.copy(mem, memory)
                proc.kill()
                proc.wait()
                with anyio.fail_after(BOUND):
                    with pytest.raises(NnrtError) as e:
                        await compiled.execute([memory, np.ones(4, np.float32)])
                    assert e.value.status == ErrorStatus.DEAD_OBJECT
                    with pytest.raises(NnrtError) as e:
                        await nnrt.copy(memory, mem)
                    assert e.value.status == ErrorStatus.DEAD_OBJECT
            assert not device.alive
    finally:
        stop(proc)


DOMAIN_VECTORS = ["abs.json", "add_v1_2.json", "argmax_1.json"]


def test_the_memory_domain_mode_passes_on_a_remote_device(far):
    """Every tensor input and output of a few CTS vectors in a device
    memory on the remote host (the harness's "domain" mode): each run
    passes, and the memories were the remote device's buffers."""
    files = [str(SHARED / "cts" / "V1_2" / name) for name in DOMAIN_VECTORS]
    device = anyio.run(connect, far, "state")
    allocate, tokens = device.allocate, []

    async def counted(*args, **kwargs):
        buffer, token = await allocate(*args, **kwargs)
        tokens.append(token)
        return buffer, token
    device.allocate = counted
    try:
        outcomes = cts.run(files, modes=("domain",), device=device.name, devices=[device])
        failed = [f"{o.name} [{o.suite}]: {o.detail}" for o in outcomes if o.status != "passed"]
        assert outcomes and not failed, failed
        generated = [o for o in outcomes if o.suite == "GeneratedTests"]
        assert len(generated) >= 10
        # Every run's memories (an input and an output at least) were the
        # remote device's buffers, not the runtime's shared-memory fallback.
        assert len(set(tokens)) >= 2 * len(generated)
    finally:
        device.close()
