"""Recurrent layers: RNN, SVDF (HAL 1.0) and UNIDIRECTIONAL_SEQUENCE_RNN,
BIDIRECTIONAL_SEQUENCE_RNN (HAL 1.2, state outputs HAL 1.3).

The LSTM family lives in ``lstm.py`` and reuses the signature helpers here.
Kernels loop over time steps only; the input projections of a whole sequence
are one matmul, each step does one matmul with the recurrent weights. Internal
arithmetic is float64 (float16 and relaxed models included), which keeps the
error of long recurrences well below the CTS tolerances.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..model.types import (FusedActivation, HalVersion, OperandLifeTime, OperandType as T,
                           OperationType)
from .common import apply_activation
from .registry import Arg, Call, OpView, register

FLOAT_TYPES = (T.TENSOR_FLOAT32, T.TENSOR_FLOAT16)


# --- signature helpers (shared with lstm.py) -------------------------------

def expect_float_signature(op: OpView, tensors: Sequence[int], ints: Sequence[int] = (),
                           float_scalars: Sequence[int] = (), bools: Sequence[int] = ()) -> T:
    """All tensor inputs ``tensors`` and every output share input 0's float
    type; float scalars are FLOAT32 for a TENSOR_FLOAT32 model and FLOAT16
    for a TENSOR_FLOAT16 one. Returns the tensor type."""
    t = op.expect_type_in(0, FLOAT_TYPES)
    scalar = T.FLOAT32 if t == T.TENSOR_FLOAT32 else T.FLOAT16
    want: list[T | None] = [None] * len(op.inputs)
    for group, typ in ((tensors, t), (ints, T.INT32), (float_scalars, scalar), (bools, T.BOOL)):
        for i in group:
            want[i] = typ
    op.expect_types(want, [t] * len(op.outputs))
    return t


def version_of(t: T) -> HalVersion:
    return HalVersion.V1_0 if t == T.TENSOR_FLOAT32 else HalVersion.V1_2


def expect_fuse_code(op: OpView, i: int) -> None:
    act = op.value(i)
    if act is not None and act not in tuple(FusedActivation):
        raise op.fail(f"input {i}: invalid fused activation {act}")


def dim(op: OpView, i: int, k: int) -> int:
    """Extent ``k`` of input ``i``, 0 when unknown."""
    d = op.dims(i)
    return d[k] if len(d) > k else 0


def maybe_omitted(op: OpView, i: int) -> bool | None:
    """True/False when it is known at compile time whether optional input
    ``i`` is omitted; None when it is a model input (the request decides)."""
    lifetime = op.inputs[i].lifetime
    if lifetime == OperandLifeTime.NO_VALUE:
        return True
    if lifetime == OperandLifeTime.SUBGRAPH_INPUT:
        return None
    return False


def real(arg: Arg) -> np.ndarray | None:
    """A float tensor argument as float64, None when omitted (or empty: an
    optional model input given with no buffer)."""
    if arg.value is None or np.size(arg.value) == 0:
        return None
    return np.asarray(arg.value, np.float64)


def required(call: Call, *indexes: int) -> list[np.ndarray]:
    """The float64 values of inputs that must be present."""
    values = []
    for i in indexes:
        v = real(call.ins[i])
        if v is None:
            raise call.fail(f"input {i} is required")
        values.append(v)
    return values


def time_major_view(x: np.ndarray, time_major: bool) -> np.ndarray:
    """[time, batch, ...] view of a sequence tensor."""
    return x if time_major else np.swapaxes(x, 0, 1)


# --- RNN cell -------------------------------------------------------------

def rnn_sequence(x_proj: np.ndarray, recurrent: np.ndarray, h: np.ndarray, act: int,
                 reverse: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Run a basic RNN over time-major pre-activations ``x_proj`` [T, B, N]
    (input projection + bias already included). Returns outputs [T, B, N]
    (at the time position of each input) and the last hidden state."""
    steps = x_proj.shape[0]
    out = np.empty_like(x_proj)
    order = range(steps - 1, -1, -1) if reverse else range(steps)
    rt = recurrent.T
    for t in order:
        h = apply_activation(x_proj[t] + h @ rt, act)
        out[t] = h
    return out, h


def _input_projection(x: np.ndarray, weights: np.ndarray,
                      bias: np.ndarray | None = None) -> np.ndarray:
    y = x @ weights.T
    return y if bias is None else y + bias


# --- RNN (HAL 1.0) ----------------------------------------------------------

def _validate_rnn(op: OpView) -> HalVersion:
    op.expect_counts(6, 2)
    t = expect_float_signature(op, tensors=range(5), ints=(5,))
    for i in (0, 1, 2, 4):
        op.expect_rank(i, 2)
    op.expect_rank(3, 1)
    expect_fuse_code(op, 5)
    return version_of(t)


def _shape_rnn(op: OpView) -> list[tuple[int, ...]]:
    out = (dim(op, 0, 0), dim(op, 1, 0))
    return [out, out]


def _kernel_rnn(call: Call) -> list[np.ndarray]:
    x, w, r, b, h = required(call, 0, 1, 2, 3, 4)
    act = call.ins[5].value
    h = apply_activation(x @ w.T + h @ r.T + b, act)
    dtype = call.outs[0].type.dtype
    return [h.astype(dtype), h.astype(dtype)]


register(OperationType.RNN, validate=_validate_rnn, shape=_shape_rnn, kernel=_kernel_rnn)


# --- UNIDIRECTIONAL_SEQUENCE_RNN (HAL 1.2) -----------------------------------

def _validate_seq_rnn(op: OpView) -> HalVersion:
    op.expect_counts(7, (1, 2))
    t = expect_float_signature(op, tensors=range(5), ints=(5, 6))
    op.expect_rank(0, 3)
    for i in (1, 2, 4):
        op.expect_rank(i, 2)
    op.expect_rank(3, 1)
    expect_fuse_code(op, 5)
    tm = op.value(6)
    if tm is not None and tm not in (0, 1):
        raise op.fail(f"input 6: time_major must be 0 or 1, got {tm}")
    # The final hidden state output came with HAL 1.3.
    return HalVersion.V1_3 if len(op.outputs) == 2 else HalVersion.V1_2


def _shape_seq_rnn(op: OpView) -> list[tuple[int, ...]]:
    units = dim(op, 1, 0)
    tm = op.value(6)
    if tm is None:
        seq = (0, 0, units)
        batch = 0
    else:
        seq = (dim(op, 0, 0), dim(op, 0, 1), units)
        batch = dim(op, 0, 1 if tm else 0)
    return [seq, (batch, units)][:len(op.outputs)]


def _kernel_seq_rnn(call: Call) -> list[np.ndarray]:
    x, w, r, b, h = required(call, 0, 1, 2, 3, 4)
    act = call.ins[5].value
    time_major = bool(call.ins[6].value)
    xs = time_major_view(x, time_major)
    out, h = rnn_sequence(_input_projection(xs, w, b), r, h, act)
    dtype = call.outs[0].type.dtype
    results = [time_major_view(out, time_major).astype(dtype)]
    if len(call.outs) == 2:
        results.append(h.astype(dtype))
    return results


register(OperationType.UNIDIRECTIONAL_SEQUENCE_RNN, validate=_validate_seq_rnn,
         shape=_shape_seq_rnn, kernel=_kernel_seq_rnn)


# --- BIDIRECTIONAL_SEQUENCE_RNN (HAL 1.2) ------------------------------------
# Inputs: 0 input, 1-4 fw (weights, recurrent, bias, hidden), 5-8 bw,
# 9 aux input, 10 fw aux weights, 11 bw aux weights, 12 activation,
# 13 time_major, 14 merge_outputs.
# Aux input with aux weights = cross-linking (both directions read input and
# aux input); aux input without aux weights = parallel linking (HAL 1.3: the
# backward cell reads the aux input instead of the input).

def _validate_bidi_rnn(op: OpView) -> HalVersion:
    op.expect_counts(15, (1, 2, 3, 4))
    expect_float_signature(op, tensors=range(12), ints=(12,), bools=(13, 14))
    op.expect_rank(0, 3)
    for i in (1, 2, 4, 5, 6, 8):
        op.expect_rank(i, 2)
    for i in (3, 7):
        op.expect_rank(i, 1)
    expect_fuse_code(op, 12)
    # One sequence output when merged (1 or 3 outputs), two otherwise; the
    # two trailing final-state outputs came with HAL 1.3.
    n = len(op.outputs)
    merge = op.value(14)
    if merge is not None and bool(merge) != (n % 2 == 1):
        raise op.fail(f"{n} outputs do not fit merge_outputs={bool(merge)}")
    version = HalVersion.V1_3 if n >= 3 else HalVersion.V1_2
    if maybe_omitted(op, 9) is False and maybe_omitted(op, 10) is True:
        version = HalVersion.V1_3  # parallel linking
    return version


def bidi_sequence_shape(op: OpView, fw: tuple[int, int], bw: tuple[int, int],
                        time_major: int) -> list[tuple[int, ...]]:
    """Outputs of BIDIRECTIONAL_SEQUENCE_RNN/LSTM: the sequence output(s),
    merged (an odd output count) or one per direction, then each direction's
    final states. ``fw``/``bw`` are (units input, output-size input) indexes
    whose dim 0 / dim 1 give the state widths; ``time_major`` the flag's input."""
    fw_units, fw_out = dim(op, fw[0], 0), dim(op, fw[1], 1 if fw[1] != fw[0] else 0)
    bw_units, bw_out = dim(op, bw[0], 0), dim(op, bw[1], 1 if bw[1] != bw[0] else 0)
    tm = op.value(time_major)
    if tm is None:
        lead, batch = (0, 0), 0
    else:
        lead = (dim(op, 0, 0), dim(op, 0, 1))
        batch = dim(op, 0, 1 if tm else 0)
    if len(op.outputs) % 2 == 1:
        seqs = [lead + (fw_out + bw_out if fw_out and bw_out else 0,)]
    else:
        seqs = [lead + (fw_out,), lead + (bw_out,)]
    states = [(batch, fw_out), (batch, fw_units), (batch, bw_out), (batch, bw_units)] \
        if fw[1] != fw[0] else [(batch, fw_units), (batch, bw_units)]
    return (seqs + states)[:len(op.outputs)]


def _shape_bidi_rnn(op: OpView) -> list[tuple[int, ...]]:
    return bidi_sequence_shape(op, (1, 1), (5, 5), 13)


def _kernel_bidi_rnn(call: Call) -> list[np.ndarray]:
    ins = call.ins
    x, fw_w, fw_r, fw_b, fw_h, bw_w, bw_r, bw_b, bw_h = required(call, *range(9))
    aux, fw_aux_w, bw_aux_w = (real(a) for a in ins[9:12])
    act = ins[12].value
    time_major, merge = bool(ins[13].value), bool(ins[14].value)
    if merge != (len(call.outs) % 2 == 1):
        raise call.fail(f"{len(call.outs)} outputs do not fit merge_outputs={merge}")

    xs = time_major_view(x, time_major)
    fw_proj = _input_projection(xs, fw_w, fw_b)
    if aux is not None:
        auxs = time_major_view(aux, time_major)
        if fw_aux_w is not None and bw_aux_w is not None:
            fw_proj = fw_proj + auxs @ fw_aux_w.T
            bw_proj = _input_projection(xs, bw_w, bw_b) + auxs @ bw_aux_w.T
        elif fw_aux_w is None and bw_aux_w is None:
            bw_proj = _input_projection(auxs, bw_w, bw_b)
        else:
            raise call.fail("aux weights must be both given or both omitted")
    else:
        if fw_aux_w is not None or bw_aux_w is not None:
            raise call.fail("aux weights given without an aux input")
        bw_proj = _input_projection(xs, bw_w, bw_b)

    fw_out, fw_last = rnn_sequence(fw_proj, fw_r, fw_h, act)
    bw_out, bw_last = rnn_sequence(bw_proj, bw_r, bw_h, act, reverse=True)
    dtype = call.outs[0].type.dtype
    if merge:
        seqs = [np.concatenate([fw_out, bw_out], axis=-1)]
    else:
        seqs = [fw_out, bw_out]
    results = [time_major_view(s, time_major).astype(dtype) for s in seqs]
    if len(call.outs) > len(results):
        results += [fw_last.astype(dtype), bw_last.astype(dtype)]
    return results


register(OperationType.BIDIRECTIONAL_SEQUENCE_RNN, validate=_validate_bidi_rnn,
         shape=_shape_bidi_rnn, kernel=_kernel_bidi_rnn)


# --- SVDF (HAL 1.0) -----------------------------------------------------------
# state is [batch, num_filters * memory_size] (num_filters = num_units * rank),
# each filter's memory oldest first. NNAPI's reference writes the new feature
# activation into the last memory slot of a copy of state_in, computes the
# output from it, then shifts every memory left by one with a 0 at the end:
# state_out is that shifted memory (its last slot always 0).

def _validate_svdf(op: OpView) -> HalVersion:
    op.expect_counts(7, 2)
    t = expect_float_signature(op, tensors=range(5), ints=(5, 6))
    for i in (0, 1, 2, 4):
        op.expect_rank(i, 2)
    op.expect_rank(3, 1)
    rank = op.value(5)
    if rank is not None:
        if rank < 1:
            raise op.fail(f"input 5: rank must be positive, got {rank}")
        filters = dim(op, 1, 0)
        if filters and filters % rank:
            raise op.fail(f"input 1: {filters} filters is not a multiple of rank {rank}")
    expect_fuse_code(op, 6)
    return version_of(t)


def _shape_svdf(op: OpView) -> list[tuple[int, ...]]:
    batch, filters, memory = dim(op, 0, 0), dim(op, 1, 0), dim(op, 2, 1)
    rank = op.value(5)
    units = filters // rank if rank and filters else 0
    return [(batch, filters * memory), (batch, units)]


def _kernel_svdf(call: Call) -> list[np.ndarray]:
    x, w_feature, w_time, state_in = required(call, 0, 1, 2, 4)
    bias = real(call.ins[3])
    rank, act = call.ins[5].value, call.ins[6].value
    batch = x.shape[0]
    filters, memory = w_time.shape
    if filters % rank:
        raise call.fail(f"{filters} filters is not a multiple of rank {rank}")
    state = state_in.reshape(batch, filters, memory).copy()
    state[:, :, -1] = x @ w_feature.T
    per_filter = np.einsum("bfm,fm->bf", state, w_time)
    out = per_filter.reshape(batch, filters // rank, rank).sum(axis=2)
    if bias is not None:
        out = out + bias
    out = apply_activation(out, act)
    state_out = np.zeros_like(state)
    state_out[:, :, :-1] = state[:, :, 1:]
    dtype = call.outs[0].type.dtype
    return [state_out.reshape(batch, filters * memory).astype(dtype), out.astype(dtype)]


register(OperationType.SVDF, validate=_validate_svdf, shape=_shape_svdf, kernel=_kernel_svdf)
