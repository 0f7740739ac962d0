"""What a new user trips over first (issue 22): request validation at the
API edge, placement and strict mode, closed objects, the synchronous API,
introspection."""
import asyncio
import inspect
import logging
import threading

import numpy as np
import pytest

import nnrt
from nnrt import ErrorStatus, NnrtError, OperandType as T, OperationType as Op, ResultCode
from nnrt.drivers.reference import ReferenceDevice, ReferencePreparedModel
from nnrt.hal import DeviceType, ExecutionResult, PreparedModel

from .test_runtime import add_model


def int_add_model() -> nnrt.Model:
    m = nnrt.Model()
    a = m.add_operand(T.TENSOR_INT32, [1, 4])
    b = m.add_operand(T.TENSOR_INT32, [1, 4])
    act = m.add_operand(T.INT32)
    m.set_operand_value(act, 0)
    out = m.add_operand(T.TENSOR_INT32, [1, 4])
    m.add_operation(Op.ADD, [a, b, act], [out])
    m.identify_inputs_and_outputs([a, b], [out])
    return m.finish()


class Accelerator(ReferenceDevice):
    """A non-CPU device built on the reference kernels, with ways to fail."""

    type = DeviceType.ACCELERATOR

    def __init__(self, name="npu", *, unsupported=(), refuse=False, fail_executions=False):
        super().__init__(name)
        self.unsupported, self.refuse, self.fail_executions = set(unsupported), refuse, \
            fail_executions
        self.prepared = 0

    async def supported_operations(self, model):
        flags = await super().supported_operations(model)
        return [f and op.type not in self.unsupported
                for f, op in zip(flags, model.main.operations)]

    async def prepare_model(self, model, *args, **kwargs):
        if self.refuse:
            raise NnrtError(ErrorStatus.GENERAL_FAILURE, "out of on-chip memory")
        self.prepared += 1
        prepared = await super().prepare_model(model, *args, **kwargs)
        if self.fail_executions:
            return FailingPrepared(prepared.model, prepared.executor)
        return prepared


class FailingPrepared(ReferencePreparedModel):
    # It binds nothing: each computation is the execute_synchronously below.
    create_execution = PreparedModel.create_execution

    def execute_synchronously(self, request, measure=False, deadline=None, loop_timeout=None,
                              *, checkpoint=None):
        return ExecutionResult(ErrorStatus.GENERAL_FAILURE, message="the NPU hung")


X = np.ones((1, 4), np.float32)


# -- 1. one validation at the edge ----------------------------------------------

async def test_none_for_a_required_input_is_invalid_argument_and_does_not_fall_back():
    npu = Accelerator()
    async with nnrt.Runtime(devices=[npu, ReferenceDevice()]) as rt:
        compiled = await rt.compile(add_model())
        with pytest.raises(NnrtError) as e:
            await compiled.execute([None, X])
        assert e.value.status == ErrorStatus.INVALID_ARGUMENT
        assert "input 0 (input0) is None" in e.value.message and "ADD" in e.value.message
        assert [d.name for d in compiled.devices] == ["npu"]
        assert compiled.statistics().fallbacks == 0


@pytest.mark.parametrize("value, message", [
    (np.ones((1, 4), np.int32), "int32 value is not converted"),
    (np.ones((1, 4), np.uint8), "uint8 value is not converted"),
    (np.ones((1, 4), bool), "bool value is not converted"),
    ([[1, 2, 3, 4]], "int64 value is not converted"),
])
async def test_inputs_of_another_kind_are_refused_naming_input_and_types(value, message):
    async with nnrt.Runtime() as rt:
        compiled = await rt.compile(add_model())
        with pytest.raises(NnrtError, match=f"input 1 \\(input1\\) is TENSOR_FLOAT32.*{message}"):
            await compiled.execute([X, value])


async def test_float_to_float_converts_and_int_to_int_only_when_the_values_fit():
    async with nnrt.Runtime() as rt:
        compiled = await rt.compile(add_model())
        r = await compiled.execute([np.full((1, 4), 1.5, np.float16), np.ones((1, 4))])
        assert r.outputs[0].tolist() == [[2.5] * 4]
        ints = await rt.compile(int_add_model())
        r = await ints.execute([np.full((1, 4), 7, np.int64), np.ones((1, 4), np.uint8)])
        assert r.outputs[0].tolist() == [[8] * 4]
        with pytest.raises(NnrtError) as e:
            await ints.execute([np.full((1, 4), 2 ** 40, np.int64), np.ones((1, 4), np.int32)])
        assert e.value.status == ErrorStatus.INVALID_ARGUMENT
        assert "input 0" in e.value.message and "outside [-2147483648, 2147483647]" in e.value.message
        with pytest.raises(NnrtError, match="float64 value is not converted"):
            await ints.execute([np.ones((1, 4)), np.ones((1, 4), np.int32)])


async def test_bare_array_measure_timing_and_priority_names():
    async with nnrt.Runtime() as rt:
        compiled = await rt.compile(add_model(), priority="high")
        assert compiled.priority == nnrt.Priority.HIGH
        with pytest.raises(NnrtError, match="inputs must be a list .* bare ndarray"):
            await compiled.execute(np.ones((2, 1, 4), np.float32))
        with pytest.raises(NnrtError, match="outputs must be a list"):
            await compiled.execute([X, X], outputs=np.empty((1, 4), np.float32))
        with pytest.raises(NnrtError, match="measure_timing must be True or False, got 'yes'"):
            await compiled.execute([X, X], measure_timing="yes")
        with pytest.raises(NnrtError, match="priority 'URGENT' is not one of LOW, MEDIUM, HIGH"):
            await rt.compile(add_model(), priority="URGENT")
        r = await compiled.execute([X, X], measure_timing=np.bool_(True))
        assert r.timing is not None


async def test_an_output_overlapping_an_input_is_refused():
    async with nnrt.Runtime() as rt:
        compiled = await rt.compile(add_model())
        with nnrt.Memory.create(4096) as memory:
            memory.array(np.float32, (1, 4))[:] = 1
            with pytest.raises(NnrtError, match=r"output 0 \(bytes \[8, 24\).*overlaps input 0"):
                await compiled.execute([memory.region(0, 16), X],
                                       outputs=[memory.region(8, 16)])
            r = await compiled.execute([memory.region(0, 16), X], outputs=[memory.region(16, 16)])
            assert r.outputs[0].tolist() == [[2.0] * 4]
        a = np.ones((1, 4), np.float32)
        with pytest.raises(NnrtError, match="overlaps input 1"):
            await compiled.execute([X, a], outputs=[a])
        with pytest.raises(NnrtError, match="overlaps input 0"):
            fence, _ = await compiled.execute_fenced([a, X], outputs=[a])


async def test_closed_compiled_model_and_runtime_give_bad_state_before_any_driver():
    npu = Accelerator()
    async with nnrt.Runtime(devices=[npu, ReferenceDevice()]) as rt:
        compiled = await rt.compile(add_model())
        compiled.close()
        for call in (lambda: compiled.execute([X, X]),
                     lambda: compiled.execute_fenced([X, X])):
            with pytest.raises(NnrtError) as e:
                await call()
            assert e.value.result_code == ResultCode.BAD_STATE
            assert "the compiled model is closed" in e.value.message
        with pytest.raises(NnrtError, match="closed"):
            compiled.burst()
        other = await rt.compile(add_model())
        assert npu.prepared == 2
    with pytest.raises(NnrtError) as e:
        await other.execute([X, X])
    assert e.value.result_code == ResultCode.BAD_STATE
    assert "runtime that compiled this model is closed" in e.value.message


# -- 2. placement and strict mode --------------------------------------------------

def two_op_model() -> nnrt.Model:
    m = nnrt.Model()
    a = m.add_operand(T.TENSOR_FLOAT32, [1, 4])
    act = m.add_operand(T.INT32)
    m.set_operand_value(act, 0)
    mid = m.add_operand(T.TENSOR_FLOAT32, [1, 4])
    out = m.add_operand(T.TENSOR_FLOAT32, [1, 4])
    m.add_operation(Op.ADD, [a, a, act], [mid])
    m.add_operation(Op.MUL, [mid, a, act], [out])
    m.identify_inputs_and_outputs([a], [out])
    return m.finish()


async def test_placement_says_which_device_runs_what_and_why_it_fell_back():
    async with nnrt.Runtime(devices=[Accelerator(unsupported={Op.MUL}), ReferenceDevice()]) as rt:
        compiled = await rt.compile(two_op_model())
        p = compiled.placement
        assert [(s.device, s.operations) for s in p.steps] == [("npu", (0,)), ("nnrt-reference", (1,))]
        assert p.steps[0].fallback is None
        assert p.fallbacks[0].kind == "unsupported" and "MUL" in p.fallbacks[0].detail
        assert p.device_of(1) == "nnrt-reference"
        with pytest.raises(NnrtError, match="fallback=False .* 1 MUL"):
            await rt.compile(two_op_model(), fallback=False)
    async with nnrt.Runtime(devices=[Accelerator(refuse=True), ReferenceDevice()]) as rt:
        compiled = await rt.compile(add_model())
        (fb,) = compiled.placement.fallbacks
        assert fb.kind == "refused" and fb.device == "npu" and "out of on-chip memory" in fb.detail
        assert [d.name for d in compiled.devices] == ["nnrt-reference"]
    async with nnrt.Runtime(devices=[Accelerator(refuse=True), ReferenceDevice()],
                            strict=True) as rt:
        with pytest.raises(NnrtError, match="out of on-chip memory"):
            await rt.compile(add_model())
        assert (await rt.compile(add_model(), fallback=True)).devices[0].name == "nnrt-reference"


async def test_fallback_at_execution_is_logged_once_counted_and_refused_when_strict(caplog):
    async with nnrt.Runtime(devices=[Accelerator(fail_executions=True), ReferenceDevice()]) as rt:
        compiled = await rt.compile(add_model())
        with caplog.at_level(logging.WARNING, logger="nnrt.execution"):
            for _ in range(3):
                assert (await compiled.execute([X, X])).outputs[0].tolist() == [[2.0] * 4]
        warnings = [r for r in caplog.records if "now runs on" in r.getMessage()]
        assert len(warnings) == 1 and "the NPU hung" in warnings[0].getMessage()
        assert compiled.statistics().fallbacks == 1
        assert compiled.statistics().executions == 3
        (fb,) = compiled.placement.fallbacks
        assert fb.kind == "failed" and fb.device == "npu"
        strict = await rt.compile(add_model(), fallback=False)
        with pytest.raises(NnrtError, match="the NPU hung") as e:
            await strict.execute([X, X])
        assert e.value.status == ErrorStatus.GENERAL_FAILURE
        assert strict.statistics() == nnrt.runtime.CompiledModelStatistics(0, 1, 0)


# -- 4. the synchronous API ----------------------------------------------------------

def test_sync_runtime_compiles_once_and_executes_many():
    m = add_model()
    with nnrt.SyncRuntime() as rt:
        compiled = rt.compile(m)
        for k in range(20):
            x = np.full((1, 4), k, np.float32)
            assert compiled.execute([x, x]).outputs[0].tolist() == [[2.0 * k] * 4]
        assert compiled.statistics().executions == 20
        with compiled.burst() as burst:
            for k in range(5):
                assert burst.execute([X, X]).outputs[0].tolist() == [[2.0] * 4]
            assert burst.statistics().frames == 5
    with pytest.raises(NnrtError, match="SyncRuntime is closed"):
        rt.compile(m)


def test_sync_runtime_inside_a_running_event_loop_and_from_a_thread():
    m = add_model()

    async def notebook_cell():   # a Jupyter cell: this thread runs an event loop
        assert nnrt.run(m, [X, X]).outputs[0].tolist() == [[2.0] * 4]
        with nnrt.SyncRuntime() as rt:
            return rt.compile(m).execute([X, X]).outputs[0].tolist()
    assert asyncio.run(notebook_cell()) == [[2.0] * 4]

    results = []
    stop = threading.Event()

    async def spin():
        while not stop.is_set():
            await asyncio.sleep(0.001)
    other = threading.Thread(target=lambda: asyncio.run(spin()))
    other.start()
    try:
        worker = threading.Thread(target=lambda: results.append(nnrt.run(m, [X, X])))
        worker.start()
        worker.join(30)
    finally:
        stop.set()
        other.join()
    assert results[0].outputs[0].tolist() == [[2.0] * 4]


@pytest.mark.parametrize("loop_thread", [False, True])
def test_sync_runtime_with_or_without_a_loop_thread(loop_thread):
    m = add_model()
    with nnrt.SyncRuntime(loop_thread=loop_thread) as rt:
        assert ("loop thread" in repr(rt)) == loop_thread
        compiled = rt.compile(m, priority="LOW")
        threads = [threading.Thread(target=lambda: [compiled.execute([X, X]) for _ in range(10)])
                   for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert compiled.statistics().executions == 30

        async def in_a_loop():
            return compiled.execute([X, X]).outputs[0].tolist()
        assert asyncio.run(in_a_loop()) == [[2.0] * 4]
    assert "closed" in repr(rt)


def test_run_compiles_a_model_once():
    from nnrt.runtime import sync
    m = add_model()
    nnrt.run(m, [X, X])
    first = sync._compiled[m]
    r = nnrt.run(m, [X, X], measure_timing=True)
    assert sync._compiled[m] is first and first.statistics().executions == 2
    assert r.timing is not None
    sync._shared.close()          # a new shared runtime compiles the model again
    assert nnrt.run(m, [X, X]).outputs[0].tolist() == [[2.0] * 4]
    assert sync._compiled[m] is not first


# -- 5. introspection ------------------------------------------------------------------

def test_every_public_class_has_a_repr_of_its_own():
    for name in nnrt.__all__:
        obj = getattr(nnrt, name)
        if inspect.isclass(obj):
            assert obj.__repr__ is not object.__repr__, f"nnrt.{name} has the default repr"


async def test_reprs_say_what_an_object_is():
    m = add_model()
    assert repr(m) == "<nnrt.Model finished: 4 operands, 1 operations (ADD), inputs [0, 1], outputs [3]>"
    async with nnrt.Runtime(litert=False) as rt:
        assert repr(rt) == "<nnrt.Runtime open: devices nnrt-reference>"
        compiled = await rt.compile(m)
        assert "1 operations on nnrt-reference" in repr(compiled)
        assert "input0 float32 (1, 4)" in repr(compiled)
        r = await compiled.execute([X, X], measure_timing=True)
        assert repr(r).startswith("<nnrt.Result outputs [float32 (1, 4)], timing ExecutionTiming(")
        async with compiled.burst() as burst:
            await burst.execute([X, X])
            assert "<nnrt.Burst open, 1 frame(s), 0 failed" in repr(burst)
            s = burst.statistics()
            assert (s.frames, s.failures, s.fallbacks) == (1, 0, 0) and s.sessions == (None,)
        with nnrt.Memory.create(4096) as memory:
            assert "Memory" in repr(memory) and "0x" not in repr(memory).split()[0]
    assert repr(rt) == "<nnrt.Runtime closed>"
    assert "being built" in repr(nnrt.Model())
    fence = nnrt.SyncFence.create()
    assert "object at 0x" not in repr(fence)
    fence.close()


# -- 6. docs -------------------------------------------------------------------------

def test_shared_memory_example_keeps_its_output_off_its_input():
    """The zero-copy example of docs/guide/executions.md (run as written by
    tests/test_docs.py) gives an output region that overlaps neither its input
    nor the end of the memory."""
    import re
    from pathlib import Path

    from nnrt.runtime import request
    text = (Path(__file__).resolve().parents[2] / "docs" / "guide" / "executions.md").read_text()
    block = text.split("## Shared memory")[1].split("```python")[1].split("```")[0]
    size = eval(re.search(r"Memory\.create\((.+?)\) as memory", block).group(1))
    (inp,), (out,) = [[eval(f"({a})") for a in re.findall(r"memory\.region\((.+?)\)\]", part)]
                      for part in block.split("outputs=")]
    with nnrt.Memory.create(size) as memory:
        request.check_no_overlap([memory.region(*inp)], [memory.region(*out)])
        assert out[0] + out[1] <= size


@pytest.mark.parametrize("loop_timeout", [-1.0, float("nan"), "2", True])
async def test_a_loop_timeout_that_is_no_duration_is_refused_without_a_while(loop_timeout):
    """Refused by every way of executing, whether the model has a WHILE or
    not (NaN would never time out); a longer one than 15 s is clamped by the
    driver, as NNAPI does, so it runs."""
    x = np.ones((1, 4), np.float32)
    async with nnrt.Runtime(litert=False) as rt:
        compiled = await rt.compile(add_model())
        with pytest.raises(NnrtError, match="loop_timeout") as e:
            await compiled.execute([x, x], loop_timeout=loop_timeout)
        assert e.value.status == ErrorStatus.INVALID_ARGUMENT
        async with compiled.burst() as burst:
            with pytest.raises(NnrtError, match="loop_timeout"):
                await burst.execute([x, x], loop_timeout=loop_timeout)
        with pytest.raises(NnrtError, match="loop_timeout"):
            await compiled.execute_fenced([x, x], loop_timeout=loop_timeout)
        assert (await compiled.execute([x, x], loop_timeout=60)).outputs[0].tolist() == [[2] * 4]


def test_a_long_placement_prints_ranges_and_counts_not_every_operation():
    from nnrt.runtime.placement import Placement, PlacedStep
    types = ("CONV_2D", "DEPTHWISE_CONV_2D") * 40 + ("ADD",) * 10
    p = Placement((PlacedStep("litert", tuple(range(42)) + tuple(range(43, 90)), types[:89]),
                   PlacedStep("nnrt-reference", (42,), ("CAST",))))
    assert str(p).splitlines() == [
        "litert: operations 0-41, 43-89, 89 in all: 40 CONV_2D, 40 DEPTHWISE_CONV_2D, 9 ADD",
        "nnrt-reference: 42 CAST"]
