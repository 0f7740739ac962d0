"""Burst sessions on a real driver service process: two fmq rings in memfds,
eventfd wake-ups, slots fetched over the control socket with SCM_RIGHTS,
SIGKILL of either side."""
import os
import signal
import subprocess
import sys
import textwrap

import anyio
import numpy as np
import pytest

from nnrt import ErrorStatus
from nnrt.burst import wire
from nnrt.hal import Request, RequestArgument
from nnrt.drivers.reference import ReferenceDevice
from nnrt.service.client import ServiceDevice
from nnrt.service.server import serve
from nnrt.memory import Memory
from nnrt.model.graph import DataLocation

from .test_service import (GUARD, add_model, chain_model, numpy_request, public_add_model,
                           start_service, stop)


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    path = tmp_path_factory.mktemp("burst") / "reference.sock"
    proc = start_service(path, "reference", "burst-reference")
    yield path, proc
    stop(proc)


def memory_request(mem: Memory, n: int = 4):
    """ADD of [0, 4n) and [4n, 8n) of ``mem`` into [8n, 12n): all in place."""
    size = 4 * n
    return Request((RequestArgument(False, DataLocation(0, 0, size), (1, n)),
                    RequestArgument(False, DataLocation(0, size, size), (1, n))),
                   (RequestArgument(False, DataLocation(0, 2 * size, size)),), (mem,))


def maps_of(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def wait_until(predicate, what: str):
    """Poll ``predicate`` (a guard against hangs, not a timing assertion)."""
    with anyio.fail_after(GUARD, shield=True):
        while not predicate():
            await anyio.sleep(0.01)


async def test_300_frames_through_a_burst_match_execute(service):
    path, _proc = service
    dev = await ServiceDevice.connect(str(path))
    try:
        prepared = await dev.prepare_model(add_model())
        rng = np.random.default_rng(8)
        session = await prepared.configure_burst()
        mem = Memory.create(64, "nnrt-burst-frames")
        try:
            with anyio.fail_after(GUARD * 6):
                for frame in range(300):
                    x = rng.standard_normal((1, 4)).astype(np.float32)
                    y = rng.standard_normal((1, 4)).astype(np.float32)
                    expected = np.zeros((1, 4), np.float32)
                    ref = await prepared.execute(numpy_request([x, y], [expected]))
                    assert ref.status == ErrorStatus.NONE, ref.message
                    if frame % 2:  # numpy pools: staged through the arena
                        out = np.zeros((1, 4), np.float32)
                        result = await session.execute(numpy_request([x, y], [out]),
                                                       measure=frame % 3 == 0)
                    else:          # Memory pools: in place, no copy
                        mem.array(np.float32, 4, 0)[:] = x.reshape(-1)
                        mem.array(np.float32, 4, 16)[:] = y.reshape(-1)
                        result = await session.execute(memory_request(mem))
                        out = mem.array(np.float32, (1, 4), 32)
                    assert result.status == ErrorStatus.NONE, result.message
                    assert result.output_shapes[0].dimensions == (1, 4)
                    np.testing.assert_array_equal(out, expected)
                    if frame % 3 == 0 and frame % 2:
                        assert result.timing.in_driver >= result.timing.on_device
            stats = session.statistics()
            assert stats.executions == 300
            assert stats.slots == 2  # the Memory and the arena, each once
            # Only the numpy frames were copied: 3 x 16 bytes each, 150 of them.
            assert stats.bytes_staged == 150 * 48
        finally:
            session.close()
            mem.close()
    finally:
        dev.close()


async def test_sigkill_of_the_service_fails_a_pending_burst_execution(tmp_path):
    path = tmp_path / "victim.sock"
    proc = start_service(path)
    try:
        dev = await ServiceDevice.connect(str(path))
        n = 1 << 20
        prepared = await dev.prepare_model(chain_model(n, 400))  # long enough to be caught
        session = await prepared.configure_burst()
        mem = Memory.create(3 * 4 * n)
        mem.array(np.float32, 2 * n)[:] = 1
        request = Request((RequestArgument(False, DataLocation(0, 0, 4 * n), (n,)),
                           RequestArgument(False, DataLocation(0, 4 * n, 4 * n), (n,))),
                          (RequestArgument(False, DataLocation(0, 8 * n, 4 * n)),), (mem,))
        results = []

        async def run():
            results.append(await session.execute(request))

        with anyio.fail_after(GUARD * 2):
            async with anyio.create_task_group() as tg:
                tg.start_soon(run)
                await anyio.sleep(0.1)  # the execution is in the service now
                assert not results
                os.kill(proc.pid, signal.SIGKILL)
        assert results[0].status == ErrorStatus.DEAD_OBJECT, results[0]
        # The session stays dead, without touching the rings' peer.
        again = await session.execute(request)
        assert again.status == ErrorStatus.DEAD_OBJECT
        session.close()
        dev.close()
        mem.close()
    finally:
        proc.kill()
        proc.wait()


async def test_closing_the_session_ends_the_server_task_and_unmaps(service):
    path, proc = service
    dev = await ServiceDevice.connect(str(path))
    try:
        prepared = await dev.prepare_model(add_model())
        baseline_fds = fd_count(proc.pid)
        session = await prepared.configure_burst()
        probe = f"nnrt-burst-probe-{os.getpid()}"
        mem = Memory.create(64, probe)
        mem.array(np.float32, 8)[:] = 1
        result = await session.execute(memory_request(mem))
        assert result.status == ErrorStatus.NONE, result.message
        maps = maps_of(proc.pid)
        assert probe in maps and "nnrt-burst-requests" in maps and "nnrt-burst-results" in maps
        assert fd_count(proc.pid) > baseline_fds

        session.close()
        await wait_until(lambda: not any(name in maps_of(proc.pid) for name in
                                         (probe, "nnrt-burst-requests", "nnrt-burst-results")),
                         "the service unmaps the burst")
        await wait_until(lambda: fd_count(proc.pid) == baseline_fds, "the service closes fds")
        closed = await session.execute(memory_request(mem))
        assert closed.status == ErrorStatus.INVALID_ARGUMENT
        # The connection and the prepared model live on.
        out = np.zeros((1, 4), np.float32)
        ok = await prepared.execute(numpy_request([np.ones((1, 4), np.float32)] * 2, [out]))
        assert ok.status == ErrorStatus.NONE and out.tolist() == [[2.0] * 4]
        mem.close()
    finally:
        dev.close()


APP = textwrap.dedent("""
    import sys, anyio, numpy as np
    from nnrt.service.client import ServiceDevice
    from nnrt.memory import Memory
    from tests.integration.test_burst import memory_request
    from tests.integration.test_service import add_model

    async def main():
        dev = await ServiceDevice.connect(sys.argv[1])
        session = await (await dev.prepare_model(add_model())).configure_burst()
        mem = Memory.create(64, sys.argv[2])
        result = await session.execute(memory_request(mem))
        print(result.status.name, flush=True)
        await anyio.sleep(60)

    anyio.run(main)
""")


async def test_app_death_ends_the_server_task_and_unmaps(service):
    path, proc = service
    probe = f"nnrt-burst-app-{os.getpid()}"
    app = subprocess.Popen([sys.executable, "-c", APP, str(path), probe],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    try:
        with anyio.fail_after(GUARD * 6):
            line = await anyio.to_thread.run_sync(app.stdout.readline)
        assert line.strip() == b"NONE", app.stderr.read() if not line else line
        assert probe in maps_of(proc.pid)
        app.kill()
        app.wait()
        await wait_until(lambda: probe not in maps_of(proc.pid), "the service unmaps")
    finally:
        app.kill()
        app.wait()


async def test_unknown_slots_are_fetched_once_then_cached_and_freed(tmp_path):
    """In-process service, to read its burst statistics."""
    path = str(tmp_path / "stats.sock")
    async with anyio.create_task_group() as tg:
        svc = await tg.start(serve, ReferenceDevice(), path)
        dev = await ServiceDevice.connect(path)
        try:
            prepared = await dev.prepare_model(add_model())
            async with await prepared.configure_burst() as session:
                first = Memory.create(64)
                first.array(np.float32, 8)[:] = 2
                for _ in range(5):
                    assert (await session.execute(memory_request(first))).status == \
                        ErrorStatus.NONE
                stats = svc.burst_statistics()
                assert (stats.get_memories_calls, stats.slots_fetched, stats.slots_mapped) == \
                    (1, 1, 1)
                assert first.array(np.float32, 4, 32).tolist() == [4.0] * 4

                second = Memory.create(64)
                for _ in range(3):
                    await session.execute(memory_request(second))
                stats = svc.burst_statistics()
                assert (stats.get_memories_calls, stats.slots_fetched, stats.slots_mapped) == \
                    (2, 2, 2)

                # The app releases a Memory (closed, or collected): the slot is
                # freed with the next execution and unmapped by the server.
                first.close()
                del second
                third = Memory.create(64)
                await session.execute(memory_request(third))
                await wait_until(lambda: svc.burst_statistics().slots_mapped == 1,
                                 "freed slots are unmapped")
                assert session.statistics().slots_freed == 2
                assert svc.burst_statistics().bursts_open == 1
            await wait_until(lambda: svc.burst_statistics().bursts_open == 0, "the burst ends")
            assert svc.burst_statistics().slots_mapped == 0
        finally:
            dev.close()
            tg.cancel_scope.cancel()


async def test_a_bound_execution_is_placed_and_bound_once_and_its_frames_only_move_bytes(
        tmp_path):
    """A reusable execution computed by a burst (``burst.compute``; a HAL
    caller's ``session.create_execution``): the controller places its pools
    once, the service binds its layout to the driver once, and every later
    frame is a run frame -- only the bytes of its pools move. A one-shot
    frame (``burst.execute``) is placed and sent whole each time."""
    import nnrt

    path = str(tmp_path / "layouts.sock")
    async with anyio.create_task_group() as tg:
        svc = await tg.start(serve, ReferenceDevice(), path)
        dev = await ServiceDevice.connect(path)
        try:
            rng = np.random.default_rng(16)
            async with nnrt.Runtime(devices=[dev], discover=False) as rt:
                compiled = await rt.compile(public_add_model())
                x, y = np.zeros((1, 4), np.float32), np.zeros((1, 4), np.float32)
                execution = compiled.create_execution([x, y])
                async with compiled.burst() as burst:
                    frames = []
                    write = burst._sessions[id(compiled._steps[0])]._requests.write_nowait
                    burst._sessions[id(compiled._steps[0])]._requests.write_nowait = \
                        lambda f: (frames.append(bytes(f)), write(f))[1]
                    for _ in range(40):
                        x[...], y[...] = rng.standard_normal((2, 1, 4)).astype(np.float32)
                        result = await burst.compute(execution)
                        np.testing.assert_array_equal(result.outputs[0], x + y)
                    session, = burst.statistics().sessions
                    assert (session.executions, session.layouts_staged) == (40, 1)
                    assert session.bytes_staged == 40 * 48
                    assert frames[0][:4] == wire.REQUEST_MAGIC
                    assert {f[:4] for f in frames[1:]} == {wire.RUN_MAGIC}
                    assert {len(f) for f in frames[1:]} == {32}
                    assert svc.burst_statistics().layouts == 1
                    for _ in range(3):
                        result = await burst.execute([x, y])
                        np.testing.assert_array_equal(result.outputs[0], x + y)
                    session, = burst.statistics().sessions
                    assert session.layouts_staged == 1 + 3
                    assert burst.statistics().frames == 43
            assert svc.burst_statistics().layouts == 1
            prepared = await dev.prepare_model(add_model())
            x, y = np.zeros((1, 4), np.float32), np.zeros((1, 4), np.float32)
            sums = np.zeros((1, 4), np.float32)
            request = numpy_request([x, y], [sums])
            async with await prepared.configure_burst() as session:
                bound = session.create_execution(request)
                for k in range(20):
                    x[:], y[:] = k, 2 * k     # new contents, the same binding
                    assert (await bound.execute()).status == ErrorStatus.NONE
                    assert sums.tolist() == [[3.0 * k] * 4]
                assert session.statistics().layouts_staged == 1
            assert svc.burst_statistics().layouts == 2
        finally:
            dev.close()
            tg.cancel_scope.cancel()


async def test_bound_executions_follow_every_change_mid_burst(tmp_path):
    """Two bindings alternating with one-shot frames, timings asked for by
    one binding, a binding whose memory was closed, a layout number given
    back and taken by another binding, and frames cut short, lengthened or
    changed in one field: each frame gets its own right answer."""
    path = str(tmp_path / "reuse.sock")
    async with anyio.create_task_group() as tg:
        svc = await tg.start(serve, ReferenceDevice(), path)
        dev = await ServiceDevice.connect(path)
        try:
            prepared = await dev.prepare_model(add_model())
            rng = np.random.default_rng(4)
            async with await prepared.configure_burst() as session:
                x, y, sums = (np.zeros((1, 4), np.float32) for _ in "xys")
                numpy_bound = session.create_execution(numpy_request([x, y], [sums]))
                timed = session.create_execution(numpy_request([x, y], [sums]), measure=True)
                mem = Memory.create(64, "nnrt-burst-reuse")
                memory_bound = session.create_execution(memory_request(mem))
                for k in range(15):
                    x[:], y[:] = rng.standard_normal((2, 1, 4)).astype(np.float32)
                    if k % 5 == 2:           # the Memory binding and a one-shot frame
                        mem.array(np.float32, 8)[:] = np.concatenate([x, y], axis=None)
                        result = await memory_bound.execute()
                        assert result.status == ErrorStatus.NONE, result.message
                        assert mem.array(np.float32, 4, 32).tolist() == (x + y)[0].tolist()
                        result = await session.execute(numpy_request([x, y], [sums]))
                        assert result.status == ErrorStatus.NONE, result.message
                        np.testing.assert_array_equal(sums, x + y)
                        continue
                    bound = timed if k == 6 else numpy_bound
                    result = await bound.execute()
                    assert result.status == ErrorStatus.NONE, result.message
                    np.testing.assert_array_equal(sums, x + y)
                    assert (result.timing.in_driver != wire.UINT64_MAX) == (k == 6)
                # Three bindings, each defined once in the service.
                assert svc.burst_statistics().layouts == 3
                assert session.statistics().layouts_staged == 3 + 3

                # The memory closed: its binding is refused, the others go on;
                # the server unmaps the slot and forgets the layout using it.
                mem.close()
                result = await memory_bound.execute()
                assert result.status == ErrorStatus.INVALID_ARGUMENT and "closed" in result.message
                x[:], y[:] = 1, 2
                assert (await numpy_bound.execute()).status == ErrorStatus.NONE
                assert sums.tolist() == [[3.0] * 4]
                # (left: the two numpy bindings' arenas and the one-shots' arena)
                await wait_until(lambda: svc.burst_statistics().slots_mapped == 3,
                                 "the freed slot is unmapped")
                # Its layout number given back and taken by a new binding,
                # which defines it anew.
                memory_bound.release()
                other = Memory.create(64, "nnrt-burst-reuse")
                other_bound = session.create_execution(memory_request(other))
                for k in range(3):
                    other.array(np.float32, 8)[:] = k
                    result = await other_bound.execute()
                    assert result.status == ErrorStatus.NONE, result.message
                    assert other.array(np.float32, 4, 32).tolist() == [2.0 * k] * 4
                assert svc.burst_statistics().layouts == 4

                # A run frame and a defining frame, cut, lengthened or changed
                # in one field: each refused alone, and the bindings go on.
                run = wire.encode_run(wire.BurstRun(9_000, other_bound._layout))
                define = wire.encode_request(wire.BurstRequest(
                    9_001, other_bound._inputs, other_bound._outputs, other_bound._slots,
                    layout=other_bound._layout))
                past_the_pool = bytearray(define)
                # The output argument's offset (the third argument, after the
                # 40-byte header and two inputs of 24 + 4 * rank 2 bytes; at 8
                # into the argument) past the memory's end.
                offset_at = 40 + 2 * (24 + 8) + 8
                assert int.from_bytes(define[offset_at:offset_at + 8], "little") == 32
                past_the_pool[offset_at:offset_at + 8] = (60).to_bytes(8, "little")
                undefined = wire.encode_run(wire.BurstRun(9_002, wire.MAX_LAYOUTS))
                served = svc.burst_statistics().executions
                for bad in (run[:-4], run + b"\0" * 8, define[:-4], bytes(past_the_pool),
                            undefined):
                    result = await session.for_test_execute_raw(bad)
                    assert result.status == ErrorStatus.INVALID_ARGUMENT, result
                assert svc.burst_statistics().executions == served + 5
                # The refused definition of its number left the binding's
                # layout undefined in the service (frames the controller did
                # not send): its next frame is refused, then it defines the
                # layout again and goes on.
                other.array(np.float32, 8)[:] = 5
                result = await other_bound.execute()
                assert result.status == ErrorStatus.INVALID_ARGUMENT
                assert "is not defined" in result.message
                result = await other_bound.execute()
                assert result.status == ErrorStatus.NONE, result.message
                assert other.array(np.float32, 4, 32).tolist() == [10.0] * 4
                x[:], y[:] = 1, 2
                assert (await numpy_bound.execute()).status == ErrorStatus.NONE
                assert sums.tolist() == [[3.0] * 4]
                other.close()
        finally:
            dev.close()
            tg.cancel_scope.cancel()


async def test_malformed_requests_fail_alone_and_the_burst_goes_on(service):
    path, _proc = service
    dev = await ServiceDevice.connect(str(path))
    try:
        prepared = await dev.prepare_model(add_model())
        session = await prepared.configure_burst()
        mem = Memory.create(64)
        mem.array(np.float32, 8)[:] = 3
        try:
            # Garbage after a readable header: INVALID_ARGUMENT for that one.
            good = wire.encode_request(wire.BurstRequest(7, (), (), ()))
            for frame in (good[:24] + b"\xff" * 40, b"not a request", good + b"\0"):
                result = await session.for_test_execute_raw(frame)
                assert result.status == ErrorStatus.INVALID_ARGUMENT, result
            # A well-formed request naming a slot nobody gave out.
            arg = wire.BurstArgument(False, 0, 0, 16, (1, 4))
            forged = wire.encode_request(wire.BurstRequest(10_000, (arg, arg), (arg,), (999,)))
            result = await session.for_test_execute_raw(forged)
            assert result.status == ErrorStatus.INVALID_ARGUMENT and "999" in result.message
            # The driver's own validation applies: an output region past the pool.
            bad = Request(memory_request(mem).inputs,
                          (RequestArgument(False, DataLocation(0, 56, 16)),), (mem,))
            assert (await session.execute(bad)).status == ErrorStatus.INVALID_ARGUMENT
            result = await session.execute(memory_request(mem))
            assert result.status == ErrorStatus.NONE, result.message
            assert mem.array(np.float32, 4, 32).tolist() == [6.0] * 4
        finally:
            session.close()
            mem.close()
    finally:
        dev.close()


async def test_an_out_of_sync_ring_tears_the_burst_down_on_both_sides(service):
    path, proc = service
    dev = await ServiceDevice.connect(str(path))
    try:
        prepared = await dev.prepare_model(add_model())
        session = await prepared.configure_burst()
        probe = f"nnrt-burst-sync-{os.getpid()}"
        mem = Memory.create(64, probe)
        assert (await session.execute(memory_request(mem))).status == ErrorStatus.NONE
        session.for_test_corrupt_request_ring()
        await wait_until(lambda: probe not in maps_of(proc.pid), "the service unmaps")
        with anyio.fail_after(GUARD):
            result = await session.execute(memory_request(mem))
        assert result.status == ErrorStatus.GENERAL_FAILURE and "out of sync" in result.message
        session.close()
        # The connection is fine: a new burst works.
        async with await prepared.configure_burst() as again:
            assert (await again.execute(memory_request(mem))).status == ErrorStatus.NONE
        mem.close()
    finally:
        dev.close()


async def test_releasing_the_prepared_model_closes_its_bursts(service):
    path, _proc = service
    dev = await ServiceDevice.connect(str(path))
    try:
        prepared = await dev.prepare_model(add_model())
        session = await prepared.configure_burst()
        mem = Memory.create(64)
        assert (await session.execute(memory_request(mem))).status == ErrorStatus.NONE
        prepared.release()
        with anyio.fail_after(GUARD):
            result = await session.execute(memory_request(mem))
        assert result.status == ErrorStatus.INVALID_ARGUMENT and "closed" in result.message
        mem.close()
    finally:
        dev.close()
