"""The reference driver runs numpy's BLAS on one thread (nnrt/drivers/blas.py):
a product split across BLAS worker threads made a HIGH job wait behind LOW
convolutions for the workers to get a CPU (docs/design/scheduler.md). Process-wide state,
so each case runs in a fresh interpreter."""
import json
import os
import subprocess
import sys

import numpy  # noqa: F401  (loads the BLAS threadpool_info looks for)
import pytest
from threadpoolctl import threadpool_info

pytestmark = pytest.mark.service     # each case is a fresh interpreter

PROBE = """
import json
from threadpoolctl import threadpool_info
import numpy
before = [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]
from nnrt.drivers.reference import ReferenceDevice
ReferenceDevice()
after = [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]
print(json.dumps([before, after]))
"""

needs_blas = pytest.mark.skipif(not [i for i in threadpool_info() if i["user_api"] == "blas"],
                                reason="this numpy uses no BLAS library")


def _threads(**env) -> tuple[list[int], list[int]]:
    environ = {k: v for k, v in os.environ.items()
               if k not in ("NNRT_BLAS_THREADS", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}
    environ.update(env, OPENBLAS_NUM_THREADS="2", OMP_NUM_THREADS="2")
    out = subprocess.run([sys.executable, "-c", PROBE], env=environ, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    before, after = json.loads(out)
    return before, after


@needs_blas
def test_a_reference_device_makes_blas_single_threaded():
    before, after = _threads()
    assert before and all(n == 2 for n in before)
    assert all(n == 1 for n in after)


@needs_blas
def test_nnrt_blas_threads_zero_leaves_the_blas_alone_and_a_count_is_used():
    assert _threads(NNRT_BLAS_THREADS="0")[1] == _threads(NNRT_BLAS_THREADS="0")[0]
    assert all(n == 2 for n in _threads(NNRT_BLAS_THREADS="2")[1])
    assert all(n == 1 for n in _threads(NNRT_BLAS_THREADS="many")[1])   # not a count: default
