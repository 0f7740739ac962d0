"""Reusable executions on a driver service: a request created once in the
service (CREATE_EXECUTION, its pools mapped for it alone), then computed by
id (COMPUTE: the id and the deadline; the pools' bytes move in shared
memory), released with the execution, the prepared model or the
connection; and what a hostile client can do with the new calls."""
import os
import signal

import anyio
import numpy as np
import pytest

import nnrt
from nnrt import ErrorStatus
from nnrt.drivers.reference import ReferenceDevice
from nnrt.service import protocol as p
from nnrt.service.client import ServiceDevice, ServiceExecution
from nnrt.service.server import serve
from nnrt.memory import Memory

from .test_burst import memory_request, wait_until
from .test_service import GUARD, add_model, numpy_request, public_add_model, start_service

pytestmark = pytest.mark.service


async def test_an_execution_is_created_once_and_computed_by_id(tmp_path):
    path = str(tmp_path / "executions.sock")
    async with anyio.create_task_group() as tg:
        svc = await tg.start(serve, ReferenceDevice(), path)
        dev = await ServiceDevice.connect(path)
        try:
            prepared = await dev.prepare_model(add_model())
            x, y, sums = (np.zeros((1, 4), np.float32) for _ in "xys")
            execution = prepared.create_execution(numpy_request([x, y], [sums]))
            assert isinstance(execution, ServiceExecution)
            connection, = svc.connections
            assert connection.executions == {}       # made with its first computation
            calls = svc.statistics().calls
            for k in range(5):
                x[:], y[:] = k, 2 * k
                with anyio.fail_after(GUARD):
                    result = await execution.execute()
                assert result.status == ErrorStatus.NONE, result.message
                assert sums.tolist() == [[3.0 * k] * 4]
            # One CREATE_EXECUTION, then one COMPUTE per computation.
            assert svc.statistics().calls == calls + 6
            assert len(connection.executions) == 1
            # From a thread, blocking: the same execution.
            x[:] = 10
            result = await anyio.to_thread.run_sync(execution.execute_synchronously)
            assert result.status == ErrorStatus.NONE and sums.tolist() == [[18.0] * 4]   # 10 + 8
            execution.release()
            await wait_until(lambda: connection.executions == {}, "the service releases it")
            result = await execution.execute()
            assert result.status == ErrorStatus.INVALID_ARGUMENT and "released" in result.message
        finally:
            dev.close()
            tg.cancel_scope.cancel()


async def test_a_memory_pool_is_computed_in_place_and_a_bad_request_fails_its_computation(
        tmp_path):
    path = str(tmp_path / "executions.sock")
    async with anyio.create_task_group() as tg:
        svc = await tg.start(serve, ReferenceDevice(), path)
        dev = await ServiceDevice.connect(path)
        try:
            prepared = await dev.prepare_model(add_model())
            with Memory.create(64) as mem:
                execution = prepared.create_execution(memory_request(mem))
                for k in range(3):
                    mem.array(np.float32, 8)[:] = k
                    result = await execution.execute()
                    assert result.status == ErrorStatus.NONE, result.message
                    assert mem.array(np.float32, 4, 32).tolist() == [2.0 * k] * 4
                execution.release()
            # A request the driver refuses: its first computation says why.
            x, y = np.zeros((1, 4), np.float32), np.zeros((1, 4), np.float32)
            short = np.zeros((1, 2), np.float32)
            bad = prepared.create_execution(numpy_request([x, y], [short]))
            result = await bad.execute()
            assert result.status in (ErrorStatus.INVALID_ARGUMENT,
                                     ErrorStatus.OUTPUT_INSUFFICIENT_SIZE), result
            connection, = svc.connections
            assert len(connection.executions) <= 1
            bad.release()
        finally:
            dev.close()
            tg.cancel_scope.cancel()


async def test_executions_go_with_their_prepared_model_and_their_connection(tmp_path):
    path = str(tmp_path / "executions.sock")
    async with anyio.create_task_group() as tg:
        svc = await tg.start(serve, ReferenceDevice(), path)
        dev = await ServiceDevice.connect(path)
        try:
            prepared = await dev.prepare_model(add_model())
            x, y, sums = (np.ones((1, 4), np.float32) for _ in "xys")
            for _ in range(3):
                assert (await prepared.create_execution(numpy_request([x, y], [sums]))
                        .execute()).status == ErrorStatus.NONE
            connection, = svc.connections
            assert len(connection.executions) == 3
            prepared.release()
            await wait_until(lambda: connection.executions == {}, "released with the model")
            other = await dev.prepare_model(add_model())
            assert (await other.create_execution(numpy_request([x, y], [sums]))
                    .execute()).status == ErrorStatus.NONE
            assert len(connection.executions) == 1
        finally:
            dev.close()
        await wait_until(lambda: not svc.connections, "the connection closes")
        tg.cancel_scope.cancel()


async def test_the_new_calls_refuse_what_is_not_the_callers(tmp_path):
    """COMPUTE or RELEASE_EXECUTION of an id that is not the connection's
    (another connection's, or none), and CREATE_EXECUTION naming a driver
    buffer or a pool without its fd: INVALID_ARGUMENT, and the service
    serves on."""
    path = str(tmp_path / "executions.sock")
    async with anyio.create_task_group() as tg:
        await tg.start(serve, ReferenceDevice(), path)
        mine, theirs = await ServiceDevice.connect(path), await ServiceDevice.connect(path)
        try:
            prepared = await theirs.prepare_model(add_model())
            x, y, sums = (np.ones((1, 4), np.float32) for _ in "xys")
            execution = prepared.create_execution(numpy_request([x, y], [sums]))
            assert (await execution.execute()).status == ErrorStatus.NONE
            for target in (execution._id, 10_000):
                reply = await mine._channel.call(lambda cid: p.Compute(cid, target, None))
                assert reply.status == ErrorStatus.INVALID_ARGUMENT, reply
                reply = await mine._channel.call(lambda cid: p.ReleaseExecution(cid, target))
                assert reply.status == ErrorStatus.INVALID_ARGUMENT, reply
            model = await mine.prepare_model(add_model())
            request = numpy_request([x, y], [sums])
            args = (model.model_id, request.inputs, request.outputs)
            for pools, what in (((p.WireToken(7),) * 3, "driver buffer"),
                                ((p.WirePool(0, None, True, 0, 64, 0, 16),) * 3, "without")):
                reply = await mine._channel.call(
                    lambda cid: p.CreateExecution(cid, *args, pools))
                assert reply.status == ErrorStatus.INVALID_ARGUMENT and what in reply.message
            # Theirs is untouched.
            x[:] = 5
            assert (await execution.execute()).status == ErrorStatus.NONE
            assert sums.tolist() == [[6.0] * 4]
        finally:
            mine.close()
            theirs.close()
            tg.cancel_scope.cancel()


async def test_a_reusable_execution_on_a_service_falls_back_when_the_service_dies(tmp_path):
    proc = start_service(tmp_path / "dying.sock", "reference", "dying")
    try:
        dev = await ServiceDevice.connect(str(tmp_path / "dying.sock"))
        async with nnrt.Runtime(devices=[dev, ReferenceDevice()]) as rt:
            compiled = await rt.compile(public_add_model())
            assert [d.name for d in compiled.devices] == ["dying"]
            x = np.arange(4, dtype=np.float32).reshape(1, 4)
            execution = compiled.create_execution([x, x])
            assert (await execution.compute()).outputs[0].tolist() == [[0, 2, 4, 6]]
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            x += 1
            with anyio.fail_after(GUARD):
                result = await execution.compute()
            assert result.outputs[0].tolist() == [[2, 4, 6, 8]]
            assert compiled.statistics().fallbacks == 1
            assert [d.name for d in compiled.devices] == ["nnrt-reference"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_the_pools_a_connections_executions_map_are_bounded(tmp_path, monkeypatch):
    """Each reusable execution maps its pools (an fd and a mapping each): a
    connection creating execution after execution is refused past the
    bound, RESOURCE_EXHAUSTED for it alone, and another connection is served."""
    from nnrt.service import server
    monkeypatch.setattr(server, "MAX_EXECUTION_POOLS_PER_CONNECTION", 6)
    path = str(tmp_path / "executions.sock")
    async with anyio.create_task_group() as tg:
        svc = await tg.start(serve, ReferenceDevice(), path)
        greedy, other = await ServiceDevice.connect(path), await ServiceDevice.connect(path)
        try:
            prepared = await greedy.prepare_model(add_model())
            kept = []
            for k in range(7):    # one mapping each: its arena (three pools in it)
                mem = Memory.create(64)   # (its output: a numpy view, staged like the rest)
                x = np.ones((1, 4), np.float32)
                out = mem.array(np.float32, 4).reshape(1, 4)
                kept.append((mem, prepared.create_execution(numpy_request([x, x], [out]))))
            statuses = [(await e.execute()).status for _, e in kept]
            assert statuses == [ErrorStatus.NONE] * 6 + [ErrorStatus.RESOURCE_EXHAUSTED_PERSISTENT]
            assert "the limit of 6" in (await kept[-1][1].execute()).message
            mine = await other.prepare_model(add_model())
            x, y, sums = (np.ones((1, 4), np.float32) for _ in "xys")
            assert (await mine.create_execution(numpy_request([x, y], [sums])).execute()) \
                .status == ErrorStatus.NONE
            kept[0][1].release()          # room again
            connection = next(c for c in svc.connections if len(c.executions) >= 5)
            await wait_until(lambda: len(connection.executions) == 5, "released")
            assert (await kept[-1][1].execute()).status == ErrorStatus.NONE
        finally:
            for mem, execution in kept:
                execution.release()
                mem.close()
            greedy.close()
            other.close()
            tg.cancel_scope.cancel()


async def test_an_execution_the_app_drops_is_released_in_the_service(tmp_path):
    import gc
    path = str(tmp_path / "executions.sock")
    async with anyio.create_task_group() as tg:
        svc = await tg.start(serve, ReferenceDevice(), path)
        dev = await ServiceDevice.connect(path)
        try:
            async with nnrt.Runtime(devices=[dev, ReferenceDevice()]) as rt:
                compiled = await rt.compile(public_add_model())
                x = np.ones((1, 4), np.float32)
                for _ in range(3):
                    execution = compiled.create_execution([x, x])
                    assert (await execution.compute()).outputs[0].tolist() == [[2.0] * 4]
                connection, = svc.connections
                del execution
                gc.collect()
                await wait_until(lambda: connection.executions == {}, "released when collected")
        finally:
            dev.close()
            tg.cancel_scope.cancel()
