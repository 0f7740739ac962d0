"""Lookups: EMBEDDING_LOOKUP, HASHTABLE_LOOKUP, LSH_PROJECTION (HAL 1.0) and
GATHER (HAL 1.2).

LSH_PROJECTION hashes with FarmHash's 64-bit fingerprint (``farmhashna::Hash64``,
what NNAPI's reference calls ``Fingerprint64``), written here over numpy
uint64 columns: every key of one call has the same length, so the branch
taken by the hash is the same for all of them and the whole batch of keys is
hashed at once.
"""
from __future__ import annotations

import numpy as np

from ..model.types import HalVersion as V, OperandType as T, OperationType
from .common import check_quant_params, quantize
from .registry import Call, OpView, register


def _norm_axis(axis: int, rank: int, fail) -> int:
    if not -rank <= axis < rank:
        raise fail(f"axis {axis} out of range for rank {rank}")
    return axis + rank if axis < 0 else axis


def _same_quant_copy(x: np.ndarray, src, out) -> np.ndarray:
    """Gathered stored values -> output array (requantized if the output's
    quantization differs; NNAPI requires it to be the same)."""
    if out.type.is_quantized and (src.scale != out.scale or src.zero_point != out.zero_point):
        # float64: exact, so a tie stays a tie when it is requantized.
        real = (x.astype(np.float64) - src.zero_point) * np.float64(np.float32(src.scale))
        return quantize(real, out)
    return np.array(x, dtype=out.type.dtype, copy=True)


# --- EMBEDDING_LOOKUP --------------------------------------------------------------

_EMBEDDING_TYPES = {T.TENSOR_FLOAT32: V.V1_0, T.TENSOR_FLOAT16: V.V1_3,
                    T.TENSOR_INT32: V.V1_2, T.TENSOR_QUANT8_ASYMM: V.V1_2,
                    T.TENSOR_QUANT8_ASYMM_SIGNED: V.V1_3}


def _embedding_validate(op: OpView) -> V:
    op.expect_counts(2, 1)
    t = op.expect_type_in(1, tuple(_EMBEDDING_TYPES))
    op.expect_types([T.TENSOR_INT32, t], [t])
    op.expect_rank(0, 1)
    r = op.rank(1)
    if r is not None and r < 2:
        raise op.fail(f"values (input 1) must have rank >= 2, got {r}")
    check_quant_params(op)
    return _EMBEDDING_TYPES[t]


def _embedding_shape(op: OpView) -> list[tuple[int, ...]]:
    if op.rank(1) is None:
        return [()]
    lookups = op.dims(0)[0] if op.rank(0) == 1 else 0
    return [(lookups,) + tuple(op.dims(1)[1:])]


def _embedding_kernel(call: Call) -> list[np.ndarray]:
    lookups, values = call.ins
    idx = lookups.value.astype(np.int64)
    rows = values.value.shape[0]
    if ((idx < 0) | (idx >= rows)).any():
        raise call.fail(f"lookup index out of range [0, {rows})")
    return [_same_quant_copy(values.value[idx], values, call.outs[0])]


register(OperationType.EMBEDDING_LOOKUP, validate=_embedding_validate, shape=_embedding_shape,
         kernel=_embedding_kernel)


# --- HASHTABLE_LOOKUP --------------------------------------------------------------

_HASHTABLE_TYPES = (T.TENSOR_FLOAT32, T.TENSOR_INT32, T.TENSOR_QUANT8_ASYMM)


def _hashtable_validate(op: OpView) -> V:
    op.expect_counts(3, 2)
    t = op.expect_type_in(2, _HASHTABLE_TYPES)
    op.expect_types([T.TENSOR_INT32, T.TENSOR_INT32, t], [t, T.TENSOR_QUANT8_ASYMM])
    op.expect_rank(0, 1)
    op.expect_rank(1, 1)
    if op.rank(2) == 0:
        raise op.fail("values (input 2) must have rank >= 1")
    keys, rows = op.dims(1), op.dims(2)
    if keys and rows and keys[0] and rows[0] and keys[0] != rows[0]:
        raise op.fail(f"{keys[0]} keys for {rows[0]} value rows")
    check_quant_params(op)
    return V.V1_0


def _hashtable_shape(op: OpView) -> list[tuple[int, ...]]:
    lookups = op.dims(0)[0] if op.rank(0) == 1 else 0
    values = (lookups,) + tuple(op.dims(2)[1:]) if op.rank(2) is not None else ()
    return [values, (lookups,)]


def _hashtable_kernel(call: Call) -> list[np.ndarray]:
    lookups, keys, values = call.ins
    out, hits_out = call.outs
    keys_v, wanted = keys.value, lookups.value
    if keys_v.shape[0] != values.value.shape[0]:
        raise call.fail(f"{keys_v.shape[0]} keys for {values.value.shape[0]} value rows")
    # Keys are sorted ascending (the spec requires it), so a binary search finds them.
    pos = np.searchsorted(keys_v, wanted)
    pos_valid = np.minimum(pos, max(keys_v.shape[0] - 1, 0))
    hit = (pos < keys_v.shape[0]) & (keys_v[pos_valid] == wanted) if keys_v.size else \
        np.zeros(wanted.shape, bool)
    gathered = np.zeros((wanted.shape[0],) + values.value.shape[1:], values.value.dtype)
    if hit.any():
        gathered[hit] = values.value[pos_valid[hit]]
    # A miss is a slice of zero bytes (not the zero point), as the reference fills it.
    return [_same_quant_copy(gathered, values, out), hit.astype(np.uint8)]


register(OperationType.HASHTABLE_LOOKUP, validate=_hashtable_validate, shape=_hashtable_shape,
         kernel=_hashtable_kernel)


# --- GATHER ------------------------------------------------------------------------

_GATHER_TYPES = {T.TENSOR_FLOAT32: V.V1_2, T.TENSOR_FLOAT16: V.V1_2, T.TENSOR_INT32: V.V1_2,
                 T.TENSOR_QUANT8_ASYMM: V.V1_2, T.TENSOR_QUANT8_ASYMM_SIGNED: V.V1_3}


def _gather_validate(op: OpView) -> V:
    op.expect_counts(3, 1)
    t = op.expect_type_in(0, tuple(_GATHER_TYPES))
    op.expect_types([t, T.INT32, T.TENSOR_INT32], [t])
    check_quant_params(op)
    axis, rank = op.value(1), op.rank(0)
    if rank == 0:
        raise op.fail("input 0 must have rank >= 1")
    if axis is not None and rank is not None:
        _norm_axis(axis, rank, op.fail)
    return _GATHER_TYPES[t]


def _gather_shape(op: OpView) -> list[tuple[int, ...]]:
    rank, axis = op.rank(0), op.value(1)
    if rank is None or op.rank(2) is None:
        return [()]
    if axis is None:
        return [(0,) * (rank - 1 + op.rank(2))]
    axis = _norm_axis(axis, rank, op.fail)
    dims = op.dims(0)
    return [dims[:axis] + tuple(op.dims(2)) + dims[axis + 1:]]


def _gather_kernel(call: Call) -> list[np.ndarray]:
    x, axis, indices = call.ins
    axis = _norm_axis(axis.value, x.value.ndim, call.fail)
    idx = indices.value.astype(np.int64)
    extent = x.value.shape[axis]
    if ((idx < 0) | (idx >= extent)).any():
        raise call.fail(f"index out of range [0, {extent}) on axis {axis}")
    return [_same_quant_copy(np.take(x.value, idx, axis=axis), x, call.outs[0])]


register(OperationType.GATHER, validate=_gather_validate, shape=_gather_shape,
         kernel=_gather_kernel)


# --- FarmHash Fingerprint64 (farmhashna::Hash64), vectorised over keys --------------

_U64 = np.uint64
_K0 = _U64(0xC3A5C85C97CB3127)
_K1 = _U64(0xB492B66FBE98F273)
_K2 = _U64(0x9AE16A3B2F90404F)


def _rot(v, shift: int):
    return v if shift == 0 else (v >> _U64(shift)) | (v << _U64(64 - shift))


def _shift_mix(v):
    return v ^ (v >> _U64(47))


def _mix16(u, v, mul):
    """The Murmur-style 128 -> 64 bit mix farmhash calls HashLen16(u, v, mul)."""
    a = _shift_mix((u ^ v) * mul)
    b = _shift_mix((v ^ a) * mul)
    return b * mul


class _Keys:
    """Little-endian word reads at fixed offsets of equal-length byte keys."""

    def __init__(self, keys: np.ndarray):
        self.keys = keys  # (count, length) uint8

    def u64(self, offset: int):
        return np.ascontiguousarray(self.keys[:, offset:offset + 8]).view("<u8")[:, 0]

    def u32(self, offset: int):
        return np.ascontiguousarray(self.keys[:, offset:offset + 4]).view("<u4")[:, 0].astype(_U64)

    def u8(self, offset: int):
        return self.keys[:, offset].astype(_U64)


def _len_0_to_16(k: _Keys, n: int):
    if n >= 8:
        mul = _K2 + _U64(2 * n)
        a = k.u64(0) + _K2
        b = k.u64(n - 8)
        c = _rot(b, 37) * mul + a
        d = (_rot(a, 25) + b) * mul
        return _mix16(c, d, mul)
    if n >= 4:
        mul = _K2 + _U64(2 * n)
        return _mix16(_U64(n) + (k.u32(0) << _U64(3)), k.u32(n - 4), mul)
    if n > 0:
        y = (k.u8(0) + (k.u8(n >> 1) << _U64(8))) & _U64(0xFFFFFFFF)
        z = (_U64(n) + (k.u8(n - 1) << _U64(2))) & _U64(0xFFFFFFFF)
        return _shift_mix(y * _K2 ^ z * _K0) * _K2
    return np.full(k.keys.shape[0], _K2, dtype=_U64)


def _len_17_to_32(k: _Keys, n: int):
    mul = _K2 + _U64(2 * n)
    a = k.u64(0) * _K1
    b = k.u64(8)
    c = k.u64(n - 8) * mul
    d = k.u64(n - 16) * _K2
    return _mix16(_rot(a + b, 43) + _rot(c, 30) + d, a + _rot(b + _K2, 18) + c, mul)


def _len_33_to_64(k: _Keys, n: int):
    mul = _K2 + _U64(2 * n)
    a = k.u64(0) * _K2
    b = k.u64(8)
    c = k.u64(n - 8) * mul
    d = k.u64(n - 16) * _K2
    y = _rot(a + b, 43) + _rot(c, 30) + d
    z = _mix16(y, a + _rot(b + _K2, 18) + c, mul)
    e = k.u64(16) * mul
    f = k.u64(24)
    g = (y + k.u64(n - 32)) * mul
    h = (z + k.u64(n - 24)) * mul
    return _mix16(_rot(e + f, 43) + _rot(g, 30) + h, e + _rot(f + a, 18) + g, mul)


def _weak_hash_32(k: _Keys, offset: int, a, b):
    """farmhash's WeakHashLen32WithSeeds over the 32 bytes at ``offset``."""
    w, x, y, z = (k.u64(offset + 8 * i) for i in range(4))
    a = a + w
    b = _rot(b + a + z, 21)
    c = a
    a = a + x + y
    b = b + _rot(a, 44)
    return a + z, b + c


def _len_over_64(k: _Keys, n: int):
    count = k.keys.shape[0]
    seed = _U64(81)
    x = np.full(count, seed, _U64)
    y = np.full(count, seed * _K1 + _U64(113), _U64)
    z = _shift_mix(y * _K2 + _U64(113)) * _K2
    v0 = v1 = w0 = w1 = np.zeros(count, _U64)
    x = x * _K2 + k.u64(0)
    # Whole 64-byte blocks except the last (1..64 bytes), which is read as the final 64.
    for s in range(0, ((n - 1) // 64) * 64, 64):
        x = _rot(x + y + v0 + k.u64(s + 8), 37) * _K1
        y = _rot(y + v1 + k.u64(s + 48), 42) * _K1
        x = x ^ w1
        y = y + v0 + k.u64(s + 40)
        z = _rot(z + w0, 33) * _K1
        v0, v1 = _weak_hash_32(k, s, v1 * _K1, x + w0)
        w0, w1 = _weak_hash_32(k, s + 32, z + w1, y + k.u64(s + 16))
        x, z = z, x
    mul = _K1 + ((z & _U64(0xFF)) << _U64(1))
    s = n - 64
    w0 = w0 + _U64((n - 1) & 63)
    v0 = v0 + w0
    w0 = w0 + v0
    x = _rot(x + y + v0 + k.u64(s + 8), 37) * mul
    y = _rot(y + v1 + k.u64(s + 48), 42) * mul
    x = x ^ (w1 * _U64(9))
    y = y + v0 * _U64(9) + k.u64(s + 40)
    z = _rot(z + w0, 33) * mul
    v0, v1 = _weak_hash_32(k, s, v1 * mul, x + w0)
    w0, w1 = _weak_hash_32(k, s + 32, z + w1, y + k.u64(s + 16))
    x, z = z, x
    return _mix16(_mix16(v0, w0, mul) + _shift_mix(y) * _K0 + z,
                  _mix16(v1, w1, mul) + x, mul)


def fingerprint64(keys: np.ndarray) -> np.ndarray:
    """FarmHash Fingerprint64 of each row of ``keys`` ((count, length) uint8)."""
    keys = np.ascontiguousarray(keys, dtype=np.uint8)
    n = keys.shape[1]
    k = _Keys(keys)
    # The hash wraps on overflow, by design: quiet wherever it is called from
    # (a kernel's run already ignores numpy's FP errors: see the executor).
    with np.errstate(over="ignore"):
        if n <= 16:
            return _len_0_to_16(k, n)
        if n <= 32:
            return _len_17_to_32(k, n)
        if n <= 64:
            return _len_33_to_64(k, n)
        return _len_over_64(k, n)


# --- LSH_PROJECTION ------------------------------------------------------------------

_SPARSE_DEPRECATED, _DENSE, _SPARSE = 1, 2, 3
_LSH_HASH_TYPES = {T.TENSOR_FLOAT32: V.V1_0, T.TENSOR_FLOAT16: V.V1_2}


def _lsh_validate(op: OpView) -> V:
    op.expect_counts(4, 1)
    t = op.expect_type_in(0, tuple(_LSH_HASH_TYPES))
    op.expect_types([t, None, None, T.INT32], [T.TENSOR_INT32])
    if not op.inputs[1].type.is_tensor:
        raise op.fail("input 1 must be a tensor")
    op.expect_rank(0, 2)
    if op.rank(1) == 0:
        raise op.fail("input 1 must have rank >= 1")
    hash_dims = op.dims(0)
    if len(hash_dims) == 2 and hash_dims[1] > 32:
        raise op.fail(f"at most 32 bits per hash function, got {hash_dims[1]}")
    version = _LSH_HASH_TYPES[t]
    if not op.is_omitted(2):
        op.expect_types([None, None, t], [])
        op.expect_rank(2, 1)
        w, x = op.dims(2), op.dims(1)
        if w and x and w[0] and x[0] and w[0] != x[0]:
            raise op.fail(f"{w[0]} weights for {x[0]} input rows")
    kind = op.value(3)
    if kind is not None and kind not in (_SPARSE_DEPRECATED, _DENSE, _SPARSE):
        raise op.fail(f"unknown projection type {kind}")
    if kind == _SPARSE:
        version = max(version, V.V1_2)
    check_quant_params(op)
    return version


def _lsh_shape(op: OpView) -> list[tuple[int, ...]]:
    hash_dims, kind = op.dims(0), op.value(3)
    if len(hash_dims) != 2 or kind is None:
        return [(0,)]
    num_hash, num_bits = hash_dims
    return [(num_hash,) if kind != _DENSE else (num_hash * num_bits,)]


def _lsh_kernel(call: Call) -> list[np.ndarray]:
    hashes, data, weight, kind = call.ins
    kind = kind.value
    if kind not in (_SPARSE_DEPRECATED, _DENSE, _SPARSE):
        raise call.fail(f"unknown projection type {kind}")
    num_hash, num_bits = hashes.value.shape
    rows = data.value.shape[0]
    # Each seed is hashed as its float32 bytes followed by the raw bytes of one
    # input row (NNAPI converts float16 seeds to float first).
    seeds = hashes.value.astype(np.float32).reshape(-1, 1).view(np.uint8)       # (S, 4)
    row_bytes = np.ascontiguousarray(data.value).reshape(rows, -1).view(np.uint8)  # (R, B)
    keys = np.concatenate([np.repeat(seeds, rows, axis=0),
                           np.tile(row_bytes, (seeds.shape[0], 1))], axis=1)
    signatures = fingerprint64(keys).view(np.int64).astype(np.float64).reshape(-1, rows)
    if weight.omitted:
        terms = signatures
    else:
        if weight.value.shape[0] != rows:
            raise call.fail(f"{weight.value.shape[0]} weights for {rows} input rows")
        terms = signatures * weight.value.astype(np.float64)
    # Accumulate row by row in double, in order, as the reference does (cumsum is
    # sequential, unlike sum's pairwise summation) so that the sign matches.
    score = np.cumsum(terms, axis=1)[:, -1] if rows else np.zeros(len(terms))
    bits = (score > 0).astype(np.int64).reshape(num_hash, num_bits)
    if kind == _DENSE:
        return [bits.reshape(-1).astype(np.int32)]
    weights_of_bits = np.int64(1) << np.arange(num_bits - 1, -1, -1, dtype=np.int64)
    signature = bits @ weights_of_bits
    if kind == _SPARSE:  # HAL 1.2: each hash function gets its own range of values
        signature = signature + np.arange(num_hash, dtype=np.int64) * (np.int64(1) << num_bits)
    # int32 arithmetic wraps in the reference (32-bit signatures).
    return [(signature & 0xFFFFFFFF).astype(np.uint32).view(np.int32)]


register(OperationType.LSH_PROJECTION, validate=_lsh_validate, shape=_lsh_shape,
         kernel=_lsh_kernel)
