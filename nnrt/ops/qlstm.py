"""QUANTIZED_LSTM (HAL 1.3): one LSTM time step on signed 8-bit activations,
8-bit symmetric weights and a 16-bit symmetric cell state, with the CIFG,
peephole, projection and layer-normalization variants.

NNAPI's reference (QLSTM.cpp, a port of TF Lite's 8x8_16 integer LSTM) is
integer arithmetic from end to end, and the CTS expectations are its exact
outputs, so this kernel reproduces each integer step (vectorised over batch
and units) instead of computing in float and requantizing at the end: a float
cell drifts by several units of the 16-bit cell state. The steps:
* each gate: input and recurrent matmuls, each rescaled by its own Q31
  multiplier to the gate's intermediate scale and accumulated in saturating
  int16; + peephole (cell state x cell-to-gate weights, rescaled likewise);
* layer normalization (when given) in fixed point, where the gate bias is
  added; then gemmlowp's fixed-point sigmoid (Q3.12 -> Q0.15), or tanh for
  the cell gate;
* CIFG: input gate = 1 - forget gate (32767 - f);
* cell = f*c >> 15 + i*g >> (30 + log2(cell scale)), saturated, clipped;
* hidden = o * tanh(cell), requantized to the hidden-state scale, then the
  optional projection (requantized to the output scale, clipped).

Where the reference is plainly broken, the kernel follows the intended
semantics (TF Lite's), which gives the same results on every AOSP test:
* without layer normalization the reference drops the gate biases; here they
  are added to the input matmul accumulator (TF Lite folds them there);
* its input/forget peepholes read the not-yet-written output cell buffer and
  only ``output_size`` elements; here they read the previous cell state, and
  the output-gate peephole the new one, over all units;
* an omitted projection bias counts as zeros (the reference dereferences
  a null pointer).
The reference's own quirks that are consistent are kept: the hidden state is
stored as ``value - hidden_zero_point`` (the projection undoes it), the
projection clip is divided by the projection weights' scale, and the
output's declared scale is not used (the hidden state is output as is when
there is no projection).
"""
from __future__ import annotations

import math

import numpy as np

from ..model.types import HalVersion, OperandType as T, OperationType
from .common import (multiply_by_quantized_multiplier, qrange, quantize_multiplier,
                     rounding_divide_by_pot)
from .lstm import _srdhm
from .recurrent import dim, maybe_omitted
from .registry import Call, OpView, register

# --- operand positions -------------------------------------------------------
INPUT = 0
INPUT_W = (1, 2, 3, 4)          # input-to-{input, forget, cell, output} [units, input]
RECURRENT_W = (5, 6, 7, 8)      # recurrent-to-{...} [units, output]
PEEPHOLE_W = (9, 10, 11)        # cell-to-{input, forget, output} [units]
BIAS = (12, 13, 14, 15)         # {input, forget, cell, output} gate bias [units]
PROJ_W, PROJ_B = 16, 17         # [output, units], [output]
OUTPUT_STATE_IN, CELL_STATE_IN = 18, 19
LAYER_NORM_W = (20, 21, 22, 23)
CELL_CLIP, PROJ_CLIP = 24, 25
INTERMEDIATE_SCALE = (26, 27, 28, 29)
HIDDEN_ZERO_POINT, HIDDEN_SCALE = 30, 31

_REQUIRED = (INPUT, 2, 3, 4, 6, 7, 8, 13, 14, 15, OUTPUT_STATE_IN, CELL_STATE_IN,
             *range(CELL_CLIP, HIDDEN_SCALE + 1))
_SIGNATURE = ([T.TENSOR_QUANT8_ASYMM_SIGNED] + [T.TENSOR_QUANT8_SYMM] * 8
              + [T.TENSOR_QUANT16_SYMM] * 3 + [T.TENSOR_INT32] * 4
              + [T.TENSOR_QUANT8_SYMM, T.TENSOR_INT32, T.TENSOR_QUANT8_ASYMM_SIGNED,
                 T.TENSOR_QUANT16_SYMM] + [T.TENSOR_QUANT16_SYMM] * 4
              + [T.FLOAT32] * 6 + [T.INT32, T.FLOAT32])
_OUTPUTS = [T.TENSOR_QUANT8_ASYMM_SIGNED, T.TENSOR_QUANT16_SYMM, T.TENSOR_QUANT8_ASYMM_SIGNED]

I16_MIN, I16_MAX = -(1 << 15), (1 << 15) - 1
I32_MIN, I32_MAX = -(1 << 31), (1 << 31) - 1


# --- integer primitives (int64 arrays holding the values of C int16/int32) -----

def _wrap(x, bits: int):
    """Two's-complement wrap-around, as a C store into a ``bits``-bit integer."""
    half = 1 << (bits - 1)
    return ((np.asarray(x, np.int64) + half) & ((1 << bits) - 1)) - half


def _sat16(x):
    return np.clip(x, I16_MIN, I16_MAX)


def _sat_shift_left(x, exponent: int, bits: int):
    """gemmlowp SaturatingRoundingMultiplyByPOT for a positive exponent."""
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    return np.clip(np.asarray(x, np.int64) << exponent, lo, hi)


def _const16(raw32: int) -> int:
    """gemmlowp's int32 fixed-point constants as their int16 counterparts."""
    return int(rounding_divide_by_pot(raw32, 16))


# --- gemmlowp's 16-bit fixed-point exp, sigmoid and tanh ----------------------

_EXP_CONSTANT_TERM = _const16(1895147668)      # exp(-1/8)
_ONE_THIRD = _const16(715827883)
_EXP_BARREL = [(e, _const16(m)) for e, m in ((-2, 1672461947), (-1, 1302514674), (0, 790015084),
                                             (1, 290630308), (2, 39332535), (3, 720401), (4, 242))]
_48_OVER_17 = _const16(1515870810)             # Q2.13
_NEG_32_OVER_17 = _const16(-1010580540)


def _mul16(a, b):
    return _srdhm(a, b, 16)


def _exp_on_quarter_interval(a):
    """exp(a) for Q0.15 ``a`` in [-1/4, 0): Taylor expansion around -1/8."""
    x = _wrap(a + (1 << 12), 16)
    x2 = _mul16(x, x)
    x3 = _mul16(x2, x)
    x4 = _mul16(x2, x2)
    poly = _wrap(_mul16(_wrap(rounding_divide_by_pot(x4, 2) + x3, 16), _ONE_THIRD) + x2, 16)
    poly = rounding_divide_by_pot(poly, 1)
    return _sat16(_EXP_CONSTANT_TERM + _mul16(_EXP_CONSTANT_TERM, _wrap(x + poly, 16)))


def _exp_on_negative(a, integer_bits: int):
    """exp(a) in Q0.15 for a <= 0 given with ``integer_bits`` integer bits."""
    frac = 15 - integer_bits
    quarter = 1 << (frac - 2)
    a_mod = _wrap((a & (quarter - 1)) - quarter, 16)
    result = _exp_on_quarter_interval(_sat_shift_left(a_mod, integer_bits, 16))
    remainder = _wrap(a_mod - a, 16)
    for exponent, multiplier in _EXP_BARREL:
        if integer_bits > exponent:
            hit = (remainder & (1 << (frac + exponent))) != 0
            result = np.where(hit, _mul16(result, multiplier), result)
    if integer_bits > 5:
        clamp = _const16(-(1 << (36 - integer_bits)))  # -32
        result = np.where(a < clamp, 0, result)
    return np.where(a == 0, I16_MAX, result)


def _newton_reciprocal(a):
    """Newton-Raphson for 1 / (1 + a), Q0.15 ``a`` in [0, 1]; result Q2.13."""
    half_denominator = (a + I16_MAX + 1) >> 1   # RoundingHalfSum(a, 1); the sum is > 0
    x = _wrap(_48_OVER_17 + _mul16(half_denominator, _NEG_32_OVER_17), 16)
    one = 1 << 13
    for _ in range(3):
        err = _wrap(one - _mul16(half_denominator, x), 16)
        x = _wrap(x + _sat_shift_left(_mul16(x, err), 2, 16), 16)
    return x


def logistic16(a, integer_bits: int):
    """gemmlowp::logistic on int16 with ``integer_bits`` -> Q0.15."""
    a = np.asarray(a, np.int64)
    positive = a > 0
    magnitude = np.where(positive, a, _wrap(-a, 16))
    # 1 / (1 + e^-|a|): the Q2.13 reciprocal halved is read as Q1.14, then to Q0.15.
    r = _sat_shift_left(_newton_reciprocal(_exp_on_negative(_wrap(-magnitude, 16),
                                                            integer_bits)), 1, 16)
    r = np.where(positive, r, _wrap(I16_MAX - r, 16))
    return np.where(a == 0, 1 << 14, r)


def tanh16(a, integer_bits: int):
    """gemmlowp::tanh on int16 with ``integer_bits`` -> Q0.15."""
    a = np.asarray(a, np.int64)
    negative = a < 0
    n = np.where(negative, a, _wrap(-a, 16))
    # (1 - e^2n) / (1 + e^2n); 2n is n's raw value read with one more integer bit.
    e = _exp_on_negative(n, integer_bits + 1)
    t = _sat_shift_left(_wrap(_newton_reciprocal(e) - (1 << 13), 16), 2, 16)
    return np.where(a == 0, 0, np.where(negative, _wrap(-t, 16), t))


# --- layer normalization ---------------------------------------------------------

def _inv_sqrt_multiplier(v):
    """NNAPI's GetInvSqrtQuantizedMultiplierExp(v, reverse_shift=-1) per row:
    (Q31 multiplier, shift) of 1/sqrt(v) by fixed-point Newton-Raphson."""
    v = np.asarray(v, np.int64)
    tiny = v <= 1
    v = np.maximum(v, 2)
    shift = np.full_like(v, 11)
    while np.any(v >= 1 << 29):
        big = v >= 1 << 29
        v = np.where(big, v // 4, v)
        shift += big
    leading_zeros = 32 - np.frexp(v.astype(np.float64))[1].astype(np.int64)
    pairs = (leading_zeros - 1) // 2 - 1
    shift -= pairs
    v = v << (2 * pairs)
    half_input = rounding_divide_by_pot(v >> 1, 1)   # Q3.28
    half_three = (1 << 28) + (1 << 27)
    x = np.full_like(v, 1 << 28)
    for _ in range(5):
        x3 = _sat_shift_left(_srdhm(_srdhm(x, x, 32), x, 32), 6, 32)
        step = _wrap(_srdhm(half_three, x, 32) - _srdhm(half_input, x3, 32), 32)
        x = _sat_shift_left(step, 3, 32)
    x = _srdhm(x, 1518500250, 32)                 # * sqrt(2)/2
    x = np.where(shift < 0, _wrap(x << np.maximum(-shift, 0), 32), x)
    shift = np.maximum(shift, 0)
    return np.where(tiny, I32_MAX, x), np.where(tiny, 0, -shift)


def _cdiv(a, b: int):
    """C integer division (truncates toward zero) by a positive ``b``."""
    return np.sign(a) * (np.abs(a) // b)


def _layer_norm(g, weights, bias, scale_q: tuple[int, int], variance_limit: int):
    """Normalize int16 gate values per batch row, scale by the Q?.15 weights,
    add the bias, rescale to Q3.12 (NNAPI's ApplyLayerNorm)."""
    n = g.shape[-1]
    total = g.sum(axis=-1, keepdims=True)
    mean = _cdiv(total * 1024, n)
    variance = (g * g).sum(axis=-1, keepdims=True) * ((1 << 20) // n) - mean * mean
    variance = _cdiv(variance, 1 << 20)
    variance = np.where(variance < 1, variance_limit, variance)
    inv_a, inv_b = _inv_sqrt_multiplier(variance)
    rescaled = multiply_by_quantized_multiplier(1024 * g - mean, inv_a, inv_b)
    scaled = rescaled * weights + bias
    scaled = _cdiv(scaled + np.where(scaled > 0, 512, -512), 1024)
    return _sat16(multiply_by_quantized_multiplier(scaled, scale_q[0], scale_q[1] + 12))


# --- the cell --------------------------------------------------------------------

def _f32(x) -> float:
    return float(np.float32(x))


def _effective(a: float, b: float, c: float) -> tuple[int, int]:
    """Q31 multiplier of a * b / c, the product computed in float32 as the reference does."""
    return quantize_multiplier(float(np.float32(a) * np.float32(b) / np.float32(c)))


def _cell_shift(scale: float) -> int | None:
    """log2 of a power-of-two cell-state scale (NNAPI's CheckedLog2), else None."""
    exact = math.log(_f32(scale)) / math.log(2.0)
    rounded = round(exact)
    return int(rounded) if abs(exact - rounded) < 1e-3 else None


def _kernel(call: Call) -> list[np.ndarray]:
    ins = call.ins
    present = [a.value is not None and (not a.type.is_tensor or np.size(a.value) > 0)
               for a in ins]
    _check_presence(call, present)
    val = [np.asarray(a.value, np.int64) if present[i] and a.type.is_tensor else None
           for i, a in enumerate(ins)]
    x, h_prev, c_prev = val[INPUT], val[OUTPUT_STATE_IN], val[CELL_STATE_IN]
    _check_shapes(call, val)
    cifg = not present[1]
    layer_norm = present[LAYER_NORM_W[1]]
    x_arg, h_arg, c_arg = ins[INPUT], ins[OUTPUT_STATE_IN], ins[CELL_STATE_IN]

    cell_shift = _cell_shift(c_arg.scale)
    # cell_shift + 15 integer bits for tanh(cell) must lie in gemmlowp's 0..6.
    if cell_shift is None or not -15 <= cell_shift <= -9:
        raise call.fail("cell state scale must be a power of two between 2^-15 and 2^-9")
    intermediate = [ins[i].value for i in INTERMEDIATE_SCALE]

    def gate(k: int, peephole_k: int | None, cell) -> np.ndarray:
        """Pre-activation of gate k (0 input, 1 forget, 2 cell, 3 output), Q3.12."""
        scale = intermediate[k]
        if not scale > 0:
            raise call.fail(f"input {INTERMEDIATE_SCALE[k]}: intermediate scale must be > 0")
        w_in, w_rec = val[INPUT_W[k]], val[RECURRENT_W[k]]
        acc = (x - x_arg.zero_point) @ w_in.T
        if not layer_norm:
            acc = acc + val[BIAS[k]]
        g = _sat16(multiply_by_quantized_multiplier(acc, *_effective(ins[INPUT_W[k]].scale, x_arg.scale, scale)))
        acc = (h_prev - h_arg.zero_point) @ w_rec.T
        g = _sat16(g + multiply_by_quantized_multiplier(acc, *_effective(ins[RECURRENT_W[k]].scale, h_arg.scale, scale)))
        if peephole_k is not None and present[PEEPHOLE_W[peephole_k]]:
            p = ins[PEEPHOLE_W[peephole_k]]
            q = quantize_multiplier(_f32(2.0 ** cell_shift * _f32(p.scale) / _f32(scale)))
            g = _sat16(g + multiply_by_quantized_multiplier(val[PEEPHOLE_W[peephole_k]] * cell, *q))
        if layer_norm:
            ln = ins[LAYER_NORM_W[k]]
            limit = min(1, int(np.float32(10000) * np.float32(ln.scale)))
            g = _layer_norm(g, val[LAYER_NORM_W[k]], val[BIAS[k]],
                            quantize_multiplier(_f32(ln.scale)), limit)
        return g

    f = logistic16(gate(1, 1, c_prev), 3)
    g = tanh16(gate(2, None, None), 3)
    i = _wrap(I16_MAX - f, 16) if cifg else logistic16(gate(0, 0, c_prev), 3)
    c = _sat16(_wrap(rounding_divide_by_pot(f * c_prev, 15), 16)
               + _wrap(rounding_divide_by_pot(i * g, 30 + cell_shift), 16))
    cell_clip = _f32(ins[CELL_CLIP].value)
    if cell_clip > 0:
        q_clip = int(min(max(np.float32(cell_clip) / np.float32(c_arg.scale), -32768.0), 32767.0))
        c = np.clip(c, -q_clip, q_clip)
    o = logistic16(gate(3, 2, c), 3)

    hidden_scale = _f32(ins[HIDDEN_SCALE].value)
    # The reference reads the INT32 zero point as an int8 (its low byte).
    hidden_zp = int(_wrap(int(ins[HIDDEN_ZERO_POINT].value), 8))
    if not hidden_scale > 0:
        raise call.fail(f"input {HIDDEN_SCALE}: hidden state scale must be > 0")
    q_hidden = quantize_multiplier(_f32(2.0 ** -15 / hidden_scale * 2.0 ** -15))
    hidden = np.clip(multiply_by_quantized_multiplier(o * tanh16(c, cell_shift + 15), *q_hidden) - hidden_zp, -128, 127)

    if present[PROJ_W]:
        w = val[PROJ_W]
        bias = val[PROJ_B] if present[PROJ_B] else 0
        acc = bias + hidden_zp * w.sum(axis=1) + hidden @ w.T
        q_proj = _effective(ins[PROJ_W].scale, hidden_scale, h_arg.scale)
        out = np.clip(multiply_by_quantized_multiplier(acc, *q_proj) + h_arg.zero_point, -128, 127)
        proj_clip = _f32(ins[PROJ_CLIP].value)
        if proj_clip > 0:
            q_clip = int(min(max(np.float32(proj_clip) / np.float32(ins[PROJ_W].scale),
                                 -128.0), 127.0))
            out = np.clip(out, -q_clip, q_clip)
    else:
        out = hidden
    out = out.astype(np.int8)
    return [out, c.astype(np.int16), out.copy()]


def _check_presence(call: Call, present: list[bool]) -> None:
    """NNAPI's rules on the optional operands (checked when the request is known)."""
    for i in _REQUIRED:
        if not present[i]:
            raise call.fail(f"required input {i} is omitted")
    cifg = not present[1]
    if present[5] == cifg:
        raise call.fail("input-to-input and recurrent-to-input weights must be both given or "
                        "both omitted (CIFG)")
    if present[BIAS[0]] == cifg:
        raise call.fail("the input gate bias must be given exactly when the input gate is "
                        "(no CIFG)")
    peep = [present[i] for i in PEEPHOLE_W]
    if any(peep) and not (peep[1] and peep[2] and (peep[0] or cifg)):
        raise call.fail("cell-to-forget and cell-to-output weights (and cell-to-input without "
                        "CIFG) must be all given or all omitted")
    ln = [present[i] for i in LAYER_NORM_W]
    if cifg and ln[0]:
        raise call.fail("input layer norm weights given with CIFG")
    if len(set(ln[1:] + ([] if cifg else ln[:1]))) > 1:
        raise call.fail("layer normalization weights must be all given or all omitted")


def _check_shapes(call: Call, val: list) -> None:
    """The dimension rules of NNAPI's QLSTM prepare()."""
    x = val[INPUT]
    if x.ndim != 2:
        raise call.fail(f"input 0 must have rank 2, got {x.ndim}")
    batch, input_size = x.shape
    units = val[INPUT_W[3]].shape[0] if val[INPUT_W[3]].ndim == 2 else -1
    out_size = val[RECURRENT_W[3]].shape[1] if val[RECURRENT_W[3]].ndim == 2 else -1
    want = {i: (units, input_size) for i in INPUT_W}
    want.update({i: (units, out_size) for i in RECURRENT_W})
    want.update({i: (units,) for i in PEEPHOLE_W + BIAS + LAYER_NORM_W})
    want.update({PROJ_W: (out_size, units), PROJ_B: (out_size,),
                 OUTPUT_STATE_IN: (batch, out_size), CELL_STATE_IN: (batch, units)})
    for i, shape in want.items():
        if val[i] is not None and val[i].shape != shape:
            raise call.fail(f"input {i} has shape {list(val[i].shape)}, expected {list(shape)}")
    if val[PROJ_W] is None and out_size != units:
        raise call.fail(f"output size {out_size} differs from the number of units {units} "
                        f"without projection")


# --- validation and shapes --------------------------------------------------------

def _validate(op: OpView) -> HalVersion:
    op.expect_counts(32, 3)
    op.expect_types(_SIGNATURE, _OUTPUTS)
    for i in _REQUIRED:
        if maybe_omitted(op, i):
            raise op.fail(f"required input {i} is omitted")
    for pos, o in enumerate(op.inputs):
        if o.type.is_quantized and maybe_omitted(op, pos) is not True:
            _check_quant(op, f"input {pos}", o)
    for pos, o in enumerate(op.outputs):
        _check_quant(op, f"output {pos}", o)
    for i in (INPUT, OUTPUT_STATE_IN, CELL_STATE_IN) + INPUT_W[1:] + RECURRENT_W[1:]:
        op.expect_rank(i, 2)
    for i in BIAS[1:]:
        op.expect_rank(i, 1)
    for i in (1, 5, PROJ_W):
        if maybe_omitted(op, i) is False:
            op.expect_rank(i, 2)
    for i in PEEPHOLE_W + (BIAS[0], PROJ_B) + LAYER_NORM_W:
        if maybe_omitted(op, i) is False:
            op.expect_rank(i, 1)
    for i in (CELL_CLIP, PROJ_CLIP):
        v = op.value(i)
        if v is not None and v < 0:
            raise op.fail(f"input {i}: clipping threshold must be >= 0, got {v}")
    zp = op.value(HIDDEN_ZERO_POINT)
    if zp is not None and not -128 <= zp <= 127:
        raise op.fail(f"input {HIDDEN_ZERO_POINT}: hidden state zero point {zp} "
                      f"outside [-128, 127]")
    return HalVersion.V1_3


def _check_quant(op: OpView, name: str, o) -> None:
    if not o.scale > 0:
        raise op.fail(f"{name} needs a positive scale, got {o.scale}")
    lo, hi = qrange(o.type)
    if o.type in (T.TENSOR_QUANT8_SYMM, T.TENSOR_QUANT16_SYMM) and o.zero_point != 0:
        raise op.fail(f"{name} is symmetric: zero point must be 0")
    if not lo <= o.zero_point <= hi:
        raise op.fail(f"{name} zero point {o.zero_point} outside [{lo}, {hi}]")


def _first_known(*extents: int) -> int:
    return next((e for e in extents if e), 0)


def _shape(op: OpView) -> list[tuple[int, ...]]:
    batch = _first_known(dim(op, INPUT, 0), dim(op, OUTPUT_STATE_IN, 0), dim(op, CELL_STATE_IN, 0))
    out_size = _first_known(dim(op, OUTPUT_STATE_IN, 1), dim(op, RECURRENT_W[3], 1))
    units = _first_known(dim(op, CELL_STATE_IN, 1), dim(op, INPUT_W[3], 0))
    return [(batch, out_size), (batch, units), (batch, out_size)]


register(OperationType.QUANTIZED_LSTM, validate=_validate, shape=_shape, kernel=_kernel)
