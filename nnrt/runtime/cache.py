"""The compilation cache on the app's side: where cache files live, how
they are named, opened and made visible, and what the runtime counts.

Layout. ``cache_dir/<key>/`` is one *entry*: a compiled model on one set of
devices. ``key`` (64 hex digits) hashes everything that must match for the
files to be reused: the nnrt version, the model's content (a BLAKE2b digest
of its graph and constants), the app's token (when given), the execution
preference, whether fallback was allowed, and each candidate device's name,
``version_string`` and cache file counts. The entry holds ``compilation``
(the runtime's own record: which device runs which operations, what
validation inferred; in the envelope of :mod:`nnrt.hal.cache`) and, per step
``k`` on a caching device, ``step<k>-model<i>`` / ``step<k>-data<i>``, the
driver's files. Folders are 0700 and files 0600, created by the app's
process; a driver service only ever gets fds.

Atomicity. An entry is written into a staging folder ``.tmp-<pid>-<random>``
and renamed into place only once every driver returned and every file is
synced; a crash at any point leaves a staging folder that no lookup reads
(later writers remove those of dead processes). Two writers of one entry
race harmlessly: the second rename finds the entry there and the loser
discards its staging folder. A step whose files a driver rejected is
rewritten into a fresh staging folder (the other steps' files hard-linked)
which replaces the entry.

Every decision is counted (:class:`CacheStatistics`) and logged with the
``compilation`` VLOG tag.
"""
from __future__ import annotations

import hashlib
import json
import operator
import os
import pickle
import shutil
import stat
from dataclasses import dataclass, field, fields
from typing import Sequence

from .._version import __version__
from ..errors import ErrorStatus, NnrtError
from ..hal import Device
from ..hal.cache import (TOKEN_SIZE, CacheFiles, CacheReject, CacheRejected, dims_meta,
                         read_file, validated_of, write_file)
from ..memory import as_buffer
from ..model.graph import (ChannelQuant, DataLocation, ExtensionPrefix, HalModel, Operand,
                           Operation, Subgraph)
from ..vlog import vlog

# How an entry's files are opened to read: never through a link, and without
# blocking, so a FIFO planted in a shared cache folder is refused as not a
# regular file instead of waiting for a writer forever.
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
RECORD = "compilation"
_RECORD_KIND = "nnrt-compilation"
_STAGING = ".tmp-"


def default_cache_dir() -> str:
    """``$XDG_CACHE_HOME/nnrt`` (``~/.cache/nnrt``): where ``nnrt cache``
    looks unless told otherwise."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "nnrt")


@dataclass(frozen=True)
class CacheStatistics:
    """What the compilation cache decided, per compiled step: ``hits``
    (prepared from cache files), ``misses`` (no files yet), ``rejects`` by
    reason (files refused, compiled afresh), ``uncached`` (the device keeps
    no cache); and entries ``written`` or that could not be
    (``write_failures``)."""

    hits: int = 0
    misses: int = 0
    rejects: dict[str, int] = field(default_factory=dict)
    uncached: int = 0
    written: int = 0
    write_failures: int = 0

    @property
    def rejected(self) -> int:
        return sum(self.rejects.values())


class Counters:
    """The runtime's running counts; :meth:`snapshot` is the public view."""

    def __init__(self):
        self.hits = self.misses = self.uncached = self.written = self.write_failures = 0
        self.rejects: dict[str, int] = {}

    def reject(self, reason: CacheReject, what: str, message: str) -> None:
        self.rejects[reason.value] = self.rejects.get(reason.value, 0) + 1
        vlog("compilation", "cache reject (%s): %s: %s; compiling afresh", reason.value, what,
             message)

    def snapshot(self) -> CacheStatistics:
        return CacheStatistics(self.hits, self.misses, dict(self.rejects), self.uncached,
                               self.written, self.write_failures)


def _plain(value):
    """A graph's dataclasses as nested tuples (class name, then each field
    in order), everything else as it is: what pickle then writes at C speed.
    Pickling the frozen slotted dataclasses themselves goes through a Python
    ``__getstate__`` per object (10 ms for pose_detection's graph against
    about 2 ms this way)."""
    getter = _FIELDS.get(type(value))
    if getter is None:
        return value
    name, fields_of = getter
    return (name, *[_plain(v) if type(v) in _FIELDS else v for v in fields_of(value)])


def _getter(cls) -> tuple:
    names = [f.name for f in fields(cls)]
    get = operator.attrgetter(*names)
    return cls.__qualname__, (get if len(names) > 1 else lambda obj: (get(obj),))


_FIELDS = {cls: _getter(cls) for cls in (Operand, Operation, DataLocation, ChannelQuant,
                                          ExtensionPrefix)}


def _subgraph(sub: Subgraph) -> tuple:
    return (tuple(map(_plain, sub.operands)), tuple(map(_plain, sub.operations)),
            sub.input_indexes, sub.output_indexes)


def model_digest(model: HalModel) -> bytes:
    """A digest of everything that makes ``model`` what it is: its graphs
    and the bytes of its constants. The graphs are hashed as the pickle of
    their fields (C speed; repr took 30 ms for MobileNet's scales): equal
    pickles mean equal graphs, and two equal graphs pickled differently
    (shared objects are memoized) only cost a miss, never a wrong hit."""
    h = hashlib.sha256()
    h.update(pickle.dumps((_subgraph(model.main), tuple(map(_subgraph, model.referenced)),
                           model.relax_computation_float32_to_float16,
                           tuple(map(_plain, model.extension_prefixes))), protocol=5))
    h.update(len(model.operand_values).to_bytes(8, "little"))
    h.update(model.operand_values)
    for pool in model.pools:
        buf = as_buffer(pool)
        h.update(len(buf).to_bytes(8, "little"))
        h.update(buf)
    return h.digest()


def check_token(token) -> bytes | None:
    if token is None:
        return None
    if not isinstance(token, (bytes, bytearray)) or len(token) != TOKEN_SIZE:
        raise NnrtError(ErrorStatus.INVALID_ARGUMENT,
                        f"a cache token is {TOKEN_SIZE} bytes, got {token!r:.60}")
    return bytes(token)


def entry_key(model: HalModel, token: bytes | None, devices: Sequence[Device],
              preference, fallback: bool) -> str:
    h = hashlib.blake2b(digest_size=32)
    h.update(repr(("nnrt", __version__, int(preference), bool(fallback),
                   [(d.name, d.version_string, tuple(d.number_of_cache_files_needed()))
                    for d in devices])).encode())
    h.update(b"token" + token if token is not None else b"no token")
    h.update(model_digest(model))
    return h.hexdigest()


def step_token(key: str, step: int) -> bytes:
    """The token a driver gets for step ``step`` of entry ``key``."""
    return hashlib.blake2b(f"{key}/{step}".encode(), digest_size=TOKEN_SIZE).digest()


def _file_names(step: int, needed: tuple[int, int]) -> tuple[list[str], list[str]]:
    return ([f"step{step}-model{i}" for i in range(needed[0])],
            [f"step{step}-data{i}" for i in range(needed[1])])


def check_folder(cache_dir) -> str:
    """``cache_dir`` as a path, when it is a folder only this user may
    write (or not there yet: it is made 0700). INVALID_ARGUMENT for one that
    another user owns or may write (group or others: mode 0775, 0777): they
    could plant, swap or remove entries under the app."""
    path = os.fspath(cache_dir)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return path
    except OSError as e:
        raise NnrtError(ErrorStatus.INVALID_ARGUMENT, f"cache_dir {path}: {e}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise NnrtError(ErrorStatus.INVALID_ARGUMENT, f"cache_dir {path} is not a folder")
    if st.st_uid != os.geteuid():
        raise NnrtError(ErrorStatus.INVALID_ARGUMENT,
                        f"cache_dir {path} belongs to uid {st.st_uid}, not to this user "
                        f"({os.geteuid()}): use a folder of your own")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise NnrtError(ErrorStatus.INVALID_ARGUMENT,
                        f"cache_dir {path} may be written by other users (mode "
                        f"{stat.S_IMODE(st.st_mode):04o}): they could plant or swap its "
                        f"entries; use a folder only you can write (chmod 700 {path})")
    return path


class Entry:
    """One entry of a cache folder, looked up or being written."""

    def __init__(self, cache_dir: str, key: str, counters: Counters):
        self.cache_dir = os.fspath(cache_dir)
        self.key = key
        self.path = os.path.join(self.cache_dir, key)
        self.counters = counters
        self._staging: str | None = None
        self._fds: list[int] = []
        self._linked: set[int] = set()
        self._rewritten: set[int] = set()
        self._needed: dict[int, tuple[int, int]] = {}
        self._failed = False
        self.replace = False   # the entry there was rejected: ours replaces it

    # -- reading -------------------------------------------------------------------

    def read_record(self) -> dict | None:
        """The runtime's record of this entry, None when there is none (a
        miss) or it was rejected (counted)."""
        try:
            fd = os.open(os.path.join(self.path, RECORD), _READ)
        except FileNotFoundError:
            return None
        except OSError as e:
            self.counters.reject(CacheReject.FOREIGN, self.key, f"the record: {e}")
            self.replace = True
            return None
        try:
            payload = read_file(fd, kind=_RECORD_KIND, version=__version__,
                                token=step_token(self.key, -1))
            record = json.loads(bytes(payload))
            if not isinstance(record, dict) or not isinstance(record.get("steps"), list):
                raise CacheRejected(CacheReject.UNUSABLE, "the record holds no steps")
            return record
        except CacheRejected as e:
            self.counters.reject(e.reason, f"{self.key} record", e.message)
        except (ValueError, NnrtError) as e:
            self.counters.reject(CacheReject.UNUSABLE, f"{self.key} record", str(e))
        finally:
            os.close(fd)
        self.replace = True
        return None

    def open_step(self, step: int, needed: tuple[int, int]) -> CacheFiles | None:
        """Read-only fds of step ``step``'s files, None when one is missing."""
        model, data = _file_names(step, needed)
        fds = []
        try:
            for name in (*model, *data):
                fds.append(os.open(os.path.join(self.path, name), _READ))
        except OSError:
            for fd in fds:
                os.close(fd)
            return None
        self._fds += fds
        return CacheFiles(tuple(fds[:needed[0]]), tuple(fds[needed[0]:]),
                          step_token(self.key, step))

    # -- writing -------------------------------------------------------------------

    def _stage(self) -> str:
        if self._staging is None:
            os.makedirs(self.cache_dir, mode=0o700, exist_ok=True)
            _sweep_staging(self.cache_dir)
            path = os.path.join(self.cache_dir,
                                f"{_STAGING}{os.getpid()}-{os.urandom(6).hex()}")
            os.mkdir(path, 0o700)
            self._staging = path
        return self._staging

    def create_step(self, step: int, needed: tuple[int, int]) -> CacheFiles | None:
        """Fresh files (0600) for step ``step`` in the staging folder, for the
        driver to write; None when they cannot be made (counted, logged)."""
        try:
            staging = self._stage()
            model, data = _file_names(step, needed)
            fds = []
            for name in (*model, *data):
                fds.append(os.open(os.path.join(staging, name),
                                   os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
                self._fds.append(fds[-1])
        except OSError as e:
            self._fail(f"cannot create the cache files: {e}")
            return None
        self._rewritten.add(step)
        return CacheFiles(tuple(fds[:needed[0]]), tuple(fds[needed[0]:]),
                          step_token(self.key, step))

    def keep_step(self, step: int, needed: tuple[int, int]) -> None:
        """Step ``step``'s files were good: a rewritten entry links them."""
        self._linked.add(step)
        self._needed[step] = needed

    def _fail(self, why: str) -> None:
        if not self._failed:
            self._failed = True
            self.counters.write_failures += 1
            vlog("compilation", "cache entry %s not written: %s", self.key, why)

    def commit(self, record: dict) -> None:
        """Make the staged files visible as the entry, with ``record``.
        Nothing staged (every step was a hit): nothing to do."""
        if self._staging is None or self._failed:
            self.close()
            return
        staging = self._staging
        try:
            for step in self._linked - self._rewritten:
                for name in sum(_file_names(step, self._needed[step]), []):
                    os.link(os.path.join(self.path, name), os.path.join(staging, name))
            for name in os.listdir(staging):
                fd = os.open(os.path.join(staging, name), os.O_RDONLY)
                try:
                    if os.fstat(fd).st_size == 0:
                        raise OSError(f"the driver wrote nothing into {name}")
                    os.fsync(fd)
                finally:
                    os.close(fd)
            fd = os.open(os.path.join(staging, RECORD),
                         os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            try:
                write_file(fd, kind=_RECORD_KIND, version=__version__,
                           token=step_token(self.key, -1),
                           payload=json.dumps(record, separators=(",", ":")).encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            _fsync_dir(staging)
            self._install(staging)
            self.counters.written += 1
            vlog("compilation", "cache entry %s written", self.key)
        except OSError as e:
            self._fail(str(e))
        finally:
            if os.path.isdir(staging):
                shutil.rmtree(staging, ignore_errors=True)
            self._staging = None
            self.close()

    def _install(self, staging: str) -> None:
        try:
            os.rename(staging, self.path)
        except OSError:
            if not os.path.isdir(self.path):
                raise
            if not self.replace:
                vlog("compilation", "cache entry %s: another writer installed it first",
                     self.key)
                return
            # Swap the rejected entry out; a reader holding its fds keeps them.
            trash = os.path.join(self.cache_dir,
                                 f"{_STAGING}{os.getpid()}-{os.urandom(6).hex()}")
            try:
                os.rename(self.path, trash)
            except FileNotFoundError:
                pass
            try:
                os.rename(staging, self.path)
            except OSError:
                vlog("compilation", "cache entry %s: another writer installed it first",
                     self.key)
            shutil.rmtree(trash, ignore_errors=True)
        _fsync_dir(self.cache_dir)

    def close(self) -> None:
        for fd in self._fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds = []

    def discard(self) -> None:
        """Drop what was staged (the compilation failed)."""
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None
        self.close()


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sweep_staging(cache_dir: str) -> None:
    """Remove the staging folders of writers that died mid-write."""
    try:
        names = os.listdir(cache_dir)
    except OSError:
        return
    for name in names:
        if not name.startswith(_STAGING):
            continue
        try:
            pid = int(name[len(_STAGING):].split("-", 1)[0])
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(cache_dir, name), ignore_errors=True)
        except (ValueError, PermissionError):
            pass


# -- what ``nnrt cache`` shows and clears ------------------------------------------

@dataclass(frozen=True)
class EntryInfo:
    key: str
    bytes: int
    modified: float
    devices: tuple[str, ...]     # the devices of its steps, () when the record is unreadable
    state: str                   # "ok", "stale" (another nnrt), "bad", "staging"


def _is_key(name: str) -> bool:
    return len(name) == 64 and all(c in "0123456789abcdef" for c in name)


def list_entries(cache_dir: str) -> list[EntryInfo]:
    """The entries (and staging folders) of ``cache_dir``, oldest first."""
    found = []
    try:
        names = sorted(os.listdir(cache_dir))
    except FileNotFoundError:
        return []
    for name in names:
        path = os.path.join(cache_dir, name)
        if not (_is_key(name) or name.startswith(_STAGING)) or not os.path.isdir(path) \
                or os.path.islink(path):
            continue
        try:
            size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
            modified = os.path.getmtime(path)
        except OSError:   # removed meanwhile (a writer replacing it, another clear)
            continue
        devices, state = (), "staging"
        if _is_key(name):
            state = "bad"
            try:
                fd = os.open(os.path.join(path, RECORD), _READ)
                try:
                    record = json.loads(bytes(read_file(fd, kind=_RECORD_KIND,
                                                        version=__version__,
                                                        token=step_token(name, -1))))
                finally:
                    os.close(fd)
                devices = tuple(s["device"] for s in record["steps"])
                state = "ok"
            except CacheRejected as e:
                state = "stale" if e.reason is CacheReject.STALE else "bad"
            except (OSError, ValueError, KeyError, TypeError):
                pass
        found.append(EntryInfo(name, size, modified, devices, state))
    return sorted(found, key=lambda e: e.modified)


def clear(cache_dir: str) -> int:
    """Remove every entry and staging folder of ``cache_dir`` (nothing else
    that may live there); returns how many."""
    removed = 0
    for entry in list_entries(cache_dir):
        shutil.rmtree(os.path.join(cache_dir, entry.key), ignore_errors=True)
        removed += 1
    return removed
