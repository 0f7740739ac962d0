"""Scale-out (issue 42, deliverable 6): a pool of real ``nnrt driver serve
--listen`` processes on 127.0.0.2 and 127.0.0.3 (loopback, standing for
two hosts) as one device -- executions spread over the members, a burst
and a reusable execution stay on one, a killed member's work runs again on the other and the
member comes back; ``nnrt driver status --remote`` and the Prometheus
endpoint, checked against the services' own accounting."""
import os
import signal
import ssl
import subprocess
import sys
import urllib.request

import anyio
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import nnrt
from nnrt.service.client import ServiceDevice
from nnrt.service.remote.client import RemoteDevice, remote_status

from .test_remote import BOUND, HOST, add_model, pki, remote_service  # noqa: F401 (fixtures)

HOSTS = (HOST, "127.0.0.3")


async def _done(targets) -> list[int]:
    """Each service's completed jobs, from its own scheduler (Status)."""
    counts = []
    for target in targets:
        _, value = await remote_status(target)
        counts.append(sum(c.completed for c in value.statistics.classes))
    return counts


def _pool(remote_service):
    return [remote_service("--insecure", "--statistics", "all", name=f"m{k}",
                           listen=f"{host}:0") for k, host in enumerate(HOSTS)]


async def test_a_pool_spreads_executions_over_its_members_and_keeps_a_burst_on_one(
        remote_service):
    targets = [target for _, target in _pool(remote_service)]
    async with nnrt.Runtime(remote=targets, pool="cpu-pool", discover=False, litert=False,
                            strict=True) as rt:
        (state,) = rt.services
        assert (state.path, state.state, state.device) == \
            (f"pool:cpu-pool={'+'.join(targets)}", "up", "cpu-pool")
        assert [(m.target, m.state, m.device) for m in state.members] == \
            [(targets[0], "up", "m0"), (targets[1], "up", "m1")]
        # Named: unasked, a 1x4 ADD is not worth a round trip (it stays local).
        compiled = await rt.compile(add_model(), devices=["cpu-pool"])
        assert [d.name for d in compiled.devices] == ["cpu-pool"]
        x = np.random.default_rng(0).random((1, 4), dtype=np.float32)

        async def stream() -> None:
            for _ in range(4):
                np.testing.assert_array_equal((await compiled.execute([x, x])).outputs[0], 2 * x)

        with anyio.fail_after(BOUND):
            async with anyio.create_task_group() as tg:
                for _ in range(8):
                    tg.start_soon(stream)
        spread = await _done(targets)
        assert sum(spread) == 32 and min(spread) > 0, spread
        # A burst is bound to one member and stays there; a second one,
        # opened while the first is bound, goes to the other member.
        async with compiled.burst() as first, compiled.burst() as second:
            for _ in range(2):
                await first.execute([x, x])
            for _ in range(4):
                np.testing.assert_array_equal((await second.execute([x, x])).outputs[0], 2 * x)
        after = await _done(targets)
        assert sorted(a - b for a, b in zip(after, spread)) == [2, 4]
        # A reusable execution is bound to one member too, and stays there.
        frame = np.zeros((1, 4), np.float32)
        execution = compiled.create_execution([frame, x], reusable=True)
        for k in range(3):
            frame[:] = k
            np.testing.assert_array_equal((await execution.compute()).outputs[0], x + k)
        final = await _done(targets)
        assert sorted(a - b for a, b in zip(final, after)) == [0, 3]


async def test_a_killed_member_s_pending_work_reruns_on_the_other_and_it_comes_back(
        remote_service):
    members = _pool(remote_service)
    targets = [target for _, target in members]
    async with nnrt.Runtime(remote=targets, pool="cpu-pool", discover=False, litert=False,
                            strict=True) as rt:
        compiled = await rt.compile(add_model(), devices=["cpu-pool"])
        pool = compiled.devices[0]
        x = np.random.default_rng(1).random((1, 4), dtype=np.float32)
        async with compiled.burst() as burst:
            await burst.execute([x, x])
            before = await _done(targets)
            bound = before.index(1)          # the member the burst is on
            proc = members[bound][0]
            # Stopped, the member holds whatever is sent to it: the burst's
            # next frame at least. Then it is killed.
            proc.send_signal(signal.SIGSTOP)
            results = []

            async def run(execute) -> None:
                results.append(await execute([x, x]))

            with anyio.fail_after(BOUND):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(run, burst.execute)
                    for _ in range(4):
                        tg.start_soon(run, compiled.execute)
                    await anyio.sleep(0.3)
                    proc.send_signal(signal.SIGKILL)
            assert len(results) == 5     # none raised (a failure would)
            for r in results:
                np.testing.assert_array_equal(r.outputs[0], 2 * x)
            other = 1 - bound
            assert (await _done([targets[other]]))[0] == before[other] + 5
            # The pool stays usable: the burst is bound to the other member now.
            np.testing.assert_array_equal((await burst.execute([x, x])).outputs[0], 2 * x)
        assert [d.name for d in compiled.devices] == ["cpu-pool"]
        assert [m.state for m in pool.members()][bound] == "down"
        # The member comes back on its address; the runtime finds it.
        proc.wait()
        remote_service("--insecure", "--statistics", "all", name=f"m{bound}",
                       listen=targets[bound].removeprefix("grpc://"))
        for _ in range(50):
            if pool.members()[bound].state == "up":
                break
            await anyio.sleep(0.2)
        assert pool.members()[bound].state == "up"
        # Two bursts at once: one of them is bound to the member that came back.
        async with compiled.burst() as a, compiled.burst() as b:
            await a.execute([x, x])
            await b.execute([x, x])
        assert (await _done([targets[bound]]))[0] == 1


async def test_status_remote_and_metrics_show_the_service_s_own_accounting(remote_service,
                                                                          tmp_path):
    socket = tmp_path / "far.sock"
    proc, target = remote_service("--insecure", "--statistics", "all", "--metrics",
                                  f"{HOST}:0", "--socket", str(socket))
    url = proc.stdout.readline().decode().split()[-1]
    assert url.startswith(f"http://{HOST}:") and url.endswith("/metrics")
    device = await RemoteDevice.connect(target)
    local = await ServiceDevice.connect(str(socket))     # an app on the socket, too
    try:
        async with nnrt.Runtime(devices=[device, local], strict=True) as rt:
            compiled = await rt.compile(add_model(), devices=["far"])
            x = np.ones((1, 4), np.float32)
            for _ in range(5):
                await compiled.execute([x, x])
            on_socket = await rt.compile(add_model(), devices=[local])
            for _ in range(3):
                await on_socket.execute([x, x])
            async with compiled.burst() as burst:
                for _ in range(2):
                    await burst.execute([x, x])
                text = await anyio.to_thread.run_sync(
                    lambda: urllib.request.urlopen(url, timeout=BOUND).read().decode())
                _, value = await remote_status(target)
                unreachable = "grpc://127.0.0.3:1"   # nothing listens there
                table = await anyio.to_thread.run_sync(lambda: subprocess.run(
                    [sys.executable, "-m", "nnrt", "driver", "status", "--remote", target,
                     "--remote", unreachable, "--once"], capture_output=True, timeout=60,
                    env={**os.environ, "NNRT_CONNECT_TIMEOUT": "5"}))
    finally:
        device.close()
        local.close()
    (cls,) = [c for c in value.statistics.classes if c.app[0] == "remote"]
    samples = {(s.name, s.labels.get("app")): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    app = f"{cls.app[0]} {cls.app[1]}"
    assert samples[("nnrt_app_completed_total", app)] == cls.completed == 7
    assert samples[("nnrt_app_run_seconds_total", app)] == pytest.approx(cls.run_time)
    assert samples[("nnrt_app_deadline_misses_total", app)] == cls.deadline_misses == 0
    assert samples[("nnrt_app_preemptions_total", app)] == cls.preempted
    assert samples[("nnrt_app_queued", app)] == 0
    # What the app holds under the service's limits: its session, its
    # model, the open burst and the burst's one layout (2 inputs and an
    # output of 16 bytes, on pools of the server's own).
    assert samples[("nnrt_app_connections", app)] == 1
    assert samples[("nnrt_app_models", app)] == 1
    assert samples[("nnrt_app_bursts", app)] == 1
    assert samples[("nnrt_app_mapped_bytes", app)] == 48
    assert samples[("nnrt_device_slots", None)] == 1
    # The socket's app, in the same figures: its pid, its 3 executions.
    mine = f"pid {os.getpid()}"
    assert samples[("nnrt_app_completed_total", mine)] == 3
    assert samples[("nnrt_app_connections", mine)] == 1
    assert samples[("nnrt_app_models", mine)] == 1
    assert samples[("nnrt_app_share", mine)] + samples[("nnrt_app_share", app)] == \
        pytest.approx(1)
    # One table: the host's app rows (7 and 3 done), and the host that did not answer.
    assert table.returncode == 0, table.stderr
    lines = table.stdout.decode().splitlines()
    assert lines[0].split()[:4] == ["host", "device", "app", "rule"]
    rows = [line for line in lines if line.startswith(target)]
    (remote_row,) = [line for line in rows if app in line]
    (local_row,) = [line for line in rows if mine in line]
    assert len(rows) == 2
    assert remote_row.split()[-3:] == ["7", "0", "0"]
    assert local_row.split()[-3:] == ["3", "0", "0"]
    (down,) = [line for line in lines if line.startswith(unreachable)]
    assert "unreachable" in down and "UNAVAILABLE" in down


def test_metrics_are_https_with_the_listener_s_certificate(remote_service, pki):
    proc, _ = remote_service("--tls-cert", str(pki["server"]), "--tls-key", str(pki["server.key"]),
                             "--client-ca", str(pki["ca"]), "--metrics", f"{HOST}:0")
    url = proc.stdout.readline().decode().split()[-1]
    assert url.startswith(f"https://{HOST}:")
    context = ssl.create_default_context(cafile=str(pki["ca"]))
    with pytest.raises(OSError):     # no client certificate: the handshake is refused
        urllib.request.urlopen(url, timeout=BOUND, context=context).read()
    context.load_cert_chain(str(pki["camera"]), str(pki["camera.key"]))
    text = urllib.request.urlopen(url, timeout=BOUND, context=context).read().decode()
    samples = {s.name: s.value for family in text_string_to_metric_families(text)
               for s in family.samples}
    assert samples["nnrt_device_slots"] == 1 and samples["nnrt_device_busy_slots"] == 0
