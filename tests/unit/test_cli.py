"""The command line's rough edges: how it ends when interrupted, when its
reader goes away, and when it cannot write what it was asked to."""
import subprocess
import sys

import pytest

from nnrt import cli
from tests.conftest import MODELS

MODEL = MODELS / "generated" / "mobilenet_v1_0.25_128_float32.tflite"


def test_ctrl_c_ends_a_command_with_one_line_and_code_130(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "_run", interrupted)
    assert cli.main(["run", str(MODEL), "--random"]) == 130
    err = capsys.readouterr().err
    assert err == "nnrt run: interrupted\n"


def test_a_missing_output_folder_is_refused_before_the_model_runs(monkeypatch, capsys, tmp_path):
    ran = []
    monkeypatch.setattr(cli.anyio, "run", lambda *a: ran.append(a))
    target = tmp_path / "missing" / "out.npz"
    assert cli.main(["run", str(MODEL), "--random", "--output", str(target)]) == 2
    assert not ran
    assert f"the folder {tmp_path / 'missing'} does not exist" in capsys.readouterr().err


@pytest.mark.service
def test_a_reader_that_goes_away_ends_the_command_quietly():
    """``nnrt devices | head -0``: the pipe is closed before nnrt writes, so
    its first write fails; it ends without a traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "nnrt", "devices"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()                  # before the interpreter has even imported nnrt
    _, err = proc.communicate(timeout=120)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert proc.returncode == 1


def test_status_remote_refuses_a_target_that_is_not_host_port(capsys):
    assert cli.main(["driver", "status", "--remote", "grpc://nowhere", "--once"]) == 1
    assert "is not [grpc://|grpcs://]HOST:PORT" in capsys.readouterr().err


def test_metrics_off_loopback_without_tls_is_refused_before_serving(capsys):
    assert cli.main(["driver", "serve", "x", "--metrics", "0.0.0.0:9464"]) == 1
    assert "--metrics serves plain HTTP on loopback addresses only" in capsys.readouterr().err
