"""The builder and model/request validation refuse bad input with errors that
name the problem, and nothing crashes."""
import anyio
import numpy as np
import pytest

import nnrt
from nnrt import ErrorStatus, NnrtError, OperandType as T, OperationType as Op, ResultCode
from nnrt.hal import Request, RequestArgument
from nnrt.drivers.reference import ReferenceDevice
from nnrt.model.graph import DataLocation
from nnrt.hal.validate import validate_model, validate_request


def add_model(out_dims=(1, 4)) -> nnrt.Model:
    m = nnrt.Model()
    a = m.add_operand(T.TENSOR_FLOAT32, [1, 4])
    b = m.add_operand(T.TENSOR_FLOAT32, [1, 4])
    act = m.add_operand(T.INT32)
    m.set_operand_value(act, 0)
    out = m.add_operand(T.TENSOR_FLOAT32, list(out_dims))
    m.add_operation(Op.ADD, [a, b, act], [out])
    m.identify_inputs_and_outputs([a, b], [out])
    return m


def test_bad_operand_index_is_refused_naming_it():
    m = nnrt.Model()
    a = m.add_operand(T.TENSOR_FLOAT32, [2])
    with pytest.raises(NnrtError) as e:
        m.add_operation(Op.ADD, [a, 7, a], [a])
    assert e.value.status == ErrorStatus.INVALID_ARGUMENT
    assert e.value.result_code == ResultCode.BAD_DATA
    assert "operand index 7" in str(e.value)
    with pytest.raises(NnrtError, match="operand index -1"):
        m.set_operand_value(-1, 3)


def test_wrong_operand_type_for_an_operation_is_refused_at_compile():
    m = nnrt.Model()
    a = m.add_operand(T.TENSOR_FLOAT32, [2])
    b = m.add_operand(T.TENSOR_INT32, [2])         # ADD needs both inputs of one type
    act = m.add_operand(T.INT32)
    m.set_operand_value(act, 0)
    out = m.add_operand(T.TENSOR_FLOAT32, [2])
    m.add_operation(Op.ADD, [a, b, act], [out])
    m.identify_inputs_and_outputs([a, b], [out])
    m.finish()  # the CTS requires finish to succeed; the compile refuses it
    with pytest.raises(NnrtError) as e:
        nnrt.run(m, [np.zeros(2, np.float32), np.zeros(2, np.int32)])
    assert e.value.status == ErrorStatus.INVALID_ARGUMENT
    assert "ADD" in str(e.value) and "input 1" in str(e.value) and "TENSOR_INT32" in str(e.value)


def test_cycle_is_refused_naming_an_operation():
    m = nnrt.Model()
    x = m.add_operand(T.TENSOR_FLOAT32, [2])
    act = m.add_operand(T.INT32)
    m.set_operand_value(act, 0)
    t1 = m.add_operand(T.TENSOR_FLOAT32, [2])
    t2 = m.add_operand(T.TENSOR_FLOAT32, [2])
    out = m.add_operand(T.TENSOR_FLOAT32, [2])
    m.add_operation(Op.ADD, [x, t2, act], [t1])
    m.add_operation(Op.ADD, [t1, x, act], [t2])
    m.add_operation(Op.ADD, [t2, x, act], [out])
    m.identify_inputs_and_outputs([x], [out])
    with pytest.raises(NnrtError, match="cycle through operation 0 .ADD."):
        m.finish()


def test_constant_of_the_wrong_size_is_refused():
    m = nnrt.Model()
    w = m.add_operand(T.TENSOR_FLOAT32, [2, 3])
    with pytest.raises(NnrtError) as e:
        m.set_operand_value(w, np.zeros(5, np.float32))
    assert "operand 0" in str(e.value) and "6 elements" in str(e.value)
    s = m.add_operand(T.INT32)
    with pytest.raises(NnrtError, match="needs 4 bytes, got 2"):
        m.set_operand_value(s, b"\0\0")
    with pytest.raises(NnrtError, match="does not convert"):
        m.set_operand_value(w, np.zeros(6, np.float64).astype(complex))


def test_request_outside_its_pool_is_refused():
    model = add_model().finish().hal_model
    pool = bytearray(16)
    out_pool = bytearray(16)
    bad = Request(inputs=(RequestArgument(False, DataLocation(0, 8, 16)),
                          RequestArgument(False, DataLocation(0, 0, 16))),
                  outputs=(RequestArgument(False, DataLocation(1, 0, 16)),),
                  pools=(pool, out_pool))
    with pytest.raises(NnrtError, match=r"request input 0 .*outside pool 0 of 16 bytes"):
        validate_request(model, bad)
    # The driver answers the same request with INVALID_ARGUMENT and keeps serving.
    prepared = anyio.run(ReferenceDevice().prepare_model, model)
    result = prepared.execute_synchronously(bad)
    assert result.status == ErrorStatus.INVALID_ARGUMENT
    good = Request(inputs=(RequestArgument(False, DataLocation(0, 0, 16)),
                           RequestArgument(False, DataLocation(0, 0, 16))),
                   outputs=(RequestArgument(False, DataLocation(1, 0, 16)),),
                   pools=(np.arange(4, dtype=np.float32).tobytes(), out_pool))
    assert prepared.execute_synchronously(good).status == ErrorStatus.NONE
    assert np.frombuffer(out_pool, np.float32).tolist() == [0, 2, 4, 6]


def test_request_with_a_bad_pool_index_or_count():
    model = add_model().finish().hal_model
    args = (RequestArgument(False, DataLocation(3, 0, 16)),) * 2
    with pytest.raises(NnrtError, match="pool index 3 out of range"):
        validate_request(model, Request(args, (RequestArgument(False, DataLocation(0, 0, 16)),),
                                        (bytearray(16),)))
    with pytest.raises(NnrtError, match="request has 1 inputs, the model has 2"):
        validate_request(model, Request(args[:1], (), (bytearray(16),)))


def test_finish_makes_the_model_immutable():
    m = add_model().finish()
    for call in (lambda: m.add_operand(T.INT32), lambda: m.set_operand_value(0, 1),
                 lambda: m.add_operation(Op.ADD, [0, 1, 2], [3]),
                 lambda: m.identify_inputs_and_outputs([0], [3]),
                 lambda: m.relax_computation_float32_to_float16(), m.finish):
        with pytest.raises(NnrtError) as e:
            call()
        assert e.value.result_code == ResultCode.BAD_STATE


def test_temporary_written_twice_and_never_written():
    m = nnrt.Model()
    x = m.add_operand(T.TENSOR_FLOAT32, [2])
    act = m.add_operand(T.INT32)
    m.set_operand_value(act, 0)
    out = m.add_operand(T.TENSOR_FLOAT32, [2])
    m.add_operation(Op.ADD, [x, x, act], [out])
    m.add_operation(Op.MUL, [x, x, act], [out])
    m.identify_inputs_and_outputs([x], [out])
    with pytest.raises(NnrtError, match="operand 2 is written by operation 0 .ADD. and operation 1"):
        m.finish()
    m = nnrt.Model()
    x = m.add_operand(T.TENSOR_FLOAT32, [2])
    ghost = m.add_operand(T.TENSOR_FLOAT32, [2])
    act = m.add_operand(T.INT32)
    m.set_operand_value(act, 0)
    out = m.add_operand(T.TENSOR_FLOAT32, [2])
    m.add_operation(Op.ADD, [x, ghost, act], [out])
    m.identify_inputs_and_outputs([x], [out])
    with pytest.raises(NnrtError, match="reads operand 1, which is never written"):
        m.finish()


def test_declared_output_shape_conflicting_with_inference_is_refused():
    hal = add_model(out_dims=(1, 5)).finish().hal_model
    with pytest.raises(NnrtError, match=r"output operand 3 is declared \[1, 5\]"):
        validate_model(hal)


def test_large_values_are_kept_by_reference_until_finish():
    m = nnrt.Model()
    small = m.add_operand(T.TENSOR_FLOAT32, [4])
    big = m.add_operand(T.TENSOR_FLOAT32, [64])
    m.set_operand_value(small, np.ones(4, np.float32))
    values = np.zeros(64, np.float32)
    m.set_operand_value(big, values)
    values[:] = 2.0  # NNAPI reads a large value at finish, not at the set call
    act = m.add_operand(T.INT32)
    m.set_operand_value(act, 0)
    out = m.add_operand(T.TENSOR_FLOAT32, [64])
    m.add_operation(Op.ADD, [big, big, act], [out])
    m.identify_inputs_and_outputs([], [out])
    hal = m.finish().hal_model
    from nnrt.model.types import OperandLifeTime as L
    assert hal.main.operands[small].lifetime == L.CONSTANT_COPY
    assert hal.main.operands[big].lifetime == L.CONSTANT_REFERENCE
    assert hal.constant_value(hal.main.operands[big]).tolist() == [2.0] * 64
    values[:] = 3.0  # after finish the model owns its copy
    assert nnrt.run(m, []).outputs[0].tolist() == [4.0] * 64


def test_quantized_operand_needs_a_scale():
    m = nnrt.Model()
    with pytest.raises(NnrtError, match="positive scale"):
        m.add_operand(T.TENSOR_QUANT8_ASYMM, [2], scale=0.0)
    with pytest.raises(NnrtError, match="cannot have dimensions"):
        m.add_operand(T.INT32, [2])
    with pytest.raises(NnrtError, match="unknown operand type"):
        m.add_operand(99, [2])


def test_to_dot_draws_operands_and_operations():
    dot = nnrt.model.to_dot(add_model().finish())
    assert dot.startswith("digraph")
    assert 'label="0: ADD"' in dot and "mo0 -> mop0" in dot and "mop0 -> mo3" in dot


def memory_constant_model(memory) -> nnrt.Model:
    m = nnrt.Model()
    x = m.add_operand(T.TENSOR_FLOAT32, [64])
    w = m.add_operand(T.TENSOR_FLOAT32, [64])
    m.set_operand_value_from_memory(w, memory, 256, 64 * 4)
    act = m.add_operand(T.INT32)
    m.set_operand_value(act, 0)
    out = m.add_operand(T.TENSOR_FLOAT32, [64])
    m.add_operation(Op.MUL, [x, w, act], [out])
    m.identify_inputs_and_outputs([x], [out])
    return m.finish()


def test_constant_from_shared_memory_is_referenced_not_copied():
    from nnrt.memory import Memory
    with Memory.create(4096) as memory:
        weights = memory.array(np.float32, 64, offset=256)
        weights[:] = np.arange(64, dtype=np.float32)
        m = memory_constant_model(memory)
        from nnrt.model.types import OperandLifeTime as L
        operand = m.hal_model.main.operands[1]
        assert operand.lifetime == L.CONSTANT_REFERENCE
        assert m.hal_model.pools[operand.location.pool_index] is memory
        r = nnrt.run(m, [np.full(64, 2.0, np.float32)])
        assert r.outputs[0].tolist() == (np.arange(64) * 2.0).tolist()
        b = nnrt.Model()
        k = b.add_operand(T.TENSOR_FLOAT32, [4])
        with pytest.raises(NnrtError, match="outside the memory"):
            b.set_operand_value_from_memory(k, memory, 4090, 16)
        with pytest.raises(NnrtError, match="needs 16 bytes, got length 12"):
            b.set_operand_value_from_memory(k, memory, 0, 12)
