"""nnrt.tflite: importing .tflite files.

The small models in tests/data/tflite are made by scripts/make_test_models.py
(flatbuffers builder) with outputs from LiteRT's reference kernels; they cover
operators the shared models do not. Shared models are tested in
tests/integration/test_tflite_models.py.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import anyio
import numpy as np
import pytest

import nnrt
import nnrt.tflite
from nnrt import ErrorStatus, OperationType

DATA = Path(__file__).resolve().parents[1] / "data" / "tflite"


def _cases(stem: str):
    k = 0
    while (DATA / f"{stem}.case{k}.in0.npy").exists():
        ins = sorted(DATA.glob(f"{stem}.case{k}.in*.npy"))
        outs = sorted(DATA.glob(f"{stem}.case{k}.out*.npy"))
        yield [np.load(p) for p in ins], [np.load(p) for p in outs]
        k += 1


def _op_counts(model: nnrt.Model, referenced: bool = False) -> Counter:
    hal = model.hal_model
    subgraphs = [hal.main] + (list(hal.referenced) if referenced else [])
    return Counter(op.type for s in subgraphs for op in s.operations)


def _run_on_reference(model: nnrt.Model, inputs) -> list:
    """The expected outputs come from LiteRT's reference kernels, which the
    reference device reproduces; the litert device (XNNPACK) may round a
    value at a quantization tie the other way (float_chain's QUANTIZE: XNNPACK
    rounds half to even, NNAPI and the reference kernels half away from zero,
    one quantization step apart, as the CTS's tolerance of 1 allows)."""
    async def main():
        async with nnrt.Runtime(discover=False, litert=False) as rt:
            compiled = await rt.compile(model)
            return (await compiled.execute(inputs)).outputs
    return anyio.run(main)


@pytest.mark.parametrize("stem", ["if_add_or_mul", "float_chain", "int8_chain", "more_float_ops", "lrn",
                                  "batch_matmul_float", "batch_matmul_int8", "rfft2d",
                                  "range_dynamic", "framed_spectrum"])
def test_generated_models_match_litert_reference_kernels(stem):
    model = nnrt.tflite.load(DATA / f"{stem}.tflite")
    cases = list(_cases(stem))
    assert cases
    for inputs, expected in cases:
        outputs = _run_on_reference(model, inputs)
        assert len(outputs) == len(expected)
        for got, want in zip(outputs, expected):
            assert got.shape == want.shape and got.dtype == want.dtype
            if want.dtype.kind == "f":
                scale = max(float(np.abs(want).max()), 1e-30)
                assert np.abs(got - want).max() <= 1e-4 * scale
            else:
                assert np.abs(got.astype(np.int64) - want).max() <= 1


def test_if_becomes_nnapi_control_flow_with_referenced_models():
    model = nnrt.tflite.load(DATA / "if_add_or_mul.tflite")
    hal = model.hal_model
    assert [op.type for op in hal.main.operations] == [OperationType.IF]
    assert sorted(op.type.name for s in hal.referenced for op in s.operations) == ["ADD", "MUL"]
    (true_in, true_out), (false_in, false_out) = _cases("if_add_or_mul")
    x, y = true_in[1], true_in[2]
    np.testing.assert_array_equal(nnrt.run(model, true_in).outputs[0], x + y)
    np.testing.assert_array_equal(nnrt.run(model, false_in).outputs[0], x * y)


def test_strided_slice_shrink_axis_with_negative_begin_takes_one_row():
    # int8_chain slices begin=-1 on a shrink axis with end=0, which TFLite
    # ignores; read literally, NNAPI would give an empty slice.
    model = nnrt.tflite.load(DATA / "int8_chain.tflite")
    ops = [op for op in model.hal_model.main.operations if op.type == OperationType.STRIDED_SLICE]
    assert len(ops) == 1
    (inputs, expected), = _cases("int8_chain")
    out = nnrt.run(model, inputs).outputs[0]
    assert out.shape == (1, 2, 3)
    np.testing.assert_array_equal(out, expected[0])


def test_metadata_keeps_names_dtypes_shapes_and_quantization():
    model = nnrt.tflite.load(DATA / "int8_chain.tflite")
    meta = model.metadata
    assert [i.name for i in meta.inputs] == ["a"]
    assert [o.name for o in meta.outputs] == ["row", "sum"]
    a = meta.inputs[0]
    assert a.dtype == np.int8 and a.shape == (1, 4, 4, 3)
    assert a.quantization.scales == (pytest.approx(0.05),) and a.quantization.zero_points == (-3,)
    assert meta.states == () and meta.source == "int8_chain.tflite"


def test_fused_activations_and_folded_constants():
    model = nnrt.tflite.load(DATA / "float_chain.tflite")
    counts = _op_counts(model)
    # QUANTIZE float->int8 then DEQUANTIZE run on the device; nothing of the
    # constant shape arithmetic is left as an operation.
    assert counts[OperationType.QUANTIZE] == 1 and counts[OperationType.DEQUANTIZE] == 1
    assert counts[OperationType.PAD_V2] == 1 and counts[OperationType.RESIZE_NEAREST_NEIGHBOR] == 1


def test_custom_op_is_refused_naming_the_op_its_index_and_the_model():
    with pytest.raises(nnrt.NnrtError) as info:
        nnrt.tflite.load(DATA / "custom_op.tflite")
    e = info.value
    assert e.status == ErrorStatus.INVALID_ARGUMENT
    assert "MyVendorOp" in e.message and "operator 1" in e.message
    assert "custom_op.tflite" in e.message


@pytest.mark.parametrize("data", [b"", b"not a flatbuffer at all", b"\x10\0\0\0TFL3" + b"\xff" * 8])
def test_bad_bytes_are_invalid_argument(data):
    with pytest.raises(nnrt.NnrtError) as info:
        nnrt.tflite.load(data)
    assert info.value.status == ErrorStatus.INVALID_ARGUMENT


def test_truncated_file_is_invalid_argument_not_a_crash():
    data = (DATA / "float_chain.tflite").read_bytes()
    for cut in (16, 64, len(data) // 2, len(data) - 8):
        with pytest.raises(nnrt.NnrtError) as info:
            nnrt.tflite.load(data[:cut])
        assert info.value.status == ErrorStatus.INVALID_ARGUMENT


def test_missing_file_and_bad_subgraph_are_invalid_argument(tmp_path):
    with pytest.raises(nnrt.NnrtError) as info:
        nnrt.tflite.load(tmp_path / "nope.tflite")
    assert info.value.status == ErrorStatus.INVALID_ARGUMENT and "nope.tflite" in info.value.message
    with pytest.raises(nnrt.NnrtError) as info:
        nnrt.tflite.load(DATA / "float_chain.tflite", subgraph=3)
    assert info.value.status == ErrorStatus.INVALID_ARGUMENT


def test_the_imported_model_is_finished_and_immutable():
    model = nnrt.tflite.load(DATA / "float_chain.tflite")
    assert model.finished
    with pytest.raises(nnrt.NnrtError):
        model.add_operand(nnrt.OperandType.TENSOR_FLOAT32, [1])


def test_operators_without_a_one_to_one_nnapi_operation_are_lowered():
    counts = _op_counts(nnrt.tflite.load(DATA / "more_float_ops.tflite"))
    assert counts[OperationType.SLICE] == 2            # SPLIT_V: one SLICE per part
    assert counts[OperationType.PRELU] == 1            # LEAKY_RELU
    assert counts[OperationType.SUB] == 1 and counts[OperationType.MUL] == 1  # SQUARED_DIFFERENCE
    assert counts[OperationType.TRANSPOSE_CONV_2D] == 1


def test_batch_matmul_and_pack_map_to_feature_level_6_operations():
    """TFLite's BATCH_MATMUL broadcasts batch dimensions, NNAPI's does not:
    [2, 1, 3, 4] x [3, 4, 5] becomes a TILE of the lhs, a RESHAPE and a TILE
    of the rhs, then one BATCH_MATMUL; PACK is one PACK (axis -1 made 3)."""
    model = nnrt.tflite.load(DATA / "batch_matmul_float.tflite")
    ops = model.hal_model.main.operations
    counts = _op_counts(model)
    assert counts == Counter({OperationType.BATCH_MATMUL: 3, OperationType.TILE: 3,
                              OperationType.RESHAPE: 2, OperationType.PACK: 1})
    operands = model.hal_model.main.operands
    pack = next(op for op in ops if op.type == OperationType.PACK)
    assert model.hal_model.constant_value(operands[pack.inputs[0]]) == 3
    adjoint = [op for op in ops if op.type == OperationType.BATCH_MATMUL][1]
    assert [bool(model.hal_model.constant_value(operands[i])) for i in adjoint.inputs[2:]] == \
        [True, True]


@pytest.mark.parametrize("stem", ["batch_matmul_float", "batch_matmul_int8"])
def test_batch_matmul_and_pack_on_litert_match_litert_on_the_file(stem):
    """The imported model on the litert device against LiteRT run directly on
    the .tflite (XNNPACK): float within 1e-4 of the largest output, or no
    further from the reference kernels' outputs than XNNPACK; int8 within one
    unit. Every operation of the float model runs on litert; of the int8
    one, all but the BATCH_MATMUL with a symmetric rhs (XNNPACK would take it
    and rescale in float32: the table leaves it to the reference driver)."""
    litert = pytest.importorskip("ai_edge_litert.interpreter")
    from nnrt.drivers.litert import LiteRTDevice
    from nnrt.drivers.reference import ReferenceDevice

    model = nnrt.tflite.load(DATA / f"{stem}.tflite")
    (inputs, reference), = _cases(stem)
    interp = litert.Interpreter(model_path=str(DATA / f"{stem}.tflite"))
    interp.allocate_tensors()
    for detail, value in zip(interp.get_input_details(), inputs):
        interp.set_tensor(detail["index"], value)
    interp.invoke()
    xnnpack = [interp.get_tensor(d["index"]) for d in interp.get_output_details()]

    device = LiteRTDevice()
    flags = anyio.run(device.supported_operations, model.hal_model)
    refused = [op.type for op, ok in zip(model.hal_model.main.operations, flags) if not ok]
    assert refused == ([] if stem.endswith("float") else [OperationType.BATCH_MATMUL])

    async def run():
        async with nnrt.Runtime(devices=[device, ReferenceDevice()]) as rt:
            compiled = await rt.compile(model)
            return (await compiled.execute(inputs)).outputs
    for got, ref, xnn in zip(anyio.run(run), reference, xnnpack):
        assert got.shape == ref.shape and got.dtype == ref.dtype
        if ref.dtype.kind == "f":
            error = np.abs(got - ref).max()
            assert error <= max(1e-4 * np.abs(ref).max(), np.abs(xnn - ref).max())
        else:
            assert np.abs(got.astype(np.int64) - xnn).max() <= 1
            assert np.abs(got.astype(np.int64) - ref).max() <= 1


def test_hybrid_batch_matmul_is_refused_naming_it():
    with pytest.raises(nnrt.NnrtError) as info:
        nnrt.tflite.load(DATA / "batch_matmul_hybrid.tflite")
    assert info.value.status == ErrorStatus.INVALID_ARGUMENT
    assert "hybrid BATCH_MATMUL" in info.value.message and "operator 0" in info.value.message


# --- MIRROR_PAD and REVERSE_V2 (NNAPI feature level 7) ----------------------------
# Tiny models written with scripts/make_test_models.py's builder, compared with
# LiteRT run on the same bytes: exact, as both only move values.

def _one_op_model(code: str, x_shape, dtype: str, quant, param, out_shape,
                  options: str | None = None, fields: dict | None = None) -> bytes:
    from scripts.make_test_models import Graph, Op, T
    from scripts.make_test_models import build as build_tflite
    tensors = [T("x", tuple(x_shape), dtype, quant=quant),
               T("param", np.asarray(param).shape, str(np.asarray(param).dtype), param),
               T("y", tuple(out_shape), dtype, quant=quant)]
    return build_tflite([Graph(tensors, [Op(code, [0, 1], [2], options, fields or {})],
                               [0], [2])])


def _litert(data: bytes, x: np.ndarray) -> np.ndarray:
    litert = pytest.importorskip("ai_edge_litert.interpreter")
    interp = litert.Interpreter(model_content=data, num_threads=1)
    interp.allocate_tensors()
    interp.set_tensor(interp.get_input_details()[0]["index"], x)
    interp.invoke()
    return interp.get_tensor(interp.get_output_details()[0]["index"])


_MIRROR_PAD_MODELS = [  # (dtype, quantization, paddings, TFLite MirrorPadMode)
    ("float32", None, np.array([[1, 0], [2, 2], [0, 1]], np.int32), 0),        # REFLECT
    ("float32", None, np.array([[2, 1], [3, 0], [1, 1]], np.int64), 1),        # SYMMETRIC
    ("uint8", (0.5, 3), np.array([[0, 1], [0, 2], [1, 0]], np.int32), 1),
    ("int8", (0.25, -2), np.array([[1, 1], [2, 0], [0, 0]], np.int32), 0),
]


@pytest.mark.parametrize("dtype,quant,pads,mode", _MIRROR_PAD_MODELS)
def test_mirror_pad_is_nnapi_mirror_pad_and_matches_litert(dtype, quant, pads, mode):
    shape = (2, 3, 2)
    x = (np.arange(12).reshape(shape) * 3 + 1).astype(dtype)
    out_shape = tuple(d + int(p.sum()) for d, p in zip(shape, pads))
    data = _one_op_model("MIRROR_PAD", shape, dtype, quant, pads, out_shape,
                         "MirrorPadOptions", {"Mode": mode})
    model = nnrt.tflite.load(data)
    assert _op_counts(model) == Counter({OperationType.MIRROR_PAD: 1})
    (got,) = _run_on_reference(model, [x])
    np.testing.assert_array_equal(got, _litert(data, x))


@pytest.mark.parametrize("dtype,quant,axes", [
    ("float32", None, [1]), ("float32", None, [-1]), ("int32", None, [0]),
    ("uint8", (0.5, 3), [-1, -2]), ("int8", (0.25, -2), [0, 1])])
def test_reverse_v2_is_one_nnapi_reverse_per_axis_and_matches_litert(dtype, quant, axes):
    shape = (2, 3, 4)
    x = (np.arange(24).reshape(shape) * 5 % 101).astype(dtype)
    data = _one_op_model("REVERSE_V2", shape, dtype, quant, np.array(axes, np.int32), shape)
    model = nnrt.tflite.load(data)
    assert _op_counts(model) == Counter({OperationType.REVERSE: len(axes)})
    (got,) = _run_on_reference(model, [x])
    np.testing.assert_array_equal(got, _litert(data, x))


def test_reverse_v2_on_axes_apart_is_exact_where_litert_refuses():
    """TFLite's REVERSE_V2 kernel takes only adjacent axes; the NNAPI lowering
    (one REVERSE per axis) gives TensorFlow's reverse for any distinct axes."""
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    model = nnrt.tflite.load(_one_op_model("REVERSE_V2", x.shape, "float32", None,
                                           np.array([2, 0], np.int32), x.shape))
    (got,) = _run_on_reference(model, [x])
    np.testing.assert_array_equal(got, x[::-1, :, ::-1])


@pytest.mark.parametrize("code,param,options,fields,reason", [
    ("REVERSE_V2", np.array([1, -2], np.int32), None, None, "names a dimension twice"),
    ("REVERSE_V2", np.array([3], np.int32), None, None, "out of range for rank 3"),
    ("MIRROR_PAD", np.array([[0, 0], [3, 0], [0, 0]], np.int32), "MirrorPadOptions",
     {"Mode": 0}, "exceed 2, the most REFLECT mode can pad"),
    ("MIRROR_PAD", np.array([[0, 0], [0, 4], [0, 0]], np.int32), "MirrorPadOptions",
     {"Mode": 1}, "exceed 3, the most SYMMETRIC mode can pad")])
def test_what_nnapi_cannot_reverse_or_mirror_is_refused_naming_why(code, param, options,
                                                                     fields, reason):
    out = (2, 3, 4) if code == "REVERSE_V2" else \
        tuple(d + int(p.sum()) for d, p in zip((2, 3, 4), param))
    data = _one_op_model(code, (2, 3, 4), "float32", None, param, out, options, fields)
    with pytest.raises(nnrt.NnrtError) as info:
        nnrt.tflite.load(data)
    assert info.value.status == ErrorStatus.INVALID_ARGUMENT
    assert f"({code})" in info.value.message and reason in info.value.message


# --- FLOOR_DIV (no NNAPI twin: lowered exactly) --------------------------------------

@pytest.mark.parametrize("dtype,ops", [
    ("int32", {OperationType.DIV: 1}),
    ("float32", {OperationType.DIV: 1, OperationType.FLOOR: 1})])
def test_floor_div_is_nnapi_div_and_floor_and_matches_litert(dtype, ops):
    """Issue 41: FLOOR_DIV was refused at import. int32: NNAPI's DIV rounds
    toward negative infinity; floats: DIV then FLOOR. Negative operands
    included, where rounding toward zero would differ."""
    x = (np.arange(24).reshape(2, 3, 4) - 11.5 if dtype == "float32"
         else np.arange(24).reshape(2, 3, 4) - 12).astype(dtype)
    y = np.array([3, -2, 5, -4], dtype)
    data = _one_op_model("FLOOR_DIV", x.shape, dtype, None, y, x.shape)
    model = nnrt.tflite.load(data)
    assert _op_counts(model) == Counter(ops)
    (got,) = _run_on_reference(model, [x])
    np.testing.assert_array_equal(got, _litert(data, x))
    np.testing.assert_array_equal(got, np.floor_divide(x, y))


# --- TFLite builtins without an NNAPI twin: the com.nnrt.tflite extension ----------

def _extension_ops(model: nnrt.Model) -> Counter:
    return Counter(op.type.name for op in model.hal_model.main.operations
                   if op.type.is_extension)


def test_rfft2d_and_range_are_operations_of_nnrts_tflite_extension():
    """RFFT2D, and RANGE whose ends are model inputs, become com.nnrt.tflite
    operations; the constant RANGE is folded; complex results are float32
    with (real, imaginary) interleaved in a last dimension twice as long,
    which REAL/IMAG/CAST/COMPLEX_ABS read with NNAPI operations."""
    rfft = nnrt.tflite.load(DATA / "rfft2d.tflite")
    assert _extension_ops(rfft) == Counter({"com.nnrt.tflite:RFFT2D": 2})
    framed = nnrt.tflite.load(DATA / "framed_spectrum.tflite")
    # SHAPE, FLOOR_DIV, RANGE and the index arithmetic fold; 7 frames of 4 bands.
    assert _extension_ops(framed) == Counter({"com.nnrt.tflite:RFFT2D": 1})
    assert framed.metadata.outputs[0].shape == (7, 4)
    main = framed.hal_model.main   # declared so, not the file's placeholder (1, 4)
    assert main.operands[main.output_indexes[0]].dimensions == (7, 4)
    main = rfft.hal_model.main
    spectrum = next(op for op in main.operations if op.type.is_extension)
    assert main.operands[spectrum.outputs[0]].dimensions == (2, 4, 10)
    assert [o.shape for o in rfft.metadata.outputs] == [(2, 4, 5)] * 4 + [(3, 9)]
    ranges = nnrt.tflite.load(DATA / "range_dynamic.tflite")
    assert _extension_ops(ranges) == Counter({"com.nnrt.tflite:RANGE": 2})
    assert [o.shape for o in ranges.metadata.outputs] == [(None,), (None,), (4,)]


@pytest.mark.parametrize("stem", ["rfft2d", "range_dynamic", "framed_spectrum"])
def test_extension_models_on_litert_match_litert_with_dynamic_shapes(stem):
    """On the litert device with the reference device beside it: RFFT2D runs
    on litert (RFFT2D, REAL, IMAG, PACK, RESHAPE in TFLite); a RANGE of
    run-time ends has no static shape, so it stays on the reference device,
    and its output comes back with the length of each case (the cases
    differ). framed_spectrum's shapes, placeholders in the file, are all
    inferred at import: every operation runs on litert."""
    pytest.importorskip("ai_edge_litert.interpreter")
    from nnrt.drivers.litert import LiteRTDevice
    from nnrt.drivers.reference import ReferenceDevice

    model = nnrt.tflite.load(DATA / f"{stem}.tflite")
    litert, reference = LiteRTDevice(), ReferenceDevice()
    flags = anyio.run(litert.supported_operations, model.hal_model)
    on_litert = Counter(op.type.name for op, ok in zip(model.hal_model.main.operations, flags)
                        if ok and op.type.is_extension)
    rfft2d = {"rfft2d": 2, "range_dynamic": 0, "framed_spectrum": 1}[stem]
    assert on_litert == Counter({"com.nnrt.tflite:RFFT2D": rfft2d} if rfft2d else {})
    assert all(flags) == (stem != "range_dynamic")

    async def run(inputs):
        async with nnrt.Runtime(devices=[litert, reference]) as rt:
            compiled = await rt.compile(model)
            result = await compiled.execute(inputs)
            return result.outputs, result.output_shapes
    lengths = set()
    for inputs, expected in _cases(stem):
        outputs, shapes = anyio.run(run, inputs)
        for got, shape, want in zip(outputs, shapes, expected):
            assert got.shape == want.shape == tuple(shape) and got.dtype == want.dtype
            bound = 1e-4 * max(float(np.abs(want).max()), 1e-30) if want.dtype.kind == "f" else 0
            assert np.abs(got.astype(np.float64) - want).max() <= bound
        lengths.add(outputs[0].shape)
    assert len(lengths) == (3 if stem == "range_dynamic" else 1)


def test_a_range_that_moves_away_from_its_limit_fails_the_execution():
    """LiteRT fails such a RANGE when it runs; so does the extension's."""
    model = nnrt.tflite.load(DATA / "range_dynamic.tflite")
    x = np.zeros(4, np.int32)
    with pytest.raises(nnrt.NnrtError) as info:
        _run_on_reference(model, [np.array(-4, np.int32), np.array(0.5, np.float32), x])
    assert "RANGE" in info.value.message and "moves away from limit" in info.value.message


def test_the_extension_needs_no_allowlist_entry(allow_nobody):
    """com.nnrt.tflite is nnrt's own: an app that no allowlist names runs it."""
    model = nnrt.tflite.load(DATA / "rfft2d.tflite")
    (inputs, expected), = _cases("rfft2d")
    outputs = _run_on_reference(model, inputs)
    assert np.abs(outputs[0] - expected[0]).max() <= 1e-4 * np.abs(expected[0]).max()


def _spectrum_model(consumer: str, fft_length) -> bytes:
    from scripts.make_test_models import Graph, Op, T
    from scripts.make_test_models import build as build_tflite
    tensors = [T("x", (2, 8)), T("fft_length", (2,), "int32", np.array(fft_length)),
               T("spectrum", (2, 5), "complex64"), T("y", (10,), "complex64"),
               T("shape", (1,), "int32", np.array([10]))]
    ops = [Op("RFFT2D", [0, 1], [2]), Op(consumer, [2, 4], [3])]
    return build_tflite([Graph(tensors, ops, [0], [3])])


@pytest.mark.parametrize("consumer,fft_length,reason", [
    ("RESHAPE", [2, 8], "reads a complex64 tensor"),
    ("RESHAPE", [2, 6], "must be two powers of two")])
def test_what_the_complex_lowering_cannot_take_is_refused_naming_it(consumer, fft_length, reason):
    with pytest.raises(nnrt.NnrtError) as info:
        nnrt.tflite.load(_spectrum_model(consumer, fft_length))
    assert info.value.status == ErrorStatus.INVALID_ARGUMENT and reason in info.value.message
