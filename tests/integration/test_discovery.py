"""Device discovery with real driver service processes: NNRT_DRIVERS, the
config file, Runtime(spawn=...), and a model split between a service and the
in-process reference device."""
import os
import subprocess
import sys
import time

import anyio
import numpy as np
import pytest

import nnrt
from nnrt.model.types import HalVersion
from nnrt.runtime import discovery
from tests.conftest import start_service

from ..unit.test_partition import C, EXPECTED_T1, EXPECTED_Y, X, chain_model


@pytest.fixture
def service(tmp_path):
    """A `nnrt driver serve` process on a socket in tmp_path."""
    path = str(tmp_path / "fast.sock")
    proc = subprocess.Popen([sys.executable, "-m", "nnrt", "driver", "serve", "fast",
                             "--driver", "sample-float-fast", "--socket", path],
                            stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while not os.path.exists(path):
        assert proc.poll() is None, "the service exited"
        assert time.monotonic() < deadline, "the service did not start"
        time.sleep(0.02)
    yield path
    proc.terminate()
    proc.wait(timeout=10)


async def test_nnrt_drivers_and_the_config_file_name_services(service, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("NNRT_DRIVERS", service)
    async with nnrt.Runtime(litert=False) as rt:
        assert [d.name for d in rt.devices] == ["fast", "nnrt-reference"]
        fast = rt.devices[0]
        assert fast.version_string and fast.feature_level == HalVersion.FL7.feature_level
        assert fast.capabilities().performance(nnrt.OperandType.TENSOR_FLOAT32).exec_time < 1
    monkeypatch.delenv("NNRT_DRIVERS")
    conf = tmp_path / "config" / "nnrt" / "drivers.conf"
    conf.parent.mkdir(parents=True)
    conf.write_text(f"# services of this machine\n{service}\n{tmp_path / 'nobody.sock'}\n")
    assert discovery.configured_sockets() == [service, str(tmp_path / "nobody.sock")]
    async with nnrt.Runtime(litert=False) as rt:  # the dead entry is left out, the rest works
        assert [d.name for d in rt.devices] == ["fast", "nnrt-reference"]


async def test_spawned_services_run_part_of_a_model_and_stop_on_close(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.delenv("NNRT_DRIVERS", raising=False)
    rt = nnrt.Runtime(spawn=["sample-partial"], litert=False)
    async with rt:
        assert [d.name for d in rt.devices] == ["sample-partial", "nnrt-reference"]
        processes = [s.process for s in rt._services]
        compiled = await rt.compile(chain_model())
        assert {d.name for d in compiled.devices} == {"sample-partial", "nnrt-reference"}
        r = await compiled.execute([X, C])
        assert np.array_equal(r.outputs[0], EXPECTED_Y)
        assert np.array_equal(r.outputs[1], EXPECTED_T1)
    for p in processes:
        assert p.poll() is not None, "a spawned service outlived its runtime"


def test_nnrt_devices_lists_configured_services(service, tmp_path):
    env = dict(os.environ, NNRT_DRIVERS=service, XDG_CONFIG_HOME=str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "nnrt", "devices"], env=env, check=True,
                         capture_output=True, text=True).stdout
    assert out.splitlines()[0] == "fast" and "nnrt-reference" in out


async def test_constants_in_shared_memory_reach_a_service(monkeypatch, tmp_path):
    from nnrt.memory import Memory

    from ..unit.test_model_builder import memory_constant_model
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.delenv("NNRT_DRIVERS", raising=False)
    with Memory.create(4096) as memory:
        memory.array(np.float32, 64, offset=256)[:] = np.arange(64, dtype=np.float32)
        async with nnrt.Runtime(spawn=[("fast", "sample-float-fast")]) as rt:
            compiled = await rt.compile(memory_constant_model(memory), devices=["fast"])
            r = await compiled.execute([np.full(64, 3.0, np.float32)])
            assert r.outputs[0].tolist() == (np.arange(64) * 3.0).tolist()


async def test_inputs_and_outputs_in_shared_memory_are_not_copied(monkeypatch, tmp_path):
    """Regions of an nnrt.Memory as execution inputs and outputs, on a service
    and on the in-process reference device: results land in the memory."""
    from nnrt.memory import Memory

    from ..unit.test_runtime import add_model
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.delenv("NNRT_DRIVERS", raising=False)
    async with nnrt.Runtime(spawn=[("fast", "sample-float-fast")]) as rt:
        for device in ("fast", "nnrt-reference"):
            compiled = await rt.compile(add_model(), devices=[device])
            with Memory.create(4096) as memory:
                memory.array(np.float32, (1, 4), offset=0)[:] = [[1, 2, 3, 4]]
                memory.array(np.float32, (1, 4), offset=64)[:] = [[10, 20, 30, 40]]
                out = memory.region(1024, 16)
                r = await compiled.execute([memory.region(0, 16), memory.region(64, 16)],
                                           outputs=[out])
                assert r.outputs[0].tolist() == [[11, 22, 33, 44]]
                # The result is the memory itself, not a copy of it.
                assert memory.array(np.float32, (1, 4), offset=1024).tolist() == [[11, 22, 33, 44]]
                assert np.shares_memory(r.outputs[0], memory.array(np.float32, 4, offset=1024))
                del r


async def test_a_burst_through_the_runtime_uses_the_ring_of_the_service(monkeypatch, tmp_path):
    from nnrt.burst.controller import BurstController
    from nnrt.memory import Memory

    from ..unit.test_runtime import add_model
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.delenv("NNRT_DRIVERS", raising=False)
    async with nnrt.Runtime(spawn=[("npu", "reference")]) as rt:
        compiled = await rt.compile(add_model(), devices=["npu"])
        frames = np.random.default_rng(1).random((300, 1, 4), dtype=np.float32)
        expected = [(await compiled.execute([f, f])).outputs[0] for f in frames[:5]]
        with Memory.create(4096) as memory:
            async with compiled.burst() as burst:
                (session,) = burst._sessions.values()
                assert isinstance(session, BurstController)
                for k, f in enumerate(frames):
                    r = await burst.execute([f, f])
                    assert np.array_equal(r.outputs[0], f + f)
                    if k < 5:
                        assert np.array_equal(r.outputs[0], expected[k])
                memory.array(np.float32, (1, 4))[:] = frames[0]
                r = await burst.execute([memory.region(0, 16), memory.region(0, 16)])
                assert np.array_equal(r.outputs[0], frames[0] + frames[0])
                assert session.statistics().executions == 301
                stats = burst.statistics()   # issue 22: reachable from nnrt.Burst
                assert (stats.frames, stats.failures) == (301, 0)
                assert stats.sessions[0].executions == 301


# -- issue 22: discovery says what it drops, and an open runtime reconnects --------------

def test_config_entries_that_cannot_be_sockets_are_warned_about(monkeypatch, tmp_path, caplog):
    conf = tmp_path / "nnrt" / "drivers.conf"
    conf.parent.mkdir()
    conf.write_bytes(b"/run/a.sock\nrelative.sock\n/run/\xff\xfe.sock\n# comment\n")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.setenv("NNRT_DRIVERS", "/run/b.sock,/run/c.sock")
    with caplog.at_level("WARNING", logger="nnrt.manager"):
        assert discovery.configured_sockets() == ["/run/b.sock", "/run/c.sock", "/run/a.sock"]
    text = caplog.text
    assert "line 3 is not UTF-8" in text and "'relative.sock' is not an absolute" in text


def _serve(name: str, path: str):
    import subprocess
    import sys
    return subprocess.Popen([sys.executable, "-m", "nnrt", "driver", "serve", name, "--driver",
                             "reference", "--socket", path], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL)


async def _wait_for(path: str):
    import os
    for _ in range(1000):
        if os.path.exists(path):
            return
        await anyio.sleep(0.02)
    raise AssertionError(f"{path} never appeared")


async def test_an_open_runtime_offers_a_restarted_service_again(monkeypatch, tmp_path):
    from ..unit.test_runtime import add_model
    folder = tmp_path / "run"
    folder.mkdir(mode=0o700)
    path = str(folder / "npu.sock")
    missing = str(folder / "missing.sock")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.setenv("NNRT_DRIVERS", f"{path}:{missing}")
    # Started until it says it listens: its socket file appears a moment
    # before it does, and a runtime opened in between finds it unreachable.
    service = start_service(path, "reference", "npu")
    try:
        async with nnrt.Runtime(litert=False) as rt:
            states = {s.path: s for s in rt.services}
            assert states[path].state == "up" and states[path].device == "npu"
            assert states[missing].state == "unreachable"
            assert "No such file" in states[missing].reason
            assert (await rt.compile(add_model())).devices[0].name == "npu"
            service.terminate()
            service.wait()
            compiled = await rt.compile(add_model())
            assert compiled.devices[0].name == "nnrt-reference"
            assert {s.path: s.state for s in rt.services}[path] == "unreachable"
            service = _serve("npu", path)
            await _wait_for(path)
            for _ in range(100):   # the socket file exists a moment before it listens
                compiled = await rt.compile(add_model())
                if compiled.devices[0].name == "npu":
                    break
                await anyio.sleep(0.05)
            assert compiled.devices[0].name == "npu"
            x = np.ones((1, 4), np.float32)
            assert (await compiled.execute([x, x])).outputs[0].tolist() == [[2.0] * 4]
            assert {s.path: s.state for s in rt.services}[path] == "up"
    finally:
        service.terminate()
        service.wait()


def test_a_socket_of_an_untrusted_folder_is_listed_as_refused(monkeypatch, tmp_path):
    import os
    import socket
    folder = tmp_path / "open"
    folder.mkdir()
    os.chmod(folder, 0o777)
    path = str(folder / "x.sock")
    s = socket.socket(socket.AF_UNIX)
    s.bind(path)
    try:
        monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
        monkeypatch.setenv("NNRT_DRIVERS", path)

        async def main():
            async with nnrt.Runtime() as rt:
                return rt.services
        (state,) = anyio.run(main)
        assert state.state == "refused" and "can be changed by another user" in state.reason
    finally:
        s.close()


async def test_a_socket_that_refused_at_once_is_retried_a_silent_one_is_not(monkeypatch,
                                                                             tmp_path):
    """A socket file with no listener yet (a service between bind and
    listen) is tried again after RETRY_INTERVAL without a new file; one that
    made us wait for the connect timeout only when its file changes."""
    import socket

    from ..unit.test_runtime import add_model
    folder = tmp_path / "run"
    folder.mkdir(mode=0o700)
    refusing, silent = str(folder / "refusing.sock"), str(folder / "silent.sock")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.setenv("NNRT_DRIVERS", f"{silent}:{refusing}")
    monkeypatch.setenv("NNRT_CONNECT_TIMEOUT", "0.6")
    monkeypatch.setattr(discovery, "RETRY_INTERVAL", 1.0)
    attempts = []
    real_connect = discovery.connect

    async def counting(path, *args, **kwargs):
        attempts.append(path)
        return await real_connect(path, *args, **kwargs)
    monkeypatch.setattr(discovery, "connect", counting)
    bound = socket.socket(socket.AF_UNIX)
    bound.bind(refusing)        # bound, not listening: connect is refused at once
    quiet = socket.socket(socket.AF_UNIX)
    quiet.bind(silent)
    quiet.listen(1)             # accepts, never answers HELLO
    try:
        async with nnrt.Runtime() as rt:
            assert [s.state for s in rt.services] == ["unreachable", "unreachable"]
            assert attempts == [silent, refusing]
            await rt.compile(add_model())
            assert attempts == [silent, refusing]     # too soon for the refusing one
            await anyio.sleep(1.05)
            await rt.compile(add_model())
            assert attempts == [silent, refusing, refusing]
    finally:
        bound.close()
        quiet.close()


def test_nnrt_devices_lists_capabilities_and_every_configured_service(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir(mode=0o700)
    path, missing = str(folder / "npu.sock"), str(folder / "gone.sock")
    env = dict(os.environ, XDG_CONFIG_HOME=str(tmp_path), NNRT_DRIVERS=f"{path},{missing}")
    service = start_service(path, "reference", "npu")   # (listening, not just its file)
    try:
        out = subprocess.run([sys.executable, "-m", "nnrt", "devices"], env=env,
                             capture_output=True, text=True, timeout=120).stdout
    finally:
        service.terminate()
        service.wait()
    assert "npu\n  type:" in out and "nnrt-reference\n  type: CPU" in out
    assert "feature level: 7 (1000007)" in out and "state: up" in out
    # The reference driver (in process and served) offers nnrt's com.nnrt.tflite.
    assert out.count("extensions: com.nnrt.tflite") >= 2
    assert "TENSOR_FLOAT32: 1, 1" in out
    assert f"{path}: up (npu)" in out
    assert f"{missing}: unreachable: no driver service at {missing}" in out


async def test_a_spawned_kind_named_like_an_in_process_device_is_named_apart(monkeypatch,
                                                                           tmp_path):
    """``spawn=["litert"]`` next to the in-process litert device: the service
    is "litert-service", so devices= and reports can tell the two apart."""
    pytest.importorskip("ai_edge_litert")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.delenv("NNRT_DRIVERS", raising=False)
    async with nnrt.Runtime(spawn=["litert", "reference"], discover=False) as rt:
        names = [d.name for d in rt.devices]
        assert names == ["litert-service", "reference", "litert", "nnrt-reference"]
        assert len(set(names)) == len(names)
