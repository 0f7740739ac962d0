"""Compilation caching across real processes: concurrent writers, a writer
killed mid-write, a driver service preparing from the app's fds (the reason
it refuses them crosses the wire), and files another user cannot read."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import nnrt
import nnrt.tflite

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT.parent / "shared" / "models"
SMALL = MODELS / "generated" / "mobilenet_v1_0.25_128_int8.tflite"


def _child(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.integration.cache_doubles",
                             *map(str, args)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _entries(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if len(p.name) == 64]


def _staging(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if p.name.startswith(".tmp-")]


def test_concurrent_writers_leave_one_valid_entry(tmp_path):
    cache, go = tmp_path / "cache", tmp_path / "go"
    children = [_child(SMALL, cache, go) for _ in range(4)]
    time.sleep(1.0)   # let them load the model and wait at the start line
    go.write_text("")
    results = []
    for c in children:
        out, err = c.communicate(timeout=120)
        assert c.returncode == 0, err
        results.append(out.split())
    # Every writer compiled (nobody's files existed yet) and got the same output.
    assert {r[3] for r in results} == {results[0][3]}
    assert all(r[2] == "0" for r in results)
    assert len(_entries(cache)) == 1 and _staging(cache) == []
    reader = _child(SMALL, cache)
    out, err = reader.communicate(timeout=120)
    hits, misses, rejected, checksum = out.split()
    assert (hits, misses, rejected, checksum) == ("1", "0", "0", results[0][3]), err


def test_a_writer_killed_mid_write_leaves_nothing_that_looks_valid(tmp_path):
    cache, ready = tmp_path / "cache", tmp_path / "ready"
    writer = _child(SMALL, cache, "", ready)
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert writer.poll() is None, writer.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait()
    # Its half-written file is in a staging folder no lookup reads.
    assert _entries(cache) == []
    [staged] = _staging(cache)
    assert (staged / "step0-model0").stat().st_size > 0
    reader = _child(SMALL, cache)
    out, err = reader.communicate(timeout=120)
    hits, misses, rejected, _ = out.split()
    assert (hits, misses, rejected) == ("0", "1", "0"), err   # a miss, not a wrong hit
    assert len(_entries(cache)) == 1
    assert _staging(cache) == []   # the dead writer's folder was swept


def _input(model):
    hal = model.hal_model
    o = hal.main.operands[hal.main.input_indexes[0]]
    return np.random.default_rng(3).integers(-128, 127, o.dimensions).astype(o.type.dtype)


@pytest.mark.parametrize("driver", ["reference", "litert"])
async def test_a_service_prepares_from_the_apps_fds_and_reports_why_it_refuses(
        tmp_path, monkeypatch, driver):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.delenv("NNRT_DRIVERS", raising=False)
    model = nnrt.tflite.load(SMALL)
    x = _input(model)
    cache = tmp_path / "cache"
    spawn = [("svc", driver)]

    async def compile_run(cache_dir):
        async with nnrt.Runtime(spawn=spawn, litert=False) as rt:
            compiled = await rt.compile(model, devices=["svc"], cache_dir=cache_dir)
            out = (await compiled.execute([x])).outputs[0]
            return np.array(out), rt.cache_statistics()

    plain, _ = await compile_run(None)
    cold, stats = await compile_run(cache)
    assert (stats.misses, stats.written) == (1, 1)
    warm, stats = await compile_run(cache)   # another service process, the same files
    assert (stats.hits, stats.rejects) == (1, {})
    assert np.array_equal(plain, cold) and np.array_equal(plain, warm)
    [entry] = _entries(cache)
    f = entry / "step0-model0"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x10
    f.write_bytes(bytes(data))
    again, stats = await compile_run(cache)
    assert stats.rejects == {"corrupt": 1} and stats.written == 1
    assert np.array_equal(plain, again)


async def test_device_memories_of_a_model_prepared_from_a_cache_on_a_service(
        tmp_path, monkeypatch):
    """A service that prepared a model from the app's cache files never saw
    its graph; a device memory in that model's roles still works (it just
    gets no recovery mirror), and gives the uncached results."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.delenv("NNRT_DRIVERS", raising=False)
    model = nnrt.tflite.load(SMALL)
    x = _input(model)
    cache = tmp_path / "cache"

    async def run_into_device_memory():
        async with nnrt.Runtime(spawn=[("svc", "reference")], litert=False) as rt:
            compiled = await rt.compile(model, devices=["svc"], cache_dir=cache)
            memory = await rt.allocate(nnrt.MemoryDesc().add_output_role(compiled, 0))
            assert memory.on_device
            await compiled.execute([x], outputs=[memory])
            out = compiled.outputs[0]
            with nnrt.Memory.create(out.dtype.itemsize * int(np.prod(out.shape))) as m:
                await nnrt.copy(memory, m)
                got = np.array(m.array(out.dtype, out.shape))
            memory.close()
            return got, rt.cache_statistics()

    cold, stats = await run_into_device_memory()
    assert stats.written == 1
    warm, stats = await run_into_device_memory()
    assert stats.hits == 1
    assert np.array_equal(cold, warm)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user")
def test_cache_files_are_unreadable_to_another_user():
    import pwd
    import shutil
    import tempfile
    nobody = pwd.getpwnam("nobody")
    # Folders every user may traverse (not pytest's 0700 tmp_path), so only
    # the cache's own modes protect it.
    folder = Path(tempfile.mkdtemp(prefix="nnrt-cache-user-"))
    try:
        folder.chmod(0o755)
        for parent in folder.parents:
            assert os.stat(parent).st_mode & 0o001, f"{parent} is not traversable by others"
        _check_unreadable(folder, nobody)
    finally:
        shutil.rmtree(folder)


def _check_unreadable(tmp_path, nobody):
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o755)
    cache.chmod(0o755)
    out, err = _child(SMALL, cache).communicate(timeout=120)
    [entry] = _entries(cache)
    files = sorted(entry.iterdir())
    assert files

    def attempt(paths) -> int:
        """Read ``paths`` as nobody in a forked child: how many it could read."""
        pid = os.fork()
        if pid == 0:
            try:
                os.setgroups([])
                os.setgid(nobody.pw_gid)
                os.setuid(nobody.pw_uid)
                readable = 0
                for p in paths:
                    try:
                        with open(p, "rb") as fh:
                            fh.read(1)
                        readable += 1
                    except PermissionError:
                        pass
                os._exit(readable)
            except BaseException:
                os._exit(100)
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

    assert attempt(files) == 0            # the entry folder (0700) keeps them out
    entry.chmod(0o755)                    # and each file (0600) on its own
    try:
        assert attempt(files) == 0
        probe = cache / "probe"
        probe.write_text("x")
        probe.chmod(0o644)
        assert attempt([probe]) == 1      # the check can fail: nobody reads a 0644 file
    finally:
        entry.chmod(0o700)
