"""Kernels, validation and shape inference of the convolution family
(nnrt/ops/conv.py): CONV_2D, DEPTHWISE_CONV_2D, GROUPED_CONV_2D,
TRANSPOSE_CONV_2D.

Expected values are computed by hand or by the straightforward loop
references below (one output element at a time), never by the kernels."""
from __future__ import annotations

import itertools

import math

import numpy as np
import pytest

import nnrt.ops  # noqa: F401  (registers the operations)
from nnrt.errors import NnrtError
from nnrt.model.graph import ChannelQuant, DataLocation, HalModel, Operand, Operation, Subgraph
from nnrt.model.types import HalVersion, OperandLifeTime as L, OperandType as T, OperationType as OT
from nnrt.ops.registry import Arg, Call, OpView, definition

V = HalVersion
F32, F16, I32, B = T.TENSOR_FLOAT32, T.TENSOR_FLOAT16, T.INT32, T.BOOL
Q8, Q8S, PC = T.TENSOR_QUANT8_ASYMM, T.TENSOR_QUANT8_ASYMM_SIGNED, T.TENSOR_QUANT8_SYMM_PER_CHANNEL


# --- helpers -----------------------------------------------------------------

def spec(type, dims=(), value=None, scale=0.0, zero_point=0, cq=None):
    """An operand description: ``value`` given = a constant."""
    if value is not None and type.is_tensor:
        value = np.asarray(value, type.dtype)
        dims = dims or value.shape
    return dict(type=type, dims=tuple(dims), value=value, scale=scale, zero_point=zero_point, cq=cq)


def scalars(*values):
    return [spec(B if isinstance(v, bool) else I32, (), v) for v in values]


def view(op_type, inputs, outputs):
    """An OpView of a one-operation model built from operand descriptions."""
    blob = bytearray()
    operands = []
    for s in inputs + outputs:
        loc, life = None, L.SUBGRAPH_INPUT
        if s["value"] is not None:
            raw = np.asarray(s["value"], s["type"].dtype).tobytes()
            loc, life = DataLocation(-1, len(blob), len(raw)), L.CONSTANT_COPY
            blob += raw + bytes(-len(raw) % 8)
        operands.append(Operand(s["type"], s["dims"], s["scale"], s["zero_point"], life, loc,
                                s["cq"]))
    n = len(inputs)
    op = Operation(op_type, tuple(range(n)), tuple(range(n, n + len(outputs))))
    sub = Subgraph(tuple(operands), (op,), tuple(i for i in range(n) if inputs[i]["value"] is None),
                   tuple(range(n, n + len(outputs))))
    return OpView(HalModel(sub, (), bytes(blob)), None, op)


def validate(op_type, inputs, outputs):
    return definition(op_type).validate(view(op_type, inputs, outputs))


def shape(op_type, inputs, outputs):
    return definition(op_type).shape(view(op_type, inputs, outputs))


def run(op_type, inputs, output):
    """Run the kernel on fully specified operand descriptions (values given)."""
    args = [Arg(s["type"], s["value"], s["scale"], s["zero_point"], s["cq"]) for s in inputs]
    outs = [Operand(output["type"], output["dims"], output["scale"], output["zero_point"])]
    return definition(op_type).kernel(Call(op_type, args, outs, False, None))[0]


def tensors(x, w, b, xt=F32, wt=None, bt=None, xs=0.0, xz=0, ws=0.0, wz=0, cq=None):
    wt = wt or xt
    bt = bt or (T.TENSOR_INT32 if xt in (Q8, Q8S) else xt)
    return [spec(xt, value=x, scale=xs, zero_point=xz), spec(wt, value=w, scale=ws, zero_point=wz, cq=cq),
            spec(bt, value=b, scale=xs * ws if cq is None and xt in (Q8, Q8S) else 0.0)]


# --- loop references (NHWC) ------------------------------------------------------

def ref_conv(x, w, b, pads, strides, dil=(1, 1), groups=1):
    """x [N,H,W,C], w [O,kh,kw,C/groups]; pads (top, bottom, left, right)."""
    n, h, wd, c = x.shape
    o, kh, kw, cg = w.shape
    top, bottom, left, right = pads
    xp = np.zeros((n, h + top + bottom, wd + left + right, c))
    xp[:, top:top + h, left:left + wd] = x
    oh = (h + top + bottom - (kh - 1) * dil[0] - 1) // strides[0] + 1
    ow = (wd + left + right - (kw - 1) * dil[1] - 1) // strides[1] + 1
    out = np.zeros((n, oh, ow, o))
    per_group = o // groups
    for bi, y, xx, oc in itertools.product(range(n), range(oh), range(ow), range(o)):
        g0 = (oc // per_group) * cg
        s = b[oc]
        for i, j, k in itertools.product(range(kh), range(kw), range(cg)):
            s += xp[bi, y * strides[0] + i * dil[0], xx * strides[1] + j * dil[1], g0 + k] * w[oc, i, j, k]
        out[bi, y, xx, oc] = s
    return out


def ref_depthwise(x, w, b, pads, strides, mult, dil=(1, 1)):
    """w [1,kh,kw,C*mult]: output channel c*mult+m reads input channel c."""
    c = x.shape[3]
    wf = np.zeros((c * mult, w.shape[1], w.shape[2], c))
    for oc in range(c * mult):
        wf[oc, :, :, oc // mult] = w[0, :, :, oc]
    return ref_conv(x, wf, b, pads, strides, dil)


def ref_transpose(x, w, b, pads, strides):
    """Scatter: input pixel (y, x) adds w[:, i, j, :] . x[y, x] at (y*s+i-top, x*s+j-left)."""
    n, h, wd, c = x.shape
    o, kh, kw, _ = w.shape
    top, bottom, left, right = pads
    oh = (h - 1) * strides[0] + kh - top - bottom
    ow = (wd - 1) * strides[1] + kw - left - right
    out = np.zeros((n, oh, ow, o)) + b
    for bi, y, xx, i, j in itertools.product(range(n), range(h), range(wd), range(kh), range(kw)):
        oy, ox = y * strides[0] + i - top, xx * strides[1] + j - left
        if 0 <= oy < oh and 0 <= ox < ow:
            out[bi, oy, ox] += w[:, i, j, :] @ x[bi, y, xx]
    return out


def requantize(acc, mult, zero, lo, hi):
    """NNAPI's (TFLite's) reference requantization, written out in Python
    integers: ``mult`` (a scalar or one per output channel) as a Q31 mantissa
    and a power-of-two shift, a rounding doubling high multiply, then a
    rounding right shift. The two roundings are what the reference does: an
    exact 3.375 reached through 13.5 comes out 4."""
    acc = np.asarray(acc)
    mults = np.broadcast_to(np.asarray(mult, np.float64), acc.shape[-1:])
    out = np.empty(acc.shape, np.int64)
    for index, a in np.ndenumerate(acc):
        q, shift = _q31(float(mults[index[-1]]))
        out[index] = _fixed_point_multiply(int(a), q, shift)
    return np.clip(out + zero, lo, hi)


def _q31(m: float) -> tuple[int, int]:
    mantissa, shift = math.frexp(m)
    q = int(math.floor(mantissa * (1 << 31) + 0.5))
    if q == 1 << 31:
        q, shift = q // 2, shift + 1
    return q, shift


def _fixed_point_multiply(a: int, q: int, shift: int) -> int:
    a *= 1 << max(shift, 0)
    t = a * q + ((1 << 30) if a * q >= 0 else 1 - (1 << 30))
    high = (abs(t) >> 31) * (1 if t >= 0 else -1)          # C division truncates
    right = max(-shift, 0)
    mask = (1 << right) - 1
    threshold = (mask >> 1) + (1 if high < 0 else 0)
    return (high >> right) + (1 if (high & mask) > threshold else 0)


rng = np.random.default_rng(1)


# --- CONV_2D -------------------------------------------------------------------------

def test_conv_hand_computed_valid_padding_with_bias_and_relu():
    x = np.arange(1, 10, dtype=np.float32).reshape(1, 3, 3, 1)
    w = np.ones((1, 2, 2, 1), np.float32)
    ins = tensors(x, w, [-13.0]) + scalars(2, 1, 1, 1)     # VALID, strides 1, RELU
    out = run(OT.CONV_2D, ins, spec(F32, (1, 2, 2, 1)))
    # window sums 12, 16, 24, 28 minus 13, then RELU
    np.testing.assert_array_equal(out.reshape(-1), [0, 3, 11, 15])
    assert validate(OT.CONV_2D, ins, [spec(F32, (1, 2, 2, 1))]) == V.V1_0
    assert shape(OT.CONV_2D, ins, [spec(F32, (1, 2, 2, 1))]) == [(1, 2, 2, 1)]


def test_conv_same_padding_stride_2_matches_reference():
    x = rng.standard_normal((2, 5, 6, 3)).astype(np.float32)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    b = rng.standard_normal(4).astype(np.float32)
    ins = tensors(x, w, b) + scalars(1, 2, 2, 0)           # SAME, stride 2
    # SAME: out 3x3; height pad total (3-1)*2+3-5 = 2 -> (1, 1); width (3-1)*2+3-6 = 1 -> (0, 1)
    out = run(OT.CONV_2D, ins, spec(F32, (2, 3, 3, 4)))
    np.testing.assert_allclose(out, ref_conv(x, w, b, (1, 1, 0, 1), (2, 2)), rtol=1e-5, atol=1e-5)


def test_conv_explicit_padding_nchw_dilation():
    x = rng.standard_normal((1, 7, 6, 2)).astype(np.float32)
    w = rng.standard_normal((3, 2, 3, 2)).astype(np.float32)
    b = np.zeros(3, np.float32)
    # pads left 1, right 0, top 2, bottom 1; strides w 1, h 2; NONE; NCHW; dilation w 2, h 3
    ins = tensors(x.transpose(0, 3, 1, 2), w, b) + scalars(1, 0, 2, 1, 1, 2, 0, True, 2, 3)
    expected = ref_conv(x, w, b, (2, 1, 1, 0), (2, 1), (3, 2)).transpose(0, 3, 1, 2)
    out = run(OT.CONV_2D, ins, spec(F32, expected.shape))
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    assert shape(OT.CONV_2D, ins, [spec(F32, expected.shape)]) == [expected.shape]
    assert validate(OT.CONV_2D, ins, [spec(F32, expected.shape)]) == V.V1_2


def test_conv_float16_computes_in_float32():
    x = np.full((1, 2, 2, 1), 0.5, np.float16)
    w = np.full((1, 2, 2, 1), 2.0, np.float16)
    ins = tensors(x, w, [0.25], xt=F16) + scalars(2, 1, 1, 0)
    out = run(OT.CONV_2D, ins, spec(F16, (1, 1, 1, 1)))
    assert out.dtype == np.float16 and out.item() == 4.25
    assert validate(OT.CONV_2D, ins, [spec(F16, (1, 1, 1, 1))]) == V.V1_2


def test_conv_quant8_exact_accumulator_and_rounding():
    x = rng.integers(0, 256, (1, 4, 4, 3))
    w = rng.integers(0, 256, (2, 3, 3, 3))
    b = rng.integers(-2000, 2000, 2)
    xs, xz, ws, wz, os_, oz = 0.5, 127, 0.25, 120, 64.0, 100
    ins = tensors(x, w, b, xt=Q8, xs=xs, xz=xz, ws=ws, wz=wz) + scalars(1, 1, 1, 0)
    acc = ref_conv(x - xz, w - wz, b, (1, 1, 1, 1), (1, 1))
    expected = requantize(acc, xs * ws / os_, oz, 0, 255)
    out = run(OT.CONV_2D, ins, spec(Q8, (1, 4, 4, 2), scale=os_, zero_point=oz))
    assert out.dtype == np.uint8
    np.testing.assert_array_equal(out, expected)
    assert validate(OT.CONV_2D, ins, [spec(Q8, (1, 4, 4, 2), scale=os_, zero_point=oz)]) == V.V1_0
    # An output scale not above input x filter scale needs HAL 1.2.
    assert validate(OT.CONV_2D, ins, [spec(Q8, (1, 4, 4, 2), scale=0.125, zero_point=oz)]) == V.V1_2


def test_conv_quant8_signed_per_channel_with_relu():
    x = rng.integers(-128, 128, (1, 3, 3, 2))
    w = rng.integers(-127, 128, (3, 2, 2, 2))
    scales = (1 / 128, 1 / 64, 1 / 32)
    b = rng.integers(-500, 500, 3)
    xs, xz, os_, oz = 0.125, -3, 1.0, -20
    cq = ChannelQuant(0, scales)
    ins = tensors(x, w, b, xt=Q8S, wt=PC, xs=xs, xz=xz, cq=cq) + scalars(2, 1, 1, 1)
    acc = ref_conv(x - xz, w, b, (0, 0, 0, 0), (1, 1))
    expected = requantize(acc, xs * np.array(scales) / os_, oz, oz, 127)   # RELU: real 0 = -20
    out = run(OT.CONV_2D, ins, spec(Q8S, (1, 2, 2, 3), scale=os_, zero_point=oz))
    assert out.dtype == np.int8
    np.testing.assert_array_equal(out, expected)
    assert validate(OT.CONV_2D, ins, [spec(Q8S, (1, 2, 2, 3), scale=os_, zero_point=oz)]) == V.V1_3


def test_conv_zero_batch_gives_zero_sized_output():
    x = np.zeros((0, 3, 3, 1), np.float32)
    w = np.ones((2, 2, 2, 1), np.float32)
    out = run(OT.CONV_2D, tensors(x, w, [0.0, 0.0]) + scalars(2, 1, 1, 0), spec(F32, (0, 2, 2, 2)))
    assert out.shape == (0, 2, 2, 2)


def test_conv_shape_with_unknown_extents():
    ins = [spec(F32, (0, 8, 0, 3)), spec(F32, (5, 3, 3, 3)), spec(F32, (5,))] + scalars(1, 2, 2, 0)
    assert shape(OT.CONV_2D, ins, [spec(F32, (0, 0, 0, 0))]) == [(0, 4, 0, 5)]
    ins = [spec(F32, ()), spec(F32, (5, 3, 3, 3)), spec(F32, (5,))] + scalars(1, 2, 2, 0)
    assert shape(OT.CONV_2D, ins, [spec(F32, ())]) == [(0, 0, 0, 5)]


def _conv_inputs(**over):
    base = dict(x=spec(F32, (1, 4, 4, 2)), w=spec(F32, (3, 2, 2, 2)), b=spec(F32, (3,)))
    base.update(over)
    return [base["x"], base["w"], base["b"]]


@pytest.mark.parametrize("inputs, message", [
    (_conv_inputs(w=spec(F16, (3, 2, 2, 2))) + scalars(1, 1, 1, 0), "filter"),
    (_conv_inputs(x=spec(F32, (4, 4, 2))) + scalars(1, 1, 1, 0), "rank"),
    (_conv_inputs(b=spec(F32, (4,))) + scalars(1, 1, 1, 0), "bias"),
    (_conv_inputs(w=spec(F32, (3, 2, 2, 5))) + scalars(1, 1, 1, 0), "depth"),
    (_conv_inputs() + scalars(1, 1, 1, 7), "activation"),
    (_conv_inputs() + scalars(3, 1, 1, 0), "padding scheme"),
    (_conv_inputs() + scalars(1, 0, 1, 0), "stride"),
    (_conv_inputs() + scalars(1, 1, 1, 0, False, 2), "inputs"),        # one dilation factor
    (_conv_inputs() + scalars(2, 0, 0, 0, 1, 1, 0), "padding"),        # pad >= filter extent
    (_conv_inputs(b=spec(T.TENSOR_INT32, (3,))) + scalars(1, 1, 1, 0), "INT32"),
])
def test_conv_validation_refusals(inputs, message):
    with pytest.raises(NnrtError, match=message):
        validate(OT.CONV_2D, inputs, [spec(F32, (1, 0, 0, 3))])


def test_quant_validation_refusals():
    def ins(bias_scale=0.5, cq=ChannelQuant(0, (1.0, 1.0, 1.0))):
        return [spec(Q8, (1, 4, 4, 2), scale=1.0), spec(PC, (3, 2, 2, 2), cq=cq),
                spec(T.TENSOR_INT32, (3,), scale=bias_scale)] + scalars(1, 1, 1, 0)
    outs = [spec(Q8, (1, 4, 4, 3), scale=1.0)]
    assert validate(OT.CONV_2D, ins(), outs) == V.V1_2
    with pytest.raises(NnrtError, match="dimension 0"):
        validate(OT.CONV_2D, ins(cq=ChannelQuant(3, (1.0, 1.0))), outs)
    q8 = [spec(Q8, (1, 4, 4, 2), scale=1.0), spec(Q8, (3, 2, 2, 2), scale=0.5),
          spec(T.TENSOR_INT32, (3,), scale=0.4)] + scalars(1, 1, 1, 0)
    with pytest.raises(NnrtError, match="bias"):
        validate(OT.CONV_2D, q8, outs)


# --- DEPTHWISE_CONV_2D -----------------------------------------------------------------

def test_depthwise_hand_computed():
    # two channels, 2x2 filter of per-channel weights, VALID
    x = np.array([1, 10, 2, 20, 3, 30, 4, 40], np.float32).reshape(1, 2, 2, 2)
    w = np.array([1, 0, 1, 0, 1, 0, 1, 1], np.float32).reshape(1, 2, 2, 2)
    ins = tensors(x, w, [0.5, 0.0]) + scalars(2, 1, 1, 1, 0)
    out = run(OT.DEPTHWISE_CONV_2D, ins, spec(F32, (1, 1, 1, 2)))
    np.testing.assert_array_equal(out.reshape(-1), [10.5, 40.0])
    assert validate(OT.DEPTHWISE_CONV_2D, ins, [spec(F32, (1, 1, 1, 2))]) == V.V1_0


@pytest.mark.parametrize("strides, dil", [((1, 1), (1, 1)), ((2, 3), (1, 1)), ((1, 2), (2, 1))])
def test_depthwise_multiplier_matches_reference(strides, dil):
    x = rng.standard_normal((2, 7, 8, 3)).astype(np.float32)
    w = rng.standard_normal((1, 3, 2, 6)).astype(np.float32)
    b = rng.standard_normal(6).astype(np.float32)
    # explicit pads left 1, right 1, top 2, bottom 0; multiplier 2; NCHW off; dilations
    ins = tensors(x, w, b) + scalars(1, 1, 2, 0, strides[1], strides[0], 2, 0, False, dil[1], dil[0])
    expected = ref_depthwise(x, w, b, (2, 0, 1, 1), strides, 2, dil)
    out = run(OT.DEPTHWISE_CONV_2D, ins, spec(F32, expected.shape))
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    assert shape(OT.DEPTHWISE_CONV_2D, ins, [spec(F32, expected.shape)]) == [expected.shape]


def test_depthwise_quant8_per_channel():
    x = rng.integers(0, 256, (1, 4, 4, 2))
    w = rng.integers(-127, 128, (1, 3, 3, 2))
    b = rng.integers(-300, 300, 2)
    scales = (1 / 64, 1 / 32)   # dyadic: no rounding ties between float32 and double
    ins = tensors(x, w, b, xt=Q8, wt=PC, xs=0.5, xz=128, cq=ChannelQuant(3, scales)) \
        + scalars(1, 1, 1, 1, 0)
    acc = ref_depthwise(x - 128, w, b, (1, 1, 1, 1), (1, 1), 1)
    expected = requantize(acc, 0.5 * np.array(scales) / 10.0, 10, 0, 255)
    out = run(OT.DEPTHWISE_CONV_2D, ins, spec(Q8, (1, 4, 4, 2), scale=10.0, zero_point=10))
    np.testing.assert_array_equal(out, expected)


def test_depthwise_refuses_filter_with_leading_dim_not_one():
    ins = [spec(F32, (1, 3, 3, 2)), spec(F32, (2, 2, 2, 4)), spec(F32, (4,))] \
        + scalars(0, 0, 0, 0, 1, 1, 2, 0, False)
    with pytest.raises(NnrtError, match="depthwise filter"):
        validate(OT.DEPTHWISE_CONV_2D, ins, [spec(F32, (1, 2, 2, 4))])


def test_depthwise_refuses_wrong_multiplier():
    ins = [spec(F32, (1, 3, 3, 2)), spec(F32, (1, 2, 2, 4)), spec(F32, (4,))] + scalars(2, 1, 1, 3, 0)
    with pytest.raises(NnrtError, match="multiplier"):
        validate(OT.DEPTHWISE_CONV_2D, ins, [spec(F32, (1, 2, 2, 4))])


# --- GROUPED_CONV_2D ------------------------------------------------------------------------

def test_grouped_conv_matches_reference_nchw():
    x = rng.standard_normal((1, 5, 5, 6)).astype(np.float32)
    w = rng.standard_normal((4, 2, 2, 3)).astype(np.float32)
    b = rng.standard_normal(4).astype(np.float32)
    # implicit SAME, strides 1, 2 groups, NONE, NCHW
    ins = tensors(x.transpose(0, 3, 1, 2), w, b) + scalars(1, 1, 1, 2, 0, True)
    expected = ref_conv(x, w, b, (0, 1, 0, 1), (1, 1), groups=2).transpose(0, 3, 1, 2)
    out = run(OT.GROUPED_CONV_2D, ins, spec(F32, expected.shape))
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    assert validate(OT.GROUPED_CONV_2D, ins, [spec(F32, expected.shape)]) == V.V1_2


def test_grouped_conv_quant8():
    x = rng.integers(0, 256, (1, 3, 3, 4))
    w = rng.integers(0, 256, (6, 2, 2, 2))
    b = rng.integers(-100, 100, 6)
    # explicit pads 0, strides 1, 2 groups, RELU, NHWC
    ins = tensors(x, w, b, xt=Q8, xs=0.25, xz=100, ws=0.5, wz=128) + scalars(0, 0, 0, 0, 1, 1, 2, 1, False)
    acc = ref_conv(x - 100, w - 128, b, (0, 0, 0, 0), (1, 1), groups=2)
    expected = requantize(acc, 0.25 * 0.5 / 64.0, 50, 50, 255)
    out = run(OT.GROUPED_CONV_2D, ins, spec(Q8, (1, 2, 2, 6), scale=64.0, zero_point=50))
    np.testing.assert_array_equal(out, expected)


def test_grouped_conv_refuses_indivisible_groups():
    ins = [spec(F32, (1, 4, 4, 6)), spec(F32, (4, 2, 2, 2)), spec(F32, (4,))] + scalars(2, 1, 1, 2, 0, False)
    with pytest.raises(NnrtError, match="group"):
        validate(OT.GROUPED_CONV_2D, ins, [spec(F32, (1, 3, 3, 4))])
    # the NCHW flag is not optional here
    with pytest.raises(NnrtError, match="inputs"):
        validate(OT.GROUPED_CONV_2D, ins[:-1], [spec(F32, (1, 3, 3, 4))])


# --- TRANSPOSE_CONV_2D -----------------------------------------------------------------------

def test_transpose_conv_hand_computed():
    # 1x2x2x1 input, 2x2 ones filter, stride 2, no padding: each input spreads into its own 2x2 block
    x = np.array([1, 2, 3, 4], np.float32).reshape(1, 2, 2, 1)
    w = np.ones((1, 2, 2, 1), np.float32)
    ins = tensors(x, w, [1.0]) + scalars(0, 0, 0, 0, 2, 2, 0, False)
    out = run(OT.TRANSPOSE_CONV_2D, ins, spec(F32, (1, 4, 4, 1)))
    np.testing.assert_array_equal(out[0, :, :, 0], [[2, 2, 3, 3], [2, 2, 3, 3], [4, 4, 5, 5], [4, 4, 5, 5]])
    assert shape(OT.TRANSPOSE_CONV_2D, ins, [spec(F32, (0, 0, 0, 0))]) == [(1, 4, 4, 1)]


def test_transpose_conv_implicit_same_matches_reference():
    x = rng.standard_normal((2, 3, 4, 3)).astype(np.float32)
    w = rng.standard_normal((2, 3, 3, 3)).astype(np.float32)
    b = rng.standard_normal(2).astype(np.float32)
    out_shape = spec(T.TENSOR_INT32, value=[2, 6, 8, 2])
    ins = tensors(x, w, b) + [out_shape] + scalars(1, 2, 2, 0, False)
    # SAME for a wanted size 6 (stride 2, k 3): (3-1)*2+3-6 = 1 -> head 0, tail 1; width 8: same
    expected = ref_transpose(x, w, b, (0, 1, 0, 1), (2, 2))
    assert expected.shape == (2, 6, 8, 2)
    out = run(OT.TRANSPOSE_CONV_2D, ins, spec(F32, (2, 6, 8, 2)))
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    assert shape(OT.TRANSPOSE_CONV_2D, ins, [spec(F32, (0, 0, 0, 0))]) == [(2, 6, 8, 2)]
    # The output shape tensor given at run time only: the shape is not known statically.
    ins[3] = spec(T.TENSOR_INT32, (4,))
    assert shape(OT.TRANSPOSE_CONV_2D, ins, [spec(F32, (0, 0, 0, 0))]) == [(2, 0, 0, 2)]


def test_transpose_conv_same_with_negative_tail_padding():
    # Height: wanted 6 from 2 inputs, stride 3, k 2: (2-1)*3+2-6 = -1 -> head 0, tail -1
    # (the last row gets only the bias). Width: wanted 5 from 3 inputs, stride 2, k 3:
    # (3-1)*2+3-5 = 2 -> head 1, tail 1.
    x = rng.standard_normal((1, 2, 3, 1)).astype(np.float32)
    w = rng.standard_normal((1, 2, 3, 1)).astype(np.float32)
    ins = tensors(x, w, [0.5]) + [spec(T.TENSOR_INT32, value=[1, 6, 5, 1])] + scalars(1, 2, 3, 0, False)
    expected = ref_transpose(x, w, [0.5], (0, -1, 1, 1), (3, 2))
    assert expected.shape == (1, 6, 5, 1)
    out = run(OT.TRANSPOSE_CONV_2D, ins, spec(F32, (1, 6, 5, 1)))
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_transpose_conv_quant8_per_channel_nchw():
    x = rng.integers(0, 256, (1, 2, 3, 2))
    w = rng.integers(-127, 128, (3, 3, 3, 2))
    b = rng.integers(-1000, 1000, 3)
    scales = (0.125, 0.25, 0.5)
    ins = tensors(x.transpose(0, 3, 1, 2), w, b, xt=Q8, wt=PC, xs=0.5, xz=128,
                  cq=ChannelQuant(0, scales)) + scalars(1, 0, 1, 1, 2, 1, 0, True)
    acc = ref_transpose(x - 128, w, b, (1, 1, 1, 0), (1, 2))
    expected = requantize(acc, 0.5 * np.array(scales) / 32.0, 128, 0, 255).transpose(0, 3, 1, 2)
    out = run(OT.TRANSPOSE_CONV_2D, ins, spec(Q8, expected.shape, scale=32.0, zero_point=128))
    np.testing.assert_array_equal(out, expected)
    assert validate(OT.TRANSPOSE_CONV_2D, ins, [spec(Q8, expected.shape, scale=32.0, zero_point=128)]) \
        == V.V1_2


def test_transpose_conv_refuses_channel_mismatch():
    ins = [spec(F32, (1, 2, 2, 3)), spec(F32, (1, 2, 2, 2)), spec(F32, (1,))] \
        + scalars(0, 0, 0, 0, 1, 1, 0, False)
    with pytest.raises(NnrtError, match="depth"):
        validate(OT.TRANSPOSE_CONV_2D, ins, [spec(F32, (1, 3, 3, 1))])
