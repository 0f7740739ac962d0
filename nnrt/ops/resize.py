"""Image resizing: RESIZE_BILINEAR (HAL 1.0), RESIZE_NEAREST_NEIGHBOR (HAL 1.2).

Signature: input, width, height[, nchw[, align_corners[, half_pixel_centers]]].
width/height are INT32 output sizes, or (HAL 1.2) FLOAT32 / FLOAT16 scale
factors giving floor(in * scale). The layout flag is optional for
RESIZE_BILINEAR but required for RESIZE_NEAREST_NEIGHBOR. Source coordinates
follow TFLite's reference kernels, in float32 as they do, so that the floor /
round of a coordinate lands on the same pixel.
"""
from __future__ import annotations

import numpy as np

from ..model.types import HalVersion, OperandType as T, OperationType
from .common import check_quant_params, expect_same_quant, round_half_away
from .registry import Call, OpView, register

_TYPES = {
    OperationType.RESIZE_BILINEAR: {
        T.TENSOR_FLOAT32: HalVersion.V1_0,
        T.TENSOR_FLOAT16: HalVersion.V1_2,
        T.TENSOR_QUANT8_ASYMM: HalVersion.V1_2,
        T.TENSOR_QUANT8_ASYMM_SIGNED: HalVersion.V1_3,
    },
    OperationType.RESIZE_NEAREST_NEIGHBOR: {
        T.TENSOR_FLOAT32: HalVersion.V1_2,
        T.TENSOR_FLOAT16: HalVersion.V1_2,
        T.TENSOR_QUANT8_ASYMM: HalVersion.V1_2,
        T.TENSOR_QUANT8_ASYMM_SIGNED: HalVersion.V1_3,
    },
}
# Fewest inputs: the layout flag (input 3) is optional only for bilinear.
_MIN_INPUTS = {OperationType.RESIZE_BILINEAR: 3, OperationType.RESIZE_NEAREST_NEIGHBOR: 4}


def _output_size(in_size: int, param, by_scale: bool) -> int:
    if by_scale:
        # NNAPI multiplies in float (a FLOAT16 scale is widened first) and truncates.
        return int(np.floor(np.float32(in_size) * np.float32(param)))
    return int(param)


def _flags(values: list) -> tuple:
    """(nchw, align_corners, half_pixel_centers) from inputs 3..5 (None = unknown)."""
    padded = list(values[3:6]) + [False] * (6 - len(values))
    return tuple(padded)


def _validate(op: OpView) -> HalVersion:
    types = _TYPES[op.type]
    op.expect_counts(range(_MIN_INPUTS[op.type], 7), 1)
    t = op.expect_type_in(0, tuple(types))
    size_type = op.inputs[1].type
    scale_type = T.FLOAT16 if t == T.TENSOR_FLOAT16 else T.FLOAT32
    if size_type not in (T.INT32, scale_type):
        raise op.fail(f"input 1 (width) must be INT32 or {scale_type.name}, got {size_type.name}")
    op.expect_types([t, size_type, size_type, T.BOOL, T.BOOL, T.BOOL], [t])
    op.expect_rank(0, 4)
    check_quant_params(op)
    expect_same_quant(op)
    for k, name in ((1, "width"), (2, "height")):
        v = op.value(k)
        if v is not None and not v > 0:
            raise op.fail(f"input {k} ({name}) must be positive, got {v}")
    _, align, half = _flags([None if op.is_omitted(k) else op.value(k) for k in range(len(op.inputs))])
    if align and half:
        raise op.fail("align_corners and half_pixel_centers cannot both be true")
    version = types[t]
    if size_type != T.INT32 or len(op.inputs) >= 4:  # scale form, layout flag
        version = max(version, HalVersion.V1_2)
    if len(op.inputs) >= 5:
        version = max(version, HalVersion.V1_3)
    return version


def _shape(op: OpView) -> list[tuple[int, ...]]:
    dims = op.dims(0)
    if len(dims) != 4:
        return [()]
    nchw = False if len(op.inputs) < 4 or op.is_omitted(3) else op.value(3)
    if nchw is None:
        return [(0, 0, 0, 0)]
    b, h, w, c = (dims[0], dims[2], dims[3], dims[1]) if nchw else dims
    by_scale = op.inputs[1].type != T.INT32
    sizes = []
    for k, in_size in ((2, h), (1, w)):
        v = op.value(k)
        if v is None or (by_scale and in_size == 0):
            sizes.append(0)
        else:
            sizes.append(_output_size(in_size, v, by_scale))
            if sizes[-1] <= 0:
                raise op.fail(f"output {'height' if k == 2 else 'width'} would be {sizes[-1]}")
    oh, ow = sizes
    return [(b, c, oh, ow) if nchw else (b, oh, ow, c)]


def _scale(in_size: int, out_size: int, align: bool) -> np.float32:
    if align and out_size > 1:
        return np.float32(in_size - 1) / np.float32(out_size - 1)
    return np.float32(in_size) / np.float32(out_size)


def _source_coords(in_size: int, out_size: int, align: bool, half: bool) -> np.ndarray:
    """Real source coordinate of every output index, in float32."""
    scale = _scale(in_size, out_size, align)
    idx = np.arange(out_size, dtype=np.float32)
    if half:
        return (idx + np.float32(0.5)) * scale - np.float32(0.5)
    return idx * scale


def _bilinear(x: np.ndarray, oh: int, ow: int, align: bool, half: bool) -> np.ndarray:
    """NHWC float32 bilinear resize."""
    _, h, w, _ = x.shape

    def taps(in_size, out_size):
        src = _source_coords(in_size, out_size, align, half)
        lo = np.maximum(np.floor(src), 0).astype(np.int64)
        hi = np.minimum(np.ceil(src), in_size - 1).astype(np.int64)
        # The weight is measured from the clamped lower tap, as TFLite does.
        frac = (src - lo.astype(np.float32)).astype(np.float32)
        return lo, hi, frac

    y0, y1, fy = taps(h, oh)
    x0, x1, fx = taps(w, ow)
    fy = fy[None, :, None, None]
    fx = fx[None, None, :, None]
    one = np.float32(1)
    top = x[:, y0]
    bottom = x[:, y1]
    return (top[:, :, x0] * (one - fy) * (one - fx) + bottom[:, :, x0] * fy * (one - fx)
            + top[:, :, x1] * (one - fy) * fx + bottom[:, :, x1] * fy * fx)


def _nearest_index(in_size: int, out_size: int, align: bool, half: bool) -> np.ndarray:
    scale = _scale(in_size, out_size, align)
    offset = np.float32(0.5) if half else np.float32(0)
    src = (np.arange(out_size, dtype=np.float32) + offset) * scale
    # Rounded in float64 so that x.5 - tiny does not round up in float32 addition.
    idx = round_half_away(src.astype(np.float64)) if align else np.floor(src)
    idx = np.minimum(idx.astype(np.int64), in_size - 1)
    return np.maximum(idx, 0) if half else idx


def _kernel(call: Call) -> list[np.ndarray]:
    x = call.ins[0].value
    out = call.outs[0]
    nchw, align, half = (bool(v) for v in _flags([None if a.omitted else a.value for a in call.ins]))
    if align and half:
        raise call.fail("align_corners and half_pixel_centers cannot both be true")
    if nchw:
        x = x.transpose(0, 2, 3, 1)
    _, h, w, _ = x.shape
    by_scale = call.ins[1].type != T.INT32
    oh = _output_size(h, call.ins[2].value, by_scale)
    ow = _output_size(w, call.ins[1].value, by_scale)
    if oh <= 0 or ow <= 0:
        raise call.fail(f"output size {oh}x{ow} is not positive")
    if call.type == OperationType.RESIZE_NEAREST_NEIGHBOR:
        res = x[:, _nearest_index(h, oh, align, half)][:, :, _nearest_index(w, ow, align, half)]
    else:
        res = _bilinear(x.astype(np.float32), oh, ow, align, half)
        if out.type.is_quantized:
            # Same scale and zero point in and out: interpolate the stored
            # integers and round to the nearest one.
            lo, hi = np.iinfo(out.type.dtype).min, np.iinfo(out.type.dtype).max
            res = np.clip(round_half_away(res), lo, hi)
        res = res.astype(out.type.dtype)
    if nchw:
        res = res.transpose(0, 3, 1, 2)
    return [np.ascontiguousarray(res)]


for _op in _TYPES:
    register(_op, validate=_validate, shape=_shape, kernel=_kernel)
