"""Activations, normalizations and element-wise unary math (nnrt/ops/activation.py,
normalization.py, unary.py): hand-computed values and validation refusals."""
from __future__ import annotations

import math

import numpy as np
import pytest

import nnrt.ops  # noqa: F401  (registers every operation)
from nnrt.errors import NnrtError
from nnrt.model.builder import Model
from nnrt.model.graph import ChannelQuant, Operand
from nnrt.model.types import HalVersion as V, OperandType as T, OperationType as Op
from nnrt.ops.registry import Arg, Call, OpView, definition

F32, F16, I32 = T.TENSOR_FLOAT32, T.TENSOR_FLOAT16, T.TENSOR_INT32
Q8, Q8S = T.TENSOR_QUANT8_ASYMM, T.TENSOR_QUANT8_ASYMM_SIGNED


# --- helpers ------------------------------------------------------------------

def t(type, dims, scale=0.0, zp=0):
    """A tensor operand spec for ``validate``."""
    return (type, dims, scale, zp, None)


def s(type, value):
    """A constant scalar operand spec."""
    return (type, [], 0.0, 0, value)


def validate(op, inputs, outputs):
    """Build a one-operation model and run the operation's validator."""
    m = Model()
    ins = []
    for type, dims, scale, zp, value in inputs:
        i = m.add_operand(type, dims, scale=scale, zero_point=zp)
        if value is not None:
            m.set_operand_value(i, value)
        ins.append(i)
    outs = [m.add_operand(type, dims, scale=scale, zero_point=zp)
            for type, dims, scale, zp, _ in outputs]
    m.add_operation(op, ins, outs)
    m.identify_inputs_and_outputs([i for i, spec in zip(ins, inputs) if spec[4] is None], outs)
    hal = m.finish().hal_model
    view = OpView(hal, None, hal.main.operations[0])
    return definition(op).validate(view)


def run(op, args, out_type, out_dims=(), scale=0.0, zp=0):
    out = Operand(out_type, tuple(out_dims), scale, zp)
    with np.errstate(all="ignore"):   # as the executor runs every kernel
        (result,) = definition(op).kernel(Call(op, args, [out], relaxed=False, executor=None))
    assert result.dtype == out_type.dtype
    return result


def arr(values, type=F32, scale=0.0, zp=0):
    return Arg(type, np.array(values, type.dtype), scale, zp)


def scalar(value, type=T.FLOAT32):
    return Arg(type, value)


# --- RELU family, LOGISTIC, TANH ----------------------------------------------

@pytest.mark.parametrize("op, expected", [
    (Op.RELU, [0, 0, 0.5, 2, 7]),
    (Op.RELU1, [-1, -0.5, 0.5, 1, 1]),
    (Op.RELU6, [0, 0, 0.5, 2, 6]),
], ids=["relu", "relu1", "relu6"])
def test_relu_family_float(op, expected):
    got = run(op, [arr([-2, -0.5, 0.5, 2, 7])], F32)
    np.testing.assert_array_equal(got, np.array(expected, np.float32))


def test_relu6_quant8_clamps_in_the_quantized_domain():
    # scale 0.5, zero point 128: 6.0 is 140, 0.0 is 128.
    got = run(Op.RELU6, [arr([0, 127, 128, 130, 140, 141, 255], Q8, 0.5, 128)], Q8, (), 0.5, 128)
    np.testing.assert_array_equal(got, [128, 128, 128, 130, 140, 140, 140])


def test_logistic_and_tanh_float():
    x = [0.0, math.log(3.0)]
    np.testing.assert_allclose(run(Op.LOGISTIC, [arr(x)], F32), [0.5, 0.75], rtol=1e-6)
    np.testing.assert_allclose(run(Op.TANH, [arr(x)], F32), [0.0, 0.8], rtol=1e-6)


def test_logistic_float16_keeps_float16():
    got = run(Op.LOGISTIC, [arr([0.0, -100.0, 100.0], F16)], F16)
    np.testing.assert_array_equal(got, np.array([0.5, 0.0, 1.0], np.float16))


def test_logistic_and_tanh_quant8():
    # Input scale 0.5, zp 128: q=128 is 0.0, q=130 is 1.0.
    x = arr([128, 130], Q8, 0.5, 128)
    sig1 = 1 / (1 + math.exp(-1))
    np.testing.assert_array_equal(run(Op.LOGISTIC, [x], Q8, (), 1 / 256, 0),
                                  [128, round(sig1 * 256)])
    np.testing.assert_array_equal(run(Op.TANH, [x], Q8, (), 1 / 128, 128),
                                  [128, 128 + round(math.tanh(1) * 128)])


def test_activation_validation():
    assert validate(Op.RELU, [t(F32, [2])], [t(F32, [2])]) == V.V1_0
    assert validate(Op.RELU, [t(F16, [2])], [t(F16, [2])]) == V.V1_2
    assert validate(Op.TANH, [t(Q8, [2], 0.1, 3)], [t(Q8, [2], 1 / 128, 128)]) == V.V1_2
    assert validate(Op.LOGISTIC, [t(Q8S, [2], 0.1, 3)], [t(Q8S, [2], 1 / 256, -128)]) == V.V1_3
    with pytest.raises(NnrtError, match="input 0"):
        validate(Op.RELU, [t(I32, [2])], [t(I32, [2])])
    with pytest.raises(NnrtError, match="rank"):
        validate(Op.RELU1, [t(F32, [1, 1, 1, 1, 2])], [t(F32, [1, 1, 1, 1, 2])])
    with pytest.raises(NnrtError, match="scale"):
        validate(Op.LOGISTIC, [t(Q8, [2], 0.5, 0)], [t(Q8, [2], 0.5, 0)])
    with pytest.raises(NnrtError, match="same|scale"):
        validate(Op.RELU, [t(Q8, [2], 0.5, 0)], [t(Q8, [2], 0.25, 0)])
    with pytest.raises(NnrtError, match="output 0"):
        validate(Op.RELU, [t(F32, [2])], [t(F16, [2])])


# --- SOFTMAX, LOG_SOFTMAX -----------------------------------------------------

def test_softmax_float_last_axis_and_beta():
    e = math.e
    got = run(Op.SOFTMAX, [arr([[1.0, 2.0], [3.0, 3.0]]), scalar(1.0)], F32)
    np.testing.assert_allclose(got, [[1 / (1 + e), e / (1 + e)], [0.5, 0.5]], rtol=1e-6)
    # beta 2 on a difference of 1 gives weights 1 : e^2.
    got = run(Op.SOFTMAX, [arr([[0.0, 1.0]]), scalar(2.0)], F32)
    np.testing.assert_allclose(got, [[1 / (1 + e * e), e * e / (1 + e * e)]], rtol=1e-6)


def test_softmax_axis_zero():
    got = run(Op.SOFTMAX, [arr([[1.0, 5.0], [1.0, 5.0]]), scalar(1.0), scalar(0, T.INT32)], F32)
    np.testing.assert_allclose(got, [[0.5, 0.5], [0.5, 0.5]], rtol=1e-6)


def test_softmax_quant8():
    got = run(Op.SOFTMAX, [arr([7, 7, 7, 7], Q8, 0.5, 0), scalar(1.0)], Q8, (), 1 / 256, 0)
    np.testing.assert_array_equal(got, [64, 64, 64, 64])


def test_softmax_zero_sized():
    got = run(Op.SOFTMAX, [arr(np.zeros((0, 3))), scalar(1.0)], F32)
    assert got.shape == (0, 3)


def test_log_softmax():
    got = run(Op.LOG_SOFTMAX, [arr([[0.0, 0.0], [0.0, math.log(3.0)]]), scalar(1.0),
                               scalar(-1, T.INT32)], F32)
    np.testing.assert_allclose(got, [[math.log(0.5)] * 2, [math.log(0.25), math.log(0.75)]],
                               rtol=1e-6)


def test_softmax_validation():
    beta = s(T.FLOAT32, 1.0)
    assert validate(Op.SOFTMAX, [t(F32, [2, 3]), beta], [t(F32, [2, 3])]) == V.V1_0
    assert validate(Op.SOFTMAX, [t(F32, [2, 3, 4]), beta], [t(F32, [2, 3, 4])]) == V.V1_2
    assert validate(Op.SOFTMAX, [t(F32, [2, 3]), beta, s(T.INT32, 0)], [t(F32, [2, 3])]) == V.V1_2
    with pytest.raises(NnrtError, match="axis"):
        validate(Op.SOFTMAX, [t(F32, [2, 3]), beta, s(T.INT32, 2)], [t(F32, [2, 3])])
    with pytest.raises(NnrtError, match="beta"):
        validate(Op.SOFTMAX, [t(F32, [2, 3]), s(T.FLOAT32, 0.0)], [t(F32, [2, 3])])
    with pytest.raises(NnrtError, match="input 1"):
        validate(Op.SOFTMAX, [t(F16, [2, 3]), beta], [t(F16, [2, 3])])
    with pytest.raises(NnrtError, match="scale"):
        validate(Op.SOFTMAX, [t(Q8, [2, 3], 0.5, 0), beta], [t(Q8, [2, 3], 1 / 256, 128)])


# --- PRELU, ELU, HARD_SWISH ---------------------------------------------------

def test_prelu_broadcasts_alpha():
    got = run(Op.PRELU, [arr([[-1.0, -2.0], [3.0, -4.0]]), arr([0.5, 0.25])], F32)
    np.testing.assert_array_equal(got, [[-0.5, -0.5], [3.0, -1.0]])


def test_prelu_quant8_requantizes():
    # x = (q - 128) * 0.25, alpha = (q - 50) * 0.25 = 0.5, out scale 0.5 zp 120.
    got = run(Op.PRELU, [arr([120, 136], Q8, 0.25, 128), arr([52], Q8, 0.25, 50)],
              Q8, (), 0.5, 120)
    np.testing.assert_array_equal(got, [118, 124])   # -2*0.5=-1 -> 118; 2 -> 124


def test_elu_and_hard_swish():
    got = run(Op.ELU, [arr([-1.0, 0.0, 2.0]), scalar(2.0)], F32)
    np.testing.assert_allclose(got, [2 * (math.exp(-1) - 1), 0.0, 2.0], rtol=1e-6)
    got = run(Op.HARD_SWISH, [arr([-4.0, -1.0, 1.0, 4.0])], F32)
    np.testing.assert_allclose(got, [0.0, -1 / 3, 4 / 6, 4.0], rtol=1e-6)


def test_prelu_elu_hard_swish_validation():
    assert validate(Op.PRELU, [t(F32, [2, 2]), t(F32, [2])], [t(F32, [2, 2])]) == V.V1_2
    assert validate(Op.ELU, [t(F16, [2]), s(T.FLOAT16, 1.0)], [t(F16, [2])]) == V.V1_3
    assert validate(Op.HARD_SWISH, [t(Q8, [2], 0.1, 0)], [t(Q8, [2], 0.2, 3)]) == V.V1_3
    with pytest.raises(NnrtError, match="broadcast|cannot"):
        validate(Op.PRELU, [t(F32, [2, 2]), t(F32, [3])], [t(F32, [2, 2])])
    with pytest.raises(NnrtError, match="input 1"):
        validate(Op.ELU, [t(F32, [2]), s(T.FLOAT16, 1.0)], [t(F32, [2])])


# --- normalizations -----------------------------------------------------------

def test_l2_normalization_float_and_zero_vector():
    got = run(Op.L2_NORMALIZATION, [arr([[3.0, 4.0], [0.0, 0.0]])], F32)
    np.testing.assert_allclose(got, [[0.6, 0.8], [0.0, 0.0]], rtol=1e-6)
    got = run(Op.L2_NORMALIZATION, [arr([[3.0, 1.0], [4.0, 1.0]]), scalar(0, T.INT32)], F32)
    np.testing.assert_allclose(got, [[0.6, 1 / math.sqrt(2)], [0.8, 1 / math.sqrt(2)]],
                               rtol=1e-6)


def test_l2_normalization_quant8():
    # (q - 10) = 3, 4 -> 0.6, 0.8 -> 128 + 76.8, 128 + 102.4; zero vector -> zero point.
    got = run(Op.L2_NORMALIZATION, [arr([[13, 14], [10, 10]], Q8, 0.1, 10)], Q8, (), 1 / 128, 128)
    np.testing.assert_array_equal(got, [[205, 230], [128, 128]])


def test_local_response_normalization():
    # radius 1, bias 1, alpha 1, beta 1: sums of squares 1+4, 1+4+9, 4+9.
    args = [arr([1.0, 2.0, 3.0]), scalar(1, T.INT32), scalar(1.0), scalar(1.0), scalar(1.0)]
    got = run(Op.LOCAL_RESPONSE_NORMALIZATION, args, F32)
    np.testing.assert_allclose(got, [1 / 6, 2 / 15, 3 / 14], rtol=1e-6)
    # Along axis 0 of a [3, 1] tensor with beta 0.5 and radius 0: x / sqrt(1 + x^2).
    args = [arr([[1.0], [2.0], [3.0]]), scalar(0, T.INT32), scalar(1.0), scalar(1.0),
            scalar(0.5), scalar(0, T.INT32)]
    got = run(Op.LOCAL_RESPONSE_NORMALIZATION, args, F32)
    np.testing.assert_allclose(got, [[1 / math.sqrt(2)], [2 / math.sqrt(5)], [3 / math.sqrt(10)]],
                               rtol=1e-6)


@pytest.mark.parametrize("nchw", [False, True])
def test_instance_normalization(nchw):
    # One batch, two channels of 2 pixels: channel 0 = [1, 3] (mean 2, variance 1),
    # channel 1 = [4, 8] (mean 6, variance 4). gamma 2, beta 0.5.
    nhwc = np.array([[[[1.0, 4.0]], [[3.0, 8.0]]]], np.float32)   # [1, 2, 1, 2]
    x = nhwc.transpose(0, 3, 1, 2) if nchw else nhwc
    for epsilon, want in ((0.0, [[-1.5, -1.5], [2.5, 2.5]]),
                          (3.0, [[-0.5, 0.5 - 4 / math.sqrt(7)], [1.5, 0.5 + 4 / math.sqrt(7)]])):
        args = [Arg(F32, x), scalar(2.0), scalar(0.5), scalar(epsilon), scalar(nchw, T.BOOL)]
        got = run(Op.INSTANCE_NORMALIZATION, args, F32)
        got_nhwc = got.transpose(0, 2, 3, 1) if nchw else got
        np.testing.assert_allclose(got_nhwc.reshape(2, 2), want, rtol=1e-6)


def test_normalization_validation():
    assert validate(Op.L2_NORMALIZATION, [t(F32, [1, 1, 2, 3])], [t(F32, [1, 1, 2, 3])]) == V.V1_0
    assert validate(Op.L2_NORMALIZATION, [t(F32, [2, 3])], [t(F32, [2, 3])]) == V.V1_2
    assert validate(Op.L2_NORMALIZATION, [t(Q8, [1, 1, 2, 3], 0.1, 0)],
                    [t(Q8, [1, 1, 2, 3], 1 / 128, 128)]) == V.V1_2
    with pytest.raises(NnrtError, match="scale"):
        validate(Op.L2_NORMALIZATION, [t(Q8, [2, 3], 0.1, 0)], [t(Q8, [2, 3], 1 / 128, 0)])
    lrn = [s(T.INT32, 1), s(T.FLOAT32, 1.0), s(T.FLOAT32, 1.0), s(T.FLOAT32, 0.5)]
    assert validate(Op.LOCAL_RESPONSE_NORMALIZATION, [t(F32, [1, 1, 1, 6])] + lrn,
                    [t(F32, [1, 1, 1, 6])]) == V.V1_0
    assert validate(Op.LOCAL_RESPONSE_NORMALIZATION, [t(F32, [6])] + lrn,
                    [t(F32, [6])]) == V.V1_2
    with pytest.raises(NnrtError, match="input 2"):
        validate(Op.LOCAL_RESPONSE_NORMALIZATION, [t(F16, [1, 1, 1, 6])] + lrn,
                 [t(F16, [1, 1, 1, 6])])
    with pytest.raises(NnrtError, match="bias"):
        validate(Op.LOCAL_RESPONSE_NORMALIZATION, [t(F32, [1, 1, 1, 6]), s(T.INT32, 1),
                 s(T.FLOAT32, 0.0)] + lrn[2:], [t(F32, [1, 1, 1, 6])])
    with pytest.raises(NnrtError, match="axis"):
        validate(Op.LOCAL_RESPONSE_NORMALIZATION, [t(F32, [1, 6])] + lrn + [s(T.INT32, -3)],
                 [t(F32, [1, 6])])
    inorm = [s(T.FLOAT32, 1.0), s(T.FLOAT32, 0.0), s(T.FLOAT32, 1e-3), s(T.BOOL, False)]
    assert validate(Op.INSTANCE_NORMALIZATION, [t(F32, [1, 2, 2, 3])] + inorm,
                    [t(F32, [1, 2, 2, 3])]) == V.V1_2
    with pytest.raises(NnrtError, match="rank"):
        validate(Op.INSTANCE_NORMALIZATION, [t(F32, [2, 3])] + inorm, [t(F32, [2, 3])])


# --- unary math, DEQUANTIZE, QUANTIZE -----------------------------------------

def test_unary_math():
    x = arr([0.25, 1.0, 4.0])
    np.testing.assert_allclose(run(Op.SQRT, [x], F32), [0.5, 1.0, 2.0])
    np.testing.assert_allclose(run(Op.RSQRT, [x], F32), [2.0, 1.0, 0.5])
    np.testing.assert_allclose(run(Op.LOG, [x], F32), [math.log(0.25), 0.0, math.log(4)],
                               rtol=1e-6)
    np.testing.assert_allclose(run(Op.EXP, [arr([0.0, 1.0])], F32), [1.0, math.e], rtol=1e-6)
    np.testing.assert_allclose(run(Op.SIN, [arr([0.0, math.pi / 2])], F32), [0.0, 1.0],
                               atol=1e-7)
    np.testing.assert_array_equal(run(Op.FLOOR, [arr([-1.5, 1.5, 2.0])], F32), [-2, 1, 2])
    np.testing.assert_array_equal(run(Op.ABS, [arr([-3, 4], I32)], I32), [3, 4])
    np.testing.assert_array_equal(run(Op.NEG, [arr([-3, 4], I32)], I32), [3, -4])
    np.testing.assert_array_equal(run(Op.NEG, [arr([1.5], F16)], F16), [-1.5])


def test_dequantize_per_channel_and_float16():
    x = Arg(T.TENSOR_QUANT8_SYMM_PER_CHANNEL, np.array([[1, 2], [3, 4]], np.int8),
            channel_quant=ChannelQuant(1, (0.5, 2.0)))
    np.testing.assert_array_equal(run(Op.DEQUANTIZE, [x], F32), [[0.5, 4.0], [1.5, 8.0]])
    got = run(Op.DEQUANTIZE, [arr([0, 255], Q8, 0.5, 128)], F16)
    np.testing.assert_array_equal(got, np.array([-64.0, 63.5], np.float16))


def test_quantize_rounds_half_away_after_adding_zero_point():
    got = run(Op.QUANTIZE, [arr([0.5, -0.5, -1000.0, 1000.0])], Q8, (), 1.0, 10)
    np.testing.assert_array_equal(got, [11, 10, 0, 255])   # 10.5 -> 11, 9.5 -> 10
    got = run(Op.QUANTIZE, [arr([0.25, -0.25], F16)], Q8S, (), 0.5, 0)
    np.testing.assert_array_equal(got, [1, -1])


def test_unary_validation():
    assert validate(Op.FLOOR, [t(F32, [2])], [t(F32, [2])]) == V.V1_0
    assert validate(Op.EXP, [t(F32, [1, 1, 1, 1, 2])], [t(F32, [1, 1, 1, 1, 2])]) == V.V1_2
    assert validate(Op.ABS, [t(I32, [2])], [t(I32, [2])]) == V.V1_3
    assert validate(Op.NEG, [t(I32, [2])], [t(I32, [2])]) == V.V1_2
    assert validate(Op.DEQUANTIZE, [t(Q8, [2], 0.5, 1)], [t(F32, [2])]) == V.V1_0
    assert validate(Op.DEQUANTIZE, [t(Q8, [2], 0.5, 1)], [t(F16, [2])]) == V.V1_2
    assert validate(Op.QUANTIZE, [t(F32, [2])], [t(Q8S, [2], 0.5, 1)]) == V.V1_3
    with pytest.raises(NnrtError, match="rank"):
        validate(Op.FLOOR, [t(F32, [1, 1, 1, 1, 2])], [t(F32, [1, 1, 1, 1, 2])])
    with pytest.raises(NnrtError, match="input 0"):
        validate(Op.SQRT, [t(I32, [2])], [t(I32, [2])])
    with pytest.raises(NnrtError, match="output 0"):
        validate(Op.DEQUANTIZE, [t(Q8, [2], 0.5, 1)], [t(I32, [2])])
    with pytest.raises(NnrtError, match="input 0"):
        validate(Op.QUANTIZE, [t(Q8, [2], 0.5, 1)], [t(Q8, [2], 0.5, 1)])
