"""IF and WHILE through nnrt.Runtime, FILL and RANK, and the validation of
referenced subgraphs. Expected values are computed here in plain Python."""
import time
from dataclasses import replace

import numpy as np
import pytest

import nnrt
from nnrt import ErrorStatus, NnrtError, OperandType as T, OperationType as Op
from nnrt.model.graph import DataLocation
from nnrt.model.types import OperandLifeTime as L
from nnrt.hal.validate import validate_model


def scalar(m, type, value):
    i = m.add_operand(type)
    m.set_operand_value(i, value)
    return i


def binary(m, op, a, b, dims, type=T.TENSOR_FLOAT32, act=True):
    out = m.add_operand(type, dims)
    ins = [a, b, scalar(m, T.INT32, 0)] if act else [a, b]
    m.add_operation(op, ins, [out])
    return out


def fibonacci_model() -> nnrt.Model:
    """WHILE i < n: (fib, i) = (fib @ [[0,1],[1,1]]^T, i + 1)."""
    def loop_operands(m):
        return (m.add_operand(T.TENSOR_FLOAT32, [1, 2]), m.add_operand(T.TENSOR_FLOAT32, [1]),
                m.add_operand(T.TENSOR_FLOAT32, [1]))

    cond = nnrt.Model()
    fib, i, n = loop_operands(cond)
    go = binary(cond, Op.LESS, i, n, [1], T.TENSOR_BOOL8, act=False)
    cond.identify_inputs_and_outputs([fib, i, n], [go])
    cond.finish()

    body = nnrt.Model()
    fib, i, n = loop_operands(body)
    w = body.add_operand(T.TENSOR_FLOAT32, [2, 2])
    body.set_operand_value(w, np.array([[0, 1], [1, 1]], np.float32))
    b = body.add_operand(T.TENSOR_FLOAT32, [2])
    body.set_operand_value(b, np.zeros(2, np.float32))
    nxt = body.add_operand(T.TENSOR_FLOAT32, [1, 2])
    body.add_operation(Op.FULLY_CONNECTED, [fib, w, b, scalar(body, T.INT32, 0)], [nxt])
    one = body.add_operand(T.TENSOR_FLOAT32, [1])
    body.set_operand_value(one, np.ones(1, np.float32))
    i2 = binary(body, Op.ADD, i, one, [1])
    body.identify_inputs_and_outputs([fib, i, n], [nxt, i2])
    body.finish()

    m = nnrt.Model()
    fib, i, n = loop_operands(m)
    cond_ref, body_ref = m.add_operand(T.SUBGRAPH), m.add_operand(T.SUBGRAPH)
    m.set_operand_value_from_model(cond_ref, cond)
    m.set_operand_value_from_model(body_ref, body)
    out = m.add_operand(T.TENSOR_FLOAT32, [1, 2])
    m.add_operation(Op.WHILE, [cond_ref, body_ref, fib, i, n], [out])
    m.identify_inputs_and_outputs([fib, i, n], [out])
    return m.finish()


def fib(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return [a, b]


async def test_while_computes_fibonacci_numbers():
    async with nnrt.Runtime() as rt:
        compiled = await rt.compile(fibonacci_model())
        for n in (0, 1, 2, 10, 30):
            r = await compiled.execute([np.array([[0, 1]], np.float32), np.zeros(1, np.float32),
                                        np.array([n], np.float32)])
            assert r.outputs[0].tolist() == [fib(n)]


def endless_loop_model() -> nnrt.Model:
    cond = nnrt.Model()
    x = cond.add_operand(T.TENSOR_FLOAT32, [1])
    go = binary(cond, Op.GREATER_EQUAL, x, x, [1], T.TENSOR_BOOL8, act=False)
    cond.identify_inputs_and_outputs([x], [go])
    cond.finish()
    body = nnrt.Model()
    x = body.add_operand(T.TENSOR_FLOAT32, [1])
    y = binary(body, Op.ADD, x, x, [1])
    body.identify_inputs_and_outputs([x], [y])
    body.finish()
    m = nnrt.Model()
    x = m.add_operand(T.TENSOR_FLOAT32, [1])
    refs = [m.add_operand(T.SUBGRAPH), m.add_operand(T.SUBGRAPH)]
    m.set_operand_value_from_model(refs[0], cond)
    m.set_operand_value_from_model(refs[1], body)
    out = m.add_operand(T.TENSOR_FLOAT32, [1])
    m.add_operation(Op.WHILE, [*refs, x], [out])
    m.identify_inputs_and_outputs([x], [out])
    return m.finish()


async def test_endless_while_stops_at_the_loop_timeout():
    async with nnrt.Runtime() as rt:
        compiled = await rt.compile(endless_loop_model())
        timeout = 0.5
        start = time.monotonic()
        with pytest.raises(NnrtError) as e:
            await compiled.execute([np.zeros(1, np.float32)], loop_timeout=timeout)
        elapsed = time.monotonic() - start
        assert e.value.status == ErrorStatus.MISSED_DEADLINE_TRANSIENT
        assert "loop timeout" in str(e.value)
        assert timeout <= elapsed < 2 * timeout
        # The compiled model still serves executions afterwards.
        with pytest.raises(NnrtError):
            await compiled.execute([np.zeros(1, np.float32)], loop_timeout=0.01)


def if_model(condition_omitted: bool = False) -> nnrt.Model:
    """IF c: x + x (shape [2]) else: concat(x, x) (shape [4]). With
    ``condition_omitted``, c has no value (and x is the only input)."""
    then = nnrt.Model()
    x = then.add_operand(T.TENSOR_FLOAT32, [2])
    y = binary(then, Op.ADD, x, x, [2])
    then.identify_inputs_and_outputs([x], [y])
    then.finish()
    other = nnrt.Model()
    x = other.add_operand(T.TENSOR_FLOAT32, [2])
    y = other.add_operand(T.TENSOR_FLOAT32, [4])
    other.add_operation(Op.CONCATENATION, [x, x, scalar(other, T.INT32, 0)], [y])
    other.identify_inputs_and_outputs([x], [y])
    other.finish()
    m = nnrt.Model()
    c = m.add_operand(T.TENSOR_BOOL8, [1])
    x = m.add_operand(T.TENSOR_FLOAT32, [2])
    refs = [m.add_operand(T.SUBGRAPH), m.add_operand(T.SUBGRAPH)]
    m.set_operand_value_from_model(refs[0], then)
    m.set_operand_value_from_model(refs[1], other)
    out = m.add_operand(T.TENSOR_FLOAT32, [0])
    m.add_operation(Op.IF, [c, *refs, x], [out])
    if condition_omitted:
        m.set_operand_value(c, None)
    m.identify_inputs_and_outputs([x] if condition_omitted else [c, x], [out])
    return m.finish()


async def test_if_branches_with_different_output_shapes():
    async with nnrt.Runtime() as rt:
        compiled = await rt.compile(if_model())
        x = np.array([1.5, -2], np.float32)
        r = await compiled.execute([np.array([True]), x])
        assert r.output_shapes == [(2,)] and r.outputs[0].tolist() == [3.0, -4.0]
        r = await compiled.execute([np.array([False]), x])
        assert r.output_shapes == [(4,)] and r.outputs[0].tolist() == [1.5, -2, 1.5, -2]


def test_nested_control_flow_if_inside_while_body():
    """WHILE i < 5: i += (2 if i is odd-ish (i >= 2) else 1), via an IF in the body."""
    inc = {}
    for step in (1, 2):
        g = nnrt.Model()
        i = g.add_operand(T.TENSOR_FLOAT32, [1])
        k = g.add_operand(T.TENSOR_FLOAT32, [1])
        g.set_operand_value(k, np.array([step], np.float32))
        out = binary(g, Op.ADD, i, k, [1])
        g.identify_inputs_and_outputs([i], [out])
        inc[step] = g.finish()
    body = nnrt.Model()
    i = body.add_operand(T.TENSOR_FLOAT32, [1])
    two = body.add_operand(T.TENSOR_FLOAT32, [1])
    body.set_operand_value(two, np.array([2], np.float32))
    c = binary(body, Op.GREATER_EQUAL, i, two, [1], T.TENSOR_BOOL8, act=False)
    refs = [body.add_operand(T.SUBGRAPH), body.add_operand(T.SUBGRAPH)]
    body.set_operand_value_from_model(refs[0], inc[2])
    body.set_operand_value_from_model(refs[1], inc[1])
    nxt = body.add_operand(T.TENSOR_FLOAT32, [1])
    body.add_operation(Op.IF, [c, *refs, i], [nxt])
    body.identify_inputs_and_outputs([i], [nxt])
    body.finish()
    cond = nnrt.Model()
    i = cond.add_operand(T.TENSOR_FLOAT32, [1])
    five = cond.add_operand(T.TENSOR_FLOAT32, [1])
    cond.set_operand_value(five, np.array([5], np.float32))
    go = binary(cond, Op.LESS, i, five, [1], T.TENSOR_BOOL8, act=False)
    cond.identify_inputs_and_outputs([i], [go])
    cond.finish()
    m = nnrt.Model()
    i = m.add_operand(T.TENSOR_FLOAT32, [1])
    refs = [m.add_operand(T.SUBGRAPH), m.add_operand(T.SUBGRAPH)]
    m.set_operand_value_from_model(refs[0], cond)
    m.set_operand_value_from_model(refs[1], body)
    out = m.add_operand(T.TENSOR_FLOAT32, [1])
    m.add_operation(Op.WHILE, [*refs, i], [out])
    m.identify_inputs_and_outputs([i], [out])
    m.finish()
    assert len(m.hal_model.referenced) == 4  # cond, body, and the body's two branches
    expected, v = [], 0.0
    while v < 5:
        v += 2 if v >= 2 else 1
    r = nnrt.run(m, [np.zeros(1, np.float32)])
    assert r.outputs[0].tolist() == [v] == [6.0]
    assert "cluster_" in nnrt.model.to_dot(m)


def test_subgraph_reference_cycle_is_refused():
    hal = fibonacci_model().hal_model
    # Make the body refer to the WHILE's own condition-body pair: body -> itself.
    body_index = hal.main.operands[4].location.offset
    body = hal.referenced[body_index]
    ref = replace(body.operands[0], type=T.SUBGRAPH, dimensions=(), lifetime=L.SUBGRAPH,
                  location=DataLocation(-1, body_index, 0))
    cyclic = replace(body, operands=body.operands + (ref,))
    referenced = list(hal.referenced)
    referenced[body_index] = cyclic
    with pytest.raises(NnrtError, match="subgraph reference cycle"):
        validate_model(replace(hal, referenced=tuple(referenced)))


def test_type_mismatch_between_operation_and_subgraph_is_refused():
    then = nnrt.Model()
    x = then.add_operand(T.TENSOR_INT32, [2])  # the IF passes TENSOR_FLOAT32
    y = binary(then, Op.ADD, x, x, [2], T.TENSOR_INT32)
    then.identify_inputs_and_outputs([x], [y])
    then.finish()
    m = _if_of(then, [2])
    with pytest.raises(NnrtError, match="then input 0: TENSOR_FLOAT32 .* does not match"):
        validate_model(m.hal_model)


def _if_of(branch: nnrt.Model, out_dims: list[int]) -> nnrt.Model:
    """(c, x float32 [2]) -> IF c then ``branch`` else ``branch``."""
    m = nnrt.Model()
    c = m.add_operand(T.TENSOR_BOOL8, [1])
    x = m.add_operand(T.TENSOR_FLOAT32, [2])
    refs = [m.add_operand(T.SUBGRAPH), m.add_operand(T.SUBGRAPH)]
    m.set_operand_value_from_model(refs[0], branch)
    m.set_operand_value_from_model(refs[1], branch)
    out = m.add_operand(T.TENSOR_FLOAT32, out_dims)
    m.add_operation(Op.IF, [c, *refs, x], [out])
    m.identify_inputs_and_outputs([c, x], [out])
    return m.finish()


def test_bad_condition_operand_is_refused():
    hal = if_model().hal_model
    bad = replace(hal.main.operands[0], type=T.TENSOR_INT32)
    operands = (bad,) + hal.main.operands[1:]
    with pytest.raises(NnrtError, match="condition.*TENSOR_BOOL8"):
        validate_model(replace(hal, main=replace(hal.main, operands=operands)))


async def test_an_if_condition_without_a_value_is_refused_at_compile():
    """Issue 41: an omitted condition (declared TENSOR_BOOL8 [1]) ran the else branch."""
    async with nnrt.Runtime() as rt:
        with pytest.raises(NnrtError) as refused:
            await rt.compile(if_model(condition_omitted=True))
    assert refused.value.status == ErrorStatus.INVALID_ARGUMENT
    assert "main subgraph operation 0 (IF): IF: input 0 (condition, operand 0) has no value" \
        in refused.value.message


async def test_an_if_condition_without_a_value_inside_a_referenced_subgraph_is_refused():
    """The IF of the previous test as the body of an outer IF: model
    validation reaches operations of every referenced subgraph."""
    m = _if_of(if_model(condition_omitted=True), [0])
    async with nnrt.Runtime() as rt:
        with pytest.raises(NnrtError) as refused:
            await rt.compile(m)
    assert refused.value.status == ErrorStatus.INVALID_ARGUMENT
    then = m.hal_model.main.operations[0].inputs[1]
    inner_index = m.hal_model.main.operands[then].location.offset
    assert f"subgraph {inner_index} operation 0 (IF): IF: input 0 (condition, operand 0) has " \
           f"no value" in refused.value.message


@pytest.mark.parametrize("branch", [1, 2])
def test_an_if_branch_operand_without_a_value_is_refused(branch):
    # The builder cannot omit a SUBGRAPH operand; a HAL model from another process can.
    hal = if_model().hal_model
    k = hal.main.operations[0].inputs[branch]
    operands = list(hal.main.operands)
    operands[k] = replace(operands[k], lifetime=L.NO_VALUE, location=None)
    with pytest.raises(NnrtError, match=rf"IF: input {branch} \(operand {k}\) has no value"):
        validate_model(replace(hal, main=replace(hal.main, operands=tuple(operands))))


def test_set_operand_value_from_model_checks_its_arguments():
    m = nnrt.Model()
    t = m.add_operand(T.TENSOR_FLOAT32, [1])
    s = m.add_operand(T.SUBGRAPH)
    with pytest.raises(NnrtError, match="not SUBGRAPH"):
        m.set_operand_value_from_model(t, if_model())
    with pytest.raises(NnrtError, match="must be finished"):
        m.set_operand_value_from_model(s, nnrt.Model())
    with pytest.raises(NnrtError, match="SUBGRAPH operand"):
        m.set_operand_value(s, 1)


def test_fill_and_rank():
    m = nnrt.Model()
    dims = m.add_operand(T.TENSOR_INT32, [2])
    value = m.add_operand(T.FLOAT32)
    filled = m.add_operand(T.TENSOR_FLOAT32, [0, 0])
    m.add_operation(Op.FILL, [dims, value], [filled])
    rank = m.add_operand(T.INT32)
    m.add_operation(Op.RANK, [filled], [rank])
    m.identify_inputs_and_outputs([dims, value], [filled, rank])
    m.finish()
    r = nnrt.run(m, [np.array([2, 3], np.int32), np.float32(1.5)])
    assert r.output_shapes == [(2, 3), ()]
    assert r.outputs[0].tolist() == [[1.5] * 3] * 2 and int(r.outputs[1]) == 2
    with pytest.raises(NnrtError, match="negative dimension"):
        nnrt.run(m, [np.array([2, -1], np.int32), np.float32(1.5)])


def test_values_of_unknown_rank_flow_through_subgraphs():
    """Branch subgraphs declare their tensors with unknown rank; the IF output
    is unknown too; the shapes come from the data at run time."""
    branches = []
    for op in (Op.ADD, Op.MUL):
        g = nnrt.Model()
        x = g.add_operand(T.TENSOR_FLOAT32, [])       # unknown rank
        y = binary(g, op, x, x, [])
        g.identify_inputs_and_outputs([x], [y])
        branches.append(g.finish())
    m = nnrt.Model()
    c = m.add_operand(T.TENSOR_BOOL8, [1])
    x = m.add_operand(T.TENSOR_FLOAT32, [])
    refs = [m.add_operand(T.SUBGRAPH), m.add_operand(T.SUBGRAPH)]
    for ref, g in zip(refs, branches):
        m.set_operand_value_from_model(ref, g)
    out = m.add_operand(T.TENSOR_FLOAT32, [])
    m.add_operation(Op.IF, [c, *refs, x], [out])
    m.identify_inputs_and_outputs([c, x], [out])
    m.finish()
    x3 = np.arange(6, dtype=np.float32).reshape(1, 2, 3)
    r = nnrt.run(m, [np.array([True]), x3])
    assert r.output_shapes == [(1, 2, 3)] and np.array_equal(r.outputs[0], x3 + x3)
    x1 = np.array([3.0, -1.0], np.float32)
    r = nnrt.run(m, [np.array([False]), x1])
    assert r.output_shapes == [(2,)] and r.outputs[0].tolist() == [9.0, 1.0]


def test_validating_a_model_makes_no_reference_cycle():
    """The subgraph-cycle check was a nested function calling itself: a
    reference cycle holding the model, so in a driver service an app's
    model memfds stayed open (2 per compilation) until the garbage
    collector came by. Validation must leave nothing for the collector."""
    import gc
    import weakref
    from dataclasses import replace
    from nnrt.hal.validate import validate_model
    fresh = fibonacci_model().hal_model        # a WHILE: the check walks its bodies
    gc.disable()      # (only the model's own references may free it)
    try:
        model = replace(fresh)                  # a new HalModel: validated afresh
        validate_model(model)
        gone = weakref.ref(model)
        del model
        # Freed by reference counting alone: nothing validation made still
        # holds it. (Not gc.collect() == 0: other threads of the test
        # process may leave garbage of their own meanwhile.)
        assert gone() is None
    finally:
        gc.enable()
