"""Read a ``.tflite`` flatbuffer into plain Python values.

The flatbuffer is decoded by the ``tflite`` package (the generated TFLite
schema on ``flatbuffers``), never by hand. This module turns it into small
dataclasses — tensors with their constant data already densified, operators
with their options as a dict — so the lowering in :mod:`nnrt.tflite.lower`
works on values, not on flatbuffer tables. A malformed file is refused with
INVALID_ARGUMENT naming what could not be read.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np
import tflite

from ..errors import invalid

# TensorType -> numpy dtype (the schema's numbering; FLOAT16 and INT64 are
# only kept for constants the importer folds).
_DTYPES = {
    tflite.TensorType.FLOAT32: np.dtype(np.float32),
    tflite.TensorType.FLOAT16: np.dtype(np.float16),
    tflite.TensorType.INT32: np.dtype(np.int32),
    tflite.TensorType.UINT8: np.dtype(np.uint8),
    tflite.TensorType.INT64: np.dtype(np.int64),
    tflite.TensorType.BOOL: np.dtype(np.bool_),
    tflite.TensorType.INT16: np.dtype(np.int16),
    tflite.TensorType.INT8: np.dtype(np.int8),
    tflite.TensorType.FLOAT64: np.dtype(np.float64),
    tflite.TensorType.COMPLEX64: np.dtype(np.complex64),
}
_TYPE_NAMES = {v: k for k, v in vars(tflite.TensorType).items() if not k.startswith("_")}
OPERATOR_NAMES = {v: k for k, v in vars(tflite.BuiltinOperator).items() if not k.startswith("_")}
_OPTION_CLASSES = {v: k for k, v in vars(tflite.BuiltinOptions).items()
                   if not k.startswith("_") and k != "NONE"}
_INDEX_VECTORS = {tflite.SparseIndexVector.Int32Vector: tflite.Int32Vector,
                  tflite.SparseIndexVector.Uint16Vector: tflite.Uint16Vector,
                  tflite.SparseIndexVector.Uint8Vector: tflite.Uint8Vector}


@dataclass(frozen=True)
class Quantization:
    """TFLite quantization of one tensor: one scale and zero point per tensor,
    or one per slice along ``dimension``."""

    scales: tuple[float, ...]
    zero_points: tuple[int, ...]
    dimension: int = 0

    @property
    def per_channel(self) -> bool:
        return len(self.scales) > 1


@dataclass
class Tensor:
    index: int
    name: str
    dtype: np.dtype | None        # None for a type nnrt has no operand for (STRING, ...)
    type_name: str
    shape: tuple[int, ...]
    shape_signature: tuple[int, ...]  # -1 where the dimension is unknown
    quantization: Quantization | None
    data: np.ndarray | None       # the constant value (dense), None when not constant
    is_variable: bool


@dataclass
class Operator:
    index: int
    name: str                     # builtin operator name, or "CUSTOM:<code>"
    inputs: tuple[int, ...]       # -1 for an omitted optional input
    outputs: tuple[int, ...]
    options: dict = field(default_factory=dict)
    custom_options: bytes = b""
    version: int = 1              # the operator code's version (custom ops' kernels differ by it)


@dataclass
class Graph:
    index: int
    name: str
    tensors: list[Tensor]
    operators: list[Operator]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]


@dataclass
class Signature:
    key: str
    subgraph: int
    inputs: dict[int, str]        # tensor index -> signature name
    outputs: dict[int, str]


@dataclass
class TfliteFile:
    name: str
    graphs: list[Graph]
    signatures: list[Signature]


def read(data: bytes, name: str) -> TfliteFile:
    """Decode the flatbuffer ``data`` (``name`` is used in messages)."""
    if len(data) < 8 or data[4:8] != b"TFL3":
        raise invalid(f"{name}: not a TFLite flatbuffer (no 'TFL3' identifier)")
    try:
        model = tflite.Model.GetRootAsModel(data, 0)
        buffers = [_buffer(model.Buffers(i), data) for i in range(model.BuffersLength())]
        opcodes = [(_opcode_name(model.OperatorCodes(i)), model.OperatorCodes(i).Version())
                   for i in range(model.OperatorCodesLength())]
        graphs = [_graph(model.Subgraphs(g), g, buffers, opcodes, name)
                  for g in range(model.SubgraphsLength())]
        signatures = [_signature(model.SignatureDefs(i)) for i in range(model.SignatureDefsLength())]
    except (IndexError, ValueError, TypeError, AttributeError, UnicodeDecodeError,
            struct.error, OverflowError, MemoryError) as e:
        # flatbuffers raises these on offsets pointing outside the file.
        raise invalid(f"{name}: malformed TFLite flatbuffer ({type(e).__name__}: {e})") from None
    if not graphs:
        raise invalid(f"{name}: the model has no subgraph")
    return TfliteFile(name, graphs, signatures)


def _buffer(buf, data: bytes) -> np.ndarray | None:
    if buf is None:
        return None
    if buf.Offset() > 1:  # stored after the flatbuffer (models over 2 GB)
        start, size = buf.Offset(), buf.Size()
        if start + size > len(data):
            raise ValueError(f"buffer [{start}, {start + size}) lies outside the file")
        return np.frombuffer(data, np.uint8, size, start)
    if buf.DataLength() == 0:
        return None
    return buf.DataAsNumpy()


def _opcode_name(code) -> str:
    # builtin_code replaced deprecated_builtin_code (an int8) once codes passed 127.
    builtin = max(code.BuiltinCode(), code.DeprecatedBuiltinCode())
    if builtin == tflite.BuiltinOperator.CUSTOM:
        return "CUSTOM:" + (code.CustomCode() or b"").decode()
    return OPERATOR_NAMES.get(builtin, f"BUILTIN_{builtin}")


def _graph(sg, g: int, buffers, opcodes, name: str) -> Graph:
    tensors = [_tensor(sg.Tensors(i), i, buffers, name) for i in range(sg.TensorsLength())]
    operators = []
    for k in range(sg.OperatorsLength()):
        op = sg.Operators(k)
        code = op.OpcodeIndex()
        if not 0 <= code < len(opcodes):
            raise ValueError(f"operator {k} has opcode index {code} of {len(opcodes)}")
        operators.append(Operator(
            index=k, name=opcodes[code][0], version=opcodes[code][1],
            inputs=tuple(int(i) for i in op.InputsAsNumpy()) if op.InputsLength() else (),
            outputs=tuple(int(i) for i in op.OutputsAsNumpy()) if op.OutputsLength() else (),
            options=_options(op),
            custom_options=op.CustomOptionsAsNumpy().tobytes() if op.CustomOptionsLength() else b""))
    for op in operators:
        if any(t < 0 for t in op.outputs):
            raise ValueError(f"operator {op.index} ({op.name}) has an omitted output")
        for t in op.inputs + op.outputs:
            if not -1 <= t < len(tensors):
                raise ValueError(f"operator {op.index} ({op.name}) names tensor {t} "
                                 f"of {len(tensors)}")
    graph_io = tuple(int(i) for i in sg.InputsAsNumpy()) if sg.InputsLength() else ()
    graph_io += tuple(int(i) for i in sg.OutputsAsNumpy()) if sg.OutputsLength() else ()
    if any(not 0 <= t < len(tensors) for t in graph_io):
        raise ValueError(f"subgraph {g} names an input or output tensor outside its "
                         f"{len(tensors)} tensors")
    return Graph(g, (sg.Name() or b"").decode(), tensors, operators,
                 tuple(int(i) for i in sg.InputsAsNumpy()) if sg.InputsLength() else (),
                 tuple(int(i) for i in sg.OutputsAsNumpy()) if sg.OutputsLength() else ())


def _tensor(t, index: int, buffers, name: str) -> Tensor:
    type_name = _TYPE_NAMES.get(t.Type(), f"TYPE_{t.Type()}")
    dtype = _DTYPES.get(t.Type())
    shape = tuple(int(d) for d in t.ShapeAsNumpy()) if t.ShapeLength() else ()
    signature = tuple(int(d) for d in t.ShapeSignatureAsNumpy()) if t.ShapeSignatureLength() \
        else shape
    q = t.Quantization()
    quant = None
    if q is not None and q.ScaleLength():
        scales = tuple(float(s) for s in q.ScaleAsNumpy())
        zps = tuple(int(z) for z in q.ZeroPointAsNumpy()) if q.ZeroPointLength() else (0,)
        quant = Quantization(scales, zps, int(q.QuantizedDimension()))
    raw = buffers[t.Buffer()] if 0 < t.Buffer() < len(buffers) else None
    data = None
    tensor_name = (t.Name() or b"").decode()
    if raw is not None and dtype is not None:
        sparsity = t.Sparsity()
        values = np.frombuffer(raw.tobytes(), dtype)
        if sparsity is not None:
            data = _densify(values, shape, sparsity, tensor_name)
        else:
            if values.size != int(np.prod(shape)):
                raise ValueError(f"tensor {index} ({tensor_name}) has {values.size} values "
                                 f"for shape {list(shape)}")
            data = values.reshape(shape)
    return Tensor(index, tensor_name, dtype, type_name, shape, signature, quant, data,
                  bool(t.IsVariable()))


def _index_vector(table_type: int, table) -> np.ndarray:
    vector = _INDEX_VECTORS[table_type]()
    vector.Init(table.Bytes, table.Pos)
    return vector.ValuesAsNumpy().astype(np.int64)


def _densify(values: np.ndarray, shape: tuple[int, ...], sparsity, name: str) -> np.ndarray:
    """The dense array of a sparse constant (the DENSIFY op's job, done at
    import). Supports the format TFLite's converter writes for pruned
    weights: dims in storage order, each dense or CSR, without block maps."""
    order = tuple(int(d) for d in sparsity.TraversalOrderAsNumpy()) \
        if sparsity.TraversalOrderLength() else tuple(range(len(shape)))
    if order != tuple(range(len(shape))) or sparsity.BlockMapLength():
        raise ValueError(f"sparse tensor {name}: block-sparse or reordered storage "
                         f"(traversal order {list(order)}) is not supported")
    dims = [sparsity.DimMetadata(d) for d in range(sparsity.DimMetadataLength())]
    if len(dims) != len(shape):
        raise ValueError(f"sparse tensor {name}: {len(dims)} dimension metadata for "
                         f"rank {len(shape)}")
    # Walk the storage levels: ``positions`` are the storage positions reached
    # so far, ``coords`` their coordinates in the dense tensor.
    positions = np.zeros(1, np.int64)
    coords = np.zeros((1, 0), np.int64)
    for level, dm in enumerate(dims):
        if dm.Format() == tflite.DimensionType.DENSE:
            size = int(dm.DenseSize())
            new_pos = (positions[:, None] * size + np.arange(size)[None, :]).reshape(-1)
            new_coord = np.repeat(np.arange(size)[None, :], len(positions), 0).reshape(-1)
            coords = np.concatenate([np.repeat(coords, size, 0), new_coord[:, None]], 1)
        else:
            segments = _index_vector(dm.ArraySegmentsType(), dm.ArraySegments())
            indices = _index_vector(dm.ArrayIndicesType(), dm.ArrayIndices())
            counts = segments[positions + 1] - segments[positions]
            new_pos = np.concatenate([np.arange(segments[p], segments[p + 1]) for p in positions]) \
                if len(positions) else np.zeros(0, np.int64)
            new_coord = indices[new_pos]
            coords = np.concatenate([np.repeat(coords, counts, 0), new_coord[:, None]], 1)
        positions = new_pos.astype(np.int64)
    if positions.size != values.size:
        raise ValueError(f"sparse tensor {name}: {values.size} values for {positions.size} "
                         f"stored positions")
    dense = np.zeros(shape, values.dtype)
    dense[tuple(coords.T)] = values[positions]
    return dense


def _options(op) -> dict:
    """The builtin options of ``op`` as a dict of field name -> value."""
    kind = op.BuiltinOptionsType()
    if kind not in _OPTION_CLASSES or op.BuiltinOptions() is None:
        return {}
    cls = getattr(tflite, _OPTION_CLASSES[kind], None)
    if cls is None:
        return {}
    table = op.BuiltinOptions()
    options = cls()
    options.Init(table.Bytes, table.Pos)
    out = {}
    for attr in dir(cls):
        if attr.startswith("_") or attr in ("Init",) or attr.startswith("GetRootAs") \
                or attr.endswith(("IsNone", "Length", "BufferHasIdentifier")):
            continue
        if attr.endswith("AsNumpy"):
            value = getattr(options, attr)()
            out[attr[:-len("AsNumpy")]] = [int(v) for v in value] if not isinstance(value, int) \
                else []
            continue
        if attr + "AsNumpy" in dir(cls):
            continue
        try:
            out[attr] = getattr(options, attr)()
        except TypeError:  # a vector accessor that takes an index
            pass
    return out


def _signature(sd) -> Signature:
    def names(count, get):
        return {int(get(i).TensorIndex()): (get(i).Name() or b"").decode() for i in range(count)}
    return Signature((sd.SignatureKey() or b"").decode(), int(sd.SubgraphIndex()),
                     names(sd.InputsLength(), sd.Inputs), names(sd.OutputsLength(), sd.Outputs))
