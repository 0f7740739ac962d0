"""Run mediapipe's selfie_segmentation through the TFLite importer with its
custom op Convolution2DTransposeBias on the com.nnrt.mediapipe extension
driver and the rest on the reference device, and compare with LiteRT's
XNNPACK output stored beside the model.

    python scripts/selfie_extension.py [--service] [MODELS_DIR]

The app must be on the extensions allowlist (docs/vendors/extensions.md); this
script lists its own interpreter in a temporary XDG_CONFIG_HOME so that it
runs anywhere. With --service the extension driver runs as a driver service
(``nnrt driver serve mediapipe --driver mediapipe``) that checks the same
allowlist against this process's executable.
"""
import argparse
import asyncio
import os
import sys
import tempfile
from pathlib import Path

import numpy as np


async def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("models", nargs="?", default="/work/shared/models/mediapipe")
    parser.add_argument("--service", action="store_true")
    args = parser.parse_args()
    config = tempfile.TemporaryDirectory()
    (Path(config.name) / "nnrt").mkdir()
    (Path(config.name) / "nnrt" / "extensions-allowlist").write_text(
        f"# written by {__file__}\n{os.path.realpath(sys.executable)}\n")
    os.environ["XDG_CONFIG_HOME"] = config.name    # inherited by a spawned service

    import nnrt
    import nnrt.tflite
    from nnrt.drivers.mediapipe import MediapipeDevice
    from nnrt.drivers.reference import ReferenceDevice

    stem = Path(args.models) / "selfie_segmentation"
    model = nnrt.tflite.load(f"{stem}.tflite")
    x = np.load(f"{stem}.in0.npy")
    expected = np.load(f"{stem}.out0.npy")
    if args.service:
        runtime = nnrt.Runtime(spawn=[("mediapipe", "mediapipe")], discover=False)
    else:
        runtime = nnrt.Runtime(devices=[MediapipeDevice(), ReferenceDevice()])
    async with runtime as rt:
        compiled = await rt.compile(model)
        print("steps:", " -> ".join(f"{d.name}" for d in compiled.devices))
        result = await compiled.execute([x])
    got = result.outputs[0]
    err = float(np.max(np.abs(got - expected)))
    scale = float(np.max(np.abs(expected)))
    print(f"max abs error {err:.3g}, largest output magnitude {scale:.3g}, "
          f"relative {err / scale:.3g} (limit 1e-4)")
    return 0 if err <= 1e-4 * scale else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
