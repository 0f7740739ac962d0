"""A configured driver service killed and restarted under a running app: the
compiled model moves off it (to the best devices left) and back to it once
it is reachable again, with no app code for either; pinned to it
(``devices=[...]``), it fails with DEAD_OBJECT while the service is down
and works again once it is back."""
import os
import signal

import anyio
import numpy as np
import pytest

import nnrt
from nnrt import ErrorStatus

from ..conftest import start_service, stop
from .test_service import GUARD, public_add_model

pytestmark = pytest.mark.service

X = np.arange(4, dtype=np.float32).reshape(1, 4)
SUM = (X + X).tolist()


@pytest.fixture
def npu(tmp_path, monkeypatch):
    """A configured sample service "npu" (NNRT_DRIVERS) and a function that
    starts it again; whatever runs last is stopped at the end."""
    path = tmp_path / "npu.sock"
    monkeypatch.setenv("NNRT_DRIVERS", str(path))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    procs = []

    def start():
        procs.append(start_service(path, "sample-float-fast", "npu"))
        return procs[-1]
    start()
    yield procs, start
    stop(procs[-1])


def _kill(proc) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


async def _until(compiled, devices: list[str]) -> int:
    """Execute until the model runs on ``devices`` (the move back happens in
    the background: a guard, not a timing assertion); the executions it took."""
    with anyio.fail_after(GUARD):
        for n in range(1, 10_000):
            result = await compiled.execute([X, X])
            assert result.outputs[0].tolist() == SUM
            if [d.name for d in compiled.devices] == devices:
                return n
            await anyio.sleep(0.05)
    raise AssertionError("never moved")


async def test_a_model_moves_off_a_dead_service_and_back_when_it_returns(npu):
    procs, start = npu
    async with nnrt.Runtime(litert=False) as rt:
        compiled = await rt.compile(public_add_model())
        assert [d.name for d in compiled.devices] == ["npu"]
        assert (await compiled.execute([X, X])).outputs[0].tolist() == SUM
        _kill(procs[-1])
        # The next execution reruns on the devices left, and so do later ones.
        assert (await compiled.execute([X, X])).outputs[0].tolist() == SUM
        assert [d.name for d in compiled.devices] == ["nnrt-reference"]
        assert [f.kind for f in compiled.placement.fallbacks] == ["died"]
        start()
        await _until(compiled, ["npu"])
        assert compiled.placement.fallbacks == ()
        assert compiled.statistics().fallbacks == 1
        # A reusable execution follows the model: it binds on the service again.
        execution = compiled.create_execution([X, X])
        assert (await execution.compute()).outputs[0].tolist() == SUM


async def _while_dead(attempt, pause: float | None):
    """``await attempt()`` again while it raises DEAD_OBJECT (the service is
    down), ``pause`` seconds apart; what it returns once it works."""
    with anyio.fail_after(GUARD):
        while True:
            try:
                return await attempt()
            except nnrt.NnrtError as e:
                assert e.status == ErrorStatus.DEAD_OBJECT
                if pause is not None:
                    await anyio.sleep(pause)


async def test_a_pinned_model_fails_while_its_service_is_down_then_recovers(npu):
    procs, start = npu
    async with nnrt.Runtime(litert=False) as rt:
        compiled = await rt.compile(public_add_model(), devices=["npu"])
        assert (await compiled.execute([X, X])).outputs[0].tolist() == SUM
        _kill(procs[-1])
        for _ in range(3):
            with pytest.raises(nnrt.NnrtError) as e:
                await compiled.execute([X, X])
            assert e.value.status == ErrorStatus.DEAD_OBJECT
        start()
        result = await _while_dead(lambda: compiled.execute([X, X]), pause=0.05)
        assert result.outputs[0].tolist() == SUM
        assert [d.name for d in compiled.devices] == ["npu"]
        assert compiled.statistics().fallbacks == 0


async def test_a_pinned_burst_opened_again_in_a_loop_recovers_when_its_service_returns(npu):
    """An app that reopens its burst after each DEAD_OBJECT: every failed
    open is a checkpoint (the runtime's look for the service runs between
    them) and the model moves back, with no reconnect or compile of its own."""
    procs, start = npu
    async with nnrt.Runtime(litert=False) as rt:
        compiled = await rt.compile(public_add_model(), devices=["npu"])
        _kill(procs[-1])
        with pytest.raises(nnrt.NnrtError) as e:
            await compiled.execute([X, X])
        assert e.value.status == ErrorStatus.DEAD_OBJECT
        start()

        async def one_frame():
            async with compiled.burst() as burst:
                return await burst.execute([X, X]), burst.statistics().sessions
        # No pause between the opens: each failed open must be a checkpoint.
        result, sessions = await _while_dead(one_frame, pause=None)
        assert result.outputs[0].tolist() == SUM
        assert sessions[0] is not None and sessions[0].executions == 1   # the service's ring
        assert [d.name for d in compiled.devices] == ["npu"]
