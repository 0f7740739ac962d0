"""What nnrt's drivers keep in their compilation cache files, and how.

Both the reference and the LiteRT driver keep the HAL model (the prepared
model validates requests and maps their arguments with it: NNAPI's
``prepareModelFromCache`` gets no model) and what their preparation
computed, as *records*: a small JSON header of facts (inferred dimensions,
the segment table) followed by binary blobs (the encoded model, flatbuffers),
inside the envelope of :mod:`nnrt.hal.cache` (checksum, driver version,
token). JSON and the protocol's model codec parse any bytes safely; the
envelope's keyed checksum already guarantees that only a file this user's
driver wrote gets here.
"""
from __future__ import annotations

import json
import os
import struct

from ..errors import NnrtError
from ..hal.cache import (CacheFiles, CacheReject, CacheRejected, dims_meta, read_file,
                         read_parts, validated_of, write_file)
from ..model.graph import HalModel
from ..vlog import vlog
from ..service.protocol import decode_model, encode_model

_U64 = struct.Struct("<Q")


def pack(meta: dict, blobs) -> bytes:
    """``meta`` (JSON-able) and ``blobs`` (bytes-like) as one payload."""
    head = json.dumps(meta, separators=(",", ":")).encode()
    parts = [_U64.pack(len(head)), head, _U64.pack(len(blobs))]
    for blob in blobs:
        parts += [_U64.pack(len(blob)), blob]
    return b"".join(parts)


def unpack(view) -> tuple[dict, list[memoryview]]:
    """What :func:`pack` packed; CacheRejected(UNUSABLE) for anything else."""
    view = memoryview(view)
    try:
        pos = 0

        def take(n: int) -> memoryview:
            nonlocal pos
            if pos + n > len(view):
                raise ValueError("the record ends early")
            pos += n
            return view[pos - n:pos]
        meta = json.loads(bytes(take(_U64.unpack(take(8))[0])))
        blobs = [take(_U64.unpack(take(8))[0]) for _ in range(_U64.unpack(take(8))[0])]
        if pos != len(view) or not isinstance(meta, dict):
            raise ValueError("the record has trailing bytes")
    except (ValueError, struct.error, UnicodeDecodeError) as e:
        raise CacheRejected(CacheReject.UNUSABLE, f"the record does not parse: {e}") from None
    return meta, blobs


def model_of(blob) -> HalModel:
    try:
        return decode_model(blob)
    except NnrtError as e:
        raise CacheRejected(CacheReject.UNUSABLE, f"the cached model: {e.message}") from None


def model_blob(model: HalModel) -> bytes:
    return encode_model(model)


def save(device, cache: CacheFiles | None, kind_payloads: list[tuple[int, str, object]]) -> None:
    """Write each ``(fd, kind, payload)`` in the envelope (a payload is
    bytes-like, or a list of them for :func:`load_parts`); a failure is
    logged, never raised (a cache that could not be written only costs the
    next compilation its speed)."""
    if cache is None:
        return
    try:
        for fd, kind, payload in kind_payloads:
            write_file(fd, kind=kind, version=device.version_string, token=cache.token,
                       payload=payload)
    except (OSError, NnrtError) as e:
        vlog("driver", "%s: could not write the cache files: %s", device.name, e)
        for fd, _, _ in kind_payloads:
            try:
                os.ftruncate(fd, 0)
            except OSError:
                pass


def load(device, cache: CacheFiles, fd: int, kind: str) -> memoryview:
    return read_file(fd, kind=kind, version=device.version_string, token=cache.token)


def load_parts(device, cache: CacheFiles, fd: int, kind: str, sizes) -> list[bytes]:
    """The parts of a file saved as a list, read in one pass; ``sizes``
    comes from a record :func:`load` already authenticated."""
    try:
        sizes = [int(n) for n in sizes]
        if any(n < 0 for n in sizes):
            raise ValueError("a negative size")
    except (TypeError, ValueError) as e:
        raise CacheRejected(CacheReject.UNUSABLE, f"the record's part sizes: {e}") from None
    return read_parts(fd, kind=kind, version=device.version_string, token=cache.token,
                      sizes=sizes)
