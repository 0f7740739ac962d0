"""The remote service's seal on cache files (nnrt/service/remote/cache.py):
the bytes come back only for the app and token they were sealed for; any
cut, flipped byte or other owner is refused with its reason, never with
another error; the server's memfds and the app's files carry the bytes."""
import os

import pytest

from nnrt.errors import ErrorStatus, NnrtError
from nnrt.hal.cache import CacheFiles, CacheReject, CacheRejected
from nnrt.service.remote import cache as rc
from nnrt.service.remote import nnrt_remote_v1_pb2 as pb

TOKEN = bytes(range(32))
DATA = b"the driver's cache file" * 3


def test_a_sealed_file_opens_only_for_its_app_token_and_place():
    sealed = rc.seal("camera", TOKEN, "model", 0, DATA)
    assert bytes(rc.unseal("camera", TOKEN, "model", 0, sealed)) == DATA
    for who, token, role, index, reason in (
            ("batch", TOKEN, "model", 0, CacheReject.FOREIGN),
            ("camera", bytes(32), "model", 0, CacheReject.FOREIGN),
            ("camera", TOKEN, "data", 0, CacheReject.CORRUPT),
            ("camera", TOKEN, "model", 1, CacheReject.CORRUPT)):
        with pytest.raises(CacheRejected) as e:
            rc.unseal(who, token, role, index, sealed)
        assert e.value.reason is reason, (who, role, index)


def test_every_cut_and_every_flipped_byte_is_refused_with_a_reason():
    sealed = rc.seal("camera", TOKEN, "data", 2, DATA)
    for cut in range(len(sealed)):
        with pytest.raises(CacheRejected):
            rc.unseal("camera", TOKEN, "data", 2, sealed[:cut])
    for at in range(len(sealed)):
        bad = bytearray(sealed)
        bad[at] ^= 1
        with pytest.raises(CacheRejected) as e:
            rc.unseal("camera", TOKEN, "data", 2, bytes(bad))
        assert e.value.reason in (CacheReject.FOREIGN, CacheReject.CORRUPT)
    with pytest.raises(CacheRejected) as e:
        rc.unseal("camera", TOKEN, "data", 2, sealed + b"x")
    assert e.value.reason is CacheReject.FOREIGN   # the tag is no longer where it was


def test_messages_of_the_wrong_shape_are_invalid_arguments():
    good = rc.seal("camera", TOKEN, "model", 0, DATA)
    for cache in (pb.CacheFiles(token=b"short", model=[good]),
                  pb.CacheFiles(token=TOKEN, model=[good, good]),
                  pb.CacheFiles(token=TOKEN)):
        with pytest.raises(NnrtError) as e:
            rc.unsealed("camera", cache, (1, 0))
        assert e.value.status is ErrorStatus.INVALID_ARGUMENT


def test_the_bytes_go_from_the_drivers_memfds_to_the_apps_files_and_back(tmp_path):
    with rc.Scratch((1, 1), TOKEN) as scratch:
        assert scratch.sealed("camera") is None      # the driver wrote nothing
        os.pwrite(scratch.files.model[0], b"plan", 0)
        os.pwrite(scratch.files.data[0], DATA, 0)
        reply = scratch.sealed("camera")
    fds = [os.open(tmp_path / name, os.O_RDWR | os.O_CREAT, 0o600) for name in ("m", "d")]
    try:
        files = CacheFiles((fds[0],), (fds[1],), TOKEN)
        rc.write_app_files(files, reply)
        sent = rc.read_app_files(files, (1, 1))
        payloads = rc.unsealed("camera", sent, (1, 1))
        assert [bytes(p) for p in payloads] == [b"plan", DATA]
        with rc.Scratch((1, 1), TOKEN) as scratch:
            scratch.fill(payloads)
            assert os.pread(scratch.files.data[0], 1000, 0) == DATA
        rc.write_app_files(files, None)              # nothing to cache: left empty
        assert os.fstat(fds[0]).st_size == os.fstat(fds[1]).st_size == 0
    finally:
        for fd in fds:
            os.close(fd)
