"""The operator's QoS policy: TOML parsing, matching apps by uid, user name
or executable, defaults, and what the scheduled device does with it."""
import asyncio
import os
import pwd
import sys

import anyio
import numpy as np
import pytest

import nnrt
from nnrt import ErrorStatus, NnrtError, Priority
from nnrt.drivers.reference import ReferenceDevice
from nnrt.hal import AppDeclaration
from nnrt.qos import AppIdentity, AppSettings, Policy, ScheduledDevice, identify
from nnrt.qos.policy import MAX_POLICY_BYTES
from nnrt.qos.status import reload_policy, render

ME = pwd.getpwuid(os.getuid()).pw_name
EXAMPLE = f"""
[default]
weight = 1
queue_limit = 16
when_full = "wait"
deadlines = "hard"

[[app]]
name = "camera"
exe = "{os.path.realpath(sys.executable)}"
user = "{ME}"
weight = 3
max_priority = "high"

[[app]]
name = "batch"
user = "nobody-here"
weight = 0.5
max_priority = "low"
memory_limit = "256MiB"
when_full = "fail"
deadlines = "soft"

[[app]]
name = "ci"
uid = 54321
queue_limit = 4
"""


def test_no_policy_gives_every_app_the_defaults():
    assert Policy().settings_for(AppIdentity(1000, "x", "/bin/x")) == AppSettings()


def test_rules_match_in_order_and_fill_in_from_the_default():
    policy = Policy.from_toml(EXAMPLE)
    me = identify(os.getpid())
    assert me.uid == os.getuid() and me.user == ME
    assert me.exe == os.path.realpath(sys.executable)
    camera = policy.settings_for(me)
    assert camera == AppSettings(weight=3, max_priority=Priority.HIGH, queue_limit=16,
                                 name="camera")
    batch = policy.settings_for(AppIdentity(1234, "nobody-here", "/usr/bin/make"))
    assert batch == AppSettings(weight=0.5, max_priority=Priority.LOW, queue_limit=16,
                                memory_limit=256 << 20, soft_deadlines=True,
                                fail_when_full=True, name="batch")
    assert policy.settings_for(AppIdentity(54321, "ci", None)).queue_limit == 4
    # Every key a rule gives must match: the camera rule needs the exe too.
    assert policy.settings_for(AppIdentity(os.getuid(), ME, "/bin/sh")) == \
        AppSettings(queue_limit=16)


def test_app_keys_of_a_service_are_identified():
    assert identify(("pid", os.getpid())).exe == os.path.realpath(sys.executable)
    by_uid = identify(("uid", os.getuid()))
    assert by_uid.user == ME and by_uid.exe is None       # many processes: no exe
    assert identify("some-key") == AppIdentity()
    gone = identify(("pid", 2 ** 22 + 12345))
    assert gone.exe is None and gone.uid is None


@pytest.mark.parametrize("text,words", [
    ("[default]\nweight = 0", "weight"),
    ("[default]\nmax_priority = 'urgent'", "max_priority"),
    ("[default]\nqueue_limit = 0", "queue_limit"),
    ("[default]\nmemory_limit = '12 parsecs'", "memory_limit"),
    ("[default]\ndeadlines = 'firm'", "deadlines"),
    ("[default]\nwhen_full = 'panic'", "when_full"),
    ("[default]\nwieght = 2", "wieght"),
    ("[[app]]\nweight = 2", "matches nothing"),
    ("[[app]]\nuid = 'root'", "uid"),
    ("[apps]\nx = 1", "unknown table"),
    ("[default\n", "not valid TOML"),
])
def test_bad_policies_are_refused_with_the_reason(text, words):
    with pytest.raises(NnrtError) as e:
        Policy.from_toml(text, "p.toml")
    assert e.value.status == ErrorStatus.INVALID_ARGUMENT
    assert words in e.value.message and "p.toml" in e.value.message


async def test_reload_keeps_the_old_policy_when_the_file_is_broken(tmp_path):
    path = tmp_path / "policy.toml"
    path.write_text(f'[[app]]\nuser = "{ME}"\nweight = 2\n')
    device = ScheduledDevice(ReferenceDevice(), policy=Policy.load(str(path)))
    assert device.settings_of().weight == 2
    path.write_text(f'[[app]]\nuser = "{ME}"\nweight = 5\n')
    assert "reloaded" in await reload_policy(device, str(path))
    assert device.settings_of().weight == 5
    path.write_text("[[app]\n")
    assert "keeping the previous one" in await reload_policy(device, str(path))
    assert device.settings_of().weight == 5


@pytest.mark.parametrize("plant, words", [
    (lambda p: os.mkfifo(p), "not a regular file"),
    (lambda p: p.symlink_to("/dev/zero"), "not a regular file"),
    (lambda p: p.write_text(""), "is empty"),
    (lambda p: p.write_text("\n  \n"), "is empty"),
    (lambda p: p.write_bytes(b"#" * (MAX_POLICY_BYTES + 1)), "more than"),
])
async def test_a_file_that_would_wedge_or_lift_every_cap_is_refused_and_the_old_policy_stays(
        tmp_path, plant, words):
    """A FIFO at the policy path (no writer: a blocking open would wait
    forever), a link to /dev/zero (endless), an empty file (an editor
    truncating before it writes: 'no rules' would lift every cap), a huge
    file: each refused at once, the policy in force kept."""
    path = tmp_path / "policy.toml"
    path.write_text(f'[[app]]\nuser = "{ME}"\nweight = 2\n')
    device = ScheduledDevice(ReferenceDevice(), policy=Policy.load(str(path)))
    path.unlink()
    plant(path)
    with anyio.fail_after(10):                  # a guard against the wedge, not a timing
        line = await reload_policy(device, str(path))
    assert "keeping the previous one" in line and words in line, line
    assert device.settings_of().weight == 2


def add_model():
    m = nnrt.Model()
    a = m.add_operand(nnrt.OperandType.TENSOR_FLOAT32, [1, 4])
    b = m.add_operand(nnrt.OperandType.TENSOR_FLOAT32, [1, 4])
    act = m.add_operand(nnrt.OperandType.INT32)
    m.set_operand_value(act, 0)
    out = m.add_operand(nnrt.OperandType.TENSOR_FLOAT32, [1, 4])
    m.add_operation(nnrt.OperationType.ADD, [a, b, act], [out])
    m.identify_inputs_and_outputs([a, b], [out])
    m.finish()
    return m


async def test_runtime_policy_caps_priority_and_limits_memory():
    policy = Policy.from_toml(f'[[app]]\nuser = "{ME}"\nmax_priority = "low"\n'
                              f'memory_limit = 16\n')
    async with nnrt.Runtime(discover=False, policy=policy) as rt:
        with pytest.raises(NnrtError) as e:
            await rt.compile(add_model(), priority=Priority.HIGH)
        assert e.value.status == ErrorStatus.RESOURCE_EXHAUSTED_PERSISTENT
    policy = Policy.from_toml(f'[[app]]\nuser = "{ME}"\nmax_priority = "low"\n')
    async with nnrt.Runtime(discover=False, policy=policy, litert=False) as rt:
        compiled = await rt.compile(add_model(), priority=Priority.HIGH)
        x = np.ones((1, 4), np.float32)
        await compiled.execute([x, x])
        stats = await rt.statistics(rt.devices[-1])
        assert stats.of(os.getpid(), Priority.LOW).completed == 1
        assert stats.of(os.getpid(), Priority.HIGH).completed == 0


async def test_a_hundred_concurrent_executions_of_one_app_all_complete_in_process():
    async with nnrt.Runtime(discover=False) as rt:
        compiled = await rt.compile(add_model())
        x = np.ones((1, 4), np.float32)
        results = await asyncio.gather(*[compiled.execute([x, x]) for _ in range(100)])
        assert len(results) == 100
        assert all(np.array_equal(r.outputs[0], 2 * x) for r in results)


async def test_fail_fast_apps_get_resource_exhausted_in_process():
    policy = Policy.from_toml(f'[[app]]\nuser = "{ME}"\nwhen_full = "fail"\n'
                              f'queue_limit = 2\n')
    async with nnrt.Runtime(discover=False, policy=policy) as rt:
        compiled = await rt.compile(add_model())
        x = np.ones((1, 4), np.float32)
        outcomes = await asyncio.gather(*[compiled.execute([x, x]) for _ in range(40)],
                                        return_exceptions=True)
        refused = [o for o in outcomes if isinstance(o, NnrtError)]
        assert refused and all(o.status == ErrorStatus.RESOURCE_EXHAUSTED_TRANSIENT
                               for o in refused)


def test_status_table_shows_each_app():
    from nnrt.qos import ManualClock, Scheduler
    clock = ManualClock()
    s = Scheduler(clock=clock)
    jobs = [s.submit(("pid", 7), Priority.LOW), s.submit(("pid", 8), Priority.HIGH)]
    clock.advance(0.003)
    s.finish(jobs[0])
    clock.advance(0.001)
    s.finish(jobs[1])
    table = render("npu", s.statistics(), s.finished_jobs())
    assert "pid 7" in table and "pid 8" in table and "75.0%" in table and "25.0%" in table
    # Each row names the app's policy rule, weight and priority cap.
    row = next(line for line in table.splitlines() if line.startswith("pid 7"))
    assert row.split()[2:5] == ["[default]", "1", "HIGH"], row


def test_status_rows_name_the_rule_weight_and_cap_the_policy_gave():
    from nnrt.qos import ManualClock, Scheduler
    policy = Policy.from_toml(EXAMPLE)
    clock = ManualClock()
    s = Scheduler(clock=clock, settings=policy.resolver())
    me = ("pid", os.getpid())
    s.finish(s.submit(me, Priority.LOW))
    table = render("npu", s.statistics(), s.finished_jobs())
    exe = os.path.basename(os.path.realpath(sys.executable))
    row = next(line for line in table.splitlines() if line.startswith(f"{exe} pid "))
    assert row.split()[:6] == [exe, "pid", str(os.getpid()), "camera", "3", "HIGH"], row
    assert s.statistics().apps[0].rule == "camera"


def test_a_declared_name_and_script_name_the_app_in_status():
    from nnrt.qos import ManualClock, Scheduler
    me = ("pid", os.getpid())
    declared = {me: AppDeclaration("camera", "/srv/apps/cam.py")}
    s = Scheduler(clock=ManualClock(), settings=Policy().resolver(declared.get))
    s.finish(s.submit(me, Priority.LOW))
    assert s.statistics().apps[0].who == f"camera cam.py pid {os.getpid()}"
    assert render("npu", s.statistics()).splitlines()[2].startswith(
        f"camera cam.py pid {os.getpid()}")


MINE = f"""
[[app]]
name = "camera"
uid = {os.getuid()}
app = "camera"
weight = 3

[[app]]
name = "trainer"
user = "{ME}"
script = "/srv/apps/train.py"
weight = 0.5

[[app]]
name = "unit"
cgroup = "/system.slice/camera.service"
max_priority = "low"
"""


def test_rules_match_the_cgroup_and_what_a_process_of_the_users_uid_declares():
    policy = Policy.from_toml(MINE)
    mine = dict(uid=os.getuid(), user=ME, pid=7)
    assert policy.rule_for(AppIdentity(**mine, name="camera")).name == "camera"
    assert policy.rule_for(AppIdentity(**mine, script="/srv/apps/train.py")).name == "trainer"
    assert policy.rule_for(AppIdentity(**mine, name="other")) is None
    # What another user's process declares does not claim this user's rules.
    other = dict(uid=os.getuid() + 1, user="someone-else", pid=8)
    assert policy.rule_for(AppIdentity(**other, name="camera")) is None
    assert policy.rule_for(AppIdentity(**other, script="/srv/apps/train.py")) is None
    # A cgroup rule matches the group and every group below it, not a sibling
    # whose name merely starts the same.
    unit = "/system.slice/camera.service"
    assert policy.rule_for(AppIdentity(**other, cgroup=unit)).name == "unit"
    assert policy.rule_for(AppIdentity(**other, cgroup=unit + "/worker")).name == "unit"
    assert policy.rule_for(AppIdentity(**other, cgroup=unit + "2")) is None
    assert policy.rule_for(AppIdentity(**other, cgroup=None)) is None


@pytest.mark.parametrize("key", ["app = \"camera\"", "script = \"/srv/cam.py\""])
def test_a_rule_on_what_an_app_declares_must_name_its_user(key):
    with pytest.raises(NnrtError) as e:
        Policy.from_toml(f"[[app]]\n{key}\nweight = 3\n")
    assert "give uid or user too" in e.value.message


def test_a_service_key_of_a_whole_uid_takes_no_declaration():
    who = identify(("uid", os.getuid()), AppDeclaration("camera"))
    assert who.name is None and who.uid == os.getuid()
    who = identify(("pid", os.getpid()), AppDeclaration("camera"))
    assert who.name == "camera" and who.cgroup is not None


def test_a_long_app_name_keeps_its_pid_in_status():
    from nnrt.qos import ManualClock, Scheduler
    me = ("pid", os.getpid())
    declared = {me: AppDeclaration("x" * 64, "/srv/apps/a-rather-long-script-name.py")}
    s = Scheduler(clock=ManualClock(), settings=Policy().resolver(declared.get))
    s.finish(s.submit(me, Priority.LOW))
    row = render("npu", s.statistics()).splitlines()[2]
    assert row.startswith("…") and f"script-name.py pid {os.getpid()} " in row, row
