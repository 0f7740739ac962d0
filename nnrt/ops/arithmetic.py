"""Broadcasting element-wise arithmetic.

* With a fused activation: ADD, MUL (HAL 1.0), SUB, DIV (HAL 1.1).
* Without: MAXIMUM, MINIMUM, POW (HAL 1.2).
* CAST (HAL 1.2): element type conversion that ignores quantization.
"""
from __future__ import annotations

import numpy as np

from ..model.types import FusedActivation, HalVersion, OperandType as T, OperationType
from ..model.graph import Operand
from .common import (broadcast_dims, check_quant_params, dequantize, finish_output, qrange,
                     round_half_away, same_as_input)
from .registry import Arg, Call, OpView, register

V = HalVersion

# Oldest HAL version accepting each input type, per operation (absent = refused).
_ACT_OP_TYPES = {
    OperationType.ADD: {T.TENSOR_FLOAT32: V.V1_0, T.TENSOR_QUANT8_ASYMM: V.V1_0,
                        T.TENSOR_FLOAT16: V.V1_2, T.TENSOR_QUANT8_ASYMM_SIGNED: V.V1_3,
                        T.TENSOR_INT32: V.V1_3},
    OperationType.MUL: {T.TENSOR_FLOAT32: V.V1_0, T.TENSOR_QUANT8_ASYMM: V.V1_0,
                        T.TENSOR_FLOAT16: V.V1_2, T.TENSOR_QUANT8_ASYMM_SIGNED: V.V1_3,
                        T.TENSOR_INT32: V.V1_3},
    OperationType.SUB: {T.TENSOR_FLOAT32: V.V1_1, T.TENSOR_FLOAT16: V.V1_2,
                        T.TENSOR_QUANT8_ASYMM: V.V1_2, T.TENSOR_QUANT8_ASYMM_SIGNED: V.V1_3,
                        T.TENSOR_INT32: V.V1_3},
    # No quantized DIV in any HAL version.
    OperationType.DIV: {T.TENSOR_FLOAT32: V.V1_1, T.TENSOR_FLOAT16: V.V1_2,
                        T.TENSOR_INT32: V.V1_3},
}


def broadcast_shape(op: OpView) -> list[tuple[int, ...]]:
    if op.rank(0) is None or op.rank(1) is None:
        return [()]
    try:
        return [broadcast_dims(op.dims(0), op.dims(1))]
    except ValueError as e:
        raise op.fail(str(e)) from None


def _validate_with_activation(op: OpView) -> HalVersion:
    versions = _ACT_OP_TYPES[op.type]
    op.expect_counts(3, 1)
    t = op.expect_type_in(0, tuple(versions))
    op.expect_types([t, t, T.INT32], [t])
    op.expect_rank(0, at_most=4)
    op.expect_rank(1, at_most=4)
    check_quant_params(op)
    act = op.value(2)
    if act is not None and act not in tuple(FusedActivation):
        raise op.fail(f"invalid fused activation {act}")
    if t == T.TENSOR_INT32 and act not in (None, FusedActivation.NONE):
        raise op.fail("TENSOR_INT32 takes no fused activation")
    if op.type == OperationType.MUL and t.is_quantized:
        # The reference requantizes with a multiplier that must be < 1.
        in1, in2, out = op.inputs[0], op.inputs[1], op.outputs[0]
        if not out.scale > in1.scale * in2.scale:
            raise op.fail(f"quantized output scale {out.scale} must exceed the product of the "
                          f"input scales {in1.scale} * {in2.scale}")
    return versions[t]


def _floor_div_int32(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    # NNAPI: floor division; division by zero is undefined but yields 0 in the
    # reference. int64 keeps INT32_MIN / -1 from trapping; it wraps like C.
    x = x.astype(np.int64)
    y = np.broadcast_to(y.astype(np.int64), np.broadcast_shapes(x.shape, y.shape))
    safe = np.where(y == 0, 1, y)
    return np.where(y == 0, 0, np.floor_divide(x, safe)).astype(np.int32)


# operation -> (float function, int32 function); int32 wraps like C arithmetic.
_ACT_OP_FUNCS = {
    OperationType.ADD: (np.add, lambda x, y: (x.astype(np.int64) + y).astype(np.int32)),
    OperationType.MUL: (np.multiply, lambda x, y: (x.astype(np.int64) * y).astype(np.int32)),
    OperationType.SUB: (np.subtract, lambda x, y: (x.astype(np.int64) - y).astype(np.int32)),
    OperationType.DIV: (np.divide, _floor_div_int32),
}


_FUSED_ACTIVATIONS = frozenset(FusedActivation)   # (tuple(FusedActivation) per call cost ~2 us)
# Read by every kernel call: an enum member read off its class costs ~130 ns
# on Python 3.11 (EnumType's __getattr__), a global ~10 ns.
_INT32 = T.TENSOR_INT32


def _activation_kernel(fn_float, fn_int):
    def kernel(call: Call) -> list[np.ndarray]:
        a, b, act = call.ins
        out = call.outs[0]
        if out.type is _INT32:
            if act.value != FusedActivation.NONE:
                raise call.fail("TENSOR_INT32 takes no fused activation")
            return [fn_int(a.value, b.value)]
        if act.value not in _FUSED_ACTIVATIONS:
            raise call.fail(f"invalid fused activation {act.value}")
        # (inf and NaN as results: the executor ignores FP errors)
        return [finish_output(fn_float(dequantize(a), dequantize(b)), act.value, out)]
    return kernel


for _op, (_f, _i) in _ACT_OP_FUNCS.items():
    register(_op, validate=_validate_with_activation, shape=broadcast_shape,
             kernel=_activation_kernel(_f, _i))


# --- MAXIMUM, MINIMUM, POW -------------------------------------------------

_MINMAX_TYPES = {T.TENSOR_FLOAT32: V.V1_2, T.TENSOR_FLOAT16: V.V1_2, T.TENSOR_INT32: V.V1_2,
                 T.TENSOR_QUANT8_ASYMM: V.V1_2, T.TENSOR_QUANT8_ASYMM_SIGNED: V.V1_3}
_POW_TYPES = {T.TENSOR_FLOAT32: V.V1_2, T.TENSOR_FLOAT16: V.V1_2}


def _binary_validator(types: dict):
    def validate(op: OpView) -> HalVersion:
        op.expect_counts(2, 1)
        t = op.expect_type_in(0, tuple(types))
        op.expect_types([t, t], [t])
        check_quant_params(op)
        return types[t]
    return validate


def requantize(arg: Arg, out: Operand) -> np.ndarray:
    """Quantized ``arg`` -> the quantization of ``out``, in double. The value is
    rounded (half away from zero) *before* the output zero point is added:
    NNAPI's reference adds it first, which makes a tie round differently for
    TENSOR_QUANT8_ASYMM and its signed twin; rounding first keeps the signed
    result exactly the unsigned one minus 128 (HAL 1.3's coupling rule) and
    stays within the CTS tolerance of 1."""
    lo, hi = qrange(out.type)
    real = (arg.value.astype(np.float64) - arg.zero_point) * np.float64(np.float32(arg.scale))
    q = round_half_away(real / np.float64(np.float32(out.scale))) + out.zero_point
    return np.clip(q, lo, hi).astype(out.type.dtype)


def _minmax_kernel(pick):
    def kernel(call: Call) -> list[np.ndarray]:
        a, b = call.ins
        out = call.outs[0]
        if out.type is _INT32:
            return [pick(a.value, b.value).astype(np.int32)]
        if out.type.is_quantized:
            # Each input is requantized to the output's parameters, then picked.
            return [pick(requantize(a, out), requantize(b, out))]
        return [pick(dequantize(a), dequantize(b)).astype(out.type.dtype)]
    return kernel


def _pow_kernel(call: Call) -> list[np.ndarray]:
    base, exponent = call.ins
    result = np.power(dequantize(base), dequantize(exponent))   # FP errors: see the executor
    return [result.astype(call.outs[0].type.dtype)]


register(OperationType.MAXIMUM, validate=_binary_validator(_MINMAX_TYPES),
         shape=broadcast_shape, kernel=_minmax_kernel(np.maximum))
register(OperationType.MINIMUM, validate=_binary_validator(_MINMAX_TYPES),
         shape=broadcast_shape, kernel=_minmax_kernel(np.minimum))
register(OperationType.POW, validate=_binary_validator(_POW_TYPES),
         shape=broadcast_shape, kernel=_pow_kernel)


# --- CAST -------------------------------------------------------------------

_CAST_ANY = (T.TENSOR_FLOAT16, T.TENSOR_FLOAT32, T.TENSOR_INT32, T.TENSOR_QUANT8_ASYMM)
# HAL 1.3 adds casts of these types to themselves only.
_CAST_SAME_V13 = (T.TENSOR_BOOL8, T.TENSOR_INT32, T.TENSOR_QUANT16_ASYMM, T.TENSOR_QUANT16_SYMM,
                  T.TENSOR_QUANT8_ASYMM_SIGNED, T.TENSOR_QUANT8_SYMM)


def _validate_cast(op: OpView) -> HalVersion:
    op.expect_counts(1, 1)
    t_in, t_out = op.inputs[0].type, op.outputs[0].type
    check_quant_params(op)
    if t_in in _CAST_ANY and t_out in _CAST_ANY:
        return V.V1_2
    if t_in == t_out and t_in in _CAST_SAME_V13:
        return V.V1_3
    raise op.fail(f"cannot cast {t_in.name} to {t_out.name}")


def _cast_kernel(call: Call) -> list[np.ndarray]:
    # NNAPI's CAST converts the stored values and ignores scale and zero point
    # (quant8 200 -> float 200.0); conversions to integers truncate toward zero
    # and saturate to the destination range.
    x = call.ins[0].value
    out_type = call.outs[0].type
    if x.dtype == out_type.dtype:
        return [x.copy()]
    if out_type == T.TENSOR_INT32 or out_type.is_quantized:
        lo, hi = (-2**31, 2**31 - 1) if out_type == T.TENSOR_INT32 else qrange(out_type)
        y = np.trunc(np.nan_to_num(x.astype(np.float64)))
        return [np.clip(y, lo, hi).astype(out_type.dtype)]
    return [x.astype(out_type.dtype)]


register(OperationType.CAST, validate=_validate_cast, shape=same_as_input(0), kernel=_cast_kernel)
