"""Object-detection operations (HAL 1.2): AXIS_ALIGNED_BBOX_TRANSFORM,
BOX_WITH_NMS_LIMIT, GENERATE_PROPOSALS, DETECTION_POSTPROCESSING, and
RANDOM_MULTINOMIAL (the other HAL 1.2 operation with a data-dependent,
non-elementwise result).

Boxes are ``[x1, y1, x2, y2]`` (DETECTION_POSTPROCESSING: ``[y1, x1, y2, x2]``);
quantized boxes are TENSOR_QUANT16_ASYMM (anchors: TENSOR_QUANT16_SYMM) with
scale 0.125. Everything is computed on float32 real values, like NNAPI's
reference, whose float16 and quantized paths convert to float32 too.

Non-maximum suppression is inherently sequential: the loop runs once per
*kept* box, each step vectorised over the remaining candidates. The
reference picks the first maximum of a candidate array it permutes while
discarding; with equal scores we keep the earliest candidate instead, which
only matters for exact ties.
"""
from __future__ import annotations

import os
from typing import Callable

import numpy as np

from ..model.types import HalVersion, OperationType
from .common import check_quant_params, dequantize, to_output
from .registry import Call, OpView, register
from .roi import (BOOL, F16, F16S, F32, F32S, I32, I32T, Q8, Q8S, Q16A, Q16S, V12, V13,
                  box_coordinates, check_box_quant, check_positive, dim, expect_ndim,
                  signature_validator, to_nhwc)

f32 = np.float32


# --- box arithmetic shared by the operations --------------------------------

def _iou(box: np.ndarray, others: np.ndarray) -> np.ndarray:
    """Intersection over union of ``box`` (4,) with each row of ``others``,
    in float32 (0/0 gives NaN, which no threshold test accepts)."""
    area = (box[2] - box[0]) * (box[3] - box[1])
    areas = (others[:, 2] - others[:, 0]) * (others[:, 3] - others[:, 1])
    w = np.maximum(np.minimum(box[2], others[:, 2]) - np.maximum(box[0], others[:, 0]), f32(0))
    h = np.maximum(np.minimum(box[3], others[:, 3]) - np.maximum(box[1], others[:, 1]), f32(0))
    inter = w * h
    # FP errors give inf/NaN: the executor ignores them
    return inter / (area + areas - inter)


def _nms(scores: np.ndarray, boxes: np.ndarray, limit: int,
         decay: Callable[[np.ndarray], np.ndarray] | None, iou_threshold: float,
         score_threshold: float) -> tuple[np.ndarray, np.ndarray]:
    """Greedy NMS over candidates in the given order.

    Repeatedly keeps the best remaining candidate (at most ``limit``; < 0 =
    no limit). Hard NMS (``decay`` None) drops the others whose IoU with it
    is >= ``iou_threshold``; soft NMS multiplies their scores by
    ``decay(iou)`` and drops those falling below ``score_threshold``.
    Returns the kept positions in keeping order and the (decayed) scores."""
    scores = scores.astype(f32, copy=True)
    alive = np.arange(len(scores))
    if limit < 0:
        limit = len(scores)
    kept = []
    while alive.size and len(kept) < limit:
        k = int(np.argmax(scores[alive]))
        best = alive[k]
        kept.append(best)
        alive = np.delete(alive, k)
        iou = _iou(boxes[best], boxes[alive])
        if decay is None:
            alive = alive[~(iou >= f32(iou_threshold))]
        else:
            scores[alive] = scores[alive] * decay(iou)
            alive = alive[~(scores[alive] < f32(score_threshold))]
    return np.asarray(kept, np.int64), scores


def _transform_boxes(boxes: np.ndarray, deltas: np.ndarray, image_hw: np.ndarray) -> np.ndarray:
    """Apply center-size deltas ``[dx, dy, dw, dh]`` (..., 4) to corner boxes
    (broadcast against ``deltas``) and clip to the image ``[height, width]``."""
    w = boxes[..., 2] - boxes[..., 0]
    h = boxes[..., 3] - boxes[..., 1]
    cx = (boxes[..., 0] + boxes[..., 2]) / f32(2)
    cy = (boxes[..., 1] + boxes[..., 3]) / f32(2)
    new_w = np.exp(deltas[..., 2]) * w
    new_h = np.exp(deltas[..., 3]) * h
    new_cx = cx + deltas[..., 0] * w
    new_cy = cy + deltas[..., 1] * h
    img_h, img_w = image_hw[..., 0], image_hw[..., 1]
    out = np.stack([new_cx - new_w / f32(2), new_cy - new_h / f32(2),
                    new_cx + new_w / f32(2), new_cy + new_h / f32(2)], axis=-1)
    limit = np.stack([img_w, img_h, img_w, img_h], axis=-1)
    return np.minimum(np.maximum(out, f32(0)), limit).astype(f32)


def _check_corner_boxes(call: Call, boxes: np.ndarray, what: str) -> None:
    if np.any(boxes[..., 0] > boxes[..., 2]) or np.any(boxes[..., 1] > boxes[..., 3]):
        raise call.fail(f"{what} with x2 < x1 or y2 < y1")


def _floats(arg) -> np.ndarray:
    return dequantize(arg).astype(f32, copy=False)


# --- AXIS_ALIGNED_BBOX_TRANSFORM --------------------------------------------

_BBOX_ROWS = [
    ((F32, F32, I32T, F32), (F32,), V12),
    ((F16, F16, I32T, F16), (F16,), V12),
    ((Q16A, Q8, I32T, Q16A), (Q16A,), V12),
    ((Q16A, Q8S, I32T, Q16A), (Q16A,), V13),
]


def _validate_bbox(op: OpView) -> HalVersion:
    version = signature_validator(op, _BBOX_ROWS)
    for i, rank in enumerate((2, 2, 1, 2)):
        op.expect_rank(i, rank)
    check_quant_params(op)
    check_box_quant(op, 0, 3, outputs=(0,))
    return version


def _bbox_shape(op: OpView) -> list[tuple[int, ...]]:
    rois, deltas = op.dims(0), op.dims(1)
    if dim(deltas, 1) % 4:
        raise op.fail(f"input 1 must be [num_rois, num_classes * 4], got {list(deltas)}")
    return [(dim(rois, 0) or dim(deltas, 0), dim(deltas, 1))]


def _bbox_kernel(call: Call) -> list[np.ndarray]:
    rois_arg, deltas_arg, batches_arg, info_arg = call.ins
    boxes, deltas, info = _floats(rois_arg), _floats(deltas_arg), _floats(info_arg)
    batches = np.asarray(batches_arg.value, np.int64)
    expect_ndim(call, deltas, 2, "deltas")
    n = boxes.shape[0]
    if boxes.shape != (n, 4) or deltas.shape[0] != n or deltas.shape[1] % 4 or not deltas.shape[1]:
        raise call.fail(f"bad shapes: rois {list(boxes.shape)}, deltas {list(deltas.shape)}")
    if batches.shape != (n,) or info.ndim != 2 or info.shape[1] != 2 or info.shape[0] == 0:
        raise call.fail("batch indexes must be [num_rois] and image info [batches, 2]")
    if np.any((batches < 0) | (batches >= info.shape[0])):
        raise call.fail("batch index out of range")
    _check_corner_boxes(call, boxes, "ROI")
    deltas = deltas.reshape(n, deltas.shape[1] // 4, 4)
    out = _transform_boxes(boxes[:, None, :], deltas, info[batches][:, None, :])
    return [to_output(out.reshape(n, deltas.shape[1] * 4), call.outs[0])]


register(OperationType.AXIS_ALIGNED_BBOX_TRANSFORM, validate=_validate_bbox, shape=_bbox_shape,
         kernel=_bbox_kernel)


# --- BOX_WITH_NMS_LIMIT -----------------------------------------------------

_NMS_ROWS = [
    ((F32, F32, I32T, F32S, I32, I32, F32S, F32S, F32S), (F32, F32, I32T, I32T), V12),
    ((F16, F16, I32T, F16S, I32, I32, F16S, F16S, F16S), (F16, F16, I32T, I32T), V12),
    ((Q8, Q16A, I32T, F32S, I32, I32, F32S, F32S, F32S), (Q8, Q16A, I32T, I32T), V12),
    ((Q8S, Q16A, I32T, F32S, I32, I32, F32S, F32S, F32S), (Q8S, Q16A, I32T, I32T), V13),
]
_HARD, _LINEAR, _GAUSSIAN = 0, 1, 2


def _validate_box_nms(op: OpView) -> HalVersion:
    version = signature_validator(op, _NMS_ROWS)
    for i, rank in enumerate((2, 2, 1)):
        op.expect_rank(i, rank)
    check_quant_params(op)
    check_box_quant(op, 1, outputs=(1,))
    kernel = op.value(5)
    if kernel is not None and kernel not in (_HARD, _LINEAR, _GAUSSIAN):
        raise op.fail(f"input 5 (NMS kernel) must be 0, 1 or 2, got {kernel}")
    return version


def _box_nms_shape(op: OpView) -> list[tuple[int, ...]]:
    scores, rois = op.dims(0), op.dims(1)
    if dim(scores, 1) == 1:
        raise op.fail("input 0 needs at least 2 classes (class 0 is the background)")
    if dim(scores, 1) and dim(rois, 1) and dim(rois, 1) != 4 * dim(scores, 1):
        raise op.fail(f"input 1 must be [num_rois, num_classes * 4], got {list(rois)}")
    # The number of kept boxes depends on the data.
    return [(0,), (0, 4), (0,), (0,)]


def _decay(kernel: int, iou_threshold: float, sigma: float):
    if kernel == _HARD:
        return lambda iou: np.where(iou < f32(iou_threshold), f32(1), f32(0))
    if kernel == _LINEAR:
        return lambda iou: np.where(iou < f32(iou_threshold), f32(1), f32(1) - iou)
    return lambda iou: np.exp(f32(-1) * iou * iou / f32(sigma)).astype(f32)


def _batch_runs(batches: np.ndarray) -> list[tuple[int, int]]:
    """(start, end) of each run of equal consecutive batch indexes (the
    boxes of one image must be grouped together)."""
    if not len(batches):
        return []
    starts = np.flatnonzero(np.r_[True, batches[1:] != batches[:-1]])
    return list(zip(starts.tolist(), np.r_[starts[1:], len(batches)].tolist()))


def _box_nms_kernel(call: Call) -> list[np.ndarray]:
    score_arg, roi_arg, batch_arg = call.ins[:3]
    score_threshold, max_detections, kernel, iou_threshold, sigma, nms_threshold = (
        a.value for a in call.ins[3:])
    if kernel not in (_HARD, _LINEAR, _GAUSSIAN):
        raise call.fail(f"unsupported NMS kernel {kernel}")
    scores = _floats(score_arg)
    expect_ndim(call, scores, 2, "scores")
    n, classes = scores.shape
    boxes = box_coordinates(roi_arg)
    batches = np.asarray(batch_arg.value, np.int64)
    if boxes.shape != (n, classes * 4) or batches.shape != (n,):
        raise call.fail(f"boxes must be [{n}, {classes * 4}] and batch indexes [{n}], got "
                        f"{list(boxes.shape)} and {list(batches.shape)}")
    if classes < 2:
        raise call.fail("needs at least 2 classes (class 0 is the background)")
    boxes = boxes.reshape(n, classes, 4)
    decay = _decay(kernel, iou_threshold, sigma)
    picked_rows, picked_classes, picked_scores = [], [], []
    for start, end in _batch_runs(batches):
        rows, cls, kept_scores = [], [], []
        for c in range(1, classes):  # class 0 is the background
            cand = start + np.flatnonzero(scores[start:end, c] > f32(score_threshold))
            kept, decayed = _nms(scores[cand, c], boxes[cand, c], max_detections, decay,
                                 iou_threshold, nms_threshold)
            rows.append(cand[kept])
            cls.append(np.full(len(kept), c, np.int64))
            kept_scores.append(decayed[kept])
        rows, cls, kept_scores = (np.concatenate(x) for x in (rows, cls, kept_scores))
        # Best max_detections over all classes, then ordered by class and score.
        best = np.argsort(-kept_scores, kind="stable")
        if max_detections >= 0:
            best = best[:max_detections]
        best = best[np.lexsort((-kept_scores[best], cls[best]))]
        picked_rows.append(rows[best])
        picked_classes.append(cls[best])
        picked_scores.append(kept_scores[best])
    rows = np.concatenate(picked_rows or [np.zeros(0, np.int64)]).astype(np.int64)
    cls = np.concatenate(picked_classes or [np.zeros(0, np.int64)]).astype(np.int64)
    kept_scores = np.concatenate(picked_scores or [np.zeros(0, f32)]).astype(f32)
    score_out, roi_out = call.outs[:2]
    # Kept boxes are copied as they are (quantized boxes keep their raw values).
    raw_boxes = np.asarray(roi_arg.value).reshape(n, classes, 4)[rows, cls]
    return [to_output(kept_scores, score_out), raw_boxes.astype(roi_out.type.dtype),
            cls.astype(np.int32), batches[rows].astype(np.int32)]


register(OperationType.BOX_WITH_NMS_LIMIT, validate=_validate_box_nms, shape=_box_nms_shape,
         kernel=_box_nms_kernel)


# --- GENERATE_PROPOSALS -----------------------------------------------------

_PROPOSAL_ROWS = [
    ((F32, F32, F32, F32, F32S, F32S, I32, I32, F32S, F32S, BOOL), (F32, F32, I32T), V12),
    ((F16, F16, F16, F16, F16S, F16S, I32, I32, F16S, F16S, BOOL), (F16, F16, I32T), V12),
    ((Q8, Q8, Q16S, Q16A, F32S, F32S, I32, I32, F32S, F32S, BOOL), (Q8, Q16A, I32T), V12),
    ((Q8S, Q8S, Q16S, Q16A, F32S, F32S, I32, I32, F32S, F32S, BOOL), (Q8S, Q16A, I32T), V13),
]


def _validate_proposals(op: OpView) -> HalVersion:
    version = signature_validator(op, _PROPOSAL_ROWS)
    for i, rank in enumerate((4, 4, 2, 2)):
        op.expect_rank(i, rank)
    check_quant_params(op)
    check_box_quant(op, 2, 3, outputs=(1,))
    check_positive(op, 4, 5)
    return version


def _proposals_shape(op: OpView) -> list[tuple[int, ...]]:
    return [(0,), (0, 4), (0,)]


def _proposals_kernel(call: Call) -> list[np.ndarray]:
    score_arg, delta_arg, anchor_arg, info_arg = call.ins[:4]
    h_stride, w_stride, pre_nms, post_nms, iou_threshold, min_size, nchw = (
        a.value for a in call.ins[4:])
    expect_ndim(call, score_arg.value, 4, "scores")
    expect_ndim(call, delta_arg.value, 4, "deltas")
    scores = to_nhwc(_floats(score_arg), bool(nchw))
    deltas = to_nhwc(_floats(delta_arg), bool(nchw))
    anchors, info = _floats(anchor_arg), _floats(info_arg)
    batches, height, width, num_anchors = scores.shape
    if deltas.shape != (batches, height, width, num_anchors * 4):
        raise call.fail(f"deltas must be {[batches, height, width, num_anchors * 4]} (NHWC), "
                        f"got {list(deltas.shape)}")
    if anchors.shape != (num_anchors, 4) or info.shape != (batches, 2):
        raise call.fail("anchors must be [num_anchors, 4] and image info [batches, 2]")
    _check_corner_boxes(call, anchors, "anchor")
    # Anchor boxes at every feature-map position, in (h, w, anchor) order.
    shift_x = np.arange(width, dtype=f32) * f32(w_stride)
    shift_y = np.arange(height, dtype=f32) * f32(h_stride)
    shifts = np.stack(np.broadcast_arrays(shift_x[None, :], shift_y[:, None],
                                          shift_x[None, :], shift_y[:, None]), axis=-1)
    grid_boxes = (anchors[None, None, :, :] + shifts[:, :, None, :]).reshape(-1, 4)
    out_scores, out_boxes, out_batches = [], [], []
    for b in range(batches):
        boxes = _transform_boxes(grid_boxes, deltas[b].reshape(-1, 4), info[b])
        score = scores[b].reshape(-1)
        order = np.arange(len(score))
        if 0 < pre_nms < len(score):
            order = np.argsort(-score, kind="stable")[:pre_nms]
        cand = boxes[order]
        w = cand[:, 2] - cand[:, 0]
        h = cand[:, 3] - cand[:, 1]
        keep = ((w > f32(min_size)) & (h > f32(min_size))
                & (cand[:, 0] + w / f32(2) < info[b, 1]) & (cand[:, 1] + h / f32(2) < info[b, 0]))
        order = order[keep]
        kept, _ = _nms(score[order], boxes[order], post_nms, None, iou_threshold, 0.0)
        order = order[kept]
        out_scores.append(score[order])
        out_boxes.append(boxes[order])
        out_batches.append(np.full(len(order), b, np.int32))
    score_out, box_out, _ = call.outs
    return [to_output(np.concatenate(out_scores), score_out),
            to_output(np.concatenate(out_boxes).reshape(-1, 4), box_out),
            np.concatenate(out_batches).astype(np.int32)]


register(OperationType.GENERATE_PROPOSALS, validate=_validate_proposals, shape=_proposals_shape,
         kernel=_proposals_kernel)


# --- DETECTION_POSTPROCESSING -----------------------------------------------

_POSTPROCESS_ROWS = [
    ((F32, F32, F32, F32S, F32S, F32S, F32S, BOOL, I32, I32, I32, F32S, F32S, BOOL),
     (F32, F32, I32T, I32T), V12),
    ((F16, F16, F16, F16S, F16S, F16S, F16S, BOOL, I32, I32, I32, F16S, F16S, BOOL),
     (F16, F16, I32T, I32T), V12),
]


def _validate_postprocess(op: OpView) -> HalVersion:
    version = signature_validator(op, _POSTPROCESS_ROWS)
    for i, rank in enumerate((3, 3, 2)):
        op.expect_rank(i, rank)
    check_positive(op, 3, 4, 5, 6, 8)
    check_positive(op, 11, 12, allow_zero=True)
    regular = op.value(7)
    if regular is True:
        check_positive(op, 10)
    elif regular is False:
        check_positive(op, 9)
    if dim(op.dims(0), 2) == 1:
        raise op.fail("input 0 needs at least 2 classes (class 0 is the background)")
    if 0 < dim(op.dims(1), 2) < 4:
        raise op.fail("input 1 box encodings need at least 4 values")
    return version


def _postprocess_shape(op: OpView) -> list[tuple[int, ...]]:
    batches = dim(op.dims(0), 0)
    regular, max_detections, max_classes = op.value(7), op.value(8), op.value(9)
    detections = 0
    if regular is not None and max_detections is not None:
        if regular:
            detections = max_detections
        elif max_classes is not None:
            detections = max_detections * max_classes
    return [(batches, detections), (batches, detections, 4), (batches, detections), (batches,)]


def _decode_center_size(anchors: np.ndarray, deltas: np.ndarray, scales) -> np.ndarray:
    """Anchors ``[yc, xc, h, w]`` + scaled deltas -> boxes ``[y1, x1, y2, x2]``."""
    scale_y, scale_x, scale_h, scale_w = (f32(s) for s in scales)
    yc = anchors[:, 0] + anchors[:, 2] * deltas[..., 0] / scale_y
    xc = anchors[:, 1] + anchors[:, 3] * deltas[..., 1] / scale_x
    half_h = anchors[:, 2] * np.exp(deltas[..., 2] / scale_h) * f32(0.5)
    half_w = anchors[:, 3] * np.exp(deltas[..., 3] / scale_w) * f32(0.5)
    return np.stack([yc - half_h, xc - half_w, yc + half_h, xc + half_w], axis=-1).astype(f32)


def _postprocess_kernel(call: Call) -> list[np.ndarray]:
    score_arg, delta_arg, anchor_arg = call.ins[:3]
    (scale_y, scale_x, scale_h, scale_w, regular, max_detections, max_classes,
     max_per_class, score_threshold, iou_threshold, background_in_label) = (
        a.value for a in call.ins[3:])
    scores, deltas, anchors = _floats(score_arg), _floats(delta_arg), _floats(anchor_arg)
    expect_ndim(call, scores, 3, "scores")
    expect_ndim(call, deltas, 3, "box encodings")
    batches, num_anchors, classes = scores.shape
    if deltas.shape[:2] != (batches, num_anchors) or deltas.shape[2] < 4:
        raise call.fail(f"box encodings must be [{batches}, {num_anchors}, >=4], "
                        f"got {list(deltas.shape)}")
    if anchors.shape != (num_anchors, 4) or classes < 2 or max_detections <= 0:
        raise call.fail("bad anchors shape, class count or detection limit")
    boxes = _decode_center_size(anchors, deltas[..., :4], (scale_y, scale_x, scale_h, scale_w))
    per_box_classes = 1 if regular else min(classes - 1, max_classes)
    slots = max_detections * (1 if regular else max_classes)
    out_scores = np.zeros((batches, slots), f32)
    out_boxes = np.zeros((batches, slots, 4), f32)
    out_classes = np.zeros((batches, slots), np.int32)
    out_counts = np.zeros(batches, np.int32)
    label_shift = 0 if background_in_label else 1
    for b in range(batches):
        if regular:
            anchor_ids, class_ids = _regular_nms(scores[b], boxes[b], score_threshold,
                                                 iou_threshold, max_per_class, max_detections)
        else:
            anchor_ids, class_ids = _fast_nms(scores[b], boxes[b], score_threshold,
                                              iou_threshold, max_detections, per_box_classes)
        count = len(anchor_ids)
        out_scores[b, :count] = scores[b, anchor_ids, class_ids]
        out_boxes[b, :count] = boxes[b, anchor_ids]
        out_classes[b, :count] = class_ids - label_shift
        out_counts[b] = count
    score_out, box_out = call.outs[:2]
    return [out_scores.astype(score_out.type.dtype), out_boxes.astype(box_out.type.dtype),
            out_classes, out_counts]


def _regular_nms(scores, boxes, score_threshold, iou_threshold, per_class, limit):
    """NMS per foreground class, then the best ``limit`` overall."""
    anchor_ids, class_ids = [], []
    for c in range(1, scores.shape[1]):
        cand = np.flatnonzero(scores[:, c] > f32(score_threshold))
        kept, _ = _nms(scores[cand, c], boxes[cand], per_class, None, iou_threshold, 0.0)
        anchor_ids.append(cand[kept])
        class_ids.append(np.full(len(kept), c, np.int64))
    anchor_ids, class_ids = np.concatenate(anchor_ids), np.concatenate(class_ids)
    best = np.argsort(-scores[anchor_ids, class_ids], kind="stable")[:limit]
    return anchor_ids[best], class_ids[best]


def _fast_nms(scores, boxes, score_threshold, iou_threshold, limit, per_box_classes):
    """NMS once on each anchor's best foreground score; each kept anchor then
    reports its ``per_box_classes`` best classes."""
    best_score = scores[:, 1:].max(axis=1)
    cand = np.flatnonzero(best_score > f32(score_threshold))
    kept, _ = _nms(best_score[cand], boxes[cand], limit, None, iou_threshold, 0.0)
    anchors = cand[kept]
    top = 1 + np.argsort(-scores[anchors, 1:], axis=1, kind="stable")[:, :per_box_classes]
    return np.repeat(anchors, per_box_classes), top.reshape(-1)


register(OperationType.DETECTION_POSTPROCESSING, validate=_validate_postprocess,
         shape=_postprocess_shape, kernel=_postprocess_kernel)


# --- RANDOM_MULTINOMIAL -----------------------------------------------------

_MULTINOMIAL_ROWS = [
    ((F32, I32, I32T), (I32T,), V12),
    ((F16, I32, I32T), (I32T,), V12),
]


def _validate_multinomial(op: OpView) -> HalVersion:
    version = signature_validator(op, _MULTINOMIAL_ROWS)
    op.expect_rank(0, 2)
    op.expect_rank(2, 1)
    check_positive(op, 1)
    return version


def _multinomial_shape(op: OpView) -> list[tuple[int, ...]]:
    return [(dim(op.dims(0), 0), op.value(1) or 0)]


def _generator(seeds: np.ndarray | None) -> np.random.Generator:
    """numpy Generator seeded from the seed tensor; like TensorFlow, a missing
    or all-zero seed means "non-deterministic" (os.urandom)."""
    if seeds is None or not np.any(seeds):
        return np.random.default_rng(int.from_bytes(os.urandom(16), "little"))
    return np.random.default_rng([int(s) & 0xFFFFFFFF for s in np.ravel(seeds)])


def _multinomial_kernel(call: Call) -> list[np.ndarray]:
    logits_arg, count_arg, seed_arg = call.ins
    logits = dequantize(logits_arg).astype(np.float64)
    samples = int(count_arg.value)
    if samples <= 0 or logits.ndim != 2 or logits.shape[1] == 0:
        raise call.fail("needs [batches, classes] logits and a positive sample count")
    top = logits.max(axis=1, keepdims=True)
    if not np.all(np.isfinite(top)):
        raise call.fail("every batch needs a finite logit")
    cdf = np.cumsum(np.exp(logits - top), axis=1)
    cdf /= cdf[:, -1:]
    uniform = _generator(seed_arg.value).random((logits.shape[0], samples))
    drawn = np.stack([np.searchsorted(row, u, side="right") for row, u in zip(cdf, uniform)])
    return [np.minimum(drawn, logits.shape[1] - 1).astype(np.int32)]


register(OperationType.RANDOM_MULTINOMIAL, validate=_validate_multinomial,
         shape=_multinomial_shape, kernel=_multinomial_kernel)
