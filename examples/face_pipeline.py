"""A face pipeline on nnrt: MediaPipe's face detection, the face's crop, the
face mesh landmarks on it and, beside them on the same frame, selfie
segmentation -- on a synthetic camera made from a real photo (scikit-image's
``astronaut``) whose face moves and scales from frame to frame.

    python examples/face_pipeline.py --frames 120        # or: nnrt demo --pipeline

Per frame (stages of one nnrt pipeline; docs/guide/pipelines.md):

    frame 256x256 ─ detect_input (RESIZE_BILINEAR 128x128, x*2-1; litert)
                  ─ detect (face_detection_short_range; litert)
                  ─ box (Python: decode the 896 anchors, best face, a square 1.5x its size)
                  ─ crop (ROI_ALIGN 192x192 of the frame; the reference device)
                  ─ landmarks (face_landmark, 468 points; litert)
          frame ─ segment (selfie_segmentation; litert, its custom op included)

The stages run on two lanes (threads) placed from their measured costs,
two frames in flight; the in-process litert device runs two executions at
once (``nnrt.Runtime(litert=2)``). At the end the outputs of a few frames are
checked against the same models run one after another through LiteRT.

Models: ``../shared/models/mediapipe`` (detection, segmentation) and
``tests/data/mediapipe/face_landmark.tflite`` (from the mediapipe 0.10.21
wheel, ``scripts/fetch_face_landmark.py``). The photo needs scikit-image
(``pip install nnrt[examples]``).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import anyio
import numpy as np

import nnrt
import nnrt.tflite
from nnrt import OperandType as T, OperationType as Op, Priority, Stage, Step

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "models" / "mediapipe"
DETECTOR = SHARED / "face_detection_short_range.tflite"
SEGMENTER = SHARED / "selfie_segmentation.tflite"
LANDMARKS = ROOT / "tests" / "data" / "mediapipe" / "face_landmark.tflite"
SIZE = 256            # camera frames: SIZE x SIZE RGB, float32 in [0, 1]
DETECT, CROP = 128, 192
FACE_SCORE = 0.5


# --- the camera -------------------------------------------------------------------

def camera(count: int, size: int = SIZE) -> list[np.ndarray]:
    """``count`` frames of the astronaut photo, zoomed and moved so the face
    wanders and scales: each a (1, size, size, 3) float32 in [0, 1]."""
    try:
        from skimage.data import astronaut
    except ImportError:
        sys.exit("the synthetic camera needs scikit-image: pip install 'nnrt[examples]'")
    photo = astronaut().astype(np.float32) / 255.0          # 512 x 512, the face near (210, 110)
    frames = []
    for k in range(count):
        t = k / max(count, 1) * 2 * np.pi
        scale = 1.6 + 0.5 * np.sin(2 * t)                    # source pixels per frame pixel
        cx, cy = 230 + 50 * np.sin(t), 190 + 40 * np.cos(3 * t)
        axis = (np.arange(size) - size / 2 + 0.5) * scale
        ys = np.clip(np.round(cy + axis).astype(int), 0, 511)
        xs = np.clip(np.round(cx + axis).astype(int), 0, 511)
        frames.append(np.ascontiguousarray(photo[ys][:, xs][None]))
    return frames


# --- the stages' pieces ------------------------------------------------------------

def detect_input_model() -> nnrt.Model:
    """The frame as the detector takes it: 128 x 128, in [-1, 1]."""
    m = nnrt.Model()
    frame = m.add_operand(T.TENSOR_FLOAT32, [1, SIZE, SIZE, 3])
    small = m.add_operand(T.TENSOR_FLOAT32, [1, DETECT, DETECT, 3])
    scaled = m.add_operand(T.TENSOR_FLOAT32, [1, DETECT, DETECT, 3])
    out = m.add_operand(T.TENSOR_FLOAT32, [1, DETECT, DETECT, 3])

    def scalar(t, v):
        k = m.add_operand(t)
        m.set_operand_value(k, v)
        return k

    def const(v):
        k = m.add_operand(T.TENSOR_FLOAT32, [1])
        m.set_operand_value(k, np.array([v], np.float32))
        return k
    none = scalar(T.INT32, 0)
    m.add_operation(Op.RESIZE_BILINEAR, [frame, scalar(T.INT32, DETECT), scalar(T.INT32, DETECT)],
                    [small])
    m.add_operation(Op.MUL, [small, const(2.0), none], [scaled])
    m.add_operation(Op.ADD, [scaled, const(-1.0), none], [out])
    m.identify_inputs_and_outputs([frame], [out])
    return m.finish()


def crop_model() -> nnrt.Model:
    """ROI_ALIGN: the box (x1, y1, x2, y2 in frame pixels) resampled to
    192 x 192, one bilinear sample per output pixel."""
    m = nnrt.Model()
    frame = m.add_operand(T.TENSOR_FLOAT32, [1, SIZE, SIZE, 3])
    box = m.add_operand(T.TENSOR_FLOAT32, [1, 4])
    batch = m.add_operand(T.TENSOR_INT32, [1])
    m.set_operand_value(batch, np.zeros(1, np.int32))
    out = m.add_operand(T.TENSOR_FLOAT32, [1, CROP, CROP, 3])
    args = []
    for t, v in ((T.INT32, CROP), (T.INT32, CROP), (T.FLOAT32, 1.0), (T.FLOAT32, 1.0),
                 (T.INT32, 1), (T.INT32, 1), (T.BOOL, False)):
        k = m.add_operand(t)
        m.set_operand_value(k, v)
        args.append(k)
    m.add_operation(Op.ROI_ALIGN, [frame, box, batch, *args], [out])
    m.identify_inputs_and_outputs([frame, box], [out])
    return m.finish()


def anchors() -> np.ndarray:
    """face_detection_short_range's 896 SSD anchor centres (x, y), as
    MediaPipe's SsdAnchorsCalculator makes them (strides 8, 16, 16, 16;
    two anchors per cell at stride 8, six at 16; fixed size)."""
    out = []
    for stride, per_cell in ((8, 2), (16, 6)):
        cells = DETECT // stride
        ys, xs = np.meshgrid((np.arange(cells) + 0.5) / cells, (np.arange(cells) + 0.5) / cells,
                             indexing="ij")
        grid = np.stack([xs.ravel(), ys.ravel()], axis=1)
        out.append(np.repeat(grid, per_cell, axis=0))
    return np.concatenate(out).astype(np.float32)


ANCHORS = anchors()


def face_box(regressors: np.ndarray, scores: np.ndarray):
    """The best face's box, a square 1.5x its larger side around its centre
    (as face mesh crops), kept inside the frame: (x1, y1, x2, y2) in frame
    pixels, and the face's score."""
    logits = np.clip(scores.reshape(-1), -100, 100)
    best = int(np.argmax(logits))
    score = 1 / (1 + np.exp(-logits[best]))
    raw = regressors.reshape(-1, 16)[best]
    cx, cy = raw[0] / DETECT + ANCHORS[best, 0], raw[1] / DETECT + ANCHORS[best, 1]
    side = 1.5 * max(raw[2], raw[3]) / DETECT
    side = min(max(side, 4 / SIZE), 1.0)
    x1 = min(max(cx - side / 2, 0.0), 1.0 - side)
    y1 = min(max(cy - side / 2, 0.0), 1.0 - side)
    box = np.array([[x1, y1, x1 + side, y1 + side]], np.float32) * SIZE
    return box, np.array([score], np.float32)


async def compile_all(rt, segment_devices=None, priority=Priority.HIGH):
    """The five compiled models; with ``segment_devices``, the segmenter on
    those and the others on the remaining devices."""
    load = nnrt.tflite.load
    others = None if segment_devices is None else \
        [d.name for d in rt.devices if d.name not in segment_devices]
    return {
        "detect_input": await rt.compile(detect_input_model(), priority=priority, devices=others),
        "detect": await rt.compile(load(str(DETECTOR)), priority=priority, devices=others),
        "crop": await rt.compile(crop_model(), priority=priority, devices=others),
        "landmarks": await rt.compile(load(str(LANDMARKS)), priority=priority, devices=others),
        "segment": await rt.compile(load(str(SEGMENTER)), priority=priority,
                                    devices=segment_devices),
    }


def stages(compiled) -> list:
    """The face pipeline: what feeds what."""
    return [
        Stage("detect_input", compiled["detect_input"], ["frame"]),
        Stage("detect", compiled["detect"], ["detect_input"]),
        Step("box", face_box, ["detect:regressors", "detect:classificators"],
             outputs=[((1, 4), np.float32), ((1,), np.float32)]),
        Stage("crop", compiled["crop"], ["frame", "box:0"]),
        Stage("landmarks", compiled["landmarks"], ["crop"]),
        Stage("segment", compiled["segment"], ["frame"]),
    ]


OUTPUTS = ["box:0", "box:1", "landmarks:0", "landmarks:1", "segment:0"]


# --- the same through LiteRT, one model after another ------------------------------

def resize_bilinear(image: np.ndarray, size: int) -> np.ndarray:
    """NNAPI's RESIZE_BILINEAR (no corner alignment, no half-pixel centres) in numpy."""
    n, h, w, c = image.shape
    out = []
    for length, axis in ((h, 1), (w, 2)):
        pos = np.arange(size, dtype=np.float32) * np.float32(length / size)
        low = np.floor(pos).astype(int)
        high = np.minimum(low + 1, length - 1)
        out.append((low, high, (pos - low).astype(np.float32)))
    (y0, y1, fy), (x0, x1, fx) = out
    rows = image[:, y0] * (1 - fy)[None, :, None, None] + image[:, y1] * fy[None, :, None, None]
    return rows[:, :, x0] * (1 - fx)[None, None, :, None] + rows[:, :, x1] * fx[None, None, :, None]


def roi_align(image: np.ndarray, box: np.ndarray, size: int) -> np.ndarray:
    """NNAPI's ROI_ALIGN of one box, one sample per output pixel, in numpy."""
    _, h, w, _ = image.shape
    x1, y1, x2, y2 = box.reshape(4)
    taps = []
    for start, extent, length in ((y1, y2 - y1, h), (x1, x2 - x1, w)):
        pos = start + (np.arange(size, dtype=np.float32) + 0.5) * np.float32(max(extent, 1) / size)
        low = np.floor(pos).astype(int)
        frac = (pos - low).astype(np.float32)
        edge = low >= length - 1
        low = np.where(edge, length - 1, low)
        taps.append((low, np.where(edge, length - 1, low + 1), np.where(edge, 0, frac)))
    (ylo, yhi, fy), (xlo, xhi, fx) = taps
    img = image[0]
    rows = img[ylo] * (1 - fy)[:, None, None] + img[yhi] * fy[:, None, None]
    return (rows[:, xlo] * (1 - fx)[None, :, None] + rows[:, xhi] * fx[None, :, None])[None]


class LiteRTSequential:
    """What an app writes on LiteRT alone: three interpreters, numpy between them."""

    def __init__(self, threads: int = 1):
        from ai_edge_litert.interpreter import Interpreter
        self.models = []
        for path in (DETECTOR, LANDMARKS, SEGMENTER):
            it = Interpreter(model_path=str(path), num_threads=threads)
            it.allocate_tensors()
            self.models.append(it)

    @staticmethod
    def invoke(it, *inputs):
        for detail, x in zip(it.get_input_details(), inputs):
            it.set_tensor(detail["index"], x)
        it.invoke()
        return [it.get_tensor(d["index"]) for d in it.get_output_details()]

    def detect(self, detect_input):
        out = self.invoke(self.models[0], detect_input)
        by_name = {d["name"]: o for d, o in zip(self.models[0].get_output_details(), out)}
        return by_name["regressors"], by_name["classificators"]

    def frame(self, frame: np.ndarray) -> dict[str, np.ndarray]:
        box, score = face_box(*self.detect(resize_bilinear(frame, DETECT) * 2 - 1))
        landmarks = self.invoke(self.models[1], roi_align(frame, box, CROP))
        (mask,) = self.invoke(self.models[2], frame)
        return dict(zip(OUTPUTS, (box, score, *landmarks, mask)))


# --- the app -------------------------------------------------------------------------

async def run(frames: list[np.ndarray], deadline_ms: float | None, check: int) -> int:
    async with nnrt.Runtime(litert=2, discover=False) as rt:
        compiled = await compile_all(rt)
        kept, latencies, faces = {}, [], 0
        async with rt.pipeline(stages(compiled), in_flight=2, outputs=OUTPUTS) as pipe:
            began = time.perf_counter()
            deadline = None if deadline_ms is None else deadline_ms / 1000
            async for result in pipe.run(frames, deadline_per_frame=deadline):
                if result.dropped_at is None:
                    latencies.append(result.latency)
                    faces += bool(result.outputs["box:1"][0] > FACE_SCORE)
                    if result.index < check:
                        kept[result.index] = result.outputs
            seconds = time.perf_counter() - began
            stats = pipe.statistics()
        print(pipe)
        print(f"{len(frames)} frames in {seconds:.2f} s: {len(frames) / seconds:.1f} fps; "
              f"face found on {faces}; latency p50 {1e3 * statistics.median(latencies):.1f} ms; "
              f"dropped {sum(stats.dropped.values())} {stats.dropped}")
        print("stage costs (ms):", {k: round(v * 1e3, 2) for k, v in stats.stage_seconds.items()})
    return compare(frames, kept)


def compare(frames, kept: dict[int, dict]) -> int:
    """The pipeline's outputs against LiteRT's, model after model: the same
    box, and each model's outputs within float noise of LiteRT's own
    (nnrt's resize and crop run NNAPI's kernels, LiteRT's app numpy's)."""
    lite = LiteRTSequential()
    worst = {}
    for index, outputs in sorted(kept.items()):
        expected = lite.frame(frames[index])
        for name, value in outputs.items():
            scale = max(float(np.max(np.abs(expected[name]))), 1e-6)
            worst[name] = max(worst.get(name, 0.0),
                              float(np.max(np.abs(value - expected[name]))) / scale)
    print(f"checked {len(kept)} frames against LiteRT one model after another; largest "
          f"difference relative to the output's range: "
          + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))
    bad = {k: v for k, v in worst.items() if v > 1e-3}
    if bad:
        print(f"MISMATCH: {bad}")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="face_pipeline", description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=120, help="camera frames (default 120)")
    parser.add_argument("--deadline-ms", type=float, default=None,
                        help="each frame's deadline after its submission (default: none)")
    parser.add_argument("--check", type=int, default=8,
                        help="frames checked against LiteRT one model after another (default 8)")
    args = parser.parse_args(argv)
    if args.frames < 1:
        parser.error("--frames must be at least 1")
    for path in (DETECTOR, SEGMENTER, LANDMARKS):
        if not path.exists():
            sys.exit(f"{path} is missing (see the docstring of {__file__})")
    return anyio.run(run, camera(args.frames), args.deadline_ms, args.check)


if __name__ == "__main__":
    sys.exit(main())
