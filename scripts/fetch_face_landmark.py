"""Fetch face_landmark.tflite (MediaPipe face mesh's landmark model, 192x192
input, 468 landmarks) into tests/data/mediapipe/, as ../shared/models gets
its mediapipe models: from the mediapipe 0.10.21 wheel, unchanged.

    python scripts/fetch_face_landmark.py [--wheel PATH.whl]

Without ``--wheel`` it runs ``pip download mediapipe==0.10.21 --no-deps``
(the cp311 manylinux_2_28_x86_64 wheel) into a temporary folder. The file's
SHA-256 is checked against the one committed.
"""
from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

MEMBER = "mediapipe/modules/face_landmark/face_landmark.tflite"
SHA256 = "1055cb9d4a9ca8b8c688902a3a5194311138ba256bcc94e336d8373a5f30c814"
TARGET = Path(__file__).resolve().parents[1] / "tests" / "data" / "mediapipe" / "face_landmark.tflite"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheel", type=Path, help="a mediapipe 0.10.21 wheel already here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        wheel = args.wheel
        if wheel is None:
            subprocess.run([sys.executable, "-m", "pip", "download", "mediapipe==0.10.21",
                            "--no-deps", "--only-binary", ":all:", "--python-version", "3.11",
                            "--platform", "manylinux_2_28_x86_64", "-d", folder], check=True)
            wheel = next(Path(folder).glob("mediapipe-*.whl"))
        data = zipfile.ZipFile(wheel).read(MEMBER)
    digest = hashlib.sha256(data).hexdigest()
    if digest != SHA256:
        sys.exit(f"{MEMBER} in {wheel} has SHA-256 {digest}, expected {SHA256}")
    TARGET.write_bytes(data)
    print(f"wrote {TARGET} ({len(data)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
