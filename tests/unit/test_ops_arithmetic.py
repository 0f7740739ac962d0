"""Kernels, validation and shape inference of the arithmetic, comparison and
reduction families (nnrt/ops/arithmetic.py, comparison.py, reduce.py).

Expected values are computed by hand."""
from __future__ import annotations

import numpy as np
import pytest

import nnrt.ops  # noqa: F401  (registers the operations)
from nnrt.errors import NnrtError
from nnrt.model.graph import DataLocation, HalModel, Operand, Operation, Subgraph
from nnrt.model.types import HalVersion, OperandLifeTime as L, OperandType as T, OperationType as OT
from nnrt.ops.registry import Arg, Call, OpView, definition

V = HalVersion


# --- helpers -----------------------------------------------------------------

def spec(type, dims=(), value=None, scale=0.0, zero_point=0):
    """An operand description: ``value`` given = a constant."""
    return dict(type=type, dims=tuple(dims), value=value, scale=scale, zero_point=zero_point)


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
        operands.append(Operand(s["type"], s["dims"], s["scale"], s["zero_point"], life, loc))
    n = len(inputs)
    op = Operation(op_type, tuple(range(n)), tuple(range(n, n + len(outputs))))
    sub = Subgraph(tuple(operands), (op,), tuple(i for i in range(n) if inputs[i]["value"] is None),
                   tuple(range(n, n + len(outputs))))
    return OpView(HalModel(sub, (), bytes(blob)), None, op)


def validate(op_type, inputs, outputs):
    return definition(op_type).validate(view(op_type, inputs, outputs))


def shape(op_type, inputs, outputs):
    return definition(op_type).shape(view(op_type, inputs, outputs))


def arg(type, value, scale=0.0, zero_point=0):
    if type.is_tensor:
        value = np.asarray(value, type.dtype)
    return Arg(type, value, scale, zero_point)


def out(type, dims=(), scale=0.0, zero_point=0):
    return Operand(type, tuple(dims), scale, zero_point)


def run(op_type, ins, outs):
    return definition(op_type).kernel(Call(op_type, ins, outs, False, None))


F32, F16, I32, Q8, Q8S, B8 = (T.TENSOR_FLOAT32, T.TENSOR_FLOAT16, T.TENSOR_INT32,
                              T.TENSOR_QUANT8_ASYMM, T.TENSOR_QUANT8_ASYMM_SIGNED, T.TENSOR_BOOL8)


def act(code=0):
    return arg(T.INT32, code)


# --- ADD, MUL, SUB, DIV --------------------------------------------------------

def test_float_arithmetic_broadcasts_and_applies_activation():
    a = arg(F32, [[1.0, -2.0], [3.0, 4.0]])
    b = arg(F32, [10.0, -10.0])
    o = out(F32, (2, 2))
    assert run(OT.ADD, [a, b, act()], [o])[0].tolist() == [[11.0, -12.0], [13.0, -6.0]]
    assert run(OT.SUB, [a, b, act(1)], [o])[0].tolist() == [[0.0, 8.0], [0.0, 14.0]]  # RELU
    assert run(OT.MUL, [a, b, act(2)], [o])[0].tolist() == [[1.0, 1.0], [1.0, -1.0]]  # RELU1
    expected = np.array([[0.1, 0.2], [0.3, 0.0]], np.float32)                       # RELU6
    np.testing.assert_array_equal(run(OT.DIV, [a, b, act(3)], [o])[0], expected)
    assert run(OT.ADD, [a, b, act()], [o])[0].dtype == np.float32


def test_float16_sub_returns_float16():
    r = run(OT.SUB, [arg(F16, [1.5, 2.0]), arg(F16, [0.5]), act()], [out(F16, (2,))])[0]
    assert r.dtype == np.float16 and r.tolist() == [1.0, 1.5]


def test_int32_div_is_floor_division_and_zero_on_division_by_zero():
    r = run(OT.DIV, [arg(I32, [7, -7, 7, -7, 5, -2147483648]), arg(I32, [2, 2, -2, -2, 0, -1]),
                     act()], [out(I32, (6,))])[0]
    # INT32_MIN / -1 overflows: it wraps like C int32 arithmetic.
    assert r.dtype == np.int32 and r.tolist() == [3, -4, -4, 3, 0, -2147483648]


def test_int32_add_sub_mul_wrap():
    big = arg(I32, [2147483647])
    one = arg(I32, [1])
    assert run(OT.ADD, [big, one, act()], [out(I32, (1,))])[0].tolist() == [-2147483648]
    assert run(OT.SUB, [arg(I32, [5]), arg(I32, [7]), act()], [out(I32, (1,))])[0].tolist() == [-2]
    assert run(OT.MUL, [arg(I32, [3, -4]), arg(I32, [5]), act()], [out(I32, (2,))])[0].tolist() == [15, -20]


def test_int32_with_activation_fails_at_run_time():
    with pytest.raises(NnrtError):
        run(OT.ADD, [arg(I32, [1]), arg(I32, [1]), act(1)], [out(I32, (1,))])


def test_quant8_add_and_sub_requantize():
    # a: scale 0.5 zp 10 -> real 2.0, 5.0 ; b: scale 0.25 zp 0 -> real 1.0, 0.5
    a = arg(Q8, [14, 20], 0.5, 10)
    b = arg(Q8, [4, 2], 0.25, 0)
    o = out(Q8, (2,), 0.1, 100)
    assert run(OT.ADD, [a, b, act()], [o])[0].tolist() == [130, 155]
    assert run(OT.SUB, [a, b, act()], [o])[0].tolist() == [110, 145]
    # RELU6 clamps the real 7.0 to 6.0 -> 160; 5.0 -> 150 is kept
    r = run(OT.ADD, [arg(Q8, [22, 19], 0.5, 10), b, act(3)], [out(Q8, (2,), 0.1, 100)])[0]
    assert r.tolist() == [160, 150]


def test_quant8_signed_mul():
    r = run(OT.MUL, [arg(Q8S, [-10, 20], 0.5, 0), arg(Q8S, [4], 0.5, -2), act()],
            [out(Q8S, (2,), 1.0, -5)])[0]
    # reals: -5 * 3 = -15 -> -20 ; 10 * 3 = 30 -> 25
    assert r.dtype == np.int8 and r.tolist() == [-20, 25]


def test_arithmetic_versions():
    f = lambda t, *d: spec(t, d)  # noqa: E731
    none = spec(T.INT32, value=0)
    assert validate(OT.ADD, [f(F32, 2), f(F32, 2), none], [f(F32, 2)]) == V.V1_0
    assert validate(OT.SUB, [f(F32, 2), f(F32, 2), none], [f(F32, 2)]) == V.V1_1
    assert validate(OT.DIV, [f(F16, 2), f(F16, 2), none], [f(F16, 2)]) == V.V1_2
    assert validate(OT.DIV, [f(I32, 2), f(I32, 2), none], [f(I32, 2)]) == V.V1_3
    q = spec(Q8, (2,), scale=0.5, zero_point=3)
    assert validate(OT.SUB, [q, q, none], [q]) == V.V1_2
    assert validate(OT.ADD, [q, q, none], [q]) == V.V1_0


def test_arithmetic_refusals():
    f = lambda t, *d: spec(t, d)  # noqa: E731
    none = spec(T.INT32, value=0)
    q = spec(Q8, (2,), scale=0.5, zero_point=3)
    with pytest.raises(NnrtError, match="DIV"):
        validate(OT.DIV, [q, q, none], [q])
    with pytest.raises(NnrtError, match="input 1"):
        validate(OT.ADD, [f(F32, 2), f(F16, 2), none], [f(F32, 2)])
    with pytest.raises(NnrtError, match="rank"):
        validate(OT.MUL, [f(F32, 1, 1, 1, 1, 2), f(F32, 2), none], [f(F32, 1, 1, 1, 1, 2)])
    with pytest.raises(NnrtError, match="activation"):
        validate(OT.ADD, [f(I32, 2), f(I32, 2), spec(T.INT32, value=1)], [f(I32, 2)])
    with pytest.raises(NnrtError, match="activation"):
        validate(OT.ADD, [f(F32, 2), f(F32, 2), spec(T.INT32, value=7)], [f(F32, 2)])
    # HAL 1.0 quant8 MUL: output scale must exceed the product of input scales.
    q1 = spec(Q8, (2,), scale=2.0)
    with pytest.raises(NnrtError, match="scale"):
        validate(OT.MUL, [q1, q1, none], [spec(Q8, (2,), scale=4.0)])
    assert validate(OT.MUL, [q1, q1, none], [spec(Q8, (2,), scale=4.5)]) == V.V1_0


def test_broadcast_shape_inference():
    none = spec(T.INT32, value=0)
    assert shape(OT.ADD, [spec(F32, (2, 1, 3)), spec(F32, (4, 1)), none], [spec(F32)]) == [(2, 4, 3)]
    assert shape(OT.ADD, [spec(F32, (0, 3)), spec(F32, (1,)), none], [spec(F32)]) == [(0, 3)]
    assert shape(OT.ADD, [spec(F32, ()), spec(F32, (3,)), none], [spec(F32)]) == [()]
    with pytest.raises(NnrtError):
        shape(OT.ADD, [spec(F32, (2,)), spec(F32, (3,)), none], [spec(F32)])


def test_zero_sized_inputs_give_zero_sized_outputs():
    r = run(OT.ADD, [arg(F32, np.zeros((0, 2))), arg(F32, [1.0, 2.0]), act()], [out(F32, (0, 2))])[0]
    assert r.shape == (0, 2)


# --- MAXIMUM, MINIMUM, POW, CAST --------------------------------------------------

def test_maximum_minimum():
    a, b = arg(F32, [1.0, -5.0, 3.0]), arg(F32, [2.0])
    assert run(OT.MAXIMUM, [a, b], [out(F32, (3,))])[0].tolist() == [2.0, 2.0, 3.0]
    assert run(OT.MINIMUM, [a, b], [out(F32, (3,))])[0].tolist() == [1.0, -5.0, 2.0]
    assert run(OT.MAXIMUM, [arg(I32, [1, 9]), arg(I32, [4, 4])], [out(I32, (2,))])[0].tolist() == [4, 9]


def test_maximum_quant8_with_different_scales_requantizes():
    # a reals: 1.0, 4.0 ; b reals: 2.0, 3.0 ; output scale 0.5 zp 10
    r = run(OT.MAXIMUM, [arg(Q8, [2, 8], 0.5, 0), arg(Q8, [12, 13], 1.0, 10)], [out(Q8, (2,), 0.5, 10)])[0]
    assert r.tolist() == [14, 18]


def test_requantization_ties_are_the_same_for_signed_and_unsigned():
    # real -0.5 on an output of scale 1: it rounds half away from zero to -1
    # before the zero point is added, so the unsigned (zp 1) result is 0 and the
    # signed twin (zp -127) gives exactly 0 - 128, as HAL 1.3's coupling requires.
    r = run(OT.MINIMUM, [arg(Q8, [0], 0.5, 1), arg(Q8, [9], 0.5, 1)], [out(Q8, (1,), 1.0, 1)])[0]
    s = run(OT.MINIMUM, [arg(Q8S, [-128], 0.5, -127), arg(Q8S, [-119], 0.5, -127)],
            [out(Q8S, (1,), 1.0, -127)])[0]
    assert r.tolist() == [0] and s.tolist() == [-128]


def test_pow():
    r = run(OT.POW, [arg(F32, [2.0, 9.0, 4.0]), arg(F32, [3.0, 0.5, -1.0])], [out(F32, (3,))])[0]
    assert r.tolist() == [8.0, 3.0, 0.25]
    with pytest.raises(NnrtError):
        validate(OT.POW, [spec(I32, (2,)), spec(I32, (2,))], [spec(I32, (2,))])
    assert validate(OT.POW, [spec(F16, (2,)), spec(F16, (1,))], [spec(F16, (2,))]) == V.V1_2


def test_minmax_versions_and_refusals():
    q = spec(Q8S, (2,), scale=1.0)
    assert validate(OT.MINIMUM, [q, q], [q]) == V.V1_3
    with pytest.raises(NnrtError):
        validate(OT.MAXIMUM, [spec(B8, (2,)), spec(B8, (2,))], [spec(B8, (2,))])
    with pytest.raises(NnrtError):
        validate(OT.MAXIMUM, [spec(F32, (2,)), spec(F32, (2,)), spec(T.INT32, value=0)],
                 [spec(F32, (2,))])


def test_cast_ignores_quantization_and_saturates():
    q = arg(Q8, [0, 200], 4.0, 100)
    assert run(OT.CAST, [q], [out(F32, (2,))])[0].tolist() == [0.0, 200.0]
    r = run(OT.CAST, [arg(F32, [-1.0, 2.7, 300.0, -2.7])], [out(Q8, (4,), 4.0, 100)])[0]
    assert r.dtype == np.uint8 and r.tolist() == [0, 2, 255, 0]
    assert run(OT.CAST, [arg(F32, [2.7, -2.7])], [out(I32, (2,))])[0].tolist() == [2, -2]
    assert run(OT.CAST, [arg(I32, [3])], [out(F16, (1,))])[0].dtype == np.float16


def test_cast_versions():
    assert validate(OT.CAST, [spec(F32, (2,))], [spec(Q8, (2,), scale=1.0)]) == V.V1_2
    assert validate(OT.CAST, [spec(B8, (2,))], [spec(B8, (2,))]) == V.V1_3
    with pytest.raises(NnrtError, match="cast"):
        validate(OT.CAST, [spec(B8, (2,))], [spec(F32, (2,))])


# --- comparisons, logic, SELECT --------------------------------------------------

def test_comparisons_broadcast():
    a, b = arg(F32, [[1.0, 2.0, 3.0]]), arg(F32, [[2.0], [1.0]])
    o = [out(B8, (2, 3))]
    assert run(OT.EQUAL, [a, b], o)[0].tolist() == [[False, True, False], [True, False, False]]
    assert run(OT.NOT_EQUAL, [a, b], o)[0].tolist() == [[True, False, True], [False, True, True]]
    assert run(OT.GREATER, [a, b], o)[0].tolist() == [[False, False, True], [False, True, True]]
    assert run(OT.GREATER_EQUAL, [a, b], o)[0].tolist() == [[False, True, True], [True, True, True]]
    assert run(OT.LESS, [a, b], o)[0].tolist() == [[True, False, False], [False, False, False]]
    assert run(OT.LESS_EQUAL, [a, b], o)[0].tolist() == [[True, True, False], [True, False, False]]


def test_quantized_comparison_uses_real_values():
    # reals: a = 1.0, 2.0 ; b = 1.0, 1.0 (different scales and zero points)
    r = run(OT.EQUAL, [arg(Q8, [12, 14], 0.5, 10), arg(Q8, [4, 4], 0.25, 0)], [out(B8, (2,))])[0]
    assert r.dtype == np.bool_ and r.tolist() == [True, False]


def test_comparison_validation():
    assert validate(OT.LESS, [spec(B8, (2,)), spec(B8, (2,))], [spec(B8, (2,))]) == V.V1_2
    q = spec(Q8S, (2,), scale=1.0)
    assert validate(OT.GREATER, [q, q], [spec(B8, (2,))]) == V.V1_3
    with pytest.raises(NnrtError, match="output 0"):
        validate(OT.EQUAL, [spec(F32, (2,)), spec(F32, (2,))], [spec(F32, (2,))])


def test_logical_ops():
    a, b = arg(B8, [True, True, False, False]), arg(B8, [True, False, True, False])
    o = [out(B8, (4,))]
    assert run(OT.LOGICAL_AND, [a, b], o)[0].tolist() == [True, False, False, False]
    assert run(OT.LOGICAL_OR, [a, b], o)[0].tolist() == [True, True, True, False]
    assert run(OT.LOGICAL_NOT, [a], o)[0].tolist() == [False, False, True, True]
    with pytest.raises(NnrtError):
        validate(OT.LOGICAL_AND, [spec(F32, (2,)), spec(F32, (2,))], [spec(B8, (2,))])


def test_select():
    c = arg(B8, [True, False, True])
    r = run(OT.SELECT, [c, arg(F32, [1.0, 2.0, 3.0]), arg(F32, [4.0, 5.0, 6.0])], [out(F32, (3,))])[0]
    assert r.tolist() == [1.0, 5.0, 3.0]
    # quantized: each input requantized to the output (reals 1.5, 3.0, 4.5 / 4, 5, 6)
    r = run(OT.SELECT, [c, arg(Q8, [1, 2, 3], 1.5, 0), arg(Q8, [8, 10, 12], 0.5, 0)],
            [out(Q8, (3,), 1.0, 0)])[0]
    assert r.tolist() == [2, 5, 5]  # 1.5 -> 2 and 4.5 -> 5: ties round away from zero


def test_select_refuses_different_shapes():
    with pytest.raises(NnrtError, match="input 2"):
        validate(OT.SELECT, [spec(B8, (3,)), spec(F32, (3,)), spec(F32, (2,))], [spec(F32, (3,))])
    assert shape(OT.SELECT, [spec(B8, (0, 2)), spec(F32, (4, 0)), spec(F32, ())],
                 [spec(F32)]) == [(4, 2)]


# --- REDUCE_*, ARGMAX, ARGMIN, TOPK_V2 ------------------------------------------------

X = [[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], [[-1.0, 0.5], [2.0, 2.0], [0.0, 1.0]]]


def reduce(op_type, x, axes, keep, o_type=F32, o_dims=()):
    return run(op_type, [x, arg(I32, axes), arg(T.BOOL, keep)], [out(o_type, o_dims)])[0]


def test_reduce_sum_prod_max_min():
    x = arg(F32, X)
    assert reduce(OT.REDUCE_SUM, x, [1], False).tolist() == [[9.0, 12.0], [1.0, 3.5]]
    assert reduce(OT.REDUCE_PROD, x, [-1], True).tolist() == [[[2.0], [12.0], [30.0]],
                                                                [[-0.5], [4.0], [0.0]]]
    # repeated and negative axes
    assert reduce(OT.REDUCE_MAX, x, [0, 2, -1], False).tolist() == [2.0, 4.0, 6.0]
    assert reduce(OT.REDUCE_MIN, x, [0, 1], True).tolist() == [[[-1.0, 0.5]]]


def test_reduce_all_axes_without_keep_dims_gives_shape_1():
    r = reduce(OT.REDUCE_SUM, arg(F32, X), [0, 1, 2], False)
    assert r.shape == (1,) and r.tolist() == [25.5]
    assert shape(OT.REDUCE_SUM, [spec(F32, (2, 3)), spec(I32, (2,), value=[0, 1]),
                                 spec(T.BOOL, value=False)], [spec(F32)]) == [(1,)]


def test_reduce_bool_and_quant8():
    b = arg(B8, [[True, False], [True, True]])
    assert reduce(OT.REDUCE_ALL, b, [1], False, B8).tolist() == [False, True]
    assert reduce(OT.REDUCE_ANY, b, [0], False, B8).tolist() == [True, True]
    q = arg(Q8, [[3, 250], [7, 1]], 0.5, 127)
    r = run(OT.REDUCE_MAX, [q, arg(I32, [0]), arg(T.BOOL, False)], [out(Q8, (2,), 0.5, 127)])[0]
    assert r.dtype == np.uint8 and r.tolist() == [7, 250]


def test_reduce_validation_and_shape():
    axes = spec(I32, (1,), value=[1])
    keep = spec(T.BOOL, value=True)
    assert validate(OT.REDUCE_SUM, [spec(F16, (2, 3)), axes, keep], [spec(F16, (2, 1))]) == V.V1_2
    q = spec(Q8S, (2, 3), scale=1.0)
    assert validate(OT.REDUCE_MIN, [q, axes, keep], [spec(Q8S, (2, 1), scale=1.0)]) == V.V1_3
    with pytest.raises(NnrtError):
        validate(OT.REDUCE_SUM, [spec(Q8, (2, 3), scale=1.0), axes, keep], [spec(Q8, (2, 1), scale=1.0)])
    with pytest.raises(NnrtError):
        validate(OT.REDUCE_ALL, [spec(F32, (2, 3)), axes, keep], [spec(F32, (2, 1))])
    with pytest.raises(NnrtError, match="range"):
        validate(OT.REDUCE_MAX, [spec(F32, (2, 3)), spec(I32, (1,), value=[2]), keep], [spec(F32)])
    with pytest.raises(NnrtError, match="rank"):
        validate(OT.REDUCE_MAX, [spec(F32, (1, 1, 1, 1, 2)), axes, keep], [spec(F32)])
    assert shape(OT.REDUCE_MAX, [spec(F32, (0, 3)), axes, keep], [spec(F32)]) == [(0, 1)]
    assert shape(OT.REDUCE_MAX, [spec(F32, (2, 3)), spec(I32, (1,)), keep], [spec(F32)]) == [(0, 0)]
    assert shape(OT.REDUCE_MAX, [spec(F32, (2, 3)), spec(I32, (1,)), spec(T.BOOL, value=False)],
                 [spec(F32)]) == [()]


def test_argmax_argmin_first_index_on_ties():
    x = arg(F32, [[1.0, 3.0, 3.0], [2.0, 2.0, 0.0]])
    assert run(OT.ARGMAX, [x, arg(T.INT32, 1)], [out(I32, (2,))])[0].tolist() == [1, 0]
    assert run(OT.ARGMIN, [x, arg(T.INT32, -1)], [out(I32, (2,))])[0].tolist() == [0, 2]
    assert run(OT.ARGMAX, [x, arg(T.INT32, 0)], [out(I32, (3,))])[0].tolist() == [1, 0, 0]
    r = run(OT.ARGMIN, [arg(Q8, [5, 1, 1], 1.0, 0), arg(T.INT32, 0)], [out(I32, (1,))])[0]
    assert r.dtype == np.int32 and r.tolist() == [1]  # rank 1 gives shape [1]


def test_argmax_validation_and_shape():
    assert validate(OT.ARGMAX, [spec(I32, (2, 3)), spec(T.INT32, value=1)], [spec(I32, (2,))]) == V.V1_2
    with pytest.raises(NnrtError, match="axis"):
        validate(OT.ARGMAX, [spec(F32, (2, 3)), spec(T.INT32, value=2)], [spec(I32, (2,))])
    with pytest.raises(NnrtError, match="output 0"):
        validate(OT.ARGMIN, [spec(F32, (2, 3)), spec(T.INT32, value=1)], [spec(F32, (2,))])
    assert shape(OT.ARGMAX, [spec(F32, (2, 3, 4)), spec(T.INT32, value=-2)], [spec(I32)]) == [(2, 4)]
    assert shape(OT.ARGMAX, [spec(F32, (5,)), spec(T.INT32, value=0)], [spec(I32)]) == [(1,)]


def test_topk_v2_largest_first_lower_index_on_ties():
    x = arg(F32, [[1.0, 5.0, 3.0, 5.0], [0.0, -1.0, 2.0, 2.0]])
    values, indices = run(OT.TOPK_V2, [x, arg(T.INT32, 3)], [out(F32, (2, 3)), out(I32, (2, 3))])
    assert values.tolist() == [[5.0, 5.0, 3.0], [2.0, 2.0, 0.0]]
    assert indices.dtype == np.int32 and indices.tolist() == [[1, 3, 2], [2, 3, 0]]
    values, indices = run(OT.TOPK_V2, [arg(Q8, [1, 251, 250], 2.0, 128), arg(T.INT32, 1)],
                          [out(Q8, (1,), 2.0, 128), out(I32, (1,))])
    assert values.dtype == np.uint8 and values.tolist() == [251] and indices.tolist() == [1]


def test_topk_v2_validation_and_shape():
    k = spec(T.INT32, value=2)
    assert shape(OT.TOPK_V2, [spec(F32, (0, 5)), k], [spec(F32), spec(I32)]) == [(0, 2), (0, 2)]
    with pytest.raises(NnrtError, match="k"):
        validate(OT.TOPK_V2, [spec(F32, (2, 1)), k], [spec(F32), spec(I32)])
    with pytest.raises(NnrtError, match="output 1"):
        validate(OT.TOPK_V2, [spec(F32, (2, 3)), k], [spec(F32), spec(F32)])
    with pytest.raises(NnrtError):
        run(OT.TOPK_V2, [arg(F32, [1.0]), arg(T.INT32, 2)], [out(F32, (2,)), out(I32, (2,))])
