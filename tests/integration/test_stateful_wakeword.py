"""A real streaming model: microWakeWord's "Hey Jarvis" (int8; tests/data/wakeword,
with its provenance) keeps its streaming buffers in six TFLite resource
variables that a CALL_ONCE init subgraph sets to -128. Streamed for 50
consecutive calls, nnrt must give LiteRT's output at every call: on the
reference device the reference kernels' (BUILTIN_REF), on the litert device
XNNPACK's (LiteRT's default kernels, which round differently and drift from
the reference kernels by several units along this stream), and on a driver
service, where the state stays on the serving side. ``reset_state`` starts
the stream afresh from the init subgraph's values (from zeros it would give
other outputs from the fifth call on)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import nnrt
import nnrt.tflite

litert = pytest.importorskip("ai_edge_litert.interpreter")

DATA = Path(__file__).resolve().parents[1] / "data" / "wakeword"
MODEL = DATA / "hey_jarvis.tflite"
FRAMES = np.load(DATA / "hey_jarvis.frames.npy")   # 50 x (1, 3, 40) int8


def _litert_stream(resolver) -> np.ndarray:
    """LiteRT's output at each call of one interpreter (its variables persist
    across invoke)."""
    interp = litert.Interpreter(model_path=str(MODEL), experimental_op_resolver_type=resolver)
    interp.allocate_tensors()
    x, y = interp.get_input_details()[0]["index"], interp.get_output_details()[0]["index"]
    out = []
    for frame in FRAMES:
        interp.set_tensor(x, frame)
        interp.invoke()
        out.append(interp.get_tensor(y).copy())
    return np.stack(out)


@pytest.fixture(scope="module")
def expected() -> dict[str, np.ndarray]:
    return {"nnrt-reference": _litert_stream(litert.OpResolverType.BUILTIN_REF),
            "litert": _litert_stream(litert.OpResolverType.AUTO)}


async def _stream(compiled) -> np.ndarray:
    return np.stack([(await compiled.execute([frame])).outputs[0].copy() for frame in FRAMES])


def _within_one_unit(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype == np.uint8
    worst = np.abs(got.astype(np.int64) - want).reshape(len(FRAMES), -1).max(axis=1)
    assert worst.max() <= 1, f"calls off by more than one unit: {np.nonzero(worst > 1)[0]}"


def test_the_frames_exercise_the_state(expected):
    """The stream is worth comparing: the output climbs from 0 to a detection
    through many values, and each call depends on the calls before it."""
    ref = expected["nnrt-reference"].ravel()
    assert ref[0] == 0 and ref.max() >= 200 and len(set(ref.tolist())) >= 15
    alone = [int(v) for v in _single_calls(FRAMES[-10:])]
    assert alone != ref[-10:].tolist()


def _single_calls(frames) -> list:
    """Each frame in a fresh interpreter (the init values as state)."""
    out = []
    for frame in frames:
        interp = litert.Interpreter(model_path=str(MODEL),
                                    experimental_op_resolver_type=litert.OpResolverType.BUILTIN_REF)
        interp.allocate_tensors()
        interp.set_tensor(interp.get_input_details()[0]["index"], frame)
        interp.invoke()
        out.append(interp.get_tensor(interp.get_output_details()[0]["index"]).ravel()[0])
    return out


@pytest.mark.parametrize("device", ["nnrt-reference", "litert"])
async def test_50_calls_in_process_match_litert_call_by_call(device, expected):
    async with nnrt.Runtime(discover=False) as rt:
        compiled = await rt.compile(nnrt.tflite.load(MODEL), devices=[device])
        assert [d.name for d in compiled.devices] == [device]
        assert [i.name for i in compiled.inputs] == ["serving_default_input_audio:0"]
        _within_one_unit(await _stream(compiled), expected[device])
        memories = compiled._signature.memories
        assert len(memories) == 6 and all(m.on_device for pair in memories for m in pair)
        # reset_state: the init subgraph's -128s again (not zeros), so the
        # same stream again
        compiled.reset_state()
        _within_one_unit(await _stream(compiled), expected[device])
        stats = compiled.statistics()
        assert stats.executions == 2 * len(FRAMES) and stats.state_transfers == 2


async def test_50_calls_on_a_service_match_litert_with_the_state_on_the_service(expected):
    async with nnrt.Runtime(spawn=[("npu", "reference")], discover=False, litert=False) as rt:
        compiled = await rt.compile(nnrt.tflite.load(MODEL), devices=["npu"])
        _within_one_unit(await _stream(compiled), expected["nnrt-reference"])
        memories = compiled._signature.memories
        assert all(m.on_device and m.device.name == "npu" for pair in memories for m in pair)
        # the state crossed from the app side once: the init values, before call 1
        assert compiled.statistics().state_transfers == 1
        # a burst after reset_state: the same stream again
        compiled.reset_state()
        async with compiled.burst() as burst:
            again = np.stack([(await burst.execute([f])).outputs[0].copy() for f in FRAMES])
        _within_one_unit(again, expected["nnrt-reference"])
        assert compiled.statistics().state_transfers == 2
