"""Region-of-interest operations (HAL 1.2): ROI_ALIGN, ROI_POOLING,
HEATMAP_MAX_KEYPOINT.

ROIs are ``[x1, y1, x2, y2]`` in image coordinates; a stride maps them onto
the feature map. Quantized models carry ROIs as TENSOR_QUANT16_ASYMM with the
fixed scale 0.125 and zero point 0. Kernels loop over ROIs (the per-ROI
sampling grid depends on the ROI's size) and vectorise everything inside one.
``signature_validator`` and the layout helpers are shared with ``detection.py``.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..model.types import HalVersion, OperandType as T, OperationType
from .common import (check_quant_params, dequantize, qrange, quantize, round_half_away,
                     to_output)
from .registry import Arg, Call, OpView, register

V12, V13 = HalVersion.V1_2, HalVersion.V1_3
F32, F16, I32T = T.TENSOR_FLOAT32, T.TENSOR_FLOAT16, T.TENSOR_INT32
Q8, Q8S, Q16A, Q16S = (T.TENSOR_QUANT8_ASYMM, T.TENSOR_QUANT8_ASYMM_SIGNED,
                       T.TENSOR_QUANT16_ASYMM, T.TENSOR_QUANT16_SYMM)
I32, F32S, F16S, BOOL = T.INT32, T.FLOAT32, T.FLOAT16, T.BOOL

# The fixed quantization of box coordinates in quantized models.
BOX_SCALE = 0.125

Signature = tuple[tuple[T, ...], tuple[T, ...], HalVersion]


# --- shared validation helpers ----------------------------------------------

def signature_validator(op: OpView, rows: Sequence[Signature]) -> HalVersion:
    """Match the operand types against a table of accepted signatures (all
    of one length); return the HAL version of the matching row or raise
    naming the first operand that differs from the closest row."""
    op.expect_counts(len(rows[0][0]), len(rows[0][1]))
    ins = tuple(o.type for o in op.inputs)
    outs = tuple(o.type for o in op.outputs)
    for r_in, r_out, version in rows:
        if ins == r_in and outs == r_out:
            return version
    candidates = [r for r in rows if r[0][0] == ins[0]]
    if not candidates:
        op.expect_type_in(0, tuple(dict.fromkeys(r[0][0] for r in rows)))
    best = max(candidates, key=lambda r: sum(a == b for a, b in zip(ins + outs, r[0] + r[1])))
    op.expect_types(best[0], best[1])
    raise op.fail("unsupported combination of operand types")  # not reached


def check_box_quant(op: OpView, *inputs: int, outputs: Sequence[int] = ()) -> None:
    """Quantized box tensors must use scale 0.125 and zero point 0."""
    for which, operands, idx in (("input", op.inputs, inputs), ("output", op.outputs, outputs)):
        for i in idx:
            o = operands[i]
            if o.type in (Q16A, Q16S) and (o.scale != BOX_SCALE or o.zero_point != 0):
                raise op.fail(f"{which} {i} must have scale 0.125 and zero point 0, got "
                              f"{o.scale}/{o.zero_point}")


def check_positive(op: OpView, *indexes: int, allow_zero: bool = False) -> None:
    """Constant scalar parameters that must be > 0 (or >= 0)."""
    for i in indexes:
        v = op.value(i)
        if v is not None and (v < 0 if allow_zero else not v > 0):
            raise op.fail(f"input {i} must be {'>= 0' if allow_zero else '> 0'}, got {v}")


def dim(dims: tuple[int, ...], i: int) -> int:
    """Extent ``i`` of a dimension list, 0 (unknown) when the rank is unknown."""
    return dims[i] if len(dims) > i else 0


def to_nhwc(x: np.ndarray, nchw: bool) -> np.ndarray:
    return x.transpose(0, 2, 3, 1) if nchw else x


def from_nhwc(x: np.ndarray, nchw: bool) -> np.ndarray:
    return x.transpose(0, 3, 1, 2) if nchw else x


def expect_ndim(call: Call, array: np.ndarray, ndim: int, what: str) -> None:
    """Run-time rank check, for operands whose rank was unknown at preparation."""
    if array.ndim != ndim:
        raise call.fail(f"{what} must have rank {ndim}, got shape {list(array.shape)}")


def box_coordinates(arg) -> np.ndarray:
    """Box tensor -> float32 real coordinates (QUANT16 boxes: raw * 0.125)."""
    return dequantize(arg).astype(np.float32, copy=False)


# --- ROI_ALIGN / ROI_POOLING common part --------------------------------------

def _roi_rows(n_scalars_after_strides: int) -> list[Signature]:
    tail = (I32,) * n_scalars_after_strides + (BOOL,)
    return [
        ((F32, F32, I32T, I32, I32, F32S, F32S) + tail, (F32,), V12),
        ((F16, F16, I32T, I32, I32, F16S, F16S) + tail, (F16,), V12),
        ((Q8, Q16A, I32T, I32, I32, F32S, F32S) + tail, (Q8,), V12),
        ((Q8S, Q16A, I32T, I32, I32, F32S, F32S) + tail, (Q8S,), V13),
    ]


def _validate_roi_op(op: OpView, rows: list[Signature]) -> HalVersion:
    version = signature_validator(op, rows)
    op.expect_rank(0, 4)
    op.expect_rank(1, 2)
    op.expect_rank(2, 1)
    check_quant_params(op)
    check_box_quant(op, 1)
    check_positive(op, 3, 4, 5, 6)
    return version


def _roi_shape(layout_input: int):
    def shape(op: OpView) -> list[tuple[int, ...]]:
        data, rois = op.dims(0), op.dims(1)
        num_rois = dim(rois, 0)
        out_h, out_w = op.value(3) or 0, op.value(4) or 0
        nchw = op.value(layout_input)
        if dim(rois, 1) not in (0, 4):
            raise op.fail(f"input 1 must be [num_rois, 4], got {list(rois)}")
        if nchw is None:
            return [(num_rois, 0, 0, 0)]
        depth = dim(data, 1 if nchw else 3)
        return [(num_rois, depth, out_h, out_w) if nchw else (num_rois, out_h, out_w, depth)]
    return shape


def _check_rois(call: Call, boxes: np.ndarray, batch_ids: np.ndarray, num_batches: int,
                height: int, width: int, h_scale: np.float32, w_scale: np.float32) -> None:
    """Malformed ROI data is a run-time error (as in NNAPI's reference)."""
    if np.any((batch_ids < 0) | (batch_ids >= num_batches)):
        raise call.fail("batch index out of range")
    if np.any(boxes < 0):
        raise call.fail("negative ROI coordinate")
    if np.any(boxes[:, [0, 2]] * w_scale > width) or np.any(boxes[:, [1, 3]] * h_scale > height):
        raise call.fail("ROI outside the feature map")
    if np.any(boxes[:, 0] > boxes[:, 2]) or np.any(boxes[:, 1] > boxes[:, 3]):
        raise call.fail("ROI with x2 < x1 or y2 < y1")


def _roi_inputs(call: Call, layout_input: int):
    data, rois, split = call.ins[0], call.ins[1], call.ins[2]
    nchw = bool(call.ins[layout_input].value)
    expect_ndim(call, data.value, 4, "input 0")
    fmap = to_nhwc(data.value, nchw)
    boxes = box_coordinates(rois)
    batch_ids = np.asarray(split.value, np.int64)
    if boxes.ndim != 2 or boxes.shape[1] != 4:
        raise call.fail(f"ROI tensor must be [num_rois, 4], got {list(boxes.shape)}")
    if batch_ids.shape != (boxes.shape[0],):
        raise call.fail("batch index tensor must have one entry per ROI")
    out_h, out_w = int(call.ins[3].value), int(call.ins[4].value)
    h_stride, w_stride = np.float32(call.ins[5].value), np.float32(call.ins[6].value)
    if out_h <= 0 or out_w <= 0 or not (h_stride > 0 and w_stride > 0):
        raise call.fail("output size and strides must be positive")
    h_scale, w_scale = np.float32(1.0) / h_stride, np.float32(1.0) / w_stride
    n, h, w, _ = fmap.shape
    _check_rois(call, boxes, batch_ids, n, h, w, h_scale, w_scale)
    return fmap, boxes, batch_ids, nchw, out_h, out_w, h_scale, w_scale


# --- ROI_ALIGN --------------------------------------------------------------

def _sample_taps(start: np.float32, extent: np.float32, bins: int, ratio: int, size: int):
    """Bilinear taps of the ``bins x samples`` sampling points along one axis.

    Returns (low index, high index, weight of high) arrays of shape
    [bins, samples], all points clamped to the last row/column the way NNAPI
    does (a point past size-1 reads only the edge)."""
    f32 = np.float32
    step = f32(extent / f32(bins))
    samples = ratio if ratio > 0 else int(np.ceil(step))
    bin_size = f32(step / f32(samples))
    bin_start = step * np.arange(bins, dtype=f32)[:, None] + start
    pos = (bin_start + bin_size / f32(2)) + bin_size * np.arange(samples, dtype=f32)[None, :]
    low = np.floor(pos).astype(np.int64)
    frac = (pos - low.astype(f32)).astype(f32)
    edge = low >= size - 1
    low = np.where(edge, size - 1, low)
    high = np.where(edge, size - 1, low + 1)
    frac = np.where(edge, f32(0), frac)
    return low, high, frac


def _roi_align_one(fmap: np.ndarray, box: np.ndarray, out_h: int, out_w: int,
                   ratio_h: int, ratio_w: int, quant: bool):
    """One ROI on one (H, W, C) map: the sum over sampling points of the
    bilinear values and the number of points. ``quant``: weights are
    quantized to 1/255 steps and the sum is exact integer arithmetic, as in
    NNAPI's quantized kernel."""
    f32 = np.float32
    h, w, _ = fmap.shape
    x1, y1, x2, y2 = box
    roi_w = max(f32(x2 - x1), f32(1))
    roi_h = max(f32(y2 - y1), f32(1))
    ylo, yhi, fy = _sample_taps(y1, roi_h, out_h, ratio_h, h)
    xlo, xhi, fx = _sample_taps(x1, roi_w, out_w, ratio_w, w)
    # Axes of every tap array below: [out_h, samples_h, out_w, samples_w].
    ylo, yhi = ylo[:, :, None, None], yhi[:, :, None, None]
    xlo, xhi = xlo[None, None], xhi[None, None]
    fy, fx = fy[:, :, None, None], fx[None, None]
    gy, gx = f32(1) - fy, f32(1) - fx
    if not quant:
        # Separable: interpolate the sampled rows first, then their columns --
        # gathers of out_h rows and out_w columns instead of four gathers of
        # every (row, column) pair (a 192x192 camera crop of a 256x256 frame:
        # ~1 ms rather than ~8); the same terms, summed in another order.
        oh, sh, ow, sw = ylo.shape[0], ylo.shape[1], xlo.shape[2], xlo.shape[3]
        rows = np.take(fmap, ylo.ravel(), axis=0) * gy.reshape(-1, 1, 1) \
            + np.take(fmap, yhi.ravel(), axis=0) * fy.reshape(-1, 1, 1)
        cols = np.take(rows, xlo.ravel(), axis=1) * gx.reshape(1, -1, 1) \
            + np.take(rows, xhi.ravel(), axis=1) * fx.reshape(1, -1, 1)
        cols = cols.reshape(oh, sh, ow, sw, -1)
        return (cols[:, 0, :, 0] if sh == sw == 1 else cols.sum(axis=(1, 3))), sh * sw
    taps = ((gx * gy, ylo, xlo), (fx * gy, ylo, xhi), (gx * fy, yhi, xlo), (fx * fy, yhi, xhi))
    total = 0
    for weight, yi, xi in taps:
        if quant:
            weight = round_half_away(weight / f32(1.0 / 255.0)).astype(np.int64)
        total = total + weight[..., None] * fmap[yi, xi]
    count = ylo.shape[1] * xlo.shape[3]
    return total.sum(axis=(1, 3)), count


def _roi_align_kernel(call: Call) -> list[np.ndarray]:
    fmap, boxes, batch_ids, nchw, out_h, out_w, h_scale, w_scale = _roi_inputs(call, 9)
    ratio_h, ratio_w = int(call.ins[7].value), int(call.ins[8].value)
    if ratio_h < 0 or ratio_w < 0:
        raise call.fail("sampling ratios must be >= 0")
    data, out = call.ins[0], call.outs[0]
    quant = out.type.is_quantized
    depth = fmap.shape[3]
    result = np.zeros((len(boxes), out_h, out_w, depth),
                      np.int64 if quant else np.float32)
    if quant:
        fmap = fmap.astype(np.int64) - data.zero_point
        lo, hi = qrange(out.type)
    else:
        fmap = fmap.astype(np.float32)
    scales = np.array([w_scale, h_scale, w_scale, h_scale], np.float32)
    for r, box in enumerate(boxes * scales):
        total, count = _roi_align_one(fmap[batch_ids[r]], box, out_h, out_w, ratio_h, ratio_w,
                                      quant)
        if quant:
            mult = (np.float32(data.scale) * np.float32(1.0 / 255.0) / np.float32(out.scale)
                    / np.float32(count))
            q = round_half_away(total * np.float64(mult)) + out.zero_point
            result[r] = np.clip(q, lo, hi)
        else:
            result[r] = total / np.float32(count)
    return [from_nhwc(result, nchw).astype(out.type.dtype)]


def _validate_roi_align(op: OpView) -> HalVersion:
    version = _validate_roi_op(op, _roi_rows(2))
    check_positive(op, 7, 8, allow_zero=True)
    return version


register(OperationType.ROI_ALIGN, validate=_validate_roi_align, shape=_roi_shape(9),
         kernel=_roi_align_kernel)


# --- ROI_POOLING ------------------------------------------------------------

def _pool_bins(start: int, end: int, bins: int, size: int):
    """[start, end) of each output bin along one axis (floor / ceil of the
    fractional bin edges, clamped to the map)."""
    f32 = np.float32
    extent = f32(max(end - start + 1, 1))
    step = extent / f32(bins)
    k = np.arange(bins, dtype=f32)
    lo = np.floor(step * k + f32(start)).astype(np.int64)
    hi = np.ceil(step * (k + f32(1)) + f32(start)).astype(np.int64)
    return np.minimum(lo, size), np.minimum(hi, size)


def _segment_max(a: np.ndarray, lo: np.ndarray, hi: np.ndarray, axis: int) -> np.ndarray:
    """max(a[lo[k]:hi[k]]) along ``axis`` for every k, with ``np.maximum.reduceat``
    on interleaved (lo, hi) indices; results of empty segments are garbage."""
    n = a.shape[axis]
    padded = np.concatenate([a, np.take(a, [n - 1], axis=axis)], axis=axis)
    edges = np.stack([lo, hi], axis=1).ravel()
    reduced = np.maximum.reduceat(padded, edges, axis=axis)
    return np.take(reduced, np.arange(0, len(edges), 2), axis=axis)


def _roi_pooling_kernel(call: Call) -> list[np.ndarray]:
    fmap, boxes, batch_ids, nchw, out_h, out_w, h_scale, w_scale = _roi_inputs(call, 7)
    data, out = call.ins[0], call.outs[0]
    _, h, w, depth = fmap.shape
    # Max pooling commutes with the (monotonic) quantization, so quantized
    # maps are pooled raw; an empty bin holds the input zero point (real 0).
    empty_value = data.zero_point if data.type.is_quantized else 0
    result = np.zeros((len(boxes), out_h, out_w, depth), fmap.dtype)
    scales = np.array([w_scale, h_scale, w_scale, h_scale], np.float32)
    corners = round_half_away(boxes * scales).astype(np.int64)
    for r, (x1, y1, x2, y2) in enumerate(corners):
        hlo, hhi = _pool_bins(y1, y2, out_h, h)
        wlo, whi = _pool_bins(x1, x2, out_w, w)
        rows = _segment_max(fmap[batch_ids[r]], hlo, hhi, axis=0)
        bins = _segment_max(rows, wlo, whi, axis=1)
        empty = (hlo >= hhi)[:, None] | (wlo >= whi)[None, :]
        result[r] = np.where(empty[..., None], empty_value, bins)
    if data.type.is_quantized and (data.scale, data.zero_point) != (out.scale, out.zero_point):
        result = quantize(dequantize(Arg(data.type, result, data.scale, data.zero_point)), out)
    return [from_nhwc(result, nchw).astype(out.type.dtype)]


register(OperationType.ROI_POOLING, validate=lambda op: _validate_roi_op(op, _roi_rows(0)),
         shape=_roi_shape(7), kernel=_roi_pooling_kernel)


# --- HEATMAP_MAX_KEYPOINT ---------------------------------------------------

_HEATMAP_ROWS: list[Signature] = [
    ((F32, F32, BOOL), (F32, F32), V12),
    ((F16, F16, BOOL), (F16, F16), V12),
    ((Q8, Q16A, BOOL), (Q8, Q16A), V12),
    ((Q8S, Q16A, BOOL), (Q8S, Q16A), V13),
]


def _validate_heatmap(op: OpView) -> HalVersion:
    version = signature_validator(op, _HEATMAP_ROWS)
    op.expect_rank(0, 4)
    op.expect_rank(1, 2)
    check_quant_params(op)
    check_box_quant(op, 1, outputs=(1,))
    return version


def _heatmap_shape(op: OpView) -> list[tuple[int, ...]]:
    heat = op.dims(0)
    nchw = op.value(2)
    boxes = dim(heat, 0)
    keypoints = 0 if nchw is None else dim(heat, 1 if nchw else 3)
    return [(boxes, keypoints), (boxes, keypoints, 2)]


def _refine_peak(g, atol: float, rtol: float):
    """Sub-pixel peak from the 3x3 neighbourhood ``g[dy][dx]`` (arrays): the
    extremum of the 2nd-order Taylor expansion at the centre, its offset
    clamped to 1.5 pixels. Where the Hessian is (nearly) singular the offset
    stays 0 and the score the centre value."""
    f32 = np.float32
    b0 = -(g[1][2] - g[1][0]) / f32(2)
    b1 = -(g[2][1] - g[0][1]) / f32(2)
    a00 = g[1][0] - f32(2) * g[1][1] + g[1][2]
    a01 = (g[2][2] - g[2][0] - g[0][2] + g[0][0]) / f32(4)
    a11 = g[0][1] - f32(2) * g[1][1] + g[2][1]
    cross = a00 * a11
    det = cross - a01 * a01
    solvable = ~(np.abs(det) < f32(atol) + f32(rtol) * cross)
    # FP errors give inf/NaN: the executor ignores them
    d0 = (a11 * b0 - a01 * b1) / det
    d1 = (a00 * b1 - a01 * b0) / det
    biggest = np.maximum(np.abs(d0), np.abs(d1))
    shrink = np.where(biggest > f32(1.5), f32(1.5) / biggest, f32(1))
    d0 = np.where(solvable, d0 * shrink, f32(0)).astype(f32)
    d1 = np.where(solvable, d1 * shrink, f32(0)).astype(f32)
    score = g[1][1] - b0 * d0 - b1 * d1 + ((a00 * d0 + a01 * d1) * d0
                                          + (a01 * d0 + a11 * d1) * d1) / f32(2)
    return d0, d1, np.where(solvable, score, g[1][1]).astype(f32)


def _heatmap_kernel(call: Call) -> list[np.ndarray]:
    heat_arg, box_arg, layout = call.ins
    nchw = bool(layout.value)
    expect_ndim(call, heat_arg.value, 4, "heatmap")
    heat = to_nhwc(dequantize(heat_arg), nchw)
    boxes = box_coordinates(box_arg)
    n, size, size_w, keypoints = heat.shape
    if size != size_w or size < 2:
        raise call.fail(f"heatmaps must be square and at least 2x2, got {size}x{size_w}")
    if boxes.shape != (n, 4):
        raise call.fail(f"boxes must be [{n}, 4], got {list(boxes.shape)}")
    if np.any(boxes[:, 0] > boxes[:, 2]) or np.any(boxes[:, 1] > boxes[:, 3]):
        raise call.fail("box with x2 < x1 or y2 < y1")
    flat = heat.reshape(n, size * size, keypoints)
    peak = flat.argmax(axis=1)                               # [n, keypoints]
    py, px = peak // size, peak % size
    box_i = np.arange(n)[:, None]
    kp_i = np.arange(keypoints)[None, :]

    def mirrored(i):
        # Out-of-map neighbours reflect to the other side of the peak.
        return np.where(i < 0, 1, np.where(i >= size, size - 2, i))

    grid = [[heat[box_i, mirrored(py + dy), mirrored(px + dx), kp_i] for dx in (-1, 0, 1)]
            for dy in (-1, 0, 1)]
    tol = 1e-3 if heat_arg.type == F16 else 1e-5
    dx, dy, score = _refine_peak(grid, tol, tol)
    f32 = np.float32
    x1, y1 = boxes[:, 0:1], boxes[:, 1:2]
    width, height = boxes[:, 2:3] - x1, boxes[:, 3:4] - y1
    kx = (px.astype(f32) + dx + f32(0.5)) / f32(size) * width + x1
    ky = (py.astype(f32) + dy + f32(0.5)) / f32(size) * height + y1
    points = np.stack([kx, ky], axis=-1)
    score_out, point_out = call.outs
    return [to_output(score, score_out), to_output(points, point_out)]


register(OperationType.HEATMAP_MAX_KEYPOINT, validate=_validate_heatmap, shape=_heatmap_shape,
         kernel=_heatmap_kernel)
