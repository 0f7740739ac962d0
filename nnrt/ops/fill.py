"""Tensors made from shapes (HAL 1.3): FILL (a tensor of one value) and RANK."""
from __future__ import annotations

import numpy as np

from ..model.types import HalVersion, OperandType as T, OperationType
from .registry import Call, OpView, register

_VALUE_TYPE = {T.TENSOR_FLOAT32: T.FLOAT32, T.TENSOR_FLOAT16: T.FLOAT16, T.TENSOR_INT32: T.INT32}


def _validate_fill(op: OpView) -> HalVersion:
    op.expect_counts(2, 1)
    out = op.outputs[0].type
    if out not in _VALUE_TYPE:
        raise op.fail(f"output 0 has type {out.name}; accepted: "
                      f"{', '.join(t.name for t in _VALUE_TYPE)}")
    op.expect_types([T.TENSOR_INT32, _VALUE_TYPE[out]], [out])
    op.expect_rank(0, 1)
    dims = op.value(0)
    if dims is not None and (np.asarray(dims) < 0).any():
        raise op.fail(f"negative dimension in {np.asarray(dims).tolist()}")
    return HalVersion.V1_3


def _fill_shape(op: OpView) -> list[tuple[int, ...]]:
    dims = op.value(0)
    if dims is not None:
        return [tuple(int(d) for d in np.asarray(dims).reshape(-1))]
    known = op.dims(0)
    return [(0,) * known[0]] if len(known) == 1 and known[0] else [()]


def _fill(call: Call) -> list[np.ndarray]:
    dims, value = call.ins
    shape = tuple(int(d) for d in np.asarray(dims.value).reshape(-1))
    if any(d < 0 for d in shape):
        raise call.fail(f"negative dimension in {list(shape)}")
    return [np.full(shape, value.value, dtype=call.outs[0].type.dtype)]


def _validate_rank(op: OpView) -> HalVersion:
    op.expect_counts(1, 1)
    if not op.inputs[0].type.is_tensor:
        raise op.fail(f"input 0 must be a tensor, got {op.inputs[0].type.name}")
    op.expect_types([None], [T.INT32])
    return HalVersion.V1_3


def _rank(call: Call) -> list:
    return [np.int32(np.ndim(call.ins[0].value))]


register(OperationType.FILL, validate=_validate_fill, shape=_fill_shape, kernel=_fill)
register(OperationType.RANK, validate=_validate_rank, shape=lambda op: [()], kernel=_rank)
