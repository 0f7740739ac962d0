"""The one table from NNAPI operations to TFLite builtins.

Each entry of :data:`RULES` says, for one NNAPI operation, which TFLite
builtin runs it, which data types LiteRT runs with NNAPI's semantics, and how
its operands become the builtin's input tensors and options (``lower``). A
lowering raises :class:`Unsupported` naming what it cannot express; the
driver's ``supported_operations`` is exactly "the rule exists and lowering
succeeds", so what the driver claims and what it converts cannot drift apart.

Float16 operations run as their float32 twin, widened and rounded around
it (``_through_float32``); relaxed float32 models run at float32, which NNAPI
allows. What is deliberately left to the reference driver (``Unsupported``):

* explicit padding that is neither SAME nor VALID for
  the operand's shapes, grouped convolutions, reductions/softmax on any
  axis but the last where the builtin only has that one; (int8 filters with
  a non-zero zero point and per-channel filters on uint8 data, which
  TFLite's kernels do not take, run exactly as their twin in the other 8-bit
  type: see ``_finish_filtered``; NCHW operations run as their NHWC twin
  between two TRANSPOSEs: see ``_from_nchw``);
* every operand whose shape is not known at preparation (the TFLite model
  is built with static shapes), and parameters that are not constants;
* operations whose TFLite twin differs in a way that matters (CAST's
  saturation, TOPK_V2's tie order, DIV on int32, ELU with alpha != 1,
  QUANTIZE's rounding of ties, ...)
  and those with no twin at all (LSTM family, detection, ROI ops, IF/WHILE).

``lower`` works on :class:`OpInfo`, a read-only view of one NNAPI operation
with every operand's statically inferred dimensions.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np

from ...extensions import mediapipe as mediapipe_ext, tflite as tflite_ext
from ...model.types import OperandLifeTime as L, OperandType as T, OperationType as Op

F32, F16, I32, U8, S8, BOOL8 = (T.TENSOR_FLOAT32, T.TENSOR_FLOAT16, T.TENSOR_INT32,
                                T.TENSOR_QUANT8_ASYMM, T.TENSOR_QUANT8_ASYMM_SIGNED,
                                T.TENSOR_BOOL8)
QUANT8 = frozenset({U8, S8})
FLOATQ = frozenset({F32, U8, S8})

# NNAPI PaddingScheme -> tflite.Padding
_SAME, _VALID = 0, 1


class Unsupported(Exception):
    """This operation (with these operands) is not run by the litert driver."""


@dataclass(frozen=True)
class Const:
    """A constant tensor the lowering adds (a shape, an axis, a pad value,
    a re-zero-pointed filter)."""

    value: np.ndarray
    like: int | None = None   # NNAPI operand whose type and quantization it takes
    quant: tuple | None = None  # or (OperandType, scale, zero point)

    def __post_init__(self):
        assert self.value.dtype in (np.int32, np.float32, np.uint8, np.int8), self.value.dtype


@dataclass(frozen=True, eq=False)
class Temp:
    """A tensor between the TFLite operators of one NNAPI operation's lowering
    (compared by identity: each is its own tensor)."""

    type: T
    shape: tuple[int, ...]
    scale: float = 0.0
    zero_point: int = 0


@dataclass(frozen=True)
class Lowered:
    """One TFLite operator: its input tensors (NNAPI operand index, a
    :class:`Const`, or None for an omitted optional input), its outputs
    (NNAPI operand indexes), and its options (a ``tflite`` options table name
    and field values, set with the generated ``<Name>Add<Field>`` functions)."""

    inputs: tuple
    outputs: tuple[int, ...]
    options: str | None = None
    fields: dict = field(default_factory=dict)
    builtin: str = ""          # filled in from the rule by :func:`lower`


class OpInfo:
    """One NNAPI operation of a model's main subgraph, as the table sees it."""

    def __init__(self, model, index: int, dims: dict[int, tuple[int, ...]]):
        self.model = model
        self.index = index
        self.op = model.main.operations[index]
        self.type = self.op.type
        self._operands = model.main.operands
        self._dims = dims

    @property
    def n(self) -> int:
        return len(self.op.inputs)

    def operand(self, k: int):
        return self._operands[self.op.inputs[k]]

    def out(self, k: int = 0):
        return self._operands[self.op.outputs[k]]

    def t(self, k: int) -> T:
        return self.operand(k).type

    def dims(self, k: int) -> tuple[int, ...]:
        return self._dims.get(self.op.inputs[k], self.operand(k).dimensions)

    def out_dims(self, k: int = 0) -> tuple[int, ...]:
        return self._dims.get(self.op.outputs[k], self.out(k).dimensions)

    def omitted(self, k: int) -> bool:
        return self.operand(k).lifetime == L.NO_VALUE

    def const(self, k: int):
        """The constant value of input ``k``; Unsupported when it is not a constant."""
        o = self.operand(k)
        if o.lifetime not in (L.CONSTANT_COPY, L.CONSTANT_REFERENCE):
            raise Unsupported(f"input {k} is not a constant")
        return self.model.constant_value(o)

    def flag(self, k: int, default: bool = False) -> bool:
        return bool(self.const(k)) if k < self.n and not self.omitted(k) else default


@dataclass(frozen=True)
class Rule:
    builtin: str                       # tflite.BuiltinOperator member
    types: frozenset                   # accepted types of the data tensor (see `data`)
    lower: Callable[[OpInfo], Lowered]
    data: int = 0                      # which input's type decides (-1: output 0)
    layout: Callable[[OpInfo], int] | None = None   # the input holding the NCHW flag


class _View(OpInfo):
    """``base`` seen differently by a lowering; views stack (an NCHW float16
    operation is seen as an NHWC float32 one)."""

    def __init__(self, base: OpInfo):
        super().__init__(base.model, base.index, base._dims)
        self._base = base

    def operand(self, k: int):
        return self._base.operand(k)

    def out(self, k: int = 0):
        return self._base.out(k)

    def dims(self, k: int) -> tuple[int, ...]:
        return self._base.dims(k)

    def out_dims(self, k: int = 0) -> tuple[int, ...]:
        return self._base.out_dims(k)

    def const(self, k: int):
        return self._base.const(k)

    def flag(self, k: int, default: bool = False) -> bool:
        return self._base.flag(k, default)


class _NhwcView(_View):
    """An NCHW operation seen as its NHWC twin: input 0 and output 0 have
    their NHWC shapes and the layout flag reads false. The lowering of the
    twin is wrapped in TRANSPOSEs by :func:`_from_nchw`."""

    def __init__(self, base: OpInfo, layout: int):
        super().__init__(base)
        self._layout = layout

    def dims(self, k: int) -> tuple[int, ...]:
        d = super().dims(k)
        return (d[0], d[2], d[3], d[1]) if k == 0 else d

    def out_dims(self, k: int = 0) -> tuple[int, ...]:
        d = super().out_dims(k)
        return (d[0], d[2], d[3], d[1]) if k == 0 else d

    def flag(self, k: int, default: bool = False) -> bool:
        return False if k == self._layout else super().flag(k, default)


class _Float32View(_View):
    """A float16 operation seen as its float32 twin (its TENSOR_FLOAT16
    operands read as TENSOR_FLOAT32; constants keep their float16 values).
    :func:`_through_float32` puts DEQUANTIZE / CAST around the twin."""

    def operand(self, k: int):
        o = super().operand(k)
        return replace(o, type=F32) if o.type == F16 else o

    def out(self, k: int = 0):
        o = super().out(k)
        return replace(o, type=F32) if o.type == F16 else o


def _through_float32(info: OpInfo, ops: tuple[Lowered, ...]) -> tuple[Lowered, ...]:
    """Run a float16 operation in float32: every float16 tensor it reads is
    widened by DEQUANTIZE (exact), every float16 result computed in float32
    and rounded by CAST. NNAPI asks float16 operations for float16 precision
    at least; computing wider and rounding once gives that."""
    operands = info.model.main.operands
    wide: dict[int, Temp] = {}
    before, after = [], []

    def widened(i):
        if not isinstance(i, int) or operands[i].type != F16:
            return i
        if i not in wide:
            wide[i] = Temp(F32, info._dims.get(i, operands[i].dimensions))
            before.append(Lowered((i,), (wide[i],), builtin="DEQUANTIZE"))
        return wide[i]

    def narrowed(o):
        if not isinstance(o, int) or operands[o].type != F16:
            return o
        temp = Temp(F32, info._dims.get(o, operands[o].dimensions))
        after.append(Lowered((temp,), (o,), "CastOptions",
                             {"InDataType": 0, "OutDataType": 1}, builtin="CAST"))
        return temp

    body = tuple(replace(op, inputs=tuple(widened(i) for i in op.inputs),
                         outputs=tuple(narrowed(o) for o in op.outputs)) for op in ops)
    return (*before, *body, *after)


def _from_nchw(info: OpInfo, rule: "Rule", layout: int) -> tuple[Lowered, ...]:
    """TFLite has NHWC kernels only: transpose input 0 to NHWC, run the NHWC
    lowering, transpose output 0 back (exact for every type)."""
    view = _NhwcView(info, layout)
    if len(info.dims(0)) != 4 or len(info.out_dims()) != 4:
        raise Unsupported("NCHW on a tensor that is not 4-D")
    lowered = rule.lower(view)
    ops = lowered if isinstance(lowered, tuple) else (replace(lowered, builtin=rule.builtin),)
    x, y = info.op.inputs[0], info.op.outputs[0]
    xo, yo = info.operand(0), info.out()
    x_t = Temp(xo.type, view.dims(0), xo.scale, xo.zero_point)
    y_t = Temp(yo.type, view.out_dims(), yo.scale, yo.zero_point)
    to_nhwc = Lowered((x, Const(np.array([0, 2, 3, 1], np.int32))), (x_t,), builtin="TRANSPOSE")
    to_nchw = Lowered((y_t, Const(np.array([0, 3, 1, 2], np.int32))), (y,), builtin="TRANSPOSE")
    body = tuple(replace(op, inputs=tuple(x_t if i == x else i for i in op.inputs),
                         outputs=tuple(y_t if o == y else o for o in op.outputs))
                 for op in ops)
    return (to_nhwc, *body, to_nchw)


# --- checks shared by the lowerings -------------------------------------------

def _nhwc(info: OpInfo, k: int) -> None:
    if info.flag(k):
        raise Unsupported("NCHW layout")


def _activation(info: OpInfo, k: int) -> int:
    code = int(info.const(k))
    if code not in (0, 1, 2, 3):
        raise Unsupported(f"fused activation {code}")
    return code   # NNAPI FuseCode numbers equal tflite.ActivationFunctionType's


def _last_axis(info: OpInfo, axis: int) -> None:
    rank = len(info.dims(0))
    if axis not in (-1, rank - 1):
        raise Unsupported(f"axis {axis} is not the last one")


def _same_quant(info: OpInfo, a, b) -> bool:
    return a.scale == b.scale and a.zero_point == b.zero_point


def _padding(info: OpInfo, explicit: tuple[int, int, int, int] | None, code_input: int | None,
             strides: tuple[int, int], kernel: tuple[int, int],
             dilation: tuple[int, int] = (1, 1)) -> int:
    """tflite.Padding for NNAPI implicit padding, or for explicit padding
    (left, right, top, bottom) when it is exactly TFLite's SAME or VALID."""
    if explicit is None:
        code = int(info.const(code_input))
        if code not in (1, 2):
            raise Unsupported(f"padding code {code}")
        return _SAME if code == 1 else _VALID
    left, right, top, bottom = explicit
    if not any(explicit):
        return _VALID
    _, in_h, in_w, _ = info.dims(0)
    for size, stride, k, d, before, after in ((in_h, strides[1], kernel[1], dilation[1], top, bottom),
                                              (in_w, strides[0], kernel[0], dilation[0], left, right)):
        out = -(-size // stride)
        total = max((out - 1) * stride + (k - 1) * d + 1 - size, 0)
        if (before, after) != (total // 2, total - total // 2):
            raise Unsupported(f"explicit padding {explicit} is neither SAME nor VALID")
    return _SAME


def _bias(info: OpInfo, k: int):
    return None if info.omitted(k) else info.op.inputs[k]


def _check_filter(info: OpInfo, data: T, filt: int) -> None:
    ft = info.t(filt)
    if data == F32 and ft != F32:
        raise Unsupported(f"float32 data with a {ft.name} filter")
    if data == U8 and ft not in (U8, T.TENSOR_QUANT8_SYMM_PER_CHANNEL):
        raise Unsupported(f"uint8 data with a {ft.name} filter")
    if data == S8 and ft not in (S8, T.TENSOR_QUANT8_SYMM_PER_CHANNEL):
        raise Unsupported(f"int8 data with a {ft.name} filter")


def _finish_filtered(info: OpInfo, op: Lowered, builtin: str, filt: int,
                     at: tuple[int, int] = (0, 1)):
    """``op`` as it is, or run as its twin in the other 8-bit type where
    TFLite's kernels do not take the filter:

    * int8 data with an asymmetric int8 filter (TFLite's int8 kernels take
      symmetric filters only) runs as uint8;
    * uint8 data with a per-channel filter (TFLite's uint8 kernels take
      per-tensor filters only) runs as int8.

    An int8 value v with zero point z is exactly the uint8 value v + 128
    with zero point z + 128, so QUANTIZE (a pure shift at equal scales)
    turns the data (and an asymmetric filter) into the twin type, the
    twin's kernel runs, and QUANTIZE turns the result back: bit for bit
    what the twin model computes, shifted by 128. ``at`` gives the positions
    of the data and the filter among the TFLite operator's inputs."""
    w = info.operand(filt)
    data = info.t(0)
    if data == S8 and w.type == S8 and w.zero_point != 0:
        twin, shift = U8, 128
    elif data == U8 and w.type == T.TENSOR_QUANT8_SYMM_PER_CHANNEL:
        twin, shift = S8, -128
    else:
        return replace(op, builtin=builtin)
    ops = []

    def to_twin(k: int):
        o = info.operand(k)
        temp = Temp(twin, info.dims(k), o.scale, o.zero_point + shift)
        ops.append(Lowered((info.op.inputs[k],), (temp,), builtin="QUANTIZE"))
        return temp

    inputs = list(op.inputs)
    data_at, filter_at = at
    inputs[data_at] = to_twin(0)
    if w.type == S8:
        if w.lifetime in (L.CONSTANT_COPY, L.CONSTANT_REFERENCE):
            inputs[filter_at] = Const(
                (np.asarray(info.const(filt), np.int16) + shift).astype(np.uint8),
                quant=(twin, w.scale, w.zero_point + shift))
        else:
            inputs[filter_at] = to_twin(filt)
    out = info.out()
    y = Temp(twin, info.out_dims(), out.scale, out.zero_point + shift)
    ops.append(replace(op, inputs=tuple(inputs), outputs=(y,), builtin=builtin))
    ops.append(Lowered((y,), info.op.outputs, builtin="QUANTIZE"))
    return tuple(ops)


# --- lowerings ------------------------------------------------------------------

def _conv_layout(info: OpInfo) -> int:
    return 10 if info.n in (10, 11, 13) and info.t(7) == T.INT32 else 7


def _depthwise_layout(info: OpInfo) -> int:
    return 11 if info.n in (11, 12, 14) and info.t(8) == T.INT32 else 8


def _pool_layout(info: OpInfo) -> int:
    return 10 if info.n in (10, 11) else 7


def _at(k: int) -> Callable[[OpInfo], int]:
    return lambda info: k


def _binary(options: str) -> Callable[[OpInfo], Lowered]:
    def lower(info: OpInfo) -> Lowered:
        act = _activation(info, 2)
        if info.t(0) == I32 and act:
            raise Unsupported("fused activation on int32")
        return Lowered((info.op.inputs[0], info.op.inputs[1]), info.op.outputs, options,
                       {"FusedActivationFunction": act})
    return lower


def _plain(info: OpInfo) -> Lowered:
    """Every input is a tensor input of the builtin, no options."""
    return Lowered(tuple(info.op.inputs), info.op.outputs)


def _unary(info: OpInfo) -> Lowered:
    return Lowered((info.op.inputs[0],), info.op.outputs)


def _conv(info: OpInfo) -> Lowered:
    n = info.n
    explicit = n in (10, 11, 13) and info.t(7) == T.INT32
    if explicit:
        pads = tuple(int(info.const(k)) for k in (3, 4, 5, 6))
        s, act, rest = (int(info.const(7)), int(info.const(8))), 9, 10
    else:
        pads = None
        s, act, rest = (int(info.const(4)), int(info.const(5))), 6, 7
    if n > rest:
        _nhwc(info, rest)
    d = (int(info.const(rest + 1)), int(info.const(rest + 2))) if n > rest + 1 else (1, 1)
    data = info.t(0)
    _check_filter(info, data, 1)
    out_c, kh, kw, in_c = info.dims(1)
    if in_c != info.dims(0)[3]:
        raise Unsupported("grouped convolution")
    padding = _padding(info, pads, 3, s, (kw, kh), d)
    op = Lowered((info.op.inputs[0], info.op.inputs[1], _bias(info, 2)), info.op.outputs,
                 "Conv2DOptions", {"Padding": padding, "StrideW": s[0], "StrideH": s[1],
                                   "FusedActivationFunction": _activation(info, act),
                                   "DilationWFactor": d[0], "DilationHFactor": d[1]})
    return _finish_filtered(info, op, "CONV_2D", 1)


def _depthwise(info: OpInfo) -> Lowered:
    n = info.n
    explicit = n in (11, 12, 14) and info.t(8) == T.INT32
    if explicit:
        pads = tuple(int(info.const(k)) for k in (3, 4, 5, 6))
        s, mult, act, rest = (int(info.const(7)), int(info.const(8))), 9, 10, 11
    else:
        pads = None
        s, mult, act, rest = (int(info.const(4)), int(info.const(5))), 6, 7, 8
    if n > rest:
        _nhwc(info, rest)
    d = (int(info.const(rest + 1)), int(info.const(rest + 2))) if n > rest + 1 else (1, 1)
    data = info.t(0)
    _check_filter(info, data, 1)
    multiplier = int(info.const(mult))
    _, kh, kw, out_c = info.dims(1)
    if out_c != info.dims(0)[3] * multiplier:
        raise Unsupported("filter depth is not input depth x multiplier")
    padding = _padding(info, pads, 3, s, (kw, kh), d)
    op = Lowered((info.op.inputs[0], info.op.inputs[1], _bias(info, 2)), info.op.outputs,
                 "DepthwiseConv2DOptions",
                 {"Padding": padding, "StrideW": s[0], "StrideH": s[1],
                  "DepthMultiplier": multiplier,
                  "FusedActivationFunction": _activation(info, act),
                  "DilationWFactor": d[0], "DilationHFactor": d[1]})
    return _finish_filtered(info, op, "DEPTHWISE_CONV_2D", 1)


def _transpose_conv_layout(info: OpInfo) -> int:
    return 10 if info.n == 11 else 8


def _transpose_conv(info: OpInfo) -> Lowered:
    """NNAPI's filter [out, h, w, in] is TFLite's; TFLite takes the output
    shape as its first input and a padding whose head (left/top) it computes
    as a convolution's SAME or VALID head from that output size, then crops
    to the output: so explicit padding maps when its heads are those."""
    explicit = info.n == 11
    if explicit:
        left, _, top, _ = (int(info.const(k)) for k in (3, 4, 5, 6))
        s, act, rest = (int(info.const(7)), int(info.const(8))), 9, 10
    else:
        s, act, rest = (int(info.const(5)), int(info.const(6))), 7, 8
    _nhwc(info, rest)
    data = info.t(0)
    _check_filter(info, data, 1)
    _, kh, kw, in_c = info.dims(1)
    if in_c != info.dims(0)[3]:
        raise Unsupported("filter depth differs from the input depth")
    n, out_h, out_w, out_c = info.out_dims()
    if explicit:
        heads = []
        for size, stride, k in ((out_h, s[1], kh), (out_w, s[0], kw)):
            total = max((-(-size // stride) - 1) * stride + k - size, 0)
            heads.append(total // 2)
        if (top, left) == (0, 0):
            padding = _VALID
        elif (top, left) == tuple(heads):
            padding = _SAME
        else:
            raise Unsupported(f"explicit padding heads ({left}, {top}) are neither SAME nor VALID")
    else:
        code = int(info.const(4))
        if code not in (1, 2):
            raise Unsupported(f"padding code {code}")
        padding = _SAME if code == 1 else _VALID
    shape = Const(np.array([n, out_h, out_w, out_c], np.int32))
    op = Lowered((shape, info.op.inputs[1], info.op.inputs[0], _bias(info, 2)), info.op.outputs,
                 "TransposeConvOptions",
                 {"Padding": padding, "StrideW": s[0], "StrideH": s[1],
                  "FusedActivationFunction": _activation(info, act)})
    return _finish_filtered(info, op, "TRANSPOSE_CONV", 1, at=(2, 1))


def _pool(info: OpInfo) -> Lowered:
    n = info.n
    if n in (10, 11):
        pads = tuple(int(info.const(k)) for k in (1, 2, 3, 4))
        s = (int(info.const(5)), int(info.const(6)))
        f = (int(info.const(7)), int(info.const(8)))
        act, rest = 9, 10
    else:
        pads = None
        s = (int(info.const(2)), int(info.const(3)))
        f = (int(info.const(4)), int(info.const(5)))
        act, rest = 6, 7
    if n > rest:
        _nhwc(info, rest)
    padding = _padding(info, pads, 1, s, f)
    return Lowered((info.op.inputs[0],), info.op.outputs, "Pool2DOptions",
                   {"Padding": padding, "StrideW": s[0], "StrideH": s[1], "FilterWidth": f[0],
                    "FilterHeight": f[1], "FusedActivationFunction": _activation(info, act)})


def _concatenation(info: OpInfo) -> Lowered:
    axis = int(info.const(info.n - 1))
    if info.t(0) == S8 and any(not _same_quant(info, info.operand(k), info.out())
                               for k in range(info.n - 1)):
        # XNNPACK refuses int8 concatenation that requantizes, and then fails
        # the whole model instead of leaving the node to TFLite's kernel.
        raise Unsupported("int8 concatenation of differently quantized inputs")
    return Lowered(tuple(info.op.inputs[:-1]), info.op.outputs, "ConcatenationOptions",
                   {"Axis": axis, "FusedActivationFunction": 0})


def _pack(info: OpInfo) -> Lowered:
    """NNAPI's axis (input 0, in [0, rank]) becomes PackOptions; the tensors
    are the builtin's inputs. NNAPI and TFLite both want every input to keep
    the output's quantization, so PACK only moves values."""
    axis = int(info.const(0))
    values = tuple(info.op.inputs[1:])
    return Lowered(values, info.op.outputs, "PackOptions",
                   {"ValuesCount": len(values), "Axis": axis})


def _batch_matmul(info: OpInfo) -> Lowered:
    """NNAPI's adj_x/adj_y (constants; omitted is false) become the options.
    NNAPI's operands have one rank and the same batch dimensions, a case of
    TFLite's broadcasting BATCH_MATMUL.

    int8 runs on TFLite's kernel, whose fixed-point rescale is the reference
    driver's bit for bit, unless XNNPACK takes the node: it does when the rhs
    is symmetric (zero point 0), and rescales in float32, one unit off now and
    then (seen on 3 of 200 random cases). That case is left to the reference
    driver."""
    if info.t(0) == S8 and info.operand(1).zero_point == 0:
        raise Unsupported("int8 BATCH_MATMUL with a symmetric rhs: XNNPACK takes it and "
                          "rescales in float32, not with NNAPI's fixed-point multiplier")
    return Lowered((info.op.inputs[0], info.op.inputs[1]), info.op.outputs,
                   "BatchMatMulOptions", {"AdjX": info.flag(2), "AdjY": info.flag(3),
                                          "AsymmetricQuantizeInputs": False})


def _block(options: str) -> Callable[[OpInfo], Lowered]:
    def lower(info: OpInfo) -> Lowered:
        if info.n > 2:
            _nhwc(info, 2)
        return Lowered((info.op.inputs[0],), info.op.outputs, options,
                       {"BlockSize": int(info.const(1))})
    return lower


def _dequantize(info: OpInfo) -> Lowered:
    if info.out().type != F32:
        raise Unsupported(f"DEQUANTIZE to {info.out().type.name}")
    return _unary(info)


def _quantize(info: OpInfo) -> Lowered:
    """XNNPACK's QUANTIZE rounds a tie (x / scale exactly halfway) to even,
    NNAPI's rounds it away from zero: 0.25 at scale 0.5 is 0 here and 1
    there. So only a QUANTIZE that meets no ties runs here: one undoing a
    DEQUANTIZE of the same scale (a change of zero point or of 8-bit type,
    as an importer writes a uint8 <-> int8 requantization), whose inputs are
    whole multiples of the scale."""
    out = info.out()
    if out.type not in QUANT8:
        raise Unsupported(f"QUANTIZE to {out.type.name}")
    x = info.op.inputs[0]
    producer = next((op for op in info.model.main.operations if x in op.outputs), None)
    if producer is None or producer.type != Op.DEQUANTIZE or \
            info.model.main.operands[producer.inputs[0]].scale != out.scale:
        raise Unsupported("QUANTIZE of arbitrary floats: LiteRT rounds ties to even, "
                          "NNAPI away from zero")
    return _unary(info)


def _fully_connected(info: OpInfo) -> Lowered:
    data = info.t(0)
    wt = info.t(1)
    if wt != data:
        raise Unsupported(f"{data.name} data with {wt.name} weights")
    op = Lowered((info.op.inputs[0], info.op.inputs[1], _bias(info, 2)), info.op.outputs,
                 "FullyConnectedOptions",
                 {"FusedActivationFunction": _activation(info, 3), "KeepNumDims": False})
    return _finish_filtered(info, op, "FULLY_CONNECTED", 1)


def _l2_normalization(info: OpInfo) -> Lowered:
    if info.n > 1:
        _last_axis(info, int(info.const(1)))
    return Lowered((info.op.inputs[0],), info.op.outputs, "L2NormOptions",
                   {"FusedActivationFunction": 0})


def _lrn(info: OpInfo) -> Lowered:
    if len(info.dims(0)) != 4:
        raise Unsupported("TFLite's LOCAL_RESPONSE_NORMALIZATION takes rank 4 only")
    if info.n > 5:
        _last_axis(info, int(info.const(5)))
    return Lowered((info.op.inputs[0],), info.op.outputs, "LocalResponseNormalizationOptions",
                   {"Radius": int(info.const(1)), "Bias": float(info.const(2)),
                    "Alpha": float(info.const(3)), "Beta": float(info.const(4))})


def _reshape_to_output(info: OpInfo) -> Lowered:
    """RESHAPE, SQUEEZE and EXPAND_DIMS: the output shape is known statically."""
    return Lowered((info.op.inputs[0], Const(np.array(info.out_dims(), np.int32))),
                   info.op.outputs)


def _resize(options: str) -> Callable[[OpInfo], Lowered]:
    def lower(info: OpInfo) -> Lowered:
        if info.n > 3:
            _nhwc(info, 3)
        _, out_h, out_w, _ = info.out_dims()
        return Lowered((info.op.inputs[0], Const(np.array([out_h, out_w], np.int32))),
                       info.op.outputs, options,
                       {"AlignCorners": info.flag(4), "HalfPixelCenters": info.flag(5)})
    return lower


def _softmax(info: OpInfo) -> Lowered:
    if info.n > 2:
        _last_axis(info, int(info.const(2)))
    return Lowered((info.op.inputs[0],), info.op.outputs, "SoftmaxOptions",
                   {"Beta": float(info.const(1))})


def _log_softmax(info: OpInfo) -> Lowered:
    if float(info.const(1)) != 1.0:
        raise Unsupported("LOG_SOFTMAX with beta != 1")
    _last_axis(info, int(info.const(2)))
    return _unary(info)


def _pad(info: OpInfo) -> Lowered:
    paddings = np.asarray(info.const(1), np.int32)
    return Lowered((info.op.inputs[0], Const(paddings)), info.op.outputs)


def _pad_v2(info: OpInfo) -> Lowered:
    paddings = np.asarray(info.const(1), np.int32)
    data = info.t(0)
    # A quantized pad value is in the input's quantization (and TFLite wants
    # it so); a float one is a float32 tensor (float16 models run in float32).
    value = Const(np.array([info.const(2)], data.dtype),
                  like=info.op.inputs[0] if data in QUANT8 else None)
    return Lowered((info.op.inputs[0], Const(paddings), value), info.op.outputs)


def _mirror_pad(info: OpInfo) -> Lowered:
    # NNAPI's mode codes are tflite.MirrorPadMode's (REFLECT 0, SYMMETRIC 1),
    # and both check the paddings against the same per-mode limits.
    mode = int(info.const(2))
    if mode not in (0, 1):
        raise Unsupported(f"mirror pad mode {mode}")
    paddings = np.asarray(info.const(1), np.int32)
    return Lowered((info.op.inputs[0], Const(paddings)), info.op.outputs, "MirrorPadOptions",
                   {"Mode": mode})


def _reverse(info: OpInfo) -> Lowered:
    axis = np.asarray(info.const(1), np.int32).reshape(-1)
    return Lowered((info.op.inputs[0], Const(axis)), info.op.outputs)


def _reduce(info: OpInfo) -> Lowered:
    axes = np.asarray(info.const(1), np.int32).reshape(-1)
    return Lowered((info.op.inputs[0], Const(axes)), info.op.outputs, "ReducerOptions",
                   {"KeepDims": bool(info.const(2))})


def _strided_slice(info: OpInfo) -> Lowered:
    consts = [Const(np.asarray(info.const(k), np.int32)) for k in (1, 2, 3)]
    return Lowered((info.op.inputs[0], *consts), info.op.outputs, "StridedSliceOptions",
                   {"BeginMask": int(info.const(4)), "EndMask": int(info.const(5)),
                    "ShrinkAxisMask": int(info.const(6))})


def _transpose(info: OpInfo) -> Lowered:
    rank = len(info.dims(0))
    perm = (np.arange(rank - 1, -1, -1, dtype=np.int32) if info.n < 2 or info.omitted(1)
            else np.asarray(info.const(1), np.int32))
    return Lowered((info.op.inputs[0], Const(perm)), info.op.outputs)


def _batch_to_space(info: OpInfo) -> Lowered:
    if info.n > 2:
        _nhwc(info, 2)
    block = np.asarray(info.const(1), np.int32)
    return Lowered((info.op.inputs[0], Const(block), Const(np.zeros((2, 2), np.int32))),
                   info.op.outputs)


def _space_to_batch(info: OpInfo) -> Lowered:
    if info.n > 3:
        _nhwc(info, 3)
    block = np.asarray(info.const(1), np.int32)
    paddings = np.asarray(info.const(2), np.int32)
    return Lowered((info.op.inputs[0], Const(block), Const(paddings)), info.op.outputs)


def _arg(options: str) -> Callable[[OpInfo], Lowered]:
    def lower(info: OpInfo) -> Lowered:
        axis = np.array([int(info.const(1))], np.int32)
        return Lowered((info.op.inputs[0], Const(axis)), info.op.outputs, options,
                       {"OutputType": 2})   # tflite.TensorType.INT32
    return lower


def _gather(info: OpInfo) -> Lowered:
    return Lowered((info.op.inputs[0], info.op.inputs[2]), info.op.outputs, "GatherOptions",
                   {"Axis": int(info.const(1))})


def _elu(info: OpInfo) -> Lowered:
    if float(info.const(1)) != 1.0:
        raise Unsupported("ELU with alpha != 1 (TFLite's ELU has alpha 1)")
    return _unary(info)


def _slice(info: OpInfo) -> Lowered:
    begin = np.asarray(info.const(1), np.int32)
    size = np.asarray(info.const(2), np.int32)
    return Lowered((info.op.inputs[0], Const(begin), Const(size)), info.op.outputs)


def _split(info: OpInfo) -> Lowered:
    axis = np.array(int(info.const(1)), np.int32)
    return Lowered((Const(axis), info.op.inputs[0]), info.op.outputs, "SplitOptions",
                   {"NumSplits": int(info.const(2))})


def _tile(info: OpInfo) -> Lowered:
    return Lowered((info.op.inputs[0], Const(np.asarray(info.const(1), np.int32))),
                   info.op.outputs)


def _requantizing(lower: Callable[[OpInfo], Lowered]) -> Callable[[OpInfo], Lowered]:
    """For operations NNAPI defines as keeping the input's quantization."""
    def checked(info: OpInfo) -> Lowered:
        if info.t(0) in QUANT8 and not _same_quant(info, info.operand(0), info.out()):
            raise Unsupported("output quantization differs from the input's")
        return lower(info)
    return checked


_COMPARE = frozenset({F32, I32})

RULES: dict[Op, Rule] = {
    Op.ADD: Rule("ADD", frozenset({F32, U8, S8, I32}), _binary("AddOptions")),
    Op.SUB: Rule("SUB", frozenset({F32, U8, S8, I32}), _binary("SubOptions")),
    Op.MUL: Rule("MUL", frozenset({F32, U8, S8, I32}), _binary("MulOptions")),
    Op.DIV: Rule("DIV", frozenset({F32}), _binary("DivOptions")),
    Op.CONV_2D: Rule("CONV_2D", FLOATQ, _conv, layout=_conv_layout),
    Op.DEPTHWISE_CONV_2D: Rule("DEPTHWISE_CONV_2D", FLOATQ, _depthwise,
                                 layout=_depthwise_layout),
    Op.TRANSPOSE_CONV_2D: Rule("TRANSPOSE_CONV", FLOATQ, _transpose_conv,
                               layout=_transpose_conv_layout),
    Op.AVERAGE_POOL_2D: Rule("AVERAGE_POOL_2D", FLOATQ, _pool, layout=_pool_layout),
    Op.MAX_POOL_2D: Rule("MAX_POOL_2D", FLOATQ, _pool, layout=_pool_layout),
    Op.L2_POOL_2D: Rule("L2_POOL_2D", frozenset({F32}), _pool, layout=_pool_layout),
    Op.CONCATENATION: Rule("CONCATENATION", FLOATQ, _concatenation),
    Op.PACK: Rule("PACK", frozenset({F32, I32, U8, S8}), _pack, data=-1),
    Op.BATCH_MATMUL: Rule("BATCH_MATMUL", frozenset({F32, S8}), _batch_matmul),
    Op.DEPTH_TO_SPACE: Rule("DEPTH_TO_SPACE", FLOATQ, _block("DepthToSpaceOptions"),
                              layout=_at(2)),
    Op.SPACE_TO_DEPTH: Rule("SPACE_TO_DEPTH", FLOATQ, _block("SpaceToDepthOptions"),
                              layout=_at(2)),
    Op.DEQUANTIZE: Rule("DEQUANTIZE", frozenset({U8, S8, T.TENSOR_QUANT8_SYMM}), _dequantize),
    Op.QUANTIZE: Rule("QUANTIZE", frozenset({F32}), _quantize),
    Op.FLOOR: Rule("FLOOR", frozenset({F32}), _unary),
    Op.FULLY_CONNECTED: Rule("FULLY_CONNECTED", FLOATQ, _fully_connected),
    Op.L2_NORMALIZATION: Rule("L2_NORMALIZATION", frozenset({F32}), _l2_normalization),
    Op.LOCAL_RESPONSE_NORMALIZATION: Rule("LOCAL_RESPONSE_NORMALIZATION", frozenset({F32}), _lrn),
    Op.LOGISTIC: Rule("LOGISTIC", FLOATQ, _unary),
    Op.TANH: Rule("TANH", FLOATQ, _unary),
    Op.RELU: Rule("RELU", FLOATQ, _requantizing(_unary)),
    Op.RELU1: Rule("RELU_N1_TO_1", FLOATQ, _requantizing(_unary)),
    Op.RELU6: Rule("RELU6", FLOATQ, _requantizing(_unary)),
    Op.RESHAPE: Rule("RESHAPE", frozenset({F32, U8, S8, I32}), _requantizing(_reshape_to_output)),
    Op.SQUEEZE: Rule("RESHAPE", frozenset({F32, U8, S8, I32}), _requantizing(_reshape_to_output)),
    Op.EXPAND_DIMS: Rule("RESHAPE", frozenset({F32, U8, S8, I32}),
                         _requantizing(_reshape_to_output)),
    Op.RESIZE_BILINEAR: Rule("RESIZE_BILINEAR", FLOATQ, _resize("ResizeBilinearOptions"),
                               layout=_at(3)),
    Op.RESIZE_NEAREST_NEIGHBOR: Rule("RESIZE_NEAREST_NEIGHBOR", FLOATQ,
                                     _resize("ResizeNearestNeighborOptions"), layout=_at(3)),
    Op.SOFTMAX: Rule("SOFTMAX", FLOATQ, _softmax),
    Op.LOG_SOFTMAX: Rule("LOG_SOFTMAX", frozenset({F32}), _log_softmax),
    Op.PAD: Rule("PAD", FLOATQ, _requantizing(_pad)),
    Op.PAD_V2: Rule("PADV2", FLOATQ, _requantizing(_pad_v2)),
    Op.MIRROR_PAD: Rule("MIRROR_PAD", frozenset({F32, I32, U8, S8}), _requantizing(_mirror_pad)),
    Op.REVERSE: Rule("REVERSE_V2", frozenset({F32, I32, U8, S8}), _requantizing(_reverse)),
    Op.MEAN: Rule("MEAN", FLOATQ, _reduce),
    Op.REDUCE_SUM: Rule("SUM", frozenset({F32}), _reduce),
    Op.REDUCE_PROD: Rule("REDUCE_PROD", frozenset({F32}), _reduce),
    Op.REDUCE_MAX: Rule("REDUCE_MAX", FLOATQ, _reduce),
    Op.REDUCE_MIN: Rule("REDUCE_MIN", FLOATQ, _reduce),
    Op.REDUCE_ANY: Rule("REDUCE_ANY", frozenset({BOOL8}), _reduce),
    Op.REDUCE_ALL: Rule("REDUCE_ALL", frozenset({BOOL8}), _reduce),
    Op.STRIDED_SLICE: Rule("STRIDED_SLICE", FLOATQ, _requantizing(_strided_slice)),
    Op.TRANSPOSE: Rule("TRANSPOSE", FLOATQ, _requantizing(_transpose)),
    Op.BATCH_TO_SPACE_ND: Rule("BATCH_TO_SPACE_ND", FLOATQ, _requantizing(_batch_to_space),
                                 layout=_at(2)),
    Op.SPACE_TO_BATCH_ND: Rule("SPACE_TO_BATCH_ND", FLOATQ, _requantizing(_space_to_batch),
                                 layout=_at(3)),
    Op.ARGMAX: Rule("ARG_MAX", frozenset({F32, I32, U8, S8}), _arg("ArgMaxOptions")),
    Op.ARGMIN: Rule("ARG_MIN", frozenset({F32, I32, U8, S8}), _arg("ArgMinOptions")),
    Op.EQUAL: Rule("EQUAL", _COMPARE, _plain),
    Op.NOT_EQUAL: Rule("NOT_EQUAL", _COMPARE, _plain),
    Op.GREATER: Rule("GREATER", _COMPARE, _plain),
    Op.GREATER_EQUAL: Rule("GREATER_EQUAL", _COMPARE, _plain),
    Op.LESS: Rule("LESS", _COMPARE, _plain),
    Op.LESS_EQUAL: Rule("LESS_EQUAL", _COMPARE, _plain),
    Op.LOGICAL_AND: Rule("LOGICAL_AND", frozenset({BOOL8}), _plain),
    Op.LOGICAL_OR: Rule("LOGICAL_OR", frozenset({BOOL8}), _plain),
    Op.LOGICAL_NOT: Rule("LOGICAL_NOT", frozenset({BOOL8}), _plain),
    Op.MAXIMUM: Rule("MAXIMUM", frozenset({F32, I32}), _plain),
    Op.MINIMUM: Rule("MINIMUM", frozenset({F32, I32}), _plain),
    Op.GATHER: Rule("GATHER", frozenset({F32, I32, U8, S8}), _requantizing(_gather)),
    Op.PRELU: Rule("PRELU", frozenset({F32}), _plain),
    Op.HARD_SWISH: Rule("HARD_SWISH", frozenset({F32}), _unary),
    Op.ELU: Rule("ELU", frozenset({F32}), _elu),
    Op.POW: Rule("POW", frozenset({F32}), _plain),
    Op.SELECT: Rule("SELECT", frozenset({F32, I32}), _plain, data=1),
    Op.SLICE: Rule("SLICE", frozenset({F32, I32, U8, S8}), _requantizing(_slice)),
    Op.SPLIT: Rule("SPLIT", frozenset({F32, I32, U8, S8}), _requantizing(_split)),
    Op.TILE: Rule("TILE", frozenset({F32, I32, U8, S8}), _requantizing(_tile)),
    Op.ABS: Rule("ABS", frozenset({F32}), _unary),
    Op.EXP: Rule("EXP", frozenset({F32}), _unary),
    Op.LOG: Rule("LOG", frozenset({F32}), _unary),
    Op.NEG: Rule("NEG", frozenset({F32, I32}), _unary),
    Op.RSQRT: Rule("RSQRT", frozenset({F32}), _unary),
    Op.SIN: Rule("SIN", frozenset({F32}), _unary),
    Op.SQRT: Rule("SQRT", frozenset({F32}), _unary),
}


# --- nnrt's com.nnrt.tflite extension: TFLite builtins without an NNAPI twin ------

class _Complex64:
    """The type of a complex64 tensor between TFLite operators (NNAPI has
    none: the extension's operands interleave (real, imaginary) in the last
    dimension)."""

    name = "COMPLEX64"
    is_quantized = False


COMPLEX64 = _Complex64()


def _range(info: OpInfo) -> Lowered:
    """TFLite's RANGE takes three scalars; its length must be known here
    (constant inputs) for the static shapes the TFLite model is built with."""
    dtype = np.int32 if info.t(0) == I32 else np.float32
    ends = tuple(Const(np.asarray(info.const(k), dtype).reshape(())) for k in range(3))
    return Lowered(ends, info.op.outputs)


def _rfft2d(info: OpInfo) -> tuple[Lowered, ...]:
    """RFFT2D gives complex64; REAL and IMAG take its parts, PACK puts them
    side by side on a new last axis and RESHAPE merges it into the one
    before: the extension's interleaved layout (exact: values only move)."""
    out = info.out_dims()
    parts = out[:-1] + (out[-1] // 2,)
    length = np.asarray(info.const(1), np.int32).reshape(-1)
    spectrum = Temp(COMPLEX64, parts)
    real, imag, pairs = Temp(F32, parts), Temp(F32, parts), Temp(F32, parts + (2,))
    return (Lowered((info.op.inputs[0], Const(length)), (spectrum,), builtin="RFFT2D"),
            Lowered((spectrum,), (real,), builtin="REAL"),
            Lowered((spectrum,), (imag,), builtin="IMAG"),
            Lowered((real, imag), (pairs,), "PackOptions",
                    {"ValuesCount": 2, "Axis": len(parts)}, builtin="PACK"),
            Lowered((pairs, Const(np.asarray(out, np.int32))), info.op.outputs,
                    builtin="RESHAPE"))


# --- com.nnrt.mediapipe ------------------------------------------------------------

def _transpose_conv_bias(info: OpInfo) -> Lowered:
    """mediapipe's Convolution2DTransposeBias is TFLite's TRANSPOSE_CONV with
    its bias input (the same OHWI filter, SAME or VALID padding, strides from
    the 12-byte parameters): XNNPACK runs both with one deconvolution kernel,
    as it runs the custom op in mediapipe's own interpreter."""
    operand = info.operand(3)
    t = operand.type
    if not (t.is_extension and t.extension == mediapipe_ext.NAME
            and t.type_within == mediapipe_ext.TRANSPOSE_CONV_PARAMS) \
            or operand.lifetime not in (L.CONSTANT_COPY, L.CONSTANT_REFERENCE):
        raise Unsupported("input 3 is not constant TRANSPOSE_CONV_PARAMS")
    raw = info.model.constant_bytes(operand)
    if len(raw) != mediapipe_ext.PARAMS_FORMAT.size:
        raise Unsupported(f"parameters of {len(raw)} bytes")
    code, stride_w, stride_h = mediapipe_ext.PARAMS_FORMAT.unpack(raw)
    if code not in (1, 2) or not (0 < stride_w <= 1024 and 0 < stride_h <= 1024):
        raise Unsupported(f"parameters (padding {code}, strides {stride_w}, {stride_h})")
    _check_filter(info, info.t(0), 1)
    if info.dims(1)[3] != info.dims(0)[3]:
        raise Unsupported("filter depth differs from the input depth")
    shape = Const(np.array(info.out_dims(), np.int32))
    return Lowered((shape, info.op.inputs[1], info.op.inputs[0], info.op.inputs[2]),
                   info.op.outputs, "TransposeConvOptions",
                   {"Padding": _SAME if code == 1 else _VALID, "StrideW": stride_w,
                    "StrideH": stride_h, "FusedActivationFunction": 0})


# (extension, type within) -> rule; a model numbers its extensions itself.
EXTENSION_RULES: dict[tuple[str, int], Rule] = {
    (tflite_ext.NAME, tflite_ext.RANGE): Rule("RANGE", frozenset({I32, F32}), _range),
    (tflite_ext.NAME, tflite_ext.RFFT2D): Rule("RFFT2D", frozenset({F32}), _rfft2d),
    (mediapipe_ext.NAME, mediapipe_ext.CONVOLUTION_2D_TRANSPOSE_BIAS):
        Rule("TRANSPOSE_CONV", frozenset({F32}), _transpose_conv_bias),
}
EXTENSIONS = (tflite_ext.EXTENSION, mediapipe_ext.EXTENSION)


def lower(info: OpInfo) -> tuple[Lowered, ...]:
    """The TFLite operators running ``info``; Unsupported when there are none."""
    if info.type.is_extension:
        rule = EXTENSION_RULES.get((info.type.extension, info.type.type_within))
    else:
        rule = RULES.get(info.type)
    if rule is None:
        raise Unsupported(f"no TFLite lowering for {info.type.name}")
    operands = info.model.main.operands
    float16 = any(operands[i].type == F16 for i in (*info.op.inputs, *info.op.outputs))
    view = _Float32View(info) if float16 else info
    data = view.out().type if rule.data < 0 else view.t(rule.data)
    if data not in rule.types:
        raise Unsupported(f"{info.type.name} on {(F16 if float16 else data).name}")
    layout = rule.layout(view) if rule.layout is not None else None
    if layout is not None and layout < view.n and view.flag(layout):
        ops = _from_nchw(view, rule, layout)
    else:
        lowered = rule.lower(view)
        ops = lowered if isinstance(lowered, tuple) else (replace(lowered, builtin=rule.builtin),)
    if float16:
        ops = _through_float32(info, ops)
    for op in ops:
        for i in (*op.inputs, *op.outputs):
            if not isinstance(i, int):
                continue
            o = operands[i]
            if o.type.is_scalar:
                raise Unsupported(f"operand {i} is {o.type.name}")
            d = info._dims.get(i, o.dimensions)
            if not d or not all(x > 0 for x in d):
                raise Unsupported(f"operand {i} has no static shape ({list(d)})")
    return ops
