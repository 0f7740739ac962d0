"""The face pipeline of examples/face_pipeline.py (issue 43) on the real
MediaPipe models: its outputs are LiteRT's, one model after another, frame
by frame in order -- in process, and with segmentation on a litert driver
service."""
import numpy as np
import pytest

import nnrt

pytest.importorskip("ai_edge_litert.interpreter")
from examples import face_pipeline as face     # noqa: E402


def frames(count: int) -> list[np.ndarray]:
    """Frames from the segmenter's stored input, moved a little each time
    (no face is needed: the box of the best anchor is cropped all the same)."""
    base = np.load(str(face.SEGMENTER).replace(".tflite", ".in0.npy"))
    return [np.ascontiguousarray(np.roll(base, 9 * k, axis=(1, 2))) for k in range(count)]


async def _pipeline_outputs(rt, segment_devices=None):
    compiled = await face.compile_all(rt, segment_devices)
    async with rt.pipeline(face.stages(compiled), in_flight=2, warmup=1,
                           outputs=face.OUTPUTS) as pipe:
        got = [r async for r in pipe.run(frames(4))]
        lanes = pipe.statistics().lanes
    return got, lanes, compiled


def _check_against_litert(got):
    lite = face.LiteRTSequential()
    assert [r.index for r in got] == [0, 1, 2, 3]
    for r, frame in zip(got, frames(4)):
        assert r.dropped_at is None
        expected = lite.frame(frame)
        # The segmenter reads the frame itself: the same bits as LiteRT.
        np.testing.assert_array_equal(r.outputs["segment:0"], expected["segment:0"])
        # The detector's input and the crop come from NNAPI's RESIZE_BILINEAR
        # and ROI_ALIGN in nnrt, from numpy in the LiteRT app: float noise.
        np.testing.assert_allclose(r.outputs["box:0"], expected["box:0"], atol=1e-3)
        for name in ("landmarks:0", "landmarks:1"):
            scale = np.max(np.abs(expected[name]))
            assert np.max(np.abs(r.outputs[name] - expected[name])) <= 1e-4 * scale, name


async def test_the_face_pipeline_in_process_gives_litert_s_outputs_in_frame_order():
    async with nnrt.Runtime(litert=2, discover=False) as rt:
        assert rt.device("litert").scheduling().slots == 2
        got, lanes, compiled = await _pipeline_outputs(rt)
        # Segmentation, its custom op included, runs on litert: one step.
        assert [d.name for d in compiled["segment"].devices] == ["litert"]
        assert [d.name for d in compiled["crop"].devices] == ["nnrt-reference"]
    assert len(lanes) == 2
    _check_against_litert(got)


async def test_a_stage_on_a_litert_service_gives_the_same_outputs():
    async with nnrt.Runtime(litert=2, discover=False, spawn=[("seg", "litert")]) as rt:
        got, _, compiled = await _pipeline_outputs(rt, segment_devices=["seg"])
        assert [d.name for d in compiled["segment"].devices] == ["seg"]
        assert [d.name for d in compiled["landmarks"].devices] == ["litert"]
    _check_against_litert(got)
