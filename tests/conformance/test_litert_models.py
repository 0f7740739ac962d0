"""Every shared real model the test reader takes (../shared/models), as an
NNAPI model through the litert driver, matches LiteRT called directly on the
.tflite file (the reference outputs stored next to it): float outputs within
1e-5 of the largest output magnitude, quantized ones within 1 unit. Every
operation of these models runs on litert (none is partitioned away)."""
from pathlib import Path

import anyio
import numpy as np
import pytest

pytest.importorskip("ai_edge_litert")

import nnrt  # noqa: E402
from nnrt.drivers.litert import LiteRTDevice  # noqa: E402
from nnrt.testing import tflite_subset  # noqa: E402

MODELS = Path(__file__).resolve().parents[3] / "shared" / "models"
NAMES = [
    "conv/conv3x3_112x112x32to64_float32", "conv/conv3x3_112x112x32to64_int8",
    "generated/mobilenet_v1_0.25_128_float32", "generated/mobilenet_v1_0.25_128_int8",
    "generated/mobilenet_v1_0.25_128_uint8", "generated/mobilenet_v1_0.25_128_uint8io",
    "generated/mobilenet_v1_1.0_224_int8", "generated/mobilenet_v1_1.0_224_uint8",
    "generated/mobilenet_v2_0.35_96_float32", "generated/mobilenet_v2_0.35_96_int8",
    "generated/mobilenet_v2_0.35_96_uint8io", "generated/mobilenet_v2_1.0_224_int8",
    "mediapipe/face_detection_short_range", "mediapipe/hand_landmark_lite",
    "mediapipe/palm_detection_lite", "generated/lstm_20x40_unrolled_float32",
]


@pytest.mark.parametrize("name", NAMES)
def test_shared_model_on_litert_matches_litert_called_directly(name):
    stem = MODELS / name
    path = Path(f"{stem}.tflite")    # not with_suffix: "mobilenet_v1_0.25_..." has dots
    if not path.exists():
        pytest.skip(f"{path} is not beside the checkout")
    model = tflite_subset.load(path)
    inputs = [np.load(p) for p in sorted(stem.parent.glob(stem.name + ".in*.npy"))]
    expected = [np.load(p) for p in sorted(stem.parent.glob(stem.name + ".out*.npy"))]
    device = LiteRTDevice()
    assert all(anyio.run(device.supported_operations, model.hal_model)), \
        device.unsupported_reasons(model.hal_model)

    async def run():
        async with nnrt.Runtime(devices=[device]) as rt:
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
