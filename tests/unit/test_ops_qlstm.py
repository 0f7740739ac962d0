"""QUANTIZED_LSTM (nnrt/ops/qlstm.py): values, validation and shapes.

Expected values come from two independent sources, never from the kernel:
* AOSP's own HAL 1.3 test specs (frameworks/ml nn/runtime/test/specs/V1_3/
  qlstm.mod.py examples 1-2 and qlstm_noprojection.mod.py example 1): the
  exact outputs of NNAPI's reference implementation;
* tiny hand-computed cells whose scales make every requantization exact
  (input 2^-4 x weights 2^-8 over intermediate 2^-12 = multiplier 1, cell
  state 2^-15, hidden state 2^-7), so only sigmoid/tanh need a calculator.
  gemmlowp's 16-bit fixed-point sigmoid/tanh are off the exact functions by
  up to ~12/32768, so a cell value derived from a non-trivial sigmoid is
  checked within 3 units; everything else within the CTS tolerance (1).
"""
from __future__ import annotations

import math

import numpy as np
import pytest

import nnrt
from nnrt.errors import NnrtError
from nnrt.model.types import HalVersion, OperandType as T, OperationType as OT
from nnrt.ops.registry import OpView, definition

Q8, W8, Q16, I32T = (T.TENSOR_QUANT8_ASYMM_SIGNED, T.TENSOR_QUANT8_SYMM, T.TENSOR_QUANT16_SYMM,
                     T.TENSOR_INT32)
GATES = "ifco"


# --- building a QUANTIZED_LSTM model -------------------------------------------

def tensor(type, dims, value, scale=0.0, zero_point=0):
    """``value`` None = omitted optional operand (NO_VALUE)."""
    return dict(type=type, dims=tuple(dims), value=value, scale=scale, zero_point=zero_point)


def scalar(type, value):
    return dict(type=type, dims=(), value=value, scale=0.0, zero_point=0)


def tiny_cell(units=4, input_size=2, out_size=4, batch=1, **kw):
    """The 32 inputs of a cell whose weights and biases are all zero, with
    exact scales (see the module docstring). ``kw`` overrides by name:
    input, w_<gate>, r_<gate>, p_<gate> (peephole i/f/o), b_<gate>, proj_w,
    proj_b, h, c, ln_<gate>, cell_clip, proj_clip, hidden_zp, hidden_scale,
    cell_scale, h_scale, h_zp, proj_scale; a value None omits the operand."""
    def get(name, default):
        return kw.get(name, default)
    zeros_w = np.zeros((units, input_size), np.int8).tolist()
    zeros_r = np.zeros((units, out_size), np.int8).tolist()
    h_scale, h_zp = get("h_scale", 2.0 ** -4), get("h_zp", 0)
    ins = [tensor(Q8, (batch, input_size), get("input", [[1] * input_size] * batch), 2.0 ** -4)]
    ins += [tensor(W8, (units, input_size), get(f"w_{g}", zeros_w), 2.0 ** -8) for g in GATES]
    ins += [tensor(W8, (units, out_size), get(f"r_{g}", zeros_r), 2.0 ** -8) for g in GATES]
    ins += [tensor(Q16, (units,), get(f"p_{g}", None), 8.0) for g in "ifo"]
    ins += [tensor(I32T, (units,), get(f"b_{g}", [0] * units)) for g in GATES]
    ins += [tensor(W8, (out_size, units), get("proj_w", None), get("proj_scale", 0.5)),
            tensor(I32T, (out_size,), get("proj_b", None))]
    ins += [tensor(Q8, (batch, out_size), get("h", [[h_zp] * out_size] * batch), h_scale, h_zp),
            tensor(Q16, (batch, units), get("c", [[0] * units] * batch),
                   get("cell_scale", 2.0 ** -15))]
    ins += [tensor(Q16, (units,), get(f"ln_{g}", None), 2.0 ** -15) for g in GATES]
    ins += [scalar(T.FLOAT32, get("cell_clip", 0.0)), scalar(T.FLOAT32, get("proj_clip", 0.0))]
    ins += [scalar(T.FLOAT32, 2.0 ** -12) for _ in GATES]
    ins += [scalar(T.INT32, get("hidden_zp", 0)), scalar(T.FLOAT32, get("hidden_scale", 2.0 ** -7))]
    outs = [tensor(Q8, (batch, out_size), None, h_scale, h_zp),
            tensor(Q16, (batch, units), None, get("cell_scale", 2.0 ** -15)),
            tensor(Q8, (batch, out_size), None, h_scale, h_zp)]
    return ins, outs


def build(ins, outs, dynamic=False):
    """Tensors given become model inputs, omitted ones NO_VALUE, scalars constants.
    Returns (model, input values)."""
    m = nnrt.Model()
    model_inputs, values = [], []
    for k, s in enumerate(ins):
        m.add_operand(s["type"], list(s["dims"]), scale=s["scale"], zero_point=s["zero_point"])
        if s["type"].is_scalar:
            m.set_operand_value(k, s["value"])
        elif s["value"] is None:
            m.set_operand_value(k, None)
        else:
            model_inputs.append(k)
            values.append(np.asarray(s["value"], s["type"].dtype).reshape(s["dims"]))
    out_ids = []
    for s in outs:
        dims = [0] * len(s["dims"]) if dynamic else list(s["dims"])
        out_ids.append(m.add_operand(s["type"], dims, scale=s["scale"], zero_point=s["zero_point"]))
    m.add_operation(OT.QUANTIZED_LSTM, list(range(len(ins))), out_ids)
    m.identify_inputs_and_outputs(model_inputs, out_ids)
    m.finish()
    return m, values


def run(ins, outs, dynamic=False):
    model, values = build(ins, outs, dynamic)
    result = nnrt.run(model, values)
    return result


def hidden(o: float, c: float) -> float:
    """Hidden state in units of the 2^-7 hidden scale: o * tanh(c)."""
    return o * math.tanh(c) * 128


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


# --- AOSP V1_3 spec examples ---------------------------------------------------

_AOSP_WI = dict(
    i=[64, 77, 89, -102, -115, 13, 25, 38, -51, 64,
       -102, 89, -77, 64, -51, -64, -51, -38, -25, -13],
    f=[-77, -13, 38, 25, 115, -64, -25, -51, 38, -102,
       -51, 38, -64, -51, -77, 38, -51, -77, -64, -64],
    c=[-51, -38, -25, -13, -64, 64, -25, -38, -25, -77,
       77, -13, -51, -38, -89, 89, -115, -64, 102, 77],
    o=[-102, -51, -25, -115, -13, -89, 38, -38, -102, -25,
       77, -25, 51, -89, -38, -64, 13, 64, -77, -51])
_AOSP_WR = dict(  # [units, 4] (noprojection); the projection specs use the first 12 as [units, 3]
    i=[-25, -38, 51, 13, -64, 115, -25, -38, -89, 6, -25, -77],
    f=[-64, -38, -64, -25, 77, 51, 115, 38, -13, 25, 64, 25, 25, 38, -13, 51],
    c=[-38, 25, 13, -38, 102, -10, -25, 38, 102, -77, -13, 25, 38, -13, 25, 64],
    o=[38, -13, 13, -25, -64, -89, -25, -77, -13, -51, -89, -25, 13, 64, 25, -38])
_AOSP_BIAS = dict(i=[644245, 3221226, 4724464, 8160438], f=[2147484, -6442451, -4294968, 2147484],
                  c=[-1073742, 15461883, 5368709, 1717987], o=[1073742, -214748, 4294968, 2147484])
_AOSP_LN = dict(i=[3277, 6553, 9830, 16384], f=[6553, 6553, 13107, 9830],
                c=[22937, 6553, 9830, 26214], o=[19660, 6553, 6553, 16384])


def aosp_cell(cifg: bool, projection: bool):
    """The operands of qlstm.mod.py / qlstm_noprojection.mod.py (batch 2,
    input 5, units 4, output 3 with projection, 4 without; zero states)."""
    b, n_in, units = 2, 5, 4
    n_out = 3 if projection else 4
    skip = {"i"} if cifg else set()
    ins = [tensor(Q8, (b, n_in), [90, 102, 13, 26, 38, 102, 13, 26, 51, 64], 0.0078125)]
    ins += [tensor(W8, (units, n_in), None if g in skip else _AOSP_WI[g], 0.00784314)
            for g in GATES]
    ins += [tensor(W8, (units, n_out), None if g in skip else _AOSP_WR[g][:units * n_out],
                   0.00784314) for g in GATES]
    ins += [tensor(Q16, (units,), None, 1.0) for _ in "ifo"]
    ins += [tensor(I32T, (units,), None if g in skip else _AOSP_BIAS[g], 4.65661e-08)
            for g in GATES]
    ins += [tensor(W8, (n_out, units), [-25, 51, 3, -51, 25, 127, 77, 20, 18, 51, -102, 51]
                   if projection else None, 0.00392157),
            tensor(I32T, (n_out,), [0] * n_out if projection else None)]
    ins += [tensor(Q8, (b, n_out), [0] * (b * n_out), 3.05176e-05),
            tensor(Q16, (b, units), [0] * (b * units), 3.05176e-05)]
    ins += [tensor(Q16, (units,), None if g in skip else _AOSP_LN[g], 3.05182e-05) for g in GATES]
    ins += [scalar(T.FLOAT32, v) for v in (0.0, 0.0, 0.007059, 0.007812, 0.007059, 0.007812)]
    ins += [scalar(T.INT32, 0), scalar(T.FLOAT32, 0.007)]
    outs = [tensor(Q8, (b, n_out), None, 3.05176e-05), tensor(Q16, (b, units), None, 3.05176e-05),
            tensor(Q8, (b, n_out), None, 3.05176e-05)]
    return ins, outs


@pytest.mark.parametrize("cifg, projection, output, cell", [
    # qlstm.mod.py example 1: layer norm, projection.
    (False, True, [127, 127, -108, -67, 127, 127],
     [-14650, 8939, 5771, 6715, -11843, 7847, 1508, 12939]),
    # qlstm.mod.py example 2: CIFG, layer norm, projection.
    (True, True, [127, 127, 127, -128, 127, 127],
     [-11692, 9960, 5491, 8861, -9422, 7726, 2056, 13149]),
    # qlstm_noprojection.mod.py example 1: CIFG, layer norm.
    (True, False, [-15, 21, 14, 20, -15, 15, 5, 27],
     [-11692, 9960, 5491, 8861, -9422, 7726, 2056, 13149]),
])
@pytest.mark.parametrize("dynamic", [False, True])
def test_aosp_examples(cifg, projection, output, cell, dynamic):
    ins, outs = aosp_cell(cifg, projection)
    result = run(ins, outs, dynamic)
    state_out, cell_out, out = result.outputs
    n_out = 3 if projection else 4
    assert [tuple(s) for s in result.output_shapes] == [(2, n_out), (2, 4), (2, n_out)]
    assert out.dtype == np.int8 and cell_out.dtype == np.int16
    # The reference's integer outputs are matched exactly (CTS allows 1).
    np.testing.assert_array_equal(out.ravel(), output)
    np.testing.assert_array_equal(state_out.ravel(), output)
    np.testing.assert_array_equal(cell_out.ravel(), cell)


# --- hand-computed cells -------------------------------------------------------

def outputs(**kw):
    ins, outs = tiny_cell(**kw)
    return [np.asarray(o) for o in run(ins, outs).outputs]


def test_zero_gates_halve_the_cell():
    # All pre-activations 0: sigmoid = 1/2 exactly (16384), tanh = 0, so
    # c = c_prev / 2 rounded half away from zero, h = 0.5 * tanh(c).
    state, c, out = outputs(c=[[16384, -16384, 3, -3]])
    np.testing.assert_array_equal(c, [[8192, -8192, 2, -2]])
    expected = [round(hidden(0.5, 0.25)), -round(hidden(0.5, 0.25)), 0, 0]   # 15.67 -> 16
    np.testing.assert_allclose(out, [expected], atol=1)
    np.testing.assert_array_equal(out, state)


def test_gate_bias_without_layer_norm():
    # Cell-gate bias -8 / +8 in Q3.12 (multiplier 1): tanh(-+8) ~ -+1, i = 1/2:
    # c = +-16384, h = 0.5 * tanh(+-0.5).
    _, c, out = outputs(b_c=[-32768, 0, 32767, 0])
    np.testing.assert_allclose(c, [[-16384, 0, 16384, 0]], atol=1)
    h = hidden(0.5, 0.5)   # 29.6
    np.testing.assert_allclose(out, [[-h, 0, h, 0]], atol=1)


def test_recurrent_weights_and_output_state_zero_point():
    # Output state zero point -128: h - zp = [255, 0, 0, 0]; recurrent scale
    # 2^-8 x 2^-4 / 2^-12 = multiplier 1: cell-gate pre-activations
    # +-127 * 255 = +-32385 raw (+-7.9) -> g = +-tanh(7.9), i = 1/2: c = +-16384.
    kw = dict(h_zp=-128, h=[[127, -128, -128, -128]],
              r_c=[[127, 0, 0, 0], [-127, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]])
    _, c, out = outputs(**kw)
    np.testing.assert_allclose(c, [[16384, -16384, 0, 0]], atol=1)
    # The output is the hidden state in the hidden-state quantization (scale
    # 2^-7, zero point 0); NNAPI's reference does not use the output
    # operand's own scale or zero point.
    np.testing.assert_allclose(out, [[hidden(0.5, 0.5), -hidden(0.5, 0.5), 0, 0]], atol=1)


def test_cifg_input_gate_is_one_minus_forget():
    # CIFG: i = 32767 - 16384 = 16383 (Q0.15); g = tanh(-8): c = -16383.
    kw = dict(w_i=None, r_i=None, b_i=None, b_c=[-32768, 0, 0, 0])
    _, c, out = outputs(**kw)
    np.testing.assert_allclose(c, [[16383 / 32768 * -32768, 0, 0, 0]], atol=1)
    np.testing.assert_allclose(out, [[-hidden(0.5, 0.5), 0, 0, 0]], atol=1)


def test_peepholes_read_previous_then_new_cell_state():
    # Cell-to-gate weights scale 8: 2^-15 * 8 / 2^-12 = multiplier 1, so a
    # weight w adds w * c (raw) to the Q3.12 pre-activation. c_prev = 16384.
    # Forget weights [0, 1, -1, 0] on c_prev: f = sigmoid([0, 4, -4, 0]).
    # Output weight 1 on unit 3 reads the NEW cell 8192 (2.0): o = sigmoid(2)
    # (reading c_prev would give sigmoid(4): 31 instead of 28).
    kw = dict(c=[[16384] * 4], p_i=[0, 0, 0, 0], p_f=[0, 1, -1, 0], p_o=[0, 0, 0, 1])
    _, c, out = outputs(**kw)
    f = [0.5, sigmoid(4), sigmoid(-4), 0.5]
    c_real = [fk * 0.5 for fk in f]
    np.testing.assert_allclose(c, [[ck * 32768 for ck in c_real]], atol=3)
    o = [0.5, 0.5, 0.5, sigmoid(2)]
    np.testing.assert_allclose(out, [[hidden(ok, ck) for ok, ck in zip(o, c_real)]], atol=1)
    assert out[0, 3] == 28


def test_cell_clip():
    # 0.2 / 2^-15 = 6553.6 -> clip at 6553.
    _, c, out = outputs(c=[[16384, -16384, 3, -3]], cell_clip=0.2)
    np.testing.assert_array_equal(c, [[6553, -6553, 2, -2]])
    h = hidden(0.5, 6553 / 32768)   # 12.6
    np.testing.assert_allclose(out, [[h, -h, 0, 0]], atol=1)


@pytest.mark.parametrize("hidden_zp", [0, 5])
@pytest.mark.parametrize("proj_clip, expected", [(0.0, [19, -29, 8]), (10.0, [19, -20, 8])])
def test_projection(hidden_zp, proj_clip, expected):
    # Hidden state [16, -16, 0, 0] (see test_zero_gates_halve_the_cell) in
    # units of 2^-7; projection weights scale 0.5 into an output of scale
    # 2^-8 = multiplier 1; output zero point 3. Rows: h0, 2*h1, bias 5.
    # The clip is divided by the projection weights' scale (NNAPI's
    # reference): 10 / 0.5 = +-20. The hidden zero point cancels out.
    kw = dict(out_size=3, c=[[16384, -16384, 3, -3]], h_scale=2.0 ** -8, h_zp=3,
              proj_w=[[1, 0, 0, 0], [0, 2, 0, 0], [0, 0, 0, 0]], proj_b=[0, 0, 5],
              proj_clip=proj_clip, hidden_zp=hidden_zp)
    state, c, out = outputs(**kw)
    np.testing.assert_array_equal(c, [[8192, -8192, 2, -2]])
    np.testing.assert_array_equal(out, [expected])
    np.testing.assert_array_equal(state, out)


def test_omitted_projection_bias_is_zero():
    kw = dict(out_size=3, c=[[16384, -16384, 3, -3]], h_scale=2.0 ** -8, h_zp=3,
              proj_w=[[1, 0, 0, 0], [0, 2, 0, 0], [0, 0, 0, 0]])
    _, _, out = outputs(**kw)
    np.testing.assert_array_equal(out, [[19, -29, 3]])


def test_hidden_zero_point_without_projection():
    # NNAPI's reference stores the hidden state as value - zero point.
    _, _, out = outputs(c=[[16384, -16384, 3, -3]], hidden_zp=5)
    np.testing.assert_allclose(out, [[16 - 5, -16 - 5, -5, -5]], atol=1)


def test_layer_norm_constant_gate_uses_bias():
    # With layer norm, all weights zero: every gate is constant, its
    # normalized value 0 (zero variance), so only the bias remains. NNAPI's
    # layer norm adds the bias b to the Q?.10 normalized value times the
    # weight, divides by 1024 (rounded) and rescales by the layer-norm scale
    # (2^-15) times 2^12: b = 1 << 22 -> 4096 -> 4096 * 2^-3 = 512 raw Q3.12
    # = 0.125. So f = sigmoid(+-0.125) on units 1, 2; 1/2 elsewhere; i = 1/2,
    # g = 0: c = f * c_prev.
    ln = [32767] * 4
    kw = dict(c=[[16384] * 4], ln_i=ln, ln_f=ln, ln_c=ln, ln_o=ln,
              b_f=[0, 1 << 22, -(1 << 22), 0])
    _, c, _ = outputs(**kw)
    f = [0.5, sigmoid(0.125), sigmoid(-0.125), 0.5]
    np.testing.assert_allclose(c, [[fk * 16384 for fk in f]], atol=3)


# --- run-time failures -----------------------------------------------------------

def test_recurrent_to_input_omitted_alone_fails():
    ins, outs = tiny_cell(r_i=None)
    with pytest.raises(NnrtError):
        run(ins, outs)


def test_cell_scale_must_be_power_of_two():
    ins, outs = tiny_cell(cell_scale=3e-5)
    with pytest.raises(NnrtError):
        run(ins, outs)


# --- validation and shapes --------------------------------------------------------

def _view(ins, outs):
    model, _ = build(ins, outs)
    hal = model.hal_model
    return OpView(hal, None, hal.main.operations[0])


def test_validate_returns_v1_3_and_shapes():
    ins, outs = aosp_cell(cifg=False, projection=True)
    view = _view(ins, outs)
    assert definition(OT.QUANTIZED_LSTM).validate(view) == HalVersion.V1_3
    assert definition(OT.QUANTIZED_LSTM).shape(view) == [(2, 3), (2, 4), (2, 3)]


@pytest.mark.parametrize("change", [
    lambda ins, outs: ins.pop(),                                          # 31 inputs
    lambda ins, outs: ins[0].update(type=T.TENSOR_QUANT8_ASYMM),          # input not signed
    lambda ins, outs: ins[2].update(type=Q8),                             # weights not SYMM
    lambda ins, outs: ins[0].update(dims=(1, 1, 5), value=[[[0] * 5]]),   # input rank 3
    lambda ins, outs: ins[19].update(zero_point=1),                       # QUANT16_SYMM zp
    lambda ins, outs: ins[30].update(value=200),                          # hidden zp > 127
    lambda ins, outs: ins[24].update(value=-1.0),                         # negative cell clip
    lambda ins, outs: outs[1].update(type=Q8),                            # cell state out type
])
def test_validation_refusals(change):
    ins, outs = tiny_cell()
    change(ins, outs)
    with pytest.raises(NnrtError):
        run(ins, outs)   # the model is validated when compiled
