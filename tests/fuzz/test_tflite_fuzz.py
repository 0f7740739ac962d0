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
