"""What the tests share: driver services spawned as real processes, the
shared models, the extensions allowlist, the hypothesis profiles, and the
tiers.

Tiers (markers, declared in pyproject.toml): ``conformance`` (CTS vectors and
the conformance kit), ``fuzz`` (hypothesis and atheris over the decoders and a
live service), ``service`` (real processes, sockets and services), ``slow``
(seconds of work on its own). ``make check`` runs what has none of them;
``make test`` runs everything on both cores. A test is marked by its folder
(tests/conformance, tests/fuzz, and tests/integration as ``service``) and by
the service fixtures here; a unit test that starts a process, or takes
seconds, carries its marker itself.
"""
import os
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
MODELS = SHARED / "models"

# No wall-clock deadline on any hypothesis test: the work of each example is
# bounded by its strategy, and a deadline only measures how loaded the
# machine is (a first call over 200 ms under load, then a fast replay, is
# hypothesis' FlakyFailure). CI replays the same examples every run.
settings.register_profile("nnrt", deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", parent=settings.get_profile("nnrt"), derandomize=True,
                          print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "nnrt")

FOLDER_MARKS = {"conformance": pytest.mark.conformance, "fuzz": pytest.mark.fuzz,
                "integration": pytest.mark.service}


def pytest_collection_modifyitems(config, items):
    for item in items:
        folder = Path(item.fspath).relative_to(ROOT / "tests").parts[0]
        if folder in FOLDER_MARKS:
            item.add_marker(FOLDER_MARKS[folder])
        if {"reference_service", "spawn_service"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.service)


# -- driver services ----------------------------------------------------------------

def start_service(path, kind="reference", name=None, *extra, env=None) -> subprocess.Popen:
    """``nnrt driver serve`` as its own process, once it says it listens. Its
    stderr goes to an unnamed file (a pipe nobody reads would stop a service
    that logs a lot), read back if it fails to start."""
    return _serve(name or kind, "--socket", str(path), "--driver", kind, *extra, env=env)[0]


def start_remote_service(listen, kind="reference", name=None, *extra, env=None):
    """``nnrt driver serve --listen LISTEN`` (gRPC only, no socket) as its
    own process, once it listens: ``(process, "grpc[s]://HOST:PORT")``, the
    port the one it bound (LISTEN may give port 0)."""
    proc, line = _serve(name or kind, "--listen", listen, "--driver", kind, *extra, env=env)
    if "--socket" in extra:   # its socket's line came first; the gRPC one is next
        line = proc.stdout.readline().decode()
    assert "grpc" in line, line
    return proc, line.split()[-1]


def _serve(*argv, env=None) -> tuple[subprocess.Popen, str]:
    """``nnrt driver serve ARGV...`` and the line where it says it listens."""
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "-m", "nnrt", "driver", "serve", *argv],
                            stdout=subprocess.PIPE, stderr=log, env=env)
    with log:                                   # the child keeps its own descriptor
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        line = proc.stdout.readline() if ready else b""
        if b"listening" not in line:
            proc.kill()
            proc.wait()
            log.seek(0)
            raise RuntimeError(f"service {argv[0]} did not start: {line!r} "
                               f"{log.read()[-2000:]!r}")
    return proc, line.decode().strip()


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if it has not gone within 10 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def spawn_service(tmp_path):
    """A factory: ``spawn_service(kind, *flags, env=None)`` starts a service
    of driver ``kind`` on a socket of its own and gives ``(path, proc)``;
    every service it started is stopped when the test ends."""
    started = []

    def spawn(kind="reference", *extra, name=None, env=None):
        path = tmp_path / f"{name or kind}-{len(started)}.sock"
        started.append(start_service(path, kind, name, *extra, env=env))
        return path, started[-1]
    yield spawn
    for proc in started:
        stop(proc)


@pytest.fixture(scope="module")
def reference_service(tmp_path_factory):
    """One reference driver service for a module (starting one costs ~0.7 s):
    the path of its socket."""
    path = tmp_path_factory.mktemp("svc") / "reference.sock"
    proc = start_service(path, "reference", "remote-reference")
    yield path
    stop(proc)
    assert not path.exists(), "the service removes its socket on SIGTERM"


# -- models and configuration --------------------------------------------------------

@pytest.fixture
def shared_model():
    """``shared_model("generated/mobilenet_v2_1.0_224_int8")``: a shared
    .tflite model with LiteRT's stored input and first output, as
    ``(path, input, expected)``; the test is skipped when ../shared/models
    is not beside the checkout."""
    import numpy as np

    def load(name: str):
        stem = MODELS / name
        if not Path(f"{stem}.tflite").exists():
            pytest.skip(f"{stem}.tflite is not beside the checkout")
        return Path(f"{stem}.tflite"), np.load(f"{stem}.in0.npy"), np.load(f"{stem}.out0.npy")
    return load


@pytest.fixture
def allow_this_app(tmp_path, monkeypatch):
    """An extensions allowlist naming this test process's executable."""
    (tmp_path / "nnrt").mkdir()
    (tmp_path / "nnrt" / "extensions-allowlist").write_text(
        f"# tests\n{os.path.realpath(sys.executable)}\n")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    return tmp_path


@pytest.fixture
def allow_nobody(tmp_path, monkeypatch):
    """An extensions allowlist that names neither this process nor its app name."""
    (tmp_path / "nnrt").mkdir()
    (tmp_path / "nnrt" / "extensions-allowlist").write_text("/usr/bin/not-this-app\nsome-app\n")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.delenv("NNRT_APP_NAME", raising=False)
    return tmp_path
