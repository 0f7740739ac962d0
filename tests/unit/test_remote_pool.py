"""The pool device's decisions (nnrt/service/remote/pool.py) over members
whose load and our own work on them are given: which member an execution
goes to, how a stale report counts, which members a pool admits. The
members' transport is tests/integration/test_remote_pool.py's."""
import math

import anyio
import pytest

from nnrt.errors import ErrorStatus, NnrtError
from nnrt.hal import BufferDesc, BufferRole, Capabilities, DeviceType, ExecutionResult
from nnrt.qos import SchedulerLoad
from nnrt.service.remote.client import RemoteStatistics
from nnrt.service.remote.pool import STALE, PoolDevice, parse_pool, pool_entry


class Member:
    """What the pool reads of a member's RemoteDevice."""

    def __init__(self, name="m", load=None, age=0.0, ours=0, version="1"):
        self.name, self.type, self.version_string, self.feature_level = \
            name, DeviceType.CPU, version, 8
        self.load, self.age, self.ours = load, age, ours
        self.alive, self.dead, self.closed = True, None, False

    def capabilities(self):
        # Every member's round trip is its own: members of one driver
        # differ in it and nothing else.
        return Capabilities(round_trip=1e-4 * (1 + id(self) % 97))

    def supported_extensions(self):
        return []

    def load_seen(self):
        return (self.load, self.age) if self.load is not None else (None, math.inf)

    def remote_statistics(self):
        return RemoteStatistics(self.ours, 0, 32)

    def close(self):
        self.closed = True

    def kill(self):
        self.alive, self.dead = False, NnrtError(ErrorStatus.DEAD_OBJECT, f"{self.name} died")


def pool_of(*devices) -> PoolDevice:
    by_target = {f"grpc://127.0.0.{k + 2}:1": d for k, d in enumerate(devices)}

    async def connect(target):
        device = by_target[target]
        if isinstance(device, NnrtError):
            raise device
        return device
    return anyio.run(lambda: PoolDevice.connect("p", list(by_target), connect=connect))


def picks(pool, n=1) -> list[str]:
    return [pool._pick([m for m in pool._members if m.up]).device.name for _ in range(n)]


def test_an_execution_goes_to_the_member_with_the_shortest_expected_wait():
    busy = Member("busy", SchedulerLoad(queued=5, running=1, slots=1, service_time=0.010))
    idle = Member("idle", SchedulerLoad(queued=0, running=0, slots=1, service_time=0.010))
    assert picks(pool_of(busy, idle), 3) == ["idle"] * 3
    # Twice the slots halve the wait: 6 jobs on 2 slots beat 4 on 1.
    wide = Member("wide", SchedulerLoad(queued=4, running=2, slots=2, service_time=0.010))
    narrow = Member("narrow", SchedulerLoad(queued=3, running=1, slots=1, service_time=0.010))
    assert picks(pool_of(narrow, wide)) == ["wide"]
    # A faster member takes more queue: 3 jobs x 2 ms beat 1 job x 10 ms.
    fast = Member("fast", SchedulerLoad(queued=2, running=1, slots=1, service_time=0.002))
    slow = Member("slow", SchedulerLoad(queued=0, running=1, slots=1, service_time=0.010))
    assert picks(pool_of(slow, fast)) == ["fast"]


def test_our_own_work_counts_and_a_stale_report_counts_only_ours():
    # The report's jobs include our 3 calls there: others have 1, not 4.
    a = Member("a", SchedulerLoad(queued=3, running=1, slots=1, service_time=0.01), ours=3)
    b = Member("b", SchedulerLoad(queued=2, running=1, slots=1, service_time=0.01), ours=0)
    pool = pool_of(a, b)
    waits = {s.device: s.expected_wait for s in pool.members()}
    assert waits == pytest.approx({"a": 0.04, "b": 0.03})
    assert picks(pool) == ["b"]
    # b's report is older than STALE: only our work there counts (none).
    b.load = SchedulerLoad(queued=50, running=1, slots=1, service_time=0.01)
    b.age = STALE
    assert picks(pool) == ["b"]
    # A member that never answered an execution is judged by the others'
    # service time: our 2 calls there against a's 4 jobs.
    c = Member("c", ours=2)
    assert picks(pool_of(a, c)) == ["c"]


def test_ties_go_to_less_of_our_work_then_round_robin():
    a, b = Member("a", ours=1), Member("b", ours=0)
    assert picks(pool_of(a, b)) == ["b"]
    a.ours = 0
    assert sorted(picks(pool_of(a, b), 2)) == ["a", "b"]


def test_a_pool_admits_members_of_its_driver_and_says_why_others_are_out():
    other = Member("x", version="2")
    pool = pool_of(Member("a"), other,
                   NnrtError(ErrorStatus.DEVICE_UNAVAILABLE, "connection refused"))
    states = pool.members()
    assert [s.state for s in states] == ["up", "down", "down"]
    assert "serves x (2), not the driver of pool p (1)" in states[1].reason and other.closed
    assert states[2].reason == "connection refused"
    assert pool.alive and pool.name == "p"
    with pytest.raises(NnrtError, match=r"no member of pool p answers: grpc://127.0.0.2:1: gone"):
        pool_of(NnrtError(ErrorStatus.DEVICE_UNAVAILABLE, "gone"))


def test_pool_entries():
    entry = pool_entry("cpu-pool", ["127.0.0.2:7000", "grpc://127.0.0.3:7000"])
    assert entry == "pool:cpu-pool=grpcs://127.0.0.2:7000+grpc://127.0.0.3:7000"
    assert parse_pool(entry) == ("cpu-pool", ["grpcs://127.0.0.2:7000", "grpc://127.0.0.3:7000"])
    for bad, why in (("pool:p", "is not pool:NAME"), ("pool:p=", "is not pool:NAME"),
                     ("pool:a b=grpc://h:1", "a pool name"),
                     ("pool:p=grpc://h:1+grpcs://h:1", "lists h:1 twice"),
                     ("pool:p=grpc://h", "is not")):
        with pytest.raises(NnrtError, match=why):
            parse_pool(bad)


def test_a_pool_is_one_entry_of_nnrt_drivers_and_drivers_conf(tmp_path, caplog):
    from nnrt.runtime import discovery
    conf = tmp_path / "nnrt" / "drivers.conf"
    conf.parent.mkdir()
    conf.write_text("pool:gpu=grpcs://10.0.0.7:7001+grpcs://10.0.0.8:7001  # two hosts\n"
                    "pool:bad=grpc://h\n")
    environ = {"XDG_CONFIG_HOME": str(tmp_path),
               "NNRT_DRIVERS": "pool:cpu=grpc://127.0.0.2:7000+grpc://127.0.0.3:7000,/run/a.sock"}
    with caplog.at_level("WARNING", logger="nnrt.manager"):
        assert discovery.configured_sockets(environ) == [
            "pool:cpu=grpc://127.0.0.2:7000+grpc://127.0.0.3:7000", "/run/a.sock",
            "pool:gpu=grpcs://10.0.0.7:7001+grpcs://10.0.0.8:7001"]
    assert "'pool:bad=grpc://h'" in caplog.text and "left out" in caplog.text


class Prepared:
    """A member's prepared model whose executions answer NONE, or
    DEAD_OBJECT once its member is killed."""

    def __init__(self, device):
        self.device = device

    def create_execution(self, request, measure=False, loop_timeout=None):
        return self

    async def execute(self, deadline=None):
        if not self.device.alive:
            return ExecutionResult(ErrorStatus.DEAD_OBJECT, message="gone")
        self.device.computed += 1
        return ExecutionResult(ErrorStatus.NONE)

    def release(self):
        pass


class Preparing(Member):
    computed = 0

    async def prepare_model(self, model, preference, priority, deadline=None):
        if not self.alive:
            raise NnrtError(ErrorStatus.DEAD_OBJECT, "gone")
        return Prepared(self)


def test_a_reusable_execution_stays_on_its_member_and_moves_when_it_dies():
    a, b = Preparing("a"), Preparing("b")
    pool = pool_of(a, b)

    async def run():
        prepared = await pool.prepare_model("model")
        execution = prepared.create_execution("request")
        for _ in range(3):
            assert (await execution.execute()).status == ErrorStatus.NONE
        first, other = (a, b) if a.computed else (b, a)
        assert (first.computed, other.computed) == (3, 0)     # bound to one member
        first.kill()                                          # it dies under the binding
        assert (await execution.execute()).status == ErrorStatus.NONE
        assert (first.computed, other.computed) == (3, 1)     # ran again on the other
        other.kill()
        result = await execution.execute()
        assert result.status == ErrorStatus.DEAD_OBJECT
        assert result.message.startswith("no member of pool p is left: ")
        assert "a died" in result.message and "b died" in result.message
    anyio.run(run)


def test_a_pool_declines_driver_buffers_so_the_runtime_uses_shared_memory():
    """A pool sends executions to any member, so it keeps no driver buffer:
    GENERAL_FAILURE, the answer on which rt.allocate falls back to shared
    memory (nnrt/runtime/memory_domain.py)."""
    pool = pool_of(Member("a"), Member("b"))
    with pytest.raises(NnrtError) as e:
        anyio.run(lambda: pool.allocate(BufferDesc(), [], [BufferRole(0, 0)], []))
    assert e.value.status == ErrorStatus.GENERAL_FAILURE
    assert "pool p keeps no driver buffers" in e.value.message
