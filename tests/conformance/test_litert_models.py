"""The shared real models (../shared/models), imported with nnrt.tflite and
run through the litert driver, match LiteRT called directly on the .tflite
file (the reference outputs stored next to it): float outputs within 1e-5
of the largest output magnitude, quantized ones within 1 unit. Every
operation runs on litert, except the sequence LSTM and WHILE of the two
recurrent models, which the reference driver takes in a partitioned run.
(selfie_segmentation's custom op has no NNAPI operation: not importable.)"""
from pathlib import Path

import anyio
import numpy as np
import pytest

pytest.importorskip("ai_edge_litert")

import nnrt  # noqa: E402
import nnrt.tflite  # noqa: E402
from nnrt.drivers.litert import LiteRTDevice  # noqa: E402
from nnrt.drivers.reference import ReferenceDevice  # noqa: E402
from tests.conftest import MODELS

NAMES = [
    "conv/conv3x3_112x112x32to64_float32", "conv/conv3x3_112x112x32to64_int8",
    "generated/mobilenet_v1_0.25_128_float32", "generated/mobilenet_v1_0.25_128_int8",
    "generated/mobilenet_v1_0.25_128_uint8", "generated/mobilenet_v1_0.25_128_uint8io",
    "generated/mobilenet_v1_1.0_224_int8", "generated/mobilenet_v1_1.0_224_uint8",
    "generated/mobilenet_v2_0.35_96_float32", "generated/mobilenet_v2_0.35_96_int8",
    "generated/mobilenet_v2_0.35_96_uint8io", "generated/mobilenet_v2_1.0_224_int8",
    "mediapipe/face_detection_short_range", "mediapipe/hand_landmark_lite",
    "mediapipe/palm_detection_lite", "mediapipe/pose_detection",
    "generated/lstm_20x40_unrolled_float32",
]
# Models whose named operations litert leaves to the reference driver.
PARTITIONED = {"generated/lstm_20x40_fused_float32": {"UNIDIRECTIONAL_SEQUENCE_LSTM"},
               "generated/lstm_20x40_while_float32": {"WHILE"}}


@pytest.mark.parametrize("name", NAMES + list(PARTITIONED))
def test_shared_model_on_litert_matches_litert_called_directly(name):
    stem = MODELS / name
    path = Path(f"{stem}.tflite")    # not with_suffix: "mobilenet_v1_0.25_..." has dots
    if not path.exists():
        pytest.skip(f"{path} is not beside the checkout")
    model = nnrt.tflite.load(path)
    inputs = [np.load(p) for p in sorted(stem.parent.glob(stem.name + ".in*.npy"))]
    expected = [np.load(p) for p in sorted(stem.parent.glob(stem.name + ".out*.npy"))]
    device = LiteRTDevice()
    flags = anyio.run(device.supported_operations, model.hal_model)
    refused = {op.type.name for op, ok in zip(model.hal_model.main.operations, flags) if not ok}
    assert refused == PARTITIONED.get(name, set()), device.unsupported_reasons(model.hal_model)

    async def run():
        async with nnrt.Runtime(devices=[device, ReferenceDevice()]) as rt:
            compiled = await rt.compile(model)
            return await compiled.execute(inputs)

    result = anyio.run(run)
    assert len(result.outputs) == len(expected)
    for got, want in zip(result.outputs, expected):
        assert got.shape == want.shape and got.dtype == want.dtype
        if want.dtype.kind == "f":
            assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
        else:
            assert np.abs(got.astype(np.int32) - want.astype(np.int32)).max() <= 1
