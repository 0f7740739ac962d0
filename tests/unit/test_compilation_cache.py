"""Compilation caching in one process: the envelope of a cache file, the
runtime's entries (hit, miss, every kind of bad file), and results that are
exactly those of an uncached compilation, on the reference and LiteRT drivers."""
import os
import shutil
import threading
from pathlib import Path

import anyio
import numpy as np
import pytest

import nnrt
import nnrt.tflite
from nnrt import ErrorStatus, NnrtError
from nnrt.drivers.litert.driver import LiteRTDevice
from nnrt.drivers.reference import ReferenceDevice
from nnrt.hal.cache import (CacheFiles, CacheReject, CacheRejected, read_file, read_parts,
                            write_file)
from nnrt.runtime import cache as rc
from tests.conftest import MODELS

SMALL = MODELS / "generated" / "mobilenet_v1_0.25_128_int8.tflite"
OTHER = MODELS / "generated" / "mobilenet_v2_0.35_96_int8.tflite"
TOKEN = bytes(range(32))
# A size a cache file announces that reading it whole would show in the RSS
# (a sparse file: no disk used), for the "refused without reading it into
# memory" tests.
HUGE = 384 << 20


def _peak_growth_kib(call) -> int:
    """How far above its resident size when called the process's peak RSS
    went during ``call()``: the peak (VmHWM) is reset first (clear_refs 5),
    so what earlier tests of this worker held does not hide a big read."""
    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(key))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS:")
    call()
    return status("VmHWM:") - before


# -- the envelope --------------------------------------------------------------------

def _file(tmp_path, payload=b"payload " * 100, **kw):
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    args = dict(kind="k", version="v1", token=TOKEN) | kw
    write_file(fd, payload=payload, **args)
    return fd


def _reason(fd, **kw):
    args = dict(kind="k", version="v1", token=TOKEN) | kw
    with pytest.raises(CacheRejected) as e:
        read_file(fd, **args)
    assert e.value.status == ErrorStatus.GENERAL_FAILURE
    return e.value.reason


def test_envelope_round_trips_and_names_each_kind_of_bad_file(tmp_path):
    fd = _file(tmp_path)
    try:
        assert bytes(read_file(fd, kind="k", version="v1", token=TOKEN)) == b"payload " * 100
        assert _reason(fd, version="v2") is CacheReject.STALE
        assert _reason(fd, token=bytes(32)) is CacheReject.FOREIGN
        assert _reason(fd, kind="other") is CacheReject.FOREIGN
        size = os.fstat(fd).st_size
        data = os.pread(fd, size, 0)
        for cut in (0, 5, 12, 40, size // 2, size - 1):
            os.ftruncate(fd, 0)
            os.pwrite(fd, data[:cut], 0)
            assert _reason(fd) is CacheReject.TRUNCATED, cut
        for at in (60, size // 2, size - 1):   # the header's token, the payload, the MAC
            os.ftruncate(fd, 0)
            os.pwrite(fd, data[:at] + bytes([data[at] ^ 0x40]) + data[at + 1:], 0)
            assert _reason(fd) in (CacheReject.CORRUPT, CacheReject.FOREIGN), at
        os.ftruncate(fd, 0)
        os.pwrite(fd, b"X" + data[1:], 0)
        assert _reason(fd) is CacheReject.FOREIGN      # not a cache file at all
        os.ftruncate(fd, 0)
        os.pwrite(fd, data + b"\0", 0)
        assert _reason(fd) is CacheReject.CORRUPT
    finally:
        os.close(fd)


def test_a_payload_flip_is_corrupt_not_anything_else(tmp_path):
    fd = _file(tmp_path)
    try:
        data = bytearray(os.pread(fd, 1 << 20, 0))
        data[len(data) // 2] ^= 1
        os.pwrite(fd, bytes(data), 0)
        assert _reason(fd) is CacheReject.CORRUPT
    finally:
        os.close(fd)


PARTS = [b"a" * 1000, b"", bytes(range(256)) * 20]
SIZES = [len(p) for p in PARTS]


def _parts_reason(fd, sizes=SIZES, **kw):
    args = dict(kind="k", version="v1", token=TOKEN) | kw
    with pytest.raises(CacheRejected) as e:
        read_parts(fd, sizes=sizes, **args)
    return e.value.reason


def test_parts_round_trip_in_one_pass_and_name_each_kind_of_bad_file(tmp_path):
    fd = _file(tmp_path, payload=PARTS)
    try:
        parts = read_parts(fd, kind="k", version="v1", token=TOKEN, sizes=SIZES)
        assert parts == PARTS and all(type(p) is bytes for p in parts)
        # The same file read whole: the table of sizes, then the parts.
        assert bytes(read_file(fd, kind="k", version="v1", token=TOKEN)).endswith(
            b"".join(PARTS))
        assert _parts_reason(fd, version="v2") is CacheReject.STALE
        assert _parts_reason(fd, token=bytes(32)) is CacheReject.FOREIGN
        assert _parts_reason(fd, kind="other") is CacheReject.FOREIGN
        # A good file that is not the one the record describes.
        assert _parts_reason(fd, sizes=[1000, 0, 5119]) is CacheReject.FOREIGN
        assert _parts_reason(fd, sizes=[1000, 5120]) is CacheReject.FOREIGN
        size = os.fstat(fd).st_size
        data = os.pread(fd, size, 0)
        for cut in (0, 5, 12, 40, size // 2, size - 1):
            os.ftruncate(fd, 0)
            os.pwrite(fd, data[:cut], 0)
            assert _parts_reason(fd) is CacheReject.TRUNCATED, cut
        for at in (size // 3, size // 2, size - 1):   # each part, the MAC
            os.ftruncate(fd, 0)
            os.pwrite(fd, data[:at] + bytes([data[at] ^ 0x40]) + data[at + 1:], 0)
            assert _parts_reason(fd) is CacheReject.CORRUPT, at
            # Damaged and not what the record says: still named corrupt.
            assert _parts_reason(fd, sizes=[1, 2]) is CacheReject.CORRUPT, at
        os.ftruncate(fd, 0)
        os.pwrite(fd, data + b"\0", 0)
        assert _parts_reason(fd) is CacheReject.CORRUPT
    finally:
        os.close(fd)


@pytest.mark.slow
def test_parts_the_record_does_not_announce_are_not_read_into_memory(tmp_path):
    fd = _file(tmp_path, payload=PARTS)
    try:
        data = os.pread(fd, 1 << 20, 0)
        head_end = len(data) - 32 - 8 * (1 + len(SIZES)) - sum(SIZES)
        head = bytearray(data[:head_end])
        head[-8:] = HUGE.to_bytes(8, "little")   # a header announcing 384 MiB
        os.ftruncate(fd, 0)
        os.pwrite(fd, bytes(head), 0)
        os.ftruncate(fd, head_end + HUGE + 32)   # sparse
        reasons = []
        growth = _peak_growth_kib(lambda: reasons.append(_parts_reason(fd)))
        assert reasons == [CacheReject.CORRUPT]
        assert growth < 64 * 1024   # KiB: far less than the size announced
    finally:
        os.close(fd)


def test_a_pipe_is_refused_before_it_can_block_a_driver():
    r, w = os.pipe()
    try:
        with pytest.raises(NnrtError) as e:
            read_file(r, kind="k", version="v", token=TOKEN)
        assert e.value.status == ErrorStatus.INVALID_ARGUMENT
    finally:
        os.close(r)
        os.close(w)


def test_cache_files_check_the_token():
    with pytest.raises(NnrtError):
        CacheFiles((3,), (), b"short")


# -- the runtime ----------------------------------------------------------------------

def _input(model):
    hal = model.hal_model
    o = hal.main.operands[hal.main.input_indexes[0]]
    return np.random.default_rng(7).integers(-128, 127, o.dimensions).astype(o.type.dtype)


async def _compile_run(device, model, cache_dir, **kw):
    async with nnrt.Runtime(devices=[device], discover=False, litert=False) as rt:
        compiled = await rt.compile(model, cache_dir=cache_dir, **kw)
        result = await compiled.execute([_input(model)])
        return [np.array(o) for o in result.outputs], rt.cache_statistics()


def _run(device, model, cache_dir, **kw):
    return anyio.run(lambda: _compile_run(device, model, cache_dir, **kw))


def _entry(cache_dir) -> Path:
    entries = [p for p in Path(cache_dir).iterdir() if len(p.name) == 64]
    assert len(entries) == 1, entries
    return entries[0]


DEVICES = {"reference": ReferenceDevice, "litert": LiteRTDevice}


@pytest.fixture(scope="module")
def small():
    return nnrt.tflite.load(SMALL)


@pytest.mark.parametrize("driver", DEVICES)
def test_miss_then_hit_with_identical_outputs(tmp_path, small, driver):
    plain, stats = _run(DEVICES[driver](), small, None)
    assert stats == rc.CacheStatistics()
    cold, stats = _run(DEVICES[driver](), small, tmp_path)
    assert (stats.hits, stats.misses, stats.written, stats.rejects) == (0, 1, 1, {})
    warm, stats = _run(DEVICES[driver](), small, tmp_path)
    assert (stats.hits, stats.misses, stats.written, stats.rejects) == (1, 0, 0, {})
    for a, b, c in zip(plain, cold, warm):
        assert np.array_equal(a, b) and np.array_equal(a, c)
    entry = _entry(tmp_path)
    assert (entry.stat().st_mode & 0o777) == 0o700
    assert {f.name for f in entry.iterdir()} >= {"compilation", "step0-model0"}
    for f in entry.iterdir():
        assert (f.stat().st_mode & 0o777) == 0o600 and f.stat().st_uid == os.getuid()


def _damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncate":
        path.write_bytes(data[:len(data) // 3])
    elif how == "flip":
        mid = len(data) // 2
        path.write_bytes(data[:mid] + bytes([data[mid] ^ 0xFF]) + data[mid + 1:])


@pytest.mark.parametrize("driver", DEVICES)
@pytest.mark.parametrize("how, reason", [("truncate", "truncated"), ("flip", "corrupt")])
def test_a_damaged_file_is_rejected_counted_and_compiled_afresh(tmp_path, small, driver, how,
                                                                reason):
    plain, _ = _run(DEVICES[driver](), small, None)
    _run(DEVICES[driver](), small, tmp_path)
    names = ["step0-model0"] + (["step0-data0"] if driver == "litert" else [])
    for name in names:
        shutil.copytree(tmp_path, tmp_path.with_name(tmp_path.name + "-good"), dirs_exist_ok=True)
        _damage(_entry(tmp_path) / name, how)
        outputs, stats = _run(DEVICES[driver](), small, tmp_path)
        assert stats.rejects == {reason: 1} and stats.hits == 0 and stats.written == 1
        assert all(np.array_equal(a, b) for a, b in zip(plain, outputs))
        # The entry was rewritten: the next compilation hits.
        _, stats = _run(DEVICES[driver](), small, tmp_path)
        assert (stats.hits, stats.rejects) == (1, {})


def test_a_damaged_record_is_rejected_and_rewritten(tmp_path, small):
    _run(ReferenceDevice(), small, tmp_path)
    _damage(_entry(tmp_path) / "compilation", "flip")
    _, stats = _run(ReferenceDevice(), small, tmp_path)
    assert stats.rejects == {"corrupt": 1} and stats.written == 1
    _, stats = _run(ReferenceDevice(), small, tmp_path)
    assert stats.hits == 1


@pytest.mark.parametrize("driver", DEVICES)
def test_files_swapped_between_models_are_foreign(tmp_path, small, driver):
    other = nnrt.tflite.load(OTHER)
    a, b = tmp_path / "a", tmp_path / "b"
    plain, _ = _run(DEVICES[driver](), other, None)
    _run(DEVICES[driver](), small, a)
    _run(DEVICES[driver](), other, b)
    for f in _entry(a).iterdir():
        if f.name.startswith("step"):
            shutil.copyfile(f, _entry(b) / f.name)
    outputs, stats = _run(DEVICES[driver](), other, b)
    assert stats.rejects == {"foreign": 1} and stats.hits == 0
    assert all(np.array_equal(x, y) for x, y in zip(plain, outputs))


class _NextVersion(ReferenceDevice):
    version_string = ReferenceDevice.version_string + "+next"


def test_another_driver_version_gets_its_own_entry_and_rejects_the_old_files(tmp_path, small):
    _run(ReferenceDevice(), small, tmp_path)
    old = _entry(tmp_path)
    _, stats = _run(_NextVersion(), small, tmp_path)
    assert stats.misses == 1   # a different key: never the old version's files
    new = [p for p in tmp_path.iterdir() if len(p.name) == 64 and p != old][0]
    shutil.copyfile(old / "step0-model0", new / "step0-model0")
    plain, _ = _run(_NextVersion(), small, None)
    outputs, stats = _run(_NextVersion(), small, tmp_path)
    assert stats.rejects == {"stale": 1}
    assert all(np.array_equal(x, y) for x, y in zip(plain, outputs))


def test_the_token_and_the_model_both_key_the_entry(tmp_path, small):
    _, stats = _run(ReferenceDevice(), small, tmp_path, token=TOKEN)
    assert stats.misses == 1
    _, stats = _run(ReferenceDevice(), small, tmp_path, token=TOKEN)
    assert stats.hits == 1
    _, stats = _run(ReferenceDevice(), small, tmp_path, token=bytes(32))
    assert stats.misses == 1   # another token: another entry
    _, stats = _run(ReferenceDevice(), nnrt.tflite.load(OTHER), tmp_path, token=TOKEN)
    assert stats.misses == 1   # the same token for another model never reuses its files
    assert len([p for p in tmp_path.iterdir() if len(p.name) == 64]) == 3


def test_bad_arguments_are_invalid(tmp_path, small):
    for kw in ({"token": b"x"}, {"token": "a" * 32}, {"token": TOKEN, "cache_dir": None}):
        kw = {"cache_dir": tmp_path} | kw
        with pytest.raises(NnrtError) as e:
            _run(ReferenceDevice(), small, **kw)
        assert e.value.status == ErrorStatus.INVALID_ARGUMENT


class _NoCache(ReferenceDevice):
    def number_of_cache_files_needed(self):
        return (0, 0)


def test_a_device_without_a_cache_compiles_as_before(tmp_path, small):
    plain, _ = _run(ReferenceDevice(), small, None)
    for _ in range(2):
        outputs, stats = _run(_NoCache(), small, tmp_path)
        assert (stats.uncached, stats.hits, stats.misses, stats.rejects) == (1, 0, 0, {})
        assert all(np.array_equal(x, y) for x, y in zip(plain, outputs))
    # The HAL's default, for a driver that keeps no cache: a counted refusal.
    from nnrt.hal import Device
    with pytest.raises(CacheRejected) as e:
        anyio.run(lambda: Device.prepare_model_from_cache(_NoCache(), CacheFiles((), (), TOKEN)))
    assert e.value.reason is CacheReject.UNUSABLE


def test_the_cli_lists_and_clears_entries(tmp_path, small, capsys):
    from nnrt.cli import main
    _run(ReferenceDevice(), small, tmp_path)
    os.mkdir(tmp_path / ".tmp-999999999-abc")   # left by a writer that died
    (tmp_path / "unrelated").write_text("kept")
    assert main(["cache", "ls", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "ok" in out and "nnrt-reference" in out and "staging" in out
    assert main(["cache", "clear", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["unrelated"]


def test_sync_runtime_takes_the_same_arguments(tmp_path, small):
    for expected in ((0, 1), (1, 0)):
        with nnrt.SyncRuntime(devices=[ReferenceDevice()], discover=False, litert=False) as rt:
            rt.compile(small, cache_dir=tmp_path, token=TOKEN)
            stats = rt.cache_statistics()
            assert (stats.hits, stats.misses) == expected


def test_a_missing_file_is_a_miss_and_the_entry_is_mended(tmp_path, small):
    _run(ReferenceDevice(), small, tmp_path)
    (_entry(tmp_path) / "step0-model0").unlink()
    _, stats = _run(ReferenceDevice(), small, tmp_path)
    assert (stats.hits, stats.misses, stats.rejects, stats.written) == (0, 1, {}, 1)
    _, stats = _run(ReferenceDevice(), small, tmp_path)
    assert (stats.hits, stats.misses) == (1, 0)


@pytest.mark.slow
def test_a_huge_file_is_refused_without_reading_it_into_memory(tmp_path):
    fd = _file(tmp_path)
    try:
        data = os.pread(fd, 1 << 20, 0)
        # A valid-looking header announcing 1 GiB, in a sparse file.
        os.ftruncate(fd, 0)
        head_end = len(data) - 32 - len(b"payload " * 100)
        head = bytearray(data[:head_end])
        head[-8:] = HUGE.to_bytes(8, "little")
        os.pwrite(fd, bytes(head), 0)
        os.ftruncate(fd, head_end + HUGE + 32)
        reasons = []
        growth = _peak_growth_kib(lambda: reasons.append(_reason(fd)))
        assert reasons == [CacheReject.CORRUPT]
        assert growth < 64 * 1024   # KiB: far less than the size announced
    finally:
        os.close(fd)


def test_litert_segments_cached_damaged_and_swapped_on_real_models(tmp_path, small):
    """Several segments, so several flatbuffers in the data file: a hit
    gives the uncached outputs, a flipped byte in the data file alone is
    corrupt and a data file of another model is foreign, each compiled
    afresh with the uncached outputs."""
    other = nnrt.tflite.load(OTHER)
    plain, _ = _run(LiteRTDevice(segments=3), small, None)
    _run(LiteRTDevice(segments=3), small, tmp_path / "a")
    warm, stats = _run(LiteRTDevice(segments=3), small, tmp_path / "a")
    assert (stats.hits, stats.rejects) == (1, {})
    assert all(np.array_equal(x, y) for x, y in zip(plain, warm))
    data = _entry(tmp_path / "a") / "step0-data0"
    good = data.read_bytes()
    _damage(data, "flip")
    outputs, stats = _run(LiteRTDevice(segments=3), small, tmp_path / "a")
    assert stats.rejects == {"corrupt": 1} and stats.hits == 0 and stats.written == 1
    assert all(np.array_equal(x, y) for x, y in zip(plain, outputs))
    _run(LiteRTDevice(segments=3), other, tmp_path / "b")
    shutil.copyfile(_entry(tmp_path / "b") / "step0-data0", data)
    assert data.read_bytes() != good
    outputs, stats = _run(LiteRTDevice(segments=3), small, tmp_path / "a")
    assert stats.rejects == {"foreign": 1} and stats.hits == 0
    assert all(np.array_equal(x, y) for x, y in zip(plain, outputs))


@pytest.mark.parametrize("name", ["compilation", "step0-model0"])
def test_a_fifo_planted_as_an_entry_file_is_rejected_not_waited_on(tmp_path, small, name):
    """Another user can plant a FIFO in a shared cache folder: opening it to
    read would wait for a writer forever (and no deadline can interrupt a
    blocked open). It is opened without blocking and refused as not a
    regular file (or, among the step's files, as one missing); the model
    compiles afresh and the entry is written again."""
    plain, _ = _run(ReferenceDevice(), small, None)
    _run(ReferenceDevice(), small, tmp_path)
    path = _entry(tmp_path) / name
    path.unlink()
    os.mkfifo(path)
    done = []
    compile_ = threading.Thread(target=lambda: done.append(_run(ReferenceDevice(), small,
                                                                tmp_path)), daemon=True)
    compile_.start()
    compile_.join(60)                  # a guard against the wedge, not a timing
    if compile_.is_alive():
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))   # let the blocked open go
        pytest.fail(f"compiling with a FIFO as {name} waited for a writer")
    outputs, stats = done[0]
    assert stats.hits == 0 and stats.written == 1, stats     # compiled afresh, entry mended
    assert all(np.array_equal(a, b) for a, b in zip(plain, outputs))


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o1777])
def test_a_cache_folder_others_may_write_is_refused_before_anything_is_read(tmp_path, small,
                                                                             mode):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    with pytest.raises(NnrtError) as e:
        _run(ReferenceDevice(), small, shared)
    assert e.value.status == ErrorStatus.INVALID_ARGUMENT
    assert "may be written by other users" in e.value.message and "chmod 700" in e.value.message
    assert list(shared.iterdir()) == []            # nothing staged, nothing written
    shared.chmod(0o700)
    _, stats = _run(ReferenceDevice(), small, shared)
    assert stats.written == 1
    # Not a folder, or not there yet (made 0700).
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(NnrtError, match="is not a folder"):
        _run(ReferenceDevice(), small, tmp_path / "file")
    _, stats = _run(ReferenceDevice(), small, tmp_path / "new" / "cache")
    assert stats.written == 1 and ((tmp_path / "new" / "cache").stat().st_mode & 0o777) == 0o700
