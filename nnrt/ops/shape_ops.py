"""Tensor shape manipulation: CONCATENATION, RESHAPE (HAL 1.0); SQUEEZE,
TRANSPOSE, STRIDED_SLICE, PAD, MEAN (HAL 1.1); EXPAND_DIMS, SLICE, SPLIT,
TILE, PAD_V2 (HAL 1.2); PACK (NNAPI feature level 6); MIRROR_PAD, REVERSE (NNAPI
feature level 7).

Data-movement kernels copy the stored values; a quantized output whose scale
or zero point differs from the input's gets the values requantized (NNAPI
expects them equal, but a temporary declared otherwise would otherwise be
read with the wrong parameters downstream).
"""
from __future__ import annotations

import numpy as np

from ..model.types import HalVersion as V, OperandType as T, OperationType
from .common import (check_quant_params, dequantize, expect_same_quant,
                     multiply_by_quantized_multiplier, qrange, quantize, quantize_multiplier,
                     same_as_input)
from .registry import Arg, Call, OpView, register

# Operand types accepted for the data tensor, with the HAL version that added them.
_SINCE_1_0 = {T.TENSOR_FLOAT32: V.V1_0, T.TENSOR_QUANT8_ASYMM: V.V1_0,
              T.TENSOR_FLOAT16: V.V1_2, T.TENSOR_QUANT8_ASYMM_SIGNED: V.V1_3}
_SINCE_1_1 = {T.TENSOR_FLOAT32: V.V1_1, T.TENSOR_QUANT8_ASYMM: V.V1_1,
              T.TENSOR_FLOAT16: V.V1_2, T.TENSOR_QUANT8_ASYMM_SIGNED: V.V1_3}
_SINCE_1_2 = {T.TENSOR_FLOAT32: V.V1_2, T.TENSOR_QUANT8_ASYMM: V.V1_2,
              T.TENSOR_FLOAT16: V.V1_2, T.TENSOR_INT32: V.V1_2,
              T.TENSOR_QUANT8_ASYMM_SIGNED: V.V1_3}
_PAD_V2_TYPES = {T.TENSOR_FLOAT32: V.V1_2, T.TENSOR_QUANT8_ASYMM: V.V1_2,
                 T.TENSOR_FLOAT16: V.V1_2, T.TENSOR_QUANT8_ASYMM_SIGNED: V.V1_3}


# --- shared helpers ---------------------------------------------------------

def _data_type(op: OpView, versions: dict, i: int = 0) -> tuple[T, V]:
    """Check input ``i``'s type against ``versions``; the output 0 must match."""
    t = op.expect_type_in(i, tuple(versions))
    op.expect_types([], [t] * len(op.outputs))
    check_quant_params(op)
    return t, versions[t]


def _norm_axis(axis: int, rank: int, fail, what: str = "axis") -> int:
    if not -rank <= axis < rank:
        raise fail(f"{what} {axis} out of range for rank {rank}")
    return axis + rank if axis < 0 else axis


def _emit(x: np.ndarray, src: Arg, out) -> np.ndarray:
    """Stored values of ``src``'s type -> a fresh array for output ``out``."""
    if out.type.is_quantized and (src.scale != out.scale or src.zero_point != out.zero_point):
        # float64: exact, so a tie stays a tie when it is requantized.
        real = (x.astype(np.float64) - src.zero_point) * np.float64(np.float32(src.scale))
        return quantize(real, out)
    return np.array(x, dtype=out.type.dtype, copy=True)


def _int_list(value) -> list[int] | None:
    return None if value is None else [int(v) for v in np.asarray(value).ravel()]


def _vector_input(op: OpView, i: int) -> None:
    """Input ``i`` must be a 1-D TENSOR_INT32."""
    op.expect_type_in(i, (T.TENSOR_INT32,))
    op.expect_rank(i, 1)


# --- CONCATENATION -------------------------------------------------------------

def _concat_validate(op: OpView) -> V:
    if len(op.inputs) < 2 or len(op.outputs) != 1:
        raise op.fail("takes n >= 1 tensors, an axis, and one output")
    n = len(op.inputs) - 1
    t, version = _data_type(op, _SINCE_1_0)
    op.expect_types([t] * n + [T.INT32], [t])
    for i in range(n):
        op.expect_rank(i, at_most=4)   # NNAPI: "supported tensor rank: up to 4"
    ranks = {op.rank(i) for i in range(n)} - {None}
    if len(ranks) > 1:
        raise op.fail(f"inputs have different ranks {sorted(ranks)}")
    axis = op.value(n)
    if ranks and axis is not None:
        _norm_axis(axis, ranks.pop(), op.fail)
    if t.is_quantized:
        out = op.outputs[0]
        # Before HAL 1.2 every input had to share the output's scale and zero point.
        if any(o.scale != out.scale or o.zero_point != out.zero_point for o in op.inputs[:n]):
            version = max(version, V.V1_2)
    return version


def _concat_shape(op: OpView) -> list[tuple[int, ...]]:
    n = len(op.inputs) - 1
    dims = [op.dims(i) for i in range(n) if op.rank(i) is not None]
    axis = op.value(n)
    if not dims:
        return [()]
    rank = len(dims[0])
    if axis is None:
        return [(0,) * rank]
    axis = _norm_axis(axis, rank, op.fail)
    out = []
    for d in range(rank):
        if d == axis:
            sizes = [op.dims(i)[d] if op.rank(i) is not None else 0 for i in range(n)]
            out.append(0 if 0 in sizes else sum(sizes))
        else:
            known = {x[d] for x in dims} - {0}
            if len(known) > 1:
                raise op.fail(f"inputs disagree on dimension {d}: {sorted(known)}")
            out.append(known.pop() if known else 0)
    return [tuple(out)]


def _concat_kernel(call: Call) -> list[np.ndarray]:
    tensors, axis = call.ins[:-1], call.ins[-1].value
    out = call.outs[0]
    rank = tensors[0].value.ndim
    axis = _norm_axis(axis, rank, call.fail)
    for a in tensors[1:]:
        s, t = a.value.shape, tensors[0].value.shape
        if a.value.ndim != rank or s[:axis] + s[axis + 1:] != t[:axis] + t[axis + 1:]:
            raise call.fail(f"input shapes {t} and {s} do not match off axis {axis}")
    parts = [_emit(a.value, a, out) for a in tensors]
    return [np.concatenate(parts, axis=axis)]


register(OperationType.CONCATENATION, validate=_concat_validate, shape=_concat_shape,
         kernel=_concat_kernel)


# --- PACK (feature level 6) ---------------------------------------------------
# Input 0 is the axis, inputs 1..N the tensors: N tensors of rank R become one
# of rank R + 1, the new dimension (of size N) at the axis. NNAPI's valid axes
# are [0, R] — no negative axis, unlike TFLite's PACK — and every input has
# the output's type, shape and (quantized) scale and zero point.

_PACK_TYPES = dict.fromkeys((T.TENSOR_FLOAT32, T.TENSOR_FLOAT16, T.TENSOR_QUANT8_ASYMM,
                             T.TENSOR_QUANT8_ASYMM_SIGNED, T.TENSOR_INT32), V.FL6)


def _pack_axis(axis: int, rank: int, fail) -> int:
    if not 0 <= axis <= rank:
        raise fail(f"input 0: axis {axis} is outside [0, {rank}] for inputs of rank {rank}")
    return axis


def _pack_validate(op: OpView) -> V:
    if len(op.inputs) < 2 or len(op.outputs) != 1:
        raise op.fail(f"takes an axis and n >= 1 tensors, and one output; got "
                      f"{len(op.inputs)} inputs and {len(op.outputs)} outputs")
    op.expect_types([T.INT32], [])
    out = op.outputs[0]
    if out.type not in _PACK_TYPES:
        raise op.fail(f"output 0 (operand {op.operation.outputs[0]}) has type {out.type.name}; "
                      f"accepted: {', '.join(t.name for t in _PACK_TYPES)}")
    n = len(op.inputs) - 1
    op.expect_types([None] + [out.type] * n, [])
    check_quant_params(op)
    if out.type.is_quantized:
        for i in range(1, n + 1):
            a = op.inputs[i]
            if a.scale != out.scale or a.zero_point != out.zero_point:
                raise op.fail(f"input {i} (operand {op.operation.inputs[i]}) has scale {a.scale} "
                              f"and zero point {a.zero_point}, output 0 {out.scale} and "
                              f"{out.zero_point}: PACK keeps them")
    ranks = {op.rank(i) for i in range(1, n + 1)} - {None}
    out_rank = len(op.outputs[0].dimensions) or None
    if out_rank is not None:
        ranks.add(out_rank - 1)
    if len(ranks) > 1:
        raise op.fail(f"inputs of ranks {sorted(ranks)} (each must be the output's rank - 1)")
    if ranks:
        rank = ranks.pop()
        if rank < 1:
            raise op.fail("inputs must have rank 1 at least")
        axis = op.value(0)
        if axis is not None:
            _pack_axis(int(axis), rank, op.fail)
        _pack_input_dims(op)
    return V.FL6


def _pack_input_dims(op: OpView) -> tuple[int, ...]:
    """The inputs' common dimensions (0 = unknown); they must agree."""
    dims = [op.dims(i) for i in range(1, len(op.inputs)) if op.rank(i) is not None]
    common = []
    for d in range(len(dims[0]) if dims else 0):
        known = {x[d] for x in dims} - {0}
        if len(known) > 1:
            raise op.fail(f"inputs disagree on dimension {d}: {sorted(known)}")
        common.append(known.pop() if known else 0)
    return tuple(common)


def _pack_shape(op: OpView) -> list[tuple[int, ...]]:
    n = len(op.inputs) - 1
    if all(op.rank(i) is None for i in range(1, n + 1)):
        out = op.outputs[0].dimensions
        return [(0,) * len(out) if out else ()]
    dims = _pack_input_dims(op)
    axis = op.value(0)
    if axis is None:
        return [(0,) * (len(dims) + 1)]
    axis = _pack_axis(int(axis), len(dims), op.fail)
    return [dims[:axis] + (n,) + dims[axis:]]


def _pack_kernel(call: Call) -> list[np.ndarray]:
    axis, tensors = call.ins[0].value, call.ins[1:]
    first = tensors[0].value
    axis = _pack_axis(int(axis), first.ndim, call.fail)
    for a in tensors[1:]:
        if a.value.shape != first.shape:
            raise call.fail(f"input shapes {first.shape} and {a.value.shape} differ")
    return [np.stack([a.value for a in tensors], axis=axis).astype(call.outs[0].type.dtype,
                                                                     copy=False)]


register(OperationType.PACK, validate=_pack_validate, shape=_pack_shape, kernel=_pack_kernel)


# --- RESHAPE -------------------------------------------------------------------

def _reshape_target(shape: list[int], in_dims, fail) -> tuple[int, ...]:
    """Resolve the one allowed -1 of a RESHAPE target; in_dims may hold 0 (unknown)."""
    if shape.count(-1) > 1:
        raise fail("the shape tensor may hold at most one -1")
    if any(s < -1 or s == 0 for s in shape):
        raise fail(f"invalid target shape {shape}")
    if -1 not in shape:
        return tuple(shape)
    if in_dims is None or 0 in in_dims:
        return tuple(0 if s == -1 else s for s in shape)
    total = int(np.prod(in_dims, dtype=np.int64))
    rest = int(np.prod([s for s in shape if s != -1], dtype=np.int64))
    if total % rest:
        raise fail(f"cannot reshape {tuple(in_dims)} to {shape}")
    return tuple(total // rest if s == -1 else s for s in shape)


def _reshape_validate(op: OpView) -> V:
    op.expect_counts(2, 1)
    _, version = _data_type(op, _SINCE_1_0)
    _vector_input(op, 1)
    op.expect_rank(0, at_most=4)
    shape = _int_list(op.value(1))
    if shape is not None:
        if len(shape) > 4:
            raise op.fail(f"output rank {len(shape)} exceeds 4")
        _reshape_target(shape, None, op.fail)
    return version


def _reshape_shape(op: OpView) -> list[tuple[int, ...]]:
    shape = _int_list(op.value(1))
    in_dims = op.dims(0) if op.rank(0) is not None else None
    if shape is not None:
        out = _reshape_target(shape, in_dims, op.fail)
        if in_dims and 0 not in in_dims and 0 not in out and \
                np.prod(in_dims, dtype=np.int64) != np.prod(out, dtype=np.int64):
            raise op.fail(f"cannot reshape {tuple(in_dims)} to {shape}")
        return [out]
    length = op.dims(1)[0] if op.rank(1) == 1 else 0
    return [(0,) * length if length else ()]


def _reshape_kernel(call: Call) -> list[np.ndarray]:
    x, shape = call.ins
    target = _reshape_target(_int_list(shape.value), x.value.shape, call.fail)
    if int(np.prod(target, dtype=np.int64)) != x.value.size:
        raise call.fail(f"cannot reshape {x.value.shape} to {list(shape.value)}")
    return [_emit(x.value.reshape(target), x, call.outs[0])]


register(OperationType.RESHAPE, validate=_reshape_validate, shape=_reshape_shape,
         kernel=_reshape_kernel)


# --- SQUEEZE -------------------------------------------------------------------

def _squeeze_axes(axes: list[int] | None, dims, fail) -> set[int]:
    rank = len(dims)
    if not axes:  # omitted or empty: every extent-1 dimension
        return {d for d in range(rank) if dims[d] == 1}
    chosen = {_norm_axis(a, rank, fail, "squeeze axis") for a in axes}
    for a in chosen:
        if dims[a] not in (0, 1):
            raise fail(f"cannot squeeze dimension {a} of extent {dims[a]}")
    return chosen


def _squeeze_validate(op: OpView) -> V:
    op.expect_counts(2, 1)
    _, version = _data_type(op, _SINCE_1_1)
    op.expect_rank(0, at_most=4)
    if not op.is_omitted(1):
        _vector_input(op, 1)
    return version


def _squeeze_shape(op: OpView) -> list[tuple[int, ...]]:
    if op.rank(0) is None:
        return [()]
    dims = op.dims(0)
    axes = [] if op.is_omitted(1) else _int_list(op.value(1))
    if axes is None or (not axes and 0 in dims):
        return [()]
    drop = _squeeze_axes(axes, dims, op.fail)
    return [tuple(d for i, d in enumerate(dims) if i not in drop) or (1,)]


def _squeeze_kernel(call: Call) -> list[np.ndarray]:
    x, axes = call.ins
    drop = _squeeze_axes(_int_list(axes.value), x.value.shape, call.fail)
    squeezed = np.squeeze(x.value, axis=tuple(sorted(drop)))
    # Squeezing every dimension gives shape [1], not a scalar (b/155238914).
    return [_emit(squeezed.reshape(squeezed.shape or (1,)), x, call.outs[0])]


register(OperationType.SQUEEZE, validate=_squeeze_validate, shape=_squeeze_shape,
         kernel=_squeeze_kernel)


# --- TRANSPOSE -----------------------------------------------------------------

def _check_perm(perm: list[int], rank: int, fail) -> None:
    if sorted(perm) != list(range(rank)):
        raise fail(f"{perm} is not a permutation of {rank} dimensions")


def _transpose_validate(op: OpView) -> V:
    op.expect_counts(2, 1)
    _, version = _data_type(op, _SINCE_1_1)
    op.expect_rank(0, at_most=4)
    if not op.is_omitted(1):
        _vector_input(op, 1)
        perm = _int_list(op.value(1))
        if perm is not None and op.rank(0) is not None:
            _check_perm(perm, op.rank(0), op.fail)
    return version


def _transpose_shape(op: OpView) -> list[tuple[int, ...]]:
    if op.rank(0) is None:
        return [()]
    dims = op.dims(0)
    if op.is_omitted(1):
        return [tuple(reversed(dims))]
    perm = _int_list(op.value(1))
    if perm is None:
        return [(0,) * len(dims)]
    return [tuple(dims[p] for p in perm)]


def _transpose_kernel(call: Call) -> list[np.ndarray]:
    x, perm = call.ins
    axes = None
    if not perm.omitted:
        axes = _int_list(perm.value)
        _check_perm(axes, x.value.ndim, call.fail)
    return [_emit(np.transpose(x.value, axes), x, call.outs[0])]


register(OperationType.TRANSPOSE, validate=_transpose_validate, shape=_transpose_shape,
         kernel=_transpose_kernel)


# --- STRIDED_SLICE ---------------------------------------------------------------

def _clamped_index(index: int, dim: int, positive_stride: bool) -> int:
    """NNAPI's clamping of a begin/end index: negative counts from the end, then
    the index is clamped to [0, dim] (positive stride) or [-1, dim-1] (negative)."""
    if positive_stride:
        if index >= dim:
            return dim
        return min(max(index, -dim), dim) % dim if dim else 0
    if index < -dim:
        return -1
    return min(max(index, -dim), dim - 1) % dim if dim else -1


def _strided_ranges(dims, begin, end, strides, begin_mask, end_mask, shrink_mask, fail):
    """Per dimension (start, stride, count) and the output dims (shrunk ones dropped)."""
    rank = len(dims)
    ranges, out_dims = [], []
    for d in range(rank):
        dim, stride = dims[d], strides[d]
        if stride == 0:
            raise fail(f"stride of dimension {d} is zero")
        pos = stride > 0
        b = (0 if pos else dim - 1) if begin_mask >> d & 1 else _clamped_index(begin[d], dim, pos)
        e = (dim if pos else -1) if end_mask >> d & 1 else _clamped_index(end[d], dim, pos)
        count = max(-(-(e - b) // stride), 0)  # ceil((e - b) / stride), at least 0
        if shrink_mask >> d & 1:
            # A shrunk dimension indexes one element, and only with a positive stride.
            if not pos:
                raise fail(f"dimension {d} is shrunk but has negative stride {stride}")
            if count != 1:
                raise fail(f"dimension {d} is shrunk but its slice has {count} elements")
        else:
            out_dims.append(count)
        ranges.append((b, stride, count))
    # Shrinking every dimension gives shape [1], not a scalar (b/155662254).
    return ranges, tuple(out_dims) or (1,)


def _strided_params(op: OpView):
    vals = [_int_list(op.value(i)) for i in (1, 2, 3)] + [op.value(i) for i in (4, 5, 6)]
    return None if any(v is None for v in vals) else vals


def _strided_validate(op: OpView) -> V:
    op.expect_counts(7, 1)
    _, version = _data_type(op, _SINCE_1_1)
    op.expect_types([None, T.TENSOR_INT32, T.TENSOR_INT32, T.TENSOR_INT32,
                     T.INT32, T.INT32, T.INT32], [])
    op.expect_rank(0, at_most=4)
    rank = op.rank(0)
    for i in (1, 2, 3):
        op.expect_rank(i, 1)
        if rank is not None and op.dims(i) and op.dims(i)[0] not in (0, rank):
            raise op.fail(f"input {i} must have {rank} entries, got {op.dims(i)[0]}")
    params = _strided_params(op)
    if params is not None and rank is not None and 0 not in op.dims(0):
        _strided_ranges(op.dims(0), *params, op.fail)
    return version


def _strided_shape(op: OpView) -> list[tuple[int, ...]]:
    rank = op.rank(0)
    if rank is None:
        return [()]
    params = _strided_params(op)
    shrink = op.value(6)
    if params is None or 0 in op.dims(0):
        if shrink is None:
            return [()]
        return [(0,) * max(rank - bin(shrink & ((1 << rank) - 1)).count("1"), 1)]
    return [_strided_ranges(op.dims(0), *params, op.fail)[1]]


def _strided_kernel(call: Call) -> list[np.ndarray]:
    x = call.ins[0]
    params = [_int_list(a.value) for a in call.ins[1:4]] + [a.value for a in call.ins[4:]]
    if any(len(p) != x.value.ndim for p in params[:3]):
        raise call.fail("begin, end and strides must have one entry per input dimension")
    ranges, out_dims = _strided_ranges(x.value.shape, *params, call.fail)
    index = np.ix_(*[b + s * np.arange(n) for b, s, n in ranges])
    return [_emit(x.value[index].reshape(out_dims), x, call.outs[0])]


register(OperationType.STRIDED_SLICE, validate=_strided_validate, shape=_strided_shape,
         kernel=_strided_kernel)


# --- PAD, PAD_V2 ---------------------------------------------------------------

def _check_paddings(pads: np.ndarray, rank: int, fail) -> np.ndarray:
    pads = np.asarray(pads).reshape(-1)
    if pads.size != 2 * rank:
        raise fail(f"paddings must have shape [{rank}, 2]")
    pads = pads.reshape(rank, 2)
    if (pads < 0).any():
        raise fail("paddings must be non-negative")
    return pads


def _paddings_input(op: OpView) -> np.ndarray | None:
    """Input 1 is a [rank, 2] TENSOR_INT32 of non-negative paddings; its
    value as a [rank, 2] array when constant and the rank is known."""
    op.expect_type_in(1, (T.TENSOR_INT32,))
    op.expect_rank(1, 2)
    rank = op.rank(0)
    pdims = op.dims(1)
    if len(pdims) == 2:
        if pdims[1] not in (0, 2) or (rank is not None and pdims[0] not in (0, rank)):
            raise op.fail(f"paddings must have shape [{rank}, 2], got {list(pdims)}")
    pads = op.value(1)
    if pads is None or rank is None:
        return None
    return _check_paddings(pads, rank, op.fail)


def _pad_validate_common(op: OpView, versions: dict) -> V:
    t, version = _data_type(op, versions)
    op.expect_rank(0, at_most=4)
    _paddings_input(op)
    return version


def _pad_validate(op: OpView) -> V:
    op.expect_counts(2, 1)
    version = _pad_validate_common(op, _SINCE_1_1)
    # Rank < 4 came with HAL 1.2 (the 1.1 reference only padded 4-D tensors), and
    # so did padding quant8 with its logical zero when the zero point is not 0.
    if op.rank(0) not in (None, 4) or op.inputs[0].zero_point != 0:
        version = max(version, V.V1_2)
    return version


_PAD_VALUE_TYPE = {T.TENSOR_FLOAT32: T.FLOAT32, T.TENSOR_FLOAT16: T.FLOAT16,
                   T.TENSOR_QUANT8_ASYMM: T.INT32, T.TENSOR_QUANT8_ASYMM_SIGNED: T.INT32}


def _pad_v2_validate(op: OpView) -> V:
    op.expect_counts(3, 1)
    version = _pad_validate_common(op, _PAD_V2_TYPES)
    op.expect_types([None, None, _PAD_VALUE_TYPE[op.inputs[0].type]], [])
    return version


def _pad_shape(op: OpView) -> list[tuple[int, ...]]:
    if op.rank(0) is None:
        return [()]
    dims = op.dims(0)
    pads = op.value(1)
    if pads is None:
        return [(0,) * len(dims)]
    pads = _check_paddings(pads, len(dims), op.fail)
    return [tuple(d and d + int(p.sum()) for d, p in zip(dims, pads))]


def _pad_kernel(call: Call) -> list[np.ndarray]:
    x, pads = call.ins[:2]
    out = call.outs[0]
    pads = _check_paddings(pads.value, x.value.ndim, call.fail)
    if len(call.ins) == 3:  # PAD_V2: the pad value is given (quantized for quant8)
        fill = call.ins[2].value
        if x.type.is_quantized:
            lo, hi = qrange(x.type)
            if not lo <= fill <= hi:
                raise call.fail(f"pad value {fill} outside the range of {x.type.name}")
    else:  # PAD: the logical zero
        fill = x.zero_point if x.type.is_quantized else 0
    padded = np.pad(x.value, [tuple(p) for p in pads], mode="constant",
                    constant_values=np.array(fill).astype(x.value.dtype))
    return [_emit(padded, x, out)]


register(OperationType.PAD, validate=_pad_validate, shape=_pad_shape, kernel=_pad_kernel)
register(OperationType.PAD_V2, validate=_pad_v2_validate, shape=_pad_shape, kernel=_pad_kernel)


# --- MIRROR_PAD ------------------------------------------------------------------

_FL7_TYPES = dict.fromkeys((T.TENSOR_FLOAT32, T.TENSOR_FLOAT16, T.TENSOR_QUANT8_ASYMM,
                            T.TENSOR_QUANT8_ASYMM_SIGNED, T.TENSOR_INT32), V.FL7)
_MIRROR_MODES = {0: "REFLECT", 1: "SYMMETRIC"}   # NeuralNetworks.h's mode codes


def _check_mirror_paddings(pads: np.ndarray, dims, mode: int, fail) -> None:
    """REFLECT leaves the border out of the mirror, so it can pad at most
    dim - 1 elements on a side; SYMMETRIC repeats the border: at most dim."""
    if mode not in _MIRROR_MODES:
        raise fail(f"input 2: mode {mode} is neither 0 (REFLECT) nor 1 (SYMMETRIC)")
    for axis, (d, (before, after)) in enumerate(zip(dims, pads)):
        limit = d - 1 if mode == 0 else d
        if d and max(before, after) > limit:
            raise fail(f"input 1: paddings {[int(before), int(after)]} of dimension {axis} "
                       f"(size {d}) exceed {limit}, the most {_MIRROR_MODES[mode]} mode can pad")


def _mirror_pad_validate(op: OpView) -> V:
    op.expect_counts(3, 1)
    _, version = _data_type(op, _FL7_TYPES)
    expect_same_quant(op)
    op.expect_types([None, None, T.INT32], [])
    pads = _paddings_input(op)
    out_rank = len(op.outputs[0].dimensions)
    if op.rank(0) is not None and out_rank and out_rank != op.rank(0):
        raise op.fail(f"output 0 (operand {op.operation.outputs[0]}) has rank {out_rank}; "
                      f"the input has rank {op.rank(0)}")
    mode = op.value(2)
    if mode is not None and int(mode) not in _MIRROR_MODES:
        raise op.fail(f"input 2 (operand {op.operation.inputs[2]}) mode {int(mode)} is "
                      f"neither 0 (REFLECT) nor 1 (SYMMETRIC)")
    if mode is not None and pads is not None:
        _check_mirror_paddings(pads, op.dims(0), int(mode), op.fail)
    return version


def _mirror_indices(size: int, before: int, after: int, mode: int) -> np.ndarray:
    """For each output position along one axis, the input position it copies."""
    i = np.arange(-before, size + after)
    edge = 0 if mode == 0 else 1   # SYMMETRIC mirrors about the border element's outer edge
    i = np.where(i < 0, -i - edge, i)
    return np.where(i >= size, 2 * size - 2 + edge - i, i)


def _mirror_pad_kernel(call: Call) -> list[np.ndarray]:
    x, pads, mode = call.ins
    pads = _check_paddings(pads.value, x.value.ndim, call.fail)
    _check_mirror_paddings(pads, x.value.shape, int(mode.value), call.fail)
    y = x.value
    for axis, (before, after) in enumerate(pads):
        y = np.take(y, _mirror_indices(y.shape[axis], int(before), int(after), int(mode.value)),
                    axis=axis)
    return [_emit(y, x, call.outs[0])]


register(OperationType.MIRROR_PAD, validate=_mirror_pad_validate, shape=_pad_shape,
         kernel=_mirror_pad_kernel)


# --- EXPAND_DIMS -----------------------------------------------------------------

def _expand_validate(op: OpView) -> V:
    op.expect_counts(2, 1)
    _, version = _data_type(op, _SINCE_1_2)
    op.expect_types([None, T.INT32], [])
    axis, rank = op.value(1), op.rank(0)
    if axis is not None and rank is not None:
        _norm_axis(axis, rank + 1, op.fail)
    return version


def _expand_shape(op: OpView) -> list[tuple[int, ...]]:
    rank = op.rank(0)
    if rank is None:
        return [()]
    axis = op.value(1)
    if axis is None:
        return [(0,) * (rank + 1)]
    axis = _norm_axis(axis, rank + 1, op.fail)
    dims = op.dims(0)
    return [dims[:axis] + (1,) + dims[axis:]]


def _expand_kernel(call: Call) -> list[np.ndarray]:
    x, axis = call.ins
    axis = _norm_axis(axis.value, x.value.ndim + 1, call.fail)
    return [_emit(np.expand_dims(x.value, axis), x, call.outs[0])]


register(OperationType.EXPAND_DIMS, validate=_expand_validate, shape=_expand_shape,
         kernel=_expand_kernel)


# --- SLICE ---------------------------------------------------------------------

def _slice_bounds(dims, begin, size, fail) -> list[tuple[int, int]]:
    bounds = []
    for d, (dim, b, s) in enumerate(zip(dims, begin, size)):
        if s == -1:
            s = dim - b
        if b < 0 or s < 0 or b + s > dim:
            raise fail(f"slice [{b}, {b}+{s}) out of range for dimension {d} of extent {dim}")
        bounds.append((b, b + s))
    return bounds


def _slice_validate(op: OpView) -> V:
    op.expect_counts(3, 1)
    _, version = _data_type(op, _SINCE_1_2)
    rank = op.rank(0)
    for i in (1, 2):
        _vector_input(op, i)
        if rank is not None and op.dims(i) and op.dims(i)[0] not in (0, rank):
            raise op.fail(f"input {i} must have {rank} entries")
    return version


def _slice_shape(op: OpView) -> list[tuple[int, ...]]:
    rank = op.rank(0)
    if rank is None:
        return [()]
    dims = op.dims(0)
    begin, size = _int_list(op.value(1)), _int_list(op.value(2))
    if size is None:
        return [(0,) * rank]
    out = []
    for d in range(rank):
        if size[d] != -1:
            out.append(size[d])
        elif begin is not None and dims[d]:
            out.append(dims[d] - begin[d])
        else:
            out.append(0)
    if begin is not None and 0 not in dims:
        _slice_bounds(dims, begin, size, op.fail)
    return [tuple(out)]


def _slice_kernel(call: Call) -> list[np.ndarray]:
    x, begin, size = call.ins
    begin, size = _int_list(begin.value), _int_list(size.value)
    if len(begin) != x.value.ndim or len(size) != x.value.ndim:
        raise call.fail("begin and size must have one entry per input dimension")
    bounds = _slice_bounds(x.value.shape, begin, size, call.fail)
    return [_emit(x.value[tuple(slice(b, e) for b, e in bounds)], x, call.outs[0])]


register(OperationType.SLICE, validate=_slice_validate, shape=_slice_shape, kernel=_slice_kernel)


# --- SPLIT ---------------------------------------------------------------------

def _split_validate(op: OpView) -> V:
    if len(op.inputs) != 3 or not op.outputs:
        raise op.fail("takes 3 inputs and at least one output")
    t, version = _data_type(op, _SINCE_1_2)
    op.expect_types([None, T.INT32, T.INT32], [t] * len(op.outputs))
    count, axis, rank = op.value(2), op.value(1), op.rank(0)
    if count is not None and count != len(op.outputs):
        raise op.fail(f"num_splits {count} but {len(op.outputs)} outputs")
    if axis is not None and rank is not None:
        axis = _norm_axis(axis, rank, op.fail)
        extent = op.dims(0)[axis]
        if extent and extent % len(op.outputs):
            raise op.fail(f"dimension {axis} of extent {extent} does not split in "
                          f"{len(op.outputs)}")
    return version


def _split_shape(op: OpView) -> list[tuple[int, ...]]:
    rank, axis, n = op.rank(0), op.value(1), len(op.outputs)
    if rank is None:
        return [()] * n
    if axis is None:
        return [(0,) * rank] * n
    axis = _norm_axis(axis, rank, op.fail)
    dims = list(op.dims(0))
    dims[axis] //= n
    return [tuple(dims)] * n


def _split_kernel(call: Call) -> list[np.ndarray]:
    x, axis, count = call.ins
    axis = _norm_axis(axis.value, x.value.ndim, call.fail)
    n = len(call.outs)
    if count.value != n or x.value.shape[axis] % n:
        raise call.fail(f"cannot split extent {x.value.shape[axis]} in {count.value}")
    parts = np.split(x.value, n, axis=axis)
    return [_emit(p, x, o) for p, o in zip(parts, call.outs)]


register(OperationType.SPLIT, validate=_split_validate, shape=_split_shape, kernel=_split_kernel)


# --- TILE ----------------------------------------------------------------------

def _tile_validate(op: OpView) -> V:
    op.expect_counts(2, 1)
    _, version = _data_type(op, _SINCE_1_2)
    _vector_input(op, 1)
    rank = op.rank(0)
    if rank is not None and op.dims(1) and op.dims(1)[0] not in (0, rank):
        raise op.fail(f"multiples must have {rank} entries")
    return version


def _tile_shape(op: OpView) -> list[tuple[int, ...]]:
    rank = op.rank(0)
    if rank is None:
        return [()]
    mult = _int_list(op.value(1))
    if mult is None:
        return [(0,) * rank]
    return [tuple(d * m for d, m in zip(op.dims(0), mult))]


def _tile_kernel(call: Call) -> list[np.ndarray]:
    x, mult = call.ins
    mult = _int_list(mult.value)
    if len(mult) != x.value.ndim or any(m < 0 for m in mult):
        raise call.fail(f"invalid multiples {mult} for rank {x.value.ndim}")
    return [_emit(np.tile(x.value, mult), x, call.outs[0])]


register(OperationType.TILE, validate=_tile_validate, shape=_tile_shape, kernel=_tile_kernel)


# --- REVERSE ---------------------------------------------------------------------

def _reverse_validate(op: OpView) -> V:
    op.expect_counts(2, 1)
    _, version = _data_type(op, _FL7_TYPES)
    expect_same_quant(op)
    op.expect_rank(0, at_most=8)
    _vector_input(op, 1)
    if op.dims(1) and op.dims(1)[0] not in (0, 1):
        raise op.fail(f"input 1 (operand {op.operation.inputs[1]}) must hold exactly one axis, "
                      f"got shape {list(op.dims(1))}")
    rank = op.rank(0)
    out_rank = len(op.outputs[0].dimensions)
    if rank is not None and out_rank and out_rank != rank:
        raise op.fail(f"output 0 (operand {op.operation.outputs[0]}) has rank {out_rank}; "
                      f"the input has rank {rank}")
    axis = _int_list(op.value(1))
    if axis is not None and rank is not None:
        _reverse_axis(axis, rank, op.fail)
    return version


def _reverse_axis(axis: list[int], rank: int, fail) -> int:
    # NNAPI takes no negative axis here (unlike most axis operands): [0, rank).
    if len(axis) != 1 or not 0 <= axis[0] < rank:
        raise fail(f"input 1: axis {axis} must be one dimension in [0, {rank})")
    return axis[0]


def _reverse_kernel(call: Call) -> list[np.ndarray]:
    x, axis = call.ins
    k = _reverse_axis(_int_list(axis.value), x.value.ndim, call.fail)
    backwards = tuple(slice(None, None, -1) if d == k else slice(None) for d in range(x.value.ndim))
    return [_emit(x.value[backwards], x, call.outs[0])]


register(OperationType.REVERSE, validate=_reverse_validate, shape=same_as_input(0),
         kernel=_reverse_kernel)


# --- MEAN ----------------------------------------------------------------------
# (REDUCE_* live in reduce.py; MEAN is the HAL 1.1 average with an INT32 keep_dims.)

def _mean_axes(axes: list[int], rank: int, fail) -> tuple[int, ...]:
    return tuple(sorted({_norm_axis(a, rank, fail) for a in axes}))


def _mean_dims(dims, axes: tuple[int, ...], keep: bool) -> tuple[int, ...]:
    if keep:
        return tuple(1 if d in axes else x for d, x in enumerate(dims))
    out = tuple(x for d, x in enumerate(dims) if d not in axes)
    # NNAPI has no rank-0 result here: reducing every dimension gives shape [1]
    # (the fix for b/155508675).
    return out or (1,)


def _mean_validate(op: OpView) -> V:
    op.expect_counts(3, 1)
    _, version = _data_type(op, _SINCE_1_1)
    _vector_input(op, 1)
    op.expect_types([None, None, T.INT32], [])
    op.expect_rank(0, at_most=4)
    axes, rank = _int_list(op.value(1)), op.rank(0)
    if axes is not None and rank is not None:
        _mean_axes(axes, rank, op.fail)
    return version


def _mean_shape(op: OpView) -> list[tuple[int, ...]]:
    rank, axes, keep = op.rank(0), _int_list(op.value(1)), op.value(2)
    if rank is None or keep is None:
        return [()]
    if axes is None:
        return [(0,) * rank] if keep > 0 else [()]
    return [_mean_dims(op.dims(0), _mean_axes(axes, rank, op.fail), keep > 0)]


def _mean_kernel(call: Call) -> list[np.ndarray]:
    x, axes, keep = call.ins
    out = call.outs[0]
    axes = _mean_axes(_int_list(axes.value), x.value.ndim, call.fail)
    keep = keep.value > 0  # keep_dims is an INT32: positive means keep
    if x.type.is_quantized:
        return [_quantized_mean(x, out, axes, keep)]
    mean = dequantize(x).mean(axis=axes, keepdims=keep, dtype=np.float64)
    mean = np.asarray(mean).reshape(_mean_dims(x.value.shape, axes, keep))
    return [mean.astype(out.type.dtype)]


def _quantized_mean(x, out, axes: tuple[int, ...], keep: bool) -> np.ndarray:
    """The mean as TFLite's reference kernel (QuantizedMeanOrSum) computes
    it, in integers: an exact sum of ``q - zero_point``, times the fixed-point
    multiplier of input_scale / output_scale with 1/count folded in. An exact
    mean of 18.5 gives 19, where a float32 dequantize first would make it
    18.4999998 and round it to 18."""
    count = int(np.prod([x.value.shape[a] for a in axes]))
    total = (x.value.astype(np.int64) - x.zero_point).sum(axis=axes, keepdims=keep)
    total = np.asarray(total).reshape(_mean_dims(x.value.shape, axes, keep))
    multiplier, shift = quantize_multiplier(
        float(np.float64(np.float32(x.scale)) / np.float64(np.float32(out.scale))))
    # Fold 1/count into the multiplier as TFLite does (shift bounded so the
    # multiplier stays in 32 bits).
    extra = min(count.bit_length() - 1, 32, 31 + shift)
    multiplier = (multiplier << extra) // count
    q = multiply_by_quantized_multiplier(total, multiplier, shift - extra)
    lo, hi = qrange(out.type)
    return np.clip(q + out.zero_point, lo, hi).astype(out.type.dtype)


register(OperationType.MEAN, validate=_mean_validate, shape=_mean_shape, kernel=_mean_kernel)
