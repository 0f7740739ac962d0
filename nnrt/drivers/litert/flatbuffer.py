"""Write lowered operations as a TFLite model (a ``.tflite`` flatbuffer).

The model is built with the ``tflite`` package's generated schema functions
on a ``flatbuffers.Builder``: one subgraph, one tensor per NNAPI operand the
operators touch (constants carry their bytes in a buffer), the NNAPI
operands listed as the subgraph's inputs and outputs. Shapes are static
(the dimensions validation inferred); quantization keeps NNAPI's scale and
zero point, per-channel filters their scales and channel dimension.
"""
from __future__ import annotations

import flatbuffers
import numpy as np
import tflite

from ...model.types import OperandLifeTime as L, OperandType as T
from .table import COMPLEX64, Const, Lowered, Temp

_TENSOR_TYPES = {
    T.TENSOR_FLOAT32: tflite.TensorType.FLOAT32,
    T.TENSOR_FLOAT16: tflite.TensorType.FLOAT16,
    T.TENSOR_INT32: tflite.TensorType.INT32,
    T.TENSOR_QUANT8_ASYMM: tflite.TensorType.UINT8,
    T.TENSOR_QUANT8_ASYMM_SIGNED: tflite.TensorType.INT8,
    T.TENSOR_QUANT8_SYMM: tflite.TensorType.INT8,
    T.TENSOR_QUANT8_SYMM_PER_CHANNEL: tflite.TensorType.INT8,
    T.TENSOR_BOOL8: tflite.TensorType.BOOL,
    COMPLEX64: tflite.TensorType.COMPLEX64,   # only between operators (table.COMPLEX64)
}
_NUMPY_TYPES = {np.dtype(np.int32): T.TENSOR_INT32, np.dtype(np.float32): T.TENSOR_FLOAT32}
_CONSTANT = (L.CONSTANT_COPY, L.CONSTANT_REFERENCE)
_BUFFER_ALIGNMENT = 16   # XNNPACK reads weights in place with aligned loads where it can


class _Tensor:
    __slots__ = ("type", "shape", "data", "scale", "zero_point", "channel_dim", "name")

    def __init__(self, type, shape, data=None, scale=(), zero_point=(), channel_dim=0, name=""):
        self.type, self.shape, self.data = type, tuple(int(d) for d in shape), data
        self.scale, self.zero_point, self.channel_dim = scale, zero_point, channel_dim
        self.name = name


def build(model, ops: list[Lowered], inputs: list[int], outputs: list[int],
          dims: dict[int, tuple[int, ...]]) -> bytes:
    """A TFLite model running ``ops`` (in order) from NNAPI operands
    ``inputs`` to ``outputs`` of ``model``'s main subgraph."""
    operands = model.main.operands
    bias_scales = _per_channel_bias_scales(operands, ops)
    tensors: list[_Tensor] = []
    index: dict[int, int] = {}

    def tensor_of(i: int) -> int:
        if i in index:
            return index[i]
        o = operands[i]
        data = model.constant_bytes(o) if o.lifetime in _CONSTANT else None
        if o.channel_quant is not None:
            scale = tuple(o.channel_quant.scales)
            zp = (0,) * len(scale)
            cdim = o.channel_quant.channel_dim
        elif i in bias_scales:
            scale, zp, cdim = bias_scales[i], (0,) * len(bias_scales[i]), 0
        elif o.type.is_quantized or (o.type == T.TENSOR_INT32 and o.scale):
            scale, zp, cdim = (o.scale,), (o.zero_point,), 0
        else:
            scale, zp, cdim = (), (), 0
        tensors.append(_Tensor(_TENSOR_TYPES[o.type], dims.get(i, o.dimensions), data, scale, zp,
                               cdim, f"t{i}"))
        index[i] = len(tensors) - 1
        return index[i]

    temps: dict[int, int] = {}

    def temp_tensor(t: Temp) -> int:
        if id(t) not in temps:
            quant = ((t.scale,), (t.zero_point,)) if t.type.is_quantized else ((), ())
            tensors.append(_Tensor(_TENSOR_TYPES[t.type], t.shape, None, *quant,
                                   name=f"x{len(tensors)}"))
            temps[id(t)] = len(tensors) - 1
        return temps[id(t)]

    def const_tensor(c: Const) -> int:
        if c.quant is not None:
            type_, scale_, zp_ = c.quant
            t, scale, zp = _TENSOR_TYPES[type_], (scale_,), (zp_,)
        elif c.like is not None:
            o = operands[c.like]
            t = _TENSOR_TYPES[o.type]
            scale, zp = ((o.scale,), (o.zero_point,)) if o.type.is_quantized else ((), ())
        else:
            t = _TENSOR_TYPES[_NUMPY_TYPES[c.value.dtype]]
            scale, zp = (), ()
        tensors.append(_Tensor(t, c.value.shape, c.value.tobytes(), scale, zp,
                               name=f"c{len(tensors)}"))
        return len(tensors) - 1

    graph_ops = []
    for lowered in ops:
        ins = [-1 if x is None else const_tensor(x) if isinstance(x, Const)
               else temp_tensor(x) if isinstance(x, Temp) else tensor_of(x)
               for x in lowered.inputs]
        outs = [temp_tensor(x) if isinstance(x, Temp) else tensor_of(x) for x in lowered.outputs]
        graph_ops.append((lowered, ins, outs))
    sub_inputs = [tensor_of(i) for i in inputs]
    sub_outputs = [tensor_of(i) for i in outputs]
    return _serialize(tensors, graph_ops, sub_inputs, sub_outputs)


def _per_channel_bias_scales(operands, ops: list[Lowered]) -> dict[int, tuple[float, ...]]:
    """NNAPI leaves the scale of a bias next to a per-channel filter at 0
    (it is implied); TFLite and XNNPACK want it spelled out per channel:
    input scale x filter scale of the channel."""
    scales = {}
    for lowered in ops:
        # (data, filter, bias) positions: TRANSPOSE_CONV takes the output shape first.
        at = (2, 1, 3) if lowered.builtin == "TRANSPOSE_CONV" else (0, 1, 2)
        if len(lowered.inputs) <= at[2]:
            continue
        x, f, b = (lowered.inputs[k] for k in at)
        if not isinstance(f, int) or not isinstance(b, int) or x is None:
            continue
        x_scale = x.scale if isinstance(x, Temp) else operands[x].scale
        filt, bias = operands[f], operands[b]
        if filt.channel_quant is not None and bias.type == T.TENSOR_INT32:
            scales[b] = tuple(x_scale * s for s in filt.channel_quant.scales)
    return scales


def _int_vector(b: flatbuffers.Builder, start, values, prepend) -> int:
    start(b, len(values))
    for v in reversed(values):
        prepend(int(v))
    return b.EndVector()


def _serialize(tensors: list[_Tensor], graph_ops, sub_inputs, sub_outputs) -> bytes:
    b = flatbuffers.Builder(1 << 16)
    # Buffers: 0 is the empty buffer every tensor without data points at.
    buffer_offsets = []
    tflite.BufferStart(b)
    buffer_offsets.append(tflite.BufferEnd(b))
    buffer_of = []
    for t in tensors:
        if t.data is None:
            buffer_of.append(0)
            continue
        raw = np.frombuffer(t.data, np.uint8)
        b.Prep(_BUFFER_ALIGNMENT, raw.size)   # the vector's bytes start aligned
        data = b.CreateNumpyVector(raw)
        tflite.BufferStart(b)
        tflite.BufferAddData(b, data)
        buffer_offsets.append(tflite.BufferEnd(b))
        buffer_of.append(len(buffer_offsets) - 1)

    tensor_offsets = []
    for t, buf in zip(tensors, buffer_of):
        shape = _int_vector(b, tflite.TensorStartShapeVector, t.shape, b.PrependInt32)
        quant = None
        if t.scale:
            scale = b.CreateNumpyVector(np.asarray(t.scale, np.float32))
            zp = b.CreateNumpyVector(np.asarray(t.zero_point, np.int64))
            tflite.QuantizationParametersStart(b)
            tflite.QuantizationParametersAddScale(b, scale)
            tflite.QuantizationParametersAddZeroPoint(b, zp)
            tflite.QuantizationParametersAddQuantizedDimension(b, t.channel_dim)
            quant = tflite.QuantizationParametersEnd(b)
        name = b.CreateString(t.name)
        tflite.TensorStart(b)
        tflite.TensorAddShape(b, shape)
        tflite.TensorAddType(b, t.type)
        tflite.TensorAddBuffer(b, buf)
        tflite.TensorAddName(b, name)
        if quant is not None:
            tflite.TensorAddQuantization(b, quant)
        tensor_offsets.append(tflite.TensorEnd(b))

    codes: dict[str, int] = {}
    op_offsets = []
    for lowered, ins, outs in graph_ops:
        opcode = codes.setdefault(lowered.builtin, len(codes))
        in_vec = _int_vector(b, tflite.OperatorStartInputsVector, ins, b.PrependInt32)
        out_vec = _int_vector(b, tflite.OperatorStartOutputsVector, outs, b.PrependInt32)
        options = _options(b, lowered) if lowered.options else None
        tflite.OperatorStart(b)
        tflite.OperatorAddOpcodeIndex(b, opcode)
        tflite.OperatorAddInputs(b, in_vec)
        tflite.OperatorAddOutputs(b, out_vec)
        if options is not None:
            tflite.OperatorAddBuiltinOptionsType(b, getattr(tflite.BuiltinOptions, lowered.options))
            tflite.OperatorAddBuiltinOptions(b, options)
        op_offsets.append(tflite.OperatorEnd(b))

    code_offsets = []
    for name in codes:
        code = getattr(tflite.BuiltinOperator, name)
        tflite.OperatorCodeStart(b)
        # Codes above 127 live in builtin_code; the deprecated int8 field
        # then holds PLACEHOLDER_FOR_GREATER_OP_CODES.
        tflite.OperatorCodeAddDeprecatedBuiltinCode(b, min(code, 127))
        tflite.OperatorCodeAddBuiltinCode(b, code)
        tflite.OperatorCodeAddVersion(b, 1)
        code_offsets.append(tflite.OperatorCodeEnd(b))

    def table_vector(start, offsets) -> int:
        start(b, len(offsets))
        for o in reversed(offsets):
            b.PrependUOffsetTRelative(o)
        return b.EndVector()

    tensors_vec = table_vector(tflite.SubGraphStartTensorsVector, tensor_offsets)
    ops_vec = table_vector(tflite.SubGraphStartOperatorsVector, op_offsets)
    in_vec = _int_vector(b, tflite.SubGraphStartInputsVector, sub_inputs, b.PrependInt32)
    out_vec = _int_vector(b, tflite.SubGraphStartOutputsVector, sub_outputs, b.PrependInt32)
    name = b.CreateString("main")
    tflite.SubGraphStart(b)
    tflite.SubGraphAddTensors(b, tensors_vec)
    tflite.SubGraphAddInputs(b, in_vec)
    tflite.SubGraphAddOutputs(b, out_vec)
    tflite.SubGraphAddOperators(b, ops_vec)
    tflite.SubGraphAddName(b, name)
    subgraph = tflite.SubGraphEnd(b)

    subgraphs_vec = table_vector(tflite.ModelStartSubgraphsVector, [subgraph])
    codes_vec = table_vector(tflite.ModelStartOperatorCodesVector, code_offsets)
    buffers_vec = table_vector(tflite.ModelStartBuffersVector, buffer_offsets)
    description = b.CreateString("nnrt litert driver")
    tflite.ModelStart(b)
    tflite.ModelAddVersion(b, 3)
    tflite.ModelAddOperatorCodes(b, codes_vec)
    tflite.ModelAddSubgraphs(b, subgraphs_vec)
    tflite.ModelAddDescription(b, description)
    tflite.ModelAddBuffers(b, buffers_vec)
    b.Finish(tflite.ModelEnd(b), file_identifier=b"TFL3")
    return bytes(b.Output())


def _options(b: flatbuffers.Builder, lowered: Lowered) -> int:
    """The options table ``lowered.options`` with ``lowered.fields`` set
    through the generated ``<Options>Add<Field>`` functions."""
    name = lowered.options
    getattr(tflite, f"{name}Start")(b)
    for field_name, value in lowered.fields.items():
        getattr(tflite, f"{name}Add{field_name}")(b, value)
    return getattr(tflite, f"{name}End")(b)
