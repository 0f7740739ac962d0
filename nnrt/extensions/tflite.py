"""The ``com.nnrt.tflite`` extension: TFLite builtins that NNAPI has no
operation for, and that cannot be written exactly with NNAPI's operations.
The TFLite importer emits them; the reference and litert drivers run them
(``nnrt/ops/tflite_builtins.py`` holds their validation, shapes and kernels).
The extension has no operand types of its own: its operations take and give
NNAPI tensors.

Operation ``RANGE`` (type within 0), TFLite's RANGE:

* inputs 0, 1, 2: ``start``, ``limit``, ``delta``, each a TENSOR_INT32 or
  TENSOR_FLOAT32 of one element (any rank), all of one type
* output 0: the same type, 1-D, ``ceil(|limit - start| / |delta|)`` elements
  ``start, start + delta, ...`` (floats added one after the other, as TFLite's
  kernel does). ``delta`` 0, or of the wrong sign, fails the execution.
  Unless the three inputs are constants, its length is known only when it
  runs: a dynamic output shape in NNAPI's sense.

Operation ``RFFT2D`` (type within 1), TFLite's RFFT2D:

* input 0: TENSOR_FLOAT32 of rank 2 to 6, its last two dimensions the signal
* input 1: TENSOR_INT32 [2], a constant: ``fft_length`` (height, width), each
  a power of two; the signal is cropped or padded with zeros to it
* output 0: TENSOR_FLOAT32 ``[..., height, 2 * (width / 2 + 1)]``: the
  complex result with its real and imaginary parts interleaved along the last
  dimension, the memory layout of TFLite's complex64 tensor. (Interleaving
  keeps the rank, so the NNAPI operations that read a part, STRIDED_SLICE
  with a stride of 2, take the tensors of rank up to 4 they accept.)
"""
from __future__ import annotations

from ..model.extensions import Extension, define_extension

NAME = "com.nnrt.tflite"

# Operation types within the extension.
RANGE = 0
RFFT2D = 1

EXTENSION = define_extension(Extension(
    NAME, operand_types=(), operation_names=((RANGE, "RANGE"), (RFFT2D, "RFFT2D"))))
