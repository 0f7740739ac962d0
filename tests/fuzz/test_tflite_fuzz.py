"""Corrupted .tflite files: the importer either builds a model or raises
NnrtError INVALID_ARGUMENT — never another exception (a bare IndexError,
struct.error from the flatbuffer reader, ...)."""
from pathlib import Path

import numpy as np
import pytest

import nnrt
import nnrt.tflite

DATA = Path(__file__).resolve().parents[1] / "data" / "tflite"


@pytest.mark.parametrize("stem", ["float_chain", "int8_chain", "if_add_or_mul"])
def test_mutated_files_load_or_raise_invalid_argument(stem):
    data = (DATA / f"{stem}.tflite").read_bytes()
    rng = np.random.default_rng(sum(map(ord, stem)))
    outcomes = {"loaded": 0, "refused": 0}
    for _ in range(300):
        mutated = bytearray(data)
        for _ in range(int(rng.integers(1, 4))):
            mutated[int(rng.integers(8, len(mutated)))] = int(rng.integers(0, 256))
        try:
            nnrt.tflite.load(bytes(mutated))
            outcomes["loaded"] += 1
        except nnrt.NnrtError as e:
            assert e.status == nnrt.ErrorStatus.INVALID_ARGUMENT
            outcomes["refused"] += 1
    assert outcomes["refused"] > 0  # the mutations do reach the checks


async def test_mutated_mediapipe_custom_options_import_or_raise_invalid_argument():
    """face_landmark_with_attention's flexbuffer options with bytes changed:
    each custom op alone imports or is refused, and what imports the
    mediapipe driver supports and prepares or refuses with INVALID_ARGUMENT."""
    from dataclasses import replace
    from nnrt.drivers.mediapipe import MediapipeDevice
    from nnrt.tflite import load_operators
    from nnrt.tflite.reader import read
    path = DATA.parent / "mediapipe" / "face_landmark_with_attention.tflite"
    file = read(path.read_bytes(), path.name)
    graph = file.graphs[0]
    originals = {op.index: op for op in graph.operators if op.custom_options
                 and op.name.startswith("CUSTOM:")}
    rng = np.random.default_rng(41)
    device = MediapipeDevice()
    outcomes = {"prepared": 0, "refused": 0}
    for _ in range(300):
        k = int(rng.choice(list(originals)))
        mutated = bytearray(originals[k].custom_options)
        for _ in range(int(rng.integers(1, 4))):
            mutated[int(rng.integers(0, len(mutated)))] = int(rng.integers(0, 256))
        graph.operators[k] = replace(originals[k], custom_options=bytes(mutated))
        try:
            hal = load_operators(file, 0, [k]).hal_model
            assert len(await device.supported_operations(hal)) == 1
            (await device.prepare_model(hal)).release()
            outcomes["prepared"] += 1
        except nnrt.NnrtError as e:
            assert e.status == nnrt.ErrorStatus.INVALID_ARGUMENT, e.message
            outcomes["refused"] += 1
        finally:
            graph.operators[k] = originals[k]
    assert outcomes["refused"] > 0 and outcomes["prepared"] > 0
