"""A small ``.tflite`` -> ``nnrt.Model`` reader for the shared test models.

A stopgap for tests and benchmarks of the litert driver until the full
importer (``nnrt.tflite``) lands: it covers the builtins of the shared
MobileNet, conv, unrolled LSTM and mediapipe detector/landmark models and
nothing else
(anything else raises NotImplementedError naming the operator). Shapes are
static; float16 constants behind DEQUANTIZE are folded to float32; the
SHAPE -> STRIDED_SLICE -> PACK chain Keras puts in front of a RESHAPE is
dropped (the RESHAPE takes its static output shape); an 8-bit requantizing
QUANTIZE becomes DEQUANTIZE + QUANTIZE (NNAPI's QUANTIZE takes float input);
UNPACK becomes SPLIT + RESHAPEs and PACK RESHAPEs + CONCATENATION.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import tflite

import nnrt
from nnrt.model.types import OperandType as T, OperationType as O

_B = tflite.BuiltinOperator
_PADDING = {tflite.Padding.SAME: 1, tflite.Padding.VALID: 2}


def _options(op, cls):
    table = op.BuiltinOptions()
    opts = cls()
    opts.Init(table.Bytes, table.Pos)
    return opts


class _Reader:
    def __init__(self, data: bytes):
        self.fb = tflite.Model.GetRootAsModel(data, 0)
        self.g = self.fb.Subgraphs(0)
        self.m = nnrt.Model()
        self.operand: dict[int, int] = {}       # tflite tensor -> NNAPI operand
        self.folded: dict[int, np.ndarray] = {}  # tflite tensor -> constant value

    # --- tensors ----------------------------------------------------------------------
    def tensor(self, t: int):
        return self.g.Tensors(t)

    def shape(self, t: int) -> list[int]:
        return [int(d) for d in self.tensor(t).ShapeAsNumpy()]

    def data(self, t: int) -> np.ndarray | None:
        if t in self.folded:
            return self.folded[t]
        tensor = self.tensor(t)
        raw = self.fb.Buffers(tensor.Buffer()).DataAsNumpy()
        if isinstance(raw, int) or raw.size == 0:
            return None
        dtype = {tflite.TensorType.FLOAT32: np.float32, tflite.TensorType.FLOAT16: np.float16,
                 tflite.TensorType.INT32: np.int32, tflite.TensorType.UINT8: np.uint8,
                 tflite.TensorType.INT8: np.int8}[tensor.Type()]
        return raw.view(dtype).reshape(self.shape(t))

    def op_index(self, t: int, *, bias_of: tuple[int, int] | None = None) -> int:
        if t in self.operand:
            return self.operand[t]
        tensor = self.tensor(t)
        q = tensor.Quantization()
        scales = q.ScaleAsNumpy() if q is not None and q.ScaleLength() else np.zeros(0)
        zps = q.ZeroPointAsNumpy() if q is not None and q.ZeroPointLength() else np.zeros(0)
        kind = tensor.Type()
        value = self.data(t)
        kwargs = {}
        if t in self.folded or kind == tflite.TensorType.FLOAT32:
            type_ = T.TENSOR_FLOAT32
        elif kind == tflite.TensorType.INT32:
            type_ = T.TENSOR_INT32
            if bias_of is not None:
                x_scale, w_scales = bias_of
                kwargs["scale"] = 0.0 if len(w_scales) > 1 else float(x_scale * w_scales[0])
        elif kind == tflite.TensorType.UINT8:
            type_ = T.TENSOR_QUANT8_ASYMM
            kwargs = {"scale": float(scales[0]), "zero_point": int(zps[0])}
        elif kind == tflite.TensorType.INT8 and len(scales) > 1:
            type_ = T.TENSOR_QUANT8_SYMM_PER_CHANNEL
            kwargs = {"channel_quant": (int(q.QuantizedDimension()), [float(s) for s in scales])}
        elif kind == tflite.TensorType.INT8:
            type_ = T.TENSOR_QUANT8_ASYMM_SIGNED
            kwargs = {"scale": float(scales[0]), "zero_point": int(zps[0])}
        else:
            raise NotImplementedError(f"tensor type {kind} of tensor {t}")
        index = self.m.add_operand(type_, self.shape(t), **kwargs)
        if value is not None:
            self.m.set_operand_value(index, np.ascontiguousarray(value, dtype=type_.dtype))
        self.operand[t] = index
        return index

    def scale(self, t: int) -> tuple[float, np.ndarray]:
        q = self.tensor(t).Quantization()
        if q is None or not q.ScaleLength():
            return 0.0, np.zeros(1)
        return float(q.ScaleAsNumpy()[0]), q.ScaleAsNumpy()

    def const(self, value, type_=T.INT32) -> int:
        arr = np.asarray(value)
        index = self.m.add_operand(type_, [] if type_.is_scalar else list(arr.shape))
        self.m.set_operand_value(index, arr.astype(type_.dtype) if not type_.is_scalar else value)
        return index

    def new(self, type_, shape, **kwargs) -> int:
        return self.m.add_operand(type_, shape, **kwargs)

    # --- operators ----------------------------------------------------------------------
    def code(self, op) -> int:
        c = self.fb.OperatorCodes(op.OpcodeIndex())
        return max(c.DeprecatedBuiltinCode(), c.BuiltinCode())

    def read(self) -> nnrt.Model:
        ops = [self.g.Operators(k) for k in range(self.g.OperatorsLength())]
        needed = {int(t) for t in self.g.OutputsAsNumpy()}
        keep = []
        for op in reversed(ops):
            outs = [int(t) for t in op.OutputsAsNumpy()]
            if not needed.intersection(outs):
                continue
            keep.append(op)
            ins = [int(t) for t in op.InputsAsNumpy() if t >= 0]
            if self.code(op) == _B.RESHAPE:
                ins = ins[:1]    # the shape comes from the static output shape
            needed.update(ins)
        for op in reversed(keep):
            self.emit(op)
        inputs = [self.op_index(int(t)) for t in self.g.InputsAsNumpy()]
        outputs = [self.op_index(int(t)) for t in self.g.OutputsAsNumpy()]
        self.m.identify_inputs_and_outputs(inputs, outputs)
        self.m.finish()
        return self.m

    def emit(self, op) -> None:
        code = self.code(op)
        ins = [int(t) for t in op.InputsAsNumpy()]
        outs = [int(t) for t in op.OutputsAsNumpy()]
        add = self.m.add_operation
        if code == _B.DEQUANTIZE and self.data(ins[0]) is not None:
            self.folded[outs[0]] = self.data(ins[0]).astype(np.float32)
            return
        if code in (_B.CONV_2D, _B.DEPTHWISE_CONV_2D):
            depthwise = code == _B.DEPTHWISE_CONV_2D
            o = _options(op, tflite.DepthwiseConv2DOptions if depthwise else tflite.Conv2DOptions)
            x_scale, _ = self.scale(ins[0])
            _, w_scales = self.scale(ins[1])
            args = [self.op_index(ins[0]), self.op_index(ins[1]),
                    self.op_index(ins[2], bias_of=(x_scale, w_scales)),
                    self.const(_PADDING[o.Padding()]), self.const(o.StrideW()),
                    self.const(o.StrideH())]
            if depthwise:
                args.append(self.const(o.DepthMultiplier()))
            args.append(self.const(o.FusedActivationFunction()))
            if (o.DilationWFactor(), o.DilationHFactor()) != (1, 1):
                args += [self.const(False, T.BOOL), self.const(o.DilationWFactor()),
                         self.const(o.DilationHFactor())]
            add(O.DEPTHWISE_CONV_2D if depthwise else O.CONV_2D, args, [self.op_index(outs[0])])
        elif code in (_B.ADD, _B.MUL, _B.SUB):
            cls = {_B.ADD: tflite.AddOptions, _B.MUL: tflite.MulOptions, _B.SUB: tflite.SubOptions}
            act = _options(op, cls[code]).FusedActivationFunction()
            nn = {_B.ADD: O.ADD, _B.MUL: O.MUL, _B.SUB: O.SUB}[code]
            add(nn, [self.op_index(ins[0]), self.op_index(ins[1]), self.const(act)],
                [self.op_index(outs[0])])
        elif code == _B.FULLY_CONNECTED:
            o = _options(op, tflite.FullyConnectedOptions)
            if o.KeepNumDims():
                raise NotImplementedError("FULLY_CONNECTED with keep_num_dims")
            x_scale, _ = self.scale(ins[0])
            _, w_scales = self.scale(ins[1])
            if len(ins) > 2 and ins[2] >= 0:
                bias = self.op_index(ins[2], bias_of=(x_scale, w_scales))
            else:
                units = self.shape(ins[1])[0]
                float_w = self.tensor(ins[1]).Type() == tflite.TensorType.FLOAT32
                bias = self.new(T.TENSOR_FLOAT32 if float_w else T.TENSOR_INT32, [units],
                                scale=0.0 if float_w else x_scale * float(w_scales[0]))
                self.m.set_operand_value(bias, np.zeros(units, np.float32 if float_w else np.int32))
            act = self.const(o.FusedActivationFunction())
            if len(w_scales) > 1:
                # NNAPI's FULLY_CONNECTED has no per-channel weights: the same
                # arithmetic is a 1x1 CONV_2D on the input seen as 1x1 pixels.
                x, y = self.op_index(ins[0]), self.op_index(outs[0])
                (units, depth), batch = self.shape(ins[1]), self.shape(outs[0])[0]
                xo, yo = self.m.operand(x), self.m.operand(y)
                x4 = self.new(xo.type, [batch, 1, 1, depth], scale=xo.scale,
                              zero_point=xo.zero_point)
                add(O.RESHAPE, [x, self.const(np.array([batch, 1, 1, depth], np.int32),
                                              T.TENSOR_INT32)], [x4])
                w = self.op_index(ins[1])
                wo = self.m.operand(w)
                w4 = self.new(wo.type, [units, 1, 1, depth],
                              channel_quant=(0, list(wo.channel_quant.scales)))
                self.m.set_operand_value(w4, np.ascontiguousarray(
                    self.data(ins[1]).reshape(units, 1, 1, depth)))
                y4 = self.new(yo.type, [batch, 1, 1, units], scale=yo.scale,
                              zero_point=yo.zero_point)
                add(O.CONV_2D, [x4, w4, bias, self.const(2), self.const(1), self.const(1), act],
                    [y4])
                add(O.RESHAPE, [y4, self.const(np.array([batch, units], np.int32),
                                               T.TENSOR_INT32)], [y])
                return
            add(O.FULLY_CONNECTED, [self.op_index(ins[0]), self.op_index(ins[1]), bias, act],
                [self.op_index(outs[0])])
        elif code == _B.MEAN:
            keep = _options(op, tflite.ReducerOptions).KeepDims()
            axes = self.const(np.asarray(self.data(ins[1]), np.int32).reshape(-1), T.TENSOR_INT32)
            add(O.MEAN, [self.op_index(ins[0]), axes, self.const(int(keep))],
                [self.op_index(outs[0])])
        elif code == _B.SOFTMAX:
            beta = _options(op, tflite.SoftmaxOptions).Beta()
            add(O.SOFTMAX, [self.op_index(ins[0]), self.const(beta, T.FLOAT32)],
                [self.op_index(outs[0])])
        elif code == _B.RESHAPE:
            shape = self.const(np.array(self.shape(outs[0]), np.int32), T.TENSOR_INT32)
            add(O.RESHAPE, [self.op_index(ins[0]), shape], [self.op_index(outs[0])])
        elif code == _B.QUANTIZE:
            if self.tensor(ins[0]).Type() == tflite.TensorType.FLOAT32:
                add(O.QUANTIZE, [self.op_index(ins[0])], [self.op_index(outs[0])])
            else:   # requantize 8-bit -> 8-bit through float
                mid = self.new(T.TENSOR_FLOAT32, self.shape(ins[0]))
                add(O.DEQUANTIZE, [self.op_index(ins[0])], [mid])
                add(O.QUANTIZE, [mid], [self.op_index(outs[0])])
        elif code == _B.DEQUANTIZE:
            add(O.DEQUANTIZE, [self.op_index(ins[0])], [self.op_index(outs[0])])
        elif code in (_B.RELU, _B.RELU6, _B.LOGISTIC, _B.TANH):
            nn = {_B.RELU: O.RELU, _B.RELU6: O.RELU6, _B.LOGISTIC: O.LOGISTIC, _B.TANH: O.TANH}
            add(nn[code], [self.op_index(ins[0])], [self.op_index(outs[0])])
        elif code == _B.PAD:
            pads = self.const(np.asarray(self.data(ins[1]), np.int32), T.TENSOR_INT32)
            add(O.PAD, [self.op_index(ins[0]), pads], [self.op_index(outs[0])])
        elif code in (_B.MAX_POOL_2D, _B.AVERAGE_POOL_2D):
            o = _options(op, tflite.Pool2DOptions)
            args = [self.op_index(ins[0]), self.const(_PADDING[o.Padding()]),
                    self.const(o.StrideW()), self.const(o.StrideH()), self.const(o.FilterWidth()),
                    self.const(o.FilterHeight()), self.const(o.FusedActivationFunction())]
            add(O.MAX_POOL_2D if code == _B.MAX_POOL_2D else O.AVERAGE_POOL_2D, args,
                [self.op_index(outs[0])])
        elif code == _B.CONCATENATION:
            o = _options(op, tflite.ConcatenationOptions)
            if o.FusedActivationFunction():
                raise NotImplementedError("CONCATENATION with a fused activation")
            add(O.CONCATENATION, [*(self.op_index(t) for t in ins), self.const(o.Axis())],
                [self.op_index(outs[0])])
        elif code == _B.SPLIT:
            n = _options(op, tflite.SplitOptions).NumSplits()
            axis = int(np.asarray(self.data(ins[0])).reshape(-1)[0])
            add(O.SPLIT, [self.op_index(ins[1]), self.const(axis), self.const(n)],
                [self.op_index(t) for t in outs])
        elif code == _B.UNPACK:
            # NNAPI has no UNPACK: SPLIT into size-1 slices, RESHAPE each.
            o = _options(op, tflite.UnpackOptions)
            x = self.op_index(ins[0])
            xo = self.m.operand(x)
            shape = self.shape(ins[0])
            axis = o.Axis() % len(shape)
            sliced = [*shape[:axis], 1, *shape[axis + 1:]]
            parts = [self.new(xo.type, sliced, scale=xo.scale, zero_point=xo.zero_point)
                     for _ in outs]
            add(O.SPLIT, [x, self.const(axis), self.const(len(outs))], parts)
            for part, t in zip(parts, outs):
                add(O.RESHAPE, [part, self.const(np.array(self.shape(t), np.int32),
                                                 T.TENSOR_INT32)], [self.op_index(t)])
        elif code == _B.PACK:
            # NNAPI's PACK is newer than HAL 1.3: RESHAPE each, CONCATENATION.
            o = _options(op, tflite.PackOptions)
            out_shape = self.shape(outs[0])
            axis = o.Axis() % len(out_shape)
            parts = []
            for t in ins:
                v = self.op_index(t)
                vo = self.m.operand(v)
                shape = self.shape(t)
                part = self.new(vo.type, [*shape[:axis], 1, *shape[axis:]], scale=vo.scale,
                                zero_point=vo.zero_point)
                add(O.RESHAPE, [v, self.const(np.array([*shape[:axis], 1, *shape[axis:]],
                                                       np.int32), T.TENSOR_INT32)], [part])
                parts.append(part)
            add(O.CONCATENATION, [*parts, self.const(axis)], [self.op_index(outs[0])])
        elif code == _B.PRELU:
            add(O.PRELU, [self.op_index(ins[0]), self.op_index(ins[1])], [self.op_index(outs[0])])
        elif code == _B.RESIZE_BILINEAR:
            o = _options(op, tflite.ResizeBilinearOptions)
            _, h, w, _ = self.shape(outs[0])
            add(O.RESIZE_BILINEAR, [self.op_index(ins[0]), self.const(w), self.const(h),
                                    self.const(False, T.BOOL),
                                    self.const(bool(o.AlignCorners()), T.BOOL),
                                    self.const(bool(o.HalfPixelCenters()), T.BOOL)],
                [self.op_index(outs[0])])
        else:
            names = {v: k for k, v in vars(_B).items() if not k.startswith("_")}
            raise NotImplementedError(f"TFLite operator {names.get(code, code)}")


def load(path: str | Path) -> nnrt.Model:
    """The finished NNAPI model of the ``.tflite`` file at ``path``."""
    return _Reader(Path(path).read_bytes()).read()
