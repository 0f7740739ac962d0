"""Element-wise unary math and type conversion: FLOOR, DEQUANTIZE (HAL 1.0),
ABS, EXP, LOG, NEG, RSQRT, SIN, SQRT, QUANTIZE (HAL 1.2)."""
from __future__ import annotations

import numpy as np

from ..model.types import HalVersion, OperandType as T, OperationType
from .common import check_quant_params, dequantize, qrange, round_half_away, same_as_input
from .registry import Call, OpView, register

V = HalVersion
F32, F16, I32 = T.TENSOR_FLOAT32, T.TENSOR_FLOAT16, T.TENSOR_INT32
_FLOATS_12 = {F32: V.V1_2, F16: V.V1_2}


def _validator(versions: dict, max_rank: int | None):
    def validate(op: OpView) -> HalVersion:
        op.expect_counts(1, 1)
        t = op.expect_type_in(0, tuple(versions))
        op.expect_types([t], [t])
        if max_rank is not None:
            op.expect_rank(0, at_most=max_rank)
        return versions[t]
    return validate


def _kernel(fn):
    """Apply ``fn`` to float tensors in float32 (float16 is widened then
    rounded back) and to TENSOR_INT32 as is."""
    def kernel(call: Call) -> list[np.ndarray]:
        a, out = call.ins[0], call.outs[0]
        x = a.value if a.type == I32 else a.value.astype(np.float32, copy=False)
        # Out-of-domain inputs (log of a negative, sqrt of -1) give NaN/inf as in C.
        # FP errors give inf/NaN: the executor ignores them
        return [fn(x).astype(out.type.dtype, copy=False)]
    return kernel


def _rsqrt(x: np.ndarray) -> np.ndarray:
    return np.float32(1) / np.sqrt(x)


_TABLE = (
    # FLOOR is the HAL 1.0 one: rank up to 4; the HAL 1.2 ones take rank >= 1.
    (OperationType.FLOOR, {F32: V.V1_0, F16: V.V1_2}, 4, np.floor),
    (OperationType.ABS, {**_FLOATS_12, I32: V.V1_3}, None, np.abs),
    (OperationType.NEG, {**_FLOATS_12, I32: V.V1_2}, None, np.negative),
    (OperationType.EXP, _FLOATS_12, None, np.exp),
    (OperationType.LOG, _FLOATS_12, None, np.log),
    (OperationType.RSQRT, _FLOATS_12, None, _rsqrt),
    (OperationType.SIN, _FLOATS_12, None, np.sin),
    (OperationType.SQRT, _FLOATS_12, None, np.sqrt),
)

for _op, _versions, _max_rank, _fn in _TABLE:
    register(_op, validate=_validator(_versions, _max_rank), shape=same_as_input(),
             kernel=_kernel(_fn))


# --- DEQUANTIZE ------------------------------------------------------------------

_DEQUANT_INPUTS = {
    T.TENSOR_QUANT8_ASYMM: V.V1_0,
    T.TENSOR_QUANT8_SYMM: V.V1_2,
    T.TENSOR_QUANT8_SYMM_PER_CHANNEL: V.V1_2,
    T.TENSOR_QUANT8_ASYMM_SIGNED: V.V1_3,
}


def _validate_dequantize(op: OpView) -> HalVersion:
    op.expect_counts(1, 1)
    t = op.expect_type_in(0, tuple(_DEQUANT_INPUTS))
    out = op.outputs[0].type
    if out not in (F32, F16):
        raise op.fail(f"output 0 (operand {op.operation.outputs[0]}) must be TENSOR_FLOAT32 "
                      f"or TENSOR_FLOAT16, got {out.name}")
    op.expect_rank(0, at_most=4)
    check_quant_params(op)
    # HAL 1.0 had only TENSOR_QUANT8_ASYMM -> TENSOR_FLOAT32.
    return max(_DEQUANT_INPUTS[t], V.V1_0 if out == F32 else V.V1_2)


def _dequantize(call: Call) -> list[np.ndarray]:
    return [dequantize(call.ins[0]).astype(call.outs[0].type.dtype, copy=False)]


register(OperationType.DEQUANTIZE, validate=_validate_dequantize, shape=same_as_input(),
         kernel=_dequantize)


# --- QUANTIZE ----------------------------------------------------------------------

_QUANT_OUTPUTS = {T.TENSOR_QUANT8_ASYMM: V.V1_2, T.TENSOR_QUANT8_ASYMM_SIGNED: V.V1_3}


def _validate_quantize(op: OpView) -> HalVersion:
    op.expect_counts(1, 1)
    op.expect_type_in(0, (F32, F16))
    out = op.outputs[0].type
    if out not in _QUANT_OUTPUTS:
        raise op.fail(f"output 0 (operand {op.operation.outputs[0]}) must be "
                      f"TENSOR_QUANT8_ASYMM or TENSOR_QUANT8_ASYMM_SIGNED, got {out.name}")
    check_quant_params(op)
    return _QUANT_OUTPUTS[out]


def _quantize(call: Call) -> list[np.ndarray]:
    out = call.outs[0]
    x = call.ins[0].value.astype(np.float32, copy=False)
    # The reference rounds zero_point + x / scale (float32) as a whole, half
    # away from zero; this differs from round(x / scale) + zero_point on ties.
    real = np.float32(out.zero_point) + x / np.float32(out.scale)
    q = round_half_away(real.astype(np.float64))   # float32 would round x.4999 + 0.5 up
    lo, hi = qrange(out.type)
    return [np.clip(q, lo, hi).astype(out.type.dtype)]


register(OperationType.QUANTIZE, validate=_validate_quantize, shape=same_as_input(),
         kernel=_quantize)
