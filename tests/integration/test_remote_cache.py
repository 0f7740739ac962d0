"""Compilation caching on a remote device (issue 42): the app keeps the
cache files on its host, the litert server on 127.0.0.2 fills them and
prepares from them. The second compilation is a hit (the runtime's
counters), a tampered or truncated file and another app's entry are
refused with their reason and compiled afresh, a hostile client's cache
messages are refused without hurting the server, and a restarted server
takes the files as docs/operators/remote.md says."""
import os
import shutil

import grpc
import numpy as np
import pytest

import nnrt
import nnrt.tflite
from nnrt.hal.types import Priority
from nnrt.service.remote import nnrt_remote_v1_pb2 as pb
from nnrt.service.remote import nnrt_remote_v1_pb2_grpc as pb_grpc
from nnrt.service.remote.client import RemoteDevice

from .test_cache_processes import SMALL, _entries, _input
from ..conftest import start_remote_service, stop
from .test_remote import HOST, BOUND, _tls, pki, remote_service  # noqa: F401  (fixtures)


def _serve(remote_service, pki, state):   # noqa: F811
    """A litert server "far" whose cache key lives in ``state``."""
    return remote_service(*_flags(pki), kind="litert",
                          env={**os.environ, "XDG_STATE_HOME": str(state)})


def _flags(pki) -> list[str]:   # noqa: F811
    return ["--tls-cert", str(pki["server"]), "--tls-key", str(pki["server.key"]),
            "--client-ca", str(pki["ca"])]


@pytest.fixture(scope="module")
def far(pki, tmp_path_factory):   # noqa: F811
    """One litert server for the module (mutual TLS): its target and the
    folder of its cache key."""
    state = tmp_path_factory.mktemp("state")
    proc, target = start_remote_service(f"{HOST}:0", "litert", "far", *_flags(pki),
                                        env={**os.environ, "XDG_STATE_HOME": str(state)})
    yield target, state
    stop(proc)


async def _compile_run(device, model, x, cache_dir):
    async with nnrt.Runtime(devices=[device], litert=False, strict=True) as rt:
        compiled = await rt.compile(model, devices=["far"], cache_dir=cache_dir)
        assert [d.name for d in compiled.devices] == ["far"]
        out = np.array((await compiled.execute([x])).outputs[0])
        return out, rt.cache_statistics()


def _flip(path, at):
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


async def test_a_remote_litert_compile_hits_the_apps_cache_and_bad_files_are_refused(
        far, pki, tmp_path):  # noqa: F811
    target, _ = far
    model = nnrt.tflite.load(SMALL)
    x = _input(model)
    camera = await RemoteDevice.connect(target, tls=_tls(pki, "camera"))
    batch = await RemoteDevice.connect(target, tls=_tls(pki, "batch"))
    try:
        assert camera.number_of_cache_files_needed() == (1, 1)
        plain, _ = await _compile_run(camera, model, x, None)
        mine = tmp_path / "camera-cache"
        cold, stats = await _compile_run(camera, model, x, mine)
        assert (stats.misses, stats.written) == (1, 1)
        warm, stats = await _compile_run(camera, model, x, mine)
        assert (stats.hits, stats.misses, stats.rejects) == (1, 0, {})
        assert np.array_equal(plain, cold) and np.array_equal(plain, warm)

        # A flipped byte in the driver's bytes, then a file cut short: each
        # refused with its reason, compiled afresh, the entry rewritten.
        [entry] = _entries(mine)
        _flip(entry / "step0-model0", 40)
        again, stats = await _compile_run(camera, model, x, mine)
        assert (stats.hits, stats.rejects, stats.written) == (0, {"corrupt": 1}, 1)
        data = entry / "step0-data0"
        data.write_bytes(data.read_bytes()[:30])
        again2, stats = await _compile_run(camera, model, x, mine)
        assert (stats.hits, stats.rejects, stats.written) == (0, {"truncated": 1}, 1)
        assert np.array_equal(plain, again) and np.array_equal(plain, again2)

        # Another app with a copy of camera's entry (same model, same token):
        # the server sealed it for camera, so batch's compile is refused as
        # foreign and compiled afresh; batch's own entry then hits.
        theirs = tmp_path / "batch-cache"
        shutil.copytree(mine, theirs)
        out, stats = await _compile_run(batch, model, x, theirs)
        assert (stats.hits, stats.rejects, stats.written) == (0, {"foreign": 1}, 1)
        out2, stats = await _compile_run(batch, model, x, theirs)
        assert (stats.hits, stats.rejects) == (1, {})
        assert np.array_equal(plain, out) and np.array_equal(plain, out2)
        # ... and camera's entry, rewritten for batch, is now foreign to camera.
        shutil.rmtree(mine)
        shutil.copytree(theirs, mine)
        _, stats = await _compile_run(camera, model, x, mine)
        assert stats.rejects == {"foreign": 1}
    finally:
        camera.close()
        batch.close()


async def test_cache_messages_of_a_hostile_client_are_refused_and_the_server_serves_on(
        far, pki):  # noqa: F811
    target, _ = far
    token = bytes(range(32))
    with grpc.secure_channel(target.removeprefix("grpcs://"),
                             _tls(pki, "camera").credentials()) as channel:
        remote = pb_grpc.RemoteStub(channel)
        session_call = remote.Session(pb.SessionRequest())
        session = next(session_call).session

        def from_cache(token=token, model=(b"x" * 80,), data=(b"y" * 80,)):
            cache = pb.CacheFiles(token=token, model=model, data=data)
            return remote.PrepareModelFromCache(pb.PrepareModelFromCacheRequest(
                session=session, priority=int(Priority.MEDIUM), cache=cache), timeout=BOUND)

        # Wrong shapes: INVALID_ARGUMENT.
        for bad in (dict(token=b"short"), dict(model=()), dict(data=(b"1", b"2"))):
            with pytest.raises(grpc.RpcError) as e:
                from_cache(**bad)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad
        # Bytes the server never sealed, cut short or made up: refused, with why.
        assert from_cache(model=(b"",)).reject == "truncated"
        assert from_cache().reject == "foreign"
        # A message over the bound: gRPC refuses it before anything is decoded.
        with pytest.raises(grpc.RpcError) as e:
            from_cache(data=(bytes(66 << 20),))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.RpcError) as e:
            remote.PrepareModelCaching(pb.PrepareModelCachingRequest(
                prepare=pb.PrepareModelRequest(session=session), token=b"\0" * 31),
                timeout=BOUND)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert remote.GetInfo(pb.GetInfoRequest(), timeout=BOUND).name == "far"
        session_call.cancel()


async def test_a_restarted_server_takes_the_files_while_its_cache_key_is_the_same(
        far, remote_service, pki, tmp_path):  # noqa: F811
    model = nnrt.tflite.load(SMALL)
    x = _input(model)
    cache = tmp_path / "cache"

    async def compile_on(target):
        device = await RemoteDevice.connect(target, tls=_tls(pki, "camera"))
        try:
            return await _compile_run(device, model, x, cache)
        finally:
            device.close()

    async def compile_on_a_new_server(state):
        proc, target = _serve(remote_service, pki, state)
        try:
            return await compile_on(target)
        finally:
            stop(proc)

    target, state = far
    first, stats = await compile_on(target)
    assert (stats.misses, stats.written) == (1, 1)
    # Another server process, the same user's key: a hit.
    same, stats = await compile_on_a_new_server(state)
    assert (stats.hits, stats.rejects) == (1, {})
    # A server with another key (another user or host): the seal does not
    # hold; compiled afresh and rewritten for it.
    other, stats = await compile_on_a_new_server(tmp_path / "other-state")
    assert (stats.hits, stats.rejects, stats.written) == (0, {"corrupt": 1}, 1)
    assert np.array_equal(first, same) and np.array_equal(first, other)
