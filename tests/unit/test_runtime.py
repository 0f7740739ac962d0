"""The public API over the in-process reference driver."""
import re

import anyio
import numpy as np
import pytest

import nnrt
from nnrt import ErrorStatus, NnrtError, OperandType as T, OperationType as Op
from nnrt.hal import Request, RequestArgument
from nnrt.model.graph import DataLocation
from tests.conftest import SHARED

DESIGN = SHARED / "DESIGN.md"


def add_model(dims=(1, 4), out_dims=None) -> nnrt.Model:
    m = nnrt.Model()
    a = m.add_operand(T.TENSOR_FLOAT32, list(dims))
    b = m.add_operand(T.TENSOR_FLOAT32, list(dims))
    act = m.add_operand(T.INT32)
    m.set_operand_value(act, 0)
    out = m.add_operand(T.TENSOR_FLOAT32, list(out_dims if out_dims is not None else dims))
    m.add_operation(Op.ADD, [a, b, act], [out])
    m.identify_inputs_and_outputs([a, b], [out])
    return m.finish()


def add_model_activation_input() -> nnrt.Model:
    """out = a + b (1x4) with the fused activation a third input: a scalar INT32."""
    m = nnrt.Model()
    a = m.add_operand(T.TENSOR_FLOAT32, [1, 4])
    b = m.add_operand(T.TENSOR_FLOAT32, [1, 4])
    act = m.add_operand(T.INT32)
    out = m.add_operand(T.TENSOR_FLOAT32, [1, 4])
    m.add_operation(Op.ADD, [a, b, act], [out])
    m.identify_inputs_and_outputs([a, b, act], [out])
    return m.finish()


@pytest.mark.skipif(not DESIGN.exists(), reason="../shared/DESIGN.md is not beside the checkout")
async def test_design_md_example_runs_as_written():
    text = DESIGN.read_text()
    block = re.search(r"## Public API.*?```python\n(.*?)```", text, re.S).group(1)
    body = "\n".join("    " + line for line in block.splitlines())
    namespace = {"np": np, "x": np.ones((1, 4), np.float32), "y": np.full((1, 4), 2, np.float32)}
    exec(f"async def example():\n{body}\n    return result, compiled", namespace)
    result, compiled = await namespace["example"]()
    assert result.outputs[0].tolist() == [[3.0] * 4]
    assert result.output_shapes == [(1, 4)]


async def test_execute_returns_outputs_shapes_and_timing():
    async with nnrt.Runtime() as rt:
        compiled = await rt.compile(add_model())
        x = np.arange(4, dtype=np.float32).reshape(1, 4)
        r = await compiled.execute([x, x], measure_timing=True)
        assert r.outputs[0].tolist() == [[0, 2, 4, 6]]
        assert r.timing.on_device is not None and r.timing.in_driver >= r.timing.on_device
        r = await compiled.execute([x, x])
        assert r.timing is None


async def test_outputs_of_unknown_dimensions_are_sized_at_run_time():
    async with nnrt.Runtime() as rt:
        compiled = await rt.compile(add_model(dims=(0, 3), out_dims=(0, 0)))
        for rows in (2, 5, 1):
            x = np.ones((rows, 3), np.float32)
            r = await compiled.execute([x, x])
            assert r.output_shapes == [(rows, 3)]
            assert r.outputs[0].shape == (rows, 3) and (r.outputs[0] == 2).all()


async def test_too_small_output_buffer_reports_the_needed_shape():
    async with nnrt.Runtime() as rt:
        compiled = await rt.compile(add_model(dims=(0, 3), out_dims=(0, 0)))
        x = np.ones((4, 3), np.float32)
        with pytest.raises(NnrtError) as e:
            await compiled.execute([x, x], outputs=[np.empty(6, np.float32)])
        assert e.value.status == ErrorStatus.OUTPUT_INSUFFICIENT_SIZE
        assert e.value.output_shapes == [(4, 3)]
        name = compiled.outputs[0].name
        assert f"output 0 ({name}) needs [4, 3], 48 bytes" in e.value.message
        out = np.empty(12, np.float32)
        r = await compiled.execute([x, x], outputs=[out])
        assert (out == 2).all() and r.outputs[0].shape == (4, 3)


def test_driver_reports_insufficient_size_per_output():
    from nnrt.drivers.reference import ReferenceDevice
    hal = add_model(dims=(0, 2), out_dims=(0, 0)).hal_model
    prepared = anyio.run(ReferenceDevice().prepare_model, hal)
    x = np.ones((3, 2), np.float32)
    request = Request((RequestArgument(False, DataLocation(0, 0, 24), (3, 2)),) * 2,
                      (RequestArgument(False, DataLocation(1, 0, 8)),), (x.tobytes(), bytearray(8)))
    result = prepared.execute_synchronously(request)
    assert result.status == ErrorStatus.OUTPUT_INSUFFICIENT_SIZE
    assert result.output_shapes[0].dimensions == (3, 2)
    assert not result.output_shapes[0].is_sufficient


async def test_wrong_inputs_give_clear_errors_and_the_model_keeps_working():
    async with nnrt.Runtime() as rt:
        compiled = await rt.compile(add_model())
        x = np.ones((1, 4), np.float32)
        with pytest.raises(NnrtError, match="takes 2 inputs, got 1"):
            await compiled.execute([x])
        with pytest.raises(NnrtError, match=r"input 1 .*shape \[1, 5\], the model declares \[1, 4\]"):
            await compiled.execute([x, np.ones((1, 5), np.float32)])
        with pytest.raises(NnrtError, match="<U1 value is not converted"):
            await compiled.execute([x, np.array(["a"] * 4).reshape(1, 4)])
        r = await compiled.execute([x, x])
        assert r.outputs[0].tolist() == [[2.0] * 4]


async def test_compile_refuses_unfinished_models_and_bad_priorities():
    async with nnrt.Runtime() as rt:
        m = nnrt.Model()
        with pytest.raises(NnrtError, match="must be finished"):
            await rt.compile(m)
        with pytest.raises(NnrtError, match="priority 5 is not"):
            await rt.compile(add_model(), priority=5)
        with pytest.raises(NnrtError, match="deadline"):
            await rt.compile(add_model(), deadline="soon")


async def test_a_passed_deadline_is_a_missed_deadline():
    import time
    async with nnrt.Runtime() as rt:
        compiled = await rt.compile(add_model())
        x = np.ones((1, 4), np.float32)
        with pytest.raises(NnrtError) as e:
            await compiled.execute([x, x], deadline=time.monotonic() - 1)
        assert e.value.status == ErrorStatus.MISSED_DEADLINE_TRANSIENT


async def test_burst_runs_frames_in_order():
    async with nnrt.Runtime() as rt:
        compiled = await rt.compile(add_model())
        async with compiled.burst() as burst:
            for k in range(5):
                x = np.full((1, 4), k, np.float32)
                r = await burst.execute([x, x])
                assert r.outputs[0].tolist() == [[2.0 * k] * 4]
        with pytest.raises(NnrtError, match="not open"):
            await burst.execute([x, x])


def test_sync_facade_and_trio():
    import trio

    async def on_trio():
        async with nnrt.Runtime() as rt:
            compiled = await rt.compile(add_model())
            x = np.ones((1, 4), np.float32)
            return await compiled.execute([x, x])

    assert trio.run(on_trio).outputs[0].tolist() == [[2.0] * 4]
    x = np.ones((1, 4), np.float32)
    assert nnrt.run(add_model(), [x, x]).outputs[0].tolist() == [[2.0] * 4]


def test_vlog_tags(monkeypatch):
    from nnrt import vlog
    assert vlog._enabled_tags("compilation,driver") == {"compilation", "driver"}
    assert vlog._enabled_tags("1") == set(vlog.TAGS)
    assert vlog._enabled_tags("all") == set(vlog.TAGS)
    assert vlog._enabled_tags("") == set()


async def test_each_execution_gets_output_arrays_of_its_own():
    """No execution writes into the arrays an earlier one returned."""
    from nnrt.drivers.reference import ReferenceDevice
    async with nnrt.Runtime(devices=[ReferenceDevice()], discover=False) as rt:
        compiled = await rt.compile(add_model())
        y = np.ones((1, 4), np.float32)
        results = []
        for k in range(6):
            results.append((await compiled.execute([np.full((1, 4), k, np.float32), y]))
                           .outputs[0])
        for k, out in enumerate(results):
            np.testing.assert_array_equal(out, np.full((1, 4), k + 1, np.float32))
        assert len({id(out) for out in results}) == len(results)
        assert not any(np.may_share_memory(a, b) for a in results for b in results if a is not b)


async def test_a_step_list_not_known_to_be_the_whole_model_runs_through_the_value_table():
    """Issue 16: a compilation whose one step is the whole model runs that
    step on the app's input list; any other list of steps (here the same
    step in a list the compiled model did not vet) goes through the table
    of operand values, with the same results and errors."""
    from nnrt.drivers.reference import ReferenceDevice
    x, y = np.arange(4, dtype=np.float32).reshape(1, 4), np.ones((1, 4), np.float32)
    async with nnrt.Runtime(devices=[ReferenceDevice()], discover=False) as rt:
        compiled = await rt.compile(add_model())
        assert compiled._whole_steps is compiled._steps
        fast = (await compiled.execute([x, y])).outputs[0]
        compiled._steps = list(compiled._steps)
        assert compiled._whole_steps is not compiled._steps
        general = await compiled.execute({"input1": y, "input0": x})
        np.testing.assert_array_equal(general.outputs[0], fast)
        assert general.output_shapes == [(1, 4)]
        out = np.zeros((1, 4), np.float32)
        given = await compiled.execute([x, y], outputs=[out])
        assert given.outputs[0].base is out or given.outputs[0] is out
        np.testing.assert_array_equal(out, x + y)
        with pytest.raises(NnrtError, match=r"input 1 \(input1\) has shape \[2, 4\]"):
            await compiled.execute([x, np.ones((2, 4), np.float32)])
        assert compiled.statistics().executions == 3


async def test_output_arguments_are_reused_only_for_outputs_of_the_same_shapes():
    """Issue 16: the runtime's own output arrays (made at the expected
    shapes) and an app's output arrays share the step's remembered request
    arguments only when their shapes are those the arguments describe."""
    from nnrt.drivers.reference import ReferenceDevice
    x, y = np.arange(4, dtype=np.float32).reshape(1, 4), np.ones((1, 4), np.float32)
    async with nnrt.Runtime(devices=[ReferenceDevice()], discover=False) as rt:
        compiled = await rt.compile(add_model())
        for _ in range(3):
            np.testing.assert_array_equal((await compiled.execute([x, y])).outputs[0], x + y)
        same = np.zeros((1, 4), np.float32)
        await compiled.execute([x, y], outputs=[same])
        np.testing.assert_array_equal(same, x + y)
        flat = np.zeros(4, np.float32)     # the same bytes, another shape
        r = await compiled.execute([x, y], outputs=[flat])
        np.testing.assert_array_equal(flat, (x + y).reshape(-1))
        assert r.output_shapes == [(1, 4)]
        np.testing.assert_array_equal((await compiled.execute([x, y])).outputs[0], x + y)
