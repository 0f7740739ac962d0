"""nnrt's own NNAPI feature level 6 test vectors (BATCH_MATMUL and PACK), in
the ``nnrt-cts-json/1`` format of ``../shared/cts`` (SCHEMA.md), so the CTS
runner checks them like the shared ones.

The shared vector set stops at HAL 1.2 (Android 11), so these cases cover
what a feature level 6 CTS would: each data type NeuralNetworks.h lists for
the two operations, adjoint flags, ranks 2 to 4, PACK on the first, a middle
and the last axis and with one input, and validation cases the runtime must
refuse (what the header leaves out: unsigned 8-bit BATCH_MATMUL, broadcast
batch dimensions, a negative PACK axis, mismatched quantization...).
Expected values are computed here with numpy formulas of their own
(``einsum`` sums, ``stack``), independently of any driver; quantized ones
round the exact real result once, which the fixed-point kernels meet within
the CTS's one unit.

    python -m nnrt.testing.fl6_vectors OUT.json   # write the file
"""
from __future__ import annotations

import sys

import numpy as np

from .control_flow_vectors import _case, _Graph, vector_document, write_vectors

F32, F16, I32 = "TENSOR_FLOAT32", "TENSOR_FLOAT16", "TENSOR_INT32"
U8, S8, B8 = "TENSOR_QUANT8_ASYMM", "TENSOR_QUANT8_ASYMM_SIGNED", "TENSOR_BOOL8"
SPEC = "FL6/nnrt_fl6.mod.py"
_NUMPY = {F32: np.float32, F16: np.float16, I32: np.int32, U8: np.uint8, S8: np.int8,
          B8: np.bool_}
_QRANGE = {U8: (0, 255), S8: (-128, 127)}


def _fl6(case: dict, coupled: bool = False) -> dict:
    """A case of this file: FL6 spec and version; ``coupled`` adds the CTS's
    QuantizationCouplingTest (SCHEMA §5.4: one operation touching a
    TENSOR_QUANT8_ASYMM operand)."""
    case.update(spec=SPEC, specVersion="FL6", minSupportedVersion="FL6")
    if coupled:
        suites = case["harness"]["ctsSuites"]
        suites.insert(suites.index("GeneratedTests") + 1, "QuantizationCouplingTest")
    return case


def _values(type: str, shape, rng: np.random.Generator, lo: int = -6, hi: int = 6) -> np.ndarray:
    """Small values of ``type``: quarter steps for floats (exact in float16),
    integers in [lo, hi] otherwise (stored values for quantized types)."""
    if type in (F32, F16):
        return (rng.integers(lo * 4, hi * 4 + 1, shape) / 4).astype(_NUMPY[type])
    if type == B8:
        return rng.integers(0, 2, shape).astype(np.bool_)
    return rng.integers(lo, hi + 1, shape).astype(_NUMPY[type])


# --- BATCH_MATMUL -------------------------------------------------------------------

def _matmul_expected(type: str, x: np.ndarray, y: np.ndarray, adj_x: bool, adj_y: bool,
                     q=None) -> np.ndarray:
    """out[..., i, j] = sum_k X[..., i, k] Y[..., k, j], with X and Y the
    inputs or (adj_x / adj_y) their transposes over the last two axes."""
    sx = "...ki" if adj_x else "...ik"
    sy = "...jk" if adj_y else "...kj"
    if type in (F32, F16):
        exact = np.einsum(f"{sx},{sy}->...ij", x.astype(np.float64), y.astype(np.float64))
        return exact.astype(_NUMPY[type])
    if type == I32:
        return np.einsum(f"{sx},{sy}->...ij", x.astype(np.int64), y.astype(np.int64)).astype(np.int32)
    (s_x, z_x), (s_y, z_y), (s_o, z_o) = q
    exact = np.einsum(f"{sx},{sy}->...ij", x.astype(np.int64) - z_x, y.astype(np.int64) - z_y)
    real = exact * (np.float64(np.float32(s_x)) * np.float64(np.float32(s_y)))
    scaled = real / np.float64(np.float32(s_o))
    q_out = np.sign(scaled) * np.floor(np.abs(scaled) + 0.5) + z_o   # ties away from zero
    lo, hi = _QRANGE[type]
    return np.clip(q_out, lo, hi).astype(_NUMPY[type])


def _matmul_case(name: str, type: str, lhs_dims, rhs_dims, adj_x, adj_y, rng,
                 q=None, out_type: str | None = None, out_dims=None, flag_type: str = "BOOL",
                 expect_failure: bool = False, rhs_type: str | None = None) -> dict:
    """One BATCH_MATMUL. ``adj_x``/``adj_y`` None: the operand is omitted
    (NO_VALUE, read as false)."""
    q = q or ((0.0, 0), (0.0, 0), (0.0, 0))
    rhs_type = rhs_type or type
    lo, hi = (-20, 20) if type in _QRANGE else (-6, 6)
    x = _values(type, lhs_dims, rng, lo, hi)
    y = _values(rhs_type, rhs_dims, rng, lo, hi)
    g = _Graph("main")
    a = g.input("lhs", type, lhs_dims, x, *q[0])
    b = g.input("rhs", rhs_type, rhs_dims, y, *q[1])
    flags = []
    for label, flag in (("adj_x", adj_x), ("adj_y", adj_y)):
        if flag is None:
            flags.append(g.operand(label, flag_type, [], "NO_VALUE"))
        else:
            flags.append(g.const(label, flag_type, [], [flag]))
    if expect_failure:
        out = g.output("out", out_type or type, out_dims, np.zeros(out_dims), *q[2])
    else:
        want = _matmul_expected(type, x, y, bool(adj_x), bool(adj_y), q)
        out = g.output("out", type, want.shape, want, *q[2])
    g.op("BATCH_MATMUL", [a, b, *flags], [out])
    return _fl6(_case(name, g, [], expect_failure=expect_failure))


def batch_matmul_cases() -> list[dict]:
    rng = np.random.default_rng(102)
    c = []
    c.append(_matmul_case("batch_matmul_float32_rank2", F32, [2, 3], [3, 4], False, False, rng))
    c.append(_matmul_case("batch_matmul_float32_rank3", F32, [2, 2, 3], [2, 3, 2], False, False,
                          rng))
    c.append(_matmul_case("batch_matmul_float32_rank4", F32, [2, 3, 2, 3], [2, 3, 3, 2], False,
                          False, rng))
    c.append(_matmul_case("batch_matmul_float32_adj_x", F32, [2, 3, 2], [2, 3, 4], True, False,
                          rng))
    c.append(_matmul_case("batch_matmul_float32_adj_y", F32, [2, 2, 3], [2, 4, 3], False, True,
                          rng))
    c.append(_matmul_case("batch_matmul_float32_adj_x_adj_y", F32, [1, 3, 2], [1, 4, 3], True,
                          True, rng))
    c.append(_matmul_case("batch_matmul_float32_adj_omitted", F32, [2, 3], [3, 2], None, None,
                          rng))
    c.append(_matmul_case("batch_matmul_float16", F16, [2, 2, 3], [2, 3, 2], False, False, rng))
    c.append(_matmul_case("batch_matmul_float16_adj_y", F16, [3, 4], [2, 4], False, True, rng))
    c.append(_matmul_case("batch_matmul_int32", I32, [2, 3], [3, 2], False, False, rng))
    c.append(_matmul_case("batch_matmul_int32_adj_x", I32, [2, 3, 2], [2, 3, 3], True, False,
                          rng))
    q = ((0.25, -3), (0.5, 4), (0.75, 1))
    c.append(_matmul_case("batch_matmul_quant8_signed", S8, [1, 2, 3], [1, 3, 2], False, False,
                          rng, q))
    c.append(_matmul_case("batch_matmul_quant8_signed_adj_x_rank4", S8, [2, 1, 3, 2],
                          [2, 1, 3, 2], True, False, rng, ((0.125, 5), (0.25, -2), (0.5, 0))))
    # A symmetric rhs (zero point 0); an output scale that saturates.
    c.append(_matmul_case("batch_matmul_quant8_signed_symmetric_rhs", S8, [2, 3], [3, 2], False,
                          False, rng, ((0.5, 2), (0.25, 0), (0.3, -1))))
    c.append(_matmul_case("batch_matmul_quant8_signed_saturating", S8, [2, 4], [4, 2], False,
                          False, rng, ((1.0, 0), (1.0, 3), (0.5, 10))))
    # Refused: NeuralNetworks.h lists no unsigned 8-bit type, no broadcasting
    # of batch dimensions (one rank, the same batch size), ranks 2..4.
    fail = dict(expect_failure=True)
    c.append(_matmul_case("batch_matmul_quant8_asymm_refused", U8, [2, 3], [3, 2], False, False,
                          rng, ((0.5, 128), (0.5, 128), (1.0, 128)), out_dims=[2, 2], **fail))
    c.append(_matmul_case("batch_matmul_broadcast_ranks_refused", F32, [2, 1, 3, 4], [3, 4, 5],
                          False, False, rng, out_dims=[2, 3, 3, 5], **fail))
    c.append(_matmul_case("batch_matmul_broadcast_batch_refused", F32, [2, 3, 4], [1, 4, 5],
                          False, False, rng, out_dims=[2, 3, 5], **fail))
    c.append(_matmul_case("batch_matmul_depth_mismatch_refused", F32, [2, 3], [4, 5], False,
                          False, rng, out_dims=[2, 5], **fail))
    c.append(_matmul_case("batch_matmul_adj_mismatch_refused", F32, [2, 3], [3, 4], True, False,
                          rng, out_dims=[3, 4], **fail))
    c.append(_matmul_case("batch_matmul_rank5_refused", F32, [1, 1, 1, 2, 3], [1, 1, 1, 3, 2],
                          False, False, rng, out_dims=[1, 1, 1, 2, 2], **fail))
    c.append(_matmul_case("batch_matmul_rank1_refused", F32, [3], [3], False, False, rng,
                          out_dims=[1], **fail))
    c.append(_matmul_case("batch_matmul_mixed_types_refused", F32, [2, 3], [3, 2], False, False,
                          rng, rhs_type=F16, out_dims=[2, 2], **fail))
    c.append(_matmul_case("batch_matmul_output_type_refused", F32, [2, 3], [3, 2], False, False,
                          rng, out_type=F16, out_dims=[2, 2], **fail))
    c.append(_matmul_case("batch_matmul_adj_int32_refused", F32, [2, 3], [3, 2], 0, 0, rng,
                          flag_type="INT32", out_dims=[2, 2], **fail))
    return c


# --- PACK ------------------------------------------------------------------------

def _pack_case(name: str, type: str, dims, n: int, axis: int, rng, q=(0.0, 0),
               input_quant=None, input_dims=None, input_types=None, out_dims=None,
               axis_type: str = "INT32", expect_failure: bool = False) -> dict:
    """PACK of ``n`` tensors of ``dims`` on ``axis``; ``input_*`` give input k
    its own quantization, dimensions or type (for validation cases)."""
    g = _Graph("main")
    ax = g.const("axis", axis_type, [], [axis])
    values, ins = [], []
    for k in range(n):
        kdims = input_dims[k] if input_dims else dims
        ktype = input_types[k] if input_types else type
        kq = input_quant[k] if input_quant else q
        v = _values(ktype, kdims, rng, *((0, 255) if ktype == U8 else (-128, 127) if ktype == S8
                                        else (-6, 6)))
        values.append(v)
        ins.append(g.input(f"in{k}", ktype, kdims, v, *kq))
    if expect_failure:
        out = g.output("out", type, out_dims, np.zeros(out_dims), *q)
    else:
        # The output's element at [..., k, ...] (k at the axis) is input k's
        # element at the same position without that index.
        want = np.empty(dims[:axis] + [n] + dims[axis:], _NUMPY[type])
        for k, v in enumerate(values):
            want[(slice(None),) * axis + (k,)] = v
        out = g.output("out", type, want.shape, want, *q)
    g.op("PACK", [ax, *ins], [out])
    coupled = type == U8 and not expect_failure
    return _fl6(_case(name, g, [], expect_failure=expect_failure), coupled=coupled)


def pack_cases() -> list[dict]:
    rng = np.random.default_rng(103)
    c = []
    c.append(_pack_case("pack_float32_axis0", F32, [2, 3], 3, 0, rng))
    c.append(_pack_case("pack_float32_axis1", F32, [2, 3], 3, 1, rng))
    c.append(_pack_case("pack_float32_axis_last", F32, [2, 3], 2, 2, rng))
    c.append(_pack_case("pack_float32_one_input", F32, [2, 3], 1, 1, rng))
    c.append(_pack_case("pack_float32_rank1", F32, [4], 2, 1, rng))
    c.append(_pack_case("pack_float32_rank4_axis2", F32, [1, 2, 2, 2], 2, 2, rng))
    c.append(_pack_case("pack_float16_axis1", F16, [2, 2], 3, 1, rng))
    c.append(_pack_case("pack_int32_axis0", I32, [3], 4, 0, rng))
    c.append(_pack_case("pack_quant8_asymm_axis1", U8, [2, 3], 2, 1, rng, (0.5, 120)))
    c.append(_pack_case("pack_quant8_signed_axis_last", S8, [3, 2], 3, 2, rng, (0.25, -4)))
    fail = dict(expect_failure=True)
    c.append(_pack_case("pack_negative_axis_refused", F32, [2, 3], 2, -1, rng,
                        out_dims=[2, 3, 2], **fail))
    c.append(_pack_case("pack_axis_too_large_refused", F32, [2, 3], 2, 3, rng,
                        out_dims=[2, 3, 2], **fail))
    c.append(_pack_case("pack_shape_mismatch_refused", F32, [2, 3], 2, 0, rng,
                        input_dims=[[2, 3], [3, 2]], out_dims=[2, 2, 3], **fail))
    c.append(_pack_case("pack_rank_mismatch_refused", F32, [2, 3], 2, 0, rng,
                        out_dims=[2, 2, 3, 1], **fail))
    c.append(_pack_case("pack_type_mismatch_refused", F32, [2, 3], 2, 0, rng,
                        input_types=[F32, F16], out_dims=[2, 2, 3], **fail))
    c.append(_pack_case("pack_input_quant_mismatch_refused", U8, [2, 3], 2, 0, rng, (0.5, 120),
                        input_quant=[(0.5, 120), (0.25, 120)], out_dims=[2, 2, 3], **fail))
    c.append(_pack_case("pack_output_quant_mismatch_refused", S8, [2, 3], 2, 0, rng, (0.5, 3),
                        input_quant=[(0.5, 2), (0.5, 2)], out_dims=[2, 2, 3], **fail))
    c.append(_pack_case("pack_bool_refused", B8, [2, 3], 2, 0, rng, out_dims=[2, 2, 3], **fail))
    c.append(_pack_case("pack_axis_float32_refused", F32, [2, 3], 2, 0, rng, axis_type="FLOAT32",
                        out_dims=[2, 2, 3], **fail))
    return c


def all_cases() -> list[dict]:
    return batch_matmul_cases() + pack_cases()


def document() -> dict:
    return vector_document(SPEC, "fl6_vectors", all_cases())


def main(argv: list[str] | None = None) -> int:
    return write_vectors("fl6_vectors", document, argv)


if __name__ == "__main__":
    sys.exit(main())
