"""LiteRT's C++ side announces its XNNPACK delegate on fd 2 once per process
("INFO: Created TensorFlow Lite XNNPACK delegate for CPU."), with no switch
its Python package exposes: nnrt keeps that line out of every command's
output, and only that line."""
import os
import subprocess
import sys

import pytest

from ..conftest import MODELS, ROOT

pytest.importorskip("ai_edge_litert", reason="the litert driver needs LiteRT")

BANNER = "Created TensorFlow Lite XNNPACK delegate"
MODEL = MODELS / "generated" / "mobilenet_v1_0.25_128_float32.tflite"


def test_nnrt_run_prints_no_litert_banner():
    done = subprocess.run([sys.executable, "-m", "nnrt", "run", str(MODEL), "--random",
                           "--device", "litert"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "ran on: litert" in done.stdout
    assert BANNER not in done.stdout + done.stderr


def test_what_else_reaches_fd_2_while_the_first_interpreter_is_made_is_kept():
    script = f"""
import os
from nnrt.drivers.litert import segments
model = open({str(MODEL)!r}, "rb").read()
with segments._without_delegate_banner():
    os.write(2, b"before\\n")
    interp = segments.Interpreter(model_content=model, num_threads=1)
    interp.allocate_tensors()
    os.write(2, b"after\\n")
segments.new_interpreter(model, 1)
os.write(2, b"end\\n")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stderr == "before\nafter\nend\n"
