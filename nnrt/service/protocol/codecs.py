"""The control protocol's codecs: how each message crosses the wire. One
:class:`Codec` per ``Method`` in :data:`CODECS` (call, reply value, the fds
a call carries, the value an error reply still carries); :func:`encode`
and :func:`decode_body` are the two doors. Pure functions of bytes and
messages, no state."""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass, fields, replace
from typing import Any, Callable

from ...errors import ErrorStatus, NnrtError
from ...hal import (NO_TIMING, Capabilities, DeviceType, ExecutionPreference, ExecutionResult,
                     OutputShape, PerformanceInfo, RequestArgument, Timing)
from ...hal.cache import MAX_CACHE_FILES, TOKEN_SIZE, CacheReject
from ...hal.types import AppDeclaration, BufferRole, Priority
from ...memory import as_buffer
from ...model.graph import (ChannelQuant, DataLocation, ExtensionPrefix, HalModel, Operand,
                             Operation, Subgraph)
from ...model.extensions import (Extension, ExtensionOperandTypeInfo, is_extension_code,
                                  operand_type, operation_type)
from ...model.types import OperandLifeTime, OperandType, OperationType
from ...qos.scheduler import AppStatistics, ClassStatistics, JobRecord, SchedulerStatistics
from ...wirecodec import Reader, Writer
from .messages import (BURST_RING_FDS, MAX_BURST_SLOTS, MAX_COUNT, MAX_FDS, MAX_FRAME,
                       MAX_JOB_RECORDS, MAX_STRING, PROTOCOL_VERSION, Allocate, Allocated, BurstEnded, Cancel,
                       Compute, ConfigureBurst, CopyBuffer, CreateExecution, DeviceInfo, Execute,
                       ExecuteFenced, FencedInfo, FreeBurstSlots, FromCache, GetMemories, Hello,
                       Kind, Method, PrepareModel, PrepareModelCaching, PrepareModelFromCache,
                       ProtocolError, Query, ReleaseBuffer, ReleaseBurst, ReleaseExecution,
                       ReleaseModel, Reply, StatisticsValue, SupportedOperations,
                       WirePool, WireToken, _BODY, _FRAME)

# -- the bytes: reader and writer ----------------------------------------------

_MEMBERS: dict[type, dict] = {}    # per enum class read off the wire: its members by value


def _member(cls, value: int, what: str):
    """``cls(value)`` from a table (an Enum call costs a look-up through its
    metaclass: per field of up to 256 job records in a STATISTICS reply);
    ProtocolError for a value that is none of its members."""
    members = _MEMBERS.get(cls)
    if members is None:
        members = _MEMBERS[cls] = {m.value: m for m in cls}
    member = members.get(value)
    if member is None:
        raise ProtocolError(f"{what}: {value} is not a {cls.__name__}")
    return member


class _Reader(Reader):
    """The shared bounds-checked reader, plus this protocol's compound
    fields (flags, counted lists, strings, enums, fds beside the frame)."""

    __slots__ = ("fds", "fd_pos")

    def __init__(self, data: bytes, fds):
        super().__init__(data, ProtocolError)
        self.fds = list(fds)
        self.fd_pos = 0

    def flag(self, what: str) -> bool:
        v = self.u8(what)
        if v > 1:
            raise ProtocolError(f"{what}: flag byte {v} is neither 0 nor 1")
        return bool(v)

    def count(self, what: str, element_size: int = 1) -> int:
        """A u32 count of elements at least ``element_size`` bytes each."""
        n = self.u32(what)
        if n > MAX_COUNT or n * element_size > self.left:
            raise ProtocolError(f"{what}: count {n} exceeds what the message holds")
        return n

    def bytes_(self, what: str, limit: int = MAX_FRAME) -> bytes:
        n = self.u32(what)
        if n > limit or n > self.left:
            raise ProtocolError(f"{what}: length {n} exceeds what the message holds")
        return self.raw(n, what)

    def str_(self, what: str) -> str:
        try:
            return self.bytes_(what, MAX_STRING).decode("utf-8")
        except UnicodeDecodeError:
            raise ProtocolError(f"{what}: not UTF-8") from None

    def u32s(self, what: str) -> tuple[int, ...]:
        return self.u32_array(self.count(what, 4), what)

    def opt_f64(self, what: str) -> float | None:
        return self.f64(what) if self.flag(what) else None

    def finite(self, what: str) -> float | None:
        v = self.opt_f64(what)
        if v is not None and not math.isfinite(v):
            raise ProtocolError(f"{what} {v} is not a finite number")
        return v

    def nan_or_f64(self, what: str) -> float | None:
        v = self.f64(what)
        return None if math.isnan(v) else v

    def enum(self, cls, what: str):
        return _member(cls, self.u32(what), what)

    def fd(self, what: str) -> int:
        if self.fd_pos >= len(self.fds):
            raise ProtocolError(f"{what}: the message names more fds than came with it")
        self.fd_pos += 1
        return self.fds[self.fd_pos - 1]


class _Writer(Writer):
    __slots__ = ("fds",)

    def __init__(self, head: bytes):
        super().__init__(head)
        self.fds: list[int] = []

    def flag(self, v) -> None:
        self.out += b"\x01" if v else b"\x00"

    def bytes_(self, v) -> None:
        v = bytes(v)
        self.u32(len(v))
        self.raw(v)

    def str_(self, v: str) -> None:
        self.bytes_(v.encode("utf-8"))

    def u32s(self, values) -> None:
        values = tuple(values)
        self.u32(len(values))
        self.u32_array(values)

    def opt_f64(self, v: float | None) -> None:
        self.u8(v is not None)
        if v is not None:
            self.f64(v)

    def nan_or_f64(self, v: float | None) -> None:
        self.f64(math.nan if v is None else v)


# -- codecs of the fields that several messages share -------------------------

def _put_location(w: _Writer, loc: DataLocation | None) -> None:
    w.flag(loc is not None)
    if loc is not None:
        w.i32(loc.pool_index)
        w.u32(loc.offset)
        w.u32(loc.length)


def _get_location(r: _Reader, what: str) -> DataLocation | None:
    if not r.flag(f"{what} location flag"):
        return None
    return DataLocation(r.i32(f"{what} pool index"), r.u32(f"{what} offset"),
                        r.u32(f"{what} length"))


# A pool's kind byte: mapped by id (no fd), its fd comes with the message,
# or a driver buffer's token (memory domains; request pools only).
_POOL_CACHED, _POOL_FD, _POOL_TOKEN = 0, 1, 2


def _put_pools(w: _Writer, pools) -> None:
    w.u32(len(pools))
    for p in pools:
        if isinstance(p, WireToken):
            w.u64(p.token)
            w.u8(_POOL_TOKEN)
            continue
        if not isinstance(p, WirePool):
            raise TypeError(f"pools must be WirePool entries on the wire, got {type(p).__name__}")
        w.u64(p.pool_id)
        w.u8(_POOL_FD if p.fd is not None else _POOL_CACHED)
        w.flag(p.writable)
        for v in (p.fd_offset, p.map_size, p.offset, p.length):
            w.u64(v)
        if p.fd is not None:
            w.fds.append(p.fd)


def _get_pools(r: _Reader, what: str, tokens: bool = False) -> tuple:
    """WirePools (and, with ``tokens``, WireTokens: a request's pools)."""
    n = r.count(f"{what} pool count", 9)
    pools = []
    for k in range(n):
        w = f"{what} pool {k}"
        pool_id = r.u64(f"{w} id")
        kind = r.u8(f"{w} kind")
        if kind == _POOL_TOKEN and tokens:
            if pool_id == 0:
                raise ProtocolError(f"{w}: buffer token 0")
            pools.append(WireToken(pool_id))
            continue
        if kind not in (_POOL_CACHED, _POOL_FD):
            raise ProtocolError(f"{w}: pool kind {kind} is not valid here")
        has_fd = kind == _POOL_FD
        writable = r.flag(f"{w} writable flag")
        fd_offset, map_size, offset, length = (r.u64(f"{w} {x}") for x in
                                               ("fd offset", "map size", "offset", "length"))
        if offset + length > map_size:
            raise ProtocolError(f"{w}: region [{offset}, {offset + length}) lies outside "
                                f"its {map_size}-byte mapping")
        if map_size == 0 and has_fd:
            raise ProtocolError(f"{w}: an fd with an empty mapping")
        fd = r.fd(w) if has_fd else None
        pools.append(WirePool(pool_id, fd, writable, fd_offset, map_size, offset, length))
    return tuple(pools)


def _pool_fds(pools) -> tuple[int, ...]:
    return tuple(wp.fd for wp in pools if isinstance(wp, WirePool) and wp.fd is not None)


def _put_subgraph(w: _Writer, s: Subgraph) -> None:
    w.u32(len(s.operands))
    for o in s.operands:
        w.u32(o.type)
        w.u32s(o.dimensions)
        w.f64(o.scale)
        w.i32(o.zero_point)
        w.u8(o.lifetime)
        _put_location(w, o.location)
        w.flag(o.channel_quant is not None)
        if o.channel_quant is not None:
            w.u32(o.channel_quant.channel_dim)
            w.u32(len(o.channel_quant.scales))
            w.f64_array(o.channel_quant.scales)
        w.flag(o.extra_params is not None)
        if o.extra_params is not None:
            w.bytes_(o.extra_params)
    w.u32(len(s.operations))
    for op in s.operations:
        w.u32(op.type)
        w.u32s(op.inputs)
        w.u32s(op.outputs)
    w.u32s(s.input_indexes)
    w.u32s(s.output_indexes)


def _get_subgraph(r: _Reader, what: str) -> Subgraph:
    n = r.count(f"{what} operand count", 24)
    operands = []
    for k in range(n):
        w = f"{what} operand {k}"
        # Extension types are resolved once the prefix map is read (_get_model).
        t = r.u32(f"{w} type")
        if not is_extension_code(t):
            t = _enum(OperandType, t, f"{w} type")
        dims = r.u32s(f"{w} dimensions")
        scale = r.f64(f"{w} scale")
        zero_point = r.i32(f"{w} zero point")
        lifetime_raw = r.u8(f"{w} lifetime")
        try:
            lifetime = OperandLifeTime(lifetime_raw)
        except ValueError:
            raise ProtocolError(f"{w} lifetime: {lifetime_raw} is not an OperandLifeTime") from None
        loc = _get_location(r, w)
        cq = None
        if r.flag(f"{w} channel quant flag"):
            dim = r.u32(f"{w} channel dim")
            m = r.count(f"{w} channel scale count", 8)
            cq = ChannelQuant(dim, r.f64_array(m, f"{w} channel scales"))
        extra = r.bytes_(f"{w} extra params") if r.flag(f"{w} extra params flag") else None
        operands.append(Operand(t, dims, scale, zero_point, lifetime, loc, cq, extra))
    n = r.count(f"{what} operation count", 12)
    operations = []
    for k in range(n):
        t = r.u32(f"{what} operation {k} type")
        if not is_extension_code(t):
            t = _enum(OperationType, t, f"{what} operation {k} type")
        operations.append(Operation(t, r.u32s(f"{what} operation {k} inputs"),
                                    r.u32s(f"{what} operation {k} outputs")))
    return Subgraph(tuple(operands), tuple(operations), r.u32s(f"{what} inputs"),
                    r.u32s(f"{what} outputs"))


def _put_model(w: _Writer, m: HalModel, put_pools=_put_pools) -> None:
    _put_subgraph(w, m.main)
    w.u32(len(m.referenced))
    for s in m.referenced:
        _put_subgraph(w, s)
    w.bytes_(m.operand_values)
    put_pools(w, m.pools)
    w.flag(m.relax_computation_float32_to_float16)
    w.u32(len(m.extension_prefixes))
    for e in m.extension_prefixes:
        w.str_(e.name)
        w.u32(e.prefix)


def _get_model(r: _Reader, get_pools=lambda r: _get_pools(r, "model")) -> HalModel:
    main = _get_subgraph(r, "main subgraph")
    n = r.count("subgraph count", 16)
    referenced = tuple(_get_subgraph(r, f"subgraph {k}") for k in range(n))
    values = r.bytes_("operand values", r.left)
    pools = get_pools(r)
    relax = r.flag("relax flag")
    n = r.count("extension prefix count", 8)
    prefixes = tuple(ExtensionPrefix(r.str_("extension name"), r.u32("extension prefix"))
                     for _ in range(n))
    mapping = {e.prefix: e.name for e in prefixes}
    try:
        main = _resolve_extension_types(main, mapping)
        referenced = tuple(_resolve_extension_types(s, mapping) for s in referenced)
    except NnrtError as e:
        raise ProtocolError(e.message) from None
    return HalModel(main, referenced, values, pools, relax, prefixes)


def _put_inline_pools(w: _Writer, pools) -> None:
    w.u32(len(pools))
    for pool in pools:
        w.bytes_(as_buffer(pool))


def _get_inline_pools(r: _Reader) -> tuple[bytes, ...]:
    return tuple(r.bytes_(f"pool {k}", r.left) for k in range(r.count("pool count", 4)))


def encode_model(model: HalModel) -> bytes:
    """``model`` as bytes, its constant pools inline: what a driver keeps of
    a model in its cache files (:func:`decode_model` reads it back)."""
    w = _Writer(b"")
    _put_model(w, model, _put_inline_pools)
    return w.value()


def decode_model(data) -> HalModel:
    """The model :func:`encode_model` wrote, its pools as bytes; ProtocolError
    for bytes that do not hold one."""
    r = _Reader(data, ())
    model = _get_model(r, _get_inline_pools)
    r.finish("cached model")
    return model


def encode_capabilities(capabilities: Capabilities) -> bytes:
    """``capabilities`` as CAPABILITIES' reply carries them (the remote
    transport sends these bytes: :func:`decode_capabilities` reads them)."""
    w = _Writer(b"")
    _put_capabilities(w, capabilities)
    return w.value()


def decode_capabilities(data) -> Capabilities:
    """What :func:`encode_capabilities` wrote; ProtocolError for other bytes."""
    r = _Reader(data, ())
    value = _get_capabilities(r, ErrorStatus.NONE, "")
    r.finish("capabilities")
    return value


def encode_extensions(extensions) -> bytes:
    """``extensions`` as SUPPORTED_EXTENSIONS' reply carries them."""
    w = _Writer(b"")
    _put_extensions(w, extensions)
    return w.value()


def decode_extensions(data) -> list[Extension]:
    """What :func:`encode_extensions` wrote; ProtocolError for other bytes."""
    r = _Reader(data, ())
    value = _get_extensions(r, ErrorStatus.NONE, "")
    r.finish("extensions")
    return value


def _enum(cls, v: int, what: str):
    try:
        return cls(v)
    except ValueError:
        raise ProtocolError(f"{what}: {v} is not a {cls.__name__}") from None


def _resolve_extension_types(sub: Subgraph, prefixes: dict[int, str]) -> Subgraph:
    """Turn the raw extension codes (plain ints) of ``sub`` into extension
    types, given the model's prefix map; INVALID_ARGUMENT for an unknown
    prefix or an extension this process does not know."""
    if not any(type(x.type) is int for x in (*sub.operands, *sub.operations)):
        return sub
    operands = tuple(replace(o, type=operand_type(o.type, prefixes)) if type(o.type) is int
                     else o for o in sub.operands)
    operations = tuple(replace(op, type=operation_type(op.type, prefixes))
                       if type(op.type) is int else op for op in sub.operations)
    return replace(sub, operands=operands, operations=operations)


def with_pools(model: HalModel, pools) -> HalModel:
    """``model`` with other constant pools: WirePools on the way out, the
    mapped memories on the way in."""
    return HalModel(model.main, model.referenced, model.operand_values, tuple(pools),
                    model.relax_computation_float32_to_float16, model.extension_prefixes)


def _put_perf(w: _Writer, p: PerformanceInfo) -> None:
    w.f64(p.exec_time)
    w.f64(p.power_usage)


def _get_perf(r: _Reader, what: str) -> PerformanceInfo:
    exec_time, power = r.f64(f"{what} exec_time"), r.f64(f"{what} power_usage")
    if math.isnan(exec_time) or math.isnan(power) or exec_time < 0 or power < 0:
        raise ProtocolError(f"{what}: performance ({exec_time}, {power}) is not a "
                            f"non-negative number")
    return PerformanceInfo(exec_time, power)


def _put_shapes_and_timings(w: _Writer, shapes, timings) -> None:
    w.u32(len(shapes))
    for s in shapes:
        w.u32s(s.dimensions)
        w.flag(s.is_sufficient)
    for t in timings:
        w.u64(t.on_device)
        w.u64(t.in_driver)


_RUN = ("run on-device time", "run in-driver time")
_FENCED = (_RUN, ("launched on-device time", "launched in-driver time"),
           ("fenced on-device time", "fenced in-driver time"))


def _get_shapes_and_timings(r: _Reader, timings):
    """Output shapes, then one Timing per (on-device, in-driver) label pair."""
    n = r.count("output shape count", 5)
    shapes = tuple(OutputShape(r.u32s("output dimensions"), r.flag("is sufficient"))
                   for _ in range(n))
    return shapes, [Timing(r.u64(on_device), r.u64(in_driver))
                    for on_device, in_driver in timings]


def _put_app(w: _Writer, app) -> None:
    # Service app keys are ("uid", n) or ("pid", n), a remote app's
    # ("remote", name); anything else travels as text.
    if isinstance(app, tuple) and len(app) == 2 and isinstance(app[0], str) \
            and isinstance(app[1], int) and not isinstance(app[1], bool) and app[1] >= 0:
        w.u8(1)
        w.str_(app[0])
        w.u64(app[1])
    elif isinstance(app, tuple) and len(app) == 2 and all(isinstance(x, str) for x in app):
        w.u8(2)
        w.str_(app[0])
        w.str_(app[1])
    else:
        w.u8(0)
        w.str_(str(app))


def _get_app(r: _Reader):
    form = r.u8("app key form")
    if form == 1:
        return (r.str_("app key kind"), r.u64("app key id"))
    if form == 2:
        return (r.str_("app key kind"), r.str_("app key name"))
    if form:
        raise ProtocolError(f"app key form {form} is none of 0, 1, 2")
    return r.str_("app key")


def _slots_of(r: _Reader) -> tuple[int, ...]:
    slots = r.u32s("burst slots")
    if len(slots) > MAX_BURST_SLOTS:
        raise ProtocolError(f"{len(slots)} burst slots exceed {MAX_BURST_SLOTS}")
    return slots


# -- one codec per method ---------------------------------------------------------

def _nothing(w, m) -> None:
    pass


def _put_hello(w: _Writer, m: Hello) -> None:
    w.u32(m.protocol_version)
    w.str_(m.app.name)
    w.str_(m.app.script)


def _get_hello(r: _Reader, call_id: int, method) -> Hello:
    version = r.u32("protocol version")
    if version != PROTOCOL_VERSION:
        # Another version's HELLO: its version is all this one reads of it,
        # so the service can say which versions met (the handler refuses it).
        r.raw(r.left, "the rest of another version's HELLO")
        return Hello(call_id, version)
    name, script = r.str_("app name"), r.str_("app script")
    try:
        return Hello(call_id, version, AppDeclaration(name, script))
    except NnrtError as e:
        raise r.error(f"HELLO: {e.message}") from None


def _put_device_info(w: _Writer, v: DeviceInfo) -> None:
    w.str_(v.name)
    w.u32(v.type)
    w.str_(v.version_string)
    w.u32(v.feature_level)
    w.u32(v.protocol_version)


def _get_device_info(r: _Reader, status, message) -> DeviceInfo:
    return DeviceInfo(r.str_("device name"), r.enum(DeviceType, "device type"),
                      r.str_("version string"), r.u32("feature level"),
                      r.u32("protocol version"))


def _put_capabilities(w: _Writer, c: Capabilities) -> None:
    _put_perf(w, c.relaxed_float32_to_float16_scalar)
    _put_perf(w, c.relaxed_float32_to_float16_tensor)
    w.u32(len(c.operand_performance))
    for t, p in c.operand_performance.items():
        w.u32(t)
        _put_perf(w, p)
    _put_perf(w, c.if_performance)
    _put_perf(w, c.while_performance)


def _get_capabilities(r: _Reader, status, message) -> Capabilities:
    scalar = _get_perf(r, "relaxed scalar performance")
    tensor = _get_perf(r, "relaxed tensor performance")
    n = r.count("operand performance count", 20)
    table = {}
    for _ in range(n):
        t = r.enum(OperandType, "operand performance type")
        table[t] = _get_perf(r, f"{t.name} performance")
    return Capabilities(scalar, tensor, table, _get_perf(r, "IF performance"),
                        _get_perf(r, "WHILE performance"))


def _put_extensions(w: _Writer, extensions) -> None:
    w.u32(len(extensions))
    for ext in extensions:
        w.str_(ext.name)
        w.u32(len(ext.operand_types))
        for info in ext.operand_types:
            w.u32(info.type)
            w.flag(info.is_tensor)
            w.u32(info.byte_size)
        w.u32(len(ext.operation_names))
        for within, name in ext.operation_names:
            w.u32(within)
            w.str_(name)


def _get_extension(r: _Reader, k: int) -> Extension:
    what = f"extension {k}"
    name = r.str_(f"{what} name")
    types = tuple(ExtensionOperandTypeInfo(r.u32(f"{what} operand type"),
                                           r.flag(f"{what} is-tensor flag"),
                                           r.u32(f"{what} byte size"))
                  for _ in range(r.count(f"{what} operand type count", 9)))
    names = tuple((r.u32(f"{what} operation type"), r.str_(f"{what} operation name"))
                  for _ in range(r.count(f"{what} operation count", 8)))
    try:
        return Extension(name, types, names)
    except NnrtError as e:
        raise ProtocolError(f"{what}: {e.message}") from None


def _get_extensions(r: _Reader, status, message) -> list[Extension]:
    return [_get_extension(r, k) for k in range(r.count("extension count", 12))]


def _put_cache_files(w: _Writer, v) -> None:
    w.u32(v[0])
    w.u32(v[1])


def _get_cache_files(r: _Reader, status, message) -> tuple[int, int]:
    return (r.u32("model cache files"), r.u32("data cache files"))


def _put_flags(w: _Writer, v) -> None:
    w.bytes_(bytes(bool(x) for x in v))


def _get_flags(r: _Reader, status, message) -> list[bool]:
    raw = r.bytes_("supported flags")
    if any(b > 1 for b in raw):
        raise ProtocolError("supported flags: a byte is neither 0 nor 1")
    return [bool(b) for b in raw]


def _put_id(w: _Writer, v: int) -> None:
    w.u64(v)


def _get_id(what: str):
    return lambda r, status, message: r.u64(what)


def _put_prepare(w: _Writer, m: PrepareModel) -> None:
    _put_model(w, m.model)
    w.u32(m.preference)
    w.u32(m.priority)
    w.opt_f64(m.deadline)


def _get_prepare(r: _Reader, call_id: int, method: Method) -> PrepareModel:
    model = _get_model(r)
    return PrepareModel(call_id, model, r.enum(ExecutionPreference, "preference"),
                        r.enum(Priority, "priority"), r.finite("deadline"))


def _put_cache_fds(w: _Writer, m) -> None:
    for fds in (m.cache_model, m.cache_data):
        w.u32(len(fds))
        w.fds.extend(fds)
    w.bytes_(m.token)


def _get_cache_fds(r: _Reader) -> tuple[tuple[int, ...], tuple[int, ...], bytes]:
    fds = []
    for what in ("model", "data"):
        n = r.u32(f"{what} cache file count")
        if n > MAX_CACHE_FILES:
            raise ProtocolError(f"{n} {what} cache files exceed {MAX_CACHE_FILES}")
        fds.append(tuple(r.fd(f"{what} cache file {k}") for k in range(n)))
    token = r.bytes_("cache token", TOKEN_SIZE)
    if len(token) != TOKEN_SIZE:
        raise ProtocolError(f"a cache token of {len(token)} bytes, not {TOKEN_SIZE}")
    return fds[0], fds[1], token


def _put_prepare_caching(w: _Writer, m: PrepareModelCaching) -> None:
    _put_prepare(w, m)
    _put_cache_fds(w, m)


def _get_prepare_caching(r: _Reader, call_id: int, method: Method) -> PrepareModelCaching:
    m = _get_prepare(r, call_id, method)
    model_fds, data_fds, token = _get_cache_fds(r)
    return PrepareModelCaching(call_id, m.model, m.preference, m.priority, m.deadline,
                               model_fds, data_fds, token)


def _put_from_cache(w: _Writer, m: PrepareModelFromCache) -> None:
    w.u32(m.priority)
    w.opt_f64(m.deadline)
    _put_cache_fds(w, m)


def _get_from_cache(r: _Reader, call_id: int, method: Method) -> PrepareModelFromCache:
    priority, deadline = r.enum(Priority, "priority"), r.finite("deadline")
    return PrepareModelFromCache(call_id, priority, deadline, *_get_cache_fds(r))


_REJECTS = tuple(CacheReject)


def _put_from_cache_value(w: _Writer, v: FromCache) -> None:
    w.u64(v.model_id)
    w.u8(0 if v.reason is None else 1 + _REJECTS.index(v.reason))


def _get_from_cache_value(r: _Reader, status, message) -> FromCache:
    model_id = r.u64("prepared model id")
    code = r.u8("cache reject reason")
    if code > len(_REJECTS):
        raise ProtocolError(f"cache reject reason {code} is unknown")
    return FromCache(status, message, model_id, None if code == 0 else _REJECTS[code - 1])


def _put_execute(w: _Writer, m: Execute) -> None:
    w.u64(m.model_id)
    for args in (m.inputs, m.outputs):
        w.u32(len(args))
        for a in args:
            w.flag(a.has_no_value)
            _put_location(w, a.location)
            w.u32s(a.dimensions)
    _put_pools(w, m.pools)
    w.u32(len(m.release))
    for pool_id in m.release:
        w.u64(pool_id)
    w.flag(m.measure)
    w.opt_f64(m.deadline)
    w.opt_f64(m.loop_timeout)


def _get_argument(r: _Reader, what: str) -> RequestArgument:
    no_value = r.flag(f"{what} has_no_value")
    loc = _get_location(r, what)
    if loc is not None and loc.pool_index < 0:
        raise ProtocolError(f"{what}: pool index {loc.pool_index} is negative")
    return RequestArgument(no_value, loc, r.u32s(f"{what} dimensions"))


def _get_execute(r: _Reader, call_id: int, method: Method) -> Execute:
    model_id = r.u64("prepared model id")
    args = []
    for kind in ("input", "output"):
        n = r.count(f"{kind} count", 6)
        args.append(tuple(_get_argument(r, f"{kind} {k}") for k in range(n)))
    pools = _get_pools(r, "request", tokens=True)
    release = tuple(r.u64("released pool id") for _ in range(r.count("release count", 8)))
    return Execute(call_id, model_id, args[0], args[1], pools, release, r.flag("measure"),
                   r.finite("deadline"), r.finite("loop timeout"))


def _put_execute_fenced(w: _Writer, m: ExecuteFenced) -> None:
    _put_execute(w, m)
    w.u32(len(m.wait_for))
    w.fds.extend(m.wait_for)
    w.opt_f64(m.timeout_after_fence)
    if m.fence is None:
        raise TypeError("EXECUTE_FENCED needs the result fence's fd")
    w.fds.append(m.fence)


def _get_execute_fenced(r: _Reader, call_id: int, method: Method) -> ExecuteFenced:
    e = _get_execute(r, call_id, method)
    n = r.u32("wait_for fence count")
    if n > MAX_FDS:
        raise ProtocolError(f"wait_for fence count {n} exceeds {MAX_FDS}")
    wait_for = tuple(r.fd(f"wait_for fence {k}") for k in range(n))
    timeout = r.finite("timeout after fence")
    if timeout is not None and timeout < 0:
        raise ProtocolError(f"timeout after fence {timeout} is negative")
    return ExecuteFenced(e.call_id, e.model_id, e.inputs, e.outputs, e.pools, e.release,
                         e.measure, e.deadline, e.loop_timeout, wait_for, timeout,
                         r.fd("result fence"))


def _get_create_execution(r: _Reader, call_id: int, method: Method) -> CreateExecution:
    e = _get_execute(r, call_id, method)
    return CreateExecution(e.call_id, e.model_id, e.inputs, e.outputs, e.pools, e.release,
                           e.measure, e.deadline, e.loop_timeout)


def _put_compute(w: _Writer, m: Compute) -> None:
    w.u64(m.execution_id)
    w.opt_f64(m.deadline)


def _get_compute(r: _Reader, call_id: int, method: Method) -> Compute:
    return Compute(call_id, r.u64("execution id"), r.finite("deadline"))


def _put_result(w: _Writer, v: ExecutionResult) -> None:
    _put_shapes_and_timings(w, v.output_shapes, (v.timing,))


def _get_result(r: _Reader, status, message) -> ExecutionResult:
    shapes, (timing,) = _get_shapes_and_timings(r, (_RUN,))
    return ExecutionResult(status, shapes, timing, message)


def _put_fenced_info(w: _Writer, v: FencedInfo) -> None:
    _put_shapes_and_timings(w, v.result.output_shapes,
                            (v.result.timing, v.timing_launched, v.timing_fenced))


def _get_fenced_info(r: _Reader, status, message) -> FencedInfo:
    shapes, (timing, launched, fenced) = _get_shapes_and_timings(r, _FENCED)
    return FencedInfo(ExecutionResult(status, shapes, timing, message), launched, fenced)


def _put_configure_burst(w: _Writer, m: ConfigureBurst) -> None:
    if len(m.ring_fds) != BURST_RING_FDS:
        raise ProtocolError(f"CONFIGURE_BURST takes {BURST_RING_FDS} ring fds, "
                            f"not {len(m.ring_fds)}")
    w.u64(m.model_id)
    w.fds.extend(m.ring_fds)


def _get_configure_burst(r: _Reader, call_id: int, method: Method) -> ConfigureBurst:
    model_id = r.u64("prepared model id")
    return ConfigureBurst(call_id, model_id,
                          tuple(r.fd(f"burst ring fd {k}") for k in range(BURST_RING_FDS)))


def _put_burst_slots(w: _Writer, m) -> None:
    w.u64(m.burst_id)
    w.u32s(m.slots)


def _get_burst_slots(cls):
    def get(r: _Reader, call_id: int, method: Method):
        burst_id = r.u64("burst id")
        return cls(call_id, burst_id, _slots_of(r))
    return get


def _put_burst_ended(w: _Writer, m: BurstEnded) -> None:
    w.u64(m.burst_id)
    w.str_(m.reason)


def _get_burst_ended(r: _Reader, call_id: int, method: Method) -> BurstEnded:
    burst_id = r.u64("burst id")
    return BurstEnded(call_id, burst_id, r.str_("reason"))


class _RecordCodec:
    """The wire form of one of the scheduler's record dataclasses, made from
    its fields (``dataclasses.fields``) by their declared types: the app key
    in its own form, then each run of fixed-size fields in one struct (a
    reply carries up to 256 job records: reading them field by field took
    ~12 us each, issue 15), then strings. Fields in ``omit`` stay on the
    service (None on the client). The wire changes when the record does:
    ``tests/unit/test_protocol.py`` pins the layout against PROTOCOL_VERSION."""

    # declared type -> (struct code, to the wire, from the wire given what it is)
    _FIXED = {
        "int": ("Q", int, lambda what: int),
        "Priority": ("I", int, lambda what: lambda v: _member(Priority, v, what)),
        "ErrorStatus": ("I", int, lambda what: lambda v: _member(ErrorStatus, v, what)),
        "float": ("d", float, lambda what: float),
        "float | None": ("d", lambda v: math.nan if v is None else float(v),
                         lambda what: lambda v: None if math.isnan(v) else v),
    }

    def __init__(self, cls, omit: tuple[str, ...] = ()):
        self.cls = cls
        self.omit = omit
        self.plan: list = []     # ("app", name) | ("str", name) | (Struct, names, puts, gets)
        run: list = []

        def close_run():
            if run:
                self.plan.append((struct.Struct("<" + "".join(c for _, c, _, _ in run)),
                                  tuple(n for n, _, _, _ in run),
                                  tuple(put for _, _, put, _ in run),
                                  tuple(get for _, _, _, get in run)))
                run.clear()
        for f in fields(cls):
            if f.name in omit:
                continue
            kind = f.type if isinstance(f.type, str) else f.type.__name__
            if kind == "Hashable":
                close_run()
                self.plan.append(("app", f.name))
            elif kind == "str":
                close_run()
                self.plan.append(("str", f.name))
            elif kind in self._FIXED:
                code, put, get = self._FIXED[kind]
                run.append((f.name, code, put, get(f"{cls.__name__} {f.name}")))
            else:
                raise TypeError(f"{cls.__name__}.{f.name}: no wire form for {kind}")
        close_run()

    def put(self, w: _Writer, record) -> None:
        for step in self.plan:
            if step[0] == "app":
                _put_app(w, getattr(record, step[1]))
            elif step[0] == "str":
                w.str_(getattr(record, step[1]))
            else:
                packer, names, puts, _ = step
                w.pack(packer, *(put(getattr(record, n)) for n, put in zip(names, puts)))

    def get(self, r: _Reader):
        values = dict.fromkeys(self.omit)
        for step in self.plan:
            if step[0] == "app":
                values[step[1]] = _get_app(r)
            elif step[0] == "str":
                values[step[1]] = r.str_(f"{self.cls.__name__} {step[1]}")
            else:
                unpacker, names, _, gets = step
                raw = r.take(unpacker, f"{self.cls.__name__} fields")
                values.update((n, get(v)) for n, get, v in zip(names, gets, raw))
        return self.cls(**values)


_CLASS = _RecordCodec(ClassStatistics)
_APP = _RecordCodec(AppStatistics)
_JOB = _RecordCodec(JobRecord, omit=("model",))   # the service's own key of a prepared model


def _put_statistics(w: _Writer, v: StatisticsValue) -> None:
    st = v.statistics
    w.flag(st is not None)
    if st is not None:
        w.u32(st.slots)
        w.u32(st.busy)
        w.u32(len(st.classes))
        for c in st.classes:
            _CLASS.put(w, c)
        w.u32(len(st.apps))
        for a in st.apps:
            _APP.put(w, a)
    jobs = v.jobs[-MAX_JOB_RECORDS:]
    w.u32(len(jobs))
    for j in jobs:
        _JOB.put(w, j)


def _get_statistics(r: _Reader, status, message) -> StatisticsValue:
    st = None
    if r.flag("statistics flag"):
        slots, busy = r.u32("slots"), r.u32("busy slots")
        classes = tuple(_CLASS.get(r) for _ in range(r.count("class count", 30)))
        apps = tuple(_APP.get(r) for _ in range(r.count("app count", 20)))
        st = SchedulerStatistics(slots, busy, classes, apps)
    n = r.count("job count", 50)
    if n > MAX_JOB_RECORDS:
        raise ProtocolError(f"job count {n} exceeds {MAX_JOB_RECORDS}")
    return StatisticsValue(st, tuple(_JOB.get(r) for _ in range(n)))


def encode_statistics(value: StatisticsValue) -> bytes:
    """``value`` as STATISTICS' reply carries it (the remote ``Status``
    call sends these bytes: :func:`decode_statistics` reads them)."""
    w = _Writer(b"")
    _put_statistics(w, value)
    return w.value()


def decode_statistics(data) -> StatisticsValue:
    """What :func:`encode_statistics` wrote; ProtocolError for other bytes."""
    r = _Reader(data, ())
    value = _get_statistics(r, ErrorStatus.NONE, "")
    r.finish("statistics")
    return value


def _put_roles(w: _Writer, roles) -> None:
    w.u32(len(roles))
    for role in roles:
        w.u32(role.model_index)
        w.u32(role.io_index)
        w.f64(role.frequency)


def _get_roles(r: _Reader, what: str) -> tuple[BufferRole, ...]:
    return tuple(BufferRole(r.u32(f"{what} model index"), r.u32(f"{what} io index"),
                            r.f64(f"{what} frequency"))
                 for _ in range(r.count(f"{what} count", 16)))


def _put_allocate(w: _Writer, m: Allocate) -> None:
    w.u32s(m.dimensions)
    w.u32(len(m.model_ids))
    for model_id in m.model_ids:
        w.u64(model_id)
    _put_roles(w, m.input_roles)
    _put_roles(w, m.output_roles)


def _get_allocate(r: _Reader, call_id: int, method: Method) -> Allocate:
    dims = r.u32s("buffer dimensions")
    ids = tuple(r.u64("prepared model id") for _ in range(r.count("prepared model count", 8)))
    return Allocate(call_id, dims, ids, _get_roles(r, "input role"), _get_roles(r, "output role"))


def _put_allocated(w: _Writer, v: Allocated) -> None:
    w.u64(v.token)
    w.flag(v.mirror_fd is not None)
    if v.mirror_fd is not None:
        w.u64(v.mirror_size)
        w.fds.append(v.mirror_fd)


def _get_allocated(r: _Reader, status: ErrorStatus, message: str) -> Allocated:
    token = r.u64("buffer token")
    if not r.flag("mirror flag"):
        return Allocated(token)
    size = r.u64("mirror size")
    if size == 0:
        raise ProtocolError("ALLOCATE: a mirror of 0 bytes")
    return Allocated(token, r.fd("buffer mirror"), size)


def _put_copy(w: _Writer, m: CopyBuffer) -> None:
    w.u64(m.token)
    _put_pools(w, (m.pool,))
    w.u32s(m.dimensions)


def _get_copy(r: _Reader, call_id: int, method: Method) -> CopyBuffer:
    token = r.u64("buffer token")
    pools = _get_pools(r, "copy")
    if len(pools) != 1 or pools[0].fd is None:
        raise ProtocolError(f"{method.name}: takes one shared memory, sent with its fd")
    dims = r.u32s("copy dimensions")
    if method == Method.COPY_TO and dims:
        raise ProtocolError("COPY_TO takes no dimensions")
    return CopyBuffer(call_id, method, token, pools[0], dims)


def _execution_error(status: ErrorStatus, message: str) -> ExecutionResult:
    return ExecutionResult(status, message=message)


def _fenced_error(status: ErrorStatus, message: str) -> FencedInfo:
    return FencedInfo(ExecutionResult(status, message=message), NO_TIMING, NO_TIMING)


@dataclass(frozen=True, slots=True)
class Codec:
    """How one method crosses the wire.

    ``put_call``/``get_call`` write and read a call's payload (None: the
    method has no call form). ``put_value``/``get_value`` do the same for
    the value of a successful reply (None: the reply carries no value).
    ``error_value`` is the value an error reply still carries (an execution
    reports shapes and timing even when it failed); ``fds`` lists the fds a
    decoded call holds, which its receiver owns and closes; ``value_fds``
    the same for a reply's value."""

    put_call: Callable[[_Writer, Any], None] | None
    get_call: Callable[[_Reader, int, Method], Any] | None
    put_value: Callable[[_Writer, Any], None] | None = None
    get_value: Callable[[_Reader, ErrorStatus, str], Any] | None = None
    error_value: Callable[[ErrorStatus, str], Any] | None = None
    fds: Callable[[Any], tuple[int, ...]] = lambda call: ()
    value_fds: Callable[[Any], tuple[int, ...]] = lambda value: ()


def _query(r: _Reader, call_id: int, method: Method) -> Query:
    return Query(call_id, method)


def _get_u64_call(cls, what: str):
    return lambda r, call_id, method: cls(call_id, r.u64(what))


CODECS: dict[Method, Codec] = {
    Method.ERROR: Codec(None, None),
    Method.HELLO: Codec(_put_hello, _get_hello,
                        _put_device_info, _get_device_info),
    Method.CAPABILITIES: Codec(_nothing, _query, _put_capabilities, _get_capabilities),
    Method.SUPPORTED_EXTENSIONS: Codec(_nothing, _query, _put_extensions, _get_extensions),
    Method.NUMBER_OF_CACHE_FILES: Codec(_nothing, _query, _put_cache_files, _get_cache_files),
    Method.STATISTICS: Codec(_nothing, _query, _put_statistics, _get_statistics),
    Method.SUPPORTED_OPERATIONS: Codec(
        lambda w, m: _put_model(w, m.model),
        lambda r, cid, m: SupportedOperations(cid, _get_model(r)),
        _put_flags, _get_flags, fds=lambda call: _pool_fds(call.model.pools)),
    Method.PREPARE_MODEL: Codec(_put_prepare, _get_prepare, _put_id,
                                _get_id("prepared model id"),
                                fds=lambda call: _pool_fds(call.model.pools)),
    Method.EXECUTE: Codec(_put_execute, _get_execute, _put_result, _get_result,
                          _execution_error, fds=lambda call: _pool_fds(call.pools)),
    Method.EXECUTE_FENCED: Codec(
        _put_execute_fenced, _get_execute_fenced, _put_fenced_info, _get_fenced_info,
        _fenced_error, fds=lambda call: (*_pool_fds(call.pools), *call.wait_for, call.fence)),
    Method.RELEASE_MODEL: Codec(lambda w, m: w.u64(m.model_id),
                                _get_u64_call(ReleaseModel, "prepared model id")),
    Method.CONFIGURE_BURST: Codec(_put_configure_burst, _get_configure_burst, _put_id,
                                  _get_id("burst id"), fds=lambda call: call.ring_fds),
    Method.RELEASE_BURST: Codec(lambda w, m: w.u64(m.burst_id),
                                _get_u64_call(ReleaseBurst, "burst id")),
    Method.FREE_BURST_SLOTS: Codec(_put_burst_slots, _get_burst_slots(FreeBurstSlots)),
    Method.GET_MEMORIES: Codec(_put_burst_slots, _get_burst_slots(GetMemories),
                               _put_pools, lambda r, status, message: _get_pools(r, "burst memory"),
                               value_fds=_pool_fds),
    Method.BURST_ENDED: Codec(_put_burst_ended, _get_burst_ended),
    Method.CANCEL: Codec(lambda w, m: w.u64(m.target),
                         _get_u64_call(Cancel, "cancelled call id")),
    Method.ALLOCATE: Codec(_put_allocate, _get_allocate, _put_allocated, _get_allocated,
                           value_fds=lambda v: () if v.mirror_fd is None else (v.mirror_fd,)),
    Method.COPY_TO: Codec(_put_copy, _get_copy, fds=lambda call: _pool_fds((call.pool,))),
    Method.COPY_FROM: Codec(_put_copy, _get_copy, fds=lambda call: _pool_fds((call.pool,))),
    Method.RELEASE_BUFFER: Codec(lambda w, m: w.u64(m.token),
                                 _get_u64_call(ReleaseBuffer, "buffer token")),
    Method.PREPARE_MODEL_CACHING: Codec(
        _put_prepare_caching, _get_prepare_caching, _put_id, _get_id("prepared model id"),
        fds=lambda call: (*_pool_fds(call.model.pools), *call.cache_model, *call.cache_data)),
    Method.PREPARE_MODEL_FROM_CACHE: Codec(
        _put_from_cache, _get_from_cache, _put_from_cache_value, _get_from_cache_value,
        lambda status, message: FromCache(status, message),
        fds=lambda call: (*call.cache_model, *call.cache_data)),
    Method.CREATE_EXECUTION: Codec(_put_execute, _get_create_execution, _put_id,
                                   _get_id("execution id"), fds=lambda call: _pool_fds(call.pools)),
    Method.COMPUTE: Codec(_put_compute, _get_compute, _put_result, _get_result,
                          _execution_error),
    Method.RELEASE_EXECUTION: Codec(lambda w, m: w.u64(m.execution_id),
                                    _get_u64_call(ReleaseExecution, "execution id")),
}
assert set(CODECS) == set(Method), "every method has its codec"


def _has_value(method: Method, status: ErrorStatus) -> bool:
    return status == ErrorStatus.NONE or CODECS[method].error_value is not None


def error_reply(call_id: int, method: Method, status: ErrorStatus, message: str) -> Reply:
    """The reply refusing call ``call_id`` of ``method`` with ``status``
    (with the value an execution's error reply carries)."""
    codec = CODECS[method]
    value = codec.error_value(status, message) if codec.error_value is not None else None
    return Reply(call_id, method, status, message, value)


def reply_for(call, value) -> Reply:
    """The reply answering ``call`` with ``value``: an execution's reply takes
    its status and message from the value, any other is NONE."""
    if CODECS[call.method].error_value is not None:
        return Reply(call.call_id, call.method, value.status, value.message, value)
    return Reply(call.call_id, call.method, value=value)


def fds_of(call) -> tuple[int, ...]:
    """The fds a decoded call holds (its receiver closes them)."""
    return tuple(CODECS[call.method].fds(call))


def reply_fds_of(reply: Reply) -> tuple[int, ...]:
    """The fds a decoded reply's value holds (its receiver owns them)."""
    if reply.value is None or not _has_value(reply.method, reply.status):
        return ()
    return tuple(CODECS[reply.method].value_fds(reply.value))


# -- encoding and decoding whole messages --------------------------------------------

def encode(message) -> tuple[bytes, list[int]]:
    """Frame bytes and the fds that travel beside them."""
    reply = isinstance(message, Reply)
    try:
        codec = CODECS[message.method]
    except (AttributeError, KeyError):
        raise TypeError(f"not a protocol message: {message!r}") from None
    w = _Writer(_BODY.pack(Kind.REPLY if reply else Kind.CALL, message.method, message.call_id))
    if not reply and codec.put_call is None:
        raise TypeError(f"{message.method.name} has no call form")
    try:
        if reply:
            w.u32(message.status)
            w.str_(message.message)
            has_value = _has_value(message.method, message.status)
            w.flag(has_value)
            if has_value and codec.put_value is not None:
                codec.put_value(w, message.value)
        else:
            codec.put_call(w, message)
    except (struct.error, OverflowError, ValueError) as e:
        # An argument the wire cannot carry (a negative offset, a string
        # deadline): the caller's mistake, refused before anything is sent.
        raise ProtocolError(f"{message.method.name}: an argument cannot be encoded: {e}") \
            from None
    body = w.out
    if len(body) > MAX_FRAME or len(w.fds) > MAX_FDS:
        raise ProtocolError(f"message of {len(body)} bytes and {len(w.fds)} fds exceeds the "
                            f"frame limits ({MAX_FRAME} bytes, {MAX_FDS} fds)")
    return _FRAME.pack(len(body), len(w.fds)) + body, w.fds


def _peek_ids(body: bytes) -> tuple[int, int]:
    """(call id, method) of a body that did not decode, 0 where unreadable."""
    if len(body) >= _BODY.size:
        _kind, method, call_id = _BODY.unpack_from(body)
        return call_id, method
    return 0, 0


def decode_body(body: bytes, fds=()):
    """A message from one frame body and its fds, or ProtocolError."""
    r = _Reader(body, fds)
    kind, method, call_id = r.take(_BODY, "message header")
    if kind not in (Kind.CALL, Kind.REPLY):
        raise ProtocolError(f"message kind {kind} is neither CALL nor REPLY")
    try:
        method = Method(method)
    except ValueError:
        raise ProtocolError(f"unknown method {method}") from None
    codec = CODECS[method]
    if kind == Kind.CALL:
        if codec.get_call is None:
            raise ProtocolError(f"{method.name} is a reply, not a call")
        message = codec.get_call(r, call_id, method)
    else:
        message = _decode_reply(r, method, call_id, codec)
    r.finish(method.name)
    if r.fd_pos != len(r.fds):
        raise ProtocolError(f"{method.name}: {len(r.fds)} fds came with a message that "
                            f"uses {r.fd_pos}")
    return message


def _decode_reply(r: _Reader, method: Method, call_id: int, codec: Codec) -> Reply:
    status = r.enum(ErrorStatus, "status")
    message = r.str_("error message")
    has_value = r.flag("value flag")
    if method == Method.ERROR and status == ErrorStatus.NONE:
        raise ProtocolError("an ERROR reply with status NONE")
    if has_value != _has_value(method, status):
        raise ProtocolError(f"{method.name} reply with status {status.name} "
                            f"{'has' if has_value else 'lacks'} a value")
    value = None
    if has_value and codec.get_value is not None:
        value = codec.get_value(r, status, message)
    return Reply(call_id, method, status, message, value)


__all__ = ["CODECS", "Codec", "decode_body", "decode_capabilities", "decode_extensions",
           "decode_model", "decode_statistics", "encode", "encode_capabilities",
           "encode_extensions", "encode_model", "encode_statistics", "error_reply", "fds_of", "reply_fds_of", "reply_for", "with_pools"]
