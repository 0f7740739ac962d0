"""FULLY_CONNECTED (HAL 1.0): output = activation(input · weightsᵀ + bias), the
input flattened to [batch_size, input_size] with input_size = weights.dim[1]."""
from __future__ import annotations

import numpy as np

from ..model.types import FusedActivation, HalVersion as V, OperandType as T, OperationType
from .common import (check_quant_params, dequantize, finish_output, multiply_by_quantized_multiplier,
                     quantize_multiplier, quantized_activation_range)
from .registry import Call, OpView, register

_VERSION_OF_TYPE = {T.TENSOR_FLOAT32: V.V1_0, T.TENSOR_QUANT8_ASYMM: V.V1_0,
                    T.TENSOR_FLOAT16: V.V1_2, T.TENSOR_QUANT8_ASYMM_SIGNED: V.V1_3}


def _bias_scale_matches(op: OpView) -> bool:
    # NNAPI computes the product in float and allows a relative error of 1e-6.
    product = float(np.float32(op.inputs[0].scale) * np.float32(op.inputs[1].scale))
    bias = op.inputs[2].scale
    return abs(product - bias) <= 1e-6 * min(product, bias)


def _validate(op: OpView) -> V:
    op.expect_counts(4, 1)
    t = op.expect_type_in(0, tuple(_VERSION_OF_TYPE))
    quantized = t.is_quantized
    op.expect_types([t, t, T.TENSOR_INT32 if quantized else t, T.INT32], [t])
    op.expect_rank(0, 2, 3, 4)
    op.expect_rank(1, 2)
    op.expect_rank(2, 1)
    check_quant_params(op)
    act = op.value(3)
    if act is not None and act not in tuple(FusedActivation):
        raise op.fail(f"invalid fused activation {act}")
    weights, bias = op.dims(1), op.dims(2)
    if len(weights) == 2 and len(bias) == 1 and weights[0] and bias[0] and weights[0] != bias[0]:
        raise op.fail(f"bias has {bias[0]} entries for {weights[0]} units")
    version = _VERSION_OF_TYPE[t]
    if quantized:
        if not _bias_scale_matches(op):
            raise op.fail(f"bias scale {op.inputs[2].scale} must equal input scale × weights "
                          f"scale")
        if op.inputs[2].zero_point != 0:
            raise op.fail("bias zero point must be 0")
        # HAL 1.0/1.1 required output_scale > input_scale * weights_scale.
        if op.outputs[0].scale <= op.inputs[0].scale * op.inputs[1].scale:
            version = max(version, V.V1_2)
    return version


def _shape(op: OpView) -> list[tuple[int, ...]]:
    weights, bias = op.dims(1), op.dims(2)
    units = weights[0] if len(weights) == 2 and weights[0] else (bias[0] if len(bias) == 1 else 0)
    input_size = weights[1] if len(weights) == 2 else 0
    in_dims = op.dims(0)
    batch = 0
    if op.rank(0) is not None and input_size and 0 not in in_dims:
        total = int(np.prod(in_dims, dtype=np.int64))
        if total % input_size:
            raise op.fail(f"input of {total} elements is not a multiple of input_size "
                          f"{input_size}")
        batch = total // input_size
    return [(batch, units)]


def _kernel(call: Call) -> list[np.ndarray]:
    x, w, b, act = call.ins
    out = call.outs[0]
    units, input_size = w.value.shape
    if b.value.shape != (units,):
        raise call.fail(f"bias shape {b.value.shape} does not match {units} units")
    if x.value.size % input_size:
        raise call.fail(f"input of {x.value.size} elements is not a multiple of input_size "
                        f"{input_size}")
    if x.type.is_quantized:
        # Exact integer accumulation, then one rescale by input_scale * weights_scale.
        xq = x.value.reshape(-1, input_size).astype(np.int64) - x.zero_point
        wq = w.value.astype(np.int64) - w.zero_point
        acc = xq @ wq.T + b.value.astype(np.int64)
        # TFLite's fixed-point requantization (float32 scale product, Q31
        # multiplier, rounding shift): the reference kernels' result exactly.
        multiplier, shift = quantize_multiplier(
            float(np.float64(np.float32(x.scale) * np.float32(w.scale)) / np.float32(out.scale)))
        q = multiply_by_quantized_multiplier(acc, multiplier, shift) + out.zero_point
        lo, hi = quantized_activation_range(act.value, out)
        return [np.clip(q, lo, hi).astype(out.type.dtype)]
    # float64 accumulation: closest to the exact values the CTS expects.
    xf = dequantize(x).reshape(-1, input_size).astype(np.float64)
    real = xf @ dequantize(w).astype(np.float64).T + dequantize(b).astype(np.float64)
    return [finish_output(real, act.value, out)]


register(OperationType.FULLY_CONNECTED, validate=_validate, shape=_shape, kernel=_kernel)
