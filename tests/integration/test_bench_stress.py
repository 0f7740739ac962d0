"""nnrt bench --stress classifies each model's child process: a driver that
kills the process is a CRASH, one that never answers a HANG, one that
returns wrong numbers a FAILURE, and a correct one a SUCCESS."""
import subprocess
import sys
from pathlib import Path

from nnrt.bench.runner import BenchConfig
from nnrt.bench.stress import run_stress

MODEL = str(Path(__file__).parents[1] / "data" / "tflite" / "float_chain.tflite")
DOUBLES = "tests.integration.bench_doubles"


def _stress(factory: str, seconds: float = 3.0, hang: float = 4.0, **kwargs):
    [result] = run_stress(BenchConfig(models=[MODEL]), seconds=seconds, hang_seconds=hang,
                          driver=f"{DOUBLES}:{factory}", **kwargs)
    return result


def test_a_correct_driver_is_a_success():
    r = _stress("good")
    assert r.verdict == "SUCCESS", r
    assert r.runs > 2 and r.last_output == ""


def test_a_driver_that_kills_its_process_is_a_crash():
    r = _stress("crashing")
    assert r.verdict == "CRASH", r
    assert "SIGKILL" in r.detail
    assert r.runs == 2 and "run 2 ok" in r.last_output   # the last output is kept


def test_a_driver_that_never_answers_is_a_hang():
    r = _stress("hanging", seconds=30, hang=2.0)
    assert r.verdict == "HANG", r
    assert r.runs == 2 and r.seconds < 30   # killed on no progress, not at the end


def test_a_driver_that_never_compiles_is_a_hang_after_the_start_allowance():
    # The short hang limit counts executions only: a slow start on a busy
    # machine is not a hang, a start that never ends is one.
    r = _stress("hanging_at_start", seconds=30, hang=0.5, start_seconds=4.0)
    assert r.verdict == "HANG", r
    assert r.runs == 0 and r.detail == "did not start within 4 s; killed"
    assert 4.0 <= r.seconds < 30


def test_a_driver_with_wrong_results_is_a_failure():
    r = _stress("wrong")
    assert r.verdict == "FAILURE", r
    assert "execution 3 gave a wrong result" in r.detail and r.runs == 2


def test_the_command_line_reports_each_verdict_and_fails(tmp_path):
    report = tmp_path / "stress.html"
    out = subprocess.run([sys.executable, "-m", "nnrt", "bench", "--stress", MODEL,
                          "--seconds", "2", "--hang-seconds", "5",
                          "--driver", f"{DOUBLES}:wrong", "--report", str(report)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "FAILURE" in out.stdout and "wrong result" in out.stdout
    assert "FAILURE" in report.read_text()


def test_a_named_in_process_device_runs_too():
    [r] = run_stress(BenchConfig(models=[MODEL], devices=["nnrt-reference"], discover=False),
                     seconds=1.5, hang_seconds=10)
    assert r.verdict == "SUCCESS", r
