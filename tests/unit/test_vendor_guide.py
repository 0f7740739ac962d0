"""The minimal driver of docs/vendors/adding-a-driver.md runs as written, behind the
scheduler the runtime puts in front of it, next to the reference device."""
import os
import re
from pathlib import Path

import numpy as np

import nnrt
from nnrt import ErrorStatus, NnrtError, OperandType as T, OperationType as Op, Priority
from nnrt.drivers.reference import ReferenceDevice

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "vendors" / "adding-a-driver.md"


def _guide_driver(blocks: int = 1) -> dict:
    """The guide's first ``blocks`` python blocks run in one namespace: the
    driver, then its binding."""
    found = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), re.S)
    namespace: dict = {}
    for block in found[:blocks]:
        exec(compile(block, str(GUIDE), "exec"), namespace)   # as written
    return namespace


def _add_then_mul() -> nnrt.Model:
    m = nnrt.Model()
    x = m.add_operand(T.TENSOR_FLOAT32, [2, 3])
    y = m.add_operand(T.TENSOR_FLOAT32, [2, 3])
    act = m.add_operand(T.INT32)
    m.set_operand_value(act, 0)
    s = m.add_operand(T.TENSOR_FLOAT32, [2, 3])
    out = m.add_operand(T.TENSOR_FLOAT32, [2, 3])
    m.add_operation(Op.ADD, [x, y, act], [s])
    m.add_operation(Op.MUL, [s, y, act], [out])
    m.identify_inputs_and_outputs([x, y], [out])
    return m.finish()


async def test_the_guides_driver_runs_behind_the_scheduler_next_to_the_cpu():
    adder = _guide_driver()["AdderDevice"]()
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    y = np.full((2, 3), 2, np.float32)
    async with nnrt.Runtime(devices=[adder, ReferenceDevice()]) as rt:
        compiled = await rt.compile(_add_then_mul(), priority=Priority.HIGH)
        assert [d.name for d in compiled.devices] == ["adder", "nnrt-reference"]
        result = await compiled.execute([x, y], deadline=nnrt.deadline_in(ms=10_000))
        np.testing.assert_array_equal(result.outputs[0], (x + y) * y)
        stats = await rt.statistics("adder")
        assert stats.of(os.getpid(), Priority.HIGH).completed == 1


async def test_the_guides_driver_refuses_what_it_does_not_claim():
    adder = _guide_driver()["AdderDevice"]()
    async with nnrt.Runtime(devices=[adder]) as rt:
        try:
            await rt.compile(_add_then_mul(), devices=["adder"])
        except NnrtError as e:
            assert e.status == ErrorStatus.INVALID_ARGUMENT
        else:
            raise AssertionError("the adder compiled a MUL")


async def test_the_guides_memory_domain_example_keeps_buffers_for_the_runtime():
    """The second block of the guide, after the first: rt.allocate gets the
    adder's own buffers, the state stays in them, roles are enforced."""
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), re.S)
    namespace: dict = {}
    exec(compile(blocks[0], str(GUIDE), "exec"), namespace)
    buffered = next(b for b in blocks if "BufferRegistry" in b)
    exec(compile(buffered, str(GUIDE), "exec"), namespace)
    device = namespace["BufferedAdderDevice"]()
    m = nnrt.Model()
    state, x = m.add_operand(T.TENSOR_FLOAT32, [3]), m.add_operand(T.TENSOR_FLOAT32, [3])
    act = m.add_operand(T.INT32)
    m.set_operand_value(act, 0)
    out = m.add_operand(T.TENSOR_FLOAT32, [3])
    m.add_operation(Op.ADD, [state, x, act], [out])
    m.identify_inputs_and_outputs([state, x], [out])
    async with nnrt.Runtime(devices=[device, ReferenceDevice()]) as rt:
        compiled = await rt.compile(m.finish(), devices=["adder-buffers"])
        desc = nnrt.MemoryDesc().add_input_role(compiled, 0).add_output_role(compiled, 0)
        a, b = await rt.allocate(desc), await rt.allocate(desc)
        assert a.on_device and b.on_device
        with nnrt.Memory.create(12) as shared:
            await nnrt.copy(shared, a)
            for k in range(4):
                src, dst = (a, b) if k % 2 == 0 else (b, a)
                await compiled.execute([src, np.full(3, 2, np.float32)], outputs=[dst])
            await nnrt.copy(a, shared)
            np.testing.assert_array_equal(shared.array(np.float32, 3), [8, 8, 8])
        try:
            await compiled.execute([np.ones(3, np.float32), a])
        except NnrtError as e:
            assert e.status == ErrorStatus.INVALID_ARGUMENT
        else:
            raise AssertionError("input 1 is not one of the memory's roles")
        assert device.buffers.statistics().executions == 4


def test_the_guides_binding_computes_the_request_it_bound_again_and_again():
    from nnrt.hal import Request, RequestArgument
    from nnrt.model.graph import DataLocation
    guide = _guide_driver(blocks=2)
    m = nnrt.Model()
    a, b = m.add_operand(T.TENSOR_FLOAT32, [4]), m.add_operand(T.TENSOR_FLOAT32, [4])
    act = m.add_operand(T.INT32)
    m.set_operand_value(act, 0)
    out = m.add_operand(T.TENSOR_FLOAT32, [4])
    m.add_operation(Op.ADD, [a, b, act], [out])
    m.identify_inputs_and_outputs([a, b], [out])
    hal = m.finish().hal_model
    x, y, z = np.zeros(4, np.float32), np.ones(4, np.float32), np.zeros(4, np.float32)
    request = Request(tuple(RequestArgument(False, DataLocation(k, 0, 16)) for k in (0, 1)),
                      (RequestArgument(False, DataLocation(2, 0, 16)),), (x, y, z))
    execution = guide["BindingAdderModel"](hal).create_execution(request)
    for k in range(3):
        x[:] = k
        assert execution.execute_synchronously().status == ErrorStatus.NONE
        np.testing.assert_array_equal(z, k + 1)
    short = Request(request.inputs, (RequestArgument(False, DataLocation(2, 0, 8)),), (x, y, z))
    result = guide["BindingAdderModel"](hal).create_execution(short).execute_synchronously()
    assert result.status == ErrorStatus.OUTPUT_INSUFFICIENT_SIZE
    assert result.output_shapes[0].dimensions == (4,)
