"""Pooling, resizing and space rearrangement kernels and validators
(nnrt/ops/pooling.py, resize.py, space.py). Expected values are worked out by
hand in the comments."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import nnrt.ops  # noqa: F401  (registers the operations)
from nnrt.errors import NnrtError
from nnrt.model.graph import DataLocation, HalModel, Operand, Operation, Subgraph
from nnrt.model.types import HalVersion, OperandLifeTime as L, OperandType as T, OperationType as Op
from nnrt.ops.registry import Arg, Call, OpView, definition

F32, F16, Q8, S8, I32 = (T.TENSOR_FLOAT32, T.TENSOR_FLOAT16, T.TENSOR_QUANT8_ASYMM,
                         T.TENSOR_QUANT8_ASYMM_SIGNED, T.TENSOR_INT32)


@dataclass(eq=False)
class Spec:
    """One operand of a test operation: a constant when ``const``."""
    type: T
    value: Any = None
    dims: tuple = ()
    scale: float = 0.0
    zero_point: int = 0
    const: bool = False


def tensor(t, value, scale=0.0, zp=0, const=False, dims=None):
    arr = np.asarray(value, dtype=t.dtype)
    return Spec(t, arr, tuple(arr.shape) if dims is None else dims, scale, zp, const)


def out(t, dims, scale=0.0, zp=0):
    return Spec(t, None, tuple(dims), scale, zp)


def i32(v):
    return Spec(T.INT32, v, const=True)


def f32(v):
    return Spec(T.FLOAT32, v, const=True)


def f16(v):
    return Spec(T.FLOAT16, v, const=True)


def flag(v):
    return Spec(T.BOOL, v, const=True)


def view(op_type, ins, outs) -> OpView:
    blob = bytearray()
    operands = []
    for s in ins + outs:
        loc, life = None, (L.SUBGRAPH_OUTPUT if s in outs else L.SUBGRAPH_INPUT)
        if s.const:
            raw = np.asarray(s.value, dtype=s.type.dtype).tobytes()
            loc, life = DataLocation(-1, len(blob), len(raw)), L.CONSTANT_COPY
            blob += raw + b"\0" * (-len(raw) % 4)
        operands.append(Operand(s.type, s.dims, s.scale, s.zero_point, life, loc))
    n = len(ins)
    operation = Operation(op_type, tuple(range(n)), tuple(range(n, n + len(outs))))
    sub = Subgraph(tuple(operands), (operation,), tuple(i for i, s in enumerate(ins) if not s.const),
                   tuple(range(n, n + len(outs))))
    return OpView(HalModel(sub, operand_values=bytes(blob)), None, operation)


def validate(op_type, ins, outs) -> HalVersion:
    return definition(op_type).validate(view(op_type, ins, outs))


def shape(op_type, ins, outs):
    return definition(op_type).shape(view(op_type, ins, outs))


def run(op_type, ins, outs) -> np.ndarray:
    """Validate, check the inferred shape, run the kernel; return output 0."""
    validate(op_type, ins, outs)
    args = [Arg(s.type, s.value, s.scale, s.zero_point) for s in ins]
    operands = [Operand(s.type, s.dims, s.scale, s.zero_point) for s in outs]
    res = definition(op_type).kernel(Call(op_type, args, operands, False, None))[0]
    assert res.dtype == outs[0].type.dtype
    assert shape(op_type, ins, outs)[0] == res.shape
    return res


def refused(op_type, ins, outs):
    with pytest.raises(NnrtError):
        validate(op_type, ins, outs)


NINE = np.arange(1, 10, dtype=np.float32).reshape(1, 3, 3, 1)  # 1 2 3 / 4 5 6 / 7 8 9


# --- pooling ----------------------------------------------------------------

def explicit_pool(x, pads, stride, filt, act=0, nchw=None):
    params = [i32(p) for p in pads] + [i32(stride[0]), i32(stride[1]), i32(filt[0]),
                                       i32(filt[1]), i32(act)]
    return [x] + params + ([flag(nchw)] if nchw is not None else [])


def test_average_pool_counts_only_image_elements():
    # 2x2 filter, stride 1, one column/row of padding right and bottom.
    ins = explicit_pool(tensor(F32, NINE), (0, 1, 0, 1), (1, 1), (2, 2))
    res = run(Op.AVERAGE_POOL_2D, ins, [out(F32, (1, 3, 3, 1))])
    expected = [[3, 4, 4.5],       # (1+2+4+5)/4, (2+3+5+6)/4, (3+6)/2
                [6, 7, 7.5],       # (4+5+7+8)/4, (5+6+8+9)/4, (6+9)/2
                [7.5, 8.5, 9]]     # (7+8)/2, (8+9)/2, 9/1
    np.testing.assert_allclose(res[0, :, :, 0], expected)


def test_max_pool_same_padding_stride_2_and_relu1():
    # Implicit SAME, 5x5 -> 3x3; pads (1, 1) each way for a 3x3 filter.
    x = np.arange(25, dtype=np.float32).reshape(1, 5, 5, 1) - 20
    ins = [tensor(F32, x), i32(1), i32(2), i32(2), i32(3), i32(3), i32(2)]  # RELU1
    res = run(Op.MAX_POOL_2D, ins, [out(F32, (1, 3, 3, 1))])
    # Window maxima: x[min(2i+1, 4), min(2j+1, 4)] = 5*r + c - 20, then clamp to [-1, 1].
    raw = np.array([[6, 8, 9], [16, 18, 19], [21, 23, 24]]) - 20
    np.testing.assert_allclose(res[0, :, :, 0], np.clip(raw, -1, 1))


def test_l2_pool_valid():
    x = np.array([[3, 4], [0, 0]], np.float32).reshape(1, 2, 2, 1)
    ins = [tensor(F32, x), i32(2), i32(1), i32(1), i32(2), i32(2), i32(0)]  # VALID
    res = run(Op.L2_POOL_2D, ins, [out(F32, (1, 1, 1, 1))])
    np.testing.assert_allclose(res.ravel(), [np.sqrt((9 + 16) / 4)])  # 2.5


def test_quant_average_rounds_half_away_from_zero():
    # Filter 2 wide over one row: means 1.5 -> 2 (uint8) and -1.5 -> -2 (int8).
    xu = tensor(Q8, [[[[1], [2]]]], 0.5, 0)
    res = run(Op.AVERAGE_POOL_2D, explicit_pool(xu, (0, 0, 0, 0), (1, 1), (2, 1)),
              [out(Q8, (1, 1, 1, 1), 0.5, 0)])
    assert res.ravel().tolist() == [2]
    xs = tensor(S8, [[[[-1], [-2]]]], 0.5, 0)
    res = run(Op.AVERAGE_POOL_2D, explicit_pool(xs, (0, 0, 0, 0), (1, 1), (2, 1)),
              [out(S8, (1, 1, 1, 1), 0.5, 0)])
    assert res.ravel().tolist() == [-2]


def test_quant_max_pool_relu6_clamps_to_quantized_six():
    # scale 0.5, zero point 10: 6.0 is stored as 22.
    x = tensor(Q8, np.array([5, 40, 12, 30], np.uint8).reshape(1, 2, 2, 1), 0.5, 10)
    ins = explicit_pool(x, (0, 0, 0, 0), (1, 1), (1, 1), act=3)
    res = run(Op.MAX_POOL_2D, ins, [out(Q8, (1, 2, 2, 1), 0.5, 10)])
    assert res.ravel().tolist() == [10, 22, 12, 22]


def test_nchw_pool_matches_nhwc():
    x = np.arange(2 * 4 * 4 * 3, dtype=np.float32).reshape(2, 4, 4, 3) % 7
    nhwc = run(Op.AVERAGE_POOL_2D, explicit_pool(tensor(F32, x), (1, 0, 1, 0), (2, 2), (3, 2)),
               [out(F32, (2, 2, 2, 3))])
    nchw = run(Op.AVERAGE_POOL_2D,
               explicit_pool(tensor(F32, x.transpose(0, 3, 1, 2)), (1, 0, 1, 0), (2, 2), (3, 2),
                             nchw=True),
               [out(F32, (2, 3, 2, 2))])
    np.testing.assert_allclose(nchw, nhwc.transpose(0, 3, 1, 2))


def test_pool_versions_and_refusals():
    x = tensor(F32, NINE)
    o = [out(F32, (1, 3, 3, 1))]
    assert validate(Op.MAX_POOL_2D, explicit_pool(x, (0, 1, 0, 1), (1, 1), (2, 2)), o) == HalVersion.V1_0
    assert validate(Op.MAX_POOL_2D, explicit_pool(x, (0, 1, 0, 1), (1, 1), (2, 2), nchw=False),
                    o) == HalVersion.V1_2
    x16 = tensor(F16, NINE)
    assert validate(Op.L2_POOL_2D, explicit_pool(x16, (0, 1, 0, 1), (1, 1), (2, 2)),
                    [out(F16, (1, 3, 3, 1))]) == HalVersion.V1_2
    # Wrong tensor type, wrong rank, L2 on quant8, output quantization differing.
    refused(Op.MAX_POOL_2D, explicit_pool(tensor(I32, NINE), (0, 1, 0, 1), (1, 1), (2, 2)),
            [out(I32, (1, 3, 3, 1))])
    refused(Op.MAX_POOL_2D, explicit_pool(tensor(F32, NINE[0]), (0, 1, 0, 1), (1, 1), (2, 2)), o)
    q = tensor(Q8, NINE, 0.5, 0)
    refused(Op.L2_POOL_2D, explicit_pool(q, (0, 1, 0, 1), (1, 1), (2, 2)),
            [out(Q8, (1, 3, 3, 1), 0.5, 0)])
    refused(Op.AVERAGE_POOL_2D, explicit_pool(q, (0, 1, 0, 1), (1, 1), (2, 2)),
            [out(Q8, (1, 3, 3, 1), 0.25, 0)])
    refused(Op.AVERAGE_POOL_2D, explicit_pool(x, (0, 1, 0, 1), (0, 1), (2, 2)), o)  # stride 0
    # Declared output shape checked against inference by the caller: 3x3 here.
    assert shape(Op.AVERAGE_POOL_2D, explicit_pool(x, (0, 1, 0, 1), (1, 1), (2, 2)), o) == [(1, 3, 3, 1)]


# --- resizing ---------------------------------------------------------------

def test_resize_bilinear_by_shape():
    # 2x2 -> 3x3: source rows 0, 2/3, 4/3 (clamped to row 1).
    x = tensor(F32, np.array([1, 1, 2, 2], np.float32).reshape(1, 2, 2, 1))
    res = run(Op.RESIZE_BILINEAR, [x, i32(3), i32(3)], [out(F32, (1, 3, 3, 1))])
    np.testing.assert_allclose(res[0, :, :, 0], [[1, 1, 1], [5 / 3] * 3, [2, 2, 2]], rtol=1e-6)


def test_resize_bilinear_by_scale_quant8_and_nchw():
    # width 2 * 1.5 = 3, height 1 * 1.5 = 1; source columns 0, 2/3, 4/3 -> 10, 16.67, 20.
    x = tensor(Q8, np.array([10, 20], np.uint8).reshape(1, 1, 1, 2), 0.1, 0)
    res = run(Op.RESIZE_BILINEAR, [x, f32(1.5), f32(1.5), flag(True)],
              [out(Q8, (1, 1, 1, 3), 0.1, 0)])
    assert res.ravel().tolist() == [10, 17, 20]


def test_resize_bilinear_align_corners_and_half_pixel():
    x = tensor(F32, np.array([0, 1, 2, 3], np.float32).reshape(1, 2, 2, 1))
    res = run(Op.RESIZE_BILINEAR, [x, i32(3), i32(3), flag(False), flag(True), flag(False)],
              [out(F32, (1, 3, 3, 1))])
    np.testing.assert_allclose(res[0, :, :, 0], [[0, .5, 1], [1, 1.5, 2], [2, 2.5, 3]])
    row = tensor(F32, np.array([0, 4], np.float32).reshape(1, 1, 2, 1))
    # Half-pixel source columns -0.25, 0.25, 0.75, 1.25 -> 0, 1, 3, 4.
    res = run(Op.RESIZE_BILINEAR, [row, i32(4), i32(1), flag(False), flag(False), flag(True)],
              [out(F32, (1, 1, 4, 1))])
    np.testing.assert_allclose(res.ravel(), [0, 1, 3, 4])
    assert validate(Op.RESIZE_BILINEAR, [row, i32(4), i32(1), flag(False), flag(False), flag(True)],
                    [out(F32, (1, 1, 4, 1))]) == HalVersion.V1_3


def test_resize_nearest_neighbor():
    x = tensor(F32, np.array([0, 1, 2], np.float32).reshape(1, 1, 3, 1))
    # Floor of 0, 0.6, 1.2, 1.8, 2.4 -> 0 0 1 1 2.
    res = run(Op.RESIZE_NEAREST_NEIGHBOR, [x, i32(5), i32(1), flag(False)], [out(F32, (1, 1, 5, 1))])
    assert res.ravel().tolist() == [0, 0, 1, 1, 2]
    # align_corners: x * 0.5 rounded half away -> 0 1 1 2 2.
    res = run(Op.RESIZE_NEAREST_NEIGHBOR, [x, i32(5), i32(1), flag(False), flag(True)],
              [out(F32, (1, 1, 5, 1))])
    assert res.ravel().tolist() == [0, 1, 1, 2, 2]
    x16 = tensor(F16, np.array([0, 1], np.float16).reshape(1, 1, 2, 1))
    res = run(Op.RESIZE_NEAREST_NEIGHBOR, [x16, f16(2.0), f16(1.0), flag(False)],
              [out(F16, (1, 1, 4, 1))])
    assert res.ravel().tolist() == [0, 0, 1, 1]


def test_resize_refusals():
    x = tensor(F32, np.zeros((1, 2, 2, 1), np.float32))
    o = [out(F32, (1, 3, 3, 1))]
    refused(Op.RESIZE_NEAREST_NEIGHBOR, [x, i32(3), i32(3)], o)          # layout flag required
    refused(Op.RESIZE_BILINEAR, [x, i32(3), f32(1.5)], o)               # mixed size / scale
    refused(Op.RESIZE_BILINEAR, [tensor(F16, np.zeros((1, 2, 2, 1))), f32(1.5), f32(1.5)],
            [out(F16, (1, 3, 3, 1))])                                    # FLOAT16 needs FLOAT16 scales
    refused(Op.RESIZE_BILINEAR, [x, i32(3), i32(3), flag(False), flag(True), flag(True)], o)
    refused(Op.RESIZE_BILINEAR, [x, i32(0), i32(3)], o)
    assert validate(Op.RESIZE_BILINEAR, [x, i32(3), i32(3)], o) == HalVersion.V1_0
    assert validate(Op.RESIZE_BILINEAR, [x, f32(1.5), f32(1.5)], o) == HalVersion.V1_2


# --- space rearrangement -------------------------------------------------------

def test_depth_to_space_and_back():
    # Depth [1 2 3 4] of one pixel becomes the 2x2 block 1 2 / 3 4.
    x = tensor(F32, np.array([1, 2, 3, 4], np.float32).reshape(1, 1, 1, 4))
    res = run(Op.DEPTH_TO_SPACE, [x, i32(2)], [out(F32, (1, 2, 2, 1))])
    assert res[0, :, :, 0].tolist() == [[1, 2], [3, 4]]
    # 2x4 image, 2 channels: the block at block-column j collects pixels (0..1, 2j..2j+1).
    img = np.arange(16, dtype=np.float32).reshape(1, 2, 4, 2)
    res = run(Op.SPACE_TO_DEPTH, [tensor(F32, img), i32(2)], [out(F32, (1, 1, 2, 8))])
    assert res[0, 0, 1].tolist() == [4, 5, 6, 7, 12, 13, 14, 15]
    back = run(Op.DEPTH_TO_SPACE, [tensor(F32, res), i32(2)], [out(F32, (1, 2, 4, 2))])
    np.testing.assert_array_equal(back, img)


def test_space_to_depth_nchw():
    img = np.arange(4, dtype=np.uint8).reshape(1, 1, 2, 2)  # NCHW, one channel
    res = run(Op.SPACE_TO_DEPTH, [tensor(Q8, img, 1.0, 3), i32(2), flag(True)],
              [out(Q8, (1, 4, 1, 1), 1.0, 3)])
    assert res.ravel().tolist() == [0, 1, 2, 3]


def test_batch_to_space_and_space_to_batch():
    x = tensor(F32, np.array([1, 2, 3, 4], np.float32).reshape(4, 1, 1, 1))
    res = run(Op.BATCH_TO_SPACE_ND, [x, tensor(I32, [2, 2], const=True)], [out(F32, (1, 2, 2, 1))])
    assert res[0, :, :, 0].tolist() == [[1, 2], [3, 4]]
    # 1x1x3 row padded by (0, 0) rows and (1, 0) columns with the zero point 7,
    # then split in blocks of 1x2: batch 0 takes even columns [7, 2], batch 1 odd ones [1, 3].
    q = tensor(Q8, np.array([1, 2, 3], np.uint8).reshape(1, 1, 3, 1), 0.5, 7)
    res = run(Op.SPACE_TO_BATCH_ND, [q, tensor(I32, [1, 2], const=True),
                                     tensor(I32, [[0, 0], [1, 0]], const=True)],
              [out(Q8, (2, 1, 2, 1), 0.5, 7)])
    assert res[:, 0, :, 0].tolist() == [[7, 2], [1, 3]]


def test_space_batch_refusals():
    x = tensor(F32, np.zeros((3, 1, 1, 1), np.float32))
    refused(Op.BATCH_TO_SPACE_ND, [x, tensor(I32, [2, 2], const=True)], [out(F32, (0, 0, 0, 0))])
    refused(Op.BATCH_TO_SPACE_ND, [x, tensor(I32, [0, 1], const=True)], [out(F32, (0, 0, 0, 0))])
    refused(Op.SPACE_TO_BATCH_ND, [x, tensor(I32, [1, 1], const=True),
                                   tensor(I32, [[0, -1], [0, 0]], const=True)],
            [out(F32, (0, 0, 0, 0))])
    refused(Op.DEPTH_TO_SPACE, [tensor(F32, np.zeros((1, 1, 1, 3))), i32(2)], [out(F32, (1, 2, 2, 1))])
    refused(Op.SPACE_TO_DEPTH, [tensor(F32, np.zeros((1, 2, 2, 1))), i32(0)], [out(F32, (1, 2, 2, 1))])
    assert validate(Op.BATCH_TO_SPACE_ND, [tensor(F32, np.zeros((4, 1, 1, 1))),
                                           tensor(I32, [2, 2], const=True)],
                    [out(F32, (1, 2, 2, 1))]) == HalVersion.V1_1


def test_channel_shuffle():
    # 6 channels in 2 groups [0 1 2 | 3 4 5] interleave to 0 3 1 4 2 5.
    x = np.arange(12, dtype=np.float32).reshape(2, 6)
    res = run(Op.CHANNEL_SHUFFLE, [tensor(F32, x), i32(2), i32(-1)], [out(F32, (2, 6))])
    assert res[0].tolist() == [0, 3, 1, 4, 2, 5]
    assert res[1].tolist() == [6, 9, 7, 10, 8, 11]
    # Along axis 0 of a 4x1 tensor with 2 groups: rows 0 2 1 3.
    col = np.arange(4, dtype=np.int8).reshape(4, 1)
    res = run(Op.CHANNEL_SHUFFLE, [tensor(S8, col, 1.0, 0), i32(2), i32(0)], [out(S8, (4, 1), 1.0, 0)])
    assert res.ravel().tolist() == [0, 2, 1, 3]
    refused(Op.CHANNEL_SHUFFLE, [tensor(F32, x), i32(4), i32(1)], [out(F32, (2, 6))])
    refused(Op.CHANNEL_SHUFFLE, [tensor(F32, x), i32(2), i32(2)], [out(F32, (2, 6))])
