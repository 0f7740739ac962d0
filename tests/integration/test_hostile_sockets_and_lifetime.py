"""Who may reach a driver service, and how long it lives, with real
processes, users and sockets: the socket's folder and mode whatever the
umask, `--group`, a socket folder pre-made by another user, an app's trust
in a socket's owner, a socket that accepts and never answers, SIGTERM right
after "listening", and spawned services outliving a killed app.

Tests that need a second Unix user (uid/gid 65534, "nobody") need root to
make its files and processes; they are skipped otherwise.
"""
import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import anyio
import numpy as np
import pytest

import nnrt
from nnrt import ErrorStatus, NnrtError
from nnrt.service import protocol as p
from nnrt.runtime import discovery

from tests.conftest import start_service, stop

from .test_service import GUARD

OTHER = 65534   # "nobody" / "nogroup"
needs_root = pytest.mark.skipif(os.geteuid() != 0,
                                reason="making another user's files and processes needs root")


@pytest.fixture
def open_base():
    """A folder under /tmp that every user may enter (0755), so that only
    what the service sets decides who reaches its socket."""
    base = tempfile.mkdtemp(prefix="nnrt-hostile-")
    os.chmod(base, 0o755)
    yield base
    subprocess.run(["rm", "-rf", base], check=False)


def connect_as(uid, gid, path):
    """In a child running as ``uid``/``gid``: connect and say HELLO. Returns
    "ok", or the errno name connect failed with."""
    hello = p.encode(p.Hello(1))[0]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only syscalls, then _exit
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(GUARD)
            try:
                s.connect(path)
                s.sendall(hello)
                answer = b"ok" if len(s.recv(5)) == 5 else b"no answer"
            except OSError as e:
                answer = os.strerror(e.errno).encode() if e.errno else str(e).encode()
            os.write(w, answer)
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        answer = f.read().decode()
    os.waitpid(pid, 0)
    return answer


def test_socket_is_0600_in_a_0700_folder_whatever_the_umask(open_base):
    """Issue 23: with umask 000 the socket was 0777 and another user connected."""
    path = os.path.join(open_base, "svc", "reference.sock")
    proc = subprocess.Popen([sys.executable, "-m", "nnrt", "driver", "serve", "umask",
                             "--socket", path], stdout=subprocess.PIPE, umask=0)
    try:
        assert b"listening" in proc.stdout.readline()
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        if os.geteuid() == 0:
            assert connect_as(OTHER, OTHER, path) == os.strerror(13)   # EACCES: the folder
            os.chmod(os.path.dirname(path), 0o755)                     # an operator loosens it
            assert connect_as(OTHER, OTHER, path) == os.strerror(13)   # EACCES: the socket
            assert connect_as(os.geteuid(), os.getegid(), path) == "ok"
    finally:
        stop(proc)
    assert not os.path.exists(path)


@needs_root
def test_group_opens_the_socket_to_that_group_only(open_base):
    path = os.path.join(open_base, "svc", "reference.sock")
    proc = subprocess.Popen([sys.executable, "-m", "nnrt", "driver", "serve", "grp",
                             "--socket", path, "--group", str(OTHER)],
                            stdout=subprocess.PIPE, umask=0o077)
    try:
        assert b"listening" in proc.stdout.readline()
        folder = os.stat(os.path.dirname(path))
        sock = os.stat(path)
        assert (stat.S_IMODE(folder.st_mode), folder.st_gid) == (0o710, OTHER)
        assert (stat.S_IMODE(sock.st_mode), sock.st_gid) == (0o660, OTHER)
        assert connect_as(OTHER, OTHER, path) == "ok"          # a member of the group
        assert connect_as(OTHER, OTHER - 1, path) == os.strerror(13)   # not a member
    finally:
        stop(proc)


def serve_refusal(path, *extra):
    """Run `nnrt driver serve` expecting it to refuse: its exit code and stderr."""
    proc = subprocess.run([sys.executable, "-m", "nnrt", "driver", "serve", "refused",
                           "--socket", path, *extra], capture_output=True, timeout=30)
    return proc.returncode, proc.stderr.decode()


@pytest.mark.parametrize("how", [
    pytest.param("owned by another user", marks=needs_root), "writable by others"])
def test_a_socket_folder_someone_else_controls_is_refused(open_base, how):
    """Issue 23: another user pre-made the socket folder and took over the
    socket path (the service accepted any existing folder)."""
    folder = os.path.join(open_base, "nnrt-1000")
    os.mkdir(folder)
    if how == "owned by another user":
        os.chown(folder, OTHER, OTHER)
        os.chmod(folder, 0o700)
        expected = f"belongs to uid {OTHER}"
    else:
        os.chmod(folder, 0o777)
        expected = "writable by other users"
    code, err = serve_refusal(os.path.join(folder, "x.sock"))
    assert code == 1 and expected in err, err
    assert os.listdir(folder) == []


def test_group_that_cannot_reach_the_folder_is_refused(tmp_path):
    folder = tmp_path / "svc"
    folder.mkdir(mode=0o700)
    code, err = serve_refusal(str(folder / "x.sock"), "--group", str(os.getegid()))
    assert code == 1 and "cannot reach" in err, err


def test_sigterm_right_after_listening_removes_the_socket(tmp_path):
    """Issue 23: a SIGTERM right after the socket appeared killed the service
    before its handler existed, leaving the socket behind."""
    for k in range(3):
        path = tmp_path / f"early{k}.sock"
        proc = subprocess.Popen([sys.executable, "-m", "nnrt", "driver", "serve", "early",
                                 "--socket", str(path)], stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while not path.exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.0005)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(GUARD) == 0
        assert not path.exists()


class SilentListener:
    """A socket that accepts connections and never says a word."""

    def __init__(self, path):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(16)
        self.held = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self):
        while True:
            try:
                self.held.append(self.sock.accept()[0])
            except OSError:
                return

    def close(self):
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        for s in self.held:
            s.close()


async def test_a_socket_that_never_answers_does_not_block_runtime_start(tmp_path, monkeypatch):
    """Issue 23: connecting had no timeout; a silent socket blocked
    nnrt.Runtime() forever. A real service beside it is still found."""
    silent = SilentListener(str(tmp_path / "silent.sock"))
    real = tmp_path / "real.sock"
    proc = start_service(real, "sample-float-fast", "real")
    try:
        monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
        monkeypatch.setenv("NNRT_DRIVERS", f"{silent.path}:{real}")
        monkeypatch.setenv("NNRT_CONNECT_TIMEOUT", "0.3")
        start = time.monotonic()
        with anyio.fail_after(GUARD):
            async with nnrt.Runtime(litert=False) as rt:
                assert [d.name for d in rt.devices] == ["real", "nnrt-reference"]
        assert time.monotonic() - start < GUARD
        assert silent.held, "the runtime did connect to the silent socket"
    finally:
        silent.close()
        stop(proc)


async def test_an_app_refuses_a_socket_in_a_folder_others_can_change(tmp_path):
    folder = tmp_path / "loose"
    folder.mkdir()
    folder.chmod(0o777)
    silent = SilentListener(str(folder / "svc.sock"))
    try:
        with pytest.raises(NnrtError) as e:
            await discovery.connect(silent.path, {})
        assert e.value.status == ErrorStatus.DEVICE_UNAVAILABLE
        assert "another user" in e.value.message
        assert not silent.held, "nothing was sent to it"
    finally:
        silent.close()
    # A link there to a socket in a folder of ours: whoever put it there can re-point it.
    tight = tmp_path / "tight"
    tight.mkdir(mode=0o700)
    silent = SilentListener(str(tight / "svc.sock"))
    (folder / "link.sock").symlink_to(silent.path)
    try:
        with pytest.raises(NnrtError) as e:
            await discovery.connect(str(folder / "link.sock"), {})
        assert str(folder) in e.value.message and not silent.held
    finally:
        silent.close()


@needs_root
async def test_an_app_refuses_a_socket_of_another_user_unless_told_to_trust_it(open_base):
    silent = SilentListener(os.path.join(open_base, "svc.sock"))
    os.chown(silent.path, OTHER, OTHER)
    try:
        with pytest.raises(NnrtError) as e:
            await discovery.connect(silent.path, {})
        assert e.value.status == ErrorStatus.DEVICE_UNAVAILABLE
        assert f"uid {OTHER}" in e.value.message and "NNRT_TRUSTED_USERS" in e.value.message
        assert not silent.held, "nothing was sent to it"
        # Trusted: it is connected to, and its silence costs the timeout only.
        with pytest.raises(NnrtError) as e:
            with anyio.fail_after(GUARD):
                await discovery.connect(silent.path, {"NNRT_TRUSTED_USERS": "nobody"},
                                        timeout=0.3)
        assert "did not answer within 0.3 s" in e.value.message
        assert silent.held
    finally:
        silent.close()


APP = textwrap.dedent("""
    import sys, time, anyio, nnrt

    async def main():
        async with nnrt.Runtime(spawn=["sample-float-fast"]) as rt:
            service = rt._services[0]
            print(service.process.pid, service.socket_path, flush=True)
            await anyio.sleep(3600)
    anyio.run(main)
""")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_spawned_services_die_with_their_app(sig, tmp_path):
    """Runtime(spawn=...) services die with a SIGKILLed or SIGTERMed app,
    and leave neither their socket nor the app's folder of them behind."""
    app = subprocess.Popen([sys.executable, "-c", APP], stdout=subprocess.PIPE,
                           env={**os.environ, "XDG_CONFIG_HOME": str(tmp_path)})
    try:
        line = app.stdout.readline().decode().split()
        assert line, "the app did not start its service"
        pid, socket_path = int(line[0]), line[1]
        pidfd = os.pidfd_open(pid)
        app.send_signal(sig)
        app.wait(GUARD)
        try:
            gone = select_readable(pidfd, GUARD)
        finally:
            os.close(pidfd)
        assert gone, f"the service {pid} outlived its app"
        assert not os.path.exists(socket_path), "the service left its socket behind"
        assert not os.path.exists(os.path.dirname(socket_path)), \
            "the app's nnrt-services-* folder stayed"
    finally:
        if app.poll() is None:
            app.kill()
            app.wait()


def select_readable(fd, timeout):
    import select
    return bool(select.select([fd], [], [], timeout)[0])


def test_serve_refuses_a_parent_that_is_already_gone(tmp_path):
    code, err = serve_refusal(str(tmp_path / "x.sock"), "--parent-pid", "999999999")
    assert code == 1 and "gone" in err


def test_a_second_client_is_unaffected_by_refused_connections(tmp_path):
    """The checks above refuse without harming a service's other clients."""
    path = tmp_path / "svc.sock"
    proc = start_service(path, "reference", "shared")
    try:
        async def main():
            from .test_service import add_model, numpy_request
            dev = await discovery.connect(str(path), {})
            prepared = await dev.prepare_model(add_model())
            x = np.ones((1, 4), np.float32)
            code, err = serve_refusal(str(path))     # a second service on the same path
            assert code == 1 and "already listening" in err
            out = np.zeros((1, 4), np.float32)
            result = await prepared.execute(numpy_request([x, x], [out]))
            assert result.status == ErrorStatus.NONE and out.tolist() == [[2.0] * 4]
            dev.close()
        anyio.run(main)
    finally:
        stop(proc)


async def test_connecting_to_a_socket_that_never_answers_hello_gives_up(tmp_path):
    """A socket that accepts and stays silent: ServiceDevice.connect itself
    (not only discovery) gives DEVICE_UNAVAILABLE after its timeout, and
    closes its end."""
    from nnrt.service.client import ServiceDevice
    path = str(tmp_path / "silent.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    try:
        with anyio.fail_after(30):             # a guard against the wait, not a timing
            with pytest.raises(NnrtError, match="did not answer within 0.2 s") as e:
                await ServiceDevice.connect(path, timeout=0.2)
        assert e.value.status == ErrorStatus.DEVICE_UNAVAILABLE
        peer, _ = listener.accept()
        assert peer.recv(1 << 16, socket.MSG_PEEK)    # it did say HELLO
        peer.settimeout(10)
        while peer.recv(1 << 16):                      # and then hung up: EOF
            pass
        peer.close()
    finally:
        listener.close()


async def test_a_service_that_stops_answering_fails_the_apps_control_calls_after_their_bound(
        spawn_service):
    """A service that accepted us and then stops answering (here: SIGSTOP,
    as a wedged or paused process) costs a control call its bound
    (``call_timeout``, NNRT_CALL_TIMEOUT), not the app's life: the call and
    everything pending on the connection fail with DEAD_OBJECT."""
    from nnrt.service.client import ServiceDevice
    from .test_service import add_model
    path, proc = spawn_service("reference")
    dev = await ServiceDevice.connect(str(path), call_timeout=0.3)
    try:
        await dev.prepare_model(add_model())           # answered while it runs
        proc.send_signal(signal.SIGSTOP)
        try:
            with anyio.fail_after(30):                 # a guard against the wait, not a timing
                with pytest.raises(NnrtError, match="no answer to a control call within 0.3 s") \
                        as e:
                    await dev.prepare_model(add_model())
            assert e.value.status == ErrorStatus.DEAD_OBJECT
            assert not dev.alive
        finally:
            proc.send_signal(signal.SIGCONT)
    finally:
        dev.close()
    with pytest.raises(NnrtError, match="is not a positive number"):
        await ServiceDevice.connect(str(path), call_timeout=0)


async def test_a_client_that_never_answers_the_services_call_costs_only_its_own_frame(
        spawn_service):
    """GET_MEMORIES (the service asking an app for a burst's slots) waits at
    most ``--limit client_answer_ms``: an app that never answers gets that
    frame failed on its result ring, and the service's burst thread is free
    again (the next frame, with no slots, is served)."""
    from nnrt.burst import wire
    from .test_hostile_bursts_and_memory import HostileApp, read_results
    path, proc = spawn_service("reference", "--limit", "client_answer_ms=300")
    app = HostileApp(path)
    try:
        with app.raw_burst(app.prepare()) as (requests, results, _):
            arg = wire.BurstArgument(False, 0, 0, 16, ())   # in slot 7
            requests.write_nowait(wire.encode_request(wire.BurstRequest(1, (arg, arg), (arg,),
                                                                        (7,))))
            requests.write_nowait(wire.encode_request(wire.BurstRequest(2, (), (), ())))
            first, second = await read_results(results, 2)
            assert first.serial == 1 and first.status == ErrorStatus.GENERAL_FAILURE
            assert "did not answer within 0.3 s (limit client_answer_ms)" in first.message, \
                first.message
            assert second.serial == 2
    finally:
        app.close()
