"""The operations of nnrt's ``com.nnrt.tflite`` extension: TFLite builtins
with no NNAPI twin (``nnrt/extensions/tflite.py`` defines them). They are
registered by (extension, type within), so the reference driver runs them
like NNAPI's own and validation infers their output shapes.

RANGE's kernel adds ``delta`` one step after the other in the output type,
as TFLite's does, so float ranges round the same way. RFFT2D computes in
float64 (numpy's pocketfft) and rounds once to float32; TFLite's kernel also
works in double (Ooura's rdft2d), so the two differ by the last bits only.
"""
from __future__ import annotations

import numpy as np

from ..extensions import tflite as ext
from ..model.types import HalVersion as V, OperandType as T
from .registry import Call, OpView, register_extension

_RANGE_TYPES = (T.TENSOR_INT32, T.TENSOR_FLOAT32)
_MAX_RANGE = 1 << 28   # elements: a bound on what one RANGE may allocate


# --- RANGE ------------------------------------------------------------------------

def _range_validate(op: OpView) -> V:
    op.expect_counts(3, 1)
    t = op.expect_type_in(0, _RANGE_TYPES)
    op.expect_types([t, t, t], [t])
    for i in range(3):
        dims = op.dims(i)
        if dims and all(dims) and int(np.prod(dims)) != 1:
            raise op.fail(f"input {i} (operand {op.operation.inputs[i]}) must hold one value, "
                          f"has dimensions {list(dims)}")
    out = op.outputs[0].dimensions
    if out and len(out) != 1:
        raise op.fail(f"output 0 must have rank 1, declared {list(out)}")
    return V.V1_2


def _range_size(start, limit, delta, fail) -> int:
    """TFLite's element count; ``fail(message)`` makes the error to raise."""
    if delta == 0:
        raise fail("delta is 0")
    if (start > limit and delta > 0) or (start < limit and delta < 0):
        raise fail(f"delta {delta} moves away from limit {limit} (start {start})")
    if isinstance(start, (int, np.integer)):
        size = (abs(int(limit) - int(start)) + abs(int(delta)) - 1) // abs(int(delta))
    else:
        size = int(np.ceil(np.abs((np.float32(limit) - np.float32(start)) / np.float32(delta))))
    if size > _MAX_RANGE:
        raise fail(f"{size} elements is more than one RANGE may make ({_MAX_RANGE})")
    return size


def _range_shape(op: OpView) -> list[tuple[int, ...]]:
    values = [op.value(i) for i in range(3)]
    if any(v is None for v in values):
        return [(0,)]   # known when it runs: a dynamic output shape
    scalars = [np.asarray(v).reshape(-1)[0] for v in values]
    return [(_range_size(*scalars, op.fail) or 0,)]


def range_values(start, limit, delta, dtype, fail) -> np.ndarray:
    """TFLite's RANGE of one-element ``start``, ``limit``, ``delta`` in
    ``dtype`` (int32 or float32); ``fail(message)`` makes the error to raise.
    The TFLite importer folds constant RANGEs with it."""
    start, limit, delta = (np.asarray(v, dtype).reshape(-1) for v in (start, limit, delta))
    if start.size != 1 or limit.size != 1 or delta.size != 1:
        raise fail("start, limit and delta must hold one value each")
    size = _range_size(start[0], limit[0], delta[0], fail)
    if np.dtype(dtype) == np.int32:
        return (start[0] + delta[0] * np.arange(size, dtype=np.int64)).astype(np.int32)
    steps = np.full(size, delta[0], np.float32)
    if size:
        steps[0] = start[0]
    return np.cumsum(steps, dtype=np.float32)   # sequential float32 sums, as TFLite adds


def _range_kernel(call: Call) -> list[np.ndarray]:
    return [range_values(*(a.value for a in call.ins), call.outs[0].type.dtype, call.fail)]


register_extension(ext.EXTENSION, ext.RANGE, validate=_range_validate, shape=_range_shape,
                   kernel=_range_kernel)


# --- RFFT2D -----------------------------------------------------------------------

def _fft_length(op: OpView) -> tuple[int, int]:
    value = op.value(1)
    if value is None:
        raise op.fail("input 1 (fft_length) must be a constant")
    length = [int(v) for v in np.asarray(value).reshape(-1)]
    if len(length) != 2 or any(n < 1 or n & (n - 1) for n in length):
        raise op.fail(f"fft_length {length} must be two powers of two")
    return length[0], length[1]


def _rfft2d_validate(op: OpView) -> V:
    op.expect_counts(2, 1)
    op.expect_types([T.TENSOR_FLOAT32, T.TENSOR_INT32], [T.TENSOR_FLOAT32])
    op.expect_rank(0, 2, 3, 4, 5, 6)
    op.expect_rank(1, 1)
    _fft_length(op)
    return V.V1_2


def _rfft2d_shape(op: OpView) -> list[tuple[int, ...]]:
    height, width = _fft_length(op)
    dims = op.dims(0)
    if not dims:
        return [()]
    return [tuple(dims[:-2]) + (height, 2 * (width // 2 + 1))]


def _rfft2d_kernel(call: Call) -> list[np.ndarray]:
    x = np.asarray(call.ins[0].value, np.float64)
    height, width = (int(v) for v in np.asarray(call.ins[1].value).reshape(-1))
    spectrum = np.fft.rfft2(x, s=(height, width), axes=(-2, -1)).astype(np.complex64)
    return [spectrum.view(np.float32)]   # (real, imaginary) interleaved, as complex64 is


register_extension(ext.EXTENSION, ext.RFFT2D, validate=_rfft2d_validate, shape=_rfft2d_shape,
                   kernel=_rfft2d_kernel)
