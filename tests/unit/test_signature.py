"""Compiled models describe their inputs and outputs, take inputs by name,
and carry the state of stateful models (nnrt.runtime.signature)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import nnrt
import nnrt.tflite
from nnrt import ErrorStatus, OperandType, OperationType
from tests.conftest import MODELS

DATA = Path(__file__).resolve().parents[1] / "data" / "tflite"
SHARED = MODELS if MODELS.is_dir() else None
LSTM = SHARED / "generated" / "lstm_20x40_fused_float32.tflite" if SHARED else None
needs_shared = pytest.mark.skipif(SHARED is None, reason="the shared models folder is absent")


def _add_model() -> nnrt.Model:
    m = nnrt.Model()
    a = m.add_operand(OperandType.TENSOR_FLOAT32, [1, 0])
    b = m.add_operand(OperandType.TENSOR_QUANT8_ASYMM, [2], scale=0.5, zero_point=3)
    act = m.add_operand(OperandType.INT32)
    m.set_operand_value(act, 0)
    out = m.add_operand(OperandType.TENSOR_FLOAT32, [1, 0])
    m.add_operation(OperationType.ADD, [a, a, act], [out])
    dq = m.add_operand(OperandType.TENSOR_FLOAT32, [2])
    m.add_operation(OperationType.DEQUANTIZE, [b], [dq])
    m.identify_inputs_and_outputs([a, b], [out, dq])
    return m.finish()


async def test_a_hand_built_model_is_described_from_its_operands():
    async with nnrt.Runtime(discover=False) as rt:
        compiled = await rt.compile(_add_model())
        assert [i.name for i in compiled.inputs] == ["input0", "input1"]
        assert [o.name for o in compiled.outputs] == ["output0", "output1"]
        assert compiled.inputs[0].shape == (1, None) and compiled.inputs[0].dtype == np.float32
        q = compiled.inputs[1].quantization
        assert q.scales == (0.5,) and q.zero_points == (3,)
        result = await compiled.execute({"input1": np.array([3, 5], np.uint8),
                                         "input0": np.ones((1, 3), np.float32)})
        np.testing.assert_array_equal(result.outputs[0], np.full((1, 3), 2, np.float32))
        np.testing.assert_array_equal(result.outputs[1], [0.0, 1.0])


async def test_inputs_by_tensor_or_signature_name_and_clear_errors():
    model = nnrt.tflite.load(DATA / "int8_chain.tflite")
    (x,) = [np.load(DATA / "int8_chain.case0.in0.npy")]
    async with nnrt.Runtime(discover=False) as rt:
        compiled = await rt.compile(model)
        by_list = await compiled.execute([x])
        by_name = await compiled.execute({"a": x})
        for u, v in zip(by_list.outputs, by_name.outputs):
            np.testing.assert_array_equal(u, v)
        with pytest.raises(nnrt.NnrtError) as info:
            await compiled.execute({"b": x})
        assert info.value.status == ErrorStatus.INVALID_ARGUMENT and "'b'" in info.value.message
        with pytest.raises(nnrt.NnrtError) as info:
            await compiled.execute({})
        assert "missing" in info.value.message


@needs_shared
async def test_stateful_lstm_carries_state_and_reset_starts_afresh():
    x = np.load(LSTM.with_suffix(".in0.npy"))
    fresh = np.load(LSTM.with_suffix(".ref_out0.npy"))
    model = nnrt.tflite.load(LSTM)
    assert len(model.metadata.states) == 4  # h and c of two LSTM layers
    async with nnrt.Runtime(discover=False) as rt:
        compiled = await rt.compile(model)
        assert [i.signature_name for i in compiled.inputs] == ["seq"]  # no state inputs
        assert [o.signature_name for o in compiled.outputs] == ["cls"]
        first = (await compiled.execute({"seq": x})).outputs
        second = (await compiled.execute({"seq": x})).outputs
        assert len(first) == 1
        np.testing.assert_allclose(first[0], fresh, atol=1e-4 * np.abs(fresh).max())
        assert np.abs(second[0] - first[0]).max() > 1e-5  # the state moved on (noise is ~1e-8)
        compiled.reset_state()
        again = (await compiled.execute([x])).outputs[0]
        np.testing.assert_array_equal(again, first[0])
        # A burst carries the same state.
        compiled.reset_state()
        async with compiled.burst() as burst:
            b1 = (await burst.execute([x])).outputs[0]
            b2 = (await burst.execute([x])).outputs[0]
        np.testing.assert_array_equal(b1, first[0])
        np.testing.assert_array_equal(b2, second[0])


@needs_shared
async def test_stateful_lstm_equals_litert_invoked_three_times_on_one_interpreter():
    litert = pytest.importorskip("ai_edge_litert.interpreter")
    rng = np.random.default_rng(7)
    xs = [rng.standard_normal((1, 20, 40)).astype(np.float32) for _ in range(3)]
    interp = litert.Interpreter(model_path=str(LSTM),
                                experimental_op_resolver_type=litert.OpResolverType.BUILTIN_REF)
    interp.allocate_tensors()
    i, o = interp.get_input_details()[0]["index"], interp.get_output_details()[0]["index"]
    expected = []
    for x in xs:
        interp.set_tensor(i, x)
        interp.invoke()
        expected.append(interp.get_tensor(o).copy())
    async with nnrt.Runtime(discover=False) as rt:
        compiled = await rt.compile(nnrt.tflite.load(LSTM))
        for x, want in zip(xs, expected):
            got = (await compiled.execute([x])).outputs[0]
            np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max(), rtol=0)
        compiled.reset_state()
        fresh = litert.Interpreter(model_path=str(LSTM),
                                   experimental_op_resolver_type=litert.OpResolverType.BUILTIN_REF)
        fresh.allocate_tensors()
        fresh.set_tensor(i, xs[2])
        fresh.invoke()
        want = fresh.get_tensor(o)
        got = (await compiled.execute([xs[2]])).outputs[0]
        np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max(), rtol=0)
        assert np.abs(want - expected[2]).max() > 1e-5  # the state mattered



def _accumulator(initial) -> nnrt.Model:
    """y = state + x, and the same sum as the next state: a state pair in the
    metadata that starts at ``initial``."""
    from nnrt.model.metadata import ModelMetadata, TensorInfo
    m = nnrt.Model()
    state, x, y, new = (m.add_operand(OperandType.TENSOR_FLOAT32, [4]) for _ in range(4))
    act = m.add_operand(OperandType.INT32)
    m.set_operand_value(act, 0)
    m.add_operation(OperationType.ADD, [state, x, act], [y])
    m.add_operation(OperationType.ADD, [state, x, act], [new])
    m.identify_inputs_and_outputs([x, state], [y, new])
    f32 = np.dtype(np.float32)
    m.set_metadata(ModelMetadata(
        (TensorInfo("x", f32, (4,)), TensorInfo("state", f32, (4,))),
        (TensorInfo("y", f32, (4,)), TensorInfo("state:next", f32, (4,))),
        states=((1, 1),), initial_states=(initial,)))
    return m.finish()


@pytest.mark.parametrize("where", ["in process",
                                   pytest.param("service", marks=pytest.mark.service)])
async def test_a_state_starts_from_its_initial_value_and_reset_goes_back_to_it(where):
    """ModelMetadata.initial_states: the first execution and the first after
    reset_state start there (written into the state's device memories)."""
    if where == "service":
        runtime = nnrt.Runtime(spawn=[("npu", "reference")], discover=False, litert=False)
    else:
        runtime = nnrt.Runtime(discover=False, litert=False)
    async with runtime as rt:
        compiled = await rt.compile(_accumulator(np.array([1, 2, 3, 4], np.float32)))
        ones = np.ones(4, np.float32)
        got = [(await compiled.execute([ones])).outputs[0].tolist() for _ in range(3)]
        assert got == [[2, 3, 4, 5], [3, 4, 5, 6], [4, 5, 6, 7]]
        compiled.reset_state()
        assert (await compiled.execute([ones])).outputs[0].tolist() == [2, 3, 4, 5]
        assert all(m.on_device for pair in compiled._signature.memories for m in pair)


def test_an_initial_state_of_another_shape_or_dtype_is_refused():
    for wrong in (np.zeros(3, np.float32), np.zeros(4, np.int32)):
        with pytest.raises(nnrt.NnrtError) as info:
            _accumulator(wrong)
        assert info.value.status == ErrorStatus.INVALID_ARGUMENT
        assert "the initial state of input 1" in info.value.message
