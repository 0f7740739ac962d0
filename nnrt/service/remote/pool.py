"""A pool of hosts serving the same driver, seen as one HAL device:
:class:`PoolDevice` (``Runtime(remote=[...], pool="cpu-pool")``, or a
``pool:NAME=TARGET+TARGET`` entry in ``NNRT_DRIVERS`` or drivers.conf).

Theory of operation
-------------------
A pool is built from :class:`~nnrt.service.remote.client.RemoteDevice`\\ s,
one per member (a ``[grpc://|grpcs://]HOST:PORT``), and adds no transport of
its own: every call is a member's. The first member that answers sets what
the pool is (type, version, feature level, capabilities); a member that
answers with another driver is left out, with that reason.

Preparing prepares the model on every member that is up, at once. A member
that comes back later (or joins after the model was prepared) gets it
prepared when an execution is first sent there.

Where an execution goes. Each one goes to the member with the shortest
expected wait::

    wait = (others' jobs + ours) / slots x service time

``others' jobs``, ``slots`` and ``service time`` come from the member's own
scheduler: every execution reply carries its load as it left
(``nnrt.qos.SchedulerLoad``: jobs waiting and running over all apps, slots,
the median run time of its last 16 jobs), so keeping them fresh costs no
call of its own. ``ours`` is counted here, exactly: this pool's calls on the network
to that member or waiting for one of its places, plus its bursts bound
there (a burst is a stream that keeps a member busy). A report counts for
``STALE`` seconds; after that, a member we stopped sending to because it was
busy is judged by our own work there alone, so it gets tried again and
reports afresh. A member that has never answered an execution is judged by
the other members' service time. Ties go to the member with less of our
work, then round robin.

Sticky work. A burst (when opened) and a reusable execution (at its first
computation) are bound to one member, chosen as above, and stay there: the
member keeps the burst's layouts and the execution's binding.

A dead member. When a member's connection dies (a reset connection at once,
a hung host by keepalive), its pending calls answer DEAD_OBJECT; the pool
sends that work again to another member (a burst or a reusable execution is
bound again there), and answers DEAD_OBJECT only when no member is left --
then the runtime moves the model on, as for any dead service. A member that
is down is tried again by :meth:`PoolDevice.reconnect` (the runtime calls it
every ``RETRY_INTERVAL`` seconds) and takes work again when it is back.
"""
from __future__ import annotations

import dataclasses
import itertools
import re
import time
from dataclasses import dataclass

import anyio

from ...errors import ErrorStatus, NnrtError, invalid
from ...hal import (BurstSession, Capabilities, Device, DeviceType, Execution,
                    ExecutionPreference, ExecutionResult, FrameExecution, PreparedModel, Request,
                    Scheduling)
from ...hal.types import Priority
from ...model.graph import HalModel
from ...vlog import vlog
from .client import RemoteDevice, parse_target

STALE = 1.0          # seconds a member's reported load counts
RETRY_INTERVAL = 1.0  # seconds before a member that did not answer is tried again
_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
POOL_SCHEME = "pool:"


def parse_pool(entry: str) -> tuple[str, list[str]]:
    """``pool:NAME=TARGET+TARGET...`` as (NAME, targets, each
    ``[grpc://|grpcs://]HOST:PORT``); INVALID_ARGUMENT otherwise."""
    if not entry.startswith(POOL_SCHEME):
        raise invalid(f"{entry!r} is not pool:NAME=TARGET+TARGET...")
    name, sep, rest = entry[len(POOL_SCHEME):].partition("=")
    targets = [t.strip() for t in rest.split("+") if t.strip()]
    if not sep or not targets:
        raise invalid(f"{entry!r} is not pool:NAME=TARGET+TARGET...")
    check_members(name, targets)
    return name, targets


def pool_entry(name: str, targets) -> str:
    """The entry :func:`parse_pool` reads, each target with its scheme
    (a bare ``HOST:PORT`` is TLS)."""
    check_members(name, targets)
    return POOL_SCHEME + name + "=" + "+".join(
        t if t.startswith(("grpc://", "grpcs://")) else f"grpcs://{t}" for t in targets)


def check_members(name, targets) -> None:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise invalid(f"a pool name is 1 to 64 letters, digits, '.', '_' or '-', not {name!r}")
    if not targets:
        raise invalid(f"pool {name} has no member")
    seen = set()
    for target in targets:
        if not isinstance(target, str):
            raise invalid(f"a pool member is a 'HOST:PORT' string, not {target!r}")
        address, _ = parse_target(target)
        if address in seen:
            raise invalid(f"pool {name} lists {address} twice")
        seen.add(address)


@dataclass(frozen=True)
class MemberState:
    """A pool member as the pool last saw it (``PoolDevice.members()``)."""

    target: str
    state: str            # "up" or "down"
    device: str = ""      # the member's device name when up
    reason: str = ""      # why it is down
    expected_wait: float | None = None   # seconds, when up
    bursts: int = 0       # the pool's bursts bound to it

    def __str__(self) -> str:
        if self.state == "up":
            return f"{self.target}: up ({self.device}, expected wait " \
                   f"{self.expected_wait * 1e3:.1f} ms, {self.bursts} burst(s))"
        return f"{self.target}: down: {self.reason}"


class _Member:
    def __init__(self, target: str):
        self.target = target
        self.device: RemoteDevice | None = None
        self.reason = "not tried yet"
        self.retry_at = 0.0
        self.bursts = 0       # the pool's bursts bound here

    @property
    def up(self) -> bool:
        return self.device is not None and self.device.alive

    def ours(self) -> int:
        """The pool's work on this member now: calls out or waiting for a
        place, and bursts bound here."""
        own = self.device.remote_statistics()
        return own.in_flight + own.waiting + self.bursts


def _signature(device: Device) -> tuple:
    """What members serving one driver share (their round trips differ)."""
    return (device.type, device.version_string, device.feature_level,
            dataclasses.replace(device.capabilities(), round_trip=0.0))


class PoolDevice(Device):
    """Members serving the same driver as one device. Make one with :meth:`connect`."""

    def __init__(self, name: str, members: list[_Member], reference: RemoteDevice, connect):
        self.name = name
        self.type: DeviceType = reference.type
        self.version_string = reference.version_string
        self.feature_level = reference.feature_level
        self._capabilities: Capabilities = reference.capabilities()
        self._extensions = reference.supported_extensions()
        self._signature = _signature(reference)
        self._members = members
        self._connect = connect
        self._turn = itertools.count()
        self._closed = False

    @classmethod
    async def connect(cls, name: str, targets, *, connect=None) -> "PoolDevice":
        """Connect to every member (``connect(target)`` makes a member's
        device; default :meth:`RemoteDevice.connect`); DEVICE_UNAVAILABLE
        when none answers, saying why for each."""
        check_members(name, targets)
        connect = connect or RemoteDevice.connect
        members = [_Member(t) for t in targets]
        async with anyio.create_task_group() as tg:
            for member in members:
                tg.start_soon(_attempt, member, connect)
        up = [m for m in members if m.device is not None]
        if not up:
            raise NnrtError(ErrorStatus.DEVICE_UNAVAILABLE,
                            f"no member of pool {name} answers: " +
                            "; ".join(f"{m.target}: {m.reason}" for m in members))
        pool = cls(name, members, up[0].device, connect)
        for member in up[1:]:
            pool._admit(member)
        vlog("driver", "pool %s: %d of %d members up", name,
             sum(m.device is not None for m in members), len(members))
        return pool

    def _admit(self, member: _Member) -> None:
        """Keep the member's new device if it serves the pool's driver."""
        device = member.device
        if _signature(device) != self._signature:
            member.device = None
            member.reason = (f"serves {device.name} ({device.version_string}), not the "
                             f"driver of pool {self.name} ({self.version_string})")
            member.retry_at = time.monotonic() + RETRY_INTERVAL
            device.close()

    async def reconnect(self) -> int:
        """Try again the members that are down and due (each at most every
        ``RETRY_INTERVAL`` seconds); how many came back."""
        now = time.monotonic()
        due = [m for m in self._members if not m.up and now >= m.retry_at]
        if not due or self._closed:
            return 0
        for member in due:
            if member.device is not None:   # dead: let go of it
                member.device.close()
                member.device = None
        async with anyio.create_task_group() as tg:
            for member in due:
                tg.start_soon(_attempt, member, self._connect)
        back = 0
        for member in due:
            if member.device is not None:
                self._admit(member)
                if member.device is not None:
                    back += 1
                    vlog("driver", "pool %s: member %s is back", self.name, member.target)
        if self._closed:
            self.close()
        return back

    def members(self) -> list[MemberState]:
        states = []
        for m in self._members:
            if m.up:
                states.append(MemberState(m.target, "up", m.device.name,
                                          expected_wait=self._expected_wait(m),
                                          bursts=m.bursts))
            else:
                reason = m.device.dead.message if m.device is not None else m.reason
                states.append(MemberState(m.target, "down", reason=reason))
        return states

    # -- choosing a member --------------------------------------------------------

    def _expected_wait(self, member: _Member) -> float:
        """Seconds a new job would wait on ``member`` (see the module's
        theory of operation)."""
        ours = member.ours()
        load, age = member.device.load_seen()
        others, slots, service = 0, 1, None
        if load is not None:
            slots, service = load.slots, load.service_time
            if age < STALE:
                others = max(0, load.queued + load.running - ours)
        if service is None:
            service = self._typical_service()
        return (others + ours) / slots * service

    def _typical_service(self) -> float:
        times = [load.service_time for load, _ in
                 (m.device.load_seen() for m in self._members if m.up)
                 if load is not None and load.service_time is not None]
        return sum(times) / len(times) if times else 0.0

    def _pick(self, candidates: list[_Member]) -> _Member | None:
        if not candidates:
            return None
        turn = next(self._turn)
        n = len(self._members)
        return min(candidates, key=lambda m: (self._expected_wait(m), m.ours(),
                                              (self._members.index(m) - turn) % n))

    def _left(self) -> ExecutionResult:
        return ExecutionResult(ErrorStatus.DEAD_OBJECT,
                               message=f"no member of pool {self.name} is left: " + "; ".join(
                                   str(s) for s in self.members()))

    # -- the HAL ------------------------------------------------------------------

    def capabilities(self) -> Capabilities:
        return self._capabilities

    def supported_extensions(self) -> list:
        return list(self._extensions)

    def scheduling(self) -> Scheduling:
        return Scheduling(fronted=True)    # every member's own scheduler decides

    @property
    def alive(self) -> bool:
        return not self._closed and any(m.up for m in self._members)

    def close(self) -> None:
        self._closed = True
        for member in self._members:
            if member.device is not None:
                member.device.close()

    async def supported_operations(self, model: HalModel) -> list[bool]:
        for member in self._members:
            if member.up:
                try:
                    return await member.device.supported_operations(model)
                except NnrtError as e:
                    if e.status != ErrorStatus.DEAD_OBJECT:
                        raise
        raise NnrtError(ErrorStatus.DEAD_OBJECT, self._left().message)

    async def prepare_model(self, model: HalModel,
                            preference: ExecutionPreference = ExecutionPreference.FAST_SINGLE_ANSWER,
                            priority: Priority = Priority.MEDIUM, deadline: float | None = None,
                            cache=None, *, app=None) -> "PoolPreparedModel":
        """Prepare ``model`` on every member that is up, at once; the first
        error when none of them takes it."""
        prepared = PoolPreparedModel(self, model, preference, priority)
        errors: list[NnrtError] = []

        async def one(member: _Member) -> None:
            try:
                await prepared._on(member, deadline)
            except NnrtError as e:
                errors.append(e)

        async with anyio.create_task_group() as tg:
            for member in self._members:
                if member.up:
                    tg.start_soon(one, member)
        if not prepared._prepared:
            if errors:
                refusals = [e for e in errors if e.status != ErrorStatus.DEAD_OBJECT]
                raise (refusals or errors)[0]
            raise NnrtError(ErrorStatus.DEAD_OBJECT, self._left().message)
        return prepared

    async def allocate(self, desc, prepared_models, input_roles, output_roles, *, app=None):
        """Declined (GENERAL_FAILURE): a pool sends each execution to any
        member, and a buffer would tie the memory's executions to the one
        member that keeps it. The runtime keeps such a memory in shared
        memory on the app's side instead."""
        raise NnrtError(ErrorStatus.GENERAL_FAILURE,
                        f"pool {self.name} keeps no driver buffers: its executions go to any "
                        f"member; allocate on one member's device instead")

    def __repr__(self) -> str:
        up = sum(m.up for m in self._members)
        return f"<PoolDevice {self.name}: {up} of {len(self._members)} members up>"


async def _attempt(member: _Member, connect) -> None:
    """Connect ``member``; on failure note why and when to try again."""
    start = time.monotonic()
    try:
        member.device = await connect(member.target)
        member.reason = ""
    except NnrtError as e:
        member.device = None
        member.reason = e.message
        # A silent host made us wait: try it less often.
        member.retry_at = time.monotonic() + max(RETRY_INTERVAL, 4 * (time.monotonic() - start))


class PoolPreparedModel(PreparedModel):
    """A model prepared on the members of a pool: each execution goes to
    the member with the shortest expected wait, again elsewhere if that
    member dies under it."""

    def __init__(self, pool: PoolDevice, model: HalModel, preference, priority):
        self.pool = pool
        self._model = model           # to prepare on a member that comes back
        self._preference = preference
        self._priority = priority
        self._prepared: dict[_Member, object] = {}   # member -> its RemotePreparedModel
        self._refused: dict[_Member, str] = {}      # members whose driver refused the model
        self._released = False

    async def _on(self, member: _Member, deadline: float | None = None):
        """The model prepared on ``member`` (prepared now if it is not, or
        was prepared on the member's previous connection)."""
        prepared = self._prepared.get(member)
        if prepared is not None and prepared.device is member.device:
            return prepared
        device = member.device
        try:
            prepared = await device.prepare_model(self._model, self._preference,
                                                  self._priority, deadline)
        except NnrtError as e:
            if e.status != ErrorStatus.DEAD_OBJECT and device.alive:
                self._refused[member] = e.message
            raise
        if self._released or member.device is not device:
            prepared.release()
            raise NnrtError(ErrorStatus.DEAD_OBJECT, "the model or the member went meanwhile")
        other = self._prepared.get(member)
        if other is not None and other.device is device:   # a concurrent call prepared it too
            prepared.release()
            return other
        self._prepared[member] = prepared
        return prepared

    def _candidates(self, tried, prepared_only: bool = False) -> list[_Member]:
        return [m for m in self.pool._members
                if m.up and m not in tried and m not in self._refused
                and (not prepared_only or (m in self._prepared and
                                           self._prepared[m].device is m.device))]

    def _unusable(self) -> ExecutionResult | None:
        if self._released:
            return ExecutionResult(ErrorStatus.INVALID_ARGUMENT,
                                   message="the prepared model was released")
        return None

    async def _member_for(self, tried: set, deadline):
        """The member with the shortest expected wait and the model there,
        or (None, None) when no member is left."""
        while (member := self.pool._pick(self._candidates(tried))) is not None:
            try:
                return member, await self._on(member, deadline)
            except NnrtError:
                tried.add(member)
        return None, None

    async def execute(self, request: Request, measure: bool = False,
                      deadline: float | None = None,
                      loop_timeout: float | None = None) -> ExecutionResult:
        problem = self._unusable()
        if problem is not None:
            return problem
        tried: set = set()
        while True:
            member, prepared = await self._member_for(tried, deadline)
            if member is None:
                return self.pool._left()
            result = await prepared.execute(request, measure, deadline, loop_timeout)
            if not _member_died(member, result, tried):
                return result

    def execute_synchronously(self, request: Request, measure: bool = False,
                              deadline: float | None = None,
                              loop_timeout: float | None = None, *,
                              checkpoint=None) -> ExecutionResult:
        """A blocking run on a member the model is prepared on already."""
        problem = self._unusable()
        if problem is not None:
            return problem
        tried: set = set()
        while (member := self.pool._pick(self._candidates(tried, True))) is not None:
            result = self._prepared[member].execute_synchronously(
                request, measure, deadline, loop_timeout, checkpoint=checkpoint)
            if not _member_died(member, result, tried):
                return result
        return self.pool._left()

    def create_execution(self, request: Request, measure: bool = False,
                         loop_timeout: float | None = None) -> "PoolExecution":
        return PoolExecution(self, request, measure, loop_timeout)

    async def configure_burst(self) -> "PoolBurst":
        """A burst bound to the member with the shortest expected wait now."""
        problem = self._unusable()
        if problem is not None:
            raise NnrtError(problem.status, problem.message)
        burst = PoolBurst(self)
        if not await burst._bind(set()):
            left = self.pool._left()
            raise NnrtError(left.status, left.message)
        return burst

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        for prepared in self._prepared.values():
            prepared.release()
        self._prepared.clear()

    def __repr__(self) -> str:
        return f"<PoolPreparedModel on {sorted(m.target for m in self._prepared)}>"


def _member_died(member: _Member, result: ExecutionResult, tried: set) -> bool:
    """Whether ``result`` is the member's death (then the work goes again
    elsewhere: ``member`` joins ``tried``)."""
    if result.status == ErrorStatus.DEAD_OBJECT and not member.up:
        vlog("driver", "pool member %s died: running the work again elsewhere", member.target)
        tried.add(member)
        return True
    return False


class PoolExecution(Execution):
    """A reusable execution bound to one member of the pool (chosen at its
    first computation), bound again on another if that member dies."""

    def __init__(self, prepared: PoolPreparedModel, request: Request, measure: bool,
                 loop_timeout: float | None):
        self.prepared = prepared
        self.request = request
        self.measure = bool(measure)
        self.loop_timeout = loop_timeout
        self._member: _Member | None = None
        self._inner = None
        self._released = False

    def _bind(self, member: _Member, prepared) -> None:
        self._inner = prepared.create_execution(self.request, self.measure, self.loop_timeout)
        self._member = member

    def _unbind(self) -> None:
        inner, self._inner, self._member = self._inner, None, None
        if inner is not None:
            inner.release()

    def _unusable(self) -> ExecutionResult | None:
        if self._released:
            return ExecutionResult(ErrorStatus.INVALID_ARGUMENT,
                                   message="the execution was released")
        return self.prepared._unusable()

    async def execute(self, deadline: float | None = None) -> ExecutionResult:
        problem = self._unusable()
        if problem is not None:
            return problem
        tried: set = set()
        while True:
            if self._inner is None or not self._member.up:
                self._unbind()
                member, prepared = await self.prepared._member_for(tried, deadline)
                if member is None:
                    return self.prepared.pool._left()
                self._bind(member, prepared)
            member = self._member
            result = await self._inner.execute(deadline)
            if not _member_died(member, result, tried):
                return result
            self._unbind()

    def execute_synchronously(self, deadline: float | None = None, *,
                              checkpoint=None) -> ExecutionResult:
        problem = self._unusable()
        if problem is not None:
            return problem
        tried: set = set()
        while True:
            if self._inner is None or not self._member.up:
                self._unbind()
                member = self.prepared.pool._pick(self.prepared._candidates(tried, True))
                if member is None:
                    return self.prepared.pool._left()
                self._bind(member, self.prepared._prepared[member])
            member = self._member
            result = self._inner.execute_synchronously(deadline, checkpoint=checkpoint)
            if not _member_died(member, result, tried):
                return result
            self._unbind()

    def release(self) -> None:
        self._released = True
        self._unbind()

    def __repr__(self) -> str:
        where = self._member.target if self._member is not None else "no member yet"
        return f"<PoolExecution on {where}>"


class PoolBurst(BurstSession):
    """A burst bound to one member of the pool: its frames go on that
    member's burst stream. If the member dies, the burst is opened again
    on another member and the frame runs there."""

    def __init__(self, prepared: PoolPreparedModel):
        self.prepared = prepared
        self.member: _Member | None = None
        self._burst = None
        self._closed = False

    async def _bind(self, tried: set) -> bool:
        while True:
            member, prepared = await self.prepared._member_for(tried, None)
            if member is None:
                return False
            member.bursts += 1
            try:
                self._burst = await prepared.configure_burst()
            except NnrtError:
                member.bursts -= 1
                tried.add(member)
                continue
            self.member = member
            return True

    def _unbind(self) -> None:
        burst, self._burst = self._burst, None
        if burst is not None:
            burst.close()
            self.member.bursts -= 1

    async def execute(self, request: Request, measure: bool = False,
                      deadline: float | None = None,
                      loop_timeout: float | None = None) -> ExecutionResult:
        if self._closed:
            return ExecutionResult(ErrorStatus.INVALID_ARGUMENT,
                                   message="the burst session is closed")
        tried: set = set()
        while True:
            if self._burst is None or not self.member.up:
                self._unbind()
                if not await self._bind(tried):
                    return self.prepared.pool._left()
            member = self.member
            result = await self._burst.execute(request, measure, deadline, loop_timeout)
            if not _member_died(member, result, tried):
                return result
            self._unbind()

    def create_execution(self, request: Request, measure: bool = False,
                         loop_timeout: float | None = None) -> FrameExecution:
        """Each execution is a frame of this burst."""
        if self._closed:
            raise NnrtError(ErrorStatus.INVALID_ARGUMENT, "the burst session is closed")
        return FrameExecution(self, request, measure, loop_timeout)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._unbind()

    def __repr__(self) -> str:
        where = self.member.target if self._burst is not None else "no member"
        return f"<PoolBurst on {where}>"

