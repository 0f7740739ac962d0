"""Normalizations: L2_NORMALIZATION, LOCAL_RESPONSE_NORMALIZATION (HAL 1.0;
axis, ranks other than 4, float16 and quant8 L2 in 1.2) and
INSTANCE_NORMALIZATION (HAL 1.2).

Sums of squares are taken in float64: the reference accumulates in float32,
and the CTS float32 tolerance is met either way, but float64 keeps large
axes (l2_normalization_large) well inside it."""
from __future__ import annotations

import numpy as np

from ..model.types import HalVersion, OperandType as T, OperationType
from .activation import FLOAT_SCALAR, axis_of, check_axis, expect_output_quant
from .common import check_quant_params, dequantize, same_as_input, to_output
from .registry import Call, OpView, register

V = HalVersion
F32, F16 = T.TENSOR_FLOAT32, T.TENSOR_FLOAT16
Q8, Q8S = T.TENSOR_QUANT8_ASYMM, T.TENSOR_QUANT8_ASYMM_SIGNED


def _with_optional_axis(op: OpView, version: HalVersion, axis_input: int) -> HalVersion:
    """HAL 1.0 took only 4-D inputs and no axis; either one needs HAL 1.2."""
    op.expect_rank(0, at_most=4)
    if len(op.inputs) > axis_input:
        check_axis(op, axis_input)
        return max(version, V.V1_2)
    if op.rank(0) not in (None, 4):
        return max(version, V.V1_2)
    return version


# --- L2_NORMALIZATION ---------------------------------------------------------

_L2 = {F32: V.V1_0, F16: V.V1_2, Q8: V.V1_2, Q8S: V.V1_3}
_L2_QUANT = {Q8: (1 / 128, 128), Q8S: (1 / 128, 0)}
# The reference clamps the float norm from below, so an all-zero vector gives zeros.
_L2_EPSILON = 1e-6


def _validate_l2(op: OpView) -> HalVersion:
    op.expect_counts((1, 2), 1)
    t = op.expect_type_in(0, tuple(_L2))
    op.expect_types([t], [t])
    check_quant_params(op)
    expect_output_quant(op, _L2_QUANT)
    return _with_optional_axis(op, _L2[t], 1)


def _l2_normalization(call: Call) -> list[np.ndarray]:
    a = call.ins[0]
    if a.type.is_quantized:
        # Only (q - zero_point) matters: the input scale cancels out, and the
        # reference works on those integers without an epsilon.
        x = a.value.astype(np.float64) - a.zero_point
        floor = 0.0
    else:
        x = a.value.astype(np.float64)
        floor = _L2_EPSILON
    axis = axis_of(call, 1, x.ndim)
    if x.size == 0:
        return [to_output(x, call.outs[0])]
    norm = np.sqrt(np.square(x).sum(axis=axis, keepdims=True))
    if floor:
        norm = np.maximum(norm, floor)
    # FP errors give inf/NaN: the executor ignores them
    y = np.where(norm > 0, x / np.where(norm > 0, norm, 1.0), 0.0)
    return [to_output(y, call.outs[0])]


register(OperationType.L2_NORMALIZATION, validate=_validate_l2, shape=same_as_input(),
         kernel=_l2_normalization)


# --- LOCAL_RESPONSE_NORMALIZATION ---------------------------------------------

_LRN = {F32: V.V1_0, F16: V.V1_2}


def _validate_lrn(op: OpView) -> HalVersion:
    op.expect_counts((5, 6), 1)
    t = op.expect_type_in(0, tuple(_LRN))
    s = FLOAT_SCALAR[t]
    op.expect_types([t, T.INT32, s, s, s], [t])
    if op.value(2) == 0:
        raise op.fail("bias (input 2) must not be zero")
    return _with_optional_axis(op, _LRN[t], 5)


def _lrn(call: Call) -> list[np.ndarray]:
    x = dequantize(call.ins[0]).astype(np.float64)
    radius = call.ins[1].value
    bias, alpha, beta = (float(call.ins[i].value) for i in (2, 3, 4))
    axis = axis_of(call, 5, x.ndim)
    if x.size == 0:
        return [to_output(x, call.outs[0])]
    xm = np.moveaxis(x, axis, -1)
    n = xm.shape[-1]
    # Window sums of squares through a prefix sum: window i covers
    # [i - radius, i + radius] clipped to the axis (empty if radius < 0).
    prefix = np.concatenate([np.zeros(xm.shape[:-1] + (1,)), np.cumsum(xm * xm, axis=-1)],
                            axis=-1)
    idx = np.arange(n)
    lo = np.clip(idx - radius, 0, n)
    hi = np.maximum(np.clip(idx + radius + 1, 0, n), lo)
    window = prefix[..., hi] - prefix[..., lo]
    # FP errors give inf/NaN: the executor ignores them; bias + alpha*sum <= 0: as C's pow
    y = xm * np.power(bias + alpha * window, -beta)
    return [to_output(np.moveaxis(y, -1, axis), call.outs[0])]


register(OperationType.LOCAL_RESPONSE_NORMALIZATION, validate=_validate_lrn,
         shape=same_as_input(), kernel=_lrn)


# --- INSTANCE_NORMALIZATION ---------------------------------------------------

def _validate_instance_norm(op: OpView) -> HalVersion:
    op.expect_counts(5, 1)
    t = op.expect_type_in(0, (F32, F16))
    s = FLOAT_SCALAR[t]
    op.expect_types([t, s, s, s, T.BOOL], [t])
    op.expect_rank(0, 4)
    return V.V1_2


def _instance_norm(call: Call) -> list[np.ndarray]:
    x = dequantize(call.ins[0]).astype(np.float64)
    gamma, beta, epsilon = (float(call.ins[i].value) for i in (1, 2, 3))
    spatial = (2, 3) if call.ins[4].value else (1, 2)   # NCHW : NHWC
    if x.size == 0:
        return [to_output(x, call.outs[0])]
    mean = x.mean(axis=spatial, keepdims=True)
    var = np.square(x - mean).mean(axis=spatial, keepdims=True)
    # FP errors give inf/NaN: the executor ignores them; constant plane, epsilon 0: NaN as in C
    y = (x - mean) * gamma / np.sqrt(var + epsilon) + beta
    return [to_output(y, call.outs[0])]


register(OperationType.INSTANCE_NORMALIZATION, validate=_validate_instance_norm,
         shape=same_as_input(), kernel=_instance_norm)
