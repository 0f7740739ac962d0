"""Kernels, validation and shape inference of the recurrent family
(nnrt/ops/recurrent.py: RNN, SVDF, UNIDIRECTIONAL/BIDIRECTIONAL_SEQUENCE_RNN;
nnrt/ops/lstm.py: LSTM, UNIDIRECTIONAL/BIDIRECTIONAL_SEQUENCE_LSTM,
QUANTIZED_16BIT_LSTM).

Expected values are computed by hand or by the slow, one-batch-row-at-a-time
references below (written from the NNAPI equations, not from the kernels)."""
from __future__ import annotations

import math

import numpy as np
import pytest

import nnrt.ops  # noqa: F401  (registers the operations)
from nnrt.errors import NnrtError
from nnrt.model.graph import DataLocation, HalModel, Operand, Operation, Subgraph
from nnrt.model.types import HalVersion, OperandLifeTime as L, OperandType as T, OperationType as OT
from nnrt.ops.registry import Arg, Call, OpView, definition

F32, F16, I32, BOOL = T.TENSOR_FLOAT32, T.TENSOR_FLOAT16, T.INT32, T.BOOL
OMIT = "omit"
rng = np.random.default_rng(7)


# --- helpers -----------------------------------------------------------------

def spec(type, dims=(), value=None, scale=0.0, zero_point=0):
    """An operand description: ``value`` given = constant, OMIT = NO_VALUE."""
    return dict(type=type, dims=tuple(dims), value=value, scale=scale, zero_point=zero_point)


def view(op_type, inputs, outputs):
    blob = bytearray()
    operands = []
    for s in inputs + outputs:
        loc, life = None, L.SUBGRAPH_INPUT
        if isinstance(s["value"], str):
            life = L.NO_VALUE
        elif s["value"] is not None:
            raw = np.asarray(s["value"], s["type"].dtype).tobytes()
            loc, life = DataLocation(-1, len(blob), len(raw)), L.CONSTANT_COPY
            blob += raw + bytes(-len(raw) % 8)
        operands.append(Operand(s["type"], s["dims"], s["scale"], s["zero_point"], life, loc))
    n = len(inputs)
    op = Operation(op_type, tuple(range(n)), tuple(range(n, n + len(outputs))))
    sub = Subgraph(tuple(operands), (op,),
                   tuple(i for i in range(n) if operands[i].lifetime == L.SUBGRAPH_INPUT),
                   tuple(range(n, n + len(outputs))))
    return OpView(HalModel(sub, (), bytes(blob)), None, op)


def validate(op_type, inputs, outputs):
    return definition(op_type).validate(view(op_type, inputs, outputs))


def shape(op_type, inputs, outputs):
    return definition(op_type).shape(view(op_type, inputs, outputs))


def run(op_type, ins, outs):
    """ins: list of (type, value); value None = omitted."""
    args = []
    for t, v in ins:
        if v is not None and t.is_tensor:
            v = np.asarray(v, t.dtype)
        args.append(Arg(t, v))
    return definition(op_type).kernel(Call(op_type, args, [Operand(t) for t in outs], False, None))


def rand(*shape):
    return rng.uniform(-0.5, 0.5, shape).astype(np.float32)


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


# --- RNN ---------------------------------------------------------------------

def test_rnn_hand_computed():
    x = [[1.0, 2.0]]
    w = [[0.5, -1.0], [1.0, 1.0]]
    r = [[1.0, 0.0], [0.0, 2.0]]
    b = [0.5, -4.0]
    h = [[1.0, 0.5]]
    # unit 0: 0.5 - 2 + 1 + 0.5 = 0.0; unit 1: 3 + 1 - 4 = 0.0 -> relu: 0; use NONE too
    ins = [(F32, x), (F32, w), (F32, r), (F32, b), (F32, h), (I32, 0)]
    state, out = run(OT.RNN, ins, [F32, F32])
    np.testing.assert_allclose(out, [[0.0, 0.0]])
    b2 = [1.5, -6.0]  # unit 0: 1.0, unit 1: -2.0
    ins[3] = (F32, b2)
    ins[5] = (I32, 1)  # RELU
    state, out = run(OT.RNN, ins, [F32, F32])
    np.testing.assert_allclose(out, [[1.0, 0.0]])
    np.testing.assert_allclose(state, out)
    assert out.dtype == np.float32


def test_rnn_float16_output_type():
    ins = [(F16, [[1.0]]), (F16, [[2.0]]), (F16, [[0.5]]), (F16, [0.25]), (F16, [[1.0]]), (I32, 0)]
    state, out = run(OT.RNN, ins, [F16, F16])
    assert out.dtype == np.float16
    np.testing.assert_allclose(out, [[2.75]])


def rnn_reference(x, w, r, b, h, relu=True):
    """x: [T, input] for one batch row."""
    outs = []
    for xt in x:
        pre = [sum(w[u][k] * xt[k] for k in range(len(xt)))
               + sum(r[u][k] * h[k] for k in range(len(h))) + b[u] for u in range(len(b))]
        h = [max(p, 0.0) if relu else p for p in pre]
        outs.append(h)
    return np.array(outs)


def test_unidirectional_sequence_rnn_batch_major():
    batch, steps, inp, units = 2, 3, 3, 4
    x, w, r = rand(batch, steps, inp), rand(units, inp), rand(units, units)
    b, h = rand(units), rand(batch, units)
    ins = [(F32, x), (F32, w), (F32, r), (F32, b), (F32, h), (I32, 1), (I32, 0)]
    (out,) = run(OT.UNIDIRECTIONAL_SEQUENCE_RNN, ins, [F32])
    assert out.shape == (batch, steps, units)
    for n in range(batch):
        np.testing.assert_allclose(out[n], rnn_reference(x[n], w, r, b, h[n]), rtol=1e-5, atol=1e-6)
    # time-major input, with the HAL 1.3 final state output
    ins[0], ins[6] = (F32, np.swapaxes(x, 0, 1)), (I32, 1)
    out_tm, last = run(OT.UNIDIRECTIONAL_SEQUENCE_RNN, ins, [F32, F32])
    np.testing.assert_allclose(np.swapaxes(out_tm, 0, 1), out, rtol=1e-6)
    np.testing.assert_allclose(last, out[:, -1], rtol=1e-6)


def test_bidirectional_sequence_rnn_merged():
    batch, steps, inp, units = 1, 3, 2, 2
    x = rand(steps, batch, inp)
    fw = [rand(units, inp), rand(units, units), rand(units), rand(batch, units)]
    bw = [rand(units, inp), rand(units, units), rand(units), rand(batch, units)]
    ins = ([(F32, x)] + [(F32, a) for a in fw] + [(F32, a) for a in bw]
           + [(F32, None)] * 3 + [(I32, 1), (T.BOOL, True), (T.BOOL, True)])
    (out,) = run(OT.BIDIRECTIONAL_SEQUENCE_RNN, ins, [F32])
    assert out.shape == (steps, batch, 2 * units)
    fw_ref = rnn_reference(x[:, 0], *fw[:3], fw[3][0])
    bw_ref = rnn_reference(x[::-1, 0], *bw[:3], bw[3][0])[::-1]
    np.testing.assert_allclose(out[:, 0, :units], fw_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out[:, 0, units:], bw_ref, rtol=1e-5, atol=1e-6)


# --- SVDF --------------------------------------------------------------------

def test_svdf_rank2_hand_reference():
    batch, inp, units, rank, memory = 1, 2, 2, 2, 3
    filters = units * rank
    x, wf, wt, bias = rand(batch, inp), rand(filters, inp), rand(filters, memory), rand(units)
    state = rand(batch, filters * memory)
    ins = [(F32, x), (F32, wf), (F32, wt), (F32, bias), (F32, state), (I32, rank), (I32, 0)]
    state_out, out = run(OT.SVDF, ins, [F32, F32])
    # The memory of filter f: previous memory without its oldest entry... the
    # reference replaces the newest slot by the new activation, so:
    mem = state.reshape(filters, memory).copy()
    for f in range(filters):
        mem[f, -1] = sum(wf[f, k] * x[0, k] for k in range(inp))
    expect = [bias[u] + sum(mem[u * rank + r] @ wt[u * rank + r] for r in range(rank))
              for u in range(units)]
    np.testing.assert_allclose(out[0], expect, rtol=1e-5, atol=1e-6)
    shifted = np.concatenate([mem[:, 1:], np.zeros((filters, 1))], axis=1)
    np.testing.assert_allclose(state_out[0], shifted.ravel(), rtol=1e-6)


def test_svdf_no_bias_relu():
    ins = [(F32, [[1.0]]), (F32, [[-2.0]]), (F32, [[1.0, 1.0]]), (F32, None), (F32, [[5.0, 7.0]]),
           (I32, 1), (I32, 1)]
    state_out, out = run(OT.SVDF, ins, [F32, F32])
    # memory [5, -2] . [1, 1] = 3; relu(3) = 3; state shifts to [-2, 0]
    np.testing.assert_allclose(out, [[3.0]])
    np.testing.assert_allclose(state_out, [[-2.0, 0.0]])


# --- LSTM --------------------------------------------------------------------

def lstm_reference(x, h, c, W, cifg=False, peephole=False, proj=False, ln=False,
                   cell_clip=0.0, proj_clip=0.0):
    """One step, one batch row, written straight from the NNAPI equations.
    W: dict of weights keyed 'xi','xf','xc','xo','hi',...,'ci','cf','co','bi','bf','bc','bo',
    'p','pb','li','lf','lc','lo'."""
    def norm(v, g):
        if not ln:
            return v
        m = sum(v) / len(v)
        var = sum((a - m) ** 2 for a in v) / len(v)
        return [(a - m) / math.sqrt(var + 1e-8) * W["l" + g][k] for k, a in enumerate(v)]

    def pre(g, cell_state=None):
        v = [float(W["x" + g][u] @ x + W["h" + g][u] @ h) for u in range(len(c))]
        if not ln:
            v = [a + W["b" + g][u] for u, a in enumerate(v)]
        if peephole and cell_state is not None:
            v = [a + W["c" + g][u] * cell_state[u] for u, a in enumerate(v)]
        if ln:
            v = [a + W["b" + g][u] for u, a in enumerate(norm(v, g))]
        return v

    f = [sigmoid(a) for a in pre("f", c)]
    i = [1 - a for a in f] if cifg else [sigmoid(a) for a in pre("i", c)]
    g = [math.tanh(a) for a in pre("c")]
    new_c = [f[u] * c[u] + i[u] * g[u] for u in range(len(c))]
    if cell_clip:
        new_c = [min(max(a, -cell_clip), cell_clip) for a in new_c]
    o = [sigmoid(a) for a in pre("o", new_c)]
    out = np.array([o[u] * math.tanh(new_c[u]) for u in range(len(c))])
    if proj:
        out = W["p"] @ out + W["pb"]
        if proj_clip:
            out = np.clip(out, -proj_clip, proj_clip)
    return out, np.array(new_c)


def lstm_weights(inp, units, out):
    W = {}
    for g in "ifco":
        W["x" + g], W["h" + g], W["b" + g] = rand(units, inp), rand(units, out), rand(units)
        W["c" + g], W["l" + g] = rand(units), rand(units) + 1.0
    W["p"], W["pb"] = rand(out, units), rand(out)
    return W


def lstm_inputs(x, h, c, W, cifg, peephole, proj, ln, cell_clip=0.0, proj_clip=0.0, t=F32):
    def opt(key, present):
        return (t, W[key] if present else None)
    ins = [(t, x), opt("xi", not cifg), opt("xf", 1), opt("xc", 1), opt("xo", 1),
           opt("hi", not cifg), opt("hf", 1), opt("hc", 1), opt("ho", 1),
           opt("ci", peephole and not cifg), opt("cf", peephole), opt("co", peephole),
           opt("bi", not cifg), opt("bf", 1), opt("bc", 1), opt("bo", 1),
           opt("p", proj), opt("pb", proj), (t, h), (t, c), (I32, 4),
           (T.FLOAT32, cell_clip), (T.FLOAT32, proj_clip)]
    if ln is not None:
        ins += [opt("li", ln and not cifg), opt("lf", ln), opt("lc", ln), opt("lo", ln)]
    return ins


@pytest.mark.parametrize("cifg,peephole,proj,ln,cell_clip,proj_clip", [
    (False, False, False, None, 0.0, 0.0),
    (True, True, False, None, 0.0, 0.0),
    (False, True, True, None, 0.3, 0.1),
    (False, True, True, True, 0.0, 0.0),
    (True, True, True, True, 0.0, 0.0),
])
def test_lstm_variants(cifg, peephole, proj, ln, cell_clip, proj_clip):
    batch, inp, units = 2, 3, 4
    out_size = 2 if proj else units
    W = lstm_weights(inp, units, out_size)
    x, h, c = rand(batch, inp), rand(batch, out_size), rand(batch, units)
    ins = lstm_inputs(x, h, c, W, cifg, peephole, proj, ln, cell_clip, proj_clip)
    scratch, h_out, c_out, out = run(OT.LSTM, ins, [F32] * 4)
    assert scratch.shape == (batch, units * (3 if cifg else 4))
    for b in range(batch):
        ref_h, ref_c = lstm_reference(x[b], h[b], c[b], W, cifg, peephole, proj, bool(ln),
                                      cell_clip, proj_clip)
        np.testing.assert_allclose(out[b], ref_h, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(c_out[b], ref_c, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(h_out, out)


def test_unidirectional_sequence_lstm_matches_stepwise_reference():
    batch, steps, inp, units = 2, 3, 2, 3
    W = lstm_weights(inp, units, units)
    x, h0, c0 = rand(batch, steps, inp), rand(batch, units), rand(batch, units)
    ins = lstm_inputs(x, h0, c0, W, False, True, False, None)
    ins.insert(23, (BOOL, False))
    ins += [(F32, None)] * 4
    out, h_last, c_last = run(OT.UNIDIRECTIONAL_SEQUENCE_LSTM, ins, [F32] * 3)
    assert out.shape == (batch, steps, units)
    for b in range(batch):
        h, c = h0[b], c0[b]
        for t in range(steps):
            h, c = lstm_reference(x[b, t], h, c, W, peephole=True)
            np.testing.assert_allclose(out[b, t], h, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(h_last[b], h, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(c_last[b], c, rtol=1e-5, atol=1e-6)


def test_bidirectional_sequence_lstm_separate_outputs():
    batch, steps, inp, units = 1, 3, 2, 2
    Wf, Wb = lstm_weights(inp, units, units), lstm_weights(inp, units, units)
    x = rand(steps, batch, inp)
    states = [rand(batch, units) for _ in range(4)]
    fw = lstm_inputs(x, None, None, Wf, False, False, False, None)[1:18]
    bw = lstm_inputs(x, None, None, Wb, False, False, False, None)[1:18]
    ins = ([(F32, x)] + fw + bw + [(F32, s) for s in states] + [(F32, None)] * 9
           + [(I32, 4), (T.FLOAT32, 0.0), (T.FLOAT32, 0.0), (BOOL, False), (BOOL, True)]
           + [(F32, None)] * 8)
    fw_out, bw_out = run(OT.BIDIRECTIONAL_SEQUENCE_LSTM, ins, [F32, F32])
    h, c = states[0][0], states[1][0]
    for t in range(steps):
        h, c = lstm_reference(x[t, 0], h, c, Wf)
        np.testing.assert_allclose(fw_out[t, 0], h, rtol=1e-5, atol=1e-6)
    h, c = states[2][0], states[3][0]
    for t in reversed(range(steps)):
        h, c = lstm_reference(x[t, 0], h, c, Wb)
        np.testing.assert_allclose(bw_out[t, 0], h, rtol=1e-5, atol=1e-6)


def test_lstm_kernel_rejects_half_cifg():
    W = lstm_weights(2, 2, 2)
    ins = lstm_inputs(rand(1, 2), rand(1, 2), rand(1, 2), W, False, False, False, None)
    ins[5] = (F32, None)  # recurrent-to-input omitted but input-to-input given
    with pytest.raises(NnrtError):
        run(OT.LSTM, ins, [F32] * 4)


# --- QUANTIZED_16BIT_LSTM -------------------------------------------------------

def test_quantized_16bit_lstm_hand_computed():
    # Weights at their zero point: every gate pre-activation is its bias, 0,
    # so i = f = o = 0.5 (16384 in Q0.15) and g = tanh(0) = 0.
    # c = 0.5 * 1.0 = 0.5 -> 1024 in Q4.11.
    # out = 0.5 * tanh(0.5) = 0.5 * 15143/32768 -> 7572 in Q0.15 -> 7572/256
    # = 29.58 -> 30 -> 158 with the 128 zero point.
    q8 = T.TENSOR_QUANT8_ASYMM
    w = np.full((2, 2), 100, np.uint8)
    ins = ([Arg(q8, np.array([[128, 200]], np.uint8), 1 / 128, 128)]
           + [Arg(q8, w, 0.01, 100)] * 8
           + [Arg(T.TENSOR_INT32, np.zeros(2, np.int32), 0.01 / 128)] * 4
           + [Arg(T.TENSOR_QUANT16_SYMM, np.array([[2048, 2048]], np.int16), 2 ** -11),
              Arg(q8, np.array([[128, 50]], np.uint8), 1 / 128, 128)])
    outs = [Operand(T.TENSOR_QUANT16_SYMM, (1, 2), 2 ** -11), Operand(q8, (1, 2), 1 / 128, 128)]
    call = Call(OT.QUANTIZED_16BIT_LSTM, ins, outs, False, None)
    c, out = definition(OT.QUANTIZED_16BIT_LSTM).kernel(call)
    np.testing.assert_array_equal(c, [[1024, 1024]])
    np.testing.assert_array_equal(out, [[158, 158]])
    assert c.dtype == np.int16 and out.dtype == np.uint8


def quantized_lstm_specs(input_scale=1 / 128):
    q8 = T.TENSOR_QUANT8_ASYMM
    state = spec(T.TENSOR_QUANT16_SYMM, (1, 2), None, 2 ** -11)
    previous_output = spec(q8, (1, 2), None, 1 / 128, 128)
    return ([spec(q8, (1, 2), None, input_scale, 128)] + [spec(q8, (2, 2), None, 0.01, 100)] * 8
            + [spec(T.TENSOR_INT32, (2,), None, 0.01 / 128)] * 4
            + [state, previous_output], [state, previous_output])


def test_quantized_16bit_lstm_validation():
    assert validate(OT.QUANTIZED_16BIT_LSTM, *quantized_lstm_specs()) == HalVersion.V1_2
    with pytest.raises(NnrtError, match="1/128"):
        validate(OT.QUANTIZED_16BIT_LSTM, *quantized_lstm_specs(input_scale=0.5))


# --- validation and shapes ---------------------------------------------------------

def rnn_specs(t=F32, input_dims=(2, 3)):
    return ([spec(t, input_dims), spec(t, (4, 3)), spec(t, (4, 4)), spec(t, (4,)), spec(t, (2, 4)),
             spec(I32, (), 1)], [spec(t, (2, 4)), spec(t, (2, 4))])


def test_rnn_validation_versions_and_refusals():
    assert validate(OT.RNN, *rnn_specs()) == HalVersion.V1_0
    assert validate(OT.RNN, *rnn_specs(F16)) == HalVersion.V1_2
    assert shape(OT.RNN, *rnn_specs()) == [(2, 4), (2, 4)]
    with pytest.raises(NnrtError):
        validate(OT.RNN, *rnn_specs(T.TENSOR_INT32))
    with pytest.raises(NnrtError, match="rank"):
        validate(OT.RNN, *rnn_specs(input_dims=(2, 3, 1)))


def test_svdf_validation_and_shape():
    ins = [spec(F32, (2, 3)), spec(F32, (8, 3)), spec(F32, (8, 10)), spec(F32, (4,)),
           spec(F32, (2, 80)), spec(I32, (), 2), spec(I32, (), 0)]
    outs = [spec(F32, (2, 80)), spec(F32, (2, 4))]
    assert validate(OT.SVDF, ins, outs) == HalVersion.V1_0
    assert shape(OT.SVDF, ins, outs) == [(2, 80), (2, 4)]
    ins[5] = spec(I32, (), 3)  # 8 filters is not a multiple of rank 3
    with pytest.raises(NnrtError):
        validate(OT.SVDF, ins, outs)


def lstm_specs(cifg_omitted, n_inputs=23):
    ins = [spec(F32, (2, 3))]
    for k in range(1, 20):
        dims = {1: (4, 3), 2: (4, 3), 3: (4, 3), 4: (4, 3), 5: (4, 4), 6: (4, 4), 7: (4, 4),
                8: (4, 4), 18: (2, 4), 19: (2, 4)}.get(k, (4,))
        ins.append(spec(F32, dims, OMIT if cifg_omitted and k in (1, 5, 9, 12) else None))
    ins += [spec(I32, (), 4), spec(T.FLOAT32, (), 0.0), spec(T.FLOAT32, (), 0.0)]
    ins += [spec(F32, (4,))] * (n_inputs - 23)
    outs = [spec(F32, (2, 12 if cifg_omitted else 16)), spec(F32, (2, 4)), spec(F32, (2, 4)),
            spec(F32, (2, 4))]
    return ins, outs


def test_lstm_validation_and_shapes():
    assert validate(OT.LSTM, *lstm_specs(False)) == HalVersion.V1_0
    assert validate(OT.LSTM, *lstm_specs(False, 27)) == HalVersion.V1_2
    assert shape(OT.LSTM, *lstm_specs(True)) == [(2, 12), (2, 4), (2, 4), (2, 4)]
    # whether input-to-input weights are omitted is only known at execution
    assert shape(OT.LSTM, *lstm_specs(False))[0] == (2, 0)
    ins, outs = lstm_specs(False, 24)
    with pytest.raises(NnrtError, match="inputs"):
        validate(OT.LSTM, ins, outs)
    ins, outs = lstm_specs(False)
    ins[20] = spec(I32, (), 2)  # RELU1 is not an LSTM activation
    with pytest.raises(NnrtError, match="activation"):
        validate(OT.LSTM, ins, outs)
    ins, outs = lstm_specs(False)
    ins[21] = spec(T.FLOAT16, (), 0.0)  # clip of a float32 model must be FLOAT32
    with pytest.raises(NnrtError):
        validate(OT.LSTM, ins, outs)


def test_bidirectional_sequence_rnn_output_count_must_fit_merge():
    t = F32
    ins = ([spec(t, (3, 2, 5)), spec(t, (4, 5)), spec(t, (4, 4)), spec(t, (4,)), spec(t, (2, 4)),
            spec(t, (4, 5)), spec(t, (4, 4)), spec(t, (4,)), spec(t, (2, 4))]
           + [spec(t, (0,), OMIT)] * 3
           + [spec(I32, (), 1), spec(BOOL, (), True), spec(BOOL, (), True)])
    merged = [spec(t, (3, 2, 8))]
    assert validate(OT.BIDIRECTIONAL_SEQUENCE_RNN, ins, merged) == HalVersion.V1_2
    assert shape(OT.BIDIRECTIONAL_SEQUENCE_RNN, ins, merged) == [(3, 2, 8)]
    with pytest.raises(NnrtError, match="merge"):
        validate(OT.BIDIRECTIONAL_SEQUENCE_RNN, ins, merged * 2)


def test_bidirectional_sequence_rnn_parallel_linking_and_states():
    # HAL 1.3: aux input without aux weights feeds the backward cell alone.
    steps, batch, inp, units = 2, 1, 2, 2
    x, aux = rand(steps, batch, inp), rand(steps, batch, inp)
    fw = [rand(units, inp), rand(units, units), rand(units), rand(batch, units)]
    bw = [rand(units, inp), rand(units, units), rand(units), rand(batch, units)]
    ins = ([(F32, x)] + [(F32, a) for a in fw] + [(F32, a) for a in bw]
           + [(F32, aux), (F32, None), (F32, None)]
           + [(I32, 0), (T.BOOL, True), (T.BOOL, False)])
    fw_out, bw_out, fw_last, bw_last = run(OT.BIDIRECTIONAL_SEQUENCE_RNN, ins, [F32] * 4)
    fw_ref = rnn_reference(x[:, 0], *fw[:3], fw[3][0], relu=False)
    bw_ref = rnn_reference(aux[::-1, 0], *bw[:3], bw[3][0], relu=False)[::-1]
    np.testing.assert_allclose(fw_out[:, 0], fw_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(bw_out[:, 0], bw_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(fw_last[0], fw_ref[-1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(bw_last[0], bw_ref[0], rtol=1e-5, atol=1e-6)
