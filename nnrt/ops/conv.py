"""Convolutions: CONV_2D, DEPTHWISE_CONV_2D (HAL 1.0), GROUPED_CONV_2D and
TRANSPOSE_CONV_2D (HAL 1.2).

All four share one signature scheme: input, filter, bias, then either an
implicit padding code or four explicit paddings, the strides, an
op-specific integer (depth multiplier, group count), the fused activation and
the optional trailing NCHW flag and dilation factors. ``_FORMS`` lists, per
operation, the scalar names after the bias for each accepted input count, and
everything else (type checks, parameter reading, shapes) is driven by it.

Kernels work in NHWC (an NCHW input is transposed first, the result
transposed back). Regular and grouped convolutions are im2col (a strided
window view copied once into a [pixels, taps*channels] matrix) followed by
one float32 BLAS matmul per group. Depthwise convolution multiplies and adds
one shifted view per filter tap instead: a per-channel matmul would be
thousands of tiny products. Transposed convolution is one matmul giving every
(input pixel, tap) contribution followed by a scatter-add per tap.

Quantized kernels reproduce NNAPI's integer pipeline: the int32 accumulator
sum((x - x_zero) * (w - w_zero)) + bias is computed exactly (on integer-valued
floats: float32 while every partial sum stays below 2**24, float64 otherwise)
and then requantized with multiplier input_scale * filter_scale / output_scale
(per output channel for TENSOR_QUANT8_SYMM_PER_CHANNEL filters) in TFLite's
fixed point (a Q31 multiplier and a rounding shift), so the result is the
reference kernels' bit for bit: a one-unit rounding difference per layer
grows across a deep quantized network.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..model.types import FusedActivation, HalVersion, OperandType as T, OperationType, PaddingScheme
from .common import (apply_activation, check_quant_params, implicit_padding,
                     multiply_by_quantized_multiplier, qrange, quantize_multiplier,
                     quantized_activation_range)
from .registry import Call, OpView, register

_QUANT = (T.TENSOR_QUANT8_ASYMM, T.TENSOR_QUANT8_ASYMM_SIGNED)
_INPUT_TYPES = (T.TENSOR_FLOAT32, T.TENSOR_FLOAT16) + _QUANT
_PER_CHANNEL = T.TENSOR_QUANT8_SYMM_PER_CHANNEL

# --- signatures -------------------------------------------------------------

_EXPLICIT = ("pad_left", "pad_right", "pad_top", "pad_bottom")
_DILATION = ("dilation_w", "dilation_h")


@dataclass(frozen=True)
class _Kind:
    name: str
    extra: tuple[str, ...]          # op-specific integer after the strides
    layout_required: bool           # GROUPED/TRANSPOSE always take the NCHW flag
    dilation: bool                  # CONV_2D and DEPTHWISE_CONV_2D accept dilation
    output_shape_input: bool        # TRANSPOSE_CONV_2D's implicit form takes the output shape
    filter_channel_dim: int         # channelDim of a per-channel filter (= output channel axis)
    since: HalVersion


_CONV = _Kind("CONV_2D", (), False, True, False, 0, HalVersion.V1_0)
_DEPTHWISE = _Kind("DEPTHWISE_CONV_2D", ("multiplier",), False, True, False, 3, HalVersion.V1_0)
_GROUPED = _Kind("GROUPED_CONV_2D", ("groups",), True, False, False, 0, HalVersion.V1_2)
_TRANSPOSE = _Kind("TRANSPOSE_CONV_2D", (), True, False, True, 0, HalVersion.V1_2)


def _forms(kind: _Kind) -> list[tuple[str, ...]]:
    """Every accepted list of scalar names after the bias (implicit forms first)."""
    tail = ("stride_w", "stride_h") + kind.extra + ("activation",)
    implicit = (("output_shape",) if kind.output_shape_input else ()) + ("scheme",) + tail
    explicit = _EXPLICIT + tail
    optional = [()] if not kind.layout_required else []
    optional.append(("nchw",))
    if kind.dilation:
        optional.append(("nchw",) + _DILATION)
    return [core + opt for core in (implicit, explicit) for opt in optional]


_FORMS = {k.name: _forms(k) for k in (_CONV, _DEPTHWISE, _GROUPED, _TRANSPOSE)}


def _param_names(kind: _Kind, types: list[T]) -> tuple[str, ...] | None:
    """The scalar names for this input list, None when no form has its length.

    Two forms can have the same length (CONV_2D: implicit with NCHW flag and
    dilation vs. explicit, both 10 inputs); as in NNAPI, the type at the
    implicit form's NCHW flag position decides (BOOL = the implicit form)."""
    matches = [f for f in _FORMS[kind.name] if 3 + len(f) == len(types)]
    if len(matches) > 1:
        implicit, explicit = matches
        return implicit if types[3 + implicit.index("nchw")] == T.BOOL else explicit
    return matches[0] if matches else None


def _scalar_type(name: str) -> T:
    return {"nchw": T.BOOL, "output_shape": T.TENSOR_INT32}.get(name, T.INT32)


# --- geometry -----------------------------------------------------------------

@dataclass
class _Geometry:
    """Sizes of one convolution in NHWC terms; 0 = unknown (shape inference)."""
    batches: int
    in_h: int
    in_w: int
    in_c: int
    out_c: int
    k_h: int
    k_w: int
    pads: tuple[int, int, int, int] | None   # top, bottom, left, right
    strides: tuple[int, int]
    dilations: tuple[int, int]
    out_h: int
    out_w: int


def _known(*xs) -> bool:
    return all(x is not None and x > 0 for x in xs)


def _conv_out(size, k, stride, dil, head, tail) -> int:
    if not _known(size, k, stride, dil):
        return 0
    effective = (k - 1) * dil + 1
    return (size + head + tail - effective) // stride + 1


def _transpose_pads(out_size: int, stride: int, k: int, scheme: int) -> tuple[int, int]:
    """NNAPI's implicit padding of a transposed convolution given its wanted
    output size: SAME pads like a convolution of that size, but the tail is
    kept even when negative so that the computed output matches exactly."""
    if scheme != PaddingScheme.SAME:
        return 0, 0
    n = (out_size + stride - 1) // stride
    total = (n - 1) * stride + k - out_size
    head = max(total, 0) // 2
    return head, total - head


def _geometry(kind: _Kind, p: dict, in_dims, f_dims) -> _Geometry:
    """Compute the geometry from (possibly partly unknown) dims and parameters.

    ``p`` maps parameter names to values (None when not constant). Raises
    ValueError when known values are inconsistent."""
    nchw = p.get("nchw") or False
    in_dims = tuple(in_dims) if in_dims and len(in_dims) == 4 else (0, 0, 0, 0)
    f_dims = tuple(f_dims) if f_dims and len(f_dims) == 4 else (0, 0, 0, 0)
    if nchw:
        n, c, h, w = in_dims
    else:
        n, h, w, c = in_dims
    if p.get("nchw", False) is None:      # layout unknown: only the batch is sure
        h = w = c = 0
    k_h, k_w = f_dims[1], f_dims[2]
    strides = (p.get("stride_h"), p.get("stride_w"))
    dil = (p.get("dilation_h", 1), p.get("dilation_w", 1))

    if kind is _DEPTHWISE:
        if f_dims[0] not in (0, 1):
            raise ValueError(f"depthwise filter must have shape [1, h, w, channels], got {list(f_dims)}")
        out_c = f_dims[3]
        mult = p.get("multiplier")
        if _known(c, mult):
            if out_c and out_c != c * mult:
                raise ValueError(f"filter has {out_c} output channels, input has {c} channels "
                                 f"and depth multiplier {mult}")
            out_c = c * mult
    else:
        out_c = f_dims[0]
        per_group = f_dims[3]
        groups = p.get("groups", 1) if kind is _GROUPED else 1
        if _known(c, per_group, groups) and per_group * groups != c:
            raise ValueError(f"filter depth {per_group} x {groups} group(s) != input depth {c}")
        if _known(out_c, groups) and out_c % groups:
            raise ValueError(f"{out_c} output channels not divisible by {groups} groups")

    wanted = (None, None)                 # TRANSPOSE_CONV_2D's requested output size
    if kind is _TRANSPOSE and p.get("output_shape") is not None:
        requested = np.asarray(p["output_shape"]).ravel()
        if requested.size != 4:
            raise ValueError("output shape tensor must have 4 elements")
        wanted = tuple(int(v) for v in (requested[2:4] if nchw else requested[1:3]))
    pad_h, out_h = _axis(kind, p, h, k_h, strides[0], dil[0], ("pad_top", "pad_bottom"), wanted[0])
    pad_w, out_w = _axis(kind, p, w, k_w, strides[1], dil[1], ("pad_left", "pad_right"), wanted[1])
    pads = None if pad_h is None or pad_w is None else (*pad_h, *pad_w)
    return _Geometry(n, h, w, c, out_c, k_h, k_w, pads, strides, dil, out_h, out_w)


def _axis(kind: _Kind, p: dict, size, k, stride, dil, pad_names, wanted):
    """(head, tail) padding (None if unknown) and output size (0 if unknown)
    along one spatial axis."""
    if "scheme" in p:
        scheme = p["scheme"]
        if scheme is None or not _known(k, stride, dil):
            return None, 0
        if kind is _TRANSPOSE:
            if wanted is None:
                return None, 0
            pads = _transpose_pads(wanted, stride, k, scheme)
        elif not _known(size):
            return None, 0
        else:
            pads = implicit_padding(scheme, size, k, stride, dil)
    else:
        pads = (p[pad_names[0]], p[pad_names[1]])
        if None in pads:
            return None, 0
    if kind is _TRANSPOSE:
        if not _known(size, k, stride):
            return pads, 0
        out = (size - 1) * stride + k - pads[0] - pads[1]
        if out <= 0:
            raise ValueError(f"padding {list(pads)} leaves no output")
        return pads, out
    # The reference requires each padding to be smaller than the (dilated)
    # filter: every window must touch real input.
    if _known(k, dil) and max(pads) >= (k - 1) * dil + 1:
        raise ValueError(f"padding {list(pads)} not smaller than filter extent {(k - 1) * dil + 1}")
    out = _conv_out(size, k, stride, dil, pads[0], pads[1])
    if _known(size, k, stride, dil) and out <= 0:
        raise ValueError("filter larger than the padded input")
    return pads, out


def _out_dims(g: _Geometry, nchw) -> tuple[int, ...]:
    if nchw:
        return (g.batches, g.out_c, g.out_h, g.out_w)
    return (g.batches, g.out_h, g.out_w, g.out_c)


# --- validation and shape -------------------------------------------------------

def _op_params(kind: _Kind, op: OpView) -> dict:
    names = _param_names(kind, [o.type for o in op.inputs])
    if names is None:
        raise op.fail(f"takes {' or '.join(str(3 + len(f)) for f in _FORMS[kind.name])} inputs, "
                      f"got {len(op.inputs)}")
    return {name: op.value(3 + i) for i, name in enumerate(names)}


def _check_params(p: dict, kind: _Kind) -> None:
    """Range checks of constant scalar parameters; raises ValueError."""
    for name in ("stride_w", "stride_h", "dilation_w", "dilation_h", "multiplier", "groups"):
        v = p.get(name)
        if v is not None and v <= 0:
            raise ValueError(f"{name} must be positive, got {v}")
    # A transposed convolution may crop more than it pads at the tail (the
    # reference lets right/bottom go negative to pick among ambiguous sizes).
    for name in ("pad_left", "pad_top") if kind is _TRANSPOSE else _EXPLICIT:
        v = p.get(name)
        if v is not None and v < 0:
            raise ValueError(f"{name} must not be negative, got {v}")
    scheme = p.get("scheme")
    if scheme is not None and scheme not in tuple(PaddingScheme):
        raise ValueError(f"invalid padding scheme {scheme}")
    act = p.get("activation")
    if act is not None and act not in tuple(FusedActivation):
        raise ValueError(f"invalid fused activation {act}")


def _validator(kind: _Kind):
    def validate(op: OpView) -> HalVersion:
        if len(op.outputs) != 1:
            raise op.fail(f"takes 1 output, got {len(op.outputs)}")
        if len(op.inputs) < 7:
            raise op.fail(f"takes at least 7 inputs, got {len(op.inputs)}")
        t = op.expect_type_in(0, _INPUT_TYPES)
        f_type = op.inputs[1].type
        if f_type != t and not (t in _QUANT and f_type == _PER_CHANNEL):
            raise op.fail(f"input 1 (filter) has type {f_type.name}; accepted: {t.name}"
                          + (f" or {_PER_CHANNEL.name}" if t in _QUANT else ""))
        bias_type = T.TENSOR_INT32 if t in _QUANT else t
        p = _op_params(kind, op)
        names = list(p)
        op.expect_types([t, f_type, bias_type] + [_scalar_type(n) for n in names], [t])
        op.expect_rank(0, 4)
        op.expect_rank(1, 4)
        op.expect_rank(2, 1)
        check_quant_params(op)
        if f_type == _PER_CHANNEL and op.inputs[1].channel_quant.channel_dim != kind.filter_channel_dim:
            raise op.fail(f"per-channel filter must be quantized along dimension "
                          f"{kind.filter_channel_dim}")
        if "output_shape" in p:
            op.expect_rank(3, 1)
        inp, filt, bias, out = op.inputs[0], op.inputs[1], op.inputs[2], op.outputs[0]
        if t in _QUANT and f_type != _PER_CHANNEL:
            # NNAPI rejects a bias whose scale is not input_scale * filter_scale.
            product = float(np.float32(inp.scale) * np.float32(filt.scale))
            if abs(product - bias.scale) > 1e-6 * min(product, bias.scale):
                raise op.fail(f"input 2 (bias) scale {bias.scale} must equal input scale x "
                              f"filter scale = {product}")
        try:
            _check_params(p, kind)
            g = _geometry(kind, p, op.dims(0) if op.rank(0) else (), op.dims(1) if op.rank(1) else ())
        except ValueError as e:
            raise op.fail(str(e)) from None
        bias_dims = op.dims(2)
        if len(bias_dims) == 1 and bias_dims[0] and g.out_c and bias_dims[0] != g.out_c:
            raise op.fail(f"input 2 (bias) has {bias_dims[0]} elements for {g.out_c} output channels")

        version = kind.since
        if t == T.TENSOR_QUANT8_ASYMM_SIGNED:
            return HalVersion.V1_3
        if t == T.TENSOR_FLOAT16 or f_type == _PER_CHANNEL or "nchw" in p:
            version = max(version, HalVersion.V1_2)
        if t == T.TENSOR_QUANT8_ASYMM and f_type != _PER_CHANNEL:
            # Before HAL 1.2 the output scale had to exceed input x filter scale.
            if not out.scale > np.float32(inp.scale) * np.float32(filt.scale):
                version = max(version, HalVersion.V1_2)
        return version
    return validate


def _shaper(kind: _Kind):
    def shape(op: OpView) -> list[tuple[int, ...]]:
        p = _op_params(kind, op)
        try:
            _check_params(p, kind)
            g = _geometry(kind, p, op.dims(0) if op.rank(0) else (), op.dims(1) if op.rank(1) else ())
        except ValueError as e:
            raise op.fail(str(e)) from None
        if p.get("nchw", False) is None:
            return [(g.batches, 0, 0, 0)]
        return [_out_dims(g, p.get("nchw"))]
    return shape


# --- numeric cores (NHWC) ---------------------------------------------------------

def _pad_hw(x: np.ndarray, pads) -> np.ndarray:
    top, bottom, left, right = pads
    if not (top or bottom or left or right):
        return x
    n, h, w, c = x.shape
    out = np.zeros((n, h + top + bottom, w + left + right, c), x.dtype)   # faster than np.pad
    out[:, top:top + h, left:left + w] = x
    return out


def _windows(x: np.ndarray, g: _Geometry) -> np.ndarray:
    """View [N, out_h, out_w, k_h, k_w, C] of the padded input: tap (i, j) of
    output pixel (y, x) reads padded row y*stride_h + i*dilation_h."""
    (sh, sw), (dh, dw) = g.strides, g.dilations
    xp = _pad_hw(x, g.pads)
    eh, ew = (g.k_h - 1) * dh + 1, (g.k_w - 1) * dw + 1
    win = sliding_window_view(xp, (eh, ew), axis=(1, 2))     # [N, H', W', C, eh, ew]
    win = win[:, :(g.out_h - 1) * sh + 1:sh, :(g.out_w - 1) * sw + 1:sw, :, ::dh, ::dw]
    return win.transpose(0, 1, 2, 4, 5, 3)


def _conv(x: np.ndarray, w: np.ndarray, g: _Geometry, groups: int) -> np.ndarray:
    """Grouped 2-D correlation: x [N,H,W,C], w [O,kh,kw,C/groups] -> [N,oh,ow,O]."""
    n = x.shape[0]
    out_c, cg = w.shape[0], w.shape[3]
    pixels = n * g.out_h * g.out_w
    taps = g.k_h * g.k_w * cg
    if g.k_h == g.k_w == 1 and not any(g.pads):
        # Pointwise: the strided input itself is the im2col matrix.
        win = x[:, ::g.strides[0], ::g.strides[1], :][:, :g.out_h, :g.out_w]
        win = win.reshape(n, g.out_h, g.out_w, 1, 1, x.shape[3])
    else:
        win = _windows(x, g)
    if groups == 1:
        cols = win.reshape(pixels, taps)
        out = cols @ w.reshape(out_c, taps).T
        return out.reshape(n, g.out_h, g.out_w, out_c)
    per_group = out_c // groups
    win = win.reshape(n, g.out_h, g.out_w, g.k_h, g.k_w, groups, cg)
    cols = np.ascontiguousarray(win.transpose(5, 0, 1, 2, 3, 4, 6)).reshape(groups, pixels, taps)
    wg = w.reshape(groups, per_group, taps).transpose(0, 2, 1)
    out = np.matmul(cols, wg)                               # [G, pixels, per_group]
    return out.transpose(1, 0, 2).reshape(n, g.out_h, g.out_w, out_c)


def _depthwise(x: np.ndarray, w: np.ndarray, g: _Geometry, multiplier: int) -> np.ndarray:
    """x [N,H,W,C], w [1,kh,kw,C*multiplier]; output channel c*multiplier+m
    reads input channel c."""
    (sh, sw), (dh, dw) = g.strides, g.dilations
    xp = _pad_hw(x, g.pads)
    if multiplier > 1:
        xp = np.repeat(xp, multiplier, axis=3)
    n, c = x.shape[0], g.out_c
    # Merge (width, channel) into one contiguous axis so that the inner loops
    # run over whole rows instead of C elements at a time (2-3x faster for
    # mobilenet's narrow layers). With a horizontal stride the padded input
    # is first split into its ``sw`` column phases: tap column j reads phase
    # j % sw from column j // sw on, contiguously.
    phases = {}

    def phase_rows(p: int) -> np.ndarray:
        if p not in phases:
            cols = xp[:, :, p::sw, :]
            phases[p] = np.ascontiguousarray(cols).reshape(n, xp.shape[1], -1)
        return phases[p]

    weights = np.tile(w[0], (1, 1, g.out_w))           # [kh, kw, out_w * C]
    acc = np.empty((n, g.out_h, g.out_w * c), dtype=x.dtype)
    tmp = np.empty_like(acc)
    for i in range(g.k_h):
        for j in range(g.k_w):
            q, p = divmod(j * dw, sw)
            tap = phase_rows(p)[:, i * dh:i * dh + (g.out_h - 1) * sh + 1:sh, q * c:(q + g.out_w) * c]
            if i == j == 0:
                np.multiply(tap, weights[i, j], out=acc)
            else:
                np.multiply(tap, weights[i, j], out=tmp)
                acc += tmp
    return acc.reshape(n, g.out_h, g.out_w, c)


def _transpose_conv(x: np.ndarray, w: np.ndarray, g: _Geometry) -> np.ndarray:
    """x [N,H,W,C], w [O,kh,kw,C] -> [N,out_h,out_w,O]: input pixel (y, x)
    adds w[:, i, j, :] @ x to output (y*stride_h + i - pad_top, ...)."""
    n, h, wd, c = x.shape
    out_c = w.shape[0]
    sh, sw = g.strides
    top, _, left, _ = g.pads
    contrib = x.reshape(-1, c) @ w.transpose(1, 2, 0, 3).reshape(-1, c).T
    contrib = contrib.reshape(n, h, wd, g.k_h, g.k_w, out_c)
    full_h = max((h - 1) * sh + g.k_h, top + g.out_h)
    full_w = max((wd - 1) * sw + g.k_w, left + g.out_w)
    canvas = np.zeros((n, full_h, full_w, out_c), dtype=contrib.dtype)
    for i in range(g.k_h):
        for j in range(g.k_w):
            canvas[:, i:i + (h - 1) * sh + 1:sh, j:j + (wd - 1) * sw + 1:sw, :] += contrib[:, :, :, i, j, :]
    return canvas[:, top:top + g.out_h, left:left + g.out_w, :]


# --- kernels ------------------------------------------------------------------------

def _exact_dtype(terms: int, x_type: T, x_zero: int, f_type: T, f_zero: int) -> np.dtype:
    """float32 when every partial integer sum of ``terms`` products stays
    below 2**24 (float32 then adds exactly), float64 otherwise."""
    xlo, xhi = qrange(x_type)
    flo, fhi = qrange(f_type)
    bound = terms * max(abs(xlo - x_zero), abs(xhi - x_zero)) * max(abs(flo - f_zero), abs(fhi - f_zero))
    return np.dtype(np.float32) if bound < 2 ** 24 else np.dtype(np.float64)


def _kernel(kind: _Kind):
    def kernel(call: Call) -> list[np.ndarray]:
        x_arg, f_arg, b_arg = call.ins[:3]
        out = call.outs[0]
        names = _param_names(kind, [a.type for a in call.ins])
        p = {name: call.ins[3 + i].value for i, name in enumerate(names)}
        nchw = bool(p.get("nchw", False))
        x = x_arg.value
        if nchw:
            x = x.transpose(0, 2, 3, 1)
        try:
            _check_params(p, kind)
            g = _geometry(kind, p, x_arg.value.shape, f_arg.value.shape)
        except ValueError as e:
            raise call.fail(str(e)) from None
        if b_arg.value.shape != (g.out_c,):
            raise call.fail(f"bias has shape {list(b_arg.value.shape)}, expected [{g.out_c}]")
        if any(d <= 0 for d in (g.in_h, g.in_w, g.in_c)):
            raise call.fail(f"input has an empty spatial or channel dimension: {list(x_arg.value.shape)}")
        quantized = x_arg.type in _QUANT
        if quantized:
            terms = g.k_h * g.k_w * (f_arg.value.shape[3] if kind is not _DEPTHWISE else 1)
            f_zero = 0 if f_arg.type == _PER_CHANNEL else f_arg.zero_point
            dtype = _exact_dtype(terms, x_arg.type, x_arg.zero_point, f_arg.type, f_zero)
            xv = x.astype(dtype) - dtype.type(x_arg.zero_point)
            fv = f_arg.value.astype(dtype) - dtype.type(f_zero)
        else:
            xv = x.astype(np.float32, copy=False)
            fv = f_arg.value.astype(np.float32, copy=False)

        if g.batches == 0:
            acc = np.zeros((0, g.out_h, g.out_w, g.out_c), xv.dtype)
        elif kind is _DEPTHWISE:
            acc = _depthwise(xv, fv, g, p["multiplier"])
        elif kind is _TRANSPOSE:
            acc = _transpose_conv(xv, fv, g)
        else:
            acc = _conv(xv, fv, g, p.get("groups", 1))

        act = p["activation"]
        if quantized:
            total = np.rint(acc).astype(np.int64) + b_arg.value.astype(np.int64)
            multipliers, shifts = _channel_multipliers(x_arg, f_arg, out, g.out_c)
            lo, hi = quantized_activation_range(act, out)
            q = multiply_by_quantized_multiplier(total, multipliers, shifts) + out.zero_point
            result = np.clip(q, lo, hi).astype(out.type.dtype)
        else:
            result = apply_activation(acc + b_arg.value.astype(np.float32), act)
            result = result.astype(out.type.dtype, copy=False)
        if nchw:
            result = result.transpose(0, 3, 1, 2)
        return [np.ascontiguousarray(result)]
    return kernel


def _channel_multipliers(x_arg, f_arg, out, channels: int) -> tuple[np.ndarray, np.ndarray]:
    """Per output channel, the fixed-point multiplier and shift of
    input_scale * filter_scale / output_scale, computed as TFLite's kernels
    compute them (a float32 product for per-tensor uint8, doubles otherwise),
    so results match its reference bit for bit, not just within one unit."""
    if f_arg.type == _PER_CHANNEL:
        reals = [float(np.float64(np.float32(x_arg.scale)) * np.float64(np.float32(s))
                       / np.float64(np.float32(out.scale))) for s in f_arg.channel_quant.scales]
    elif x_arg.type == T.TENSOR_QUANT8_ASYMM:
        reals = [float(np.float64(np.float32(x_arg.scale) * np.float32(f_arg.scale))
                       / np.float64(np.float32(out.scale)))] * channels
    else:
        reals = [float(np.float64(np.float32(x_arg.scale)) * np.float64(np.float32(f_arg.scale))
                       / np.float64(np.float32(out.scale)))] * channels
    pairs = [quantize_multiplier(r) for r in reals]
    return (np.array([m for m, _ in pairs], np.int64), np.array([s for _, s in pairs], np.int64))


for _kind in (_CONV, _DEPTHWISE, _GROUPED, _TRANSPOSE):
    register(OperationType[_kind.name], validate=_validator(_kind), shape=_shaper(_kind),
             kernel=_kernel(_kind))
