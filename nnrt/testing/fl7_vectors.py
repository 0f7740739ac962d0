"""nnrt's own NNAPI feature level 7 test vectors for MIRROR_PAD and REVERSE,
in the ``nnrt-cts-json/1`` format of ``../shared/cts`` (SCHEMA.md), so the
CTS runner checks them like the shared ones.

The shared vector set stops at HAL 1.3. These cases follow what
NeuralNetworks.h says of the two operations: MIRROR_PAD in REFLECT (0) and
SYMMETRIC (1) mode on every listed data type (float32, float16, int32, quant8
asymm and asymm signed), ranks 1 to 4, zero and maximal paddings (REFLECT at
most dim - 1 on a side, SYMMETRIC at most dim); REVERSE on each axis of each
listed type; paddings and axis given as model inputs; and validation cases
the runtime must refuse (paddings too large for the mode or negative, a mode
that is neither, types NNAPI does not list, an axis outside [0, rank) — NNAPI
takes no negative axis here —, a rank above 8, an output quantized unlike the
input). Expected values are computed here with numpy's own ``np.pad`` modes
and ``np.flip``, independently of any driver.

    python -m nnrt.testing.fl7_vectors OUT.json   # write the file
"""
from __future__ import annotations

import sys

import numpy as np

from .control_flow_vectors import _case as _control_flow_case, _Graph, vector_document, write_vectors

SPEC = "FL7/nnrt_fl7.mod.py"
F32, F16, I32 = "TENSOR_FLOAT32", "TENSOR_FLOAT16", "TENSOR_INT32"
U8, S8 = "TENSOR_QUANT8_ASYMM", "TENSOR_QUANT8_ASYMM_SIGNED"
REFLECT, SYMMETRIC = 0, 1
_NP_MODE = {REFLECT: "reflect", SYMMETRIC: "symmetric"}
# (scale, zero point) of each quantized type's cases; other types carry none.
_QUANT = {U8: (0.5, 4), S8: (0.25, -9)}
_F16_ULP5 = 5 * 0.0009765625


def _case(name: str, main: _Graph, expect_failure: bool = False) -> dict:
    """A single-operation case of this file: control_flow_vectors' case, with
    this spec's names and the suites SCHEMA §5.4 gives a single operation
    (QuantizationCouplingTest when it touches a TENSOR_QUANT8_ASYMM operand)."""
    case = _control_flow_case(name, main, [], expect_failure=expect_failure)
    case.update(spec=SPEC, specVersion="FL7", minSupportedVersion="FL7")
    types = {o["type"] for o in main.operands}
    if not expect_failure and U8 in types:
        suites = case["harness"]["ctsSuites"]
        suites.insert(suites.index("DynamicOutputShapeTest") + 1, "QuantizationCouplingTest")
    if "TENSOR_FLOAT16" in types:
        case["harness"]["float32Tolerance"] = {"atol": _F16_ULP5, "rtol": _F16_ULP5}
    return case


def _data(type: str, shape) -> np.ndarray:
    """Distinct values of ``type`` (stored values for quantized types), so a
    wrong source index always shows."""
    n = int(np.prod(shape))
    k = np.arange(n)
    if type in (F32, F16):
        return ((k * 0.75 - n / 3) * (1 + 0.125 * (k % 3))).reshape(shape)
    if type == I32:
        return (k * 7 - 3 * n).reshape(shape)
    if type == U8:
        return (k * 5 % 251 + 2).reshape(shape)
    return (k * 5 % 251 - 125).reshape(shape)


def _quant(type: str) -> dict:
    scale, zero_point = _QUANT.get(type, (0.0, 0))
    return {"scale": scale, "zero_point": zero_point}


# --- MIRROR_PAD -------------------------------------------------------------------

def _mirror_pad(type: str, shape, pads, mode: int, *, out_type: str | None = None,
                out_quant: dict | None = None, pads_as_input: bool = False,
                pads_type: str = I32, mode_value: int | None = None,
                expected: bool = True) -> _Graph:
    g = _Graph("main")
    x = _data(type, shape)
    q = _quant(type)
    a = g.input("in", type, shape, x, **q)
    pads = np.asarray(pads).reshape(len(shape), -1)
    if pads_as_input:
        p = g.input("paddings", pads_type, pads.shape, pads)
    else:
        p = g.const("paddings", pads_type, pads.shape, pads)
    m = g.const("mode", "INT32", [], [mode if mode_value is None else mode_value])
    out_shape = [d + int(before) + int(after) for d, (before, after) in zip(shape, pads[:, :2])]
    y = np.pad(x, pads.tolist(), mode=_NP_MODE[mode]) if expected else np.zeros(out_shape)
    out = g.output("out", out_type or type, out_shape, y, **(out_quant or q))
    g.op("MIRROR_PAD", [a, p, m], [out])
    return g


def mirror_pad_cases() -> list[dict]:
    cases = []
    shapes = {1: [4], 2: [2, 3], 3: [2, 3, 2], 4: [1, 2, 3, 2]}
    pads = {1: [[2, 1]], 2: [[1, 0], [1, 2]], 3: [[0, 1], [2, 1], [1, 0]],
            4: [[0, 0], [1, 1], [0, 2], [1, 0]]}
    for mode, mode_name in ((REFLECT, "reflect"), (SYMMETRIC, "symmetric")):
        for rank in (1, 2, 3, 4):
            cases.append(_case(f"mirror_pad_{mode_name}_float32_dim{rank}",
                               _mirror_pad(F32, shapes[rank], pads[rank], mode)))
        for type, tname in ((F16, "float16"), (I32, "int32"), (U8, "quant8_asymm"),
                            (S8, "quant8_asymm_signed")):
            cases.append(_case(f"mirror_pad_{mode_name}_{tname}_dim2",
                               _mirror_pad(type, shapes[2], pads[2], mode)))
        cases.append(_case(f"mirror_pad_{mode_name}_zero_paddings",
                           _mirror_pad(F32, [2, 3], [[0, 0], [0, 0]], mode)))
        # The most each mode may pad: dim - 1 (REFLECT), dim (SYMMETRIC), on both
        # sides of every dimension, a dimension of size 1 among them.
        shape = [2, 1, 3]
        most = [[d - 1 + mode] * 2 for d in shape]
        for type, tname in ((F32, "float32"), (U8, "quant8_asymm")):
            cases.append(_case(f"mirror_pad_{mode_name}_maximal_paddings_{tname}",
                               _mirror_pad(type, shape, most, mode)))
    cases.append(_case("mirror_pad_symmetric_paddings_as_input",
                       _mirror_pad(F32, [3, 2], [[2, 3], [1, 2]], SYMMETRIC, pads_as_input=True)))
    return cases


# --- REVERSE ----------------------------------------------------------------------

def _reverse(type: str, shape, axis, *, out_type: str | None = None,
             out_quant: dict | None = None, axis_as_input: bool = False,
             axis_type: str = I32, expected: bool = True) -> _Graph:
    g = _Graph("main")
    x = _data(type, shape)
    q = _quant(type)
    a = g.input("in", type, shape, x, **q)
    axis = np.atleast_1d(axis)
    if axis_as_input:
        k = g.input("axis", axis_type, [len(axis)], axis)
    else:
        k = g.const("axis", axis_type, [len(axis)], axis)
    y = np.flip(x, int(axis[0])) if expected else np.zeros(shape)
    out = g.output("out", out_type or type, shape, y, **(out_quant or q))
    g.op("REVERSE", [a, k], [out])
    return g


def reverse_cases() -> list[dict]:
    cases = [_case("reverse_float32_dim1", _reverse(F32, [5], 0))]
    for axis in range(3):
        cases.append(_case(f"reverse_float32_dim3_axis{axis}", _reverse(F32, [2, 3, 4], axis)))
    cases.append(_case("reverse_float32_dim4_axis2", _reverse(F32, [2, 1, 3, 2], 2)))
    for type, tname in ((F16, "float16"), (I32, "int32"), (U8, "quant8_asymm"),
                        (S8, "quant8_asymm_signed")):
        for axis in (0, 1):
            cases.append(_case(f"reverse_{tname}_dim2_axis{axis}", _reverse(type, [3, 4], axis)))
    cases.append(_case("reverse_axis_as_input", _reverse(F32, [2, 3], 1, axis_as_input=True)))
    return cases


# --- validation -------------------------------------------------------------------

def validation_cases() -> list[dict]:
    """Models NeuralNetworks.h's MIRROR_PAD and REVERSE refuse."""
    fail = []
    for mode, mode_name in ((REFLECT, "reflect"), (SYMMETRIC, "symmetric")):
        # One past the mode's limit, on one side of one dimension.
        fail.append((f"mirror_pad_{mode_name}_paddings_too_large",
                     _mirror_pad(F32, [2, 3], [[0, 0], [0, 3 + mode]], mode, expected=False)))
    fail += [
        ("mirror_pad_negative_paddings",
         _mirror_pad(F32, [2, 3], [[0, 0], [-1, 0]], REFLECT, expected=False)),
        ("mirror_pad_mode_2", _mirror_pad(F32, [2, 3], [[1, 1], [1, 1]], SYMMETRIC,
                                          mode_value=2, expected=False)),
        ("mirror_pad_mode_negative", _mirror_pad(F32, [2, 3], [[1, 1], [1, 1]], REFLECT,
                                                 mode_value=-1, expected=False)),
        ("mirror_pad_bool8_input", _mirror_pad("TENSOR_BOOL8", [2, 3], [[1, 1], [1, 1]],
                                               REFLECT, expected=False)),
        ("mirror_pad_float32_paddings", _mirror_pad(F32, [2, 3], [[1, 1], [1, 1]], REFLECT,
                                                    pads_type=F32, expected=False)),
        ("mirror_pad_paddings_three_columns",
         _mirror_pad(F32, [2, 3], [[1, 1, 0], [1, 1, 0]], REFLECT, expected=False)),
        ("mirror_pad_output_type_mismatch",
         _mirror_pad(F32, [2, 3], [[1, 1], [1, 1]], REFLECT, out_type=F16, expected=False)),
        ("mirror_pad_quant8_output_scale_mismatch",
         _mirror_pad(U8, [2, 3], [[1, 1], [1, 1]], REFLECT,
                     out_quant={"scale": 1.0, "zero_point": 4}, expected=False)),
        ("mirror_pad_quant8_signed_output_zero_point_mismatch",
         _mirror_pad(S8, [2, 3], [[1, 1], [1, 1]], SYMMETRIC,
                     out_quant={"scale": 0.25, "zero_point": 0}, expected=False)),
        ("reverse_axis_out_of_range", _reverse(F32, [2, 3, 4], 3, expected=False)),
        ("reverse_negative_axis", _reverse(F32, [2, 3, 4], -1, expected=False)),
        ("reverse_two_axes", _reverse(F32, [2, 3], [0, 1], expected=False)),
        ("reverse_bool8_input", _reverse("TENSOR_BOOL8", [2, 3], 0, expected=False)),
        ("reverse_float32_axis", _reverse(F32, [2, 3], 0, axis_type=F32, expected=False)),
        ("reverse_rank9", _reverse(F32, [1] * 8 + [2], 8, expected=False)),
        ("reverse_quant8_output_scale_mismatch",
         _reverse(U8, [2, 3], 1, out_quant={"scale": 0.25, "zero_point": 4}, expected=False)),
    ]
    return [_case(name, g, expect_failure=True) for name, g in fail]


def all_cases() -> list[dict]:
    return mirror_pad_cases() + reverse_cases() + validation_cases()


def document() -> dict:
    return vector_document(SPEC, "fl7_vectors", all_cases())


def main(argv: list[str] | None = None) -> int:
    return write_vectors("fl7_vectors", document, argv)


if __name__ == "__main__":
    sys.exit(main())
