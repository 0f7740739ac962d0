"""Pure data rearrangements between space, depth and batch:
DEPTH_TO_SPACE, SPACE_TO_DEPTH (HAL 1.0), BATCH_TO_SPACE_ND,
SPACE_TO_BATCH_ND (HAL 1.1), CHANNEL_SHUFFLE (HAL 1.2).

Values are only moved (quantized outputs must share the input's scale and
zero point), so kernels are reshape/transpose on the stored elements. The
4-D ops work on NHWC; with the NCHW flag they transpose in and out.
"""
from __future__ import annotations

import numpy as np

from ..model.types import HalVersion, OperandType as T, OperationType
from .common import check_quant_params, expect_same_quant
from .registry import Call, OpView, register

_SINCE_1_0 = {
    T.TENSOR_FLOAT32: HalVersion.V1_0,
    T.TENSOR_QUANT8_ASYMM: HalVersion.V1_0,
    T.TENSOR_FLOAT16: HalVersion.V1_2,
    T.TENSOR_QUANT8_ASYMM_SIGNED: HalVersion.V1_3,
}
_SINCE_1_1 = {t: max(v, HalVersion.V1_1) for t, v in _SINCE_1_0.items()}
_SINCE_1_2 = {t: max(v, HalVersion.V1_2) for t, v in _SINCE_1_0.items()}


def _common_checks(op: OpView, types: dict, param_types: list) -> HalVersion:
    """Input 0 type/quantization and the parameter types; returns the type's version."""
    t = op.expect_type_in(0, tuple(types))
    op.expect_types([t] + param_types, [t])
    check_quant_params(op)
    expect_same_quant(op)
    return types[t]


def _layout(op: OpView, pos: int) -> bool | None:
    """The NCHW flag at input ``pos``: False when absent, None when not constant."""
    if len(op.inputs) <= pos or op.is_omitted(pos):
        return False
    return op.value(pos)


def _with_layout(version: HalVersion, op: OpView, pos: int) -> HalVersion:
    return max(version, HalVersion.V1_2) if len(op.inputs) > pos else version


def _nhwc(dims: tuple, nchw: bool) -> tuple:
    return (dims[0], dims[2], dims[3], dims[1]) if nchw else tuple(dims)


def _from_nhwc(dims: tuple, nchw: bool) -> tuple:
    return (dims[0], dims[3], dims[1], dims[2]) if nchw else tuple(dims)


def _layout_kernel(fn, layout_pos: int):
    """Wrap an NHWC kernel body ``fn(x, call) -> array`` with the layout flag."""
    def kernel(call: Call) -> list[np.ndarray]:
        flag = call.ins[layout_pos] if len(call.ins) > layout_pos else None
        nchw = bool(flag is not None and not flag.omitted and flag.value)
        x = call.ins[0].value
        if nchw:
            x = x.transpose(0, 2, 3, 1)
        res = fn(x, call)
        if nchw:
            res = res.transpose(0, 3, 1, 2)
        return [np.ascontiguousarray(res, dtype=call.outs[0].type.dtype)]
    return kernel


# --- DEPTH_TO_SPACE / SPACE_TO_DEPTH -------------------------------------

def _validate_block(op: OpView) -> HalVersion:
    op.expect_counts((2, 3), 1)
    version = _common_checks(op, _SINCE_1_0, [T.INT32, T.BOOL])
    op.expect_rank(0, 4)
    bs = op.value(1)
    if bs is not None and bs < 1:
        raise op.fail(f"input 1 (block_size) must be >= 1, got {bs}")
    _shape_block(op)  # divisibility of known extents
    return _with_layout(version, op, 2)


def _shape_block(op: OpView) -> list[tuple[int, ...]]:
    dims, bs, nchw = op.dims(0), op.value(1), _layout(op, 2)
    if len(dims) != 4:
        return [()]
    if nchw is None:
        return [(0, 0, 0, 0)]
    b, h, w, c = _nhwc(dims, nchw)
    if bs is None:
        return [_from_nhwc((b, 0, 0, 0), nchw)]
    if op.type == OperationType.DEPTH_TO_SPACE:
        if c % (bs * bs):
            raise op.fail(f"depth {c} is not a multiple of block_size^2 = {bs * bs}")
        out = (b, h * bs, w * bs, c // (bs * bs))
    else:
        if h % bs or w % bs:
            raise op.fail(f"height {h} and width {w} must be multiples of block_size {bs}")
        out = (b, h // bs, w // bs, c * bs * bs)
    return [_from_nhwc(out, nchw)]


def _depth_to_space(x: np.ndarray, call: Call) -> np.ndarray:
    bs = call.ins[1].value
    if bs < 1:
        raise call.fail(f"block_size must be >= 1, got {bs}")
    n, h, w, c = x.shape
    if c % (bs * bs):
        raise call.fail(f"depth {c} is not a multiple of block_size^2 = {bs * bs}")
    # Depth index = (row_in_block * bs + col_in_block) * out_depth + d.
    blocks = x.reshape(n, h, w, bs, bs, c // (bs * bs))
    return blocks.transpose(0, 1, 3, 2, 4, 5).reshape(n, h * bs, w * bs, c // (bs * bs))


def _space_to_depth(x: np.ndarray, call: Call) -> np.ndarray:
    bs = call.ins[1].value
    if bs < 1:
        raise call.fail(f"block_size must be >= 1, got {bs}")
    n, h, w, c = x.shape
    if h % bs or w % bs:
        raise call.fail(f"height {h} and width {w} must be multiples of block_size {bs}")
    blocks = x.reshape(n, h // bs, bs, w // bs, bs, c)
    return blocks.transpose(0, 1, 3, 2, 4, 5).reshape(n, h // bs, w // bs, c * bs * bs)


# --- BATCH_TO_SPACE_ND / SPACE_TO_BATCH_ND --------------------------------

def _validate_batch(op: OpView) -> HalVersion:
    to_batch = op.type == OperationType.SPACE_TO_BATCH_ND
    layout_pos = 3 if to_batch else 2
    op.expect_counts((layout_pos, layout_pos + 1), 1)
    params = [T.TENSOR_INT32, T.TENSOR_INT32, T.BOOL] if to_batch else [T.TENSOR_INT32, T.BOOL]
    version = _common_checks(op, _SINCE_1_1, params)
    op.expect_rank(0, 4)
    op.expect_rank(1, 1)
    if op.dims(1) and op.dims(1)[0] not in (0, 2):
        raise op.fail(f"input 1 (block_shape) must have 2 elements, got {op.dims(1)[0]}")
    block = op.value(1)
    if block is not None and np.any(block < 1):
        raise op.fail(f"input 1 (block_shape) values must be >= 1, got {list(block)}")
    if to_batch:
        op.expect_rank(2, 2)
        if op.dims(2) and any(d not in (0, want) for d, want in zip(op.dims(2), (2, 2))):
            raise op.fail(f"input 2 (paddings) must have shape [2, 2], got {list(op.dims(2))}")
        pads = op.value(2)
        if pads is not None and np.any(pads < 0):
            raise op.fail(f"input 2 (paddings) values must be >= 0, got {pads.tolist()}")
    _shape_batch(op)  # divisibility of known extents
    return _with_layout(version, op, layout_pos)


def _shape_batch(op: OpView) -> list[tuple[int, ...]]:
    to_batch = op.type == OperationType.SPACE_TO_BATCH_ND
    dims, block = op.dims(0), op.value(1)
    nchw = _layout(op, 3 if to_batch else 2)
    if len(dims) != 4:
        return [()]
    if nchw is None:
        return [(0, 0, 0, 0)]
    b, h, w, c = _nhwc(dims, nchw)
    if block is None:
        return [_from_nhwc((0, 0, 0, c), nchw)]
    bh, bw = (int(v) for v in block.reshape(-1))
    if to_batch:
        pads = op.value(2)
        if pads is None:
            return [_from_nhwc((b * bh * bw, 0, 0, c), nchw)]
        (pt, pb), (pl, pr) = pads.reshape(2, 2).tolist()
        ph, pw = h + pt + pb, w + pl + pr
        if (h and ph % bh) or (w and pw % bw):
            raise op.fail(f"padded size {ph}x{pw} is not a multiple of block {bh}x{bw}")
        out = (b * bh * bw, ph // bh if h else 0, pw // bw if w else 0, c)
    else:
        if b % (bh * bw):
            raise op.fail(f"batch {b} is not a multiple of block {bh}x{bw}")
        out = (b // (bh * bw), h * bh, w * bw, c)
    return [_from_nhwc(out, nchw)]


def _block_shape(call: Call) -> tuple[int, int]:
    block = call.ins[1].value.reshape(-1)
    if block.size != 2 or np.any(block < 1):
        raise call.fail(f"block_shape must be 2 values >= 1, got {block.tolist()}")
    return int(block[0]), int(block[1])


def _batch_to_space(x: np.ndarray, call: Call) -> np.ndarray:
    bh, bw = _block_shape(call)
    n, h, w, c = x.shape
    if n % (bh * bw):
        raise call.fail(f"batch {n} is not a multiple of block {bh}x{bw}")
    # Input batch = (row_in_block * bw + col_in_block) * out_batch + b.
    grid = x.reshape(bh, bw, n // (bh * bw), h, w, c)
    return grid.transpose(2, 3, 0, 4, 1, 5).reshape(n // (bh * bw), h * bh, w * bw, c)


def _space_to_batch(x: np.ndarray, call: Call) -> np.ndarray:
    bh, bw = _block_shape(call)
    pads = call.ins[2].value.reshape(-1)
    if pads.size != 4 or np.any(pads < 0):
        raise call.fail(f"paddings must be 4 values >= 0, got {pads.tolist()}")
    pt, pb, pl, pr = (int(v) for v in pads)
    # Padding is the logical zero: the zero point for quantized tensors.
    fill = call.ins[0].zero_point if call.ins[0].type.is_quantized else 0
    x = np.pad(x, ((0, 0), (pt, pb), (pl, pr), (0, 0)), constant_values=fill)
    n, h, w, c = x.shape
    if h % bh or w % bw:
        raise call.fail(f"padded size {h}x{w} is not a multiple of block {bh}x{bw}")
    grid = x.reshape(n, h // bh, bh, w // bw, bw, c)
    return grid.transpose(2, 4, 0, 1, 3, 5).reshape(n * bh * bw, h // bh, w // bw, c)


# --- CHANNEL_SHUFFLE ------------------------------------------------------

def _validate_shuffle(op: OpView) -> HalVersion:
    op.expect_counts(3, 1)
    version = _common_checks(op, _SINCE_1_2, [T.INT32, T.INT32])
    op.expect_rank(0, at_most=4)
    groups, axis, rank = op.value(1), op.value(2), op.rank(0)
    if groups is not None and groups < 1:
        raise op.fail(f"input 1 (num_groups) must be >= 1, got {groups}")
    if axis is not None and rank is not None:
        if not -rank <= axis < rank:
            raise op.fail(f"input 2 (axis) {axis} out of range for rank {rank}")
        extent = op.dims(0)[axis]
        if groups is not None and extent and extent % groups:
            raise op.fail(f"axis extent {extent} is not a multiple of num_groups {groups}")
    return version


def _shuffle(call: Call) -> list[np.ndarray]:
    x, groups, axis = call.ins[0].value, call.ins[1].value, call.ins[2].value
    if not -x.ndim <= axis < x.ndim:
        raise call.fail(f"axis {axis} out of range for rank {x.ndim}")
    axis %= x.ndim
    c = x.shape[axis]
    if groups < 1 or c % groups:
        raise call.fail(f"axis extent {c} is not a multiple of num_groups {groups}")
    # Channel g * (c / groups) + k moves to k * groups + g: a transpose of a
    # [groups, c / groups] view of the axis.
    split = x.reshape(x.shape[:axis] + (groups, c // groups) + x.shape[axis + 1:])
    res = np.swapaxes(split, axis, axis + 1).reshape(x.shape)
    return [np.ascontiguousarray(res)]


def _same_shape(op: OpView) -> list[tuple[int, ...]]:
    return [op.dims(0)]


register(OperationType.DEPTH_TO_SPACE, validate=_validate_block, shape=_shape_block,
         kernel=_layout_kernel(_depth_to_space, 2))
register(OperationType.SPACE_TO_DEPTH, validate=_validate_block, shape=_shape_block,
         kernel=_layout_kernel(_space_to_depth, 2))
register(OperationType.BATCH_TO_SPACE_ND, validate=_validate_batch, shape=_shape_batch,
         kernel=_layout_kernel(_batch_to_space, 2))
register(OperationType.SPACE_TO_BATCH_ND, validate=_validate_batch, shape=_shape_batch,
         kernel=_layout_kernel(_space_to_batch, 3))
register(OperationType.CHANNEL_SHUFFLE, validate=_validate_shuffle, shape=_same_shape,
         kernel=_shuffle)
