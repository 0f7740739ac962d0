"""nnrt's own HAL 1.3 control-flow test vectors (IF and WHILE), in the
``nnrt-cts-json/1`` format of ``../shared/cts`` (SCHEMA.md), so the CTS
runner checks them like the shared ones.

The shared vector set holds no V1_3 folder, so these cases cover what its
control-flow vectors would: IF on either branch, WHILE with loop-carried,
state-only and input-only operands, zero iterations, IF nested in a WHILE
body and a WHILE nested in an IF branch (referenced subgraphs referring to
other referenced subgraphs), operands of unknown rank inside referenced
subgraphs, and validation cases the runtime must refuse. Expected values are
computed here with numpy, independently of any driver.

    python -m nnrt.testing.control_flow_vectors OUT.json   # write the file
"""
from __future__ import annotations

import json
import sys

import numpy as np

_DTYPE = {"TENSOR_FLOAT32": "float32", "FLOAT32": "float32", "TENSOR_INT32": "int32",
          "INT32": "int32", "TENSOR_BOOL8": "bool8", "BOOL": "bool8", "SUBGRAPH": "uint32",
          "TENSOR_QUANT8_ASYMM": "uint8", "TENSOR_FLOAT16": "float16", "FLOAT16": "float16",
          "TENSOR_QUANT8_ASYMM_SIGNED": "int8"}


class _Graph:
    """A subgraph under construction, in the SCHEMA's JSON shape."""

    def __init__(self, name: str):
        self.name = name
        self.operands: list[dict] = []
        self.operations: list[dict] = []
        self.inputs: list[int] = []
        self.outputs: list[int] = []

    def operand(self, name, type, dims, lifetime="TEMPORARY_VARIABLE", data=(), scale=0.0,
                zero_point=0) -> int:
        self.operands.append({
            "name": name, "type": type, "dtype": _DTYPE[type], "dimensions": list(dims),
            "scale": scale, "zeroPoint": zero_point, "channelQuant": None,
            "lifetime": lifetime, "numberOfConsumers": 0, "isIgnored": False,
            "data": _flat(type, data)})
        return len(self.operands) - 1

    def input(self, name, type, dims, data=(), scale=0.0, zero_point=0) -> int:
        k = self.operand(name, type, dims, "SUBGRAPH_INPUT", data, scale, zero_point)
        self.inputs.append(k)
        return k

    def output(self, name, type, dims, data=(), scale=0.0, zero_point=0) -> int:
        k = self.operand(name, type, dims, "SUBGRAPH_OUTPUT", data, scale, zero_point)
        self.outputs.append(k)
        return k

    def const(self, name, type, dims, data, scale=0.0, zero_point=0) -> int:
        return self.operand(name, type, dims, "CONSTANT_COPY", data, scale, zero_point)

    def subgraph(self, name, k: int) -> int:
        return self.operand(name, "SUBGRAPH", [], "SUBGRAPH", [k])

    def op(self, type, inputs, outputs) -> None:
        for i in inputs:
            self.operands[i]["numberOfConsumers"] += 1
        self.operations.append({"type": type, "inputs": list(inputs), "outputs": list(outputs)})

    def json(self) -> dict:
        return {"name": self.name, "operands": self.operands, "operations": self.operations,
                "inputIndexes": self.inputs, "outputIndexes": self.outputs}


def _flat(type: str, data) -> list:
    arr = np.asarray(data).reshape(-1)
    if _DTYPE[type] == "bool8":
        return [bool(v) for v in arr]
    if _DTYPE[type] == "float32":
        return [float(np.float32(v)) for v in arr]
    if _DTYPE[type] == "float16":
        return [float(np.float16(v)) for v in arr]
    return [int(v) for v in arr]


def _case(name: str, main: _Graph, referenced: list[_Graph], expect_failure: bool = False,
          relaxed: bool = False) -> dict:
    ops = {op["type"] for g in (main, *referenced) for op in g.operations}
    suites = []
    if expect_failure:
        # SCHEMA §5.2 leaves out the shared set's endless-loop cases; these
        # WHILE cases must be refused at validation, so they are listed.
        suites = ["GeneratedValidationTests"]
    else:
        suites = ["GeneratedTests"]
        if not ops & {"RANK", "IF", "WHILE"}:
            suites.append("DynamicOutputShapeTest")
        if all(main.operands[i]["data"] for i in main.outputs):
            suites += ["DeviceMemoryTest", "FencedComputeTest"]
    return {
        "name": name, "spec": "V1_3/nnrt_control_flow.mod.py", "specVersion": "V1_3",
        "exampleName": None, "modelName": None, "variations": [],
        "main": main.json(), "referenced": [g.json() for g in referenced],
        "isRelaxed": relaxed, "expectFailure": expect_failure,
        "expectedMultinomialDistributionTolerance": 0, "minSupportedVersion": "V1_3",
        "specDisablesDynamicOutputShape": False,
        "harness": {"ctsSuites": suites,
                    "float32Tolerance": {"atol": 1e-5, "rtol": 5 * 1.1920928955078125e-7},
                    "quant8Tolerance": 1},
    }


F32, I32, B8 = "TENSOR_FLOAT32", "TENSOR_INT32", "TENSOR_BOOL8"


def _binary(name: str, op: str, operand: float, dims, unknown_rank: bool = False) -> _Graph:
    """A branch ``out = in <op> operand`` (ADD or MUL with a constant)."""
    g = _Graph(name)
    shape = [] if unknown_rank else dims
    a = g.input("in", F32, shape)
    c = g.const("c", F32, [1], [operand])
    act = g.const("act", "INT32", [], [0])
    out = g.output("out", F32, shape)
    g.op(op, [a, c, act], [out])
    return g


def if_cases() -> list[dict]:
    cases = []
    x = np.arange(6, dtype=np.float32).reshape(2, 3) - 2.5
    for cond in (True, False):
        for unknown in (False, True):
            main = _Graph("main")
            c = main.input("cond", B8, [1], [cond])
            a = main.input("x", F32, [2, 3], x)
            then_ref = main.subgraph("then", 0)
            else_ref = main.subgraph("else", 1)
            expected = x + 10 if cond else x * 3
            out = main.output("out", F32, [2, 3], expected)
            main.op("IF", [c, then_ref, else_ref, a], [out])
            name = f"if_simple_{str(cond).lower()}" + ("_unknown_rank" if unknown else "")
            cases.append(_case(name, main, [_binary("then", "ADD", 10, [2, 3], unknown),
                                             _binary("else", "MUL", 3, [2, 3], unknown)]))
    # The same subgraph for both branches (a model may reference one twice).
    main = _Graph("main")
    c = main.input("cond", B8, [1], [False])
    a = main.input("x", F32, [2, 3], x)
    ref = main.subgraph("branch", 0)
    out = main.output("out", F32, [2, 3], x + 10)
    main.op("IF", [c, ref, ref, a], [out])
    cases.append(_case("if_same_branch_model", main, [_binary("branch", "ADD", 10, [2, 3])]))
    return cases


def _sum_loop(n: int, acc0, x) -> np.ndarray:
    acc = np.array(acc0, dtype=np.float32)
    for _ in range(n):
        acc = (acc + np.asarray(x, np.float32)).astype(np.float32)
    return acc


def _while_graphs(nested_body_ref: int | None = None):
    """Condition ``i < n`` and body ``acc += x; i += 1`` over loop inputs
    (acc carried out, i state only, x and n input only). With
    ``nested_body_ref`` the body's update is an IF: ``i < 2 ? acc + x : acc * 2``,
    the IF's branches being referenced subgraphs ``nested_body_ref`` and the next."""
    cond = _Graph("cond")
    acc, i, x, n = (cond.input("acc", F32, [2]), cond.input("i", I32, [1]),
                    cond.input("x", F32, [2]), cond.input("n", I32, [1]))
    out = cond.output("continue", B8, [1])
    cond.op("LESS", [i, n], [out])
    body = _Graph("body")
    acc, i, x, n = (body.input("acc", F32, [2]), body.input("i", I32, [1]),
                    body.input("x", F32, [2]), body.input("n", I32, [1]))
    one = body.const("one", I32, [1], [1])
    act = body.const("act", "INT32", [], [0])
    acc_out = body.output("acc_out", F32, [2])
    i_out = body.output("i_out", I32, [1])
    if nested_body_ref is None:
        body.op("ADD", [acc, x, act], [acc_out])
    else:
        two = body.const("two", I32, [1], [2])
        early = body.operand("early", B8, [1])
        body.op("LESS", [i, two], [early])
        then_ref = body.subgraph("add_x", nested_body_ref)
        else_ref = body.subgraph("double", nested_body_ref + 1)
        body.op("IF", [early, then_ref, else_ref, acc, x], [acc_out])
    body.op("ADD", [i, one, act], [i_out])
    return cond, body


def _nested_branches():
    add_x = _Graph("add_x")
    a, x = add_x.input("acc", F32, [2]), add_x.input("x", F32, [2])
    act = add_x.const("act", "INT32", [], [0])
    add_x.op("ADD", [a, x, act], [add_x.output("out", F32, [2])])
    double = _Graph("double")
    a, x = double.input("acc", F32, [2]), double.input("x", F32, [2])
    two = double.const("two", F32, [1], [2.0])
    act = double.const("act", "INT32", [], [0])
    double.op("MUL", [a, two, act], [double.output("out", F32, [2])])
    return add_x, double


def _while_main(n: int, acc0, x, expected, refs=(0, 1)) -> _Graph:
    main = _Graph("main")
    acc = main.input("acc", F32, [2], acc0)
    i = main.const("i0", I32, [1], [0])
    xs = main.input("x", F32, [2], x)
    ns = main.input("n", I32, [1], [n])
    cond_ref = main.subgraph("cond", refs[0])
    body_ref = main.subgraph("body", refs[1])
    out = main.output("out", F32, [2], expected)
    main.op("WHILE", [cond_ref, body_ref, acc, i, xs, ns], [out])
    return main


def while_cases() -> list[dict]:
    cases = []
    acc0, x = [1.0, -2.0], [0.5, 0.25]
    for n in (0, 1, 5):
        cond, body = _while_graphs()
        cases.append(_case(f"while_sum_n{n}", _while_main(n, acc0, x, _sum_loop(n, acc0, x)),
                           [cond, body]))
    # IF nested in the WHILE body (referenced subgraph -> referenced subgraph).
    for n in (1, 4):
        acc = np.array(acc0, np.float32)
        for i in range(n):
            acc = acc + np.float32(x) if i < 2 else acc * np.float32(2)
        cond, body = _while_graphs(nested_body_ref=2)
        cases.append(_case(f"while_nested_if_n{n}", _while_main(n, acc0, x, acc),
                           [cond, body, *_nested_branches()]))
    # A WHILE nested in an IF branch, two levels deep.
    for flag in (True, False):
        n = 3
        main = _Graph("main")
        c = main.input("cond", B8, [1], [flag])
        acc = main.input("acc", F32, [2], acc0)
        xs = main.input("x", F32, [2], x)
        ns = main.input("n", I32, [1], [n])
        expected = _sum_loop(n, acc0, x) if flag else np.float32(acc0) * np.float32(2)
        out = main.output("out", F32, [2], expected)
        main.op("IF", [c, main.subgraph("loop", 0), main.subgraph("double", 1), acc, xs, ns],
                [out])
        loop = _Graph("loop")
        a, lx, ln = loop.input("acc", F32, [2]), loop.input("x", F32, [2]), loop.input("n", I32, [1])
        i0 = loop.const("i0", I32, [1], [0])
        lout = loop.output("out", F32, [2])
        loop.op("WHILE", [loop.subgraph("cond", 2), loop.subgraph("body", 3), a, i0, lx, ln],
                [lout])
        double = _Graph("double")
        a, _x, _n = double.input("acc", F32, [2]), double.input("x", F32, [2]), \
            double.input("n", I32, [1])
        two = double.const("two", F32, [1], [2.0])
        act = double.const("act", "INT32", [], [0])
        double.op("MUL", [a, two, act], [double.output("out", F32, [2])])
        cond, body = _while_graphs()
        cases.append(_case(f"if_nested_while_{str(flag).lower()}", main,
                           [loop, double, cond, body]))
    return cases


def validation_cases() -> list[dict]:
    """Models the NNAPI 1.3 rules for IF/WHILE forbid: the runtime must refuse them."""
    cases = []
    x = np.ones((2, 3), np.float32)

    def if_model(cond_type="TENSOR_BOOL8", cond_dims=(1,), then=None, extra_input=False,
                 out_type=F32):
        main = _Graph("main")
        c = main.input("cond", cond_type, list(cond_dims),
                       [1] * int(np.prod(cond_dims)) if cond_type != B8
                       else [True] * int(np.prod(cond_dims)))
        a = main.input("x", F32, [2, 3], x)
        ins = [c, main.subgraph("then", 0), main.subgraph("else", 1), a]
        if extra_input:
            ins.append(main.input("y", F32, [2, 3], x))
        out = main.output("out", out_type, [2, 3], np.zeros((2, 3)))
        main.op("IF", ins, [out])
        return main, [then or _binary("then", "ADD", 1, [2, 3]), _binary("else", "MUL", 2, [2, 3])]

    main, refs = if_model(cond_type=F32)
    cases.append(_case("if_condition_float32", main, refs, expect_failure=True))
    main, refs = if_model(cond_dims=(2,))
    cases.append(_case("if_condition_two_elements", main, refs, expect_failure=True))
    main, refs = if_model(cond_type=B8, cond_dims=(1, 1))
    cases.append(_case("if_condition_rank2", main, refs, expect_failure=True))
    main, refs = if_model(extra_input=True)
    cases.append(_case("if_branch_input_count_mismatch", main, refs, expect_failure=True))
    main, refs = if_model(then=_binary("then", "ADD", 1, [3, 2]))
    cases.append(_case("if_branch_input_shape_mismatch", main, refs, expect_failure=True))
    main, refs = if_model(out_type=I32)
    cases.append(_case("if_output_type_mismatch", main, refs, expect_failure=True))

    # WHILE whose condition gives a float, and one whose body gives too many outputs.
    cond, body = _while_graphs()
    cond.operands[cond.outputs[0]].update(type=F32, dtype="float32")
    cond.operations[0] = {"type": "ADD", "inputs": [cond.inputs[0], cond.inputs[2],
                                                    cond.const("act", "INT32", [], [0])],
                          "outputs": [cond.outputs[0]]}
    cond.operands[cond.outputs[0]]["dimensions"] = [2]
    cases.append(_case("while_condition_not_bool",
                       _while_main(1, [0, 0], [1, 1], [1, 1]), [cond, body], expect_failure=True))
    cond, body = _while_graphs()
    act = next(k for k, o in enumerate(body.operands) if o["name"] == "act")
    extra = body.output("extra", F32, [2])
    body.op("MUL", [body.inputs[0], body.inputs[2], act], [extra])
    # acc_out, i_out, extra, more0, more1: five outputs for four loop inputs.
    for k in range(2):
        body.op("ADD", [body.inputs[0], body.inputs[2], act],
                [body.output(f"more{k}", F32, [2])])
    cases.append(_case("while_body_too_many_outputs",
                       _while_main(1, [0, 0], [1, 1], [1, 1]), [cond, body], expect_failure=True))
    # A condition of unknown size, computed inside the model (LESS gives a
    # TENSOR_BOOL8 [0]): NNAPI wants exactly [1].
    main = _Graph("main")
    a = main.input("a", F32, [1], [1.0])
    b = main.input("b", F32, [1], [2.0])
    xs = main.input("x", F32, [2, 3], x)
    c = main.operand("cond", B8, [0])
    main.op("LESS", [a, b], [c])
    out = main.output("out", F32, [2, 3], np.zeros((2, 3)))
    main.op("IF", [c, main.subgraph("then", 0), main.subgraph("else", 1), xs], [out])
    cases.append(_case("if_condition_unknown_size", main,
                       [_binary("then", "ADD", 1, [2, 3]), _binary("else", "MUL", 2, [2, 3])],
                       expect_failure=True))
    # A condition with no value (its declared type and shape are right), in
    # the main subgraph and in an IF's branch (issue 41: it ran the else branch).
    def if_without_condition(graph: _Graph, xs: int, out: int, refs=(0, 1)) -> None:
        c = graph.operand("cond", B8, [1], "NO_VALUE")
        graph.op("IF", [c, graph.subgraph("then", refs[0]), graph.subgraph("else", refs[1]),
                        xs], [out])

    branches = [_binary("then", "ADD", 1, [2, 3]), _binary("else", "MUL", 2, [2, 3])]
    main = _Graph("main")
    xs = main.input("x", F32, [2, 3], x)
    if_without_condition(main, xs, main.output("out", F32, [2, 3], np.zeros((2, 3))))
    cases.append(_case("if_condition_no_value", main, branches, expect_failure=True))
    outer_then = _Graph("outer_then")
    if_without_condition(outer_then, outer_then.input("x", F32, [2, 3]),
                         outer_then.output("out", F32, [2, 3]))
    main = _Graph("main")
    c = main.input("cond", B8, [1], [True])
    xs = main.input("x", F32, [2, 3], x)
    out = main.output("out", F32, [2, 3], np.zeros((2, 3)))
    main.op("IF", [c, main.subgraph("then", 2), main.subgraph("else", 1), xs], [out])
    cases.append(_case("if_condition_no_value_in_branch", main, [*branches, outer_then],
                       expect_failure=True))
    # A body whose loop-carried input and output disagree ([2] in, [1] out)
    # while the outer operand, of unknown extent, matches both.
    cond, body = _while_graphs()
    body.operands[body.outputs[0]]["dimensions"] = [1]
    main = _while_main(1, [0, 0], [1, 1], [1, 1])
    main.operands[main.inputs[0]].update(lifetime="TEMPORARY_VARIABLE", data=[],
                                         dimensions=[0])
    acc_in = main.input("acc_in", F32, [2], [0, 0])
    act = main.const("act", "INT32", [], [0])
    zero = main.const("zero", F32, [1], [0.0])
    main.operations.insert(0, {"type": "ADD", "inputs": [acc_in, zero, act],
                               "outputs": [main.inputs[0]]})
    main.inputs.pop(0)
    main.operands[main.outputs[0]]["dimensions"] = [0]
    main.operands[main.outputs[0]]["data"] = []
    cases.append(_case("while_body_carried_shape_mismatch", main, [cond, body],
                       expect_failure=True))
    # A condition subgraph that is the WHILE's own body (wrong signature), and
    # an endless loop (in no suite: the VTS checks loop timeouts).
    cond, body = _while_graphs()
    cases.append(_case("while_condition_is_body", _while_main(1, [0, 0], [1, 1], [1, 1],
                                                              refs=(1, 1)),
                       [cond, body], expect_failure=True))
    return cases


def all_cases() -> list[dict]:
    return if_cases() + while_cases() + validation_cases()


def vector_document(spec: str, module: str, cases: list[dict]) -> dict:
    """A vector file of nnrt's own, made by ``nnrt/testing/<module>.py``."""
    return {"format": "nnrt-cts-json/1", "spec": spec,
            "specPath": f"nnrt/testing/{module}.py", "specGitBlob": None, "cases": cases}


def write_vectors(module: str, document, argv: list[str] | None = None) -> int:
    """``python -m nnrt.testing.<module> OUT.json``: write ``document()``."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(f"usage: python -m nnrt.testing.{module} OUT.json", file=sys.stderr)
        return 2
    with open(argv[0], "w") as f:
        json.dump(document(), f, indent=None, separators=(",", ":"))
        f.write("\n")
    return 0


def document() -> dict:
    return vector_document("V1_3/nnrt_control_flow.mod.py", "control_flow_vectors", all_cases())


def main(argv: list[str] | None = None) -> int:
    return write_vectors("control_flow_vectors", document, argv)


if __name__ == "__main__":
    sys.exit(main())
