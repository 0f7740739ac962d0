"""``nnrt driver serve --realtime``: the event loop's thread at SCHED_FIFO,
every thread it starts (the ones that run the apps' jobs) at the normal
policy, and a clear refusal where the process may not do it."""
import os
import resource
import shutil
import subprocess
import sys

import anyio
import numpy as np
import pytest

from nnrt.service.client import ServiceDevice
from nnrt.hal import Request

from tests.conftest import start_service, stop

from .test_service import add_model, numpy_request

FIFO_ALLOWED = os.geteuid() == 0 or resource.getrlimit(resource.RLIMIT_RTPRIO)[0] >= 1


def policy_of(tid: int) -> int:
    return os.sched_getscheduler(tid) & ~os.SCHED_RESET_ON_FORK


@pytest.mark.skipif(not FIFO_ALLOWED, reason="SCHED_FIFO needs root, CAP_SYS_NICE or an "
                                             "RLIMIT_RTPRIO; this test process has none")
def test_the_loop_runs_fifo_and_the_threads_it_starts_do_not(tmp_path):
    proc = start_service(tmp_path / "rt.sock", "reference", "rt", "--realtime", "3")
    try:
        assert policy_of(proc.pid) == os.SCHED_FIFO       # the main thread runs the loop
        assert os.sched_getparam(proc.pid).sched_priority == 3

        async def work():
            dev = await ServiceDevice.connect(str(tmp_path / "rt.sock"))
            try:
                prepared = await dev.prepare_model(add_model())
                x = np.ones((1, 4), np.float32)
                out = np.zeros((1, 4), np.float32)
                for _ in range(3):
                    result = await prepared.execute(numpy_request([x, x], [out]))
                    assert result.status == 0
                np.testing.assert_array_equal(out, x + x)
            finally:
                dev.close()

        anyio.run(work)
        others = [int(t) for t in os.listdir(f"/proc/{proc.pid}/task") if int(t) != proc.pid]
        assert others, "the executions ran on threads of their own"
        assert {policy_of(t) for t in others} == {os.SCHED_OTHER}
    finally:
        stop(proc)


def test_without_the_privilege_it_refuses_to_start_and_says_why(tmp_path):
    command = [sys.executable, "-m", "nnrt", "driver", "serve", "rt", "--socket",
               str(tmp_path / "rt.sock"), "--driver", "reference", "--realtime"]
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("root, and no setpriv to drop root's privilege with")
        command = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups",
                   "--inh-caps=-all", *command]
    elif FIFO_ALLOWED:
        pytest.skip("this process's RLIMIT_RTPRIO allows SCHED_FIFO")
    proc = subprocess.run(command, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert proc.returncode == 1, proc.stderr
    assert "--realtime 1: cannot make the event loop's thread SCHED_FIFO" in proc.stderr
    assert "CAP_SYS_NICE" in proc.stderr
    assert not (tmp_path / "rt.sock").exists()
