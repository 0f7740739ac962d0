"""Shared pieces of kernels and validators: (de)quantization, fused
activations, padding arithmetic, broadcasting. No operation is registered here."""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from ..model.graph import Operand
from ..model.types import FusedActivation, OperandType, PaddingScheme
from .registry import Arg, OpView

T = OperandType
FLOAT_TENSORS = (T.TENSOR_FLOAT32, T.TENSOR_FLOAT16)
# What the float path of every kernel call reads, bound once: on Python 3.11
# an enum member read off its class, or an OperandType property such as
# ``dtype`` or ``is_quantized``, costs ~130 ns (issue 16).
_FLOAT32 = np.dtype(np.float32)
_FLOAT_DTYPES = {t: t.dtype for t in FLOAT_TENSORS}
_NO_ACTIVATION = FusedActivation.NONE
QUANT8_TENSORS = (T.TENSOR_QUANT8_ASYMM, T.TENSOR_QUANT8_ASYMM_SIGNED)

_QRANGE = {
    T.TENSOR_QUANT8_ASYMM: (0, 255),
    T.TENSOR_QUANT8_ASYMM_SIGNED: (-128, 127),
    T.TENSOR_QUANT8_SYMM: (-128, 127),
    T.TENSOR_QUANT8_SYMM_PER_CHANNEL: (-128, 127),
    T.TENSOR_QUANT16_ASYMM: (0, 65535),
    T.TENSOR_QUANT16_SYMM: (-32768, 32767),
}


def qrange(type: OperandType) -> tuple[int, int]:
    return _QRANGE[type]


def round_half_away(x: np.ndarray) -> np.ndarray:
    """Round to nearest, ties away from zero (C's ``round``, used by NNAPI's
    reference quantization), unlike numpy's ties-to-even ``np.round``."""
    return np.sign(x) * np.floor(np.abs(x) + 0.5)


def scalar_float(arg: Arg) -> float:
    return float(arg.value)


def dequantize(arg: Arg) -> np.ndarray:
    """The real values of a tensor argument: float32 for float and integer
    tensors, float64 for quantized ones. ``(q - zero_point) * scale`` is exact
    in float64 (at most 17 by 24 significant bits) but not in float32, where
    an exact tie such as 18.5 can arrive as 18.4999998 and round the wrong
    way once a kernel requantizes it."""
    v = arg.value
    t = arg.type
    if t in FLOAT_TENSORS:
        return v if v.dtype is _FLOAT32 else v.astype(np.float32, copy=False)
    if t == T.TENSOR_QUANT8_SYMM_PER_CHANNEL:
        cq = arg.channel_quant
        shape = [1] * v.ndim
        shape[cq.channel_dim] = -1
        return v.astype(np.float64) * np.asarray(cq.scales, np.float32).astype(np.float64).reshape(shape)
    if t.is_quantized:
        return (v.astype(np.float64) - arg.zero_point) * np.float64(np.float32(arg.scale))
    return v.astype(np.float32)


def quantize(x: np.ndarray, out: Operand) -> np.ndarray:
    """Real values -> the quantized type of ``out`` (round half away, saturate)."""
    lo, hi = qrange(out.type)
    q = round_half_away(np.asarray(x, np.float64) / out.scale) + out.zero_point
    return np.clip(q, lo, hi).astype(out.type.dtype)


def to_output(x: np.ndarray, out: Operand) -> np.ndarray:
    """Real-valued result -> the element type of output operand ``out``."""
    if out.type.is_quantized:
        return quantize(x, out)
    return np.asarray(x).astype(out.type.dtype, copy=False)


_ACT_BOUNDS = {
    FusedActivation.NONE: (-np.inf, np.inf),
    FusedActivation.RELU: (0.0, np.inf),
    FusedActivation.RELU1: (-1.0, 1.0),
    FusedActivation.RELU6: (0.0, 6.0),
}


def activation_bounds(act: int) -> tuple[float, float]:
    try:
        return _ACT_BOUNDS[FusedActivation(act)]
    except ValueError:
        raise ValueError(f"unknown fused activation {act}") from None


def apply_activation(x: np.ndarray, act: int) -> np.ndarray:
    """Clamp real values to the range of fused activation ``act``."""
    if act == _NO_ACTIVATION:
        return x
    lo, hi = activation_bounds(act)
    return np.clip(x, lo, hi)


def quantized_activation_range(act: int, out: Operand) -> tuple[int, int]:
    """The quantized clamp range a fused activation gives on output ``out``."""
    lo, hi = qrange(out.type)
    flo, fhi = activation_bounds(act)
    if flo != -np.inf:
        lo = max(lo, int(out.zero_point + round_half_away(np.float64(flo / out.scale))))
    if fhi != np.inf:
        hi = min(hi, int(out.zero_point + round_half_away(np.float64(fhi / out.scale))))
    return lo, hi


def finish_output(x: np.ndarray, act: int, out: Operand) -> np.ndarray:
    """Apply fused activation ``act`` to real values and convert to ``out``'s type."""
    dtype = _FLOAT_DTYPES.get(out.type)
    if dtype is not None:
        if act != _NO_ACTIVATION:
            x = apply_activation(x, act)
        # (already of the output's type: the float path's usual case, returned
        # without the astype call)
        return x if x.dtype is dtype else x.astype(dtype, copy=False)
    if out.type.is_quantized:
        lo, hi = quantized_activation_range(act, out)
        q = round_half_away(np.asarray(x, np.float64) / out.scale) + out.zero_point
        return np.clip(q, lo, hi).astype(out.type.dtype)
    return apply_activation(x, act).astype(out.type.dtype, copy=False)


# --- padding arithmetic (NNAPI's implicit padding) -------------------------

def same_padding(in_size: int, filter_size: int, stride: int, dilation: int = 1) -> tuple[int, int]:
    """(head, tail) padding of PADDING_SAME: output = ceil(in / stride)."""
    effective = (filter_size - 1) * dilation + 1
    out = (in_size + stride - 1) // stride
    total = max((out - 1) * stride + effective - in_size, 0)
    return total // 2, total - total // 2


def implicit_padding(scheme: int, in_size: int, filter_size: int, stride: int,
                     dilation: int = 1) -> tuple[int, int]:
    if scheme == PaddingScheme.SAME:
        return same_padding(in_size, filter_size, stride, dilation)
    if scheme == PaddingScheme.VALID:
        return 0, 0
    raise ValueError(f"unknown padding scheme {scheme}")


def conv_output_size(in_size: int, filter_size: int, stride: int, pad_head: int,
                     pad_tail: int, dilation: int = 1) -> int:
    effective = (filter_size - 1) * dilation + 1
    return (in_size + pad_head + pad_tail - effective) // stride + 1


# --- shapes ---------------------------------------------------------------

def broadcast_dims(a: Sequence[int], b: Sequence[int]) -> tuple[int, ...]:
    """numpy-style broadcast of two dimension lists where 0 means unknown.
    Raises ValueError when two known extents disagree."""
    n = max(len(a), len(b))
    a = (1,) * (n - len(a)) + tuple(a)
    b = (1,) * (n - len(b)) + tuple(b)
    out = []
    for x, y in zip(a, b):
        if x == 0 or y == 0:
            # An unknown extent broadcasts to the other one when that is > 1
            # (it must then be 1 or equal); otherwise the result is unknown.
            other = y if x == 0 else x
            out.append(other if other > 1 else 0)
        elif x == y or y == 1:
            out.append(x)
        elif x == 1:
            out.append(y)
        else:
            raise ValueError(f"cannot broadcast {x} with {y}")
    return tuple(out)


def same_as_input(i: int = 0):
    """Shape function: every output has the dimensions of input ``i``."""
    def shape(op: OpView) -> list[tuple[int, ...]]:
        return [op.dims(i)] * len(op.outputs)
    return shape


def expect_same_quant(op: OpView) -> None:
    """A quantized output 0 must keep input 0's scale and zero point (the
    rule of operations that only move or select values)."""
    a, out = op.inputs[0], op.outputs[0]
    if out.type.is_quantized and (out.scale != a.scale or out.zero_point != a.zero_point):
        raise op.fail(f"output 0 (operand {op.operation.outputs[0]}) must have the scale and "
                      f"zero point of input 0")


def check_quant_params(op: OpView) -> None:
    """Every quantized tensor operand (in or out) must have a positive scale
    and a zero point inside its type's range (TENSOR_QUANT8_SYMM*: zero)."""
    for which, operands, indexes in (("input", op.inputs, op.operation.inputs),
                                     ("output", op.outputs, op.operation.outputs)):
        for pos, (o, idx) in enumerate(zip(operands, indexes)):
            t = o.type
            if t == T.TENSOR_QUANT8_SYMM_PER_CHANNEL:
                cq = o.channel_quant
                if cq is None:
                    raise op.fail(f"{which} {pos} (operand {idx}) lacks per-channel quantization")
                if cq.channel_dim >= max(len(o.dimensions), 1):
                    raise op.fail(f"{which} {pos} (operand {idx}) channel_dim {cq.channel_dim} "
                                  f"out of range")
                if o.dimensions and len(cq.scales) != o.dimensions[cq.channel_dim]:
                    raise op.fail(f"{which} {pos} (operand {idx}) has {len(cq.scales)} scales for "
                                  f"{o.dimensions[cq.channel_dim]} channels")
                if any(not s > 0 for s in cq.scales):
                    raise op.fail(f"{which} {pos} (operand {idx}) has a non-positive channel scale")
            elif t.is_quantized:
                if not o.scale > 0:
                    raise op.fail(f"{which} {pos} (operand {idx}) needs a positive scale, got {o.scale}")
                lo, hi = qrange(t)
                if t in (T.TENSOR_QUANT8_SYMM, T.TENSOR_QUANT16_SYMM) and o.zero_point != 0:
                    raise op.fail(f"{which} {pos} (operand {idx}) is symmetric: zero point must be 0")
                if not lo <= o.zero_point <= hi:
                    raise op.fail(f"{which} {pos} (operand {idx}) zero point {o.zero_point} "
                                  f"outside [{lo}, {hi}]")


def multiply_by_quantized_multiplier(x: np.ndarray, multiplier, shift) -> np.ndarray:
    """TFLite's MultiplyByQuantizedMultiplier (gemmlowp's rounding doubling
    high multiply, then a rounding right shift) on int64 arrays holding int32
    values; ``multiplier`` and ``shift`` are scalars or broadcast along the
    last axis (per output channel). This is the rescale NNAPI's and TFLite's
    reference kernels use: two roundings, so results differ from a single
    round(x * real_multiplier) by one unit now and then, and deep quantized
    networks drift when they do. Written with in-place integer steps: the
    array is as large as a layer's output."""
    multiplier = np.asarray(multiplier, np.int64)
    shift = np.asarray(shift, np.int64)
    x = np.asarray(x, np.int64)
    if np.any(shift > 0):
        x = np.clip(x << np.maximum(shift, 0), -(1 << 31), (1 << 31) - 1)
    right = np.maximum(-shift, 0)
    ab = x * multiplier
    negative = ab < 0
    # (ab + nudge) / 2^31 truncated toward zero; nudge = 2^30 or 1 - 2^30.
    ab += 1 << 30
    np.subtract(ab, (1 << 31) - 1, out=ab, where=negative)
    high = ab >> 31
    high += negative & ((ab & ((1 << 31) - 1)) != 0)
    # The only saturating case, INT32_MIN * INT32_MIN, cannot occur: a Q31
    # multiplier is positive.
    mask = (np.int64(1) << right) - 1
    threshold = (mask >> 1) + (high < 0)
    remainder = high & mask
    high >>= right
    high += remainder > threshold
    return high


def rounding_divide_by_pot(x, exponent) -> np.ndarray:
    """gemmlowp's RoundingDivideByPOT: ``x`` (integers) divided by
    2**``exponent``, ties away from zero; ``exponent`` >= 0, a scalar or an
    array broadcast against ``x``. (multiply_by_quantized_multiplier does the
    same in place on its own array.)"""
    x = np.asarray(x, np.int64)
    exponent = np.asarray(exponent, np.int64)
    mask = np.left_shift(np.int64(1), exponent) - 1
    threshold = (mask >> 1) + (x < 0)
    return (x >> exponent) + ((x & mask) > threshold)


def quantize_multiplier(real: float) -> tuple[int, int]:
    """TFLite's QuantizeMultiplier: ``real`` as a Q31 mantissa and a
    power-of-two exponent (0, 0 below 2^-31)."""
    if real == 0:
        return 0, 0
    mantissa, shift = math.frexp(real)
    q = int(math.copysign(math.floor(abs(mantissa) * (1 << 31) + 0.5), mantissa))
    if q == 1 << 31:
        q //= 2
        shift += 1
    if shift < -31:
        return 0, 0
    return q, shift
