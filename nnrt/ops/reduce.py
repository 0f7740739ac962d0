"""Reductions (HAL 1.2; quant8-signed forms in 1.3).

* REDUCE_ALL, REDUCE_ANY, REDUCE_MAX, REDUCE_MIN, REDUCE_PROD, REDUCE_SUM
  reduce over a list of axes.
* ARGMAX, ARGMIN give the index of the extreme along one axis (first on ties).
* TOPK_V2 gives the k largest values along the last axis and their indices.

REDUCE_* inputs: the tensor (rank <= 4), a 1-D TENSOR_INT32 of axes (negative values
count from the end, repeats allowed) and a BOOL keep_dims. When every axis is
reduced without keep_dims the output has shape [1], not a scalar (NNAPI's
fix for b/155508675)."""
from __future__ import annotations

import numpy as np

from ..model.types import HalVersion, OperandType as T, OperationType
from .arithmetic import requantize
from .common import check_quant_params
from .registry import Arg, Call, OpView, register

_FLOATS = {T.TENSOR_FLOAT32: HalVersion.V1_2, T.TENSOR_FLOAT16: HalVersion.V1_2}
_ORDERED = {**_FLOATS, T.TENSOR_QUANT8_ASYMM: HalVersion.V1_2,
            T.TENSOR_QUANT8_ASYMM_SIGNED: HalVersion.V1_3}
_BOOLS = {T.TENSOR_BOOL8: HalVersion.V1_2}


def _validator(types: dict):
    def validate(op: OpView) -> HalVersion:
        op.expect_counts(3, 1)
        t = op.expect_type_in(0, tuple(types))
        op.expect_types([t, T.TENSOR_INT32, T.BOOL], [t])
        op.expect_rank(0, at_most=4)
        op.expect_rank(1, 1)
        check_quant_params(op)
        rank, axes = op.rank(0), op.value(1)
        if rank is not None and axes is not None and _reduced_axes(axes, rank) is None:
            raise op.fail(f"axes {np.asarray(axes).tolist()} out of range for input 0 of rank {rank}")
        return types[t]
    return validate


def _reduced_axes(axes, rank: int) -> set[int] | None:
    """Normalised axes, or None when one is out of range."""
    out = set()
    for a in np.asarray(axes).ravel().tolist():
        if not -rank <= a < rank:
            return None
        out.add(a % rank)
    return out


def _out_dims(dims, axes: set[int], keep: bool) -> tuple[int, ...]:
    kept = tuple(1 if i in axes else d for i, d in enumerate(dims) if keep or i not in axes)
    return kept or (1,)


def _shape(op: OpView) -> list[tuple[int, ...]]:
    rank, axes, keep = op.rank(0), op.value(1), op.value(2)
    if rank is None or keep is None:
        return [()]
    if axes is None:
        return [(0,) * rank] if keep else [()]
    reduced = _reduced_axes(axes, rank)
    if reduced is None:
        raise op.fail(f"axes {np.asarray(axes).tolist()} out of range for input 0 of rank {rank}")
    return [_out_dims(op.dims(0), reduced, bool(keep))]


def _kernel(reduce_fn):
    def kernel(call: Call) -> list[np.ndarray]:
        x, axes, keep = call.ins
        out = call.outs[0]
        data = x.value
        reduced = _reduced_axes(axes.value, data.ndim)
        if reduced is None:
            raise call.fail(f"axes {np.asarray(axes.value).tolist()} out of range for rank {data.ndim}")
        shape = _out_dims(data.shape, reduced, bool(keep.value))
        if data.size == 0:
            # NNAPI does not allow zero-sized inputs here (no identity for MAX/MIN).
            raise call.fail("zero-sized input")
        where = tuple(sorted(reduced))
        if x.type.is_quantized:
            # MAX/MIN pick an element: with equal quantization the raw value is exact;
            # otherwise requantize it to the output's parameters.
            r = np.asarray(reduce_fn(data, axis=where))
            if (x.scale, x.zero_point) != (out.scale, out.zero_point):
                r = requantize(Arg(x.type, r, x.scale, x.zero_point), out)
            return [r.astype(out.type.dtype).reshape(shape)]
        if x.type != T.TENSOR_BOOL8:
            data = data.astype(np.float32)
        return [np.asarray(reduce_fn(data, axis=where)).astype(out.type.dtype).reshape(shape)]
    return kernel


_OPS = (
    (OperationType.REDUCE_ALL, _BOOLS, np.all),
    (OperationType.REDUCE_ANY, _BOOLS, np.any),
    (OperationType.REDUCE_MAX, _ORDERED, np.max),
    (OperationType.REDUCE_MIN, _ORDERED, np.min),
    (OperationType.REDUCE_PROD, _FLOATS, np.prod),
    (OperationType.REDUCE_SUM, _FLOATS, np.sum),
)

for _type, _types, _fn in _OPS:
    register(_type, validate=_validator(_types), shape=_shape, kernel=_kernel(_fn))


# --- ARGMAX, ARGMIN, TOPK_V2 -----------------------------------------------------

_SORTABLE = {T.TENSOR_FLOAT32: HalVersion.V1_2, T.TENSOR_FLOAT16: HalVersion.V1_2,
             T.TENSOR_INT32: HalVersion.V1_2, T.TENSOR_QUANT8_ASYMM: HalVersion.V1_2,
             T.TENSOR_QUANT8_ASYMM_SIGNED: HalVersion.V1_3}


def _validate_arg(op: OpView) -> HalVersion:
    op.expect_counts(2, 1)
    t = op.expect_type_in(0, tuple(_SORTABLE))
    op.expect_types([t, T.INT32], [T.TENSOR_INT32])
    check_quant_params(op)
    rank, axis = op.rank(0), op.value(1)
    if rank == 0:
        raise op.fail("input 0 must have rank >= 1")
    if rank is not None and axis is not None and not -rank <= axis < rank:
        raise op.fail(f"axis {axis} out of range for input 0 of rank {rank}")
    return _SORTABLE[t]


def _shape_arg(op: OpView) -> list[tuple[int, ...]]:
    rank, axis = op.rank(0), op.value(1)
    if rank is None:
        return [()]
    if rank == 1:
        return [(1,)]
    if axis is None:
        return [(0,) * (rank - 1)]
    dims = op.dims(0)
    # A rank-1 input gives [1], not a scalar (b/155660285).
    return [tuple(d for i, d in enumerate(dims) if i != axis % rank) or (1,)]


def _arg_kernel(arg_fn):
    def kernel(call: Call) -> list[np.ndarray]:
        x, axis = call.ins
        data = x.value
        if not -data.ndim <= axis.value < data.ndim:
            raise call.fail(f"axis {axis.value} out of range for rank {data.ndim}")
        if data.shape[axis.value] == 0:
            raise call.fail("cannot take the extreme of an empty axis")
        # numpy's argmax/argmin return the first index among equal extremes, as NNAPI does.
        r = arg_fn(data, axis=axis.value).astype(np.int32)
        return [r.reshape(r.shape or (1,))]
    return kernel


register(OperationType.ARGMAX, validate=_validate_arg, shape=_shape_arg,
         kernel=_arg_kernel(np.argmax))
register(OperationType.ARGMIN, validate=_validate_arg, shape=_shape_arg,
         kernel=_arg_kernel(np.argmin))


def _validate_topk(op: OpView) -> HalVersion:
    op.expect_counts(2, 2)
    t = op.expect_type_in(0, tuple(_SORTABLE))
    op.expect_types([t, T.INT32], [t, T.TENSOR_INT32])
    check_quant_params(op)
    rank, k = op.rank(0), op.value(1)
    if rank == 0:
        raise op.fail("input 0 must have rank >= 1")
    if k is not None:
        last = op.dims(0)[-1] if rank else 0
        if k < 1 or (last and k > last):
            raise op.fail(f"k = {k} out of range for a last dimension of {last or 'unknown'}")
    return _SORTABLE[t]


def _shape_topk(op: OpView) -> list[tuple[int, ...]]:
    if op.rank(0) is None:
        return [(), ()]
    k = op.value(1)
    dims = tuple(op.dims(0)[:-1]) + (k if k is not None else 0,)
    return [dims, dims]


def _topk_kernel(call: Call) -> list[np.ndarray]:
    x, k_arg = call.ins
    values_out = call.outs[0]
    data, k = x.value, k_arg.value
    if not 1 <= k <= data.shape[-1]:
        raise call.fail(f"k = {k} out of range for a last dimension of {data.shape[-1]}")
    # Largest first, equal values by increasing index: a stable ascending sort
    # of the reversed row, read backwards.
    n = data.shape[-1]
    order = np.argsort(data[..., ::-1], axis=-1, kind="stable")[..., ::-1][..., :k]
    indices = (n - 1 - order).astype(np.int32)
    values = np.take_along_axis(data, indices, axis=-1)
    if x.type.is_quantized and (x.scale, x.zero_point) != (values_out.scale, values_out.zero_point):
        values = requantize(Arg(x.type, values, x.scale, x.zero_point), values_out)
    return [values.astype(values_out.type.dtype), indices]


register(OperationType.TOPK_V2, validate=_validate_topk, shape=_shape_topk, kernel=_topk_kernel)
