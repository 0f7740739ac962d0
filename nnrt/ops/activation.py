"""Activations: RELU, RELU1, RELU6, LOGISTIC, TANH, SOFTMAX (HAL 1.0),
PRELU, LOG_SOFTMAX (HAL 1.2), ELU, HARD_SWISH (HAL 1.3).

Quantized LOGISTIC/TANH/SOFTMAX/HARD_SWISH/PRELU are computed on the real
values and requantized; NNAPI's reference uses gemmlowp fixed point, which
lands within the 1-LSB tolerance of the CTS. Also holds the small validation
helpers the normalization family shares (axis scalar, fixed output
quantization)."""
from __future__ import annotations

import numpy as np

from ..model.types import FusedActivation, HalVersion, OperandType as T, OperationType
from .common import (broadcast_dims, check_quant_params, dequantize, expect_same_quant,
                     finish_output, same_as_input, to_output)
from .registry import Call, OpView, register

V = HalVersion
Q8, Q8S = T.TENSOR_QUANT8_ASYMM, T.TENSOR_QUANT8_ASYMM_SIGNED

# Scalar type that goes with each float tensor type (beta, alpha, epsilon...).
FLOAT_SCALAR = {T.TENSOR_FLOAT32: T.FLOAT32, T.TENSOR_FLOAT16: T.FLOAT16,
                Q8: T.FLOAT32, Q8S: T.FLOAT32}


# --- shared validation helpers ---------------------------------------------

def check_axis(op: OpView, i: int) -> None:
    """Input ``i`` is an INT32 axis into input 0: must be in [-rank, rank)
    when both are known."""
    op.expect_types([None] * i + [T.INT32], [])
    axis, rank = op.value(i), op.rank(0)
    if axis is not None and rank is not None and not -rank <= axis < rank:
        raise op.fail(f"axis {axis} (input {i}) out of range for input 0 of rank {rank}")


def axis_of(call: Call, i: int, ndim: int) -> int:
    """Axis from optional input ``i`` (default -1), normalised; run-time check."""
    axis = call.ins[i].value if len(call.ins) > i else -1
    if not -ndim <= axis < ndim:
        raise call.fail(f"axis {axis} out of range for rank {ndim}")
    return axis % ndim


def expect_output_quant(op: OpView, fixed: dict) -> None:
    """The output of a quantized type must have the (scale, zero point) the
    spec fixes for it, e.g. LOGISTIC's 1/256 and 0."""
    out = op.outputs[0]
    if out.type in fixed:
        scale, zero_point = fixed[out.type]
        if np.float32(out.scale) != np.float32(scale) or out.zero_point != zero_point:
            raise op.fail(f"output 0 (operand {op.operation.outputs[0]}) of type "
                          f"{out.type.name} must have scale {scale} and zero point "
                          f"{zero_point}, got {out.scale} and {out.zero_point}")


# --- element-wise activations ----------------------------------------------

_BASE = {T.TENSOR_FLOAT32: V.V1_0, Q8: V.V1_0, T.TENSOR_FLOAT16: V.V1_2, Q8S: V.V1_3}
_HAL13 = dict.fromkeys(_BASE, V.V1_3)


def _elementwise_validator(versions: dict, fixed_quant: dict | None, max_rank: int | None = 4):
    """Validator of a one-input, one-output activation. ``fixed_quant`` None
    means a quantized output keeps the input's scale and zero point; a dict
    gives the imposed ones; {} leaves them free."""
    def validate(op: OpView) -> HalVersion:
        op.expect_counts(1, 1)
        t = op.expect_type_in(0, tuple(versions))
        op.expect_types([t], [t])
        if max_rank is not None:
            op.expect_rank(0, at_most=max_rank)
        check_quant_params(op)
        if fixed_quant is None:
            expect_same_quant(op)
        else:
            expect_output_quant(op, fixed_quant)
        return versions[t]
    return validate


def _real_kernel(fn):
    """Kernel applying ``fn`` to the real values of input 0 (see ``dequantize``)."""
    def kernel(call: Call) -> list[np.ndarray]:
        return [to_output(fn(dequantize(call.ins[0])), call.outs[0])]
    return kernel


def _clamp_kernel(act: FusedActivation):
    # RELU/RELU1/RELU6 are the fused activations on their own; the output
    # keeps the input's quantization, so this is an exact clamp.
    def kernel(call: Call) -> list[np.ndarray]:
        return [finish_output(dequantize(call.ins[0]), act, call.outs[0])]
    return kernel


def _sigmoid(x: np.ndarray) -> np.ndarray:
    # exp(-x) overflows to inf for x < -88 in float32, which still gives 0.
    # FP errors give inf/NaN: the executor ignores them
    return 1.0 / (1.0 + np.exp(-x))


def _hard_swish(x: np.ndarray) -> np.ndarray:
    return x * np.clip(x + 3.0, 0.0, 6.0) / 6.0


for _op, _act in ((OperationType.RELU, FusedActivation.RELU),
                  (OperationType.RELU1, FusedActivation.RELU1),
                  (OperationType.RELU6, FusedActivation.RELU6)):
    register(_op, validate=_elementwise_validator(_BASE, None), shape=same_as_input(),
             kernel=_clamp_kernel(_act))

register(OperationType.LOGISTIC,
         validate=_elementwise_validator(_BASE, {Q8: (1 / 256, 0), Q8S: (1 / 256, -128)}),
         shape=same_as_input(), kernel=_real_kernel(_sigmoid))
# TANH on TENSOR_QUANT8_ASYMM only came with HAL 1.2.
register(OperationType.TANH,
         validate=_elementwise_validator({**_BASE, Q8: V.V1_2},
                                         {Q8: (1 / 128, 128), Q8S: (1 / 128, 0)}),
         shape=same_as_input(), kernel=_real_kernel(np.tanh))
register(OperationType.HARD_SWISH, validate=_elementwise_validator(_HAL13, {}, max_rank=None),
         shape=same_as_input(), kernel=_real_kernel(_hard_swish))


# --- ELU (HAL 1.3): input, alpha scalar -------------------------------------

def _validate_elu(op: OpView) -> HalVersion:
    op.expect_counts(2, 1)
    t = op.expect_type_in(0, (T.TENSOR_FLOAT32, T.TENSOR_FLOAT16))
    op.expect_types([t, FLOAT_SCALAR[t]], [t])
    return V.V1_3


def _elu(call: Call) -> list[np.ndarray]:
    x = dequantize(call.ins[0])
    alpha = np.float32(call.ins[1].value)
    # FP errors give inf/NaN: the executor ignores them
    y = np.where(x > 0, x, alpha * np.expm1(np.minimum(x, 0)))
    return [to_output(y, call.outs[0])]


register(OperationType.ELU, validate=_validate_elu, shape=same_as_input(), kernel=_elu)


# --- PRELU (HAL 1.2): input, alpha broadcast against it ----------------------

_PRELU = {T.TENSOR_FLOAT32: V.V1_2, T.TENSOR_FLOAT16: V.V1_2, Q8: V.V1_2, Q8S: V.V1_3}


def _validate_prelu(op: OpView) -> HalVersion:
    op.expect_counts(2, 1)
    t = op.expect_type_in(0, tuple(_PRELU))
    op.expect_types([t, t], [t])
    check_quant_params(op)
    _prelu_shape(op)
    return _PRELU[t]


def _prelu_shape(op: OpView) -> list[tuple[int, ...]]:
    try:
        return [broadcast_dims(op.dims(0), op.dims(1))]
    except ValueError as e:
        raise op.fail(f"input 0 and alpha (input 1): {e}") from None


def _prelu(call: Call) -> list[np.ndarray]:
    x, alpha = dequantize(call.ins[0]), dequantize(call.ins[1])
    try:
        y = np.where(x >= 0, x, x * alpha)
    except ValueError as e:
        raise call.fail(f"input and alpha do not broadcast: {e}") from None
    return [to_output(y, call.outs[0])]


register(OperationType.PRELU, validate=_validate_prelu, shape=_prelu_shape, kernel=_prelu)


# --- SOFTMAX and LOG_SOFTMAX --------------------------------------------------

_SOFTMAX_QUANT = {Q8: (1 / 256, 0), Q8S: (1 / 256, -128)}


def _validate_softmax(op: OpView) -> HalVersion:
    op.expect_counts((2, 3), 1)
    t = op.expect_type_in(0, tuple(_BASE))
    op.expect_types([t, FLOAT_SCALAR[t]], [t])
    op.expect_rank(0, at_most=4)
    check_quant_params(op)
    expect_output_quant(op, _SOFTMAX_QUANT)
    beta = op.value(1)
    if beta is not None and not beta > 0:
        raise op.fail(f"beta (input 1) must be positive, got {beta}")
    version = _BASE[t]
    if len(op.inputs) == 3:
        check_axis(op, 2)
        version = max(version, V.V1_2)
    elif op.rank(0) not in (None, 2, 4):
        version = max(version, V.V1_2)   # ranks 1 and 3 came with HAL 1.2
    return version


def _scaled_shift(call: Call) -> tuple[np.ndarray, int]:
    """(x - max(x)) * beta along the axis, in float32, and that axis."""
    x = dequantize(call.ins[0])
    beta = call.ins[1].value
    if not beta > 0:
        raise call.fail(f"beta must be positive, got {beta}")
    axis = axis_of(call, 2, x.ndim)
    if x.size == 0:
        return x, axis
    return (x - x.max(axis=axis, keepdims=True)) * np.float32(beta), axis


def _softmax(call: Call) -> list[np.ndarray]:
    z, axis = _scaled_shift(call)
    e = np.exp(z)
    return [to_output(e / e.sum(axis=axis, keepdims=True), call.outs[0])]


def _validate_log_softmax(op: OpView) -> HalVersion:
    op.expect_counts(3, 1)
    t = op.expect_type_in(0, (T.TENSOR_FLOAT32, T.TENSOR_FLOAT16))
    op.expect_types([t, FLOAT_SCALAR[t], T.INT32], [t])
    check_axis(op, 2)
    return V.V1_2


def _log_softmax(call: Call) -> list[np.ndarray]:
    x = dequantize(call.ins[0])
    axis = axis_of(call, 2, x.ndim)
    if x.size == 0:
        return [to_output(x, call.outs[0])]
    z = (x - x.max(axis=axis, keepdims=True)) * np.float32(call.ins[1].value)
    return [to_output(z - np.log(np.exp(z).sum(axis=axis, keepdims=True)), call.outs[0])]


register(OperationType.SOFTMAX, validate=_validate_softmax, shape=same_as_input(),
         kernel=_softmax)
register(OperationType.LOG_SOFTMAX, validate=_validate_log_softmax, shape=same_as_input(),
         kernel=_log_softmax)
