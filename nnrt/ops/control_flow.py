"""Control flow (HAL 1.3): IF and WHILE over referenced subgraphs.

The kernels run subgraphs through the executor that called them
(``call.executor.run_subgraph``), so nested control flow, values of unknown
shape and the loop timeout all go through one mechanism. WHILE checks the
loop timeout and the execution deadline between iterations, the only points
where an endless loop can be stopped.
"""
from __future__ import annotations

import time

import numpy as np

from ..errors import ErrorStatus, NnrtError
from ..model.graph import Operand, Subgraph
from ..model.types import HalVersion, OperandType as T, OperationType
from .registry import Call, OpView, register


def _compatible(a: Operand, b: Operand) -> bool:
    """Same type and quantization; dimensions equal where both are known."""
    if (a.type, a.scale, a.zero_point, a.channel_quant) != (b.type, b.scale, b.zero_point,
                                                            b.channel_quant):
        return False
    if not a.dimensions or not b.dimensions:
        return True
    return len(a.dimensions) == len(b.dimensions) and all(
        x == y or 0 in (x, y) for x, y in zip(a.dimensions, b.dimensions))


def _check_pairs(op: OpView, outer: list[Operand], inner: list[Operand], what: str) -> None:
    for k, (a, b) in enumerate(zip(outer, inner)):
        if not _compatible(a, b):
            dims_a = list(a.dimensions) if a.dimensions else "?"
            dims_b = list(b.dimensions) if b.dimensions else "?"
            raise op.fail(f"{what} {k}: {a.type.name} {dims_a} does not match the "
                          f"subgraph's {b.type.name} {dims_b} (or its quantization)")


def _operands(sub: Subgraph, indexes) -> list[Operand]:
    return [sub.operands[i] for i in indexes]


def _check_condition(op: OpView, operand: Operand, what: str) -> None:
    # NNAPI 1.3 (validateConditionOperand) wants exactly [1], so an unknown
    # extent ([0]) is refused. Deviation: an unknown rank is still accepted,
    # because the TFLite import declares a WHILE condition's scalar output
    # with unknown rank (nnrt/tflite/lower.py would have to reshape it to [1]).
    if operand.type != T.TENSOR_BOOL8 or tuple(operand.dimensions) not in ((1,), ()):
        raise op.fail(f"{what} must be a TENSOR_BOOL8 of shape [1], got {operand.type.name} "
                      f"{list(operand.dimensions) if operand.dimensions else '(unknown rank)'}")


def _validate_if(op: OpView) -> HalVersion:
    if len(op.inputs) < 3 or not op.outputs:
        raise op.fail("takes a condition, two subgraphs and inputs, and at least one output")
    if op.is_omitted(0):
        # Its declared type and shape may be right, so _check_condition
        # passes it; the kernel would then read no value as false.
        raise op.fail(f"input 0 (condition, operand {op.operation.inputs[0]}) has no value")
    _check_condition(op, op.inputs[0], "input 0 (condition)")
    for i, name in ((1, "then"), (2, "else")):
        sub = op.model.referenced[op.subgraph_ref(i)]
        if len(sub.input_indexes) != len(op.inputs) - 3 \
                or len(sub.output_indexes) != len(op.outputs):
            raise op.fail(f"the {name} subgraph takes {len(sub.input_indexes)} inputs and gives "
                          f"{len(sub.output_indexes)} outputs; the operation passes "
                          f"{len(op.inputs) - 3} and expects {len(op.outputs)}")
        _check_pairs(op, op.inputs[3:], _operands(sub, sub.input_indexes), f"{name} input")
        _check_pairs(op, op.outputs, _operands(sub, sub.output_indexes), f"{name} output")
    return HalVersion.V1_3


def _if_kernel(call: Call) -> list:
    condition, then_graph, else_graph, *inputs = call.ins
    taken = then_graph if bool(np.asarray(condition.value).reshape(-1)[0]) else else_graph
    return call.executor.run_subgraph(taken.value, [a.value for a in inputs])


def _validate_while(op: OpView) -> HalVersion:
    if len(op.inputs) < 3 or not op.outputs:
        raise op.fail("takes a condition subgraph, a body subgraph and inputs, and gives at "
                      "least one output")
    inputs = op.inputs[2:]
    cond = op.model.referenced[op.subgraph_ref(0)]
    body = op.model.referenced[op.subgraph_ref(1)]
    if len(cond.input_indexes) != len(inputs) or len(cond.output_indexes) != 1:
        raise op.fail(f"the condition subgraph must take the {len(inputs)} loop inputs and give "
                      f"one output; it takes {len(cond.input_indexes)} and gives "
                      f"{len(cond.output_indexes)}")
    _check_condition(op, cond.operands[cond.output_indexes[0]], "the condition's output")
    _check_pairs(op, inputs, _operands(cond, cond.input_indexes), "condition input")
    m, carried = len(op.outputs), len(body.output_indexes)
    if len(body.input_indexes) != len(inputs) or not m <= carried <= len(inputs):
        raise op.fail(f"the body subgraph takes {len(body.input_indexes)} inputs and gives "
                      f"{carried} outputs; it must take the {len(inputs)} loop inputs and give "
                      f"between {m} (the operation's outputs) and {len(inputs)}")
    _check_pairs(op, inputs, _operands(body, body.input_indexes), "body input")
    body_outs = _operands(body, body.output_indexes)
    _check_pairs(op, inputs[:carried], body_outs, "loop-carried value")
    # The body's own i-th input and output must agree too (NNAPI checks them
    # pairwise: with unknown extents the outer operand may match both).
    _check_pairs(op, _operands(body, body.input_indexes)[:carried], body_outs,
                 "body input/output pair")
    _check_pairs(op, op.outputs, body_outs[:m], "output")
    return HalVersion.V1_3


def _while_kernel(call: Call) -> list:
    cond_graph, body_graph, *inputs = call.ins
    context = call.executor
    values = [a.value for a in inputs]
    started = time.monotonic()
    iterations = 0
    while bool(np.asarray(context.run_subgraph(cond_graph.value, values)[0]).reshape(-1)[0]):
        now = time.monotonic()
        if now - started > context.loop_timeout:
            raise NnrtError(ErrorStatus.MISSED_DEADLINE_TRANSIENT,
                            f"WHILE ran past its loop timeout of {context.loop_timeout:g} s "
                            f"({iterations} iterations)")
        if context.deadline is not None and now > context.deadline:
            raise NnrtError(ErrorStatus.MISSED_DEADLINE_TRANSIENT,
                            "the execution deadline passed inside a WHILE loop")
        carried = context.run_subgraph(body_graph.value, values)
        values[:len(carried)] = carried
        iterations += 1
    return values[:len(call.outs)]


def _unknown_outputs(op: OpView) -> list[tuple[int, ...]]:
    # Branches and iterations may change shapes: only the declared dims hold.
    return [()] * len(op.outputs)


register(OperationType.IF, validate=_validate_if, shape=_unknown_outputs, kernel=_if_kernel)
register(OperationType.WHILE, validate=_validate_while, shape=_unknown_outputs,
         kernel=_while_kernel)
