"""The minimal driver of docs/adding-a-driver.md runs as written, behind the
scheduler the runtime puts in front of it, next to the reference device."""
import os
import re
from pathlib import Path

import numpy as np

import nnrt
from nnrt import ErrorStatus, NnrtError, OperandType as T, OperationType as Op, Priority
from nnrt.drivers.reference import ReferenceDevice

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "adding-a-driver.md"


def _guide_driver() -> dict:
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), re.S)
    namespace: dict = {}
    exec(compile(blocks[0], str(GUIDE), "exec"), namespace)   # the driver, as written
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
