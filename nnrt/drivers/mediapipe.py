"""An extension driver: mediapipe's custom operations as the vendor
extension ``com.nnrt.mediapipe`` (defined in ``nnrt.extensions.mediapipe``).

It claims only its extension's operations, so a model like
selfie_segmentation is split: the convolution stack runs on the other
devices, ``Convolution2DTransposeBias`` here. That kernel is the reference
driver's TRANSPOSE_CONV_2D, called with the geometry the custom op's
parameters describe; the landmark operations of face_landmark_with_attention
(``Landmarks2TransformMatrix``, ``TransformTensorBilinear``,
``TransformLandmarks``) are in ``mediapipe_kernels``. Each operation has one
entry in ``_PREPARE``: its validation, which returns its kernel bound to the
operation's constants. Like every driver it validates what it receives
(INVALID_ARGUMENT naming the operand), runs one operation at a time and
stops at operation boundaries when the scheduler asks.
"""
from __future__ import annotations

import time
from typing import Callable

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
from . import mediapipe_kernels as mk

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


def _operand(model: HalModel, op: Operation, what: str, pos: str, kind: T,
             rank: int | None = None, constant: bool = False) -> Operand:
    """Operand ``pos`` ("input 1", "output 0") of ``op``, checked for type,
    rank (when the model gives one) and, for parameters, being a constant."""
    side, k = pos.split()
    operand = model.main.operands[(op.inputs if side == "input" else op.outputs)[int(k)]]
    if operand.type != kind:
        raise invalid(f"{what}: {pos} must be {kind.name}, got {operand.type.name}")
    if rank is not None and operand.dimensions and len(operand.dimensions) != rank:
        raise invalid(f"{what}: {pos} must have rank {rank}, got dimensions "
                      f"{list(operand.dimensions)}")
    if constant and operand.lifetime not in _CONSTANT:
        raise invalid(f"{what}: {pos} (a parameter) must be a constant")
    if operand.lifetime == L.NO_VALUE:
        raise invalid(f"{what}: {pos} is omitted; it is required")
    return operand


def _scalar(model: HalModel, op: Operation, what: str, k: int, kind: T, name: str,
            positive: bool = False):
    value = model.constant_value(_operand(model, op, what, f"input {k}", kind, constant=True))
    if not np.isfinite(value) or (positive and not value > 0):
        raise invalid(f"{what}: input {k} ({name}) must be {'> 0' if positive else 'finite'}, "
                      f"got {value}")
    return value


def _check_output(what: str, out: Operand, inferred: tuple[int, ...]) -> None:
    """A declared output shape must agree with the inferred one (0 = unknown)."""
    if out.dimensions and (len(out.dimensions) != len(inferred) or any(
            d and e and d != e for d, e in zip(out.dimensions, inferred))):
        raise invalid(f"{what}: output declared {list(out.dimensions)}, the operation "
                      f"produces {list(inferred)}")


def _check_arity(what: str, op: Operation, inputs: int) -> None:
    if len(op.inputs) != inputs or len(op.outputs) != 1:
        raise invalid(f"{what}: takes {inputs} inputs and 1 output, got {len(op.inputs)} and "
                      f"{len(op.outputs)}")


def _check_dims(what: str, pos: str, dims: tuple[int, ...], want: tuple[int | str, ...]) -> None:
    """Known dimensions of ``pos`` equal ``want`` (a name: any size)."""
    if any(d and isinstance(w, int) and d != w for d, w in zip(dims, want)):
        shape = ", ".join(map(str, want))
        raise invalid(f"{what}: {pos} must have shape [{shape}], got {list(dims)}")


def _matrix(model: HalModel, op: Operation, what: str, k: int) -> None:
    m = _operand(model, op, what, f"input {k}", T.TENSOR_FLOAT32, rank=3)
    _check_dims(what, f"input {k} (the matrix)", m.dimensions, (1, 4, 4))


Run = Callable[[dict[int, np.ndarray]], np.ndarray]


def _prepare_transpose_conv_bias(model: HalModel, op: Operation, what: str) -> Run:
    _check_arity(what, op, 4)
    x = _operand(model, op, what, "input 0", T.TENSOR_FLOAT32)
    w = _operand(model, op, what, "input 1", T.TENSOR_FLOAT32)
    b = _operand(model, op, what, "input 2", T.TENSOR_FLOAT32)
    out = _operand(model, op, what, "output 0", T.TENSOR_FLOAT32)
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
    params = _params(model, op, what)
    _check_output(what, out, _out_dims(x.dimensions, w.dimensions, *params))
    i_x, i_w, i_b = op.inputs[:3]

    def run(values):
        return _convolution_2d_transpose_bias(values[i_x], values[i_w], values[i_b], *params)
    return run


def _prepare_landmarks_to_transform_matrix(model: HalModel, op: Operation, what: str) -> Run:
    _check_arity(what, op, 9)
    landmarks = _operand(model, op, what, "input 0", T.TENSOR_FLOAT32, rank=3)
    _check_dims(what, "input 0 (the landmarks)", landmarks.dimensions, (1, "n", 3))
    subset_operand = _operand(model, op, what, "input 1", T.TENSOR_INT32, rank=1, constant=True)
    subset = np.asarray(model.constant_value(subset_operand), np.int64).reshape(-1)
    left = _scalar(model, op, what, 2, T.INT32, "left_rotation_idx")
    right = _scalar(model, op, what, 3, T.INT32, "right_rotation_idx")
    target = _scalar(model, op, what, 4, T.FLOAT32, "target_rotation_radians")
    height = _scalar(model, op, what, 5, T.INT32, "output_height", positive=True)
    width = _scalar(model, op, what, 6, T.INT32, "output_width", positive=True)
    scale_x = _scalar(model, op, what, 7, T.FLOAT32, "scale_x", positive=True)
    scale_y = _scalar(model, op, what, 8, T.FLOAT32, "scale_y", positive=True)
    if not subset.size:
        raise invalid(f"{what}: input 1 (the subset) names no landmark")
    indexes = [("left_rotation_idx", left), ("right_rotation_idx", right),
               ("the subset's", int(subset.min())), ("the subset's", int(subset.max()))]
    count = landmarks.dimensions[1] if len(landmarks.dimensions) == 3 else 0

    def check_indexes(n: int | None) -> None:
        for name, index in indexes:
            if index < 0 or (n is not None and index >= n):
                raise invalid(f"{what}: {name} landmark index {index} is outside the "
                              f"{n or 'unknown number of'} landmarks of input 0")
    check_indexes(count or None)
    out = _operand(model, op, what, "output 0", T.TENSOR_FLOAT32)
    _check_output(what, out, (1, 4, 4))
    i_landmarks = op.inputs[0]

    def run(values):
        x = values[i_landmarks]
        if x.ndim != 3 or x.shape[0] != 1 or x.shape[2] != 3:
            raise invalid(f"{what}: input 0 of shape {list(x.shape)} is not [1, n, 3]")
        check_indexes(x.shape[1])
        return mk.landmarks_to_transform_matrix(x, subset, left, right, target, height, width,
                                                scale_x, scale_y)
    return run


def _prepare_transform_tensor_bilinear(model: HalModel, op: Operation, what: str) -> Run:
    _check_arity(what, op, 4)
    data = _operand(model, op, what, "input 0", T.TENSOR_FLOAT32, rank=4)
    _check_dims(what, "input 0", data.dimensions, (1, "h", "w", "c"))
    _matrix(model, op, what, 1)
    height = _scalar(model, op, what, 2, T.INT32, "output_height", positive=True)
    width = _scalar(model, op, what, 3, T.INT32, "output_width", positive=True)
    out = _operand(model, op, what, "output 0", T.TENSOR_FLOAT32)
    channels = data.dimensions[3] if len(data.dimensions) == 4 else 0
    _check_output(what, out, (1, height, width, channels))
    i_data, i_matrix = op.inputs[:2]

    def run(values):
        x, m = values[i_data], values[i_matrix]
        if x.ndim != 4 or x.shape[0] != 1 or 0 in x.shape:
            raise invalid(f"{what}: input 0 of shape {list(x.shape)} is not [1, h, w, c]")
        _check_matrix_value(what, m)
        return mk.transform_tensor_bilinear(x, m, height, width)
    return run


def _prepare_transform_landmarks(model: HalModel, op: Operation, what: str) -> Run:
    _check_arity(what, op, 2)
    landmarks = _operand(model, op, what, "input 0", T.TENSOR_FLOAT32, rank=3)
    _check_dims(what, "input 0 (the landmarks)", landmarks.dimensions, (1, "n", "d"))
    if len(landmarks.dimensions) == 3 and landmarks.dimensions[2] not in (0, 2, 3):
        raise invalid(f"{what}: input 0 holds landmarks of {landmarks.dimensions[2]} "
                      f"coordinates; 2 (x, y) or 3 (x, y, z) are defined")
    _matrix(model, op, what, 1)
    out = _operand(model, op, what, "output 0", T.TENSOR_FLOAT32)
    _check_output(what, out, landmarks.dimensions or (0, 0, 0))
    i_landmarks, i_matrix = op.inputs

    def run(values):
        x, m = values[i_landmarks], values[i_matrix]
        if x.ndim != 3 or x.shape[0] != 1 or x.shape[2] not in (2, 3):
            raise invalid(f"{what}: input 0 of shape {list(x.shape)} is not [1, n, 2 or 3]")
        _check_matrix_value(what, m)
        return mk.transform_landmarks(x, m)
    return run


def _check_matrix_value(what: str, m: np.ndarray) -> None:
    if m.shape != (1, 4, 4):
        raise invalid(f"{what}: input 1 of shape {list(m.shape)} is not a [1, 4, 4] matrix")


# Type within com.nnrt.mediapipe -> its validation, which returns its kernel
# bound to the operation's operands and constants.
_PREPARE: dict[int, Callable[[HalModel, Operation, str], Run]] = {
    mp.CONVOLUTION_2D_TRANSPOSE_BIAS: _prepare_transpose_conv_bias,
    mp.LANDMARKS_TO_TRANSFORM_MATRIX: _prepare_landmarks_to_transform_matrix,
    mp.TRANSFORM_TENSOR_BILINEAR: _prepare_transform_tensor_bilinear,
    mp.TRANSFORM_LANDMARKS: _prepare_transform_landmarks,
}


def _prepare_operation(model: HalModel, k: int, op: Operation) -> Run:
    """Validate operation ``k`` as this extension defines it; its kernel."""
    what = f"operation {k} ({op.type.name})"
    prepare = _PREPARE.get(op.type.type_within) if (
        op.type.is_extension and op.type.extension == mp.NAME) else None
    if prepare is None:
        raise invalid(f"{what}: not an operation of {mp.NAME}")
    return prepare(model, op, what)


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
                _prepare_operation(model, k, op)
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
        return MediapipePreparedModel(model)

    def __repr__(self) -> str:
        return f"<MediapipeDevice {self.name}>"


class MediapipePreparedModel(PreparedModel):
    def __init__(self, model: HalModel):
        self.model = model
        main = model.main
        self._steps = [(op.outputs[0], _prepare_operation(model, k, op))
                       for k, op in enumerate(main.operations)]
        # Constant tensors an operation reads (weights, a fixed matrix), decoded once.
        self._constants = {i: np.asarray(model.constant_value(main.operands[i]))
                           for op in main.operations for i in op.inputs
                           if main.operands[i].lifetime in _CONSTANT
                           and not main.operands[i].type.is_scalar
                           and not main.operands[i].type.is_extension}

    def execute_synchronously(self, request, measure: bool = False,
                              deadline: float | None = None, loop_timeout: float | None = None,
                              *, checkpoint=None) -> ExecutionResult:
        started = time.perf_counter_ns()
        shapes = ()
        try:
            validate_request(self.model, request)
            main = self.model.main
            values = dict(self._constants)
            values.update(zip(main.input_indexes, read_inputs(self.model, request)))
            for k, (output, run) in enumerate(self._steps):
                if checkpoint is not None:
                    checkpoint()
                try:
                    values[output] = run(values)
                except (ValueError, TypeError, IndexError, ArithmeticError, MemoryError) as e:
                    # As the reference executor: a kernel that cannot compute
                    # what it was given (a crop too large to allocate) fails
                    # this execution, never the driver.
                    raise NnrtError(ErrorStatus.GENERAL_FAILURE,
                                    f"operation {k} failed: {type(e).__name__}: {e}") from e
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
