"""Protection across apps in a driver service, with real processes: a light
app at 30 fps against another app's flood waits at most one of the flood's
operations per frame; two flooding apps share the device by the weights an
operator's policy gives them (matched by executable); 100 concurrent
executions of one app all complete. Every figure is read from the service
scheduler's own records (STATISTICS), never from wall-clock luck."""
import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time

import anyio
import numpy as np
import pytest

import nnrt
from nnrt.service.client import ServiceDevice
from nnrt import ErrorStatus, Priority

from .test_qos_inprocess import DIMS, chain_model
from .test_qos_service import FLOODER, _contended_run_time, _env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _flooder(env, seconds, inflight, python=sys.executable, ops=30):
    """A process flooding the service for ``seconds`` at most: :func:`_stop`
    ends it sooner."""
    return subprocess.Popen([python, "-c", FLOODER.format(root=ROOT, seconds=seconds,
                                                          inflight=inflight, ops=ops)],
                            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _stop(proc):
    """Tell a flooder the test has seen enough (it stops after the runs in flight)."""
    proc.stdin.write("stop\n")
    proc.stdin.flush()


def _report(proc):
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out
    return json.loads(out.strip().splitlines()[-1])


async def _collect(rt, name, procs, seen, apps=None):
    """The service keeps its latest 256 records: read them as they come (and
    into ``apps`` what the policy gave each app, while it is there)."""
    while any(p.poll() is None for p in procs):
        seen.update((r.seq, r) for r in await rt.finished_jobs(name))
        if apps is not None:
            apps.update((a.app, a) for a in (await rt.statistics(name)).apps)
        await anyio.sleep(0.1)
    seen.update((r.seq, r) for r in await rt.finished_jobs(name))


async def _until_running(rt, app):
    """Until ``app`` (a flooding process) has a job on the device."""
    for _ in range(5000):
        if (await rt.statistics("npu")).of(app, Priority.LOW).running:
            return
        await anyio.sleep(0.002)


async def _frames(light, n: int) -> list[bool]:
    """``n`` frames of the light model at 30 fps; whether each was right."""
    frames = []
    start = anyio.current_time()
    for k in range(n):
        r = await light.execute([np.full(16, k, np.float32)])
        frames.append(r.outputs[0].tolist() == [k + 2.0] * 16)
        await anyio.sleep(max(0.0, start + (k + 1) / 30 - anyio.current_time()))
    return frames


@contextlib.asynccontextmanager
async def _light_app_on_a_service(monkeypatch, tmp_path):
    """A service keyed by pid, this process's light HIGH model on it, and
    the environment a flooding process needs to reach it: ``(rt, light,
    env)``. The tests read the floods' jobs too: the operator's view."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.delenv("NNRT_DRIVERS", raising=False)
    async with nnrt.Runtime(spawn=[("npu", "reference", "--app-key", "pid",
                                    "--statistics", "all")]) as rt:
        light = await rt.compile(chain_model(2, (16,)), priority=Priority.HIGH, devices=["npu"])
        yield rt, light, _env(rt.device("npu").socket_path, tmp_path)


async def test_a_light_app_waits_at_most_one_operation_of_a_flooding_app(monkeypatch, tmp_path):
    async with _light_app_on_a_service(monkeypatch, tmp_path) as (rt, light, env):
        me = ("pid", os.getpid())
        flood = _flooder(env, seconds=5.0, inflight=3)
        other = ("pid", flood.pid)
        seen = {}
        async with anyio.create_task_group() as tg:
            tg.start_soon(_collect, rt, "npu", [flood], seen)
            await _until_running(rt, other)
            frames = await _frames(light, 60)       # 2 s at 30 fps
            _stop(flood)
        _report(flood)
    records = sorted(seen.values(), key=lambda r: r.seq)
    mine = [r for r in records if r.app == me]
    theirs = [r for r in records if r.app == other and r.started_at is not None]
    assert all(frames) and len(frames) == 60
    assert len(mine) == 60 and all(r.status == ErrorStatus.NONE for r in mine)
    # The flood really competed: its jobs ran and were preempted for the frames.
    assert len(theirs) > 20 and sum(r.preemptions for r in theirs) >= 30
    # Each frame waited at most one of the flood's operations (the longest
    # time between two of its boundaries, as the scheduler measured it).
    longest_op = max(r.longest_step for r in theirs)
    waits = sorted(r.wait for r in mine)
    assert waits[-1] <= longest_op, (waits[-5:], longest_op)
    # A frame that preempted the flood ran on the preempted job's thread
    # (donation across apps, pinned): no thread wake-up between its
    # dispatch and its run, so its run time is its whole time in the slot.
    donated = [r for r in mine if r.ran == r.finished_at - r.started_at]
    assert len(donated) >= sum(r.preemptions for r in theirs), (len(donated), len(mine))


async def test_a_flood_that_starts_later_is_owed_nothing_of_what_ran_before(monkeypatch,
                                                                              tmp_path):
    # F7 in a service: the light app runs beside one flood, which then goes
    # on alone for a while and ends; a second flooding app starts. Placed
    # at zero, the newcomer was owed everything the first flood and the
    # light app had run, and the light app's next frame waited for it to
    # catch up (2.9 s in benchmarks/qos_apps.py). Placed at the system's
    # virtual time, every frame still waits at most one of its operations.
    async with _light_app_on_a_service(monkeypatch, tmp_path) as (rt, light, env):
        me = ("pid", os.getpid())
        seen = {}
        frames = []
        floods = []
        for seconds, n in ((3.0, 30), (2.5, 45)):
            flood = _flooder(env, seconds=seconds, inflight=3)
            floods.append(("pid", flood.pid))
            async with anyio.create_task_group() as tg:
                tg.start_soon(_collect, rt, "npu", [flood], seen)
                await _until_running(rt, floods[-1])
                frames += await _frames(light, n)
                if len(floods) == 1:    # the first flood runs on alone for a while
                    await _until_alone(seen, floods[0], frames_end=time.monotonic(),
                                       jobs=30, proc=flood)
                _stop(flood)
            _report(flood)
    records = sorted(seen.values(), key=lambda r: r.seq)
    assert all(frames) and len(frames) == 75
    mine = [r for r in records if r.app == me]
    assert len(mine) == 75 and all(r.status == ErrorStatus.NONE for r in mine)
    first = [r for r in records if r.app == floods[0] and r.started_at is not None]
    assert sum(r.started_at > mine[29].finished_at for r in first) > 20   # it ran on alone
    for flood in floods:
        theirs = [r for r in records if r.app == flood and r.started_at is not None]
        assert len(theirs) > 20
        start, end = theirs[0].started_at, theirs[-1].finished_at
        waits = [r.wait for r in mine if start <= r.submitted_at <= end]
        assert len(waits) >= 25
        # Each frame, the first after the flood began included, waited at
        # most one of the flood's operations (its longest step, as the
        # scheduler measured it).
        longest_op = max(r.longest_step for r in theirs)
        assert max(waits) <= longest_op, (flood, waits[:3], max(waits), longest_op)


async def _until_alone(seen, app, frames_end, jobs, proc):
    """Until ``jobs`` of ``app``'s jobs (as ``_collect`` reads them into
    ``seen``) started after ``frames_end`` (or its process ended)."""
    while proc.poll() is None and sum(
            r.app == app and r.started_at is not None and r.started_at > frames_end
            for r in list(seen.values())) < jobs:
        await anyio.sleep(0.05)


def _python_copy(tmp_path) -> tuple[str, dict]:
    """A copy of this Python under another name, so the policy can tell the
    two flooding processes apart by the executable the kernel reports."""
    path = str(tmp_path / "python-heavy")
    shutil.copy2(os.path.realpath(sys.executable), path)
    return path, {"PYTHONPATH": os.pathsep.join([ROOT, sysconfig.get_paths()["purelib"]])}


@pytest.mark.parametrize("told_apart,weights,expected", [
    ("exe", (1, 1), (0.45, 0.55)), ("app", (3, 1), (0.70, 0.80))])
async def test_two_apps_flooding_share_by_their_weights(monkeypatch, tmp_path, told_apart,
                                                        weights, expected):
    """Two processes of one user, told apart by the executable the kernel
    reports, or by the app name one declares (NNRT_APP_NAME, in a rule that
    also names the uid), share the device by their rules' weights (the
    service's default gives each process its own share)."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.delenv("NNRT_DRIVERS", raising=False)
    policy = tmp_path / "policy.toml"
    if told_apart == "exe":
        heavy, extra_env = _python_copy(tmp_path)
        match = f'exe = "{heavy}"'
    else:
        heavy, extra_env = sys.executable, {"NNRT_APP_NAME": "heavy"}
        match = f'uid = {os.getuid()}\napp = "heavy"'
    policy.write_text(f'[[app]]\nname = "heavy"\n{match}\nweight = {weights[0]}\n\n'
                      f'[default]\nweight = {weights[1]}\n')
    async with nnrt.Runtime(spawn=[("npu", "reference", "--statistics", "all",
                                    "--policy", str(policy))]) as rt:
        env = _env(rt.device("npu").socket_path, tmp_path)
        # The heavy-weight app keeps fewer executions in flight than the other.
        procs = [_flooder(dict(env, **extra_env), 3.0, 2, python=heavy),
                 _flooder(env, 3.0, 3)]
        seen, seen_apps = {}, {}
        await _collect(rt, "npu", procs, seen, seen_apps)
        reports = [_report(p) for p in procs]
    # Device time as the scheduler's records show it, over the time both
    # apps had work in it (per job, not per sampling interval: an app
    # between two round trips is idle for a moment many times a second).
    apps = [("pid", r["pid"]) for r in reports]
    times = _contended_run_time(sorted(seen.values(), key=lambda r: r.finished_at), apps)
    assert min(times) > 0.2, (times, reports)
    share = times[0] / sum(times)
    assert expected[0] <= share <= expected[1], (share, times, reports)
    if told_apart == "app":
        rules = {a.app: (a.rule, a.who) for a in seen_apps.values()}
        assert rules[apps[0]] == ("heavy", f"heavy python{sys.version_info[0]}."
                                  f"{sys.version_info[1]} pid {apps[0][1]}"), rules
        assert rules[apps[1]][0] == "[default]"


async def test_a_hundred_concurrent_executions_of_one_app_complete_on_a_service(
        monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.delenv("NNRT_DRIVERS", raising=False)
    async with nnrt.Runtime(spawn=[("npu", "reference", "--app-key", "pid")]) as rt:
        compiled = await rt.compile(chain_model(3, (64,)), devices=["npu"])
        x = np.zeros(64, np.float32)
        results = await asyncio.gather(*[compiled.execute([x]) for _ in range(100)])
        assert all(r.outputs[0].tolist() == [3.0] * 64 for r in results)
        me = ("pid", os.getpid())
        stats = await rt.statistics("npu")
        assert stats.of(me, Priority.MEDIUM).completed == 100


async def test_serve_policy_reloads_on_sighup_and_status_shows_the_apps(tmp_path):
    import signal
    policy = tmp_path / "policy.toml"
    policy.write_text('[default]\nweight = 2\n')
    sock = str(tmp_path / "npu.sock")
    cli = [sys.executable, "-m", "nnrt", "driver"]
    serve = subprocess.Popen(cli + ["serve", "npu", "--socket", sock, "--app-key", "pid",
                                    "--statistics", "all", "--policy", str(policy)],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert "listening" in serve.stdout.readline()
        device = await ServiceDevice.connect(sock)
        async with nnrt.Runtime(devices=[device]) as rt:
            compiled = await rt.compile(chain_model(2, (16,)))
            await compiled.execute([np.zeros(16, np.float32)])
            out = subprocess.run(cli + ["status", "--socket", sock, "--once"],
                                 capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            assert f"pid {os.getpid()}" in out.stdout and "100.0%" in out.stdout
            policy.write_text("[default\n")                   # broken: kept the old one
            serve.send_signal(signal.SIGHUP)
            assert "keeping the previous one" in serve.stdout.readline()
            policy.write_text('[default]\nweight = 3\n')
            serve.send_signal(signal.SIGHUP)
            assert "reloaded" in serve.stdout.readline()
            await compiled.execute([np.zeros(16, np.float32)])   # still serving
        device.close()
    finally:
        serve.terminate()
        serve.wait(timeout=30)
