"""The app's memory domains (nnrt.MemoryDesc, rt.allocate, nnrt.copy) in
process: a driver buffer when the reference driver keeps it, shared memory
with the same semantics when a driver declines."""
import numpy as np
import pytest

import nnrt
from nnrt import ErrorStatus, NnrtError, OperandType as T, OperationType as Op
from nnrt.drivers.reference import ReferenceDevice
from tests.unit.test_memory_domains import NoBuffers


def accumulate_model(dims=(1, 4)):
    """(state, x) -> (state + x, state * x): a model with a state input and output."""
    m = nnrt.Model()
    state = m.add_operand(T.TENSOR_FLOAT32, list(dims))
    x = m.add_operand(T.TENSOR_FLOAT32, list(dims))
    act = m.add_operand(T.INT32)
    m.set_operand_value(act, 0)
    new = m.add_operand(T.TENSOR_FLOAT32, list(dims))
    prod = m.add_operand(T.TENSOR_FLOAT32, list(dims))
    m.add_operation(Op.ADD, [state, x, act], [new])
    m.add_operation(Op.MUL, [state, x, act], [prod])
    m.identify_inputs_and_outputs([state, x], [new, prod])
    return m.finish()


def state_desc(compiled):
    return (nnrt.MemoryDesc().add_input_role(compiled, 0).add_output_role(compiled, 0))


@pytest.fixture(params=["driver", "declined"])
async def rt(request):
    device = ReferenceDevice() if request.param == "driver" else NoBuffers()
    async with nnrt.Runtime(devices=[device]) as rt:
        yield rt


async def test_state_in_two_memories_equals_numpy(rt):
    compiled = await rt.compile(accumulate_model())
    a, b = await rt.allocate(state_desc(compiled)), await rt.allocate(state_desc(compiled))
    assert a.on_device == (compiled.device.name == "nnrt-reference")
    rng = np.random.default_rng(0)
    state = rng.standard_normal((1, 4)).astype(np.float32)
    with nnrt.Memory.create(16) as mem:
        mem.array(np.float32, (1, 4))[:] = state
        await nnrt.copy(mem, a)
    for k in range(20):
        x = rng.standard_normal((1, 4)).astype(np.float32)
        prod = np.empty((1, 4), np.float32)
        src, dst = (a, b) if k % 2 == 0 else (b, a)
        result = await compiled.execute([src, x], outputs=[dst, prod])
        assert result.outputs[0] is dst and result.output_shapes[0] == (1, 4)
        np.testing.assert_allclose(prod, state * x, rtol=1e-6)
        state = state + x
    with nnrt.Memory.create(16) as mem:
        await nnrt.copy(a, mem)   # 20 runs: the last wrote a
        np.testing.assert_allclose(mem.array(np.float32, (1, 4)), state, rtol=1e-6)
    a.close()
    b.close()


async def test_uses_outside_the_roles_are_refused(rt):
    compiled = await rt.compile(accumulate_model())
    memory = await rt.allocate(nnrt.MemoryDesc().add_input_role(compiled, 0))
    x = np.ones((1, 4), np.float32)
    with pytest.raises(NnrtError, match="never written") as e:
        await compiled.execute([memory, x])
    assert e.value.status == ErrorStatus.INVALID_ARGUMENT
    with nnrt.Memory.create(16) as mem:
        await nnrt.copy(mem, memory)
    await compiled.execute([memory, x])
    with pytest.raises(NnrtError, match="role"):
        await compiled.execute([x, memory])
    with pytest.raises(NnrtError, match="role"):
        await compiled.execute([x, x], outputs=[memory, np.empty((1, 4), np.float32)])
    other = await rt.compile(accumulate_model())
    with pytest.raises(NnrtError, match="role"):
        await other.execute([memory, x])
    both = await rt.allocate(state_desc(compiled))
    with nnrt.Memory.create(16) as mem:
        await nnrt.copy(mem, both)
    with pytest.raises(NnrtError, match="also an input|overlaps"):
        await compiled.execute([both, x], outputs=[both, np.empty((1, 4), np.float32)])
    memory.close()
    with pytest.raises(NnrtError) as e:
        await compiled.execute([memory, x])
    assert e.value.result_code == nnrt.ResultCode.BAD_STATE


async def test_desc_and_copy_checks(rt):
    compiled = await rt.compile(accumulate_model())
    with pytest.raises(NnrtError, match="frequency"):
        nnrt.MemoryDesc().add_input_role(compiled, 0, frequency=0)
    with pytest.raises(NnrtError, match="index"):
        nnrt.MemoryDesc().add_input_role(compiled, 2)
    with pytest.raises(NnrtError, match="already"):
        nnrt.MemoryDesc().add_input_role(compiled, 0).add_input_role(compiled, 0)
    with pytest.raises(NnrtError, match="no role"):
        await rt.allocate(nnrt.MemoryDesc())
    with pytest.raises(NnrtError, match="differ"):
        await rt.allocate(nnrt.MemoryDesc().add_input_role(compiled, 0).set_dimensions([2, 4]))
    a = await rt.allocate(state_desc(compiled))
    b = await rt.allocate(state_desc(compiled))
    with nnrt.Memory.create(32) as big, nnrt.Memory.create(16) as mem:
        with pytest.raises(NnrtError, match="never written"):
            await nnrt.copy(a, mem)
        with pytest.raises(NnrtError, match="takes 16 bytes"):
            await nnrt.copy(big, a)
        mem.array(np.float32, 4)[:] = [1, 2, 3, 4]
        await nnrt.copy(mem, a)
        await nnrt.copy(a, b)                 # device to device
        mem.array(np.float32, 4)[:] = 0
        await nnrt.copy(b, mem)
        np.testing.assert_array_equal(mem.array(np.float32, 4), [1, 2, 3, 4])
        with pytest.raises(NnrtError, match="holds 16 bytes"):
            await nnrt.copy(b, big)


async def test_a_burst_takes_device_memories(rt):
    compiled = await rt.compile(accumulate_model())
    a, b = await rt.allocate(state_desc(compiled)), await rt.allocate(state_desc(compiled))
    with nnrt.Memory.create(16) as mem:
        await nnrt.copy(mem, a)
        x = np.full((1, 4), 2, np.float32)
        async with compiled.burst() as burst:
            for k in range(4):
                src, dst = (a, b) if k % 2 == 0 else (b, a)
                await burst.execute([src, x], outputs=[dst, np.empty((1, 4), np.float32)])
        await nnrt.copy(a, mem)
        np.testing.assert_array_equal(mem.array(np.float32, (1, 4)), np.full((1, 4), 8))


async def test_unknown_dimensions_need_a_driver_or_set_dimensions():
    async with nnrt.Runtime(devices=[NoBuffers()]) as rt:
        compiled = await rt.compile(accumulate_model((0, 4)))
        with pytest.raises(NnrtError, match="set_dimensions"):
            await rt.allocate(state_desc(compiled))
        memory = await rt.allocate(state_desc(compiled).set_dimensions([3, 4]))
        assert not memory.on_device and "declined" in memory.declined
    async with nnrt.Runtime(devices=[ReferenceDevice()]) as rt:
        compiled = await rt.compile(accumulate_model((0, 4)))
        a, b = await rt.allocate(state_desc(compiled)), await rt.allocate(state_desc(compiled))
        assert a.on_device and a.dimensions == ()
        for rows in (2, 5):
            with nnrt.Memory.create(rows * 16) as mem:
                mem.array(np.float32, (rows, 4))[:] = 1
                # a memory of unknown rows: copy into it at the rows of a written source
                c = await rt.allocate(nnrt.MemoryDesc().add_input_role(compiled, 0)
                                      .set_dimensions([rows, 4]))
                await nnrt.copy(mem, c)
                await compiled.execute([c, np.ones((rows, 4), np.float32)],
                                       outputs=[b, np.empty((rows, 4), np.float32)])
                assert b.dimensions == (rows, 4)
                await nnrt.copy(b, a)
                assert a.dimensions == (rows, 4)
                await nnrt.copy(a, mem)
                np.testing.assert_array_equal(mem.array(np.float32, (rows, 4)), 2)
