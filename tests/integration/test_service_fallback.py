"""A driver service killed with SIGKILL while executions are in flight: with
devices named explicitly the pending executions fail with DEAD_OBJECT;
otherwise they and later executions complete on the CPU; either way the
dead device leaves rt.devices."""
import signal
import time

import anyio
import numpy as np
import pytest

import nnrt

from ..unit.test_partition import chain_model as small_chain


def slow_model() -> nnrt.Model:
    from nnrt.demo import chain_model
    return chain_model(30, seed=5)


async def _kill_during(rt, compiled, x, n=8):
    """Start n executions, SIGKILL the service once they are in flight;
    returns [(result or error, seconds from the kill)]."""
    outcomes = []
    killed_at = []

    async def one():
        try:
            r = await compiled.execute([x])
        except nnrt.NnrtError as e:
            r = e
        # Executions that finished before the kill have no time after it.
        outcomes.append((r, time.monotonic() - killed_at[0] if killed_at else None))

    async with anyio.create_task_group() as tg:
        for _ in range(n):
            tg.start_soon(one)
        await anyio.sleep(0.01)
        rt._services[0].process.send_signal(signal.SIGKILL)
        killed_at.append(time.monotonic())
    return outcomes


async def test_pending_executions_fail_with_dead_object_when_devices_are_named(monkeypatch,
                                                                               tmp_path):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.delenv("NNRT_DRIVERS", raising=False)
    async with nnrt.Runtime(spawn=[("npu", "reference")], litert=False) as rt:
        compiled = await rt.compile(slow_model(), devices=["npu"])
        x = np.random.default_rng(0).random((1, 40, 40, 32), dtype=np.float32)
        await compiled.execute([x])
        outcomes = await _kill_during(rt, compiled, x)
        dead = [(r, t) for r, t in outcomes if isinstance(r, nnrt.NnrtError)]
        assert dead, "no execution was in flight when the service died"
        for error, after in dead:
            assert error.status == nnrt.ErrorStatus.DEAD_OBJECT
            assert after < 5.0  # a generous guard: the failure comes from EOF, not a timeout
        assert [d.name for d in rt.devices] == ["nnrt-reference"]
        with pytest.raises(nnrt.NnrtError) as e:
            await compiled.execute([x])
        assert e.value.status == nnrt.ErrorStatus.DEAD_OBJECT


async def test_executions_fall_back_to_the_cpu_when_the_service_dies(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.delenv("NNRT_DRIVERS", raising=False)
    async with nnrt.Runtime(spawn=[("npu", "reference")], litert=False) as rt:
        compiled = await rt.compile(slow_model())
        assert [d.name for d in compiled.devices] == ["npu"]
        x = np.random.default_rng(0).random((1, 40, 40, 32), dtype=np.float32)
        expected = (await compiled.execute([x])).outputs[0]
        outcomes = await _kill_during(rt, compiled, x)
        for r, _ in outcomes:
            assert not isinstance(r, Exception), r
            assert np.allclose(r.outputs[0], expected, atol=1e-5)
        assert [d.name for d in compiled.devices] == ["nnrt-reference"]
        r = await compiled.execute([x])
        assert np.allclose(r.outputs[0], expected, atol=1e-5)
        # New compilations no longer see the dead device.
        assert [d.name for d in (await rt.compile(small_chain())).devices] == \
            ["nnrt-reference"]


async def test_an_apps_mistake_over_a_service_is_invalid_argument_and_keeps_the_device(
        monkeypatch, tmp_path):
    """Issue 22: None for a required input was a GENERAL_FAILURE in the
    service and moved the model to the CPU for good; a closed compiled model
    answered INVALID_ARGUMENT instead of BAD_STATE."""
    from ..unit.test_runtime import add_model
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.delenv("NNRT_DRIVERS", raising=False)
    async with nnrt.Runtime(spawn=[("npu", "reference")], litert=False) as rt:
        compiled = await rt.compile(add_model())
        x = np.ones((1, 4), np.float32)
        for bad in ([None, x], [x.astype(np.int32), x], [x, x[:, :3]]):
            with pytest.raises(nnrt.NnrtError) as e:
                await compiled.execute(bad)
            assert e.value.status == nnrt.ErrorStatus.INVALID_ARGUMENT
        assert [d.name for d in compiled.devices] == ["npu"]
        assert compiled.statistics().fallbacks == 0
        assert (await compiled.execute([x, x])).outputs[0].tolist() == [[2.0] * 4]
        compiled.close()
        with pytest.raises(nnrt.NnrtError) as e:
            await compiled.execute([x, x])
        assert e.value.result_code == nnrt.ResultCode.BAD_STATE


def test_sync_runtime_runs_executions_and_bursts_on_a_service(monkeypatch, tmp_path):
    """The SyncRuntime's loop only runs during calls: a service connection
    must still work across idle time between them, plainly and in bursts."""
    from ..unit.test_runtime import add_model
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.delenv("NNRT_DRIVERS", raising=False)
    x = np.ones((1, 4), np.float32)
    with nnrt.SyncRuntime(spawn=[("npu", "reference")], litert=False) as rt:
        compiled = rt.compile(add_model(), devices=["npu"])
        assert compiled.execute([x, x]).outputs[0].tolist() == [[2.0] * 4]
        time.sleep(0.5)
        assert compiled.execute([x, x]).outputs[0].tolist() == [[2.0] * 4]
        with compiled.burst() as burst:
            for k in range(20):
                assert burst.execute([x * k, x]).outputs[0].tolist() == [[k + 1.0] * 4]
            assert burst.statistics().sessions[0].executions == 20
        assert [d.name for d in compiled.devices] == ["npu"]


async def test_given_a_cpu_service_and_a_local_cpu_the_local_one_is_the_fallback(spawn_service):
    """Runtime(devices=[a service running the reference driver, the local
    reference device]): both are CPU devices, but only the local one outlives
    the service, so it is the fallback; after a SIGKILL of the service the
    execution reruns there instead of failing with DEAD_OBJECT."""
    from nnrt.drivers.reference import ReferenceDevice
    from nnrt.service.client import ServiceDevice
    path, proc = spawn_service("reference", name="cpu-service")
    service = await ServiceDevice.connect(str(path))
    async with nnrt.Runtime(devices=[service, ReferenceDevice()]) as rt:
        assert rt.cpu.name == "nnrt-reference"
        compiled = await rt.compile(small_chain())
        assert [d.name for d in compiled.devices] == ["cpu-service"]
        x = [np.ones(i.shape, np.float32) for i in compiled.inputs]
        want = (await compiled.execute(x)).outputs[0]
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        got = (await compiled.execute(x)).outputs[0]
        np.testing.assert_array_equal(got, want)
        assert [d.name for d in compiled.devices] == ["nnrt-reference"]
        assert compiled.placement.fallbacks[0].kind == "died"
