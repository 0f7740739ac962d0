"""Partitioning across devices, CPU fallback at compile and at run time.
In-process devices here; tests/integration covers driver services."""
from dataclasses import replace

import numpy as np
import pytest

import nnrt
from nnrt import ErrorStatus, NnrtError, OperandType as T, OperationType as Op
from nnrt.hal import Capabilities, DeviceType, ExecutionResult, PerformanceInfo, PreparedModel
from nnrt.drivers.reference import ReferenceDevice
from nnrt.runtime import partition

from ..integration.test_qos_inprocess import chain_model as adds_model   # x -> n ADDs of 1


class OnlyDevice(ReferenceDevice):
    """An accelerator that supports only ``ops`` and reports itself faster
    than the CPU for them."""

    type = DeviceType.ACCELERATOR

    def __init__(self, name, ops, exec_time=0.1):
        super().__init__(name)
        self.ops = set(ops)
        self.exec_time = exec_time
        self.prepared_ops = []

    def capabilities(self):
        fast = PerformanceInfo(self.exec_time, self.exec_time)
        return Capabilities(fast, fast, {t: fast for t in T}, fast, fast)

    async def supported_operations(self, model):
        return [op.type in self.ops and ok
                for op, ok in zip(model.main.operations, await super().supported_operations(model))]

    async def prepare_model(self, model, *args, **kwargs):
        self.prepared_ops.append([op.type for op in model.main.operations])
        return await super().prepare_model(model, *args, **kwargs)


class BrokenPrepare(OnlyDevice):
    async def prepare_model(self, model, *args, **kwargs):
        raise NnrtError(ErrorStatus.GENERAL_FAILURE, "this driver cannot prepare anything")


class FailsAtRun(OnlyDevice):
    """Prepares fine, then fails every execution with ``status``."""

    def __init__(self, name, ops, status):
        super().__init__(name, ops)
        self.status = status

    async def prepare_model(self, model, *args, **kwargs):
        prepared = await super().prepare_model(model, *args, **kwargs)
        status = self.status

        class Failing(type(prepared)):
            create_execution = PreparedModel.create_execution   # binds nothing

            def execute_synchronously(self, request, *a, **k):
                return ExecutionResult(status, message="the accelerator fell over")
        prepared.__class__ = Failing
        return prepared


def chain_model() -> nnrt.Model:
    """y = ((x * w + b) -> ADD c) -> MUL d -> ADD e, with a 1x1 CONV_2D first."""
    m = nnrt.Model()
    x = m.add_operand(T.TENSOR_FLOAT32, [1, 2, 2, 1])
    w = m.add_operand(T.TENSOR_FLOAT32, [1, 1, 1, 1])
    m.set_operand_value(w, np.array([2.0], np.float32).reshape(1, 1, 1, 1))
    b = m.add_operand(T.TENSOR_FLOAT32, [1])
    m.set_operand_value(b, np.array([0.5], np.float32))
    zero = m.add_operand(T.INT32)
    m.set_operand_value(zero, 0)
    one = m.add_operand(T.INT32)
    m.set_operand_value(one, 1)
    t0 = m.add_operand(T.TENSOR_FLOAT32, [1, 2, 2, 1])
    m.add_operation(Op.CONV_2D, [x, w, b, one, one, one, zero], [t0])
    c = m.add_operand(T.TENSOR_FLOAT32, [1, 2, 2, 1])
    t1 = m.add_operand(T.TENSOR_FLOAT32, [1, 2, 2, 1])
    m.add_operation(Op.ADD, [t0, c, zero], [t1])
    d = m.add_operand(T.TENSOR_FLOAT32, [1])
    m.set_operand_value(d, np.array([3.0], np.float32))
    t2 = m.add_operand(T.TENSOR_FLOAT32, [0, 0, 0, 0])  # unknown shape across a boundary
    m.add_operation(Op.MUL, [t1, d, zero], [t2])
    y = m.add_operand(T.TENSOR_FLOAT32, [1, 2, 2, 1])
    m.add_operation(Op.ADD, [t2, c, zero], [y])
    m.identify_inputs_and_outputs([x, c], [y, t1])
    return m.finish()


X = np.array([1, 2, 3, 4], np.float32).reshape(1, 2, 2, 1)
C = np.array([10, 20, 30, 40], np.float32).reshape(1, 2, 2, 1)
EXPECTED_T1 = X * 2 + 0.5 + C
EXPECTED_Y = EXPECTED_T1 * 3 + C


async def test_model_split_across_devices_matches_the_single_device_run():
    adder = OnlyDevice("adder", {Op.ADD})
    async with nnrt.Runtime(devices=[adder, ReferenceDevice()]) as rt:
        compiled = await rt.compile(chain_model())
        assert [d.name for d in compiled.devices] == ["nnrt-reference", "adder",
                                                      "nnrt-reference", "adder"]
        assert adder.prepared_ops == [[Op.ADD], [Op.ADD]]
        r = await compiled.execute([X, C], measure_timing=True)
        assert np.array_equal(r.outputs[0], EXPECTED_Y)
        assert np.array_equal(r.outputs[1], EXPECTED_T1)
        assert r.timing.in_driver >= r.timing.on_device
    async with nnrt.Runtime() as rt:  # the single-device run
        single = await (await rt.compile(chain_model())).execute([X, C])
        assert np.array_equal(single.outputs[0], r.outputs[0])


async def test_low_power_preference_uses_power_usage():
    class PowerHungry(OnlyDevice):
        def capabilities(self):
            return Capabilities(operand_performance={t: PerformanceInfo(0.1, 9.0) for t in T})
    hungry = PowerHungry("hungry", {Op.ADD, Op.MUL, Op.CONV_2D})
    async with nnrt.Runtime(devices=[hungry, ReferenceDevice()]) as rt:
        fast = await rt.compile(chain_model())
        assert {d.name for d in fast.devices} == {"hungry"}
        frugal = await rt.compile(chain_model(),
                                  preference=nnrt.ExecutionPreference.LOW_POWER)
        assert {d.name for d in frugal.devices} == {"nnrt-reference"}


async def test_a_device_that_fails_to_prepare_falls_back_to_the_cpu():
    broken = BrokenPrepare("broken", {Op.ADD})
    async with nnrt.Runtime(devices=[broken, ReferenceDevice()]) as rt:
        compiled = await rt.compile(chain_model())
        assert {d.name for d in compiled.devices} == {"nnrt-reference"}
        r = await compiled.execute([X, C])
        assert np.array_equal(r.outputs[0], EXPECTED_Y)
        # Naming the devices explicitly forbids the fallback (NNAPI's rule).
        with pytest.raises(NnrtError, match="cannot prepare"):
            await rt.compile(chain_model(), devices=["broken", "nnrt-reference"])


async def test_a_driver_failure_at_run_time_reruns_the_model_on_the_cpu():
    flaky = FailsAtRun("flaky", {Op.ADD}, ErrorStatus.GENERAL_FAILURE)
    async with nnrt.Runtime(devices=[flaky, ReferenceDevice()]) as rt:
        compiled = await rt.compile(chain_model())
        assert "flaky" in {d.name for d in compiled.devices}
        r = await compiled.execute([X, C])
        assert np.array_equal(r.outputs[0], EXPECTED_Y)
        assert {d.name for d in compiled.devices} == {"nnrt-reference"}  # stays on the CPU
        explicit = await rt.compile(chain_model(), devices=["flaky", "nnrt-reference"])
        with pytest.raises(NnrtError) as e:
            await explicit.execute([X, C])
        assert e.value.status == ErrorStatus.GENERAL_FAILURE


async def test_a_failed_device_moves_the_model_to_the_best_devices_left():
    """Not straight to the reference CPU device: the model is partitioned
    again over the devices left, by capabilities (a fast in-process device
    before the reference one), and the placement says why for each step."""
    flaky = FailsAtRun("flaky", set(Op), ErrorStatus.DEAD_OBJECT)
    fast = OnlyDevice("fast", {Op.ADD, Op.MUL}, exec_time=0.5)
    async with nnrt.Runtime(devices=[flaky, fast, ReferenceDevice()]) as rt:
        compiled = await rt.compile(chain_model())
        assert {d.name for d in compiled.devices} == {"flaky"}
        r = await compiled.execute([X, C])
        assert np.array_equal(r.outputs[0], EXPECTED_Y)
        # CONV_2D on the reference device, ADD and MUL on the fast one.
        assert [d.name for d in compiled.devices] == ["nnrt-reference", "fast"]
        fallbacks = compiled.placement.fallbacks
        assert {f.kind for f in fallbacks} == {"died"} and {f.device for f in fallbacks} == {"flaky"}
        assert len(fallbacks) == 2 and compiled.statistics().fallbacks == 1
        assert np.array_equal((await compiled.execute([X, C])).outputs[0], EXPECTED_Y)
        assert compiled.statistics().fallbacks == 1


async def test_a_dead_device_leaves_the_device_list():
    dead = FailsAtRun("dead", {Op.ADD}, ErrorStatus.DEAD_OBJECT)
    async with nnrt.Runtime(devices=[dead, ReferenceDevice()]) as rt:
        compiled = await rt.compile(chain_model())
        r = await compiled.execute([X, C])
        assert np.array_equal(r.outputs[0], EXPECTED_Y)
        assert [d.name for d in rt.devices] == ["nnrt-reference"]


async def test_bad_input_is_not_retried_on_the_cpu():
    adder = OnlyDevice("adder", {Op.ADD})
    async with nnrt.Runtime(devices=[adder, ReferenceDevice()]) as rt:
        compiled = await rt.compile(chain_model())
        with pytest.raises(NnrtError) as e:
            await compiled.execute([X, np.ones((1, 2, 2, 2), np.float32)])
        assert e.value.status == ErrorStatus.INVALID_ARGUMENT
        assert "adder" in {d.name for d in compiled.devices}


async def test_no_device_supporting_an_operation_is_a_clear_error():
    adder = OnlyDevice("adder", {Op.ADD})
    async with nnrt.Runtime(devices=[adder]) as rt:
        with pytest.raises(NnrtError, match=r"no device supports operation 0 \(CONV_2D\)"):
            await rt.compile(chain_model())


async def test_a_whole_model_step_that_fails_falls_back_to_a_whole_model_step_on_the_cpu():
    """Issue 16: the CPU's steps after a fallback are again one step that is
    the whole model, run on the app's input list."""
    flaky = FailsAtRun("flaky", {Op.CONV_2D, Op.ADD, Op.MUL}, ErrorStatus.GENERAL_FAILURE)
    async with nnrt.Runtime(devices=[flaky, ReferenceDevice()]) as rt:
        compiled = await rt.compile(chain_model())
        assert [d.name for d in compiled.devices] == ["flaky"]
        assert compiled._whole_steps is compiled._steps
        for _ in range(2):
            r = await compiled.execute([X, C])
            assert np.array_equal(r.outputs[0], EXPECTED_Y)
        assert [d.name for d in compiled.devices] == ["nnrt-reference"]
        assert compiled._whole_steps is compiled._steps
        assert compiled.statistics().fallbacks == 1
        assert compiled.statistics().executions == 2


class FarDevice(OnlyDevice):
    """A device ten times faster than the CPU whose every execution costs a
    ``round_trip`` first, as a remote device's does (it measures it at connect)."""

    def __init__(self, name, ops, round_trip):
        super().__init__(name, ops)
        self.round_trip = round_trip

    def capabilities(self):
        return replace(super().capabilities(), round_trip=self.round_trip)


async def test_a_round_trip_keeps_small_work_here_and_large_work_goes_there():
    far = FarDevice("far", {Op.ADD, Op.MUL, Op.CONV_2D}, round_trip=1e-3)
    async with nnrt.Runtime(devices=[far, ReferenceDevice()]) as rt:
        # Four operations on 4 elements: nothing a 1 ms trip could win back.
        small = await rt.compile(chain_model())
        assert [d.name for d in small.devices] == ["nnrt-reference"]
        step, = small.placement.steps
        assert step.note.startswith("kept off far:") and "round trip 1.000 ms" in step.note
        assert "kept off far" in str(small.placement) and "kept off far" in repr(step)
        assert not small.placement.fallbacks      # a choice, not a fallback
        np.testing.assert_array_equal((await small.execute([X, C])).outputs[0], EXPECTED_Y)
        # Four ADDs of 1M elements: about 3.8 ms saved there, more than the trip.
        large = await rt.compile(adds_model(4, (1 << 20,)))
        assert [d.name for d in large.devices] == ["far"]
        assert large.placement.steps[0].note == ""
        # One such ADD saves less than the trip: it stays.
        one = await rt.compile(adds_model(1, (1 << 20,)))
        assert [d.name for d in one.devices] == ["nnrt-reference"]
        # LOW_POWER compares power, which a trip's seconds do not measure.
        frugal = await rt.compile(chain_model(), preference=nnrt.ExecutionPreference.LOW_POWER)
        assert {d.name for d in frugal.devices} == {"far"}
    # Without a round trip the faster device takes even the small model.
    near = FarDevice("near", {Op.ADD, Op.MUL, Op.CONV_2D}, round_trip=0.0)
    async with nnrt.Runtime(devices=[near, ReferenceDevice()]) as rt:
        assert [d.name for d in (await rt.compile(chain_model())).devices] == ["near"]


def test_operation_work_counts_multiply_adds_of_convolutions_and_elements_otherwise():
    hal = chain_model().hal_model
    ops = hal.main.operations
    # CONV_2D: 4 outputs, a 1x1x1 filter per output; the rest: 4 elements.
    assert [partition.operation_work(hal, op) for op in ops] == [4.0, 4.0, 4.0, 4.0]
    m = nnrt.Model()
    x = m.add_operand(T.TENSOR_FLOAT32, [1, 8, 8, 3])
    w = m.add_operand(T.TENSOR_FLOAT32, [16, 3, 3, 3])
    m.set_operand_value(w, np.zeros((16, 3, 3, 3), np.float32))
    b = m.add_operand(T.TENSOR_FLOAT32, [16])
    m.set_operand_value(b, np.zeros(16, np.float32))
    one, zero = m.add_operand(T.INT32), m.add_operand(T.INT32)
    m.set_operand_value(one, 1)
    m.set_operand_value(zero, 0)
    y = m.add_operand(T.TENSOR_FLOAT32, [1, 8, 8, 16])
    m.add_operation(Op.CONV_2D, [x, w, b, one, one, one, one, one, one, zero], [y])
    m.identify_inputs_and_outputs([x], [y])
    hal = m.finish().hal_model
    assert partition.operation_work(hal, hal.main.operations[0]) == 8 * 8 * 16 * 3 * 3 * 3
