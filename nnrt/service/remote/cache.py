"""Compilation caching over the remote HAL: the app keeps the files, the
server seals them.

NNAPI's contract has the app own its cache: the runtime names and keeps
the files, a driver fills them and reads them back, and their content is
the driver's, opaque to the app. Across hosts the files stay with the app
(``cache_dir`` on the client host, as for a local driver) and their bytes
travel in the calls: ``PrepareModelCaching`` returns the driver's files,
``PrepareModelFromCache`` sends them back. The server keeps nothing between
calls -- no cache folder to bound, clean or share between apps -- and a
restarted or replaced server serves the same files as long as it runs
under a user with the same cache key (``nnrt.hal.cache``).

Why a seal. The bytes come back from a host the server does not trust: an
app could send another app's files (copied off its host), or bytes the
server never made, hoping the driver parses them. So each file the server
returns is the driver's file followed by a seal::

    driver's bytes | tag (32) | MAC (32)

``tag`` is SHA-256 of the caller's identity (its certificate's or token's
name) and the app's token; ``MAC`` is :func:`nnrt.hal.cache.keyed_mac` over
the tag, which file this is (model or data, its index) and the bytes. A
file is handed to the driver only when its seal holds: shorter than a seal
is TRUNCATED, a tag of another identity or token FOREIGN, a MAC that does
not match CORRUPT (the runtime counts each and compiles afresh). The
driver's own envelope checks then run as for a local app (STALE for
another driver version).

The driver reads and writes fds, never paths: the server gives it memfds
(:class:`Scratch`), in memory, gone when the call ends.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import stat

from ...errors import invalid
from ...hal.cache import (TOKEN_SIZE, CacheFiles, CacheReject, CacheRejected, check_counts,
                          keyed_mac)
from . import nnrt_remote_v1_pb2 as pb
from .wire import MAX_MESSAGE

_PURPOSE = b"nnrt remote cache 1"
_TAG = 32
SEAL_SIZE = _TAG + 32
# The cache bytes of one call, either way: what a reply can carry beside
# nothing else (a message's bound is wire.MAX_MESSAGE).
MAX_CACHE_BYTES = MAX_MESSAGE - (1 << 16)


def _tag(app: str, token: bytes) -> bytes:
    name = app.encode()
    return hashlib.sha256(len(name).to_bytes(4, "little") + name + token).digest()


def _mac(tag: bytes, role: str, index: int, data) -> bytes:
    return keyed_mac(_PURPOSE, (tag, role.encode(), index.to_bytes(4, "little"),
                                len(data).to_bytes(8, "little"), data))


def seal(app: str, token: bytes, role: str, index: int, data: bytes) -> bytes:
    """``data`` (a driver's cache file) sealed for ``app`` and ``token``."""
    tag = _tag(app, token)
    return b"".join((data, tag, _mac(tag, role, index, data)))


def unseal(app: str, token: bytes, role: str, index: int, sealed: bytes) -> memoryview:
    """The driver's bytes of ``sealed``, or CacheRejected: TRUNCATED,
    FOREIGN (another app's or another token's) or CORRUPT."""
    view = memoryview(sealed)
    if len(view) < SEAL_SIZE:
        raise CacheRejected(CacheReject.TRUNCATED,
                            f"{role} file {index}: {len(view)} bytes hold no seal")
    data, tag, mac = view[:-SEAL_SIZE], view[-SEAL_SIZE:-32], view[-32:]
    if not hmac.compare_digest(tag, _tag(app, token)):
        raise CacheRejected(CacheReject.FOREIGN, f"{role} file {index} was made for another "
                                                 f"app or another model")
    if not hmac.compare_digest(mac, _mac(bytes(tag), role, index, data)):
        raise CacheRejected(CacheReject.CORRUPT, f"{role} file {index}: the seal does not "
                                                 f"match")
    return data


def check_token(token: bytes) -> bytes:
    if len(token) != TOKEN_SIZE:
        raise invalid(f"a cache token is {TOKEN_SIZE} bytes, got {len(token)}")
    return bytes(token)


def _write_all(fd: int, data) -> None:
    os.ftruncate(fd, 0)
    view, offset = memoryview(data).cast("B"), 0
    while offset < len(view):
        offset += os.pwrite(fd, view[offset:], offset)


def _read_all(fd: int, limit: int) -> bytes | None:
    """The bytes of regular file ``fd``; None when it holds more than ``limit``."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise invalid(f"cache fd {fd} is not a regular file")
    if info.st_size > limit:
        return None
    parts, offset = [], 0
    while offset <= limit:   # a file that grows past the limit meanwhile: None
        part = os.pread(fd, min(1 << 20, limit + 1 - offset), offset)
        if not part:
            return b"".join(parts)
        parts.append(part)
        offset += len(part)
    return None


# -- the server's side -------------------------------------------------------------

class Scratch:
    """Memfds for one call's driver cache files, empty until :meth:`fill`;
    closed on exit. (The server fills and reads them on a worker thread:
    MACs over megabytes would stall its event loop.)"""

    def __init__(self, needed: tuple[int, int], token: bytes):
        self.needed = tuple(needed)
        self.fds: list[int] = []
        try:
            for _ in range(sum(self.needed)):
                self.fds.append(os.memfd_create("nnrt-remote-cache", os.MFD_CLOEXEC))
        except BaseException:
            self.close()
            raise
        self.files = CacheFiles(tuple(self.fds[:self.needed[0]]),
                                tuple(self.fds[self.needed[0]:]), token)

    def fill(self, payloads) -> None:
        """Write ``payloads`` (one bytes-like per file, model files first)."""
        for fd, payload in zip(self.fds, payloads, strict=True):
            _write_all(fd, payload)

    def sealed(self, app: str) -> pb.CacheFiles | None:
        """What the driver wrote, sealed for ``app``; None when it wrote
        nothing into a file (it could not cache) or more than a reply carries."""
        files, total = [], 0
        for role, fds in (("model", self.files.model), ("data", self.files.data)):
            for index, fd in enumerate(fds):
                data = _read_all(fd, MAX_CACHE_BYTES - total)
                if not data:
                    return None
                total += len(data) + SEAL_SIZE
                files.append((role, seal(app, self.files.token, role, index, data)))
        return pb.CacheFiles(token=self.files.token,
                             model=[f for role, f in files if role == "model"],
                             data=[f for role, f in files if role == "data"])

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []

    def __enter__(self) -> "Scratch":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def unsealed(app: str, cache: pb.CacheFiles, needed: tuple[int, int]) -> list[memoryview]:
    """The driver's bytes of each file of ``cache`` (model files first):
    INVALID_ARGUMENT for a message of the wrong shape, CacheRejected for a
    file whose seal does not hold."""
    token = check_token(cache.token)
    if (len(cache.model), len(cache.data)) != tuple(needed):
        raise invalid(f"the device needs {needed[0]} model and {needed[1]} data cache files, "
                      f"got {len(cache.model)} and {len(cache.data)}")
    return [unseal(app, token, role, index, data)
            for role, files in (("model", cache.model), ("data", cache.data))
            for index, data in enumerate(files)]


# -- the client's side -------------------------------------------------------------

def write_app_files(files: CacheFiles, cache: pb.CacheFiles | None) -> None:
    """Write what the server returned into the app's cache fds; without it
    (or not as many files as the fds) they are left empty, which the runtime
    takes as an entry it could not write."""
    fds = (*files.model, *files.data)
    sent = (*cache.model, *cache.data) if cache is not None else ()
    if cache is None or (len(cache.model), len(cache.data)) != (len(files.model),
                                                                len(files.data)):
        sent = (b"",) * len(fds)
    for fd, data in zip(fds, sent):
        _write_all(fd, data)


def read_app_files(files: CacheFiles, needed: tuple[int, int]) -> pb.CacheFiles:
    """The app's cache files as the request carries them; CacheRejected
    (FOREIGN) when they hold more than a call carries."""
    check_counts(files, needed)
    read, total = [], 0
    for fd in (*files.model, *files.data):
        data = _read_all(fd, MAX_CACHE_BYTES - total)
        if data is None:
            raise CacheRejected(CacheReject.FOREIGN, f"the cache files hold more than "
                                                     f"{MAX_CACHE_BYTES} bytes")
        total += len(data)
        read.append(data)
    return pb.CacheFiles(token=files.token, model=read[:needed[0]], data=read[needed[0]:])
