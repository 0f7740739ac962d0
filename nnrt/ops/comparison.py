"""Comparisons, boolean logic and selection (HAL 1.2).

* EQUAL, NOT_EQUAL, GREATER, GREATER_EQUAL, LESS, LESS_EQUAL: broadcasting,
  TENSOR_BOOL8 result. Quantized inputs are compared by real value, so the two
  inputs may have different scales and zero points.
* LOGICAL_AND, LOGICAL_OR (broadcasting), LOGICAL_NOT on TENSOR_BOOL8.
* SELECT: element-wise choice between two same-shape tensors (no broadcasting).
"""
from __future__ import annotations

import numpy as np

from ..model.types import HalVersion, OperandType as T, OperationType
from .arithmetic import broadcast_shape, requantize
from .common import check_quant_params, dequantize, same_as_input
from .registry import Call, OpView, register

V = HalVersion

_COMPARABLE = {T.TENSOR_BOOL8: V.V1_2, T.TENSOR_FLOAT16: V.V1_2, T.TENSOR_FLOAT32: V.V1_2,
               T.TENSOR_INT32: V.V1_2, T.TENSOR_QUANT8_ASYMM: V.V1_2,
               T.TENSOR_QUANT8_ASYMM_SIGNED: V.V1_3}


def _validate_comparison(op: OpView) -> HalVersion:
    op.expect_counts(2, 1)
    t = op.expect_type_in(0, tuple(_COMPARABLE))
    op.expect_types([t, t], [T.TENSOR_BOOL8])
    check_quant_params(op)
    return _COMPARABLE[t]


def _comparison_kernel(compare):
    def kernel(call: Call) -> list[np.ndarray]:
        a, b = call.ins
        if a.type.is_quantized:
            # Real values in float32, as the reference computes them.
            x, y = dequantize(a), dequantize(b)
        else:
            x, y = a.value, b.value
        return [np.asarray(compare(x, y), dtype=np.bool_)]
    return kernel


_COMPARISONS = {
    OperationType.EQUAL: np.equal,
    OperationType.NOT_EQUAL: np.not_equal,
    OperationType.GREATER: np.greater,
    OperationType.GREATER_EQUAL: np.greater_equal,
    OperationType.LESS: np.less,
    OperationType.LESS_EQUAL: np.less_equal,
}

for _op, _fn in _COMPARISONS.items():
    register(_op, validate=_validate_comparison, shape=broadcast_shape,
             kernel=_comparison_kernel(_fn))


# --- logic -------------------------------------------------------------------

def _validate_logical_binary(op: OpView) -> HalVersion:
    op.expect_counts(2, 1)
    op.expect_types([T.TENSOR_BOOL8, T.TENSOR_BOOL8], [T.TENSOR_BOOL8])
    return V.V1_2


def _validate_logical_not(op: OpView) -> HalVersion:
    op.expect_counts(1, 1)
    op.expect_types([T.TENSOR_BOOL8], [T.TENSOR_BOOL8])
    return V.V1_2


def _logical_kernel(fn):
    def kernel(call: Call) -> list[np.ndarray]:
        return [np.asarray(fn(*(arg.value for arg in call.ins)), dtype=np.bool_)]
    return kernel


register(OperationType.LOGICAL_AND, validate=_validate_logical_binary, shape=broadcast_shape,
         kernel=_logical_kernel(np.logical_and))
register(OperationType.LOGICAL_OR, validate=_validate_logical_binary, shape=broadcast_shape,
         kernel=_logical_kernel(np.logical_or))
register(OperationType.LOGICAL_NOT, validate=_validate_logical_not, shape=same_as_input(0),
         kernel=_logical_kernel(np.logical_not))


# --- SELECT ------------------------------------------------------------------

_SELECTABLE = {T.TENSOR_FLOAT16: V.V1_2, T.TENSOR_FLOAT32: V.V1_2, T.TENSOR_INT32: V.V1_2,
               T.TENSOR_QUANT8_ASYMM: V.V1_2, T.TENSOR_QUANT8_ASYMM_SIGNED: V.V1_3}


def _merge_dims(op: OpView, indexes) -> tuple[int, ...] | None:
    """The common dimensions of inputs ``indexes`` (0 = unknown), None if a
    rank is unknown; refuses known extents or ranks that differ."""
    merged = None
    for i in indexes:
        if op.rank(i) is None:
            continue
        d = op.dims(i)
        if merged is None:
            merged = tuple(d)
            continue
        if len(d) != len(merged):
            raise op.fail(f"input {i} has rank {len(d)}, expected {len(merged)}")
        out = []
        for x, y in zip(merged, d):
            if x and y and x != y:
                raise op.fail(f"input {i} has dimensions {tuple(d)}, expected {merged}")
            out.append(x or y)
        merged = tuple(out)
    return merged


def _validate_select(op: OpView) -> HalVersion:
    op.expect_counts(3, 1)
    t = op.expect_type_in(1, tuple(_SELECTABLE))
    op.expect_types([T.TENSOR_BOOL8, t, t], [t])
    check_quant_params(op)
    _merge_dims(op, (0, 1, 2))
    return _SELECTABLE[t]


def _shape_select(op: OpView) -> list[tuple[int, ...]]:
    merged = _merge_dims(op, (0, 1, 2))
    return [merged if merged is not None else ()]


def _select_kernel(call: Call) -> list[np.ndarray]:
    cond, a, b = call.ins
    out = call.outs[0]
    if not cond.value.shape == a.value.shape == b.value.shape:
        raise call.fail(f"shapes differ: {cond.value.shape}, {a.value.shape}, {b.value.shape}")
    if out.type.is_quantized:
        # Each chosen input is requantized to the output's parameters.
        x, y = requantize(a, out), requantize(b, out)
    else:
        x, y = a.value, b.value
    return [np.where(cond.value, x, y).astype(out.type.dtype)]


register(OperationType.SELECT, validate=_validate_select, shape=_shape_select,
         kernel=_select_kernel)
