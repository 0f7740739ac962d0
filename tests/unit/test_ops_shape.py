"""Shape manipulation, lookups, FULLY_CONNECTED and BATCH_MATMUL
(nnrt/ops/shape_ops.py, lookup.py, fully_connected.py, matmul.py):
hand-computed values, shape inference and validation refusals."""
from __future__ import annotations

import numpy as np
import pytest

import nnrt.ops  # noqa: F401  (registers every operation)
from nnrt.errors import NnrtError
from nnrt.model.builder import Model
from nnrt.model.graph import Operand
from nnrt.model.types import HalVersion as V, OperandType as T, OperationType as Op
from nnrt.ops.lookup import fingerprint64
from nnrt.ops.registry import Arg, Call, OpView, definition

F32, F16, I32 = T.TENSOR_FLOAT32, T.TENSOR_FLOAT16, T.TENSOR_INT32
Q8, Q8S, B8 = T.TENSOR_QUANT8_ASYMM, T.TENSOR_QUANT8_ASYMM_SIGNED, T.TENSOR_BOOL8


# --- helpers ------------------------------------------------------------------

def t(type, dims, scale=0.0, zp=0, value=None):
    """A tensor operand spec; with ``value`` it is a constant."""
    if value is not None:
        value = np.asarray(value, type.dtype)
    return (type, list(dims), scale, zp, value)


def s(type, value):
    """A constant scalar operand spec."""
    return (type, [], 0.0, 0, value)


def omitted(type):
    return (type, [], 0.0, 0, "omitted")


def _view(op, inputs, outputs):
    m = Model()
    ins = []
    for type, dims, scale, zp, value in inputs:
        i = m.add_operand(type, dims, scale=scale, zero_point=zp)
        if isinstance(value, str):
            m.set_operand_value(i, None)
        elif value is not None:
            m.set_operand_value(i, value)
        ins.append(i)
    outs = [m.add_operand(type, dims, scale=scale, zero_point=zp)
            for type, dims, scale, zp, _ in outputs]
    m.add_operation(op, ins, outs)
    m.identify_inputs_and_outputs([i for i, spec in zip(ins, inputs) if spec[4] is None], outs)
    hal = m.finish().hal_model
    return OpView(hal, None, hal.main.operations[0])


def validate(op, inputs, outputs):
    return definition(op).validate(_view(op, inputs, outputs))


def infer(op, inputs, outputs):
    view = _view(op, inputs, outputs)
    definition(op).validate(view)
    return definition(op).shape(view)


def run(op, args, outs):
    """outs: list of (type, scale, zp)."""
    operands = [Operand(type, (), scale, zp) for type, scale, zp in outs]
    results = definition(op).kernel(Call(op, args, operands, relaxed=False, executor=None))
    for r, o in zip(results, operands):
        assert r.dtype == o.type.dtype
    return results


def arr(values, type=F32, scale=0.0, zp=0):
    a = np.array(values, type.dtype)
    a.flags.writeable = False
    return Arg(type, a, scale, zp)


def sc(value, type=T.INT32):
    return Arg(type, value)


def none(type=I32):
    return Arg(type, None)


# --- CONCATENATION ---------------------------------------------------------------

def test_concat_float_axis1():
    (out,) = run(Op.CONCATENATION, [arr([[1, 2], [3, 4]]), arr([[5], [6]]), sc(1)], [(F32, 0, 0)])
    np.testing.assert_array_equal(out, [[1, 2, 5], [3, 4, 6]])


def test_concat_mixed_quant_requantizes_to_output():
    # a: scale 0.5 zp 0 -> reals 1, 2; b: scale 1 zp 10 -> reals -2, 3; out scale 0.25 zp 20.
    (out,) = run(Op.CONCATENATION, [arr([2, 4], Q8, 0.5, 0), arr([8, 13], Q8, 1.0, 10), sc(0)],
                 [(Q8, 0.25, 20)])
    np.testing.assert_array_equal(out, [24, 28, 12, 32])


def test_concat_validate_versions_and_shape():
    ins = [t(F32, [2, 3]), t(F32, [2, 1]), s(T.INT32, 1)]
    assert validate(Op.CONCATENATION, ins, [t(F32, [2, 4])]) == V.V1_0
    assert infer(Op.CONCATENATION, ins, [t(F32, [0, 0])]) == [(2, 4)]
    q = [t(Q8, [1], 0.5, 1), t(Q8, [1], 0.25, 1), s(T.INT32, 0)]
    assert validate(Op.CONCATENATION, q, [t(Q8, [2], 0.5, 1)]) == V.V1_2
    with pytest.raises(NnrtError):
        validate(Op.CONCATENATION, [t(F32, [2]), t(F16, [2]), s(T.INT32, 0)], [t(F32, [4])])
    with pytest.raises(NnrtError):
        validate(Op.CONCATENATION, [t(F32, [2]), t(F32, [2]), s(T.INT32, 1)], [t(F32, [4])])


@pytest.mark.parametrize("ranks", [(5, 5), (4, 5)])
async def test_concat_of_rank_5_inputs_is_refused_at_compile(ranks):
    """Issue 41: NNAPI's CONCATENATION takes tensors of rank up to 4."""
    import nnrt
    from nnrt.drivers.reference import ReferenceDevice

    m = nnrt.Model()
    a = m.add_operand(F32, [1] * (ranks[0] - 1) + [2])
    b = m.add_operand(F32, [1] * (ranks[1] - 1) + [2])
    axis = m.add_operand(T.INT32)
    m.set_operand_value(axis, 0)
    out = m.add_operand(F32, [])
    m.add_operation(Op.CONCATENATION, [a, b, axis], [out])
    m.identify_inputs_and_outputs([a, b], [out])
    m.finish()
    async with nnrt.Runtime(devices=[ReferenceDevice()]) as rt:
        with pytest.raises(NnrtError) as refused:
            await rt.compile(m)
    assert refused.value.status == nnrt.ErrorStatus.INVALID_ARGUMENT
    k = ranks.index(5)
    assert f"CONCATENATION: input {k} (operand {(a, b)[k]}) must have rank at most 4, " \
           f"got 5" in refused.value.message


# --- RESHAPE, SQUEEZE, EXPAND_DIMS, TRANSPOSE ---------------------------------------

def test_reshape_resolves_minus_one():
    (out,) = run(Op.RESHAPE, [arr(np.arange(6)), arr([3, -1], I32)], [(F32, 0, 0)])
    np.testing.assert_array_equal(out, [[0, 1], [2, 3], [4, 5]])
    assert infer(Op.RESHAPE, [t(F32, [2, 3]), t(I32, [2], value=[-1, 2])],
                 [t(F32, [0, 0])]) == [(3, 2)]
    # Shape given as a model input: only the rank is known.
    assert infer(Op.RESHAPE, [t(F32, [2, 3]), t(I32, [3])], [t(F32, [0, 0, 0])]) == [(0, 0, 0)]


def test_reshape_refuses_two_minus_ones_and_bad_sizes():
    with pytest.raises(NnrtError):
        validate(Op.RESHAPE, [t(F32, [2, 3]), t(I32, [2], value=[-1, -1])], [t(F32, [3, 2])])
    with pytest.raises(NnrtError):
        run(Op.RESHAPE, [arr(np.arange(6)), arr([4, -1], I32)], [(F32, 0, 0)])


def test_squeeze_all_and_listed_axes():
    x = arr(np.zeros((1, 2, 1)))
    (a,) = run(Op.SQUEEZE, [x, none()], [(F32, 0, 0)])
    (b,) = run(Op.SQUEEZE, [x, arr([-1], I32)], [(F32, 0, 0)])
    assert a.shape == (2,) and b.shape == (1, 2)
    with pytest.raises(NnrtError):
        run(Op.SQUEEZE, [x, arr([1], I32)], [(F32, 0, 0)])
    assert infer(Op.SQUEEZE, [t(F32, [1, 1]), omitted(I32)], [t(F32, [1])]) == [(1,)]


def test_expand_dims_negative_axis():
    (out,) = run(Op.EXPAND_DIMS, [arr([[1, 2]], I32), sc(-1)], [(I32, 0, 0)])
    assert out.shape == (1, 2, 1)
    with pytest.raises(NnrtError):
        validate(Op.EXPAND_DIMS, [t(F32, [2]), s(T.INT32, 2)], [t(F32, [2, 1])])


def test_transpose_perm_and_default():
    x = arr(np.arange(6).reshape(2, 3))
    (a,) = run(Op.TRANSPOSE, [x, arr([1, 0], I32)], [(F32, 0, 0)])
    (b,) = run(Op.TRANSPOSE, [x, none()], [(F32, 0, 0)])
    np.testing.assert_array_equal(a, [[0, 3], [1, 4], [2, 5]])
    np.testing.assert_array_equal(b, a)
    with pytest.raises(NnrtError):
        validate(Op.TRANSPOSE, [t(F32, [2, 3]), t(I32, [2], value=[0, 0])], [t(F32, [2, 3])])


# --- STRIDED_SLICE, SLICE, SPLIT, TILE, PAD ----------------------------------------

def _strided(x, begin, end, strides, bm=0, em=0, shrink=0):
    return run(Op.STRIDED_SLICE, [arr(x), arr(begin, I32), arr(end, I32), arr(strides, I32),
                                  sc(bm), sc(em), sc(shrink)], [(F32, 0, 0)])[0]


def test_strided_slice_python_semantics():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_array_equal(_strided(x, [0, 3], [3, 0], [2, -1]), x[0:3:2, 3:0:-1])
    np.testing.assert_array_equal(_strided(x, [-1, -10], [0, 10], [1, 1], bm=1, em=1), x)
    np.testing.assert_array_equal(_strided(x, [1, 0], [2, 4], [1, 2], shrink=1), x[1, 0:4:2])
    # Every dimension shrunk: shape [1], not a scalar.
    assert _strided(x, [1, 2], [2, 3], [1, 1], shrink=3).shape == (1,)


def test_strided_slice_refusals():
    base = [t(F32, [2, 3]), t(I32, [2], value=[1, 0]), t(I32, [2], value=[0, 3])]
    masks = [s(T.INT32, 0), s(T.INT32, 0), s(T.INT32, 1)]
    # A shrunk dimension with a negative stride is invalid (CTS strided_slice_invalid).
    with pytest.raises(NnrtError):
        validate(Op.STRIDED_SLICE, base + [t(I32, [2], value=[-1, 1])] + masks, [t(F32, [3])])
    with pytest.raises(NnrtError):  # zero stride
        validate(Op.STRIDED_SLICE, base + [t(I32, [2], value=[0, 1])] + masks[:2]
                 + [s(T.INT32, 0)], [t(F32, [1, 3])])


def test_slice_with_minus_one_size():
    (out,) = run(Op.SLICE, [arr(np.arange(12).reshape(3, 4), I32), arr([1, 1], I32),
                            arr([-1, 2], I32)], [(I32, 0, 0)])
    np.testing.assert_array_equal(out, [[5, 6], [9, 10]])
    with pytest.raises(NnrtError):
        run(Op.SLICE, [arr([1, 2, 3]), arr([2], I32), arr([2], I32)], [(F32, 0, 0)])


def test_split_three_ways():
    outs = run(Op.SPLIT, [arr(np.arange(6).reshape(1, 6)), sc(1), sc(3)], [(F32, 0, 0)] * 3)
    assert [o.tolist() for o in outs] == [[[0, 1]], [[2, 3]], [[4, 5]]]
    with pytest.raises(NnrtError):
        validate(Op.SPLIT, [t(F32, [5]), s(T.INT32, 0), s(T.INT32, 2)], [t(F32, [2])] * 2)


def test_tile():
    (out,) = run(Op.TILE, [arr([[1, 2]], Q8, 0.5, 3), arr([2, 2], I32)], [(Q8, 0.5, 3)])
    np.testing.assert_array_equal(out, [[1, 2, 1, 2], [1, 2, 1, 2]])


def test_pad_uses_zero_point_and_pad_v2_value():
    (a,) = run(Op.PAD, [arr([[7]], Q8, 0.5, 3), arr([[1, 0], [0, 1]], I32)], [(Q8, 0.5, 3)])
    np.testing.assert_array_equal(a, [[3, 3], [7, 3]])
    (b,) = run(Op.PAD_V2, [arr([1.0]), arr([[1, 2]], I32), sc(9.5, T.FLOAT32)], [(F32, 0, 0)])
    np.testing.assert_array_equal(b, [9.5, 1, 9.5, 9.5])
    with pytest.raises(NnrtError):  # PAD_V2 of float takes a FLOAT32 pad value
        validate(Op.PAD_V2, [t(F32, [1]), t(I32, [1, 2], value=[[0, 0]]), s(T.INT32, 0)],
                 [t(F32, [1])])
    with pytest.raises(NnrtError):
        validate(Op.PAD, [t(F32, [1]), t(I32, [1, 2], value=[[-1, 0]])], [t(F32, [1])])


# --- MEAN --------------------------------------------------------------------------

def test_mean_keep_dims_and_full_reduction():
    x = arr([[1, 2], [3, 5]])
    (a,) = run(Op.MEAN, [x, arr([1], I32), sc(1)], [(F32, 0, 0)])
    (b,) = run(Op.MEAN, [x, arr([0, -1, 0], I32), sc(0)], [(F32, 0, 0)])
    np.testing.assert_allclose(a, [[1.5], [4.0]])
    assert b.shape == (1,) and b[0] == pytest.approx(2.75)
    (q,) = run(Op.MEAN, [arr([[1, 2, 4, 5]], Q8, 0.5, 1), arr([1], I32), sc(0)], [(Q8, 0.5, 1)])
    assert q.tolist() == [3]  # reals 0, .5, 1.5, 2 -> mean 1.0 -> 2 + 1


@pytest.mark.parametrize("scale", [0.7, 0.0235, 0.0039215689, 0.02, 0.17])
@pytest.mark.parametrize("zero_point", [0, -3, 5])
def test_quantized_mean_rounds_an_exact_tie_as_the_reference_kernels_do(scale, zero_point):
    # The exact mean of 18 and 19 steps is 18.5 -> 19. A float32 dequantize
    # first made it 18.4999998 -> 18 with these scales (issue 13). The
    # reference's fixed-point rounding (gemmlowp) takes a tie upwards, so
    # -18.5 -> -18, as LiteRT's reference kernels give.
    x = arr([[18 + zero_point, 19 + zero_point]], Q8S, scale, zero_point)
    (q,) = run(Op.MEAN, [x, arr([1], I32), sc(0)], [(Q8S, scale, zero_point)])
    assert q.tolist() == [19 + zero_point]
    x = arr([[-18 + zero_point, -19 + zero_point]], Q8S, scale, zero_point)
    (q,) = run(Op.MEAN, [x, arr([1], I32), sc(0)], [(Q8S, scale, zero_point)])
    assert q.tolist() == [-18 + zero_point]


# --- lookups -------------------------------------------------------------------------

def test_embedding_lookup_rows():
    (out,) = run(Op.EMBEDDING_LOOKUP, [arr([2, 0], I32), arr([[0, 1], [2, 3], [4, 5]])],
                 [(F32, 0, 0)])
    np.testing.assert_array_equal(out, [[4, 5], [0, 1]])
    with pytest.raises(NnrtError):
        run(Op.EMBEDDING_LOOKUP, [arr([3], I32), arr([[0, 1], [2, 3], [4, 5]])], [(F32, 0, 0)])


def test_hashtable_lookup_hits_and_misses():
    out, hits = run(Op.HASHTABLE_LOOKUP,
                    [arr([5, 7, -1], I32), arr([-1, 5], I32), arr([[1, 2], [3, 4]])],
                    [(F32, 0, 0), (Q8, 1.0, 0)])
    np.testing.assert_array_equal(out, [[3, 4], [0, 0], [1, 2]])
    np.testing.assert_array_equal(hits, [1, 0, 1])


def test_gather_axis_and_index_rank():
    x = arr(np.arange(6).reshape(2, 3), I32)
    (out,) = run(Op.GATHER, [x, sc(1), arr([[2, 0]], I32)], [(I32, 0, 0)])
    assert out.shape == (2, 1, 2) and out.tolist() == [[[2, 0]], [[5, 3]]]
    with pytest.raises(NnrtError):
        run(Op.GATHER, [x, sc(0), arr([2], I32)], [(I32, 0, 0)])


@pytest.mark.parametrize("key, expected", [
    (b"", 0x9AE16A3B2F90404F),
    (b"a", 0xB3454265B6DF75E3),
    (b"abcd", 0x1A5502DE4A1F8101),
    (b"hello world", 0x588FB7478BD6B01B),
    (b"0123456789abcdefghij", 0x5FDB678E878137B),
    (b"The quick brown fox jumps over the lazy dog", 0xABBE83F33B1B5134),
    (bytes(range(100)), 0x3CFF0F886D8D6195),
], ids=["len0", "len1", "len4", "len11", "len20", "len43", "len100"])
def test_fingerprint64_matches_farmhash(key, expected):
    # Values from Google's C++ FarmHash (util::Fingerprint64), one per length branch.
    keys = np.frombuffer(key, np.uint8).reshape(1, len(key))
    assert int(fingerprint64(np.repeat(keys, 2, axis=0))[1]) == expected


def test_lsh_projection_sparse_types_and_dense():
    hashes = arr([[0.5, -1.0], [2.0, 3.0]])
    data = arr([[1, 2], [3, 4], [5, 6]], I32)
    weight = arr([1.0, -2.0, 0.5])
    (dense,) = run(Op.LSH_PROJECTION, [hashes, data, weight, sc(2)], [(I32, 0, 0)])
    (sparse1,) = run(Op.LSH_PROJECTION, [hashes, data, weight, sc(1)], [(I32, 0, 0)])
    (sparse3,) = run(Op.LSH_PROJECTION, [hashes, data, weight, sc(3)], [(I32, 0, 0)])
    # Slow reference: sign of sum_i w_i * int64(fingerprint(seed bytes + row bytes)).
    bits = []
    for seed in np.float32([0.5, -1.0, 2.0, 3.0]):
        score = 0.0
        for row, w in zip(np.int32([[1, 2], [3, 4], [5, 6]]), [1.0, -2.0, 0.5]):
            key = np.frombuffer(seed.tobytes() + row.tobytes(), np.uint8).reshape(1, -1)
            score += w * float(fingerprint64(key).view(np.int64)[0])
        bits.append(int(score > 0))
    assert dense.tolist() == bits
    sig = [bits[0] * 2 + bits[1], bits[2] * 2 + bits[3]]
    assert sparse1.tolist() == sig
    assert sparse3.tolist() == [sig[0], sig[1] + 4]
    assert infer(Op.LSH_PROJECTION, [t(F32, [2, 2], value=[[0.5, -1], [2, 3]]), t(I32, [3, 2]),
                                     omitted(F32), s(T.INT32, 3)], [t(I32, [2])]) == [(2,)]
    with pytest.raises(NnrtError):
        validate(Op.LSH_PROJECTION, [t(F32, [2, 2]), t(I32, [3, 2]), omitted(F32),
                                     s(T.INT32, 4)], [t(I32, [2])])


# --- FULLY_CONNECTED ------------------------------------------------------------------

def test_fully_connected_float_flattens_input():
    x = arr(np.arange(6).reshape(1, 2, 3))  # -> [2, 3]
    w = arr([[1, 0, 0], [1, 1, 1]])
    (out,) = run(Op.FULLY_CONNECTED, [x, w, arr([0.5, -20]), sc(1)], [(F32, 0, 0)])
    np.testing.assert_array_equal(out, [[0.5, 0], [3.5, 0]])  # RELU clamps -17 and -8


def test_fully_connected_quant8():
    # real x = [1, 2] (scale .5, zp 0), w = [[1, -1]] (scale 1, zp 128), bias 0.5 (scale .5)
    (out,) = run(Op.FULLY_CONNECTED, [arr([[2, 4]], Q8, 0.5, 0), arr([[129, 127]], Q8, 1.0, 128),
                                      Arg(I32, np.array([1], np.int32), 0.5, 0), sc(0)],
                 [(Q8, 0.25, 100)])
    assert out.tolist() == [[98]]  # (1 - 2 + 0.5) / 0.25 + 100


def test_fully_connected_validation():
    good = [t(F32, [2, 3]), t(F32, [4, 3]), t(F32, [4]), s(T.INT32, 0)]
    assert validate(Op.FULLY_CONNECTED, good, [t(F32, [2, 4])]) == V.V1_0
    assert infer(Op.FULLY_CONNECTED, good, [t(F32, [0, 0])]) == [(2, 4)]
    with pytest.raises(NnrtError):  # bias type must be INT32 for quant8
        validate(Op.FULLY_CONNECTED, [t(Q8, [2, 3], 0.5), t(Q8, [4, 3], 0.5), t(Q8, [4], 0.25),
                                      s(T.INT32, 0)], [t(Q8, [2, 4], 1.0)])
    with pytest.raises(NnrtError):  # bias scale != input scale * weights scale
        validate(Op.FULLY_CONNECTED, [t(Q8, [2, 3], 0.5), t(Q8, [4, 3], 0.5), t(I32, [4], 0.5),
                                      s(T.INT32, 0)], [t(Q8, [2, 4], 1.0)])
    with pytest.raises(NnrtError):  # weights must be 2-D
        validate(Op.FULLY_CONNECTED, [t(F32, [2, 3]), t(F32, [4, 3, 1]), t(F32, [4]),
                                      s(T.INT32, 0)], [t(F32, [2, 4])])


# --- PACK and BATCH_MATMUL (feature level 6) ------------------------------------------

def test_pack_on_each_axis():
    a, b = arr([[1, 2, 3], [4, 5, 6]]), arr([[7, 8, 9], [10, 11, 12]])
    (out,) = run(Op.PACK, [sc(0), a, b], [(F32, 0, 0)])
    assert out.tolist() == [[[1, 2, 3], [4, 5, 6]], [[7, 8, 9], [10, 11, 12]]]
    (out,) = run(Op.PACK, [sc(1), a, b], [(F32, 0, 0)])
    assert out.tolist() == [[[1, 2, 3], [7, 8, 9]], [[4, 5, 6], [10, 11, 12]]]
    (out,) = run(Op.PACK, [sc(2), a, b], [(F32, 0, 0)])
    assert out.tolist() == [[[1, 7], [2, 8], [3, 9]], [[4, 10], [5, 11], [6, 12]]]
    (out,) = run(Op.PACK, [sc(0), arr([-128, 127], Q8S, 0.5, 3)], [(Q8S, 0.5, 3)])
    assert out.tolist() == [[-128, 127]]


def test_pack_validation():
    ins = [s(T.INT32, 1), t(Q8, [2, 3], 0.5, 7), t(Q8, [2, 3], 0.5, 7)]
    assert validate(Op.PACK, ins, [t(Q8, [2, 2, 3], 0.5, 7)]) == V.FL6
    assert infer(Op.PACK, ins, [t(Q8, [0, 0, 0], 0.5, 7)]) == [(2, 2, 3)]
    with pytest.raises(NnrtError, match="input 0"):  # the axis is an INT32 scalar, not a tensor
        validate(Op.PACK, [t(I32, [1])] + ins[1:], [t(Q8, [2, 2, 3], 0.5, 7)])
    refused = {
        "axis -1": [s(T.INT32, -1), t(F32, [2]), t(F32, [2])],        # [0, rank] only
        "axis 2": [s(T.INT32, 2), t(F32, [2]), t(F32, [2])],
        "dimension 0": [s(T.INT32, 0), t(F32, [2]), t(F32, [3])],
        "scale 0.25": [s(T.INT32, 0), t(Q8, [2], 0.5, 7), t(Q8, [2], 0.25, 7)],
        "TENSOR_BOOL8": [s(T.INT32, 0), t(B8, [2]), t(B8, [2])],
    }
    for message, inputs in refused.items():
        out_type = inputs[1][0]
        with pytest.raises(NnrtError, match=message):
            validate(Op.PACK, inputs, [t(out_type, [2, 2], *inputs[1][2:4])])


def test_batch_matmul_adjoint_flags():
    x, y = arr([[1, 2], [3, 4]]), arr([[5, 6], [7, 8]])
    no, yes = sc(False, T.BOOL), sc(True, T.BOOL)
    assert run(Op.BATCH_MATMUL, [x, y, no, no], [(F32, 0, 0)])[0].tolist() == [[19, 22], [43, 50]]
    assert run(Op.BATCH_MATMUL, [x, y, yes, no], [(F32, 0, 0)])[0].tolist() == [[26, 30], [38, 44]]
    assert run(Op.BATCH_MATMUL, [x, y, no, yes], [(F32, 0, 0)])[0].tolist() == [[17, 23], [39, 53]]
    # Omitted flags are false; batches multiply pairwise.
    xb, yb = arr([[[1, 2]], [[3, 4]]]), arr([[[1], [1]], [[2], [-1]]])
    (out,) = run(Op.BATCH_MATMUL, [xb, yb, none(T.BOOL), none(T.BOOL)], [(F32, 0, 0)])
    assert out.tolist() == [[[3]], [[2]]]


def test_batch_matmul_int32_wraps_and_quant8_signed_rescales():
    x, y = arr([[65536, 1]], I32), arr([[32768], [5]], I32)
    no = sc(False, T.BOOL)
    assert run(Op.BATCH_MATMUL, [x, y, no, no], [(I32, 0, 0)])[0].tolist() == [[-2147483643]]
    # Reals [1, 2] . [1, 0.25] = 1.5 -> 1.5 / 0.25 + 3 = 9; at scale 0.01: 153, saturated.
    x, y = arr([[3, 5]], Q8S, 0.5, 1), arr([[2], [-1]], Q8S, 0.25, -2)
    assert run(Op.BATCH_MATMUL, [x, y, no, no], [(Q8S, 0.25, 3)])[0].tolist() == [[9]]
    assert run(Op.BATCH_MATMUL, [x, y, no, no], [(Q8S, 0.01, 3)])[0].tolist() == [[127]]


def test_batch_matmul_validation_and_shapes():
    flags = [s(T.BOOL, False), s(T.BOOL, True)]
    ins = [t(F32, [2, 4, 3]), t(F32, [2, 5, 3])] + flags
    assert validate(Op.BATCH_MATMUL, ins, [t(F32, [2, 4, 5])]) == V.FL6
    assert infer(Op.BATCH_MATMUL, ins, [t(F32, [0, 0, 0])]) == [(2, 4, 5)]
    # A flag known only at execution: the rows are lhs's dim -2 or -1.
    ins = [t(F32, [2, 3]), t(F32, [3, 3]), (T.BOOL, [], 0.0, 0, None), flags[0]]
    assert infer(Op.BATCH_MATMUL, ins, [t(F32, [0, 0])]) == [(0, 3)]
    refused = {
        "TENSOR_QUANT8_ASYMM": ([t(Q8, [2, 3], 0.5), t(Q8, [3, 2], 0.5)], t(Q8, [2, 2], 1.0)),
        "rank 3 and input 1": ([t(F32, [1, 2, 3]), t(F32, [3, 2])], t(F32, [1, 2, 2])),
        "same batch size": ([t(F32, [2, 2, 3]), t(F32, [1, 3, 2])], t(F32, [2, 2, 2])),
        "3 columns": ([t(F32, [2, 3]), t(F32, [4, 2])], t(F32, [2, 2])),
        "rank 2 or 3 or 4": ([t(F32, [1, 1, 1, 2, 3]), t(F32, [1, 1, 1, 3, 2])],
                             t(F32, [1, 1, 1, 2, 2])),
    }
    for message, (tensors, out) in refused.items():
        with pytest.raises(NnrtError, match=message):
            validate(Op.BATCH_MATMUL, tensors + [flags[0], flags[0]], [out])
    with pytest.raises(NnrtError, match="must be BOOL"):
        validate(Op.BATCH_MATMUL, [t(F32, [2, 3]), t(F32, [3, 2]), s(T.INT32, 0), flags[0]],
                 [t(F32, [2, 2])])
