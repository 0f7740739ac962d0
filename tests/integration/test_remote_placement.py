"""Partitioning knows a remote device's round trip (issue 42): measured at
connect against a real ``nnrt driver serve --listen`` process, it keeps a
tiny model on the local CPU although the remote LiteRT device reports itself
ten times faster, while a convolution of 231 M multiply-adds still goes
there; the placement says why."""
import numpy as np

import nnrt
import nnrt.tflite

from ..conftest import MODELS
from .test_remote import add_model, remote_service  # noqa: F401  (a fixture)

CONV = MODELS / "conv" / "conv3x3_112x112x32to64_int8"


async def test_a_tiny_model_stays_local_and_a_large_one_goes_to_the_remote_device(
        remote_service):  # noqa: F811
    _, target = remote_service("--insecure", kind="litert")
    # No in-process LiteRT: the remote device is the fast one, the CPU the other.
    async with nnrt.Runtime(remote=[target], discover=False, litert=False) as rt:
        far = rt.device("far")
        trip = far.capabilities().round_trip
        assert 0 < trip < 1.0, trip       # measured, and a sane number of seconds
        assert "round trip" in repr(far)
        tiny = await rt.compile(add_model())
        assert [d.name for d in tiny.devices] == [rt.cpu.name]
        step, = tiny.placement.steps
        assert step.note.startswith("kept off far:"), tiny.placement
        assert not tiny.placement.fallbacks
        x = np.ones((1, 4), np.float32)
        np.testing.assert_array_equal((await tiny.execute([x, x])).outputs[0], 2 * x)
        conv = await rt.compile(nnrt.tflite.load(f"{CONV}.tflite"))
        assert [d.name for d in conv.devices] == ["far"], conv.placement
        assert conv.placement.steps[0].note == ""
        got = (await conv.execute([np.load(f"{CONV}.in0.npy")])).outputs[0]
        np.testing.assert_array_equal(got, np.load(f"{CONV}.out0.npy"))
