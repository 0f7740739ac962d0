"""Coverage-guided fuzzing (atheris, tests/fuzz/atheris_service.py) of the
protocol decoder, the burst wire decoders and a service's handling of a
connection: a short run of each target here. libFuzzer exits non-zero on a
finding (an exception other than the documented refusal, or a wedge) and
writes the input as crash-*; the long run is the same command with
-max_total_time (see docs/operators/security.md)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# A test dependency where wheels exist (Linux x86_64, see pyproject.toml).
pytest.importorskip("atheris")
RUNS = {"protocol": 20_000, "burst": 20_000, "service": 1_000}


@pytest.mark.parametrize("target", sorted(RUNS))
def test_atheris_finds_nothing(target, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tests.fuzz.atheris_service", target,
                           f"-runs={RUNS[target]}", f"-artifact_prefix={tmp_path}/",
                           "-seed=1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"Done {RUNS[target]} runs" in proc.stderr
    assert not list(tmp_path.glob("crash-*"))
