"""Shared real models (../shared/models): import, run on the reference
device, compare with LiteRT's outputs stored beside each model.

Criteria (issue 13): float outputs within 1e-4 of the largest magnitude of
the reference kernels' outputs; quantized outputs no further from them than
LiteRT's XNNPACK outputs are, and each quantized operation within one unit
when run alone on the reference kernels' inputs. scripts/check_models.py
runs every shared model; this file runs a few that cover the lowerings.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import nnrt
import nnrt.tflite
from nnrt import OperationType
from nnrt.cli import main as cli
from tests.conftest import MODELS

SHARED = MODELS if MODELS.is_dir() else None
pytestmark = pytest.mark.skipif(SHARED is None, reason="the shared models folder is absent")


def _path(name: str) -> Path:
    found = list(SHARED.rglob(f"{name}.tflite"))
    assert found, f"{name}.tflite is not among the shared models"
    return found[0]


def _run_and_compare(name: str) -> nnrt.Model:
    path = _path(name)
    stem = path.with_suffix("")
    model = nnrt.tflite.load(path)
    inputs = [np.load(p) for p in sorted(path.parent.glob(f"{stem.name}.in*.npy"))]
    outputs = nnrt.run(model, inputs).outputs
    for k, got in enumerate(outputs):
        ref = np.load(path.parent / f"{stem.name}.ref_out{k}.npy")
        assert got.shape == ref.shape and got.dtype == ref.dtype
        if ref.dtype.kind == "f":
            assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max(), f"output {k}"
        else:
            xnnpack = np.load(path.parent / f"{stem.name}.out{k}.npy")
            ours = np.abs(got.astype(np.int64) - ref).max()
            assert ours <= np.abs(xnnpack.astype(np.int64) - ref).max(), f"output {k}"
    return model


def _counts(model: nnrt.Model) -> Counter:
    hal = model.hal_model
    return Counter(op.type for s in (hal.main, *hal.referenced) for op in s.operations)


def test_mobilenet_v1_float_folds_the_shape_arithmetic():
    model = _run_and_compare("mobilenet_v1_0.25_128_float32")
    counts = _counts(model)
    # SHAPE -> STRIDED_SLICE -> PACK folded into the one RESHAPE's constant.
    assert set(counts) == {OperationType.CONV_2D, OperationType.DEPTHWISE_CONV_2D,
                           OperationType.MEAN, OperationType.RESHAPE, OperationType.SOFTMAX}
    assert counts[OperationType.RESHAPE] == 1


def test_mobilenet_v2_int8_per_channel_fully_connected_becomes_conv():
    model = _run_and_compare("mobilenet_v2_0.35_96_int8")
    counts = _counts(model)
    assert OperationType.FULLY_CONNECTED not in counts
    assert counts[OperationType.CONV_2D] == 35 + 1


def test_uint8_io_requantize_is_dequantize_then_quantize():
    model = _run_and_compare("mobilenet_v1_0.25_128_uint8io")
    counts = _counts(model)
    assert counts[OperationType.DEQUANTIZE] == 2 and counts[OperationType.QUANTIZE] == 2
    assert model.metadata.inputs[0].dtype == np.uint8


def test_float16_weights_and_sparse_weights_are_folded():
    face = _run_and_compare("face_detection_short_range")
    assert not {OperationType.DEQUANTIZE, OperationType.CAST} & set(_counts(face))
    pose = _run_and_compare("pose_detection")
    assert not {OperationType.DEQUANTIZE, OperationType.CAST} & set(_counts(pose))
    assert _counts(pose)[OperationType.CONV_2D] == 45


def test_while_loops_become_nnapi_while_with_referenced_bodies():
    model = _run_and_compare("lstm_20x40_while_float32")
    hal = model.hal_model
    assert [op.type for op in hal.main.operations].count(OperationType.WHILE) == 2
    assert len(hal.referenced) == 4


def test_unpack_and_pack_are_lowered():
    model = _run_and_compare("lstm_20x40_unrolled_float32")
    counts = _counts(model)
    assert counts[OperationType.SPLIT] >= 40 + 2  # the model's SPLITs and the UNPACKs
    # PACK is NNAPI's PACK (feature level 6), not RESHAPEs and a CONCATENATION.
    assert counts[OperationType.PACK] == 1 and OperationType.CONCATENATION not in counts


def test_quantized_operations_alone_are_within_one_unit_of_litert_reference_kernels():
    litert = pytest.importorskip("ai_edge_litert.interpreter")
    from nnrt.tflite import load_operators
    from nnrt.tflite.reader import read
    path = _path("mobilenet_v1_0.25_128_int8")
    data = path.read_bytes()
    interp = litert.Interpreter(model_content=data,
                                experimental_op_resolver_type=litert.OpResolverType.BUILTIN_REF,
                                experimental_preserve_all_tensors=True)
    interp.allocate_tensors()
    interp.set_tensor(interp.get_input_details()[0]["index"],
                      np.load(path.with_suffix(".in0.npy")))
    interp.invoke()
    file = read(data, path.name)
    graph = file.graphs[0]
    by_name = {t.name: t.index for t in graph.tensors}
    checked = 0
    for op in graph.operators:
        if not all(graph.tensors[t].quantization for t in op.outputs):
            continue  # SHAPE, STRIDED_SLICE, PACK on int32 shapes: folded at import
        model = load_operators(file, 0, [op.index])
        inputs = [interp.get_tensor(by_name[i.name]) for i in model.metadata.inputs]
        for t, got in zip(op.outputs, nnrt.run(model, inputs).outputs):
            want = interp.get_tensor(t)
            assert np.abs(got.astype(np.int64) - want).max() <= 1, f"operator {op.index} {op.name}"
        checked += 1
    assert checked >= 30


def test_an_unknown_custom_op_is_refused_naming_it():
    # selfie_segmentation's custom op is known (the com.nnrt.mediapipe
    # extension, docs/vendors/extensions.md); renamed, it is not.
    data = _path("selfie_segmentation").read_bytes().replace(b"Convolution2DTransposeBias",
                                                             b"Convolution2DTransposeBiaZ")
    with pytest.raises(nnrt.NnrtError) as info:
        nnrt.tflite.load(data, name="selfie_segmentation")
    message = info.value.message
    assert info.value.status == nnrt.ErrorStatus.INVALID_ARGUMENT
    assert "Convolution2DTransposeBiaZ" in message and "operator 244" in message
    assert "selfie_segmentation" in message


def test_cli_run_inspect_and_refusal(tmp_path, capsys):
    model = _path("mobilenet_v1_0.25_128_int8")
    out = tmp_path / "out.npz"
    # On the reference device: its output is compared with LiteRT's reference
    # kernels bit for bit (the litert device matches XNNPACK's instead).
    assert cli(["run", str(model), "--input", f"keras_tensor={model.with_suffix('.in0.npy')}",
                "--repeat", "3", "--output", str(out), "--no-discover",
                "--device", "nnrt-reference"]) == 0
    printed = capsys.readouterr().out
    assert "ran on: nnrt-reference" in printed and "shape [1, 1000] int8" in printed
    assert "2 more executions" in printed
    saved = np.load(out)
    np.testing.assert_array_equal(saved[saved.files[0]], np.load(model.with_suffix(".ref_out0.npy")))

    assert cli(["inspect", str(model), "--no-discover"]) == 0
    printed = capsys.readouterr().out
    assert "DEPTHWISE_CONV_2D" in printed and "nnrt-reference" in printed

    # The reference device does not offer the extension selfie_segmentation's
    # custom op maps to (litert runs it, as TRANSPOSE_CONV with a bias).
    assert cli(["run", str(_path("selfie_segmentation")), "--random", "--no-discover",
                "--device", "nnrt-reference"]) == 1
    assert "com.nnrt.mediapipe" in capsys.readouterr().err
    assert cli(["run", str(model), "--no-discover"]) == 2
    assert "--random" in capsys.readouterr().err
