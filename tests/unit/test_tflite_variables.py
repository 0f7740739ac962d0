"""TFLite resource variables imported as state (issue 41, stateful models).

The model is scripts/make_test_models.py's ``stateful_variables``: a CALL_ONCE
init subgraph sets three variables; the main graph reads one before assigning
it twice, reads one it never assigns, assigns one that is also an output, and
assigns one before reading it. LiteRT runs the same bytes frame by frame with
its reference kernels (its variables persist across ``invoke``): the oracle.
The real wake-word model is streamed in tests/integration/test_stateful_wakeword.py.
"""
from __future__ import annotations

from collections import Counter

import anyio
import numpy as np
import pytest

import nnrt
import nnrt.tflite
from nnrt import ErrorStatus, OperationType
from nnrt.drivers.reference import ReferenceDevice
from scripts.make_test_models import Op, build, stateful_variables

FRAMES = 50


def _frames(seed: int = 7) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.uniform(-2, 2, (1, 4)).astype(np.float32) for _ in range(FRAMES)]


def _litert_stream(data: bytes, frames) -> list[list[np.ndarray]]:
    """Every output of every frame, one LiteRT interpreter (reference kernels)
    invoked once per frame."""
    litert = pytest.importorskip("ai_edge_litert.interpreter")
    interp = litert.Interpreter(model_content=data,
                                experimental_op_resolver_type=litert.OpResolverType.BUILTIN_REF)
    interp.allocate_tensors()
    x = interp.get_input_details()[0]["index"]
    outs = [d["index"] for d in interp.get_output_details()]
    got = []
    for frame in frames:
        interp.set_tensor(x, frame)
        interp.invoke()
        got.append([interp.get_tensor(i).copy() for i in outs])
    return got


def _stream(model: nnrt.Model, frames, *, reset_at: int | None = None):
    """Every output of every frame from one compiled model on the reference
    device; ``reset_state()`` before frame ``reset_at``."""
    async def main():
        async with nnrt.Runtime(devices=[ReferenceDevice()]) as rt:
            compiled = await rt.compile(model)
            got = []
            for k, frame in enumerate(frames):
                if k == reset_at:
                    compiled.reset_state()
                got.append([o.copy() for o in (await compiled.execute([frame])).outputs])
            return got, compiled.statistics()
    return anyio.run(main)


def _close(got, want) -> None:
    # The same float32 operations in the same order as the reference kernels.
    scale = max(float(np.abs(want).max()), 1e-30)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert np.abs(got - want).max() <= 1e-4 * scale


def test_variables_become_state_pairs_with_their_initial_values():
    model = nnrt.tflite.load(build(stateful_variables()))
    meta = model.metadata
    # acc (read before assigned) and count are states; bias (never assigned)
    # is a constant, scratch (assigned before read) plain data flow.
    assert [i.name for i in meta.inputs] == ["x", "acc", "count"]
    assert [o.name for o in meta.outputs] == ["y", "count_next", "scratch", "acc:next",
                                              "count:next"]
    assert meta.states == ((1, 3), (2, 4))
    acc, count = meta.initial_states
    np.testing.assert_array_equal(acc, [[1, 2, 3, 4]])   # folded from the init's RESHAPE
    np.testing.assert_array_equal(count, [[10]])
    assert Counter(op.type for op in model.hal_model.main.operations) == Counter(
        {OperationType.ADD: 3, OperationType.MUL: 1,
         OperationType.RESHAPE: 2})   # copies: count_next is an output and a state, scratch = y


def test_a_stream_of_50_frames_gives_litert_outputs_frame_by_frame():
    data = build(stateful_variables())
    frames = _frames()
    expected = _litert_stream(data, frames)
    got, stats = _stream(nnrt.tflite.load(data), frames)
    for k, (g, e) in enumerate(zip(got, expected)):
        assert len(g) == len(e) == 3, k
        for a, b in zip(g, e):
            _close(a, b)
    assert stats.executions == FRAMES
    # count went 10 -> 60 over the stream: the state really moved
    assert float(got[-1][1].ravel()[0]) == 10 + FRAMES


def test_reset_state_goes_back_to_the_init_subgraphs_values_not_zeros():
    data = build(stateful_variables())
    frames = _frames()[:6]
    first, _ = _stream(nnrt.tflite.load(data), frames)
    again, _ = _stream(nnrt.tflite.load(data), frames + frames, reset_at=len(frames))
    for k in range(len(frames)):
        for a, b in zip(again[len(frames) + k], first[k]):
            np.testing.assert_array_equal(a, b)
    assert float(again[len(frames)][1].ravel()[0]) == 11.0   # count starts at 10 again


def _refused(init: list[Op]) -> str:
    with pytest.raises(nnrt.NnrtError) as info:
        nnrt.tflite.load(build(stateful_variables(init)))
    assert info.value.status == ErrorStatus.INVALID_ARGUMENT
    return info.value.message


def _handle(name: str, out: int) -> Op:
    return Op("VAR_HANDLE", [], [out], "VarHandleOptions", {"Container": "", "SharedName": name})


def test_an_init_subgraph_that_does_not_fold_is_refused_naming_its_operator():
    # The init computes acc's value with a TANH: not a constant computation.
    message = _refused([_handle("acc", 0), Op("TANH", [1], [3]), Op("ASSIGN_VARIABLE", [0, 3], []),
                        _handle("bias", 4), Op("ASSIGN_VARIABLE", [4, 5], []),
                        _handle("count", 6), Op("ASSIGN_VARIABLE", [6, 7], [])])
    assert "(CALL_ONCE)" in message and "init subgraph 1 is not evaluable at import" in message
    assert "operator 1 (TANH)" in message


def test_a_variable_read_before_anything_assigns_it_is_refused():
    # The init leaves count unset: LiteRT's READ_VARIABLE fails on it too.
    message = _refused([_handle("acc", 0), Op("RESHAPE", [1, 2], [3]),
                        Op("ASSIGN_VARIABLE", [0, 3], []),
                        _handle("bias", 4), Op("ASSIGN_VARIABLE", [4, 5], [])])
    assert "(READ_VARIABLE)" in message
    assert "variable 'count' is read before any value is assigned to it" in message


def test_an_initial_value_of_another_shape_than_the_read_is_refused():
    # count starts as acc's [1, 4] value but is read as [1, 1].
    message = _refused([_handle("acc", 0), Op("RESHAPE", [1, 2], [3]),
                        Op("ASSIGN_VARIABLE", [0, 3], []),
                        _handle("bias", 4), Op("ASSIGN_VARIABLE", [4, 5], []),
                        _handle("count", 6), Op("ASSIGN_VARIABLE", [6, 5], [])])
    assert "variable 'count' starts as float32 [1, 4]" in message
    assert "read as FLOAT32 [1, 1]" in message


def test_a_state_assigned_a_value_of_another_shape_is_refused():
    graphs = stateful_variables()
    assert graphs[0].ops[15].inputs == [3, 14]
    graphs[0].ops[15] = Op("ASSIGN_VARIABLE", [3, 7], [])   # count = acc + x, a [1, 4]
    with pytest.raises(nnrt.NnrtError) as info:
        nnrt.tflite.load(build(graphs))
    assert info.value.status == ErrorStatus.INVALID_ARGUMENT
    assert "variable 'count' is read as TENSOR_FLOAT32 [1, 1] but assigned TENSOR_FLOAT32 " \
           "[1, 4]" in info.value.message


def test_a_reusable_execution_carries_the_compiled_models_state():
    """create_execution on a stateful model: it binds the app's input once,
    each computation carries the state (the compiled model's, shared with
    execute and a burst), and the SyncRuntime's blocking compute does too."""
    data = build(stateful_variables())
    frames = _frames()[:8]
    expected = _litert_stream(data, frames)

    async def main():
        async with nnrt.Runtime(devices=[ReferenceDevice()]) as rt:
            compiled = await rt.compile(nnrt.tflite.load(data))
            got = []
            with compiled.create_execution() as execution:
                assert not execution.bound and len(execution.inputs) == 1
                for frame in frames[:3]:
                    execution.inputs[0][...] = frame
                    got.append([o.copy() for o in (await execution.compute()).outputs])
                got.append([o.copy() for o in (await compiled.execute([frames[3]])).outputs])
                async with compiled.burst() as burst:
                    execution.inputs[0][...] = frames[4]
                    got.append([o.copy() for o in (await burst.compute(execution)).outputs])
            return got
    got = anyio.run(main)
    with nnrt.SyncRuntime(devices=[ReferenceDevice()]) as rt:
        compiled = rt.compile(nnrt.tflite.load(data))
        execution = compiled.create_execution()
        for frame in frames[:3]:
            execution.inputs[0][...] = frame
            got.append([o.copy() for o in execution.compute().outputs])
        compiled.reset_state()
        execution.inputs[0][...] = frames[0]
        got.append([o.copy() for o in execution.compute().outputs])
    for g, e in zip(got, expected[:5] + expected[:3] + expected[:1]):
        for a, b in zip(g, e):
            _close(a, b)
    assert len(got) == 9


def test_a_state_read_straight_into_an_output_is_the_state_before_the_call():
    graphs = stateful_variables()
    graphs[0].outputs.append(5)   # acc as read, before this call assigns it
    data = build(graphs)
    frames = _frames()[:4]
    got, _ = _stream(nnrt.tflite.load(data), frames)
    for g, e in zip(got, _litert_stream(data, frames)):
        assert len(g) == len(e) == 4
        for a, b in zip(g, e):
            _close(a, b)
    np.testing.assert_array_equal(got[0][3], [[1, 2, 3, 4]])
