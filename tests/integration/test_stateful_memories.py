"""The worked example of memory domains: an imported LSTM whose state
(h and c of two layers) is a model input and output, run 20 times with the
state kept in device memories -- in process and in a driver service --
gives the same results as carrying the state in numpy, and the state
crosses between the app side and the driver once (the initial zeroing)."""
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import nnrt
import nnrt.tflite
from nnrt.drivers.reference import ReferenceDevice
from tests.conftest import MODELS

LSTM = MODELS / "generated" / "lstm_20x40_fused_float32.tflite"
pytestmark = pytest.mark.skipif(not LSTM.exists(), reason="the shared models folder is absent")
RUNS = 20


async def numpy_carried(xs):
    """The oracle: the same model with its state pairs hidden from the
    runtime, the state carried by this test in numpy arrays."""
    model = nnrt.tflite.load(LSTM)
    meta = model.metadata
    pairs = meta.states
    model._metadata = replace(meta, states=())   # every input and output is the app's
    async with nnrt.Runtime(devices=[ReferenceDevice()]) as rt:
        compiled = await rt.compile(model)
        state = {i: np.zeros(meta.inputs[i].shape, meta.inputs[i].dtype) for i, _ in pairs}
        data = [k for k in range(len(meta.inputs)) if k not in state]
        outs = [k for k in range(len(meta.outputs)) if k not in {o for _, o in pairs}]
        results = []
        for x in xs:
            inputs = [None] * len(meta.inputs)
            inputs[data[0]] = x
            for i, value in state.items():
                inputs[i] = value
            result = await compiled.execute(inputs)
            state = {i: result.outputs[o].copy() for i, o in pairs}
            results.append(result.outputs[outs[0]].copy())
        return results


@pytest.mark.parametrize("where", ["in-process", "service"])
async def test_lstm_state_in_device_memories_equals_numpy(where):
    rng = np.random.default_rng(11)
    xs = [rng.standard_normal((1, 20, 40)).astype(np.float32) for _ in range(RUNS)]
    expected = await numpy_carried(xs)
    if where == "service":
        runtime = nnrt.Runtime(spawn=[("npu", "reference")], discover=False, litert=False)
    else:
        runtime = nnrt.Runtime(devices=[ReferenceDevice()])
    async with runtime as rt:
        devices = ["npu"] if where == "service" else None
        compiled = await rt.compile(nnrt.tflite.load(LSTM), devices=devices)
        got = [(await compiled.execute([x])).outputs[0] for x in xs]
        memories = compiled._signature.memories
        assert memories is not None and all(m.on_device for pair in memories for m in pair)
        assert len(memories) == 4   # h and c of two layers, two memories each
        for g, e in zip(got, expected):
            np.testing.assert_allclose(g, e, rtol=1e-6, atol=1e-7)
        stats = compiled.statistics()
        assert stats.executions == RUNS
        assert stats.state_transfers == 1   # the zeroing before the first run, nothing after
        # reset_state starts afresh: the first result again, one more transfer
        compiled.reset_state()
        again = (await compiled.execute([xs[0]])).outputs[0]
        np.testing.assert_array_equal(again, got[0])
        assert compiled.statistics().state_transfers == 2
        # a burst carries the same state
        compiled.reset_state()
        async with compiled.burst() as burst:
            for x, e in zip(xs[:3], expected):
                np.testing.assert_allclose((await burst.execute([x])).outputs[0], e,
                                           rtol=1e-6, atol=1e-7)
        compiled.close()
        assert all(m.closed for pair in memories for m in pair)


async def test_lstm_state_survives_a_sigkill_of_its_service():
    """The worked example with the service SIGKILLed before run 8: that run
    and the rest rerun on the CPU from the state the service last wrote
    (its buffers' mirrors), and all 20 results still equal numpy. The
    state crossed to the app side twice: the zeroing, the recovery."""
    import signal
    rng = np.random.default_rng(12)
    xs = [rng.standard_normal((1, 20, 40)).astype(np.float32) for _ in range(RUNS)]
    expected = await numpy_carried(xs)
    async with nnrt.Runtime(spawn=[("npu", "reference")], discover=False, litert=False) as rt:
        compiled = await rt.compile(nnrt.tflite.load(LSTM))
        assert [d.name for d in compiled.devices] == ["npu"]
        got = []
        for k, x in enumerate(xs):
            if k == 8:
                memories = compiled._signature.memories
                assert all(m.on_device for pair in memories for m in pair)
                assert compiled.statistics().state_transfers == 1
                rt._services[0].process.send_signal(signal.SIGKILL)
                rt._services[0].process.wait()
            got.append((await compiled.execute([x])).outputs[0])
        for k, (g, e) in enumerate(zip(got, expected)):
            np.testing.assert_allclose(g, e, rtol=1e-6, atol=1e-7, err_msg=f"run {k}")
        stats = compiled.statistics()
        assert stats.executions == RUNS and stats.fallbacks == 1 and stats.failures == 0
        assert stats.state_transfers == 2
        assert [d.name for d in compiled.devices] == [rt.cpu.name]
