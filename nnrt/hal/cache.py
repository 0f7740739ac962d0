"""Compilation caching at the seam: the files a driver is handed, the ways
a cache file is refused, and the one envelope every nnrt driver wraps its
cache files in (NNAPI ``setCaching`` / ``getNumberOfCacheFilesNeeded`` /
``prepareModelFromCache``).

Who does what. The runtime names, creates (0600) and opens the files, and
hands their fds to the driver as :class:`CacheFiles`; a driver service gets
them as SCM_RIGHTS and never opens a path. ``prepare_model(..., cache=)``
writes the driver's artifacts into those fds before it returns;
``prepare_model_from_cache(cache)`` reads them back, or raises
:class:`CacheRejected` naming why it refused them. The runtime makes the
files visible only after the driver returned (a crash mid-write leaves a
staging folder nobody reads, see nnrt/runtime/cache.py).

The envelope (:func:`write_file` / :func:`read_file`, :func:`read_parts`)::

    magic "NNRTCACH" | u16 format | u16 kind length | kind | u16 version length
    | version | token (32 bytes) | u64 payload length | payload | MAC (32 bytes)

``version`` is the driver's ``version_string`` (it names nnrt's version),
``token`` the one the runtime gave for this step, ``kind`` says which of
the driver's files this is. The MAC is an HMAC-SHA256 over everything
before it, with a key only this user's processes can read (see
:func:`_key`): a cache file is input a driver service did not produce
itself as far as the wire knows, so it accepts only files it (or another
process of its user) wrote — an app cannot feed a service a crafted
flatbuffer through its cache. Checks, in order: long enough (TRUNCATED),
magic (FOREIGN), declared length (TRUNCATED), MAC (CORRUPT), format and
version (STALE), kind and token (FOREIGN).
"""
from __future__ import annotations

import enum
import hashlib
import hmac
import os
import stat
import struct
from dataclasses import dataclass

from ..errors import ErrorStatus, NnrtError
from ..model.types import HalVersion
from .validate import ValidatedModel

TOKEN_SIZE = 32              # NNAPI's BYTE_SIZE_OF_CACHE_TOKEN
MAX_CACHE_FILES = 32         # per kind (model, data): NNAPI's kMaxNumberOfCacheFiles
MAX_FILE_SIZE = 1 << 31      # bytes a driver reads from one cache file
MAGIC = b"NNRTCACH"
FORMAT = 1
_HEAD = struct.Struct("<8sH")
_U16 = struct.Struct("<H")
_U64 = struct.Struct("<Q")
_MAC_SIZE = 32


class CacheReject(enum.Enum):
    """Why cache files were refused (the runtime counts each)."""

    TRUNCATED = "truncated"      # shorter than its header says
    CORRUPT = "corrupt"          # the checksum does not match
    FOREIGN = "foreign"          # not a cache file, another model's, another kind
    STALE = "stale"              # another format, driver or nnrt version
    UNUSABLE = "unusable"        # the driver could not use files that passed the checks


class CacheRejected(NnrtError):
    """Cache files a driver will not prepare from; the runtime compiles afresh."""

    def __init__(self, reason: CacheReject, message: str):
        super().__init__(ErrorStatus.GENERAL_FAILURE, f"cache {reason.value}: {message}")
        self.reason = reason


@dataclass(frozen=True, slots=True)
class CacheFiles:
    """The fds of one step's cache files and its token. The caller owns the
    fds (and closes them); a driver reads and writes them only during the
    call that received them."""

    model: tuple[int, ...]
    data: tuple[int, ...]
    token: bytes

    def __post_init__(self):
        if not isinstance(self.token, bytes) or len(self.token) != TOKEN_SIZE:
            raise NnrtError(ErrorStatus.INVALID_ARGUMENT,
                            f"a cache token is {TOKEN_SIZE} bytes")
        if len(self.model) > MAX_CACHE_FILES or len(self.data) > MAX_CACHE_FILES:
            raise NnrtError(ErrorStatus.INVALID_ARGUMENT,
                            f"at most {MAX_CACHE_FILES} cache files of each kind")


def check_counts(files: CacheFiles, needed: tuple[int, int]) -> None:
    """INVALID_ARGUMENT unless ``files`` has as many fds as the driver needs."""
    if (len(files.model), len(files.data)) != tuple(needed):
        raise NnrtError(ErrorStatus.INVALID_ARGUMENT,
                        f"the driver needs {needed[0]} model and {needed[1]} data cache files, "
                        f"got {len(files.model)} and {len(files.data)}")


def _key() -> bytes:
    """This user's cache key: 32 random bytes in a 0600 file of the user's
    state folder, made once; a per-process key when it cannot be kept (the
    cache then only helps within this process)."""
    global _KEY
    if _KEY is not None:
        return _KEY
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"),
                                                            ".local", "state")
    path = os.path.join(base, "nnrt", "cache-key")
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        if not os.path.exists(path):
            # Written whole under a private name, then linked: a process
            # racing this one sees no key or the whole key, never part of one.
            temp = f"{path}.{os.getpid()}.{os.urandom(4).hex()}"
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            try:
                os.write(fd, os.urandom(32))
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(temp, path)
            except FileExistsError:
                pass
            finally:
                os.unlink(temp)
        with open(path, "rb") as f:
            info = os.fstat(f.fileno())
            key = f.read(64)
        if len(key) != 32 or info.st_uid != os.getuid() or info.st_mode & 0o077:
            raise OSError(f"{path} is not a private 32-byte key")
    except OSError:
        key = os.urandom(32)
    _KEY = key
    return key


_KEY: bytes | None = None


def _mac(parts) -> bytes:
    # HMAC-SHA256: with the CPU's SHA extensions 2-3x faster than BLAKE2b here.
    h = hmac.new(_key(), digestmod=hashlib.sha256)
    for part in parts:
        h.update(part)
    return h.digest()


def keyed_mac(purpose: bytes, parts) -> bytes:
    """An HMAC-SHA256 of ``parts`` with this user's cache key, for seals of
    other cache data than the envelope (a remote service's, see
    nnrt/service/remote/cache.py). ``purpose`` names the use, so a seal made
    for one can never pass as another's or as an envelope's MAC."""
    return _mac((len(purpose).to_bytes(2, "little"), purpose, *parts))


def _check_regular(fd: int) -> os.stat_result:
    try:
        info = os.fstat(fd)
    except OSError as e:
        raise NnrtError(ErrorStatus.INVALID_ARGUMENT, f"cache fd {fd}: {e}") from None
    if not stat.S_ISREG(info.st_mode):
        # A pipe or socket could block the driver forever.
        raise NnrtError(ErrorStatus.INVALID_ARGUMENT, f"cache fd {fd} is not a regular file")
    return info


def write_file(fd: int, *, kind: str, version: str, token: bytes, payload) -> None:
    """Replace the content of cache file ``fd`` with ``payload`` in the
    envelope. ``payload`` is bytes-like, or a list of bytes-likes: then the
    payload is a table of their sizes followed by the parts, so the MAC
    covers how they are split too (:func:`read_parts` reads them back as
    they were given). Raises OSError when the file cannot be written; the
    file is then left empty, which the runtime takes as "nothing cached"."""
    _check_regular(fd)
    if isinstance(payload, list):
        parts = [memoryview(p).cast("B") for p in payload]
        parts.insert(0, memoryview(_parts_table([len(p) for p in parts])))
    else:
        parts = [memoryview(payload).cast("B")]
    kind_b, version_b = kind.encode(), version.encode()
    head = b"".join((_HEAD.pack(MAGIC, FORMAT), _U16.pack(len(kind_b)), kind_b,
                     _U16.pack(len(version_b)), version_b, token,
                     _U64.pack(sum(len(p) for p in parts))))
    mac = _mac((head, *parts))
    try:
        os.ftruncate(fd, 0)
        offset = 0
        for part in (head, *parts, mac):
            view = memoryview(part).cast("B")
            while view:
                n = os.pwrite(fd, view, offset)
                offset += n
                view = view[n:]
    except OSError:
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass
        raise


def _parts_table(sizes: list[int]) -> bytes:
    """How a payload written as parts begins: their count and sizes."""
    return _U64.pack(len(sizes)) + b"".join(_U64.pack(n) for n in sizes)


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    """Fill ``view`` from ``offset``; the bytes read (fewer at the end of the file)."""
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            break
        got += n
    return got


def _stream_mac(fd: int, end: int) -> bytes:
    """The MAC of bytes [0, end) of ``fd``, read in chunks into one small buffer."""
    h = hmac.new(_key(), digestmod=hashlib.sha256)
    chunk = memoryview(bytearray(1 << 20))
    offset = 0
    while offset < end:
        n = _pread_into(fd, chunk[:min(len(chunk), end - offset)], offset)
        if n == 0:
            break
        h.update(chunk[:n])
        offset += n
    return h.digest()


@dataclass(frozen=True, slots=True)
class _Head:
    """A cache file's header as read (not yet authenticated)."""

    raw: memoryview          # the header's bytes, [0, pos)
    format: int
    kind: bytes
    version: bytes
    token: bytes
    pos: int                 # where the payload starts
    end: int                 # where it ends (the MAC follows)


def _read_head(fd: int) -> _Head:
    """The header of cache file ``fd``, checked against the file's size:
    TRUNCATED, FOREIGN (no magic, too big) or CORRUPT (bytes after the MAC)."""
    size = _check_regular(fd).st_size
    if size > MAX_FILE_SIZE:
        raise CacheRejected(CacheReject.FOREIGN, f"a {size}-byte file is too big to be ours")
    head = memoryview(bytearray(min(size, _HEAD.size + 4 + (1 << 17) + TOKEN_SIZE + 8)))
    got = _pread_into(fd, head, 0)
    head = head[:got]
    pos = _HEAD.size
    if got < pos:
        raise CacheRejected(CacheReject.TRUNCATED, f"{got} bytes hold no header")
    magic, fmt = _HEAD.unpack_from(head)
    if magic != MAGIC:
        raise CacheRejected(CacheReject.FOREIGN, "not an nnrt cache file")
    fields = []
    for what in ("kind", "version"):
        if got < pos + 2:
            raise CacheRejected(CacheReject.TRUNCATED, f"the header ends before its {what}")
        n = _U16.unpack_from(head, pos)[0]
        pos += 2
        fields.append(bytes(head[pos:pos + n]))
        pos += n
    file_token = bytes(head[pos:pos + TOKEN_SIZE])
    pos += TOKEN_SIZE
    if got < pos + _U64.size:
        raise CacheRejected(CacheReject.TRUNCATED, "the header ends before the payload length")
    length = _U64.unpack_from(head, pos)[0]
    pos += _U64.size
    end = pos + length
    if size < end + _MAC_SIZE:
        raise CacheRejected(CacheReject.TRUNCATED,
                            f"{size} bytes, the header announces {end + _MAC_SIZE}")
    if size != end + _MAC_SIZE:
        raise CacheRejected(CacheReject.CORRUPT, f"{size - end - _MAC_SIZE} bytes "
                                                 f"after the checksum")
    return _Head(head[:pos], fmt, fields[0], fields[1], file_token, pos, end)


def _check_fields(head: _Head, kind: str, version: str, token: bytes) -> None:
    """STALE or FOREIGN unless an authenticated header names this file."""
    if head.format != FORMAT or head.version != version.encode():
        raise CacheRejected(CacheReject.STALE,
                            f"written by {head.version.decode(errors='replace')!r} "
                            f"(format {head.format}), this is {version!r} (format {FORMAT})")
    if head.kind != kind.encode():
        raise CacheRejected(CacheReject.FOREIGN, f"a {head.kind.decode(errors='replace')!r} "
                                                 f"file where {kind!r} was expected")
    if head.token != token:
        raise CacheRejected(CacheReject.FOREIGN, "the file belongs to another model")


def _file_mac(fd: int, end: int) -> bytes:
    mac = bytearray(_MAC_SIZE)
    if _pread_into(fd, memoryview(mac), end) != _MAC_SIZE:
        raise CacheRejected(CacheReject.TRUNCATED, "the file changed while it was read")
    return bytes(mac)


def _check_streamed(fd: int, head: _Head, kind: str, version: str, token: bytes) -> bytes:
    """Authenticate the whole file without holding it in memory; its MAC."""
    mac = _file_mac(fd, head.end)
    if not hmac.compare_digest(_stream_mac(fd, head.end), mac):
        raise CacheRejected(CacheReject.CORRUPT, "the checksum does not match")
    _check_fields(head, kind, version, token)
    return mac


def read_file(fd: int, *, kind: str, version: str, token: bytes) -> memoryview:
    """The payload of cache file ``fd``, or :class:`CacheRejected` saying why
    not (the checks of the module's docstring, in its order). Memory is allocated only for a file whose checksum
    holds: the file is first checked in 1 MiB chunks, so a hostile app's
    huge file costs a service time, not memory. The payload is then read
    and checked again, since the file is the app's and may change in
    between. (:func:`read_parts` reads a file of known size in one pass.)"""
    head = _read_head(fd)
    mac = _check_streamed(fd, head, kind, version, token)
    data = memoryview(bytearray(head.end))
    if (_pread_into(fd, data, 0) != head.end or data[:head.pos] != head.raw
            or not hmac.compare_digest(_mac((data,)), mac)):
        raise CacheRejected(CacheReject.CORRUPT, "the file changed while it was read")
    return data[head.pos:head.end]


def read_parts(fd: int, *, kind: str, version: str, token: bytes,
               sizes: list[int]) -> list[bytes]:
    """The payload of cache file ``fd`` as the parts :func:`write_file` was
    given, each its own ``bytes`` (what LiteRT takes without a copy), or
    :class:`CacheRejected` with the reasons of :func:`read_file`.

    ``sizes`` must come from a file already authenticated (the driver's
    record of what it wrote), which bounds the memory a hostile file can
    make a service allocate: so, unlike :func:`read_file`, the file is read
    once, each part straight into its ``bytes`` and into the MAC, and the
    MAC checks exactly the bytes returned. A file whose table of sizes is
    not ``sizes`` is not read into memory: it is authenticated in chunks to
    say why it is refused (FOREIGN if it is a good file of another
    compilation)."""
    head = _read_head(fd)
    table = _parts_table(sizes)
    if (head.end - head.pos != len(table) + sum(sizes)
            or os.pread(fd, len(table), head.pos) != table):
        _check_streamed(fd, head, kind, version, token)
        raise CacheRejected(CacheReject.FOREIGN, "the file's parts are not those its record "
                                                 "describes")
    h = hmac.new(_key(), head.raw, digestmod=hashlib.sha256)
    h.update(table)
    parts, offset = [], head.pos + len(table)
    for size in sizes:
        # os.pread returns a fresh bytes: one copy, from the page cache.
        part = os.pread(fd, size, offset)
        if len(part) != size:
            raise CacheRejected(CacheReject.TRUNCATED, "the file changed while it was read")
        h.update(part)
        parts.append(part)
        offset += size
    if not hmac.compare_digest(h.digest(), _file_mac(fd, head.end)):
        raise CacheRejected(CacheReject.CORRUPT, "the checksum does not match")
    _check_fields(head, kind, version, token)
    return parts


def dims_meta(validated: ValidatedModel) -> dict:
    """A ValidatedModel as JSON-able facts."""
    return {"version": validated.version.name,
            "dims": [[index, [[i, list(d)] for i, d in dims.items()]]
                     for index, dims in validated.dims.items()]}


def validated_of(meta: dict) -> ValidatedModel:
    try:
        return ValidatedModel(HalVersion[meta["version"]],
                              {index: {i: tuple(d) for i, d in dims}
                               for index, dims in meta["dims"]})
    except (KeyError, TypeError, ValueError) as e:
        raise CacheRejected(CacheReject.UNUSABLE, f"the record's dimensions: {e!r}") from None
