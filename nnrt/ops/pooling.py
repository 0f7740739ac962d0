"""2-D pooling: AVERAGE_POOL_2D, MAX_POOL_2D, L2_POOL_2D (HAL 1.0).

All three share one signature, in two forms:
  explicit padding: input, pad_l, pad_r, pad_t, pad_b, stride_w, stride_h,
                    filter_w, filter_h, activation[, nchw]      (10 or 11 inputs)
  implicit padding: input, scheme, stride_w, stride_h, filter_w, filter_h,
                    activation[, nchw]                          (7 or 8 inputs)
Padding elements never take part: the average and the L2 norm divide by the
number of in-image elements of each window, not by the filter area.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..model.types import FusedActivation, HalVersion, OperandType as T, OperationType, PaddingScheme
from .common import (apply_activation, check_quant_params, conv_output_size, expect_same_quant,
                     implicit_padding, quantized_activation_range, round_half_away)
from .registry import Call, OpView, register

_AVG_MAX_TYPES = {
    T.TENSOR_FLOAT32: HalVersion.V1_0,
    T.TENSOR_QUANT8_ASYMM: HalVersion.V1_0,
    T.TENSOR_FLOAT16: HalVersion.V1_2,
    T.TENSOR_QUANT8_ASYMM_SIGNED: HalVersion.V1_3,
}
_L2_TYPES = {
    T.TENSOR_FLOAT32: HalVersion.V1_0,
    T.TENSOR_FLOAT16: HalVersion.V1_2,
}


@dataclass
class _Params:
    """Pooling parameters in one place, whatever the padding form."""
    explicit: bool
    pads: tuple | None         # (left, right, top, bottom) for the explicit form
    scheme: int | None         # PaddingScheme for the implicit form
    stride_w: int | None
    stride_h: int | None
    filter_w: int | None
    filter_h: int | None
    act: int | None
    nchw: bool | None          # None = not known statically

    def padding(self, in_h: int, in_w: int) -> tuple[int, int, int, int]:
        """(top, bottom, left, right)."""
        if self.explicit:
            left, right, top, bottom = self.pads
            return top, bottom, left, right
        top, bottom = implicit_padding(self.scheme, in_h, self.filter_h, self.stride_h)
        left, right = implicit_padding(self.scheme, in_w, self.filter_w, self.stride_w)
        return top, bottom, left, right


def _params(values: list, n_inputs: int) -> _Params:
    """Sort the scalar inputs (``values[i]`` = value of input i, None if unknown)."""
    explicit = n_inputs in (10, 11)
    if explicit:
        pads = tuple(values[1:5])
        rest, layout_pos = values[5:10], 10
        scheme = None
    else:
        pads, scheme = None, values[1]
        rest, layout_pos = values[2:7], 7
    stride_w, stride_h, filter_w, filter_h, act = rest
    nchw = values[layout_pos] if n_inputs > layout_pos else False
    if pads is not None and None in pads:
        pads = None
    return _Params(explicit, pads, scheme, stride_w, stride_h, filter_w, filter_h, act, nchw)


def _static_values(op: OpView) -> list:
    """Constant input values; an omitted layout flag means NHWC."""
    return [False if op.is_omitted(k) else op.value(k) for k in range(len(op.inputs))]


def _validator(types: dict):
    def validate(op: OpView) -> HalVersion:
        op.expect_counts((7, 8, 10, 11), 1)
        t = op.expect_type_in(0, tuple(types))
        n = len(op.inputs)
        explicit = n in (10, 11)
        n_ints = 10 if explicit else 7
        op.expect_types([t] + [T.INT32] * (n_ints - 1) + [T.BOOL], [t])
        op.expect_rank(0, 4)
        check_quant_params(op)
        expect_same_quant(op)
        p = _params(_static_values(op), n)
        if explicit:
            for k in range(1, 5):
                v = op.value(k)
                if v is not None and v < 0:
                    raise op.fail(f"input {k} (padding) must be >= 0, got {v}")
        elif p.scheme is not None and p.scheme not in tuple(PaddingScheme):
            raise op.fail(f"input 1: invalid padding scheme {p.scheme}")
        for name, v in (("stride width", p.stride_w), ("stride height", p.stride_h),
                        ("filter width", p.filter_w), ("filter height", p.filter_h)):
            if v is not None and v < 1:
                raise op.fail(f"{name} must be >= 1, got {v}")
        if p.act is not None and p.act not in tuple(FusedActivation):
            raise op.fail(f"invalid fused activation {p.act}")
        version = types[t]
        if n in (8, 11):  # the layout flag came with HAL 1.2
            version = max(version, HalVersion.V1_2)
        return version
    return validate


def _out_hw(p: _Params, h: int, w: int) -> tuple[int, int]:
    top, bottom, left, right = p.padding(h, w)
    return (conv_output_size(h, p.filter_h, p.stride_h, top, bottom),
            conv_output_size(w, p.filter_w, p.stride_w, left, right))


def _shape(op: OpView) -> list[tuple[int, ...]]:
    n = len(op.inputs)
    p = _params(_static_values(op), n)
    dims = op.dims(0)
    if len(dims) != 4 or p.nchw is None:
        return [(0, 0, 0, 0)] if len(dims) == 4 else [()]
    if p.nchw:
        b, c, h, w = dims
    else:
        b, h, w, c = dims
    oh = ow = 0
    known = None not in (p.stride_w, p.stride_h, p.filter_w, p.filter_h) and \
        (p.pads is not None if p.explicit else p.scheme is not None)
    if known and h > 0 and w > 0:
        oh, ow = _out_hw(p, h, w)
        if oh <= 0 or ow <= 0:
            raise op.fail(f"output would be empty ({oh}x{ow})")
    return [(b, c, oh, ow) if p.nchw else (b, oh, ow, c)]


def _pad(p: _Params, h: int, w: int) -> tuple:
    top, bottom, left, right = p.padding(h, w)
    return (top, bottom), (left, right)


def _pooled(x: np.ndarray, p: _Params, pad_value, reduce) -> np.ndarray:
    """``reduce`` (np.add or np.maximum) over each window of the NHWC tensor
    ``x`` padded with ``pad_value``: [N, OH, OW, C]. Separably: along the
    width for every padded row first, then along the height over those, each
    as one whole-tensor step per filter tap, in order (as NNAPI's reference
    kernels sum): filter_h + filter_w steps per window instead of
    filter_h * filter_w elements (a 100x100 average pool: 50 times less).
    Sums keep ``x``'s dtype (float32 in, float32 sums)."""
    rows, cols = _pad(p, x.shape[1], x.shape[2])
    padded = np.pad(x, ((0, 0), rows, cols, (0, 0)), constant_values=pad_value)
    ow = (padded.shape[2] - p.filter_w) // p.stride_w + 1
    oh = (padded.shape[1] - p.filter_h) // p.stride_h + 1
    last_w, last_h = p.stride_w * (ow - 1) + 1, p.stride_h * (oh - 1) + 1
    across = padded[:, :, 0:last_w:p.stride_w].copy()
    for k in range(1, p.filter_w):
        reduce(across, padded[:, :, k:k + last_w:p.stride_w], out=across)
    down = across[:, 0:last_h:p.stride_h].copy()
    for k in range(1, p.filter_h):
        reduce(down, across[:, k:k + last_h:p.stride_h], out=down)
    return down


def _counts(p: _Params, h: int, w: int) -> np.ndarray:
    """In-image elements of each window, [1, OH, OW, 1]."""
    inside = np.pad(np.ones((h, w), np.int64), _pad(p, h, w))
    win = sliding_window_view(inside, (p.filter_h, p.filter_w))[::p.stride_h, ::p.stride_w]
    return win.sum(axis=(2, 3))[None, :, :, None]


def _kernel(kind: str):
    def kernel(call: Call) -> list[np.ndarray]:
        p = _params([False if a.omitted else a.value for a in call.ins], len(call.ins))
        # Scalars fed as model inputs escape the validator's checks.
        if p.act not in tuple(FusedActivation) or not p.explicit and p.scheme not in tuple(PaddingScheme):
            raise call.fail(f"invalid activation {p.act} or padding scheme {p.scheme}")
        if min(p.stride_w, p.stride_h, p.filter_w, p.filter_h) < 1 or p.explicit and min(p.pads) < 0:
            raise call.fail("strides and filter sizes must be >= 1, paddings >= 0")
        x = call.ins[0].value
        out = call.outs[0]
        if p.nchw:
            x = x.transpose(0, 2, 3, 1)
        n, h, w, c = x.shape
        oh, ow = _out_hw(p, h, w)
        if oh <= 0 or ow <= 0:
            raise call.fail(f"output would be empty ({oh}x{ow})")
        count = _counts(p, h, w)
        if np.any(count == 0):
            # Explicit padding at least as wide as the filter: nothing to pool.
            raise call.fail("a pooling window lies entirely in the padding")
        if x.size == 0:
            res = np.zeros((n, oh, ow, c), out.type.dtype)
        else:
            res = _POOL[kind](x, p, count, out)
        if p.nchw:
            res = res.transpose(0, 3, 1, 2)
        return [np.ascontiguousarray(res)]
    return kernel


def _average(x: np.ndarray, p: _Params, count: np.ndarray, out) -> np.ndarray:
    if out.type.is_quantized:
        # Input and output share scale and zero point, so NNAPI averages the
        # stored integers and rounds half away from zero (integer division
        # with a half-count bias in the reference).
        total = _pooled(x.astype(np.int64), p, 0, np.add)
        lo, hi = quantized_activation_range(p.act, out)
        return np.clip(round_half_away(total / count), lo, hi).astype(out.type.dtype)
    total = _pooled(x.astype(np.float32), p, 0.0, np.add)
    mean = total / count.astype(np.float32)
    return apply_activation(mean, p.act).astype(out.type.dtype)


def _max(x: np.ndarray, p: _Params, count: np.ndarray, out) -> np.ndarray:
    if out.type.is_quantized:
        # Padding takes the type's minimum so it never wins.
        peak = _pooled(x, p, np.iinfo(x.dtype).min, np.maximum)
        lo, hi = quantized_activation_range(p.act, out)
        return np.clip(peak, lo, hi).astype(out.type.dtype)
    peak = _pooled(x.astype(np.float32), p, -np.inf, np.maximum)
    return apply_activation(peak, p.act).astype(out.type.dtype)


def _l2(x: np.ndarray, p: _Params, count: np.ndarray, out) -> np.ndarray:
    xf = x.astype(np.float32)
    total = _pooled(xf * xf, p, 0.0, np.add)
    return apply_activation(np.sqrt(total / count.astype(np.float32)), p.act).astype(out.type.dtype)


_POOL = {"average": _average, "max": _max, "l2": _l2}

register(OperationType.AVERAGE_POOL_2D, validate=_validator(_AVG_MAX_TYPES), shape=_shape,
         kernel=_kernel("average"))
register(OperationType.MAX_POOL_2D, validate=_validator(_AVG_MAX_TYPES), shape=_shape,
         kernel=_kernel("max"))
register(OperationType.L2_POOL_2D, validate=_validator(_L2_TYPES), shape=_shape,
         kernel=_kernel("l2"))
