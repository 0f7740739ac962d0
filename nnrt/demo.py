"""`make demo`: build a small model, compile it, execute it, print outputs and timing.

The model is a tiny image classifier head: CONV_2D (3x3, ReLU) on a 1x8x8x3
image, then ADD of a bias map, then MUL by a gain; it runs through
``nnrt.Runtime`` on the reference CPU device, once plainly and then as a
burst of frames, and prints outputs, output shapes and timing.
"""
from __future__ import annotations

import time

import anyio
import numpy as np

import nnrt
from nnrt import OperandType as T, OperationType as Op


def build_model() -> nnrt.Model:
    rng = np.random.default_rng(7)
    m = nnrt.Model()
    image = m.add_operand(T.TENSOR_FLOAT32, [1, 8, 8, 3])
    weights = m.add_operand(T.TENSOR_FLOAT32, [4, 3, 3, 3])
    m.set_operand_value(weights, rng.standard_normal((4, 3, 3, 3)).astype(np.float32))
    bias = m.add_operand(T.TENSOR_FLOAT32, [4])
    m.set_operand_value(bias, np.array([0.1, -0.2, 0.3, 0.0], np.float32))
    scalars = {}
    for name, value in (("pad", 1), ("stride", 1), ("relu", 1), ("none", 0)):
        scalars[name] = m.add_operand(T.INT32)
        m.set_operand_value(scalars[name], value)
    features = m.add_operand(T.TENSOR_FLOAT32, [1, 8, 8, 4])
    m.add_operation(Op.CONV_2D, [image, weights, bias, scalars["pad"], scalars["stride"],
                                 scalars["stride"], scalars["relu"]], [features])
    offset = m.add_operand(T.TENSOR_FLOAT32, [1, 8, 8, 4])
    shifted = m.add_operand(T.TENSOR_FLOAT32, [1, 8, 8, 4])
    m.add_operation(Op.ADD, [features, offset, scalars["none"]], [shifted])
    gain = m.add_operand(T.TENSOR_FLOAT32, [1])
    m.set_operand_value(gain, np.array([0.5], np.float32))
    out = m.add_operand(T.TENSOR_FLOAT32, [1, 8, 8, 4])
    m.add_operation(Op.MUL, [shifted, gain, scalars["none"]], [out])
    m.identify_inputs_and_outputs([image, offset], [out])
    return m.finish()


async def main() -> None:
    model = build_model()
    rng = np.random.default_rng(1)
    image = rng.random((1, 8, 8, 3), dtype=np.float32)
    offset = np.full((1, 8, 8, 4), 0.25, np.float32)
    async with nnrt.Runtime() as rt:
        for d in rt.devices:
            print(f"device: {d.name} ({d.type.name}, {d.version_string}, "
                  f"feature level {d.feature_level})")
        compiled = await rt.compile(model, priority=nnrt.Priority.HIGH)
        result = await compiled.execute([image, offset], measure_timing=True)
        out = result.outputs[0]
        print(f"output shape: {result.output_shapes[0]}")
        print(f"output[0, 0, :4, :]:\n{np.array2string(out[0, 0, :4, :], precision=4)}")
        print(f"timing: on device {result.timing.on_device} us, "
              f"in driver {result.timing.in_driver} us")
        frames = 30
        start = time.perf_counter()
        async with compiled.burst() as burst:
            for _ in range(frames):
                await burst.execute([image, offset])
        elapsed = time.perf_counter() - start
        print(f"burst: {frames} frames in {elapsed * 1e3:.1f} ms "
              f"({elapsed / frames * 1e6:.0f} us per frame)")


if __name__ == "__main__":
    anyio.run(main)
