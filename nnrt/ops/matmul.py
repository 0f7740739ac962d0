"""BATCH_MATMUL (NNAPI feature level 6): ``output[..., :, :] = op(lhs[..., :, :]) ·
op(rhs[..., :, :])`` where ``op`` transposes the last two dimensions when the
input's adjoint flag (adj_x, adj_y) is set (the types are real, so the
adjoint is the transpose).

What NeuralNetworks.h asks, and what is refused otherwise:

* float16, float32, int32 and TENSOR_QUANT8_ASYMM_SIGNED only — not
  TENSOR_QUANT8_ASYMM (it lists no unsigned 8-bit type for this operation);
  lhs, rhs and output of one type;
* inputs of rank 2 to 4, both of the same rank and with the same batch
  dimensions: NNAPI says "the same batch size", and the output takes lhs's
  batch dimensions. There is no broadcasting (TFLite's BATCH_MATMUL has it;
  its importer makes the batch dimensions equal first);
* inputs 2 and 3 are BOOL scalars (adj_x, adj_y); omitted means false.

Quantized: exact integer sums of (lhs - zero point) x (rhs - zero point),
rescaled once by lhs scale x rhs scale / output scale with TFLite's
fixed-point multiplier (:func:`~.common.quantize_multiplier`, product of the
scales in double as TFLite's kernel takes it), then saturated. NNAPI states no
rule on the zero points or on the output scale beyond their type's.
"""
from __future__ import annotations

import numpy as np

from ..model.types import HalVersion as V, OperandType as T, OperationType
from .common import check_quant_params, multiply_by_quantized_multiplier, qrange, quantize_multiplier
from .registry import Call, OpView, register

_TYPES = (T.TENSOR_FLOAT32, T.TENSOR_FLOAT16, T.TENSOR_INT32, T.TENSOR_QUANT8_ASYMM_SIGNED)


def _flag(op: OpView, i: int) -> bool | None:
    """The value of adjoint flag ``i`` (omitted: false); None when it is only
    known at execution."""
    if op.is_omitted(i):
        return False
    value = op.value(i)
    return None if value is None else bool(value)


def _product_dims(lhs, rhs, adj_x: bool | None, adj_y: bool | None):
    """(rows, depth of lhs, depth of rhs, cols) of the product; 0 = unknown."""
    def pick(dims, flag, transposed: bool):
        a, b = dims[-2], dims[-1]
        if flag is None:
            return a if a == b else 0
        return b if flag == transposed else a
    rows, depth_x = pick(lhs, adj_x, True), pick(lhs, adj_x, False)
    depth_y, cols = pick(rhs, adj_y, True), pick(rhs, adj_y, False)
    return rows, depth_x, depth_y, cols


def _validate(op: OpView) -> V:
    op.expect_counts(4, 1)
    t = op.expect_type_in(0, _TYPES)
    op.expect_types([t, t, T.BOOL, T.BOOL], [t])
    check_quant_params(op)
    for i in (0, 1):
        op.expect_rank(i, 2, 3, 4)
    if (r := op.rank(0)) is not None and (s := op.rank(1)) is not None:
        if r != s:
            raise op.fail(f"input 0 (operand {op.operation.inputs[0]}) has rank {r} and input 1 "
                          f"(operand {op.operation.inputs[1]}) rank {s}: NNAPI multiplies "
                          f"tensors of one rank, without broadcasting")
        lhs, rhs = op.dims(0), op.dims(1)
        for d, (a, b) in enumerate(zip(lhs[:-2], rhs[:-2])):
            if a and b and a != b:
                raise op.fail(f"batch dimension {d} is {a} in input 0 and {b} in input 1; "
                              f"NNAPI wants the same batch size")
        _, depth_x, depth_y, _ = _product_dims(lhs, rhs, _flag(op, 2), _flag(op, 3))
        if depth_x and depth_y and depth_x != depth_y:
            raise op.fail(f"input 0 gives {depth_x} columns to multiply with input 1's "
                          f"{depth_y} rows (shapes {list(lhs)} and {list(rhs)}, adj_x "
                          f"{_flag(op, 2)}, adj_y {_flag(op, 3)})")
    return V.FL6


def _shape(op: OpView) -> list[tuple[int, ...]]:
    r, s = op.rank(0), op.rank(1)
    if r is None and s is None:
        return [()]
    rank = r if r is not None else s
    lhs = op.dims(0) if r is not None else (0,) * rank
    rhs = op.dims(1) if s is not None else (0,) * rank
    batch = tuple(a or b for a, b in zip(lhs[:-2], rhs[:-2]))
    rows, _, _, cols = _product_dims(lhs, rhs, _flag(op, 2), _flag(op, 3))
    return [batch + (rows, cols)]


def _kernel(call: Call) -> list[np.ndarray]:
    lhs, rhs, adj_x, adj_y = call.ins
    out = call.outs[0]
    x, y = lhs.value, rhs.value
    if not adj_x.omitted and adj_x.value:
        x = np.swapaxes(x, -1, -2)
    if not adj_y.omitted and adj_y.value:
        y = np.swapaxes(y, -1, -2)
    if x.ndim != y.ndim or x.shape[:-2] != y.shape[:-2] or x.shape[-1] != y.shape[-2] \
            or 0 in x.shape[-2:] or 0 in y.shape[-2:]:
        raise call.fail(f"cannot multiply {lhs.value.shape} by {rhs.value.shape} "
                        f"(adjoint flags applied: {x.shape} by {y.shape})")
    if lhs.type == T.TENSOR_QUANT8_ASYMM_SIGNED:
        acc = np.matmul(x.astype(np.int64) - lhs.zero_point, y.astype(np.int64) - rhs.zero_point)
        # TFLite's GetQuantizedConvolutionMultipler takes the product of the
        # two float32 scales in double; NNAPI's CPU path rounds it to float32
        # first. The litert driver runs TFLite's, so this is that one.
        real = (np.float64(np.float32(lhs.scale)) * np.float64(np.float32(rhs.scale))
                / np.float64(np.float32(out.scale)))
        multiplier, shift = quantize_multiplier(float(real))
        q = multiply_by_quantized_multiplier(acc, multiplier, shift) + out.zero_point
        lo, hi = qrange(out.type)
        return [np.clip(q, lo, hi).astype(np.int8)]
    if lhs.type == T.TENSOR_INT32:
        # int64 sums wrap as int32 ones do once cut to 32 bits.
        return [np.matmul(x.astype(np.int64), y.astype(np.int64)).astype(np.int32)]
    # float64 sums, one rounding to the output type: the product NNAPI's
    # tolerance is measured from.
    real = np.matmul(x.astype(np.float64), y.astype(np.float64))
    return [real.astype(out.type.dtype)]


register(OperationType.BATCH_MATMUL, validate=_validate, shape=_shape, kernel=_kernel)
