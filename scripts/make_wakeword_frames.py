"""Find 50 feature frames that make the vendored wake-word model fire, for
tests/data/wakeword/<model>.frames.npy.

    .venv/bin/python scripts/make_wakeword_frames.py [hey_jarvis]

The tests stream a microWakeWord model frame by frame and compare each
frame's output with LiteRT's. On random features the model answers 0 every
frame, which would compare nothing; real speech features are not at hand
(no audio front end is a dependency). So this searches for frames, from a
fixed seed and a fixed number of steps: a hill climb that mutates one frame
at a time (a new random frame, or noise added) and keeps the change when the
sum of the 50 outputs, plus 5 per distinct output value, does not drop —
outputs that rise from 0 towards 255 over the frames, through many values,
depending on the streaming state. LiteRT (XNNPACK) scores the candidates;
the tests compare with its reference kernels as well.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "wakeword"
FRAMES = 50
STEPS = 12000


def main(name: str = "hey_jarvis") -> int:
    from ai_edge_litert.interpreter import Interpreter

    model = (DATA / f"{name}.tflite").read_bytes()

    def outputs(frames) -> np.ndarray:
        interp = Interpreter(model_content=model)
        interp.allocate_tensors()
        x, y = interp.get_input_details()[0], interp.get_output_details()[0]
        out = []
        for frame in frames:
            interp.set_tensor(x["index"], frame)
            interp.invoke()
            out.append(int(interp.get_tensor(y["index"]).ravel()[0]))
        return np.array(out)

    rng = np.random.default_rng(5)
    shape = (1, 3, 40)

    def random_frame() -> np.ndarray:
        lo = int(rng.integers(-128, 0))
        return rng.integers(lo, int(rng.integers(lo + 1, 128)), shape).astype(np.int8)

    def score(out: np.ndarray) -> int:
        return int(out.sum()) + 5 * len(set(out.tolist()))

    frames = [random_frame() for _ in range(FRAMES)]
    best = score(outputs(frames))
    for _ in range(STEPS):
        trial = list(frames)
        k = int(rng.integers(FRAMES))
        if rng.random() < 0.5:
            trial[k] = random_frame()
        else:
            noisy = trial[k].astype(np.int64) + rng.integers(-20, 21, shape)
            trial[k] = np.clip(noisy, -128, 127).astype(np.int8)
        s = score(outputs(trial))
        if s >= best:
            frames, best = trial, s
    np.save(DATA / f"{name}.frames.npy", np.stack(frames))
    print(f"{name}: score {best}, outputs {outputs(frames).tolist()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
