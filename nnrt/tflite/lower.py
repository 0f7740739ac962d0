"""Lower a TFLite subgraph to an ``nnrt.Model``.

Operators are taken in file order. One whose inputs are all known at import
(constants, or the static shape a SHAPE reads) is evaluated here with numpy
and its output becomes a constant: that folds float16 weights behind
DEQUANTIZE, sparse weights behind DENSIFY (densified by the reader) and shape
arithmetic such as SHAPE -> STRIDED_SLICE -> PACK -> RESHAPE. Every other
operator goes through one handler from ``_HANDLERS``, which emits the NNAPI
operation(s) that compute the same thing:

* most builtins map one to one, with options turned into NNAPI's scalar
  operands (padding codes SAME=0/VALID=1 become 1/2, fused activations keep
  their codes, a fused TANH becomes a TANH operation);
* PACK maps to NNAPI's PACK (feature level 6), its axis made non-negative
  (NNAPI takes [0, rank] only); UNPACK is a SPLIT and a RESHAPE per output
  (NNAPI has no UNPACK);
* BATCH_MATMUL maps to NNAPI's BATCH_MATMUL (feature level 6), which takes
  inputs of one rank and the same batch dimensions: TFLite's broadcasting
  is written out first, a RESHAPE adding leading 1s to the input of lower
  rank and a TILE repeating an input along a batch dimension of 1 (both only
  move values). Hybrid BATCH_MATMUL (float lhs, int8 rhs, quantizing the lhs
  at run time, asymmetrically or not) has no NNAPI counterpart;
* QUANTIZE between two quantized types is DEQUANTIZE + QUANTIZE (NNAPI's
  QUANTIZE takes only float input);
* FULLY_CONNECTED with per-channel weights, which NNAPI's FULLY_CONNECTED
  cannot take, is a 1x1 CONV_2D between two RESHAPEs — the same sums, the
  same per-channel requantization;
* STRIDED_SLICE gets ``end = begin + 1`` on shrink axes (TFLite ignores
  ``end`` there, NNAPI does not);
* MIRROR_PAD maps to NNAPI's MIRROR_PAD (mode REFLECT=0 / SYMMETRIC=1 in both);
  REVERSE_V2 becomes one NNAPI REVERSE per axis, each axis made non-negative
  (NNAPI's REVERSE takes exactly one axis in [0, rank)); its axes must be
  constant, distinct and at least one;
* CUSTOM ops a known vendor extension defines become its operations:
  mediapipe's Convolution2DTransposeBias, Landmarks2TransformMatrix,
  TransformTensorBilinear and TransformLandmarks are ``com.nnrt.mediapipe``
  operations, their custom options (raw TfLiteTransposeConvParams, or a
  flexbuffer map read as mediapipe's parsers read it) NNAPI constants; the
  landmark ops only in version 2, the one mediapipe's resolvers register;
* FLOOR_DIV is DIV on int32 (NNAPI's rounds toward negative infinity), DIV
  then FLOOR on floats;
* RANGE (unless its inputs are constant, then it folds) and RFFT2D, which
  NNAPI has no exact form of, are operations of nnrt's own extension
  ``com.nnrt.tflite`` (``nnrt/extensions/tflite.py``). A complex64 tensor is
  float32 with (real, imaginary) interleaved in its last dimension, twice as
  long (complex64's memory layout, and no extra rank: NNAPI's shape
  operations stop at rank 4); REAL, IMAG and CAST to float (the real part)
  are a STRIDED_SLICE of stride 2 there, COMPLEX_ABS adds SQRT of the
  squares, SQUEEZE keeps its axes. Other operators refuse complex inputs;
* WHILE and IF become NNAPI control flow whose condition, body and branches
  are referenced models (``set_operand_value_from_model``);
* UNIDIRECTIONAL_SEQUENCE_LSTM reads its state from TFLite *variable*
  tensors, which persist between invokes. NNAPI has no variables, so each
  variable becomes a model input and the op's state output a model output,
  paired in the model's metadata; the runtime feeds one execution's state
  outputs to the next one's state inputs (zeros at first, as LiteRT's);
* resource variables (VAR_HANDLE, READ_VARIABLE, ASSIGN_VARIABLE, named by
  container and shared name) become state pairs the same way: a variable
  read before it is assigned is a state input, the value its last
  ASSIGN_VARIABLE writes the paired state output; a read after an assign is
  the assigned value itself. Its initial value is what the CALL_ONCE init
  subgraph assigns, evaluated here (constants, or operators that fold): the
  metadata carries it, the first execution and ``reset_state`` start from it.
  A variable the graph reads but never assigns keeps that value for ever:
  it is a constant. Variables inside control-flow bodies, a state whose
  assigned value differs in type, shape or quantization from what is read,
  and init subgraphs that do not fold are refused.

Shapes: each emitted operation's output dimensions are inferred with the
operation registry's shape functions (as validation will infer them), so a
tensor whose signature has an unknown size gets its real size where the
inputs fix it, and a SHAPE of it folds. Where only the batch is unknown the
file's shape is declared, as converters write the batch there; where
inference finds it was a placeholder (LiteRT resizes such tensors when it
prepares the graph: BirdNET's frames), the graph is lowered again declaring
the inferred sizes (:func:`lower_graph`; NNAPI operands keep the dimensions
they are added with).

Rank-0 tensors: NNAPI has no rank-0 constant, so scalar constants become
shape [1] and scalar temporaries have unknown rank; elementwise results are
the same values, and GATHER with a scalar index is reshaped back.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np
from flatbuffers import flexbuffers

from .. import ops
from ..errors import NnrtError, invalid
from ..extensions import mediapipe as _mediapipe, tflite as _tflite_ext
from ..model.builder import Model
from ..model.graph import Operation
from ..model.metadata import ModelMetadata, Quantization as MetaQuant, TensorInfo
from ..model.types import OperandType as T, OperationType as Op
from ..ops.tflite_builtins import range_values
from .reader import Graph, Operator, Tensor, TfliteFile

_PADDING = {0: 1, 1: 2}  # TFLite Padding SAME/VALID -> NNAPI PaddingScheme
_FUSED_TANH = 4
_FLOAT_TYPES = {np.dtype(np.float32): T.TENSOR_FLOAT32, np.dtype(np.float16): T.TENSOR_FLOAT16,
                np.dtype(np.int32): T.TENSOR_INT32, np.dtype(np.bool_): T.TENSOR_BOOL8}


@dataclass
class _State:
    """A state pair of the model being built: the tensor whose type and shape
    it has, its model input, and the (tensor, operand) giving its next value
    (set when the graph is done, for a resource variable)."""

    tensor: int
    input: int
    output: tuple[int, int] | None = None
    name: str | None = None            # the tensor's name unless given
    initial: np.ndarray | None = None  # the value it starts from; None: zeros


class _Building:
    """What an ``OpView`` reads of the model a :class:`Lowering` builds: its
    operands by index and the values of its constants."""

    def __init__(self, lowering: "Lowering"):
        self._lowering = lowering
        self._index: dict[int, int] = {}   # id(Operand) -> its index, as handed out
        self.referenced = ()

    def subgraph(self, index):
        return self

    @property
    def operands(self):
        return self

    def __getitem__(self, i: int):
        operand = self._lowering.model.operand(i)
        self._index[id(operand)] = i
        return operand

    def constant_value(self, operand):
        return self._lowering.constants.get(self._index.get(id(operand), -1))


class Lowering:
    """Lowers the operators ``ops`` of graph ``graph_index`` into a new
    ``nnrt.Model`` whose inputs and outputs are the given tensors."""

    def __init__(self, file: TfliteFile, graph_index: int, referenced: dict[int, Model],
                 *, is_main: bool = True, hints: dict[int, tuple[int, ...]] | None = None):
        self.file = file
        self.graph: Graph = file.graphs[graph_index]
        self.referenced = referenced  # graph index -> finished Model (WHILE/IF bodies)
        self.is_main = is_main
        self.model = Model()
        self.operands: dict[int, int] = {}
        # What is known of the model being built, for shape inference at
        # import (see emit): the dimensions the registry infers for each
        # operation's outputs, and the value of each constant operand.
        self.known: dict[int, tuple[int, ...]] = {}
        self.constants: dict[int, object] = {}
        self._building = _Building(self)
        # Tensors whose file shape proved a placeholder: their inferred NNAPI
        # dimensions, declared from the start when the import is redone
        # (see lower_graph), and those found in this pass.
        self.hints = dict(hints or {})
        self.conflicts: dict[int, tuple[int, ...]] = {}
        self._tensor_of: dict[int, int] = {}   # operand written by an operation -> its tensor
        self.values: dict[int, np.ndarray] = {t.index: t.data for t in self.graph.tensors
                                              if t.data is not None}
        # An empty constant (a shape [] given as a vector of 0 elements) has
        # no buffer in the file: nothing writes it, so it is that empty value.
        written = {t for op in self.graph.operators for t in op.outputs} | set(self.graph.inputs)
        for t in self.graph.tensors:
            if t.data is None and t.dtype is not None and t.shape and 0 in t.shape \
                    and t.index not in written and -1 not in t.shape_signature:
                self.values[t.index] = np.zeros(t.shape, t.dtype)
        self.states: list[_State] = []
        # Resource variables, keyed by (container, shared name): the handle
        # each VAR_HANDLE output stands for, the values CALL_ONCE init
        # subgraphs assigned, the tensor holding each one's value now, and
        # the state pair of each read before it is assigned.
        self.handles: dict[int, tuple[str, str]] = {}
        self.initial: dict[tuple[str, str], np.ndarray] = {}
        self.initialized: set[int] = set()              # init subgraphs run
        self.assigned: set[tuple[str, str]] = set()     # assigned somewhere in the graph
        self.current: dict[tuple[str, str], int] = {}
        self.variable_states: dict[tuple[str, str], _State] = {}
        self._pending: list[tuple[Op, int, int]] = []   # activations split off an operation

    # --- messages ----------------------------------------------------------
    def fail(self, op: Operator, message: str):
        return invalid(f"{self.file.name}: operator {op.index} ({op.name}) of subgraph "
                       f"{self.graph.index}: {message}")

    # --- tensors and operands ------------------------------------------------
    def tensor(self, t: int) -> Tensor:
        return self.graph.tensors[t]

    def value(self, t: int) -> np.ndarray | None:
        return None if t < 0 else self.values.get(t)

    def operand_type(self, tensor: Tensor, op: Operator | None = None) -> tuple[T, dict]:
        q = tensor.quantization
        dt = tensor.dtype
        where = f"tensor {tensor.index} ({tensor.name!r}, {tensor.type_name})"
        if dt == np.uint8:
            if q is None:
                raise self._refuse(op, f"{where} is UINT8 without quantization")
            return T.TENSOR_QUANT8_ASYMM, dict(scale=q.scales[0], zero_point=q.zero_points[0])
        if dt == np.int8:
            if q is None:
                raise self._refuse(op, f"{where} is INT8 without quantization")
            if q.per_channel:
                return T.TENSOR_QUANT8_SYMM_PER_CHANNEL, dict(channel_quant=(q.dimension, q.scales))
            return T.TENSOR_QUANT8_ASYMM_SIGNED, dict(scale=q.scales[0], zero_point=q.zero_points[0])
        if dt == np.int16 and q is not None:
            return T.TENSOR_QUANT16_SYMM, dict(scale=q.scales[0])
        if dt == np.int64:  # shape and index tensors: NNAPI takes them as int32
            return T.TENSOR_INT32, {}
        if dt in _FLOAT_TYPES:
            return _FLOAT_TYPES[dt], {}
        if dt == np.complex64:  # (real, imaginary) interleaved in the last dimension: see dims()
            return T.TENSOR_FLOAT32, {}
        raise self._refuse(op, f"{where} has a type NNAPI has no operand for")

    def _refuse(self, op: Operator | None, message: str):
        if op is None:
            return invalid(f"{self.file.name}: subgraph {self.graph.index}: {message}")
        return self.fail(op, message)

    def _signature_static(self, tensor: Tensor) -> bool:
        """Whether the file gives ``tensor``'s shape: its signature has no
        unknown size, or, in the main graph, only the batch is unknown, which
        the input shapes the file records fix (as LiteRT fixes it at
        allocate_tensors). The second is how converters write batch-size
        models, but not a promise: a dimension 0 computed from data (frames
        of a signal) has a placeholder there, which shape inference finds
        out (see _infer)."""
        unknown = [d for d, s in enumerate(tensor.shape_signature) if s < 0] \
            if len(tensor.shape_signature) == len(tensor.shape) else []
        return not unknown or (self.is_main and unknown == [0])

    def static_shape(self, tensor: Tensor) -> bool:
        """Whether ``tensor``'s shape is known at import: inferred from the
        operations that compute it, or given by the file."""
        known = self.known.get(self.operands.get(tensor.index, -1)) \
            or self.hints.get(tensor.index)
        if known:
            return 0 not in known
        return self._signature_static(tensor)

    def dims(self, tensor: Tensor) -> tuple[int, ...]:
        """NNAPI dimensions: 0 where the size is only known at execution
        (inferred at import where the operations that compute the tensor
        allow it). A complex64 tensor is float32 with (real, imaginary)
        interleaved along its last dimension, which is twice as long:
        complex64's memory layout, and the com.nnrt.tflite extension's
        RFFT2D's."""
        known = self.known.get(self.operands.get(tensor.index, -1)) \
            or self.hints.get(tensor.index)
        if known:
            return known
        if self._signature_static(tensor):
            dims = tensor.shape
        else:
            dims = tuple(0 if s < 0 else d for d, s in zip(tensor.shape, tensor.shape_signature))
        if tensor.dtype == np.complex64 and dims:
            dims = dims[:-1] + (2 * dims[-1],)
        return dims

    def shape(self, t: int | Tensor) -> tuple[int, ...]:
        """The TFLite shape of tensor ``t`` as known at import (0 = unknown)."""
        tensor = t if isinstance(t, Tensor) else self.tensor(t)
        if tensor.index in self.values:
            return self.values[tensor.index].shape
        dims = self.dims(tensor)
        if tensor.dtype == np.complex64 and dims:
            return dims[:-1] + (dims[-1] // 2,)
        return dims

    def operand(self, t: int, op: Operator | None = None) -> int:
        """The operand of tensor ``t`` (a constant operand when its value is known)."""
        if t in self.operands:
            return self.operands[t]
        tensor = self.tensor(t)
        value = self.values.get(t)
        if value is None:
            raise self._refuse(op, f"tensor {t} ({tensor.name!r}) is read before it is written")
        kind, quant = self.operand_type(tensor, op)
        if value.dtype == np.int64:
            value = _to_int32(value, self._refuse(op, f"tensor {t} does not fit int32"))
        if value.dtype == np.complex64:
            value = np.ascontiguousarray(value).view(np.float32)  # interleaved pairs
        index = self.model.add_operand(kind, value.shape or (1,), **quant)
        value = np.ascontiguousarray(value).reshape(value.shape or (1,))
        self.model.set_operand_value(index, value)
        self.constants[index] = value
        self.operands[t] = index
        return index

    def output(self, t: int, op: Operator | None = None) -> int:
        """A new operand for tensor ``t`` written by an operation."""
        tensor = self.tensor(t)
        kind, quant = self.operand_type(tensor, op)
        index = self.model.add_operand(kind, self.dims(tensor), **quant)
        self.operands[t] = index
        self._tensor_of[index] = t
        return index

    def temp_like(self, t: int, dims: tuple[int, ...] | None = None, kind: T | None = None,
                  **quant) -> int:
        tensor = self.tensor(t)
        k, q = self.operand_type(tensor)
        return self.model.add_operand(kind or k, self.dims(tensor) if dims is None else dims,
                                      **(quant if kind else q))

    def const(self, value, kind: T, dims=None, **quant) -> int:
        value = np.asarray(value)
        index = self.model.add_operand(kind, value.shape if dims is None else dims, **quant)
        self.model.set_operand_value(index, value)
        self.constants[index] = value if value.ndim else value.item()
        return index

    def i32(self, v: int) -> int:
        return self.const(np.int32(v), T.INT32, ())

    def f32(self, v: float) -> int:
        return self.const(np.float32(v), T.FLOAT32, ())

    def boolean(self, v: bool) -> int:
        return self.const(np.bool_(v), T.BOOL, ())

    def i32_tensor(self, values) -> int:
        arr = np.asarray(values, np.int32).reshape(-1)
        return self.const(arr, T.TENSOR_INT32, (len(arr),))

    def omitted(self, kind: T = T.TENSOR_FLOAT32) -> int:
        index = self.model.add_operand(kind)
        self.model.set_operand_value(index, None)
        return index

    def emit(self, kind: Op, inputs: list[int], outputs: list[int]) -> None:
        self.model.add_operation(kind, inputs, outputs)
        self._infer(kind, inputs, outputs)

    def _infer(self, kind: Op, inputs: list[int], outputs: list[int]) -> None:
        """Infer the dimensions of an operation's outputs with the registry's
        shape function (as validation will), so that a later SHAPE folds and
        a handler sees real sizes where the file has placeholders. Control
        flow and operations the registry does not define keep what they
        declare; a malformed operation is reported when the model finishes."""
        if kind in (Op.IF, Op.WHILE) or not ops.has_definition(kind):
            return
        view = ops.OpView(self._building, None, Operation(kind, tuple(inputs), tuple(outputs)),
                          self.known)
        try:
            inferred = ops.definition(kind).shape(view)
        except (NnrtError, ValueError, TypeError, IndexError, KeyError, ZeroDivisionError):
            return
        for o, shape in zip(outputs, inferred):
            declared = self.model.operand(o).dimensions
            shape = tuple(shape)
            if declared and shape and (len(declared) != len(shape) or any(
                    d and s and d != s for d, s in zip(declared, shape))):
                # The file's shape was a placeholder: go on with the real
                # one and declare it when the import is redone.
                if o in self._tensor_of:
                    self.conflicts[self._tensor_of[o]] = shape
            elif declared and shape:
                shape = tuple(d or s for d, s in zip(declared, shape))
            elif not shape:
                shape = declared
            self.known[o] = shape

    def fused(self, op: Operator, out: int, key: str = "FusedActivationFunction") -> tuple[int, int]:
        """(NNAPI fuse code, operand the operation should write) for ``op``'s
        fused activation and output tensor ``out``."""
        code = int(op.options.get(key, 0) or 0)
        target = self.output(out, op)
        if code in (0, 1, 2, 3):
            return code, target
        if code == _FUSED_TANH:
            temp = self.temp_like(out)
            self._pending.append((Op.TANH, temp, target))
            return 0, temp
        raise self.fail(op, f"fused activation {code} has no NNAPI equivalent")

    def copy(self, src: int, tensor: Tensor) -> int:
        """A new operand equal to ``src`` (NNAPI refuses an operand that is both
        a model input and output, or a constant output)."""
        kind, quant = self.operand_type(tensor)
        dst = self.model.add_operand(kind, self.dims(tensor), **quant)
        self.identity(src, dst, kind, self.shape(tensor))
        return dst

    def identity(self, src: int, dst: int, kind: T, shape: tuple[int, ...]) -> None:
        """Emit ``dst = src`` reshaped to ``shape``. RESHAPE takes only float
        and quantized tensors; an int32 or bool value of one element is
        broadcast against a neutral constant instead (exact)."""
        if kind == T.TENSOR_INT32:
            if int(np.prod(shape)) != 1:
                raise invalid(f"{self.file.name}: subgraph {self.graph.index}: cannot reshape "
                              f"an int32 tensor of {int(np.prod(shape))} elements in NNAPI")
            zero = self.const(np.zeros(shape or (1,), np.int32), T.TENSOR_INT32)
            self.emit(Op.ADD, [src, zero, self.i32(0)], [dst])
        elif kind == T.TENSOR_BOOL8:
            if int(np.prod(shape)) != 1:
                raise invalid(f"{self.file.name}: subgraph {self.graph.index}: cannot reshape "
                              f"a bool tensor of {int(np.prod(shape))} elements in NNAPI")
            self.emit(Op.LOGICAL_OR, [src, self.const(np.zeros(shape or (1,), np.bool_),
                                                      T.TENSOR_BOOL8)], [dst])
        else:
            self.emit(Op.RESHAPE, [src, self.i32_tensor(shape or (1,))], [dst])

    # --- the graph -------------------------------------------------------------
    def lower(self, ops: list[Operator] | None = None, inputs: tuple[int, ...] | None = None,
              outputs: tuple[int, ...] | None = None) -> Model:
        g = self.graph
        inputs = g.inputs if inputs is None else inputs
        outputs = g.outputs if outputs is None else outputs
        in_operands = []
        for t in inputs:
            self.values.pop(t, None)
            in_operands.append(self.output(t))
        ops = g.operators if ops is None else ops
        self.assigned = _assigned_variables(ops)
        try:
            for op in ops:
                self.lower_operator(op)
        except NnrtError:
            if self.conflicts:   # perhaps a placeholder's doing: redo with real sizes first
                raise _Placeholders(self.conflicts) from None
            raise
        out_operands = []
        state_in = {s.input for s in self.states}
        for t in outputs:
            if t in self.values and t not in self.operands:
                self.operand(t)
            o = self.operands.get(t)
            if o is None:
                raise self._refuse(None, f"output tensor {t} ({self.tensor(t).name!r}) is "
                                         f"never written")
            if o in in_operands or o in state_in or o in out_operands or t in self.values:
                o = self.copy(o, self.tensor(t))
            out_operands.append(o)
        if self.conflicts:
            raise _Placeholders(self.conflicts)
        self.finish_variables(in_operands, out_operands)
        self.model.identify_inputs_and_outputs(
            in_operands + [s.input for s in self.states],
            out_operands + [s.output[1] for s in self.states])
        if self.is_main:
            self.model.set_metadata(self.metadata(inputs, outputs))
        return self.model.finish()

    def lower_operator(self, op: Operator) -> None:
        folded = _fold(self, op)
        if folded is not None:
            for t, v in zip(op.outputs, folded):
                self.values[t] = v
            return
        handler = _HANDLERS.get(op.name)
        if op.name not in _COMPLEX_HANDLERS and any(
                t >= 0 and self.tensor(t).dtype == np.complex64 for t in op.inputs):
            raise self.fail(op, f"reads a complex64 tensor; the importer takes complex "
                                f"tensors only into {', '.join(sorted(_COMPLEX_HANDLERS))}")
        if handler is None and op.name.startswith("CUSTOM:"):
            handler = _CUSTOM_HANDLERS.get(op.name[7:])
        if handler is None:
            if op.name.startswith("CUSTOM:"):
                raise self.fail(op, f"custom op {op.name[7:]!r} has no NNAPI operation and no "
                                    f"known vendor extension defines it (known custom ops: "
                                    f"{', '.join(sorted(_CUSTOM_HANDLERS))}); the model "
                                    f"cannot be imported")
            raise self.fail(op, "this TFLite operator has no NNAPI lowering")
        try:
            handler(self, op)
        except NnrtError as e:
            if e.message.startswith(self.file.name + ":"):
                raise
            raise self.fail(op, e.message) from None
        except (IndexError, ValueError, TypeError, KeyError, ZeroDivisionError) as e:
            # A handler reads inputs, options and shapes the file declares;
            # a file that declares them wrongly is malformed, not a bug here.
            raise self.fail(op, f"malformed operator ({type(e).__name__}: {e})") from None
        for kind, src, dst in self._pending:
            self.emit(kind, [src], [dst])
        self._pending.clear()

    def metadata(self, inputs, outputs) -> ModelMetadata:
        sig = next((s for s in self.file.signatures if s.subgraph == self.graph.index), None)

        def info(t: int, sig_names: dict, suffix: str = "") -> TensorInfo:
            tensor = self.tensor(t)
            q = tensor.quantization
            # What the model accepts: an unknown batch is fixed at import (see
            # static_shape), other unknown sizes stay unknown.
            shape = tuple(None if d == 0 else d for d in self.dims(tensor))
            # The dtype the compiled model takes and gives (int64 indices come
            # back as int32, NNAPI's only index type).
            dtype = self.operand_type(tensor)[0].dtype
            return TensorInfo(tensor.name + suffix, dtype, shape,
                              MetaQuant(q.scales, q.zero_points, q.dimension) if q else None,
                              sig_names.get(t))
        ins = [info(t, sig.inputs if sig else {}) for t in inputs]
        outs = [info(t, sig.outputs if sig else {}) for t in outputs]
        pairs = []
        for state in self.states:
            pairs.append((len(ins), len(outs)))
            described = info(state.tensor, {})
            if state.name is not None:
                described = replace(described, name=state.name)
            ins.append(described)
            outs.append(replace(described, name=described.name + ":next"))
        initial = tuple(None if s.initial is None else
                        s.initial.astype(ins[i].dtype).reshape(ins[i].shape)
                        for s, (i, _) in zip(self.states, pairs))
        return ModelMetadata(tuple(ins), tuple(outs), tuple(pairs),
                             sig.key if sig else None, self.file.name,
                             initial if any(v is not None for v in initial) else ())

    # --- resource variables ------------------------------------------------------
    def variable(self, op: Operator, handle: int) -> tuple[str, str]:
        """The variable a resource tensor ``handle`` (a VAR_HANDLE's output) names."""
        if handle not in self.handles:
            raise self.fail(op, f"tensor {handle} is not the output of a VAR_HANDLE of this "
                                f"subgraph")
        return self.handles[handle]

    def same_type(self, a: Tensor, b: Tensor) -> bool:
        """Whether values of tensors ``a`` and ``b`` are the same operand type,
        shape and quantization (a variable holds bytes; NNAPI a typed operand)."""
        return (self.operand_type(a) == self.operand_type(b)
                and tuple(a.shape) == tuple(b.shape))

    def finish_variables(self, in_operands: list[int], out_operands: list[int]) -> None:
        """Each variable's state output: the value it holds at the end."""
        taken = set(in_operands) | set(out_operands) | {s.input for s in self.states}
        for key, state in self.variable_states.items():
            t = self.current[key]
            read, last = self.tensor(state.tensor), self.tensor(t)
            if not self.same_type(read, last):
                raise self._refuse(None, f"variable {_variable_name(key)!r} is read as "
                                         f"{_describe(self, read)} but assigned "
                                         f"{_describe(self, last)}: NNAPI keeps a state of "
                                         f"one type")
            o = self.operand(t)
            if o in taken or t in self.values:   # a constant, an input, another output
                o = self.copy(o, read)
            taken.add(o)
            state.output = (t, o)

    def submodel(self, graph_index: int, op: Operator) -> int:
        """A SUBGRAPH operand referring to graph ``graph_index``, lowered once."""
        if not 0 <= graph_index < len(self.file.graphs) or graph_index == self.graph.index:
            raise self.fail(op, f"refers to subgraph {graph_index}, which is not a valid "
                                f"body (the file has {len(self.file.graphs)})")
        if graph_index not in self.referenced:
            self.referenced[graph_index] = None  # a cycle would come back here
            self.referenced[graph_index] = lower_graph(self.file, graph_index, self.referenced,
                                                       is_main=False)
        model = self.referenced[graph_index]
        if model is None:
            raise self.fail(op, f"subgraph {graph_index} refers to itself")
        index = self.model.add_operand(T.SUBGRAPH)
        self.model.set_operand_value_from_model(index, model)
        return index


class _Placeholders(Exception):
    """Tensors whose file shape is a placeholder, with their real NNAPI
    dimensions: the import is redone declaring them (:func:`lower_graph`)."""

    def __init__(self, dims: dict[int, tuple[int, ...]]):
        super().__init__(dims)
        self.dims = dims


def lower_graph(file: TfliteFile, graph_index: int, referenced: dict[int, Model], *,
                is_main: bool = True, operators: list[Operator] | None = None,
                inputs: tuple[int, ...] | None = None,
                outputs: tuple[int, ...] | None = None) -> Model:
    """Lower graph ``graph_index`` (``Lowering.lower``). A model whose file
    shapes are all true is lowered once; one with placeholders (BirdNET's
    frames) a second time, declaring the sizes the first pass inferred:
    NNAPI operands cannot change dimensions once added."""
    hints: dict[int, tuple[int, ...]] = {}
    for _ in range(3):
        try:
            return Lowering(file, graph_index, referenced, is_main=is_main,
                            hints=hints).lower(operators, inputs, outputs)
        except _Placeholders as e:
            hints.update(e.dims)
    raise invalid(f"{file.name}: subgraph {graph_index}: the shapes of its tensors do not "
                  f"settle (placeholders left after three passes)")


def _to_int32(value: np.ndarray, error) -> np.ndarray:
    if value.size and (value.min() < np.iinfo(np.int32).min or value.max() > np.iinfo(np.int32).max):
        raise error
    return value.astype(np.int32)


# --- constant folding -----------------------------------------------------------

def _strided_slice_numpy(x: np.ndarray, begin, end, strides, o: dict) -> np.ndarray:
    index = []
    shrink = []
    for d in range(x.ndim):
        if d >= len(begin):
            index.append(slice(None))
            continue
        b, e, s = int(begin[d]), int(end[d]), int(strides[d])
        if o.get("ShrinkAxisMask", 0) >> d & 1:
            index.append(b)
            shrink.append(d)
            continue
        index.append(slice(None if o.get("BeginMask", 0) >> d & 1 else b,
                           None if o.get("EndMask", 0) >> d & 1 else e, s))
    return np.asarray(x[tuple(index)])


def _fold(c: Lowering, op: Operator) -> list[np.ndarray] | None:
    """The outputs of ``op`` computed now when its inputs are known, else None."""
    name = op.name
    if name == "SHAPE":
        tensor = c.tensor(op.inputs[0])
        if not c.static_shape(tensor):
            return None
        dtype = np.int64 if op.options.get("OutType") == 4 else np.int32
        return [np.asarray(c.shape(tensor), dtype)]
    if name not in _FOLDERS:
        return None
    args = [c.value(t) for t in op.inputs]
    if any(a is None for t, a in zip(op.inputs, args) if t >= 0) or not args:
        return None
    try:
        result = _FOLDERS[name](c, op, args)
    except (IndexError, ValueError, TypeError, KeyError) as e:
        raise c.fail(op, f"malformed operator ({type(e).__name__}: {e})") from None
    if result is None:
        return None
    return [np.asarray(r).astype(c.tensor(t).dtype) for r, t in zip(result, op.outputs)]


def _fold_dequantize(c: Lowering, op: Operator, args):
    x = args[0]
    tensor = c.tensor(op.inputs[0])
    q = tensor.quantization
    if x.dtype == np.float16 or q is None:
        return [x.astype(np.float32)]
    scales = np.asarray(q.scales, np.float64)
    zps = np.asarray(q.zero_points, np.float64)
    if q.per_channel:
        shape = [1] * x.ndim
        shape[q.dimension] = -1
        scales, zps = scales.reshape(shape), zps.reshape(shape)
    # TFLite's reference: static_cast<float>(scale * (q - zero_point)) with a double scale.
    return [(scales * (x.astype(np.float64) - zps)).astype(np.float32)]


def _fold_int(fn):
    def fold(c, op, args):
        if any(a.dtype.kind not in "iu" for a in args) or op.options.get("FusedActivationFunction"):
            return None  # float arithmetic stays on the device
        return [fn(*args)]
    return fold


def _fold_strided_slice(c, op, args):
    o = op.options
    if o.get("EllipsisMask") or o.get("NewAxisMask") or o.get("Offset"):
        return None
    return [_strided_slice_numpy(args[0], args[1], args[2], args[3], o)]


def _fold_reshape(c, op, args):
    out = c.tensor(op.outputs[0])
    if op.name == "RESHAPE" and len(args) > 1 and args[1] is not None:
        # The shape input decides (the file's output shape may be a placeholder).
        return [args[0].reshape([int(v) for v in args[1].reshape(-1)])]
    if op.name == "EXPAND_DIMS":
        return [np.expand_dims(args[0], int(args[1].reshape(-1)[0]))]
    if op.name == "SQUEEZE":
        axes = op.options.get("SqueezeDims") or None
        return [np.squeeze(args[0], axis=tuple(axes) if axes else None)]
    if not c.static_shape(out):
        return None
    return [args[0].reshape(out.shape)]


def _fold_split_v(c, op, args):
    x, sizes, axis = args[0], [int(v) for v in args[1].reshape(-1)], int(args[2].reshape(-1)[0])
    if sizes.count(-1) == 1:
        sizes[sizes.index(-1)] = x.shape[axis] - (sum(sizes) + 1)
    return np.split(x, np.cumsum(sizes)[:-1], axis=axis)


def _fold_range(c, op, args):
    dtype = np.int32 if args[0].dtype.kind in "iu" else np.float32
    return [range_values(*args[:3], dtype, lambda m: c.fail(op, m))]


def _fold_int_reduce(fn):
    def fold(c, op, args):
        if args[0].dtype.kind not in "iu":
            return None
        axes = tuple(int(a) for a in args[1].reshape(-1))
        return [fn(args[0], axis=axes, keepdims=bool(op.options.get("KeepDims")))]
    return fold


_FOLDERS: dict[str, Callable] = {
    "DEQUANTIZE": _fold_dequantize,
    "DENSIFY": lambda c, op, a: [a[0]],
    "STRIDED_SLICE": _fold_strided_slice,
    "PACK": lambda c, op, a: [np.stack(a, axis=op.options.get("Axis", 0))],
    "UNPACK": lambda c, op, a: [np.take(a[0], i, axis=op.options.get("Axis", 0))
                                for i in range(a[0].shape[op.options.get("Axis", 0)])],
    "RESHAPE": _fold_reshape,
    "CONCATENATION": lambda c, op, a: None if op.options.get("FusedActivationFunction")
    else [np.concatenate(a, axis=op.options.get("Axis", 0))],
    "CAST": lambda c, op, a: [a[0].astype(c.tensor(op.outputs[0]).dtype)],
    "SQUEEZE": _fold_reshape,
    "EXPAND_DIMS": _fold_reshape,
    "GATHER": lambda c, op, a: [np.take(a[0], a[1], axis=op.options.get("Axis", 0))]
    if not op.options.get("BatchDims") else None,
    "ADD": _fold_int(np.add),
    "SUB": _fold_int(np.subtract),
    "MUL": _fold_int(np.multiply),
    "FLOOR_DIV": _fold_int(np.floor_divide),
    "MAXIMUM": _fold_int(np.maximum),
    "MINIMUM": _fold_int(np.minimum),
    "SPLIT_V": _fold_split_v,
    "RANGE": _fold_range,
    "REDUCE_PROD": _fold_int_reduce(np.prod),
    "SUM": _fold_int_reduce(np.sum),
}


# --- handlers ---------------------------------------------------------------------

def _bias(c: Lowering, op: Operator, b: int, x: int, w: int, units: int) -> int:
    """The bias operand of a convolution or fully-connected operation; a zero
    bias when the TFLite op has none (NNAPI's bias is not optional)."""
    x_t, w_t = c.tensor(x), c.tensor(w)
    x_kind, x_q = c.operand_type(x_t, op)
    if x_kind in (T.TENSOR_FLOAT32, T.TENSOR_FLOAT16):
        if b >= 0:
            return _input(c, op, b)
        return c.const(np.zeros(units, x_t.dtype), x_kind)
    w_kind, w_q = c.operand_type(w_t, op)
    # NNAPI requires bias scale = input scale x filter scale, which TFLite's
    # converter writes too (up to float rounding); per-channel biases carry 0.
    scale = 0.0 if w_kind == T.TENSOR_QUANT8_SYMM_PER_CHANNEL \
        else float(np.float32(x_q["scale"]) * np.float32(w_q["scale"]))
    value = c.value(b) if b >= 0 else np.zeros(units, np.int32)
    if value is None:
        raise c.fail(op, "a quantized bias must be constant")
    return c.const(value.astype(np.int32), T.TENSOR_INT32, scale=scale)


def _input(c: Lowering, op: Operator, t: int) -> int:
    if t < 0:
        raise c.fail(op, "a required input is missing")
    return c.operand(t, op)


def _conv_2d(c: Lowering, op: Operator) -> None:
    o = op.options
    x, w = op.inputs[0], op.inputs[1]
    b = op.inputs[2] if len(op.inputs) > 2 else -1
    units = c.tensor(w).shape[0]
    ins = [_input(c, op, x), _input(c, op, w), _bias(c, op, b, x, w, units),
           c.i32(_PADDING[o.get("Padding", 0)]), c.i32(o.get("StrideW", 1)),
           c.i32(o.get("StrideH", 1))]
    act, out = c.fused(op, op.outputs[0])
    ins.append(c.i32(act))
    if (o.get("DilationWFactor", 1), o.get("DilationHFactor", 1)) != (1, 1):
        ins += [c.boolean(False), c.i32(o["DilationWFactor"]), c.i32(o["DilationHFactor"])]
    c.emit(Op.CONV_2D, ins, [out])


def _depthwise_conv_2d(c: Lowering, op: Operator) -> None:
    o = op.options
    x, w = op.inputs[0], op.inputs[1]
    b = op.inputs[2] if len(op.inputs) > 2 else -1
    channels_in = c.tensor(x).shape[-1]
    units = c.tensor(w).shape[-1]
    # The option is unreliable in old files; the shapes decide (as TFLite does).
    multiplier = units // channels_in if channels_in else int(o.get("DepthMultiplier", 1))
    ins = [_input(c, op, x), _input(c, op, w), _bias(c, op, b, x, w, units),
           c.i32(_PADDING[o.get("Padding", 0)]), c.i32(o.get("StrideW", 1)),
           c.i32(o.get("StrideH", 1)), c.i32(multiplier)]
    act, out = c.fused(op, op.outputs[0])
    ins.append(c.i32(act))
    if (o.get("DilationWFactor", 1), o.get("DilationHFactor", 1)) != (1, 1):
        ins += [c.boolean(False), c.i32(o["DilationWFactor"]), c.i32(o["DilationHFactor"])]
    c.emit(Op.DEPTHWISE_CONV_2D, ins, [out])


def _fully_connected(c: Lowering, op: Operator) -> None:
    o = op.options
    if o.get("WeightsFormat", 0) != 0:
        raise c.fail(op, "shuffled weights have no NNAPI equivalent")
    x, w = op.inputs[0], op.inputs[1]
    b = op.inputs[2] if len(op.inputs) > 2 else -1
    x_t, w_t, out_t = c.tensor(x), c.tensor(w), c.tensor(op.outputs[0])
    x_kind, _ = c.operand_type(x_t, op)
    w_kind, _ = c.operand_type(w_t, op)
    if x_kind in (T.TENSOR_FLOAT32, T.TENSOR_FLOAT16) and w_t.dtype != x_t.dtype:
        raise c.fail(op, "hybrid (float input, quantized weights) FULLY_CONNECTED is not supported")
    units, depth = w_t.shape
    batch = int(np.prod(c.shape(x_t))) // depth if depth else 0
    flat_out = (batch, units)
    # The output is [batch, units], or with KeepNumDims the input's leading
    # dimensions and units.
    out_shape = (c.shape(x_t)[:-1] + (units,)) if o.get("KeepNumDims") else flat_out
    needs_reshape = out_shape != flat_out
    if w_kind == T.TENSOR_QUANT8_SYMM_PER_CHANNEL:
        # NNAPI's FULLY_CONNECTED has no per-channel weights; CONV_2D has:
        # [batch, depth] -> [batch, 1, 1, depth] (*) [units, 1, 1, depth].
        x4 = c.temp_like(x, (batch, 1, 1, depth))
        c.emit(Op.RESHAPE, [_input(c, op, x), c.i32_tensor((batch, 1, 1, depth))], [x4])
        w_q = w_t.quantization
        if c.value(w) is None:
            raise c.fail(op, "per-channel weights must be constant")
        w4 = c.const(c.value(w).reshape(units, 1, 1, depth), T.TENSOR_QUANT8_SYMM_PER_CHANNEL,
                     channel_quant=(0, w_q.scales))
        act, out = c.fused(op, op.outputs[0])
        y4 = c.temp_like(op.outputs[0], (batch, 1, 1, units))
        c.emit(Op.CONV_2D, [x4, w4, _bias(c, op, b, x, w, units), c.i32(2), c.i32(1), c.i32(1),
                            c.i32(act)], [y4])
        c.emit(Op.RESHAPE, [y4, c.i32_tensor(out_shape)], [out])
        return
    ins = [_input(c, op, x), _input(c, op, w), _bias(c, op, b, x, w, units)]
    act, out = c.fused(op, op.outputs[0])
    if needs_reshape:
        flat = c.temp_like(op.outputs[0], flat_out)
        c.emit(Op.FULLY_CONNECTED, ins + [c.i32(act)], [flat])
        c.emit(Op.RESHAPE, [flat, c.i32_tensor(out_shape)], [out])
    else:
        c.emit(Op.FULLY_CONNECTED, ins + [c.i32(act)], [out])


def _pool(kind: Op):
    def handler(c: Lowering, op: Operator) -> None:
        o = op.options
        ins = [_input(c, op, op.inputs[0]), c.i32(_PADDING[o.get("Padding", 0)]),
               c.i32(o.get("StrideW", 1)), c.i32(o.get("StrideH", 1)),
               c.i32(o.get("FilterWidth", 1)), c.i32(o.get("FilterHeight", 1))]
        act, out = c.fused(op, op.outputs[0])
        c.emit(kind, ins + [c.i32(act)], [out])
    return handler


def _binary_with_activation(kind: Op):
    def handler(c: Lowering, op: Operator) -> None:
        a, b = (_input(c, op, t) for t in op.inputs[:2])
        act, out = c.fused(op, op.outputs[0])
        c.emit(kind, [a, b, c.i32(act)], [out])
    return handler


def _floor_div(c: Lowering, op: Operator) -> None:
    """TFLite FLOOR_DIV: on int32 NNAPI's DIV already rounds toward negative
    infinity; on floats it is DIV then FLOOR (floor(x / y), the same IEEE
    division TFLite's kernel floors). Quantized FLOOR_DIV has no exact
    NNAPI form."""
    a, b = (_input(c, op, t) for t in op.inputs[:2])
    dtype = c.tensor(op.outputs[0]).dtype
    if dtype == np.int32:
        c.emit(Op.DIV, [a, b, c.i32(0)], [c.output(op.outputs[0], op)])
    elif dtype in (np.float32, np.float16):
        quotient = c.temp_like(op.outputs[0])
        c.emit(Op.DIV, [a, b, c.i32(0)], [quotient])
        c.emit(Op.FLOOR, [quotient], [c.output(op.outputs[0], op)])
    else:
        raise c.fail(op, f"FLOOR_DIV on {np.dtype(dtype).name} has no NNAPI form "
                         f"(int32, float32 and float16 only)")


def _plain(kind: Op, count: int | None = None):
    def handler(c: Lowering, op: Operator) -> None:
        ins = [_input(c, op, t) for t in (op.inputs if count is None else op.inputs[:count])]
        c.emit(kind, ins, [c.output(op.outputs[0], op)])
    return handler


_ACTIVATION_OPS = {1: Op.RELU, 2: Op.RELU1, 3: Op.RELU6, _FUSED_TANH: Op.TANH}


def _concat_int32(c: Lowering, op: Operator) -> None:
    """An int32 vector built from constants and one-element values (begin
    indices computed in a loop body): NNAPI's CONCATENATION takes no int32,
    so it is sum(value_k * one_hot_k) + constants — exact in int32."""
    out_t = c.tensor(op.outputs[0])
    if len(out_t.shape) != 1:
        raise c.fail(op, "int32 CONCATENATION is only supported for vectors")
    n = out_t.shape[0]
    base = np.zeros(n, np.int32)
    parts, offset = [], 0
    for t in op.inputs:
        tensor = c.tensor(t)
        size = int(np.prod(tensor.shape))
        v = c.value(t)
        if v is not None:
            base[offset:offset + size] = v.reshape(-1)
        elif size == 1:
            hot = np.zeros(n, np.int32)
            hot[offset] = 1
            parts.append((_input(c, op, t), hot))
        else:
            raise c.fail(op, "int32 CONCATENATION of a computed vector longer than one element "
                             "has no NNAPI equivalent")
        offset += size
    acc = c.const(base, T.TENSOR_INT32)
    for k, (value, hot) in enumerate(parts):
        scaled = c.model.add_operand(T.TENSOR_INT32, (n,))
        c.emit(Op.MUL, [value, c.const(hot, T.TENSOR_INT32), c.i32(0)], [scaled])
        last = k == len(parts) - 1
        total = c.output(op.outputs[0], op) if last else c.model.add_operand(T.TENSOR_INT32, (n,))
        c.emit(Op.ADD, [acc, scaled, c.i32(0)], [total])
        acc = total
    if not parts:
        c.identity(acc, c.output(op.outputs[0], op), T.TENSOR_INT32, out_t.shape)


def _concatenation(c: Lowering, op: Operator) -> None:
    if c.tensor(op.outputs[0]).dtype == np.int32:
        return _concat_int32(c, op)
    rank = len(c.tensor(op.outputs[0]).shape)
    axis = op.options.get("Axis", 0) % max(rank, 1)
    ins = [_input(c, op, t) for t in op.inputs] + [c.i32(axis)]
    code = int(op.options.get("FusedActivationFunction", 0) or 0)
    out = c.output(op.outputs[0], op)
    if code:
        if code not in _ACTIVATION_OPS:
            raise c.fail(op, f"fused activation {code} has no NNAPI equivalent")
        temp = c.temp_like(op.outputs[0])
        c.emit(Op.CONCATENATION, ins, [temp])
        c.emit(_ACTIVATION_OPS[code], [temp], [out])
    else:
        c.emit(Op.CONCATENATION, ins, [out])


def _reshape(c: Lowering, op: Operator) -> None:
    out_t = c.tensor(op.outputs[0])
    kind, _ = c.operand_type(out_t, op)
    if kind in (T.TENSOR_INT32, T.TENSOR_BOOL8):
        if not c.static_shape(out_t):
            raise c.fail(op, "an int32 or bool RESHAPE needs a static output shape")
        c.identity(_input(c, op, op.inputs[0]), c.output(op.outputs[0], op), kind, c.shape(out_t))
        return
    # The shape input, when known, decides (as in TFLite's kernel); the
    # output's file shape may be a placeholder.
    given = c.value(op.inputs[1]) if len(op.inputs) > 1 and op.inputs[1] >= 0 else None
    if given is not None and given.size:
        shape = c.i32_tensor(given)
    elif c.static_shape(out_t) and out_t.shape:
        shape = c.i32_tensor(c.shape(out_t))
    elif len(op.inputs) > 1 and op.inputs[1] >= 0 and given is None:
        shape = _input(c, op, op.inputs[1])
    elif op.options.get("NewShape"):
        shape = c.i32_tensor(op.options["NewShape"])
    else:
        shape = c.i32_tensor(out_t.shape or (1,))
    c.emit(Op.RESHAPE, [_input(c, op, op.inputs[0]), shape], [c.output(op.outputs[0], op)])


def _softmax(c: Lowering, op: Operator) -> None:
    c.emit(Op.SOFTMAX, [_input(c, op, op.inputs[0]), c.f32(op.options.get("Beta", 1.0))],
           [c.output(op.outputs[0], op)])


def _mean(c: Lowering, op: Operator) -> None:
    axes = c.value(op.inputs[1])
    if axes is None:
        raise c.fail(op, "the axes must be constant")
    c.emit(Op.MEAN, [_input(c, op, op.inputs[0]), c.i32_tensor(axes),
                     c.i32(1 if op.options.get("KeepDims") else 0)],
           [c.output(op.outputs[0], op)])


def _pad(c: Lowering, op: Operator) -> None:
    pads = c.value(op.inputs[1])
    pad_operand = c.const(np.asarray(pads, np.int32), T.TENSOR_INT32) if pads is not None \
        else _input(c, op, op.inputs[1])
    ins = [_input(c, op, op.inputs[0]), pad_operand]
    kind = Op.PAD
    if op.name == "PADV2" and len(op.inputs) > 2 and op.inputs[2] >= 0:
        value = c.value(op.inputs[2])
        if value is None:
            raise c.fail(op, "the pad value must be constant")
        x_kind, _ = c.operand_type(c.tensor(op.inputs[0]), op)
        if x_kind == T.TENSOR_FLOAT32:
            ins.append(c.f32(float(value.reshape(-1)[0])))
        elif x_kind == T.TENSOR_FLOAT16:
            ins.append(c.const(np.float16(value.reshape(-1)[0]), T.FLOAT16, ()))
        else:
            ins.append(c.i32(int(value.reshape(-1)[0])))
        kind = Op.PAD_V2
    c.emit(kind, ins, [c.output(op.outputs[0], op)])


def _mirror_pad(c: Lowering, op: Operator) -> None:
    mode = int(op.options.get("Mode", 0))
    if mode not in (0, 1):
        raise c.fail(op, f"mirror pad mode {mode} is neither REFLECT (0) nor SYMMETRIC (1)")
    pads = c.value(op.inputs[1])
    x_t = c.tensor(op.inputs[0])
    if pads is not None:
        pads = np.asarray(pads, np.int64).reshape(-1, 2)
        for axis, (d, (before, after)) in enumerate(zip(c.dims(x_t), pads)):
            limit = d - 1 if mode == 0 else d
            if d and max(before, after) > limit:
                raise c.fail(op, f"paddings {[int(before), int(after)]} of dimension {axis} "
                                 f"(size {d}) exceed {limit}, the most "
                                 f"{'REFLECT' if mode == 0 else 'SYMMETRIC'} mode can pad")
    pad_operand = c.const(pads.astype(np.int32), T.TENSOR_INT32) if pads is not None \
        else _input(c, op, op.inputs[1])
    c.emit(Op.MIRROR_PAD, [_input(c, op, op.inputs[0]), pad_operand, c.i32(mode)],
           [c.output(op.outputs[0], op)])


def _reverse_v2(c: Lowering, op: Operator) -> None:
    axes = _constant_input(c, op, 1, "axis").reshape(-1)
    rank = len(c.tensor(op.inputs[0]).shape)
    if not axes.size:
        raise c.fail(op, "REVERSE_V2 with no axis: NNAPI's REVERSE reverses exactly one")
    if any(not -rank <= int(a) < rank for a in axes):
        raise c.fail(op, f"axis {axes.tolist()} out of range for rank {rank}")
    norm = [int(a) % rank for a in axes]
    if len(set(norm)) != len(norm):
        raise c.fail(op, f"axis {axes.tolist()} names a dimension twice")
    # Reversing one axis after another is exact: each REVERSE only moves values.
    src = _input(c, op, op.inputs[0])
    for k, axis in enumerate(norm):
        last = k == len(norm) - 1
        dst = c.output(op.outputs[0], op) if last else c.temp_like(op.outputs[0])
        c.emit(Op.REVERSE, [src, c.i32_tensor([axis])], [dst])
        src = dst


def _resize(kind: Op):
    def handler(c: Lowering, op: Operator) -> None:
        out_t = c.tensor(op.outputs[0])
        size = c.value(op.inputs[1])
        h, w = (int(v) for v in size) if size is not None else out_t.shape[1:3]
        c.emit(kind, [_input(c, op, op.inputs[0]), c.i32(w), c.i32(h), c.boolean(False),
                      c.boolean(bool(op.options.get("AlignCorners"))),
                      c.boolean(bool(op.options.get("HalfPixelCenters")))],
               [c.output(op.outputs[0], op)])
    return handler


def _block(kind: Op):
    def handler(c: Lowering, op: Operator) -> None:
        c.emit(kind, [_input(c, op, op.inputs[0]), c.i32(op.options.get("BlockSize", 1))],
               [c.output(op.outputs[0], op)])
    return handler


def _dequantize(c: Lowering, op: Operator) -> None:
    x_t = c.tensor(op.inputs[0])
    kind = Op.CAST if x_t.dtype == np.float16 else Op.DEQUANTIZE
    c.emit(kind, [_input(c, op, op.inputs[0])], [c.output(op.outputs[0], op)])


def _quantize(c: Lowering, op: Operator) -> None:
    x = op.inputs[0]
    x_kind, _ = c.operand_type(c.tensor(x), op)
    src = _input(c, op, x)
    if x_kind not in (T.TENSOR_FLOAT32, T.TENSOR_FLOAT16):
        # Requantize (e.g. uint8 <-> int8): NNAPI's QUANTIZE takes only float
        # input. Equal scales (the converter's uint8 I/O) make it exact.
        real = c.temp_like(x, kind=T.TENSOR_FLOAT32)
        c.emit(Op.DEQUANTIZE, [src], [real])
        src = real
    c.emit(Op.QUANTIZE, [src], [c.output(op.outputs[0], op)])


def _cast(c: Lowering, op: Operator) -> None:
    c.emit(Op.CAST, [_input(c, op, op.inputs[0])], [c.output(op.outputs[0], op)])


def _strided_slice(c: Lowering, op: Operator) -> None:
    o = op.options
    if o.get("EllipsisMask") or o.get("NewAxisMask"):
        raise c.fail(op, "ellipsis and new-axis masks have no NNAPI equivalent")
    if o.get("Offset"):
        raise c.fail(op, "offset mode has no NNAPI equivalent")
    begin, end, strides = (c.value(t) for t in op.inputs[1:4])
    if begin is None or end is None or strides is None:
        raise c.fail(op, "begin, end and strides must be constant")
    x_t = c.tensor(op.inputs[0])
    begin, end = np.array(begin, np.int64), np.array(end, np.int64)
    shrink = int(o.get("ShrinkAxisMask", 0))
    for d in range(len(begin)):
        if shrink >> d & 1:
            # TFLite takes one element at begin and ignores end; NNAPI reads end.
            b = int(begin[d])
            if b < 0 and d < len(x_t.shape):
                b += c.shape(x_t)[d]
            begin[d], end[d] = b, b + 1
    c.emit(Op.STRIDED_SLICE, [_input(c, op, op.inputs[0]), c.i32_tensor(begin), c.i32_tensor(end),
                              c.i32_tensor(strides), c.i32(o.get("BeginMask", 0)),
                              c.i32(o.get("EndMask", 0)), c.i32(shrink)],
           [c.output(op.outputs[0], op)])


def _slice(c: Lowering, op: Operator) -> None:
    ins = [_input(c, op, op.inputs[0])]
    for t in op.inputs[1:3]:
        v = c.value(t)
        ins.append(c.i32_tensor(v) if v is not None else _input(c, op, t))
    c.emit(Op.SLICE, ins, [c.output(op.outputs[0], op)])


def _split(c: Lowering, op: Operator) -> None:
    axis = c.value(op.inputs[0])
    if axis is None:
        raise c.fail(op, "the axis must be constant")
    c.emit(Op.SPLIT, [_input(c, op, op.inputs[1]), c.i32(int(axis.reshape(-1)[0])),
                      c.i32(op.options.get("NumSplits", len(op.outputs)))],
           [c.output(t, op) for t in op.outputs])


def _unpack(c: Lowering, op: Operator) -> None:
    x_t = c.tensor(op.inputs[0])
    axis = op.options.get("Axis", 0) % len(x_t.shape)
    pieces = []
    for t in op.outputs:
        dims = list(c.dims(x_t))
        dims[axis] = 1
        pieces.append(c.temp_like(op.inputs[0], tuple(dims)))
    c.emit(Op.SPLIT, [_input(c, op, op.inputs[0]), c.i32(axis), c.i32(len(op.outputs))], pieces)
    for piece, t in zip(pieces, op.outputs):
        c.emit(Op.RESHAPE, [piece, c.i32_tensor(c.tensor(t).shape or (1,))], [c.output(t, op)])


def _pack(c: Lowering, op: Operator) -> None:
    out_t = c.tensor(op.outputs[0])
    axis = op.options.get("Axis", 0) % len(out_t.shape)
    q = out_t.quantization
    for t in op.inputs:
        tq = c.tensor(t).quantization
        if q is not None and (tq is None or (tq.scales, tq.zero_points) != (q.scales, q.zero_points)):
            # LiteRT refuses such a PACK too; NNAPI's PACK only moves values.
            raise c.fail(op, f"input tensor {t} is quantized unlike the output")
    c.emit(Op.PACK, [c.i32(axis)] + [_input(c, op, t) for t in op.inputs],
           [c.output(op.outputs[0], op)])


def _batch_matmul(c: Lowering, op: Operator) -> None:
    lhs_t, rhs_t, out_t = c.tensor(op.inputs[0]), c.tensor(op.inputs[1]), c.tensor(op.outputs[0])
    kinds = [c.operand_type(t, op)[0] for t in (lhs_t, rhs_t, out_t)]
    if kinds[0] != kinds[1]:
        raise c.fail(op, f"hybrid BATCH_MATMUL ({kinds[0].name} lhs, {kinds[1].name} rhs) "
                         f"quantizes its lhs at run time: NNAPI has no such operation")
    if kinds[0] not in (T.TENSOR_FLOAT32, T.TENSOR_FLOAT16, T.TENSOR_QUANT8_ASYMM_SIGNED) \
            or kinds[2] != kinds[0]:
        raise c.fail(op, f"BATCH_MATMUL of {kinds[0].name} giving {kinds[2].name}: NNAPI's "
                         f"takes float or per-tensor int8, giving the same type")
    rank = len(out_t.shape)
    if not 2 <= rank <= 4:
        raise c.fail(op, f"rank {rank}: NNAPI's BATCH_MATMUL takes ranks 2 to 4")
    batch = c.dims(out_t)[:-2]
    ins = [_batch_broadcast(c, op, t, batch) for t in op.inputs[:2]]
    o = op.options
    c.emit(Op.BATCH_MATMUL, ins + [c.boolean(bool(o.get("AdjX", False))),
                                   c.boolean(bool(o.get("AdjY", False)))],
           [c.output(op.outputs[0], op)])


def _batch_broadcast(c: Lowering, op: Operator, t: int, batch: tuple[int, ...]) -> int:
    """Input ``t`` of a BATCH_MATMUL with the batch dimensions ``batch`` of
    the output: leading 1s added (RESHAPE), dimensions of 1 repeated (TILE)."""
    tensor = c.tensor(t)
    dims = c.dims(tensor)
    own = (1,) * (len(batch) - len(dims[:-2])) + dims[:-2]
    if dims[:-2] == batch:
        return _input(c, op, t)
    if 0 in own or 0 in batch:
        raise c.fail(op, f"input tensor {t} has batch dimensions {list(dims[:-2])} against the "
                         f"output's {list(batch)}, not known at import: NNAPI does not "
                         f"broadcast them")
    src = _input(c, op, t)
    if len(own) + 2 != len(dims):
        shaped = c.temp_like(t, own + dims[-2:])
        c.emit(Op.RESHAPE, [src, c.i32_tensor(own + dims[-2:])], [shaped])
        if own == batch:
            return shaped
        src = shaped
    tiled = c.temp_like(t, batch + dims[-2:])
    multiples = [b // a for a, b in zip(own, batch)] + [1, 1]
    c.emit(Op.TILE, [src, c.i32_tensor(multiples)], [tiled])
    return tiled


def _gather(c: Lowering, op: Operator) -> None:
    if op.options.get("BatchDims"):
        raise c.fail(op, "batch_dims has no NNAPI equivalent")
    x, idx = op.inputs[0], op.inputs[1]
    axis = op.options.get("Axis", 0)
    indices = c.value(idx)
    # Indices keep their rank (NNAPI's GATHER gives rank n + k - 1 as TFLite's).
    idx_operand = c.const(np.asarray(indices, np.int32).reshape(indices.shape or (1,)),
                          T.TENSOR_INT32) if indices is not None else _input(c, op, idx)
    ins = [_input(c, op, x), c.i32(axis), idx_operand]
    out_t = c.tensor(op.outputs[0])
    if not c.tensor(idx).shape:
        # A scalar index drops the axis; NNAPI's [1] index keeps it: reshape.
        temp = c.temp_like(op.outputs[0], ())
        c.emit(Op.GATHER, ins, [temp])
        c.emit(Op.RESHAPE, [temp, c.i32_tensor(out_t.shape or (1,))],
               [c.output(op.outputs[0], op)])
    else:
        c.emit(Op.GATHER, ins, [c.output(op.outputs[0], op)])


def _squeeze(c: Lowering, op: Operator) -> None:
    dims = op.options.get("SqueezeDims") or []
    ins = [_input(c, op, op.inputs[0])]
    if dims:
        ins.append(c.i32_tensor(dims))
    c.emit(Op.SQUEEZE, ins, [c.output(op.outputs[0], op)])


def _expand_dims(c: Lowering, op: Operator) -> None:
    axis = c.value(op.inputs[1])
    if axis is None:
        raise c.fail(op, "the axis must be constant")
    c.emit(Op.EXPAND_DIMS, [_input(c, op, op.inputs[0]), c.i32(int(axis.reshape(-1)[0]))],
           [c.output(op.outputs[0], op)])


def _transpose(c: Lowering, op: Operator) -> None:
    perm = c.value(op.inputs[1])
    ins = [_input(c, op, op.inputs[0]),
           c.i32_tensor(perm) if perm is not None else _input(c, op, op.inputs[1])]
    c.emit(Op.TRANSPOSE, ins, [c.output(op.outputs[0], op)])


def _reduce(kind: Op):
    def handler(c: Lowering, op: Operator) -> None:
        axes = c.value(op.inputs[1])
        if axes is None:
            raise c.fail(op, "the axes must be constant")
        c.emit(kind, [_input(c, op, op.inputs[0]), c.i32_tensor(axes),
                      c.boolean(bool(op.options.get("KeepDims")))],
               [c.output(op.outputs[0], op)])
    return handler


def _lstm(c: Lowering, op: Operator) -> None:
    o = op.options
    ins = list(op.inputs) + [-1] * (24 - len(op.inputs))
    x_t = c.tensor(ins[0])
    if x_t.dtype != np.float32 or any(c.tensor(t).dtype != np.float32
                                      for t in ins[1:18] if t >= 0):
        raise c.fail(op, "only float32 LSTMs are supported (no hybrid or quantized weights)")
    if not c.is_main:
        raise c.fail(op, "a stateful LSTM inside a control-flow body is not supported")
    nn = [_input(c, op, ins[0])]
    for t in ins[1:18]:
        nn.append(c.operand(t, op) if t >= 0 else c.omitted())
    states = []
    for t in ins[18:20]:
        tensor = c.tensor(t)
        if t < 0 or not tensor.is_variable:
            raise c.fail(op, "the state inputs must be variable tensors")
        if t in c.operands:
            raise c.fail(op, f"variable tensor {t} is shared with another operator")
        state = c.output(t, op)  # a model input: the runtime feeds the last state
        c.states.append(_State(t, state))
        states.append(state)
    nn += states
    nn += [c.i32(o.get("FusedActivationFunction", 4)), c.f32(o.get("CellClip", 0.0)),
           c.f32(o.get("ProjClip", 0.0)), c.boolean(bool(o.get("TimeMajor", False)))]
    for t in ins[20:24]:
        nn.append(c.operand(t, op) if t >= 0 else c.omitted())
    state_outs = []
    for state, t in zip(c.states[-2:], ins[18:20]):
        nxt = c.temp_like(t)
        state.output = (t, nxt)
        state_outs.append(nxt)
    c.emit(Op.UNIDIRECTIONAL_SEQUENCE_LSTM, nn, [c.output(op.outputs[0], op)] + state_outs)


def _variable_key(op: Operator) -> tuple[str, str]:
    """The variable a VAR_HANDLE names: (container, shared name), as LiteRT keys it."""
    def text(v) -> str:
        return v.decode() if isinstance(v, bytes) else str(v or "")
    return text(op.options.get("Container")), text(op.options.get("SharedName"))


def _variable_name(key: tuple[str, str]) -> str:
    container, name = key
    return f"{container}/{name}" if container else name


def _describe(c: Lowering, tensor: Tensor) -> str:
    kind, quant = c.operand_type(tensor)
    return f"{kind.name} {list(tensor.shape)}" + (f" {quant}" if quant else "")


def _assigned_variables(ops: list[Operator]) -> set[tuple[str, str]]:
    """The variables ``ops`` assign (a variable never assigned is a constant)."""
    handles = {op.outputs[0]: _variable_key(op) for op in ops
               if op.name == "VAR_HANDLE" and op.outputs}
    return {handles[op.inputs[0]] for op in ops
            if op.name == "ASSIGN_VARIABLE" and op.inputs and op.inputs[0] in handles}


def _var_handle(c: Lowering, op: Operator) -> None:
    if not c.is_main:
        raise c.fail(op, "resource variables inside a control-flow body are not supported")
    c.handles[op.outputs[0]] = _variable_key(op)


def _read_variable(c: Lowering, op: Operator) -> None:
    key = c.variable(op, op.inputs[0])
    out = op.outputs[0]
    out_t = c.tensor(out)
    name = _variable_name(key)
    if key in c.current:   # assigned, or read as a state, earlier in this invoke
        src = c.current[key]
        if not c.same_type(c.tensor(src), out_t):
            raise c.fail(op, f"variable {name!r} holds {_describe(c, c.tensor(src))} but is "
                             f"read as {_describe(c, out_t)}")
        if src in c.values:
            c.values[out] = c.values[src]
        else:
            c.operands[out] = c.operand(src, op)
        return
    initial = c.initial.get(key)
    if initial is None:
        raise c.fail(op, f"variable {name!r} is read before any value is assigned to it "
                         f"(no CALL_ONCE init subgraph before this operator assigns it)")
    if initial.dtype != out_t.dtype or tuple(initial.shape) != tuple(out_t.shape):
        raise c.fail(op, f"variable {name!r} starts as {initial.dtype} {list(initial.shape)} "
                         f"(its init subgraph) but is read as {out_t.type_name} "
                         f"{list(out_t.shape)}")
    c.operand_type(out_t, op)   # a type NNAPI has an operand for
    c.current[key] = out
    if key not in c.assigned:   # it keeps its initial value for ever
        c.values[out] = initial
        return
    if not c.static_shape(out_t):
        raise c.fail(op, f"variable {name!r} is read with unknown dimensions "
                         f"{list(out_t.shape_signature)}")
    state = _State(out, c.output(out, op), name=name, initial=initial)
    c.states.append(state)
    c.variable_states[key] = state


def _assign_variable(c: Lowering, op: Operator) -> None:
    key = c.variable(op, op.inputs[0])
    value = op.inputs[1]
    if value not in c.values:
        _input(c, op, value)   # refuses a value read before it is written
    c.current[key] = value


def _call_once(c: Lowering, op: Operator) -> None:
    """Runs the init subgraph once, as LiteRT does at the first invoke: here,
    at import, its assigned values becoming the variables' initial values."""
    if not c.is_main:
        raise c.fail(op, "CALL_ONCE inside a control-flow body is not supported")
    index = op.options.get("InitSubgraphIndex", -1)
    if not 0 <= index < len(c.file.graphs) or index == c.graph.index:
        raise c.fail(op, f"init subgraph {index} is not a subgraph it can run (the file has "
                         f"{len(c.file.graphs)})")
    if index not in c.initialized:
        c.initialized.add(index)
        c.initial.update(_evaluate_init(c, op, index))


def _evaluate_init(c: Lowering, op: Operator, index: int) -> dict[tuple[str, str], np.ndarray]:
    """The values init subgraph ``index`` assigns to variables, computed at
    import: every operator must be a variable access or fold to constants."""
    graph = c.file.graphs[index]
    if graph.inputs or graph.outputs:
        raise c.fail(op, f"init subgraph {index} has inputs or outputs (LiteRT's take none)")
    init = Lowering(c.file, index, c.referenced, is_main=False)
    handles: dict[int, tuple[str, str]] = {}
    assigned: dict[tuple[str, str], np.ndarray] = {}

    def not_evaluable(inner: Operator, why: str):
        return c.fail(op, f"init subgraph {index} is not evaluable at import: its operator "
                          f"{inner.index} ({inner.name}) {why}")
    for inner in graph.operators:
        if inner.name == "VAR_HANDLE":
            handles[inner.outputs[0]] = _variable_key(inner)
        elif inner.name in ("ASSIGN_VARIABLE", "READ_VARIABLE"):
            if not inner.inputs or inner.inputs[0] not in handles:
                raise not_evaluable(inner, "names no VAR_HANDLE of that subgraph")
            key = handles[inner.inputs[0]]
            if inner.name == "ASSIGN_VARIABLE":
                value = init.value(inner.inputs[1]) if len(inner.inputs) > 1 else None
                if value is None:
                    raise not_evaluable(inner, "assigns a value computed at run time")
                assigned[key] = np.array(value, copy=True)
            else:
                known = assigned.get(key, c.initial.get(key))
                if known is None:
                    raise not_evaluable(inner, f"reads variable {_variable_name(key)!r} "
                                               f"before it is assigned")
                init.values[inner.outputs[0]] = known
        else:
            folded = _fold(init, inner)
            if folded is None:
                raise not_evaluable(inner, "is not a constant computation")
            for t, v in zip(inner.outputs, folded):
                init.values[t] = v
    return assigned


def _while(c: Lowering, op: Operator) -> None:
    cond = c.submodel(op.options.get("CondSubgraphIndex", -1), op)
    body = c.submodel(op.options.get("BodySubgraphIndex", -1), op)
    c.emit(Op.WHILE, [cond, body] + [_input(c, op, t) for t in op.inputs],
           [c.output(t, op) for t in op.outputs])


def _if(c: Lowering, op: Operator) -> None:
    then = c.submodel(op.options.get("ThenSubgraphIndex", -1), op)
    other = c.submodel(op.options.get("ElseSubgraphIndex", -1), op)
    cond = _input(c, op, op.inputs[0])
    c.emit(Op.IF, [cond, then, other] + [_input(c, op, t) for t in op.inputs[1:]],
           [c.output(t, op) for t in op.outputs])


def _constant_input(c: Lowering, op: Operator, k: int, what: str) -> np.ndarray:
    value = c.value(op.inputs[k]) if k < len(op.inputs) else None
    if value is None:
        raise c.fail(op, f"the {what} must be constant")
    return value


def _transpose_conv(c: Lowering, op: Operator) -> None:
    # TFLite: (output_shape, weights [O, H, W, I], input[, bias]); NNAPI:
    # (input, filter [O, H, W, I], bias, output_shape, padding, strides, act, layout).
    o = op.options
    shape = _constant_input(c, op, 0, "output shape")
    w, x = op.inputs[1], op.inputs[2]
    b = op.inputs[3] if len(op.inputs) > 3 else -1
    units = c.tensor(w).shape[0]
    ins = [_input(c, op, x), _input(c, op, w), _bias(c, op, b, x, w, units), c.i32_tensor(shape),
           c.i32(_PADDING[o.get("Padding", 0)]), c.i32(o.get("StrideW", 1)),
           c.i32(o.get("StrideH", 1))]
    act, out = c.fused(op, op.outputs[0])
    c.emit(Op.TRANSPOSE_CONV_2D, ins + [c.i32(act), c.boolean(False)], [out])


def _mediapipe_transpose_conv_bias(c: Lowering, op: Operator) -> None:
    # mediapipe's Convolution2DTransposeBias: (input, weights [O, H, W, I], bias),
    # its custom options the raw TfLiteTransposeConvParams, which the
    # com.nnrt.mediapipe operation takes as its extension parameters operand.
    if len(op.inputs) != 3 or len(op.outputs) != 1:
        raise c.fail(op, f"takes 3 inputs and 1 output, has {len(op.inputs)} and "
                         f"{len(op.outputs)}")
    raw = op.custom_options
    if len(raw) != _mediapipe.PARAMS_FORMAT.size:
        raise c.fail(op, f"custom options of {len(raw)} bytes; TfLiteTransposeConvParams "
                         f"takes {_mediapipe.PARAMS_FORMAT.size}")
    params_type = c.model.get_extension_operand_type(_mediapipe.NAME,
                                                     _mediapipe.TRANSPOSE_CONV_PARAMS)
    params = c.model.add_operand(params_type)
    c.model.set_operand_value(params, bytes(raw))
    ins = [_input(c, op, t) for t in op.inputs] + [params]
    kind = c.model.get_extension_operation_type(_mediapipe.NAME,
                                                _mediapipe.CONVOLUTION_2D_TRANSPOSE_BIAS)
    c.emit(kind, ins, [c.output(op.outputs[0], op)])


_KIND_NAMES = {int: "an int", float: "a number", list: "a vector of ints"}


def _custom_options(c: Lowering, op: Operator, keys: dict[str, type]) -> dict:
    """The flexbuffer map of ``op``'s custom options, as mediapipe's parsers
    read it: each of ``keys`` present, an int (``int``), a number
    (``float``) or a vector of ints (``list``); other keys are ignored."""
    try:
        options = flexbuffers.Loads(op.custom_options)
    except (IndexError, ValueError, TypeError, KeyError, struct.error, RecursionError,
            OverflowError, MemoryError, AssertionError) as e:
        # What flexbuffers raises on bytes that are not a flexbuffer (it
        # checks some type tags with assert), found by mutating real options.
        raise c.fail(op, f"custom options are not a flexbuffer ({type(e).__name__}: {e})") \
            from None
    if not isinstance(options, dict):
        raise c.fail(op, "custom options are not a flexbuffer map")
    found = {}
    for key, kind in keys.items():
        value = options.get(key)
        items = value if kind is list and isinstance(value, list) else [value]
        if value is None or not all(isinstance(v, (float, int) if kind is float else int)
                                    and not isinstance(v, bool) for v in items):
            raise c.fail(op, f"custom option {key!r} must be {_KIND_NAMES[kind]}, "
                             f"got {value!r}")
        if kind is not float and not all(-2**31 <= v < 2**31 for v in items):
            raise c.fail(op, f"custom option {key!r} does not fit int32: {value!r}")
        found[key] = value
    return found


def _mediapipe_version_2(c: Lowering, op: Operator) -> None:
    """Version 1 of the landmark ops reads other options and computes otherwise."""
    if op.version != 2:
        raise c.fail(op, f"is version {op.version}; com.nnrt.mediapipe implements version 2, "
                         f"the one mediapipe's op resolvers register")


def _mediapipe_op(c: Lowering, op: Operator, type_within: int, inputs: int,
                  params: list[int]) -> None:
    """Emit ``op`` as operation ``type_within`` of com.nnrt.mediapipe: its
    ``inputs`` tensors, then the ``params`` operands, one output."""
    if len(op.inputs) != inputs or len(op.outputs) != 1:
        raise c.fail(op, f"takes {inputs} inputs and 1 output, has {len(op.inputs)} and "
                         f"{len(op.outputs)}")
    kind = c.model.get_extension_operation_type(_mediapipe.NAME, type_within)
    c.emit(kind, [_input(c, op, t) for t in op.inputs] + params, [c.output(op.outputs[0], op)])


def _mediapipe_landmarks_to_transform_matrix(c: Lowering, op: Operator) -> None:
    # Version 2 reads subset_idxs, left/right_rotation_idx, target_rotation_radians,
    # output_height/width and scale_x/y from its flexbuffer options.
    _mediapipe_version_2(c, op)
    o = _custom_options(c, op, {"subset_idxs": list, "left_rotation_idx": int,
                                "right_rotation_idx": int, "target_rotation_radians": float,
                                "output_height": int, "output_width": int, "scale_x": float,
                                "scale_y": float})
    if not o["subset_idxs"]:
        raise c.fail(op, "custom option 'subset_idxs' names no landmark")
    _mediapipe_op(c, op, _mediapipe.LANDMARKS_TO_TRANSFORM_MATRIX, 1, [
        c.i32_tensor(o["subset_idxs"]), c.i32(o["left_rotation_idx"]),
        c.i32(o["right_rotation_idx"]), c.f32(o["target_rotation_radians"]),
        c.i32(o["output_height"]), c.i32(o["output_width"]), c.f32(o["scale_x"]),
        c.f32(o["scale_y"])])


def _mediapipe_transform_tensor_bilinear(c: Lowering, op: Operator) -> None:
    # Version 2 (align corners) reads output_height and output_width.
    _mediapipe_version_2(c, op)
    o = _custom_options(c, op, {"output_height": int, "output_width": int})
    _mediapipe_op(c, op, _mediapipe.TRANSFORM_TENSOR_BILINEAR, 2,
                  [c.i32(o["output_height"]), c.i32(o["output_width"])])


def _mediapipe_transform_landmarks(c: Lowering, op: Operator) -> None:
    # Version 2 has no options: the landmarks' last dimension says 2D or 3D.
    _mediapipe_version_2(c, op)
    _mediapipe_op(c, op, _mediapipe.TRANSFORM_LANDMARKS, 2, [])


# TFLite custom codes a known vendor extension defines.
_CUSTOM_HANDLERS: dict[str, Callable[[Lowering, Operator], None]] = {
    "Convolution2DTransposeBias": _mediapipe_transpose_conv_bias,
    "Landmarks2TransformMatrix": _mediapipe_landmarks_to_transform_matrix,
    "TransformTensorBilinear": _mediapipe_transform_tensor_bilinear,
    "TransformLandmarks": _mediapipe_transform_landmarks,
}
assert _CUSTOM_HANDLERS.keys() == _mediapipe.CUSTOM_OPS.keys()


def _space_to_batch(c: Lowering, op: Operator) -> None:
    block = _constant_input(c, op, 1, "block shape")
    pads = _constant_input(c, op, 2, "paddings")
    c.emit(Op.SPACE_TO_BATCH_ND, [_input(c, op, op.inputs[0]), c.i32_tensor(block),
                                  c.const(np.asarray(pads, np.int32), T.TENSOR_INT32)],
           [c.output(op.outputs[0], op)])


def _batch_to_space(c: Lowering, op: Operator) -> None:
    block = _constant_input(c, op, 1, "block shape")
    crops = _constant_input(c, op, 2, "crops")
    if np.any(crops):
        raise c.fail(op, "non-zero crops have no NNAPI equivalent")
    c.emit(Op.BATCH_TO_SPACE_ND, [_input(c, op, op.inputs[0]), c.i32_tensor(block)],
           [c.output(op.outputs[0], op)])


def _log_softmax(c: Lowering, op: Operator) -> None:
    c.emit(Op.LOG_SOFTMAX, [_input(c, op, op.inputs[0]), c.f32(1.0), c.i32(-1)],
           [c.output(op.outputs[0], op)])


def _lrn(c: Lowering, op: Operator) -> None:
    o = op.options
    c.emit(Op.LOCAL_RESPONSE_NORMALIZATION,
           [_input(c, op, op.inputs[0]), c.i32(o.get("Radius", 5)), c.f32(o.get("Bias", 1.0)),
            c.f32(o.get("Alpha", 1.0)), c.f32(o.get("Beta", 0.5))],
           [c.output(op.outputs[0], op)])


def _split_v(c: Lowering, op: Operator) -> None:
    # NNAPI's SPLIT cuts equal parts only: one SLICE per output.
    sizes = [int(v) for v in _constant_input(c, op, 1, "split sizes").reshape(-1)]
    x_t = c.tensor(op.inputs[0])
    axis = int(_constant_input(c, op, 2, "axis").reshape(-1)[0]) % len(x_t.shape)
    if sizes.count(-1) == 1:
        sizes[sizes.index(-1)] = c.shape(x_t)[axis] - (sum(sizes) + 1)
    x = _input(c, op, op.inputs[0])
    start = 0
    for size, t in zip(sizes, op.outputs):
        begin = [0] * len(x_t.shape)
        begin[axis] = start
        extent = [-1] * len(x_t.shape)
        extent[axis] = size
        c.emit(Op.SLICE, [x, c.i32_tensor(begin), c.i32_tensor(extent)], [c.output(t, op)])
        start += size


def _leaky_relu(c: Lowering, op: Operator) -> None:
    x_t = c.tensor(op.inputs[0])
    if x_t.dtype != np.float32:
        raise c.fail(op, "only float32 LEAKY_RELU is supported")
    alpha = c.const(np.array([op.options.get("Alpha", 0.2)], np.float32), T.TENSOR_FLOAT32)
    c.emit(Op.PRELU, [_input(c, op, op.inputs[0]), alpha], [c.output(op.outputs[0], op)])


def _squared_difference(c: Lowering, op: Operator) -> None:
    if c.tensor(op.inputs[0]).dtype != np.float32:
        raise c.fail(op, "only float32 SQUARED_DIFFERENCE is supported")
    diff = c.temp_like(op.outputs[0])
    c.emit(Op.SUB, [_input(c, op, op.inputs[0]), _input(c, op, op.inputs[1]), c.i32(0)], [diff])
    c.emit(Op.MUL, [diff, diff, c.i32(0)], [c.output(op.outputs[0], op)])


def _arg(kind: Op):
    def handler(c: Lowering, op: Operator) -> None:
        axis = int(_constant_input(c, op, 1, "axis").reshape(-1)[0])
        c.emit(kind, [_input(c, op, op.inputs[0]), c.i32(axis)], [c.output(op.outputs[0], op)])
    return handler


def _topk(c: Lowering, op: Operator) -> None:
    k = int(_constant_input(c, op, 1, "k").reshape(-1)[0])
    c.emit(Op.TOPK_V2, [_input(c, op, op.inputs[0]), c.i32(k)],
           [c.output(t, op) for t in op.outputs[:2]])


def _tile(c: Lowering, op: Operator) -> None:
    multiples = _constant_input(c, op, 1, "multiples")
    c.emit(Op.TILE, [_input(c, op, op.inputs[0]), c.i32_tensor(multiples)],
           [c.output(op.outputs[0], op)])


# --- TFLite builtins without an NNAPI twin: the com.nnrt.tflite extension ------------

def _extension_op(c: Lowering, within: int):
    return c.model.get_extension_operation_type(_tflite_ext.NAME, within)


def _range(c: Lowering, op: Operator) -> None:
    """A RANGE whose ends are known only when it runs (a constant one is
    folded): the extension's RANGE, its length a dynamic output shape."""
    ins = [_input(c, op, t) for t in op.inputs[:3]]
    c.emit(_extension_op(c, _tflite_ext.RANGE), ins, [c.output(op.outputs[0], op)])


def _rfft2d(c: Lowering, op: Operator) -> None:
    length = _constant_input(c, op, 1, "fft_length").reshape(-1)
    if length.size != 2 or any(n < 1 or int(n) & (int(n) - 1) for n in length):
        raise c.fail(op, f"fft_length {length.tolist()} must be two powers of two")
    c.emit(_extension_op(c, _tflite_ext.RFFT2D),
           [_input(c, op, op.inputs[0]), c.i32_tensor(length)], [c.output(op.outputs[0], op)])


def _complex_part(c: Lowering, op: Operator, part: int, target: int | None = None) -> int:
    """Part 0 (real) or 1 (imaginary) of a complex tensor: every other value
    of the last dimension from ``part`` on, a STRIDED_SLICE with stride 2;
    masks keep the other dimensions whole and the last to its end, so sizes
    unknown at import need not be known."""
    rank = len(c.tensor(op.inputs[0]).shape)
    if not rank:
        raise c.fail(op, "a complex scalar has no NNAPI form")
    begin = [0] * (rank - 1) + [part]
    out = c.output(op.outputs[0], op) if target is None else target
    c.emit(Op.STRIDED_SLICE, [_input(c, op, op.inputs[0]), c.i32_tensor(begin),
                              c.i32_tensor([0] * rank), c.i32_tensor([1] * (rank - 1) + [2]),
                              c.i32((1 << (rank - 1)) - 1), c.i32((1 << rank) - 1), c.i32(0)],
           [out])
    return out


def _real(c: Lowering, op: Operator) -> None:
    _complex_part(c, op, 0)


def _imag(c: Lowering, op: Operator) -> None:
    _complex_part(c, op, 1)


def _complex_abs(c: Lowering, op: Operator) -> None:
    """|z| as sqrt(re * re + im * im) (TFLite calls std::abs, a hypot: the
    two round differently in the last bit, and this one overflows past
    1.8e19 where hypot does not)."""
    parts = []
    for part in (0, 1):
        value = _complex_part(c, op, part, c.temp_like(op.outputs[0]))
        square = c.temp_like(op.outputs[0])
        c.emit(Op.MUL, [value, value, c.i32(0)], [square])
        parts.append(square)
    total = c.temp_like(op.outputs[0])
    c.emit(Op.ADD, [*parts, c.i32(0)], [total])
    c.emit(Op.SQRT, [total], [c.output(op.outputs[0], op)])


def _cast_complex(c: Lowering, op: Operator) -> None:
    """CAST of a complex64 tensor to float32 keeps the real part, as
    TFLite's kernel does; other casts are NNAPI's CAST."""
    x_t, out_t = c.tensor(op.inputs[0]), c.tensor(op.outputs[0])
    if x_t.dtype != np.complex64:
        return _cast(c, op)
    if out_t.dtype != np.float32:
        raise c.fail(op, f"CAST from complex64 to {out_t.type_name}: only to FLOAT32 (the "
                         f"real part)")
    _complex_part(c, op, 0)


def _squeeze_any(c: Lowering, op: Operator) -> None:
    """SQUEEZE; a complex tensor keeps its rank (pairs interleaved in the
    last dimension), so the axes are the file's, but its last dimension
    holds two values per element and cannot be squeezed."""
    x_t = c.tensor(op.inputs[0])
    if x_t.dtype != np.complex64:
        return _squeeze(c, op)
    rank = len(x_t.shape)
    axes = op.options.get("SqueezeDims") or []
    if not axes:
        if not c.static_shape(x_t):
            raise c.fail(op, "SQUEEZE of every dimension of 1 needs the input's shape at import")
        axes = [d for d, n in enumerate(c.shape(x_t)) if n == 1]
    axes = [int(a) % rank for a in axes]
    if rank - 1 in axes:
        raise c.fail(op, "SQUEEZE of the last dimension of a complex tensor: its values are "
                         "interleaved (real, imaginary) pairs there")
    c.emit(Op.SQUEEZE, [_input(c, op, op.inputs[0]), c.i32_tensor(axes)],
           [c.output(op.outputs[0], op)])


# Operators that take complex64 tensors (pairs interleaved in the last dimension).
_COMPLEX_HANDLERS: dict[str, Callable[[Lowering, Operator], None]] = {
    "RFFT2D": _rfft2d,
    "REAL": _real,
    "IMAG": _imag,
    "COMPLEX_ABS": _complex_abs,
    "CAST": _cast_complex,
    "SQUEEZE": _squeeze_any,
}


_HANDLERS: dict[str, Callable[[Lowering, Operator], None]] = {
    "ADD": _binary_with_activation(Op.ADD),
    "SUB": _binary_with_activation(Op.SUB),
    "MUL": _binary_with_activation(Op.MUL),
    "DIV": _binary_with_activation(Op.DIV),
    "FLOOR_DIV": _floor_div,
    "AVERAGE_POOL_2D": _pool(Op.AVERAGE_POOL_2D),
    "MAX_POOL_2D": _pool(Op.MAX_POOL_2D),
    "L2_POOL_2D": _pool(Op.L2_POOL_2D),
    "CONV_2D": _conv_2d,
    "DEPTHWISE_CONV_2D": _depthwise_conv_2d,
    "FULLY_CONNECTED": _fully_connected,
    "CONCATENATION": _concatenation,
    "RESHAPE": _reshape,
    "SOFTMAX": _softmax,
    "MEAN": _mean,
    "SUM": _reduce(Op.REDUCE_SUM),
    "REDUCE_MAX": _reduce(Op.REDUCE_MAX),
    "REDUCE_MIN": _reduce(Op.REDUCE_MIN),
    "REDUCE_PROD": _reduce(Op.REDUCE_PROD),
    "REDUCE_ANY": _reduce(Op.REDUCE_ANY),
    "TRANSPOSE_CONV": _transpose_conv,
    "SPACE_TO_BATCH_ND": _space_to_batch,
    "BATCH_TO_SPACE_ND": _batch_to_space,
    "LOG_SOFTMAX": _log_softmax,
    "LOCAL_RESPONSE_NORMALIZATION": _lrn,
    "SPLIT_V": _split_v,
    "LEAKY_RELU": _leaky_relu,
    "SQUARED_DIFFERENCE": _squared_difference,
    "ARG_MAX": _arg(Op.ARGMAX),
    "ARG_MIN": _arg(Op.ARGMIN),
    "TOPK_V2": _topk,
    "TILE": _tile,
    "EMBEDDING_LOOKUP": _plain(Op.EMBEDDING_LOOKUP, 2),
    "PAD": _pad,
    "PADV2": _pad,
    "MIRROR_PAD": _mirror_pad,
    "REVERSE_V2": _reverse_v2,
    "RESIZE_BILINEAR": _resize(Op.RESIZE_BILINEAR),
    "RESIZE_NEAREST_NEIGHBOR": _resize(Op.RESIZE_NEAREST_NEIGHBOR),
    "DEPTH_TO_SPACE": _block(Op.DEPTH_TO_SPACE),
    "SPACE_TO_DEPTH": _block(Op.SPACE_TO_DEPTH),
    "DEQUANTIZE": _dequantize,
    "QUANTIZE": _quantize,
    "STRIDED_SLICE": _strided_slice,
    "SLICE": _slice,
    "SPLIT": _split,
    "UNPACK": _unpack,
    "PACK": _pack,
    "BATCH_MATMUL": _batch_matmul,
    "GATHER": _gather,
    "EXPAND_DIMS": _expand_dims,
    "TRANSPOSE": _transpose,
    "UNIDIRECTIONAL_SEQUENCE_LSTM": _lstm,
    "RANGE": _range,
    **_COMPLEX_HANDLERS,
    "WHILE": _while,
    "IF": _if,
    "VAR_HANDLE": _var_handle,
    "READ_VARIABLE": _read_variable,
    "ASSIGN_VARIABLE": _assign_variable,
    "CALL_ONCE": _call_once,
    "PRELU": _plain(Op.PRELU, 2),
    "MAXIMUM": _plain(Op.MAXIMUM, 2),
    "MINIMUM": _plain(Op.MINIMUM, 2),
    "LESS": _plain(Op.LESS, 2),
    "LESS_EQUAL": _plain(Op.LESS_EQUAL, 2),
    "GREATER": _plain(Op.GREATER, 2),
    "GREATER_EQUAL": _plain(Op.GREATER_EQUAL, 2),
    "EQUAL": _plain(Op.EQUAL, 2),
    "NOT_EQUAL": _plain(Op.NOT_EQUAL, 2),
    "LOGICAL_AND": _plain(Op.LOGICAL_AND, 2),
    "LOGICAL_OR": _plain(Op.LOGICAL_OR, 2),
    "POW": _plain(Op.POW, 2),
    "SELECT": _plain(Op.SELECT, 3),
    "SELECT_V2": _plain(Op.SELECT, 3),
    **{name: _plain(kind, 1) for name, kind in (
        ("LOGISTIC", Op.LOGISTIC), ("TANH", Op.TANH), ("RELU", Op.RELU),
        ("RELU6", Op.RELU6), ("RELU_N1_TO_1", Op.RELU1), ("HARD_SWISH", Op.HARD_SWISH),
        ("ABS", Op.ABS), ("EXP", Op.EXP), ("LOG", Op.LOG), ("NEG", Op.NEG), ("SIN", Op.SIN),
        ("SQRT", Op.SQRT), ("RSQRT", Op.RSQRT), ("FLOOR", Op.FLOOR), ("ELU", Op.ELU),
        ("LOGICAL_NOT", Op.LOGICAL_NOT), ("L2_NORMALIZATION", Op.L2_NORMALIZATION))},
}
