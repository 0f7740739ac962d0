"""An extension driver: mediapipe's custom operations as the vendor
extension ``com.nnrt.mediapipe`` (defined in ``nnrt.extensions.mediapipe``).

It claims only its extension's operations, so a model like
selfie_segmentation is split: the convolution stack runs on the other
devices, ``Convolution2DTransposeBias`` here. The kernel is the reference
driver's TRANSPOSE_CONV_2D, called with the geometry the custom op's
parameters describe. Like every driver it validates what it receives
(INVALID_ARGUMENT naming the operand), runs one operation at a time and
stops at operation boundaries when the scheduler asks.
"""
from __future__ import annotations

import time

import numpy as np

from .. import ops
from .._version import __version__
from ..errors import ErrorStatus, NnrtError, invalid
from ..extensions import mediapipe as mp
from ..hal import (NO_TIMING, Boundaries, Capabilities, Device, DeviceType, ExecutionResult,
                   PerformanceInfo, PreparedModel, Scheduling, Timing)
from ..hal.request import output_shapes, read_inputs, write_outputs
from ..hal.validate import validate_model, validate_request
from ..model.graph import HalModel, Operand, Operation
from ..model.types import OperandLifeTime as L, OperandType as T, OperationType, PaddingScheme

_CONSTANT = (L.CONSTANT_COPY, L.CONSTANT_REFERENCE)


def _params(model: HalModel, op: Operation, what: str) -> tuple[int, int, int]:
    """(padding, stride_w, stride_h) of a CONVOLUTION_2D_TRANSPOSE_BIAS."""
    operand = model.main.operands[op.inputs[3]]
    t = operand.type
    if not (t.is_extension and t.extension == mp.NAME and t.type_within == mp.TRANSPOSE_CONV_PARAMS):
        raise invalid(f"{what}: input 3 must be {mp.NAME} TRANSPOSE_CONV_PARAMS, got {t.name}")
    if operand.lifetime not in _CONSTANT:
        raise invalid(f"{what}: input 3 (the parameters) must be a constant")
    raw = model.constant_bytes(operand)
    if len(raw) != mp.PARAMS_FORMAT.size:
        raise invalid(f"{what}: the parameters take {mp.PARAMS_FORMAT.size} bytes, got {len(raw)}")
    padding, stride_w, stride_h = mp.PARAMS_FORMAT.unpack(raw)
    if padding not in (PaddingScheme.SAME, PaddingScheme.VALID):
        raise invalid(f"{what}: padding {padding} is neither SAME (1) nor VALID (2)")
    if not (0 < stride_w <= 1024 and 0 < stride_h <= 1024):
        raise invalid(f"{what}: strides ({stride_w}, {stride_h}) must be in [1, 1024]")
    return padding, stride_w, stride_h


def _out_dims(in_dims, w_dims, padding: int, stride_w: int, stride_h: int) -> tuple[int, ...]:
    """Output dimensions from known input/weight dimensions (0 = unknown)."""
    n, h, w, _ = in_dims if len(in_dims) == 4 else (0, 0, 0, 0)
    o, kh, kw, _ = w_dims

    def size(x, stride, k):
        if not x:
            return 0
        return x * stride if padding == PaddingScheme.SAME else (x - 1) * stride + k
    return (n, size(h, stride_h, kh), size(w, stride_w, kw), o)


def _check_operation(model: HalModel, k: int, op: Operation) -> None:
    """Validate operation ``k`` as this extension defines it."""
    what = f"operation {k} ({op.type.name})"
    if not (op.type.is_extension and op.type.extension == mp.NAME
            and op.type.type_within == mp.CONVOLUTION_2D_TRANSPOSE_BIAS):
        raise invalid(f"{what}: not an operation of {mp.NAME}")
    if len(op.inputs) != 4 or len(op.outputs) != 1:
        raise invalid(f"{what}: takes 4 inputs and 1 output, got {len(op.inputs)} and "
                      f"{len(op.outputs)}")
    operands = model.main.operands
    x, w, b, out = (operands[i] for i in (*op.inputs[:3], op.outputs[0]))
    for pos, operand in (("input 0", x), ("input 1", w), ("input 2", b), ("output 0", out)):
        if operand.type != T.TENSOR_FLOAT32:
            raise invalid(f"{what}: {pos} must be TENSOR_FLOAT32, got {operand.type.name}")
    for pos, operand, rank in (("input 0", x, 4), ("input 1", w, 4), ("input 2", b, 1)):
        if len(operand.dimensions) != rank:
            raise invalid(f"{what}: {pos} must have rank {rank}, got dimensions "
                          f"{list(operand.dimensions)}")
    if 0 in w.dimensions or 0 in b.dimensions:
        raise invalid(f"{what}: weights and bias must have known dimensions")
    if b.dimensions[0] != w.dimensions[0]:
        raise invalid(f"{what}: bias has {b.dimensions[0]} values for {w.dimensions[0]} "
                      f"output channels")
    if x.dimensions[3] and x.dimensions[3] != w.dimensions[3]:
        raise invalid(f"{what}: input depth {x.dimensions[3]} differs from the weights' "
                      f"{w.dimensions[3]}")
    padding, stride_w, stride_h = _params(model, op, what)
    inferred = _out_dims(x.dimensions, w.dimensions, padding, stride_w, stride_h)
    if out.dimensions:
        if len(out.dimensions) != 4 or any(d and e and d != e
                                           for d, e in zip(out.dimensions, inferred)):
            raise invalid(f"{what}: output declared {list(out.dimensions)}, the operation "
                          f"produces {list(inferred)}")


class MediapipeDevice(Device):
    type = DeviceType.ACCELERATOR
    feature_level = 30
    version_string = f"nnrt-mediapipe-{__version__}"

    def __init__(self, name: str = "mediapipe"):
        self.name = name

    def capabilities(self) -> Capabilities:
        one = PerformanceInfo(1.0, 1.0)
        return Capabilities(one, one, {T.TENSOR_FLOAT32: one}, one, one)

    def supported_extensions(self):
        return [mp.EXTENSION]

    def scheduling(self) -> Scheduling:
        return Scheduling(Boundaries.OPERATION, slots=1)

    async def supported_operations(self, model: HalModel) -> list[bool]:
        flags = []
        for k, op in enumerate(model.main.operations):
            try:
                _check_operation(model, k, op)
                flags.append(True)
            except NnrtError:
                flags.append(False)
        return flags

    async def prepare_model(self, model: HalModel, preference=None, priority=None,
                            deadline: float | None = None, cache=None, *,
                            app=None) -> "MediapipePreparedModel":
        validate_model(model)
        if model.referenced:
            raise invalid(f"{self.name} does not run control flow")
        for k, op in enumerate(model.main.operations):
            _check_operation(model, k, op)
        return MediapipePreparedModel(model)

    def __repr__(self) -> str:
        return f"<MediapipeDevice {self.name}>"


class MediapipePreparedModel(PreparedModel):
    def __init__(self, model: HalModel):
        self.model = model
        main = model.main
        self._steps = []
        for k, op in enumerate(main.operations):
            params = _params(model, op, f"operation {k}")
            weights = np.asarray(model.constant_value(main.operands[op.inputs[1]]), np.float32) \
                if main.operands[op.inputs[1]].lifetime in _CONSTANT else None
            bias = np.asarray(model.constant_value(main.operands[op.inputs[2]]), np.float32) \
                if main.operands[op.inputs[2]].lifetime in _CONSTANT else None
            self._steps.append((op, params, weights, bias))

    def execute_synchronously(self, request, measure: bool = False,
                              deadline: float | None = None, loop_timeout: float | None = None,
                              *, checkpoint=None) -> ExecutionResult:
        started = time.perf_counter_ns()
        shapes = ()
        try:
            validate_request(self.model, request)
            main = self.model.main
            values = dict(zip(main.input_indexes, read_inputs(self.model, request)))
            for op, params, weights, bias in self._steps:
                if checkpoint is not None:
                    checkpoint()
                x = values[op.inputs[0]]
                w = weights if weights is not None else values[op.inputs[1]]
                b = bias if bias is not None else values[op.inputs[2]]
                values[op.outputs[0]] = _convolution_2d_transpose_bias(x, w, b, *params)
            outputs = [values[i] for i in main.output_indexes]
            shapes = output_shapes(request, outputs)
            if not all(s.is_sufficient for s in shapes):
                return ExecutionResult(ErrorStatus.OUTPUT_INSUFFICIENT_SIZE, shapes,
                                       message="an output buffer is too small")
            write_outputs(self.model, request, outputs)
        except NnrtError as e:
            return ExecutionResult(e.status, shapes, message=e.message)
        timing = NO_TIMING
        if measure:
            elapsed = (time.perf_counter_ns() - started) // 1000
            timing = Timing(elapsed, elapsed)
        return ExecutionResult(ErrorStatus.NONE, shapes, timing)


_TRANSPOSE_CONV = ops.definition(OperationType.TRANSPOSE_CONV_2D).kernel


def _convolution_2d_transpose_bias(x: np.ndarray, w: np.ndarray, b: np.ndarray, padding: int,
                                   stride_w: int, stride_h: int) -> np.ndarray:
    """The custom op through the reference TRANSPOSE_CONV_2D kernel
    (implicit padding with an output shape, no activation, NHWC)."""
    if x.ndim != 4 or x.shape[3] != w.shape[3] or 0 in x.shape:
        raise invalid(f"CONVOLUTION_2D_TRANSPOSE_BIAS: input of shape {list(x.shape)} does not "
                      f"fit weights {list(w.shape)}")
    out_shape = _out_dims(x.shape, w.shape, padding, stride_w, stride_h)
    args = [ops.Arg(T.TENSOR_FLOAT32, x), ops.Arg(T.TENSOR_FLOAT32, w),
            ops.Arg(T.TENSOR_FLOAT32, b),
            ops.Arg(T.TENSOR_INT32, np.asarray(out_shape, np.int32)),
            ops.Arg(T.INT32, int(padding)), ops.Arg(T.INT32, int(stride_w)),
            ops.Arg(T.INT32, int(stride_h)), ops.Arg(T.INT32, 0), ops.Arg(T.BOOL, False)]
    call = ops.Call(OperationType.TRANSPOSE_CONV_2D, args,
                    [Operand(T.TENSOR_FLOAT32, out_shape)], False, None)
    return _TRANSPOSE_CONV(call)[0]
