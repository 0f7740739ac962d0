"""LSTM family: LSTM (HAL 1.0, layer normalization HAL 1.2),
UNIDIRECTIONAL_SEQUENCE_LSTM, BIDIRECTIONAL_SEQUENCE_LSTM (HAL 1.2, state
outputs HAL 1.3) and QUANTIZED_16BIT_LSTM (HAL 1.2).

One float cell (:func:`run_lstm`) serves the three float operations: it
projects the whole input sequence with one matmul per direction, then does one
recurrent matmul per time step. Semantics follow NNAPI's reference:
* CIFG (no input-to-input weights): input gate = 1 - forget gate;
* peephole: the input and forget gates see the previous cell state, the output
  gate the new one;
* layer normalization: each gate's pre-activation (matmuls + peephole) is
  normalized per batch row, scaled by its weights, and only then gets its
  bias;
* the cell state is clipped to ±cell_clip and the projection to ±proj_clip
  when the clip is > 0.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..model.types import HalVersion, OperandType as T, OperationType
from .common import (check_quant_params, multiply_by_quantized_multiplier, quantize_multiplier,
                     rounding_divide_by_pot)
from .recurrent import (bidi_sequence_shape, dim, expect_float_signature, maybe_omitted, real, required,
                        time_major_view, version_of)
from .registry import Arg, Call, OpView, register

_LAYER_NORM_EPSILON = 1e-8  # as in NNAPI's (TF Lite's) reference


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


# LSTM's activation parameter uses TF Lite's activation codes, not FuseCode.
_CELL_ACTIVATIONS = {
    0: lambda x: x,
    1: lambda x: np.maximum(x, 0.0),
    3: lambda x: np.clip(x, 0.0, 6.0),
    4: np.tanh,
    6: _sigmoid,
}


def _normalize(x: np.ndarray) -> np.ndarray:
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + _LAYER_NORM_EPSILON)


@dataclass
class Cell:
    """The weights of one LSTM direction, float64, None where omitted."""

    input_w: list          # input-to-{input, forget, cell, output} [units, input]
    recurrent_w: list      # recurrent-to-{...} [units, output]
    peephole: list         # cell-to-{input, forget, output} [units]
    bias: list             # {input, forget, cell, output} gate bias [units]
    proj_w: np.ndarray | None
    proj_b: np.ndarray | None
    layer_norm: list       # {input, forget, cell, output} [units]
    aux_w: list            # aux-input-to-{...} [units, aux_input]
    activation: int
    cell_clip: float
    proj_clip: float

    @classmethod
    def from_args(cls, ins: list[Arg], first: int, layer_norm: list[int] | None,
                  aux: list[int] | None, activation: int, cell_clip, proj_clip) -> "Cell":
        """``first``: index of the input-to-input weights; the 17 weight
        operands follow in NNAPI order (4 input, 4 recurrent, 3 peephole,
        4 bias, projection weights and bias)."""
        w = [real(ins[first + k]) for k in range(17)]
        return cls(w[0:4], w[4:8], w[8:11], w[11:15], w[15], w[16],
                   [real(ins[i]) for i in layer_norm] if layer_norm else [None] * 4,
                   [real(ins[i]) for i in aux] if aux else [None] * 4,
                   activation, float(cell_clip or 0.0), float(proj_clip or 0.0))

    def check(self, fail) -> None:
        """Run-time consistency of the optional operands (NNAPI's rules)."""
        if self.activation not in _CELL_ACTIVATIONS:
            raise fail(f"unsupported activation {self.activation}")
        if self.cell_clip < 0 or self.proj_clip < 0:
            raise fail("clipping thresholds must be >= 0")
        cifg = self.input_w[0] is None
        if (self.recurrent_w[0] is None) != cifg or (self.bias[0] is None) != cifg:
            raise fail("input-to-input weights, recurrent-to-input weights and input gate "
                       "bias must be all given or all omitted")
        if any(x is None for x in self.input_w[1:] + self.recurrent_w[1:] + self.bias[1:]):
            raise fail("a required weight or bias is missing")
        peep = self.peephole
        if not (all(p is None for p in peep) or
                (peep[1] is not None and peep[2] is not None and (peep[0] is not None) != cifg)):
            raise fail("peephole weights must be all given (cell-to-input only without CIFG) "
                       "or all omitted")
        ln = self.layer_norm
        if not (all(x is None for x in ln) or
                (all(x is not None for x in ln[1:]) and (ln[0] is not None) != cifg)):
            raise fail("layer normalization weights must be all given (input one only "
                       "without CIFG) or all omitted")
        if self.proj_w is None and self.proj_b is not None:
            raise fail("projection bias given without projection weights")
        aux = self.aux_w
        if any(a is not None for a in aux) and (
                any(a is None for a in aux[1:]) or (aux[0] is not None) == cifg):
            raise fail("aux input weights must be all given (aux-input-to-input only "
                       "without CIFG) or all omitted")

    @property
    def units(self) -> int:
        return self.input_w[3].shape[0]

    @property
    def output_size(self) -> int:
        return self.recurrent_w[3].shape[1]


def run_lstm(cell: Cell, xs: np.ndarray, h: np.ndarray, c: np.ndarray,
             aux_xs: np.ndarray | None = None, reverse: bool = False):
    """Run ``cell`` over the time-major sequence ``xs`` [T, B, I].

    Returns (outputs [T, B, output_size] at the time position of each input,
    last output state, last cell state, scratch [B, gates * units])."""
    cifg = cell.input_w[0] is None
    gates = [1, 2, 3] if cifg else [0, 1, 2, 3]  # rows present: input, forget, cell, output
    slot = {g: k for k, g in enumerate(gates)}
    n_gates, units = len(gates), cell.units
    layer_norm = cell.layer_norm[1] is not None
    steps, batch = xs.shape[:2]

    # Input projections of every time step at once: [T, B, gates, units].
    wx = np.concatenate([cell.input_w[g] for g in gates])
    proj = (xs @ wx.T).reshape(steps, batch, n_gates, units)
    if aux_xs is not None and cell.aux_w[1] is not None:
        wa = np.concatenate([cell.aux_w[g] for g in gates])
        proj += (aux_xs @ wa.T).reshape(steps, batch, n_gates, units)
    bias = np.stack([cell.bias[g] for g in gates])
    if not layer_norm:
        proj += bias
    wr_t = np.concatenate([cell.recurrent_w[g] for g in gates]).T
    act = _CELL_ACTIVATIONS[cell.activation]
    peep_i, peep_f, peep_o = cell.peephole

    def finish_gate(z, g):
        if layer_norm:
            z = _normalize(z) * cell.layer_norm[g] + bias[slot[g]]
        return z

    out = np.empty((steps, batch, cell.output_size))
    order = range(steps - 1, -1, -1) if reverse else range(steps)
    for t in order:
        z = proj[t] + (h @ wr_t).reshape(batch, n_gates, units)
        zf = z[:, slot[1]]
        if peep_f is not None:
            zf = zf + peep_f * c
        f = _sigmoid(finish_gate(zf, 1))
        if cifg:
            i = 1.0 - f
        else:
            zi = z[:, slot[0]]
            if peep_i is not None:
                zi = zi + peep_i * c
            i = _sigmoid(finish_gate(zi, 0))
        g = act(finish_gate(z[:, slot[2]], 2))
        c = f * c + i * g
        if cell.cell_clip > 0:
            c = np.clip(c, -cell.cell_clip, cell.cell_clip)
        zo = z[:, slot[3]]
        if peep_o is not None:
            zo = zo + peep_o * c
        o = _sigmoid(finish_gate(zo, 3))
        h = o * act(c)
        if cell.proj_w is not None:
            h = h @ cell.proj_w.T
            if cell.proj_b is not None:
                h = h + cell.proj_b
            if cell.proj_clip > 0:
                h = np.clip(h, -cell.proj_clip, cell.proj_clip)
        out[t] = h
    # The reference keeps gate activations in its scratch buffer, one block
    # per gate (input, cell, forget, output); nothing reads it back.
    if steps:
        blocks = [g, f, o] if cifg else [i, g, f, o]
        scratch = np.stack(blocks).reshape(batch, n_gates * units)
    else:
        scratch = np.zeros((batch, n_gates * units))
    return out, h, c, scratch


# --- validation helpers -----------------------------------------------------

def _expect_activation(op: OpView, i: int) -> None:
    act = op.value(i)
    if act is not None and act not in _CELL_ACTIVATIONS:
        raise op.fail(f"input {i}: unsupported activation {act} (0, 1, 3, 4 or 6)")


def _expect_clips(op: OpView, *indexes: int) -> None:
    for i in indexes:
        v = op.value(i)
        if v is not None and v < 0:
            raise op.fail(f"input {i}: clipping threshold must be >= 0, got {v}")


def _expect_cell_ranks(op: OpView, first: int) -> None:
    """Ranks of the required weights of a cell whose input-to-input weights
    are input ``first`` (optional operands may be declared with any shape)."""
    for k in (1, 2, 3, 5, 6, 7):
        op.expect_rank(first + k, 2)
    for k in (12, 13, 14):
        op.expect_rank(first + k, 1)


def _scratch_width(op: OpView) -> int:
    units = dim(op, 4, 0)
    omitted = maybe_omitted(op, 1)
    if not units or omitted is None:
        return 0
    return units * (3 if omitted else 4)


def _out(dtype, *arrays) -> list[np.ndarray]:
    return [a.astype(dtype) for a in arrays]


# --- LSTM (HAL 1.0; 27 inputs with layer normalization: HAL 1.2) --------------

def _validate_lstm(op: OpView) -> HalVersion:
    op.expect_counts((23, 27), 4)
    tensors = list(range(20)) + list(range(23, len(op.inputs)))
    t = expect_float_signature(op, tensors=tensors, ints=(20,), float_scalars=(21, 22))
    op.expect_rank(0, 2)
    op.expect_rank(18, 2)
    op.expect_rank(19, 2)
    _expect_cell_ranks(op, 1)
    _expect_activation(op, 20)
    _expect_clips(op, 21, 22)
    return HalVersion.V1_2 if len(op.inputs) == 27 else version_of(t)


def _shape_lstm(op: OpView) -> list[tuple[int, ...]]:
    batch, units, out = dim(op, 0, 0), dim(op, 4, 0), dim(op, 8, 1)
    return [(batch, _scratch_width(op)), (batch, out), (batch, units), (batch, out)]


def _kernel_lstm(call: Call) -> list[np.ndarray]:
    ins = call.ins
    ln = [23, 24, 25, 26] if len(ins) == 27 else None
    cell = Cell.from_args(ins, 1, ln, None, ins[20].value, ins[21].value, ins[22].value)
    cell.check(call.fail)
    x, h, c = required(call, 0, 18, 19)
    out, h, c, scratch = run_lstm(cell, x[None], h, c)
    return _out(call.outs[0].type.dtype, scratch, h, c, out[0])


register(OperationType.LSTM, validate=_validate_lstm, shape=_shape_lstm, kernel=_kernel_lstm)


# --- UNIDIRECTIONAL_SEQUENCE_LSTM (HAL 1.2; state outputs HAL 1.3) -------------
# Inputs as LSTM's first 23, then 23 time_major (BOOL), 24-27 layer norm.

def _validate_seq_lstm(op: OpView) -> HalVersion:
    op.expect_counts(28, (1, 3))
    tensors = list(range(20)) + list(range(24, 28))
    expect_float_signature(op, tensors=tensors, ints=(20,), float_scalars=(21, 22), bools=(23,))
    op.expect_rank(0, 3)
    op.expect_rank(18, 2)
    op.expect_rank(19, 2)
    _expect_cell_ranks(op, 1)
    _expect_activation(op, 20)
    _expect_clips(op, 21, 22)
    return HalVersion.V1_3 if len(op.outputs) == 3 else HalVersion.V1_2


def _shape_seq_lstm(op: OpView) -> list[tuple[int, ...]]:
    units, out = dim(op, 4, 0), dim(op, 8, 1)
    tm = op.value(23)
    batch = 0 if tm is None else dim(op, 0, 1 if tm else 0)
    seq = (dim(op, 0, 0), dim(op, 0, 1), out) if tm is not None else (0, 0, out)
    return [seq, (batch, out), (batch, units)][:len(op.outputs)]


def _kernel_seq_lstm(call: Call) -> list[np.ndarray]:
    ins = call.ins
    cell = Cell.from_args(ins, 1, [24, 25, 26, 27], None, ins[20].value, ins[21].value,
                          ins[22].value)
    cell.check(call.fail)
    time_major = bool(ins[23].value)
    x, h, c = required(call, 0, 18, 19)
    out, h, c, _ = run_lstm(cell, time_major_view(x, time_major), h, c)
    results = [time_major_view(out, time_major)]
    if len(call.outs) == 3:
        results += [h, c]
    return _out(call.outs[0].type.dtype, *results)


register(OperationType.UNIDIRECTIONAL_SEQUENCE_LSTM, validate=_validate_seq_lstm,
         shape=_shape_seq_lstm, kernel=_kernel_seq_lstm)


# --- BIDIRECTIONAL_SEQUENCE_LSTM (HAL 1.2; state outputs HAL 1.3) --------------
# 0 input; 1-17 forward weights; 18-34 backward weights; 35-38 fw h, fw c,
# bw h, bw c; 39 aux input; 40-43 fw aux weights; 44-47 bw aux weights;
# 48 activation; 49-50 clips; 51 merge_outputs; 52 time_major; 53-56 fw and
# 57-60 bw layer norm weights.
# Outputs: fw output (fw+bw merged along the last axis when merge_outputs),
# bw output unless merged, then optionally fw h, fw c, bw h, bw c (HAL 1.3).
# Aux input with aux weights: both directions also read the aux input;
# aux input without aux weights (HAL 1.3, "parallel linking"): the backward
# cell reads the aux input instead of the input.

_BIDI_TENSORS = list(range(48)) + list(range(53, 61))


def _validate_bidi_lstm(op: OpView) -> HalVersion:
    op.expect_counts(61, (1, 2, 5, 6))
    expect_float_signature(op, tensors=_BIDI_TENSORS, ints=(48,), float_scalars=(49, 50),
                           bools=(51, 52))
    op.expect_rank(0, 3)
    for i in range(35, 39):
        op.expect_rank(i, 2)
    _expect_cell_ranks(op, 1)
    _expect_cell_ranks(op, 18)
    _expect_activation(op, 48)
    _expect_clips(op, 49, 50)
    # One sequence output when merged (1 or 5 outputs), two otherwise; the
    # four trailing final-state outputs came with HAL 1.3.
    n, merge = len(op.outputs), op.value(51)
    if merge is not None and bool(merge) != (n % 2 == 1):
        raise op.fail(f"{n} outputs do not fit merge_outputs={bool(merge)}")
    version = HalVersion.V1_3 if n >= 5 else HalVersion.V1_2
    if maybe_omitted(op, 39) is False and all(maybe_omitted(op, i) for i in range(40, 48)):
        version = HalVersion.V1_3  # parallel linking
    return version


def _shape_bidi_lstm(op: OpView) -> list[tuple[int, ...]]:
    return bidi_sequence_shape(op, (4, 8), (21, 25), 52)


def _kernel_bidi_lstm(call: Call) -> list[np.ndarray]:
    ins = call.ins
    act, cell_clip, proj_clip = ins[48].value, ins[49].value, ins[50].value
    merge, time_major = bool(ins[51].value), bool(ins[52].value)
    if merge != (len(call.outs) % 2 == 1):
        raise call.fail(f"{len(call.outs)} outputs do not fit merge_outputs={merge}")
    fw = Cell.from_args(ins, 1, [53, 54, 55, 56], [40, 41, 42, 43], act, cell_clip, proj_clip)
    bw = Cell.from_args(ins, 18, [57, 58, 59, 60], [44, 45, 46, 47], act, cell_clip, proj_clip)
    fw.check(call.fail)
    bw.check(call.fail)
    x, fw_h0, fw_c0, bw_h0, bw_c0 = required(call, 0, 35, 36, 37, 38)
    xs = time_major_view(x, time_major)
    aux = real(ins[39])
    aux_xs = None if aux is None else time_major_view(aux, time_major)
    has_aux_w = fw.aux_w[1] is not None
    if has_aux_w != (bw.aux_w[1] is not None):
        raise call.fail("forward and backward aux weights must be both given or both omitted")
    if has_aux_w and aux_xs is None:
        raise call.fail("aux weights given without an aux input")
    bw_xs = aux_xs if aux_xs is not None and not has_aux_w else xs
    fw_seq, fw_h, fw_c, _ = run_lstm(fw, xs, fw_h0, fw_c0, aux_xs)
    bw_seq, bw_h, bw_c, _ = run_lstm(bw, bw_xs, bw_h0, bw_c0, aux_xs if has_aux_w else None,
                                     reverse=True)
    seqs = [np.concatenate([fw_seq, bw_seq], axis=-1)] if merge else [fw_seq, bw_seq]
    results = [time_major_view(s, time_major) for s in seqs]
    if len(call.outs) > len(results):
        results += [fw_h, fw_c, bw_h, bw_c]
    return _out(call.outs[0].type.dtype, *results)


register(OperationType.BIDIRECTIONAL_SEQUENCE_LSTM, validate=_validate_bidi_lstm,
         shape=_shape_bidi_lstm, kernel=_kernel_bidi_lstm)


# --- QUANTIZED_16BIT_LSTM (HAL 1.2) ---------------------------------------------
# 0 input [B, I] and 14 previous output [B, N]: QUANT8_ASYMM, scale 1/128,
# zero point 128; 1-8 input-to-{i,f,c,o} [N, I] and recurrent-to-{i,f,c,o}
# [N, N] weights: QUANT8_ASYMM sharing one scale and zero point; 9-12 gate
# biases: INT32, scale weights_scale/128, zero point 0; 13 previous cell
# state [B, N]: QUANT16_SYMM, scale 2^-11. Outputs: cell state (as input 13)
# and output (as input 14).
#
# NNAPI's reference is 16-bit fixed point (gemmlowp): the gate accumulators
# are requantized to Q3.12, gates are Q0.15, the cell state Q4.11. The
# kernel reproduces every integer rounding step exactly; only the logistic
# and tanh tables are evaluated in float and rounded to Q0.15 (gemmlowp's
# polynomial approximations differ by a unit or two there, which the output
# rounding absorbs).

_INT16_MIN, _INT16_MAX = -32768, 32767


def _srdhm(a: np.ndarray, b, bits: int) -> np.ndarray:
    """gemmlowp SaturatingRoundingDoublingHighMul for ``bits``-bit integers
    (int64 arrays holding the values). The only overflow case, MIN * MIN,
    saturates to MAX."""
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    ab = a * b
    nudge = np.where(ab >= 0, 1 << (bits - 2), 1 - (1 << (bits - 2)))
    total = ab + nudge
    # C integer division truncates toward zero.
    q = np.sign(total) * (np.abs(total) >> (bits - 1))
    return np.where((a == lo) & (b == lo), hi, q)


def _q15(x: np.ndarray) -> np.ndarray:
    """Real values in [-1, 1] -> Q0.15 raw int16 values (int64 arrays)."""
    return np.clip(np.floor(x * 32768.0 + 0.5), _INT16_MIN, _INT16_MAX).astype(np.int64)


_Q_WEIGHTS = range(1, 9)
_Q_BIASES = range(9, 13)


def _same_scale(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-6 * abs(b)


def _validate_quantized_lstm(op: OpView) -> HalVersion:
    op.expect_counts(15, 2)
    q8, q16 = T.TENSOR_QUANT8_ASYMM, T.TENSOR_QUANT16_SYMM
    op.expect_types([q8] * 9 + [T.TENSOR_INT32] * 4 + [q16, q8], [q16, q8])
    check_quant_params(op)
    for i in (0, 13, 14):
        op.expect_rank(i, 2)
    for i in _Q_WEIGHTS:
        op.expect_rank(i, 2)
    for i in _Q_BIASES:
        op.expect_rank(i, 1)
    for name, o in (("input 0", op.inputs[0]), ("input 14", op.inputs[14]),
                    ("output 1", op.outputs[1])):
        if not (_same_scale(o.scale, 1 / 128) and o.zero_point == 128):
            raise op.fail(f"{name} must have scale 1/128 and zero point 128")
    for name, o in (("input 13", op.inputs[13]), ("output 0", op.outputs[0])):
        if not _same_scale(o.scale, 2.0 ** -11):
            raise op.fail(f"{name} must have scale 2^-11 (4 integer bits)")
    w = op.inputs[1]
    for i in _Q_WEIGHTS:
        if op.inputs[i].scale != w.scale or op.inputs[i].zero_point != w.zero_point:
            raise op.fail(f"input {i}: all weights must share one scale and zero point")
    for i in _Q_BIASES:
        b = op.inputs[i]
        if not _same_scale(b.scale, w.scale / 128) or b.zero_point != 0:
            raise op.fail(f"input {i}: bias scale must be weights scale / 128, zero point 0")
    return HalVersion.V1_2


def _shape_quantized_lstm(op: OpView) -> list[tuple[int, ...]]:
    state = (dim(op, 0, 0), dim(op, 14, 1))
    return [state, state]


def _kernel_quantized_lstm(call: Call) -> list[np.ndarray]:
    ins = call.ins
    x = ins[0].value.astype(np.int64) - 128
    h = ins[14].value.astype(np.int64) - 128
    c = ins[13].value.astype(np.int64)
    w_zero = ins[1].zero_point
    multiplier, shift = quantize_multiplier(4096.0 * float(np.float32(ins[9].scale)))

    # NNAPI's reference multiplies the concatenation [input, previous output]
    # by the concatenation [recurrent weights | input weights]: the columns
    # line up only when input and output sizes are equal, and the CTS
    # expectations come from exactly that product, so it is reproduced here.
    concat = np.concatenate([x, h], axis=1)

    def gate_input(k: int) -> np.ndarray:
        """Gate k (0 input, 1 forget, 2 cell, 3 output) pre-activation in Q3.12."""
        weights = np.concatenate([ins[5 + k].value, ins[1 + k].value], axis=1)
        acc = ins[9 + k].value.astype(np.int64) + concat @ (weights.astype(np.int64) - w_zero).T
        acc = multiply_by_quantized_multiplier(acc, multiplier, shift)
        return np.clip(acc, _INT16_MIN, _INT16_MAX) / 4096.0

    def sigmoid_q15(k):
        return _q15(_sigmoid(gate_input(k)))

    i, f, o = sigmoid_q15(0), sigmoid_q15(1), sigmoid_q15(3)
    g = _q15(np.tanh(gate_input(2)))
    # i*g is Q0.15, rescaled to the Q4.11 state; f*c is Q0.15 * Q4.11 = Q4.11.
    new_c = rounding_divide_by_pot(_srdhm(i, g, 16), 4) + _srdhm(f, c, 16)
    new_c = np.clip(new_c, _INT16_MIN, _INT16_MAX)
    c_q312 = np.clip(new_c * 2, _INT16_MIN, _INT16_MAX)  # Q4.11 -> Q3.12, saturating
    out = _srdhm(o, _q15(np.tanh(c_q312 / 4096.0)), 16)
    out = np.clip(rounding_divide_by_pot(out, 8), -128, 127) + 128
    return [new_c.astype(np.int16), out.astype(np.uint8)]


register(OperationType.QUANTIZED_16BIT_LSTM, validate=_validate_quantized_lstm,
         shape=_shape_quantized_lstm, kernel=_kernel_quantized_lstm)
