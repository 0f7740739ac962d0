"""Detection and region-of-interest kernels and validators (nnrt/ops/roi.py,
nnrt/ops/detection.py). Expected values are worked out by hand in the comments."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import nnrt.ops  # noqa: F401  (registers the operations)
from nnrt.errors import NnrtError
from nnrt.model.graph import DataLocation, HalModel, Operand, Operation, Subgraph
from nnrt.model.types import HalVersion, OperandLifeTime as L, OperandType as T, OperationType as Op
from nnrt.ops.registry import Arg, Call, OpView, definition

F32, F16 = T.TENSOR_FLOAT32, T.TENSOR_FLOAT16
Q8, S8 = T.TENSOR_QUANT8_ASYMM, T.TENSOR_QUANT8_ASYMM_SIGNED
I32T, Q16A, Q16S = T.TENSOR_INT32, T.TENSOR_QUANT16_ASYMM, T.TENSOR_QUANT16_SYMM


@dataclass(eq=False)
class Spec:
    """One operand of a test operation: a constant when ``const``."""
    type: T
    value: Any = None
    dims: tuple = ()
    scale: float = 0.0
    zero_point: int = 0
    const: bool = False


def tensor(t, value, scale=0.0, zp=0, const=False):
    arr = np.asarray(value, dtype=t.dtype)
    return Spec(t, arr, tuple(arr.shape), scale, zp, const)


def boxes16(value):
    """QUANT16_ASYMM boxes from real coordinates (scale 0.125)."""
    return tensor(Q16A, np.round(np.asarray(value) * 8), 0.125)


def out(t, dims, scale=0.0, zp=0):
    return Spec(t, None, tuple(dims), scale, zp)


def i32(v):
    return Spec(T.INT32, v, const=True)


def f32(v):
    return Spec(T.FLOAT32, v, const=True)


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
    inputs = tuple(i for i, s in enumerate(ins) if not s.const)
    sub = Subgraph(tuple(operands), (operation,), inputs, tuple(range(n, n + len(outs))))
    return OpView(HalModel(sub, operand_values=bytes(blob)), None, operation)


def validate(op_type, ins, outs) -> HalVersion:
    return definition(op_type).validate(view(op_type, ins, outs))


def shape(op_type, ins, outs):
    return definition(op_type).shape(view(op_type, ins, outs))


def run(op_type, ins, outs):
    """Validate, then run the kernel; returns the output arrays."""
    validate(op_type, ins, outs)
    args = [Arg(s.type, s.value, s.scale, s.zero_point) for s in ins]
    operands = [Operand(s.type, s.dims, s.scale, s.zero_point) for s in outs]
    with np.errstate(all="ignore"):   # as the executor runs every kernel
        result = definition(op_type).kernel(Call(op_type, args, operands, False, None))
    for arr, o in zip(result, operands):
        assert arr.dtype == o.type.dtype
    return result


def rejects(op_type, ins, outs):
    with pytest.raises(NnrtError):
        validate(op_type, ins, outs)


# A 4x4 single-channel map whose value is linear in the position: 4*y + x.
RAMP = np.arange(16, dtype=np.float32).reshape(1, 4, 4, 1)


# --- ROI_ALIGN --------------------------------------------------------------

def roi_align_ins(data, rois, ratio=2, nchw=False, t=F32, roi=None):
    return [tensor(t, data) if not isinstance(data, Spec) else data,
            roi if roi is not None else tensor(t, rois),
            tensor(I32T, [0] * len(rois), const=True), i32(2), i32(2), f32(1.0), f32(1.0),
            i32(ratio), i32(ratio), flag(nchw)]


def test_roi_align_float():
    # ROI [0,0,4,4] in 2x2 bins of 2x2 samples at 0.5, 1.5 | 2.5, 3.5; bilinear
    # sampling of a linear map is exact except that 3.5 clamps to 3. Bin means:
    # y in {0.5,1.5} -> 1, {2.5,3} -> 2.75; same for x: value = 4*y + x.
    (res,) = run(Op.ROI_ALIGN, roi_align_ins(RAMP, [[0, 0, 4, 4]]), [out(F32, (1, 2, 2, 1))])
    np.testing.assert_allclose(res[0, :, :, 0], [[5, 6.75], [12, 13.75]], rtol=1e-6)


def test_roi_align_nchw_two_channels():
    data = np.concatenate([RAMP, 2 * RAMP], axis=3).transpose(0, 3, 1, 2)   # [1, 2, 4, 4]
    (res,) = run(Op.ROI_ALIGN, roi_align_ins(data, [[0, 0, 4, 4]], nchw=True),
                 [out(F32, (1, 2, 2, 2))])
    np.testing.assert_allclose(res[0, 1], 2 * np.array([[5, 6.75], [12, 13.75]]), rtol=1e-6)


def test_roi_align_quant8_within_one():
    # Input real = q * 0.5 - 5 (zero point 10); output scale 0.25.
    data = tensor(Q8, RAMP * 2 + 10, 0.5, 10)
    ins = roi_align_ins(data, [[0, 0, 4, 4]], t=Q8, roi=boxes16([[0, 0, 4, 4]]))
    (res,) = run(Op.ROI_ALIGN, ins, [out(Q8, (1, 2, 2, 1), 0.25, 0)])
    want = np.array([[5, 6.75], [12, 13.75]]) / 0.25
    assert np.max(np.abs(res[0, :, :, 0].astype(int) - want)) <= 1


def test_roi_align_shape_and_validation():
    ins = roi_align_ins(RAMP, [[0, 0, 4, 4]] * 3)
    assert shape(Op.ROI_ALIGN, ins, [out(F32, (0, 0, 0, 0))]) == [(3, 2, 2, 1)]
    ins_nchw = roi_align_ins(RAMP.transpose(0, 3, 1, 2), [[0, 0, 4, 4]] * 3, nchw=True)
    assert shape(Op.ROI_ALIGN, ins_nchw, [out(F32, (0, 0, 0, 0))]) == [(3, 1, 2, 2)]
    assert validate(Op.ROI_ALIGN, ins, [out(F32, (3, 2, 2, 1))]) == HalVersion.V1_2
    signed = roi_align_ins(tensor(S8, RAMP, 1.0), [[0, 0, 4, 4]], t=S8, roi=boxes16([[0, 0, 4, 4]]))
    assert validate(Op.ROI_ALIGN, signed, [out(S8, (1, 2, 2, 1), 1.0)]) == HalVersion.V1_3
    # Quantized data with float ROIs, a 3-D map, a box scale other than 0.125.
    rejects(Op.ROI_ALIGN, roi_align_ins(tensor(Q8, RAMP, 1.0), [[0, 0, 4, 4]], t=F32),
            [out(Q8, (1, 2, 2, 1), 1.0)])
    rejects(Op.ROI_ALIGN, roi_align_ins(RAMP[0], [[0, 0, 4, 4]]), [out(F32, (1, 2, 2, 1))])
    bad_scale = Spec(Q16A, np.array([[0, 0, 8, 8]], np.uint16), (1, 4), 0.25)
    rejects(Op.ROI_ALIGN, roi_align_ins(tensor(Q8, RAMP, 1.0), [[0]], t=Q8, roi=bad_scale),
            [out(Q8, (1, 2, 2, 1), 1.0)])


def test_roi_align_rejects_roi_outside_map_at_run_time():
    with pytest.raises(NnrtError):
        run(Op.ROI_ALIGN, roi_align_ins(RAMP, [[0, 0, 5, 4]]), [out(F32, (1, 2, 2, 1))])


# --- ROI_POOLING --------------------------------------------------------------

def roi_pool_ins(data, rois, t=F32, roi=None):
    return [tensor(t, data) if not isinstance(data, Spec) else data,
            roi if roi is not None else tensor(t, rois),
            tensor(I32T, [0] * len(rois), const=True), i32(2), i32(2), f32(1.0), f32(1.0),
            flag(False)]


def test_roi_pooling_float():
    # ROI [0,0,3,3] covers 4x4 cells -> bins [0,2) and [2,4) on each axis:
    # maxima 4*1+1, 4*1+3, 4*3+1, 4*3+3. ROI [2,2,2,2] is one cell: every bin
    # (floor/ceil of 2 + 0.5*k) is [2,3) -> 4*2+2 = 10.
    (res,) = run(Op.ROI_POOLING, roi_pool_ins(RAMP, [[0, 0, 3, 3], [2, 2, 2, 2]]),
                 [out(F32, (2, 2, 2, 1))])
    np.testing.assert_array_equal(res[..., 0], [[[5, 7], [13, 15]], [[10, 10], [10, 10]]])


def test_roi_pooling_quant8_keeps_raw_values():
    data = tensor(Q8, RAMP + 100, 0.5, 3)
    ins = roi_pool_ins(data, [[0, 0, 3, 3]], t=Q8, roi=boxes16([[0, 0, 3, 3]]))
    (res,) = run(Op.ROI_POOLING, ins, [out(Q8, (1, 2, 2, 1), 0.5, 3)])
    np.testing.assert_array_equal(res[0, ..., 0], [[105, 107], [113, 115]])


def test_roi_pooling_validation():
    rejects(Op.ROI_POOLING, roi_pool_ins(RAMP, [[0, 0, 3, 3]])[:7], [out(F32, (1, 2, 2, 1))])
    rejects(Op.ROI_POOLING, roi_pool_ins(RAMP, [[0, 0, 3, 3]]), [out(F16, (1, 2, 2, 1))])


# --- HEATMAP_MAX_KEYPOINT -----------------------------------------------------

def test_heatmap_subpixel_peak():
    # g(y, x) = 10 - (x - 1.2)^2 - (y - 0.9)^2 sampled on a 3x3 grid; the
    # quadratic fit is exact: peak at x = 1.2, y = 0.9 with score 10.
    # Keypoint in box [0,0,30,30]: ((1.2 + 0.5) / 3 * 30, (0.9 + 0.5) / 3 * 30).
    y, x = np.mgrid[0:3, 0:3].astype(np.float32)
    heat = (10 - (x - 1.2) ** 2 - (y - 0.9) ** 2).reshape(1, 3, 3, 1)
    score, point = run(Op.HEATMAP_MAX_KEYPOINT, [tensor(F32, heat), tensor(F32, [[0, 0, 30, 30]]),
                                                 flag(False)],
                       [out(F32, (1, 1)), out(F32, (1, 1, 2))])
    np.testing.assert_allclose(score, [[10]], rtol=1e-5)
    np.testing.assert_allclose(point, [[[17, 14]]], rtol=1e-5)


def test_heatmap_corner_peak_mirrors():
    # Peak at (0,0) of a 2x2 map: out-of-map neighbours mirror to index 1, the
    # fit is symmetric -> no offset. Keypoint: 0.5/2 of the box size.
    heat = np.array([[1, 0], [0, 0]], np.float32).reshape(1, 1, 2, 2)    # NCHW
    score, point = run(Op.HEATMAP_MAX_KEYPOINT, [tensor(F32, heat), tensor(F32, [[0, 0, 4, 8]]),
                                                 flag(True)],
                       [out(F32, (1, 1)), out(F32, (1, 1, 2))])
    np.testing.assert_allclose(score, [[1]])
    np.testing.assert_allclose(point, [[[1, 2]]])


def test_heatmap_validation_and_shape():
    heat = tensor(F32, np.zeros((2, 4, 4, 3)))
    ins = [heat, tensor(F32, np.zeros((2, 4))), flag(False)]
    assert shape(Op.HEATMAP_MAX_KEYPOINT, ins, [out(F32, (0, 0)), out(F32, (0, 0, 0))]) == \
        [(2, 3), (2, 3, 2)]
    rejects(Op.HEATMAP_MAX_KEYPOINT, [tensor(Q8, np.zeros((2, 4, 4, 3)), 0.1),
                                      tensor(F32, np.zeros((2, 4))), flag(False)],
            [out(Q8, (2, 3), 0.1), out(Q16A, (2, 3, 2), 0.125)])


# --- AXIS_ALIGNED_BBOX_TRANSFORM ------------------------------------------------

def test_bbox_transform_float():
    # Box [0,0,10,10] (center 5,5, size 10). Class 1 deltas (0.1, 0.2, ln 2, 0):
    # center (6, 7), size (20, 10) -> [-4, 2, 16, 12], clipped to the image
    # (height 100, width 12) -> [0, 2, 12, 12]. Class 0: zero deltas.
    ins = [tensor(F32, [[0, 0, 10, 10]]), tensor(F32, [[0, 0, 0, 0, 0.1, 0.2, math.log(2), 0]]),
           tensor(I32T, [0]), tensor(F32, [[100, 12]])]
    (res,) = run(Op.AXIS_ALIGNED_BBOX_TRANSFORM, ins, [out(F32, (1, 8))])
    np.testing.assert_allclose(res, [[0, 0, 10, 10, 0, 2, 12, 12]], atol=1e-5)


def test_bbox_transform_quant():
    # dx = 0.1 (q 130 at scale 0.05, zp 128): center x 6 -> [1, 0, 11, 10] = raw [8, 0, 88, 80].
    ins = [boxes16([[0, 0, 10, 10]]), tensor(Q8, [[130, 128, 128, 128]], 0.05, 128),
           tensor(I32T, [0]), boxes16([[100, 100]])]
    (res,) = run(Op.AXIS_ALIGNED_BBOX_TRANSFORM, ins, [out(Q16A, (1, 4), 0.125)])
    np.testing.assert_array_equal(res, [[8, 0, 88, 80]])
    ins[1] = tensor(S8, [[2, 0, 0, 0]], 0.05, 0)
    version = validate(Op.AXIS_ALIGNED_BBOX_TRANSFORM, ins, [out(Q16A, (1, 4), 0.125)])
    assert version == HalVersion.V1_3


def test_bbox_transform_validation():
    ins = [tensor(F32, [[0, 0, 1, 1]]), tensor(F16, [[0, 0, 0, 0]]), tensor(I32T, [0]),
           tensor(F32, [[1, 1]])]
    rejects(Op.AXIS_ALIGNED_BBOX_TRANSFORM, ins, [out(F32, (1, 4))])
    ins[1] = tensor(F32, [[0, 0, 0, 0]])
    assert shape(Op.AXIS_ALIGNED_BBOX_TRANSFORM, ins, [out(F32, (0, 0))]) == [(1, 4)]
    with pytest.raises(NnrtError):   # batch index 1 with one image
        ins[2] = tensor(I32T, [1])
        run(Op.AXIS_ALIGNED_BBOX_TRANSFORM, ins, [out(F32, (1, 4))])


# --- BOX_WITH_NMS_LIMIT ---------------------------------------------------------

A, B, C = [0, 0, 10, 10], [1, 1, 11, 11], [20, 20, 30, 30]   # IoU(A, B) = 81/119
IOU_AB = 81 / 119


def nms_ins(kernel, nms_score_threshold, max_detections=-1, sigma=1.0, t=F32):
    scores = [[0.0, 0.9], [0.0, 0.8], [0.0, 0.7]]
    rois = [[0, 0, 0, 0] + A, [0, 0, 0, 0] + B, [0, 0, 0, 0] + C]
    if t == Q8:
        score_t, roi_t = tensor(Q8, np.round(np.array(scores) * 100), 0.01), boxes16(rois)
    else:
        score_t, roi_t = tensor(t, scores), tensor(t, rois)
    return [score_t, roi_t, tensor(I32T, [0, 0, 0]), f32(0.1), i32(max_detections), i32(kernel),
            f32(0.5), f32(sigma), f32(nms_score_threshold)]


def nms_outs(t=F32, n=0):
    if t == Q8:
        return [out(Q8, (n,), 0.01), out(Q16A, (n, 4), 0.125), out(I32T, (n,)), out(I32T, (n,))]
    return [out(t, (n,)), out(t, (n, 4)), out(I32T, (n,)), out(I32T, (n,))]


def test_box_nms_hard():
    # B overlaps A (IoU 0.68 >= 0.5) and is dropped; C is kept.
    scores, rois, classes, batches = run(Op.BOX_WITH_NMS_LIMIT, nms_ins(0, 0.01), nms_outs())
    np.testing.assert_allclose(scores, [0.9, 0.7])
    np.testing.assert_array_equal(rois, [A, C])
    np.testing.assert_array_equal(classes, [1, 1])
    np.testing.assert_array_equal(batches, [0, 0])


def test_box_nms_hard_quirk_zero_score_kept_at_zero_threshold():
    # Hard NMS zeroes B's score; it is dropped only if 0 < nms_score_threshold.
    scores, rois, _, _ = run(Op.BOX_WITH_NMS_LIMIT, nms_ins(0, 0.0), nms_outs())
    np.testing.assert_allclose(scores, [0.9, 0.7, 0.0])
    np.testing.assert_array_equal(rois, [A, C, B])


def test_box_nms_linear_and_gaussian():
    scores, rois, _, _ = run(Op.BOX_WITH_NMS_LIMIT, nms_ins(1, 0.1), nms_outs())
    np.testing.assert_allclose(scores, [0.9, 0.7, 0.8 * (1 - IOU_AB)], rtol=1e-6)
    np.testing.assert_array_equal(rois, [A, C, B])
    scores, _, _, _ = run(Op.BOX_WITH_NMS_LIMIT, nms_ins(2, 0.1, sigma=0.5), nms_outs())
    np.testing.assert_allclose(scores, [0.9, 0.7, 0.8 * math.exp(-IOU_AB ** 2 / 0.5)], rtol=1e-6)
    # Linear decay to 0.255 falls under a 0.3 NMS score threshold.
    scores, _, _, _ = run(Op.BOX_WITH_NMS_LIMIT, nms_ins(1, 0.3), nms_outs())
    np.testing.assert_allclose(scores, [0.9, 0.7])


def test_box_nms_max_detections_and_quant():
    scores, rois, _, _ = run(Op.BOX_WITH_NMS_LIMIT, nms_ins(0, 0.01, max_detections=1), nms_outs())
    np.testing.assert_allclose(scores, [0.9])
    scores, rois, classes, _ = run(Op.BOX_WITH_NMS_LIMIT, nms_ins(0, 0.01, t=Q8), nms_outs(Q8))
    np.testing.assert_array_equal(scores, [90, 70])
    np.testing.assert_array_equal(rois, np.array([A, C]) * 8)   # raw boxes are copied


def test_box_nms_classes_and_batches():
    # Batch 0 (roi 0): class 1 keeps 0.3, class 2 keeps 0.9 -> ordered by class.
    # Batch 1 (roi 1): class 1 keeps 0.8, class 2 (0.2) is under the 0.25 threshold.
    rois = [[0, 0, 0, 0, 0, 0, 1, 1, 2, 2, 3, 3], [0, 0, 0, 0, 4, 4, 5, 5, 6, 6, 7, 7]]
    ins = [tensor(F32, [[0.5, 0.3, 0.9], [0.5, 0.8, 0.2]]), tensor(F32, rois), tensor(I32T, [0, 1]),
           f32(0.25), i32(-1), i32(0), f32(0.5), f32(1.0), f32(0.0)]
    scores, boxes, classes, batches = run(Op.BOX_WITH_NMS_LIMIT, ins, nms_outs())
    np.testing.assert_allclose(scores, [0.3, 0.9, 0.8])
    np.testing.assert_array_equal(boxes, [[0, 0, 1, 1], [2, 2, 3, 3], [4, 4, 5, 5]])
    np.testing.assert_array_equal(classes, [1, 2, 1])
    np.testing.assert_array_equal(batches, [0, 0, 1])


def test_box_nms_validation_and_shape():
    assert shape(Op.BOX_WITH_NMS_LIMIT, nms_ins(0, 0.0), nms_outs()) == [(0,), (0, 4), (0,), (0,)]
    rejects(Op.BOX_WITH_NMS_LIMIT, nms_ins(3, 0.0), nms_outs())            # unknown kernel
    ins = nms_ins(0, 0.0, t=Q8)
    ins[1].scale = 0.25
    rejects(Op.BOX_WITH_NMS_LIMIT, ins, nms_outs(Q8))
    rejects(Op.BOX_WITH_NMS_LIMIT, nms_ins(0, 0.0), nms_outs(F16))


def test_box_nms_zero_rois():
    ins = nms_ins(0, 0.0)
    ins[0], ins[1], ins[2] = (tensor(F32, np.zeros((0, 2))), tensor(F32, np.zeros((0, 8))),
                              tensor(I32T, np.zeros(0)))
    results = run(Op.BOX_WITH_NMS_LIMIT, ins, nms_outs())
    assert [r.shape for r in results] == [(0,), (0, 4), (0,), (0,)]


# --- GENERATE_PROPOSALS ---------------------------------------------------------

def proposal_ins(scores, pre_nms=-1, min_size=1.0, nchw=False):
    # One image, a 1x2 grid, one anchor [0,0,4,4]; stride 8 puts the second
    # position's anchor at [8,0,12,4]. Zero deltas leave the anchors as they are.
    scores = np.asarray(scores, np.float32).reshape(1, 1, 2, 1)
    deltas = np.zeros((1, 1, 2, 4), np.float32)
    if nchw:
        scores, deltas = scores.transpose(0, 3, 1, 2), deltas.transpose(0, 3, 1, 2)
    return [tensor(F32, scores), tensor(F32, deltas), tensor(F32, [[0, 0, 4, 4]]),
            tensor(F32, [[100, 100]]), f32(8.0), f32(8.0), i32(pre_nms), i32(-1), f32(0.5),
            f32(min_size), flag(nchw)]


PROPOSAL_OUTS = [out(F32, (0,)), out(F32, (0, 4)), out(I32T, (0,))]


@pytest.mark.parametrize("nchw", [False, True])
def test_generate_proposals(nchw):
    scores, boxes, batches = run(Op.GENERATE_PROPOSALS, proposal_ins([0.5, 0.9], nchw=nchw),
                                 PROPOSAL_OUTS)
    np.testing.assert_allclose(scores, [0.9, 0.5])
    np.testing.assert_allclose(boxes, [[8, 0, 12, 4], [0, 0, 4, 4]])
    np.testing.assert_array_equal(batches, [0, 0])


def test_generate_proposals_pre_nms_and_min_size():
    scores, _, _ = run(Op.GENERATE_PROPOSALS, proposal_ins([0.5, 0.9], pre_nms=1), PROPOSAL_OUTS)
    np.testing.assert_allclose(scores, [0.9])
    # Boxes 4 wide are not > 5: nothing left.
    results = run(Op.GENERATE_PROPOSALS, proposal_ins([0.5, 0.9], min_size=5.0), PROPOSAL_OUTS)
    assert [r.shape for r in results] == [(0,), (0, 4), (0,)]


def test_generate_proposals_validation():
    ins = proposal_ins([0.5, 0.9])
    assert shape(Op.GENERATE_PROPOSALS, ins, PROPOSAL_OUTS) == [(0,), (0, 4), (0,)]
    ins[2] = tensor(Q16S, [[0, 0, 32, 32]], 0.125)      # quantized anchors with float scores
    rejects(Op.GENERATE_PROPOSALS, ins, PROPOSAL_OUTS)


# --- DETECTION_POSTPROCESSING -----------------------------------------------------

def postprocess_ins(regular, max_detections, max_classes, deltas=None):
    # Anchors [yc, xc, h, w]: [5,5,10,10] and [50,50,10,10] -> boxes (zero
    # deltas) [0,0,10,10] and [45,45,55,55], no overlap.
    scores = [[[0.1, 0.9, 0.3], [0.2, 0.4, 0.6]]]
    deltas = np.zeros((1, 2, 4)) if deltas is None else deltas
    anchors = [[5, 5, 10, 10], [50, 50, 10, 10]]
    return [tensor(F32, scores), tensor(F32, deltas), tensor(F32, anchors),
            f32(10.0), f32(10.0), f32(5.0), f32(5.0), flag(regular), i32(max_detections),
            i32(max_classes), i32(2), f32(0.35), f32(0.5), flag(False)]


def postprocess_outs(n):
    return [out(F32, (1, n)), out(F32, (1, n, 4)), out(I32T, (1, n)), out(I32T, (1,))]


def test_postprocess_regular():
    # Per class (score > 0.35): class 1 keeps anchors 0 (0.9) and 1 (0.4),
    # class 2 keeps anchor 1 (0.6); sorted by score; labels shift down by one.
    scores, boxes, classes, count = run(Op.DETECTION_POSTPROCESSING, postprocess_ins(True, 3, 1),
                                        postprocess_outs(3))
    np.testing.assert_allclose(scores, [[0.9, 0.6, 0.4]])
    np.testing.assert_allclose(boxes, [[[0, 0, 10, 10], [45, 45, 55, 55], [45, 45, 55, 55]]])
    np.testing.assert_array_equal(classes, [[0, 1, 0]])
    np.testing.assert_array_equal(count, [3])


def test_postprocess_fast():
    # Best class per anchor: 0.9 (class 1) and 0.6 (class 2); with two classes
    # per detection each anchor also reports its second class.
    scores, _, classes, count = run(Op.DETECTION_POSTPROCESSING, postprocess_ins(False, 2, 1),
                                    postprocess_outs(2))
    np.testing.assert_allclose(scores, [[0.9, 0.6]])
    np.testing.assert_array_equal(classes, [[0, 1]])
    np.testing.assert_array_equal(count, [2])
    scores, _, classes, count = run(Op.DETECTION_POSTPROCESSING, postprocess_ins(False, 2, 2),
                                    postprocess_outs(4))
    np.testing.assert_allclose(scores, [[0.9, 0.3, 0.6, 0.4]])
    np.testing.assert_array_equal(classes, [[0, 1, 1, 0]])
    np.testing.assert_array_equal(count, [4])


def test_postprocess_decoding_and_padding():
    # Anchor 1 deltas (1, 2, 0, 0) with scales 10: centre (50 + 10*1/10, 50 + 10*2/10).
    deltas = np.array([[[0, 0, 0, 0], [1, 2, 0, 0]]])
    _, boxes, _, count = run(Op.DETECTION_POSTPROCESSING, postprocess_ins(True, 5, 1, deltas),
                             postprocess_outs(5))
    np.testing.assert_allclose(boxes[0, 1], [46, 47, 56, 57])
    np.testing.assert_array_equal(boxes[0, 3:], 0)        # unused slots are zero
    np.testing.assert_array_equal(count, [3])


def test_postprocess_shape_and_validation():
    dims = shape(Op.DETECTION_POSTPROCESSING, postprocess_ins(False, 3, 2), postprocess_outs(0))
    assert dims == [(1, 6), (1, 6, 4), (1, 6), (1,)]
    ins = postprocess_ins(True, 3, 1)
    ins[8] = i32(0)
    rejects(Op.DETECTION_POSTPROCESSING, ins, postprocess_outs(0))
    rejects(Op.DETECTION_POSTPROCESSING, postprocess_ins(True, 3, 1)[:13], postprocess_outs(3))


# --- RANDOM_MULTINOMIAL ------------------------------------------------------------

def multinomial_ins(logits, samples, seeds):
    return [tensor(F32, logits), i32(samples), tensor(I32T, seeds, const=True)]


def test_random_multinomial_distribution_and_seed():
    logits = [[math.log(0.25), math.log(0.75), -1e9]]
    ins = multinomial_ins(logits, 20000, [7, 11])
    (draws,) = run(Op.RANDOM_MULTINOMIAL, ins, [out(I32T, (1, 20000))])
    assert draws.shape == (1, 20000)
    freq = np.bincount(draws[0], minlength=3) / 20000
    np.testing.assert_allclose(freq, [0.25, 0.75, 0.0], atol=0.02)
    (again,) = run(Op.RANDOM_MULTINOMIAL, ins, [out(I32T, (1, 20000))])
    np.testing.assert_array_equal(draws, again)       # same seed, same draws


def test_random_multinomial_validation_and_shape():
    ins = multinomial_ins([[0.0, 0.0]], 5, [1, 2])
    assert shape(Op.RANDOM_MULTINOMIAL, ins, [out(I32T, (0, 0))]) == [(1, 5)]
    rejects(Op.RANDOM_MULTINOMIAL, ins, [out(F32, (1, 5))])
    rejects(Op.RANDOM_MULTINOMIAL, multinomial_ins([[[0.0, 0.0]]], 5, [1, 2]), [out(I32T, (1, 5))])
