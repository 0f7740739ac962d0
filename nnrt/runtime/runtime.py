"""The app-facing runtime: ``Runtime`` finds devices and compiles models,
``CompiledModel`` runs executions and burst sessions.

The async core uses anyio, so it runs on asyncio (uvloop when installed) and
on trio. The runtime talks to drivers only through the HAL
(``nnrt.hal``).
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
import weakref
from dataclasses import dataclass
from typing import Any, NoReturn, Sequence

import anyio
import numpy as np
import sniffio

from ..hal import UINT64_MAX, AppDeclaration, Device, DeviceType, ExecutionPreference, PreparedModel
from ..drivers.reference import ReferenceDevice
from ..qos import ScheduledDevice
from ..errors import STATUS_NONE as _NONE, ErrorStatus, NnrtError, bad_state, invalid
from ..memory import Memory, Region
from ..model.builder import Model
from ..model.graph import Operand
from ..hal.allowlist import check_current_app
from ..hal.validate import ValidatedModel, validate_model
from ..model.extensions import uses_extensions
from . import cache, memory_domain, partition, request, signature
from .memory_domain import DeviceMemory, MemoryDesc
from .placement import Fallback, PlacedStep, Placement, groups, notes_of
from .fenced import execute_fenced
from .results import ExecutionTiming, Result, copy_into
from .step import DriverFailure, Step, release_all
from .execution import Execution
from .pipeline import Pipeline, Stage
from ..hal.types import Priority, check_deadline, check_loop_timeout
from ..vlog import vlog
from .. import handoff, trace

# Fallbacks and dropped services are logged here at WARNING whatever NNRT_VLOG says:
# they change where (and how fast) an app's work runs.
_log = logging.getLogger("nnrt.execution")


class Runtime:
    """Finds devices and compiles models for them. Use as ``async with``."""

    def __init__(self, *, devices: Sequence[Device] | None = None, spawn: Sequence = (),
                 discover: bool = True, litert: bool = True, strict: bool = False,
                 policy=None, app: str | None = None, remote: Sequence[str] = (),
                 pool: str | None = None):
        """``devices`` replaces discovery with the given devices. Otherwise the
        runtime has the services listed in ``NNRT_DRIVERS`` and the config
        file (``discover=True``), the services it starts itself from ``spawn``
        (driver kinds such as ``"sample-float-fast"``, named after the kind --
        ``"<kind>-service"`` for ``"litert"``, the in-process device's name --
        or ``(name, kind)`` pairs), stopped on close, and the in-process CPU
        devices: ``litert`` when LiteRT is installed (and ``litert`` is
        true; ``litert=N`` lets it run N executions at once, one core each,
        e.g. for a pipeline's lanes), then the reference.

        ``strict=True`` makes every fallback to the CPU an error (the default
        of ``compile(..., fallback=)``): an operation no other device
        supports, a driver that refuses to prepare its part, a driver that
        fails an execution. ``policy`` (``nnrt.qos.Policy``) applies to the
        in-process devices.

        ``app`` names this app to the schedulers (default ``NNRT_APP_NAME``):
        a service's policy can give it its own rule (``app = "camera"``),
        and ``nnrt driver status`` shows the name. Letters, digits, ``._-``.

        ``remote`` lists driver services on other hosts (``grpcs://HOST:PORT``,
        ``grpc://HOST:PORT`` for plaintext; a bare ``HOST:PORT`` is TLS), used
        besides the configured ones (even with ``discover=False``), with the
        credentials of ``NNRT_REMOTE_*`` (docs/operators/remote.md); one that
        does not answer is left out and tried again, as a configured service is.
        With ``pool="NAME"`` the ``remote`` services are the members of one
        device of that name, a pool of hosts serving the same driver
        (docs/operators/remote.md#pools): each execution goes to the member
        with the shortest expected wait, a burst stays on one, a dead
        member's work runs again on the others."""
        self.app = AppDeclaration.for_process(app)
        if not isinstance(litert, int) or litert < 0:
            raise invalid(f"litert must be True, False or a number of executions at once, "
                          f"got {litert!r}")
        self._litert = litert
        self.strict = request.flag(strict, "strict")
        self._given_devices = list(devices) if devices is not None else None
        self._spawn = list(spawn)
        self._discover = discover
        self._remote = [remote] if isinstance(remote, str) else list(remote)
        if pool is not None and not self._remote:
            raise invalid(f"pool {pool!r} needs its members: Runtime(remote=[...], pool=...)")
        self._pool = pool
        self._policy = policy
        self._devices: list[Device] | None = None
        self._cpu: Device | None = None
        self._task_group = None
        self._background = None          # the asyncio task holding the task group
        self._background_done = None
        self._services: list = []
        self._folder = None
        self._reconnector = None   # discovery.Reconnector of the configured services
        self._local: list[Device] = []   # the in-process devices it made (after the services)
        self._cache_counters = cache.Counters()

    async def __aenter__(self) -> "Runtime":
        await self.open()
        return self

    async def __aexit__(self, *exc) -> None:
        done = self._background_done
        self.close()
        if done is not None:
            with anyio.CancelScope(shield=True):
                await done.wait()

    @property
    def task_group(self):
        """The task group this runtime's background work runs in (fenced
        chains): a task of the event loop that opened the runtime, not of
        whichever task entered it, cancelled when the runtime closes."""
        if self._task_group is None:
            raise bad_state("the runtime is not open: use 'async with nnrt.Runtime() as rt'")
        return self._task_group

    async def _start_background(self) -> None:
        """Run a task group as a task of its own (asyncio) or a system task
        (trio), so it does not belong to the task that opened the runtime
        (which may not be the one that closes it: a test fixture, an exit
        stack)."""
        started, done = anyio.Event(), anyio.Event()

        async def background() -> None:
            try:
                async with anyio.create_task_group() as tg:
                    self._task_group = tg
                    started.set()
                    await anyio.sleep_forever()
            finally:
                self._task_group = None
                done.set()

        if sniffio.current_async_library() == "trio":
            import trio
            trio.lowlevel.spawn_system_task(background)
        else:
            self._background = asyncio.get_running_loop().create_task(background())
        self._background_done = done
        await started.wait()

    async def open(self) -> None:
        if self._devices is not None:
            return
        await self._start_background()
        if self._given_devices is not None:
            # QoS in front of every driver: a device without a scheduler of
            # its own gets one (a service's proxy has one in the service).
            self._devices = [d if d.scheduling().fronted else self._front(d)
                             for d in self._given_devices]
            # The fallback is a CPU device of this process when one was
            # given (one the runtime had to front itself): a service's
            # proxy, CPU-typed or not, dies with its service.
            cpus = [d for d in self._devices if d.type == DeviceType.CPU]
            ours = [d for d, given in zip(self._devices, self._given_devices)
                    if d is not given and d.type == DeviceType.CPU]
            self._cpu = (ours or cpus or [None])[0]
        else:
            found: list[Device] = []
            in_process = in_process_devices(litert=self._litert)
            if self._discover or self._spawn or self._remote:
                from . import discovery  # the service client needs only be loaded when used
                if self._discover or self._remote:
                    self._reconnector = discovery.Reconnector(
                        app=self.app, remote=self._remote, configured=self._discover,
                        pool=self._pool)
                    found += await self._reconnector.connect_all()
                    if self._reconnector.configured:
                        self._task_group.start_soon(self._watch_services, discovery.RETRY_INTERVAL)
                if self._spawn:
                    # A kind named like an in-process device ("litert") names
                    # its service "<kind>-service": two devices of one name
                    # could not be told apart (devices=, nnrt bench rows).
                    taken = {d.name for d in in_process}
                    specs = [(f"{spec}-service", spec) if isinstance(spec, str) and spec in taken
                             else spec for spec in self._spawn]
                    self._folder = discovery.private_folder()
                    self._services, spawned = await discovery.spawn(specs, self._folder.name,
                                                                    self.app)
                    found += spawned
            local = [self._front(d) for d in in_process]
            self._cpu = local[-1]    # the reference device: the fallback
            self._local = local
            self._devices = found + local
        vlog("manager", "devices: %s", ", ".join(d.name for d in self._devices))

    def _front(self, device: Device) -> ScheduledDevice:
        """The scheduler in front of an in-process device, which knows this
        process as the app ``self.app`` declares."""
        front = ScheduledDevice(device, policy=self._policy)
        front.introduce_app(front.app, self.app)
        return front

    def close(self) -> None:
        if self._task_group is not None:
            self._task_group.cancel_scope.cancel()   # pending fenced chains fail
        if self._devices is None:
            return
        if self._given_devices is None:
            for d in self._devices:
                d.close()
        for service in self._services:
            service.stop()
        self._services = []
        if self._folder is not None:
            self._folder.cleanup()
            self._folder = None
        self._devices = None
        self._cpu = None
        self._reconnector = None

    @property
    def closed(self) -> bool:
        """True before ``open`` and after ``close``."""
        return self._devices is None

    def __repr__(self) -> str:
        if self._devices is None:
            return "<nnrt.Runtime closed>"
        names = ", ".join(d.name for d in self._devices)
        return f"<nnrt.Runtime open{' strict' if self.strict else ''}: devices {names}>"

    async def _watch_services(self, interval: float) -> None:
        """While open: every ``interval`` seconds, reconnect to configured
        services that came back (a stat per service that is down), so
        compiled models that left one move back to it by themselves."""
        while self._devices is not None:
            await anyio.sleep(interval)
            if self._devices is None:
                return
            try:
                await self.reconnect()
            except NnrtError as e:   # one service's trouble: the next round tries again
                vlog("manager", "reconnecting: %s", e)

    @property
    def services(self) -> list:
        """Every configured driver service (``NNRT_DRIVERS``, drivers.conf)
        with its state as last seen: ``up``, ``unreachable`` or ``refused``
        (the socket's owner or folder is not trusted), and why."""
        return self._reconnector.states() if self._reconnector is not None else []

    async def reconnect(self) -> list[Device]:
        """Connect to configured services that came back on their socket
        path since they were last seen (a new socket file); they are offered
        to later compilations. ``compile`` does this by itself. Returns the
        devices added."""
        if self._reconnector is None or self._devices is None:
            return []
        self.devices   # drops the dead ones
        added = await self._reconnector.reconnect()
        if added:
            # Where open() puts services: before the in-process devices, so
            # a returned service wins the ties it won at the first
            # compilation and models move back to it.
            at = next((k for k, d in enumerate(self._devices) if d in self._local),
                      len(self._devices))
            self._devices[at:at] = added
            for d in added:
                _log.warning("driver service %s is back; offering it to new compilations", d.name)
        return added

    @property
    def devices(self) -> list[Device]:
        if self._devices is None:
            raise bad_state("the runtime is not open: use 'async with nnrt.Runtime() as rt'")
        # A service that died leaves the list (the HAL's DEAD_OBJECT).
        self._devices = [d for d in self._devices if d.alive]
        return list(self._devices)

    def device(self, name: str) -> Device:
        for d in self.devices:
            if d.name == name:
                return d
        raise invalid(f"no device named {name!r}; devices: {[d.name for d in self.devices]}")

    async def supported_operations(self, model: Model,
                                   devices: Sequence[str | Device] | None = None) -> list[bool]:
        """Which operations of ``model`` the given devices (default: every
        device) can run together."""
        hal = _finished(model).hal_model
        devices = [self._resolve(d) for d in devices] if devices is not None else self.devices
        flags = [False] * len(hal.main.operations)
        for d in devices:
            flags = [a or b for a, b in zip(flags, await d.supported_operations(hal))]
        return flags

    async def statistics(self, device: str | Device):
        """The counters of the scheduler in front of ``device`` (per app and
        priority: queued, running, completed, preempted, deadline misses,
        queue-wait p50/p99, device time), None when it has none."""
        return await self._resolve(device).statistics()

    async def finished_jobs(self, device: str | Device) -> tuple:
        """The recent executions the scheduler of ``device`` finished, with
        its own timestamps (submitted, started, finished, longest step)."""
        return await self._resolve(device).finished_jobs()

    def _resolve(self, device: str | Device) -> Device:
        return self.device(device) if isinstance(device, str) else device

    def pipeline(self, stages: Sequence, *, in_flight: int = 2, lanes: int | None = None,
                 costs=None, outputs: Sequence[str] | None = None, warmup: int = 3):
        """A :class:`~nnrt.Pipeline` of ``stages`` (``nnrt.Stage`` for a
        compiled model, ``nnrt.Step`` for a Python function between models):
        ``in_flight`` frames at once, the stages placed on ``lanes`` threads
        (default: this process's cores) from ``costs`` (seconds per stage) or,
        without them, from the times of the first ``warmup`` frames;
        ``outputs`` (default: the outputs no stage reads) are what each
        frame's result holds. docs/guide/pipelines.md."""
        if self.closed:
            raise bad_state("the runtime is not open: use 'async with nnrt.Runtime() as rt'")
        for stage in stages:
            if isinstance(stage, Stage) and not (isinstance(stage.compiled, CompiledModel)
                                                 and stage.compiled.runtime is self):
                raise invalid(f"pipeline: stage {stage.name!r} needs a model compiled by this "
                              f"runtime (await rt.compile(...)), got {stage.compiled!r}")
        return Pipeline(stages, in_flight=in_flight, lanes=lanes, costs=costs, outputs=outputs,
                        warmup=warmup)

    async def compile(self, model: Model, *,
                      preference: ExecutionPreference = ExecutionPreference.FAST_SINGLE_ANSWER,
                      priority: Priority | str = Priority.MEDIUM, deadline: float | None = None,
                      devices: Sequence[str | Device] | None = None,
                      fallback: bool | None = None, cache_dir: str | os.PathLike | None = None,
                      token: bytes | None = None) -> "CompiledModel":
        """Validate ``model``, assign its operations to devices and prepare
        each step on its device. ``priority`` is a :class:`Priority` or its
        name (``"HIGH"``).

        ``devices`` restricts compilation to the named devices; then, as in
        NNAPI, a device that fails to prepare its part fails the compilation
        and nothing falls back to the CPU. Otherwise every device is a
        candidate and, unless ``fallback=False`` (default: ``not
        Runtime.strict``), work falls back to the reference CPU device when
        no other device supports an operation, when its device fails to
        prepare it, or (the whole model) when its device fails an execution.
        ``compiled.placement`` says which happened. With ``fallback=False``
        each of these is an error instead.

        ``cache_dir`` turns on compilation caching (docs/guide/models.md): the
        compiled steps are kept in that folder and a later compilation of
        the same model for the same devices prepares from them. ``token``
        (32 bytes) is the app's name for the model, mixed into the key with
        a digest of the model's content; without it the content alone keys
        the cache. Files found stale, foreign or corrupt are counted
        (:meth:`cache_statistics`) and compiled afresh.
        """
        hal = _finished(model).hal_model
        priority = request.priority(priority)
        deadline = check_deadline(deadline)
        allow = not self.strict if fallback is None else request.flag(fallback, "fallback")
        try:
            preference = ExecutionPreference(preference)
        except ValueError:
            raise invalid(f"execution preference {preference!r} is not valid") from None
        token = cache.check_token(token)
        if token is not None and cache_dir is None:
            raise invalid("a cache token needs a cache_dir")
        explicit = devices is not None
        if not explicit:
            await self.reconnect()
        candidates = [self._resolve(d) for d in devices] if explicit else self.devices
        if explicit and not candidates:
            raise invalid("devices=[] names no device")
        allow = allow and not explicit
        entry = None
        if cache_dir is not None:
            entry = cache.Entry(cache.check_folder(cache_dir),
                                cache.entry_key(hal, token, candidates, preference, allow),
                                self._cache_counters)
            record = entry.read_record()
            if record is not None:
                compiled = await self._compile_cached(model, hal, record, candidates, entry,
                                                      preference, priority, deadline, allow)
                if compiled is not None:
                    return compiled
        try:
            return await self._compile_fresh(model, hal, candidates, explicit, allow,
                                             preference, priority, deadline, entry)
        except BaseException:
            if entry is not None:
                entry.discard()
            raise

    async def _compile_fresh(self, model, hal, candidates, explicit: bool, allow: bool,
                             preference, priority, deadline,
                             entry: "cache.Entry | None") -> "CompiledModel":
        """Validate, partition and prepare every step (writing the cache
        ``entry``'s files when there is one)."""
        validated = validate_model(hal)
        supported = [await d.supported_operations(hal) for d in candidates]
        assignment, notes = partition.place(hal, candidates, supported, preference)
        placed = self._placement(hal, candidates, supported, assignment, notes)
        if not explicit and not allow and any(p.fallback for p in placed):
            raise invalid("fallback=False (or Runtime(strict=True)) but this model would fall "
                          "back to the CPU: " + "; ".join(
                              f"operations {list(p.operations)}: {p.fallback}"
                              for p in placed if p.fallback))
        plans = partition.split(hal, assignment)
        steps = []
        for k, plan in enumerate(plans):
            start = time.perf_counter()
            files = None
            if entry is not None:
                files = self._new_cache_files(entry, k, plan.device)
            try:
                prepared = await plan.device.prepare_model(plan.model, preference, priority,
                                                           deadline, files)
                device = plan.device
            except NnrtError as e:
                if not allow or plan.device is self.cpu or e.status in _NOT_THE_DRIVERS_FAULT:
                    raise
                _log.warning("%s refused to prepare operations %s (%s); they run on %s",
                             plan.device.name, list(placed[k].operations), e, self.cpu.name)
                device = self.cpu
                prepared = await device.prepare_model(plan.model, preference, priority, deadline)
                kind = "died" if e.status == ErrorStatus.DEAD_OBJECT else "refused"
                placed[k] = PlacedStep(device.name, placed[k].operations,
                                       placed[k].operation_types,
                                       Fallback(kind, plan.device.name,
                                                f"{plan.device.name} failed to prepare them: "
                                                f"{e}"))
            vlog("compilation", "step of %d operations prepared on %s in %.1f ms",
                 len(plan.model.main.operations), device.name,
                 (time.perf_counter() - start) * 1e3)
            steps.append(Step(device, prepared, plan, validated))
        if entry is not None:
            if any(p.fallback is not None and p.fallback.kind != "unsupported" for p in placed):
                vlog("compilation", "cache entry %s not written: a step fell back", entry.key)
                entry.discard()
            else:
                entry.commit(_record(placed, validated))
        return CompiledModel(self, model, validated, steps, priority, preference,
                             fallback_allowed=allow, placement=Placement(tuple(placed)))

    def _new_cache_files(self, entry: "cache.Entry", k: int, device: Device):
        """Fresh cache files for step ``k`` (a miss, or after a reject), None
        for a device that keeps no cache."""
        needed = tuple(device.number_of_cache_files_needed())
        if needed == (0, 0):
            self._cache_counters.uncached += 1
            vlog("compilation", "cache: step %d on %s is not cached (the device keeps no "
                 "cache files)", k, device.name)
            return None
        if not entry.replace:
            self._cache_counters.misses += 1
            vlog("compilation", "cache miss: step %d on %s (entry %s)", k, device.name,
                 entry.key)
        return entry.create_step(k, needed)

    async def _compile_cached(self, model, hal, record: dict, candidates, entry: "cache.Entry",
                              preference, priority, deadline, allow) -> "CompiledModel | None":
        """Compile from a cache entry's record: the placement and what
        validation inferred come from it, each step from its driver's files
        (or afresh when they are missing or rejected). None when the record
        does not fit (counted): the caller compiles from scratch."""
        check_current_app(uses_extensions(hal))   # as partitioning would
        by_name = {d.name: d for d in candidates}
        try:
            validated = cache.validated_of(record["validated"])
            placed = [PlacedStep(s["device"], tuple(s["operations"]), tuple(s["types"]),
                                 None if s["fallback"] is None else Fallback(*s["fallback"]))
                      for s in record["steps"]]
            assignment: list = [None] * len(hal.main.operations)
            for p in placed:
                for i in p.operations:
                    assignment[i] = by_name[p.device]
            if any(d is None for d in assignment):
                raise ValueError("the record leaves operations unplaced")
            plans = partition.split(hal, assignment)
        except cache.CacheRejected as e:
            self._cache_counters.reject(e.reason, f"{entry.key} record", e.message)
            entry.replace = True
            return None
        except (KeyError, TypeError, ValueError, IndexError, NnrtError) as e:
            self._cache_counters.reject(cache.CacheReject.UNUSABLE, f"{entry.key} record",
                                        repr(e))
            entry.replace = True
            return None
        steps = []
        try:
            for k, plan in enumerate(plans):
                start = time.perf_counter()
                needed = tuple(plan.device.number_of_cache_files_needed())
                prepared = None
                files = entry.open_step(k, needed) if needed != (0, 0) else None
                if files is not None:
                    try:
                        prepared = await plan.device.prepare_model_from_cache(files, priority,
                                                                              deadline)
                        self._cache_counters.hits += 1
                        entry.keep_step(k, needed)
                        vlog("compilation", "cache hit: step %d on %s from entry %s in %.1f ms",
                             k, plan.device.name, entry.key, (time.perf_counter() - start) * 1e3)
                    except cache.CacheRejected as e:
                        self._cache_counters.reject(e.reason, f"step {k} on {plan.device.name}",
                                                    e.message)
                        entry.replace = True
                if prepared is None:
                    files = self._new_cache_files(entry, k, plan.device)
                    entry.replace = True   # a missing or rejected file: mend the entry
                    prepared = await plan.device.prepare_model(plan.model, preference,
                                                               priority, deadline, files)
                steps.append(Step(plan.device, prepared, plan, validated))
        except NnrtError as e:
            # A driver failing here (a service that died) is the uncached
            # path's to handle, with its fallbacks.
            vlog("compilation", "compiling from cache entry %s failed (%s); compiling afresh",
                 entry.key, e)
            for step in steps:
                step.prepared.release()
            entry.discard()
            return None
        except BaseException:
            for step in steps:
                step.prepared.release()
            entry.discard()
            raise
        entry.commit(record)
        return CompiledModel(self, model, validated, steps, priority, preference,
                             fallback_allowed=allow, placement=Placement(tuple(placed)))

    def cache_statistics(self) -> "cache.CacheStatistics":
        """What the compilation cache decided so far: hits, misses, rejects
        by reason (a frozen dataclass)."""
        return self._cache_counters.snapshot()

    def _placement(self, hal, candidates, supported, assignment,
                   notes: dict[int, str]) -> list[PlacedStep]:
        """The steps as placed by partitioning; a step on the CPU whose
        operations no other candidate supports is an ``unsupported`` fallback;
        ``notes`` say why operations were kept off a device with a round trip."""
        ops = hal.main.operations
        others = [(d, flags) for d, flags in zip(candidates, supported) if d is not self._cpu]
        placed = []
        for device, indexes in groups(assignment):
            fallback = None
            if device is self._cpu and others:
                names = ", ".join(d.name for d, _ in others)
                refused = [k for k in indexes if not any(flags[k] for _, flags in others)]
                if refused:
                    what = ", ".join(f"{k} {ops[k].type.name} on "
                                     f"{partition._operation_type(hal, ops[k]).name}"
                                     for k in refused)
                    fallback = Fallback("unsupported", names, f"not supported by {names}: {what}")
            placed.append(PlacedStep(device.name, tuple(indexes),
                                     tuple(ops[k].type.name for k in indexes), fallback,
                                     notes_of(notes, indexes)))
        return placed

    async def allocate(self, desc: MemoryDesc) -> DeviceMemory:
        """A memory for the roles of ``desc`` (NNAPI's
        ``ANeuralNetworksMemory_createFromDesc``): a buffer kept by the
        driver the roles' compiled model runs on, named by token (its data
        never crosses into the app), or shared memory with the same
        semantics when the driver declines or the roles span devices. See
        nnrt/runtime/memory_domain.py."""
        self.devices   # BAD_STATE when not open
        return await memory_domain.allocate(desc, self)

    @property
    def cpu(self) -> Device:
        """The CPU device work falls back to: the runtime's own reference
        device, or with ``devices=`` the first given in-process device of
        type CPU (else the first of type CPU: a service's)."""
        self.devices   # BAD_STATE when not open
        if self._cpu is None:
            raise NnrtError(ErrorStatus.DEVICE_UNAVAILABLE, "the runtime has no CPU device")
        return self._cpu

    def _forget(self, device: Device) -> None:
        """A device whose service died leaves the device list."""
        if self._devices is not None and device in self._devices:
            self._devices.remove(device)
            vlog("manager", "device %s is gone", device.name)


def in_process_devices(*, litert: bool | int = True) -> list[Device]:
    """The drivers every runtime runs in its own process: the litert driver
    when LiteRT is installed (first: it is the faster CPU driver; ``litert=N``
    runs N executions at once), then the reference CPU driver (the fallback)."""
    from ..drivers import litert as litert_driver
    devices: list[Device] = []
    if litert and litert_driver.available():
        devices.append(litert_driver.LiteRTDevice(slots=1 if litert is True else litert))
    devices.append(ReferenceDevice())
    return devices


# Failures that are about the request or the app, not the driver: retrying on
# the CPU would fail the same way, break the app's deadline, or (a full queue:
# RESOURCE_EXHAUSTED) just move the app's flood onto the CPU, so they are
# reported as they are.
def _record(placed, validated: ValidatedModel) -> dict:
    """The runtime's own record of a cached compilation (see nnrt/runtime/cache.py)."""
    return {"steps": [{"device": p.device, "operations": list(p.operations),
                       "types": list(p.operation_types),
                       "fallback": None if p.fallback is None else
                       [p.fallback.kind, p.fallback.device, p.fallback.detail]}
                      for p in placed],
            "validated": cache.dims_meta(validated)}


_NOT_THE_DRIVERS_FAULT = frozenset({
    ErrorStatus.INVALID_ARGUMENT, ErrorStatus.OUTPUT_INSUFFICIENT_SIZE,
    ErrorStatus.MISSED_DEADLINE_TRANSIENT, ErrorStatus.MISSED_DEADLINE_PERSISTENT,
    ErrorStatus.RESOURCE_EXHAUSTED_TRANSIENT, ErrorStatus.RESOURCE_EXHAUSTED_PERSISTENT,
})


def _finished(model: Model) -> Model:
    if not isinstance(model, Model):
        raise invalid(f"expected an nnrt.Model, got {type(model).__name__}")
    if not model.finished:
        raise bad_state("the model must be finished before it is compiled")
    return model


@dataclass(frozen=True, slots=True)
class CompiledModelStatistics:
    executions: int     # completed successfully
    failures: int       # executions that raised (after any fallback)
    fallbacks: int      # executions rerun on the CPU after a driver failure
    # Times a stateful model's state crossed between the app side and the
    # driver: once per execution when it is carried in numpy, once per reset
    # when it stays in device memories.
    state_transfers: int = 0


class CompiledModel:
    """A model prepared on one or more devices; run it with :meth:`execute`
    or a :meth:`burst`."""

    def __init__(self, runtime: Runtime, model: Model, validated: ValidatedModel,
                 steps: list[Step], priority: Priority, preference: ExecutionPreference,
                 fallback_allowed: bool, placement: Placement):
        self.model = model
        self._placement = placement
        self._closed = False
        self._executions = self._failures = self._fallbacks = 0
        self.priority = priority
        self.preference = preference
        self._runtime = runtime
        self._validated = validated
        self._fallback_allowed = fallback_allowed
        # Prepared models live in their drivers (maybe another process) until
        # released: release them when this object goes away or is closed.
        # The collector may run the finalizer on any thread at any allocation,
        # even one holding a service channel's send lock that a release takes:
        # so a collected model is released on a worker thread (close() below
        # releases at once). At exit the processes' ends release everything.
        self._prepared_models = [s.prepared for s in steps]
        self._finalizer = weakref.finalize(self, handoff.run_soon, release_all,
                                           self._prepared_models)
        self._finalizer.atexit = False
        hal = model.hal_model
        self._main = hal.main
        self._inputs: list[Operand] = [hal.main.operands[i] for i in hal.main.input_indexes]
        self._outputs: list[Operand] = [hal.main.operands[i] for i in hal.main.output_indexes]
        self._signature = signature.Signature(model)
        self._use_steps(steps)
        self._state_tried = False   # whether device memories for the state were tried
        # The name of a device this compiled model lost (died or failed under
        # it), while it waits for it to come back; and whether a move back
        # is being prepared.
        self._left: str | None = None
        self._moving_back = False
        self._input_names = [i.name for i in signature.describe(model).inputs]
        # Per input: (dtype, shape) an array must have to be taken as it is
        # (a tensor of known shape), else None (see _stage_inputs).
        self._as_is = [(o.type.dtype, tuple(o.dimensions))
                       if o.type.is_tensor and o.is_fully_specified else None
                       for o in self._inputs]

    @property
    def runtime(self) -> Runtime:
        """The runtime that compiled this model (``runtime.allocate`` makes
        its device memories)."""
        return self._runtime

    @property
    def placement(self) -> Placement:
        """Which device runs which operations, and why any ran on the CPU
        instead (``placement.fallbacks``)."""
        return self._placement

    def statistics(self) -> CompiledModelStatistics:
        return CompiledModelStatistics(self._executions, self._failures, self._fallbacks,
                                       self._signature.transfers)

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        def tensors(infos):
            return ", ".join(f"{i.name} {i.dtype} {tuple(i.shape)}" for i in infos)
        state = "closed " if self._closed else ""
        devices = ", ".join(dict.fromkeys(d.name for d in self.devices))
        return (f"<nnrt.CompiledModel {state}{len(self.model.hal_model.main.operations)} "
                f"operations on {devices} ({len(self._steps)} step(s)), priority "
                f"{self.priority.name}; inputs [{tensors(self.inputs)}]; outputs "
                f"[{tensors(self.outputs)}]>")

    def _check_open(self) -> None:
        """BAD_STATE for a closed compiled model or runtime: refused here,
        before any driver is asked, so in process and over a service alike."""
        if self._closed:
            raise bad_state("the compiled model is closed")
        if self._runtime._devices is None:   # Runtime.closed, read on every execution
            raise bad_state("the runtime that compiled this model is closed")

    @property
    def inputs(self) -> list[signature.TensorInfo]:
        """The inputs an app passes: name, dtype, shape (None = unknown), quantization."""
        return self._signature.inputs

    @property
    def outputs(self) -> list[signature.TensorInfo]:
        return self._signature.outputs

    def _model_io_index(self, kind: str, k: int) -> int:
        """The model's own index of the app's input (output) ``k``."""
        return self._signature.model_index(kind, k)

    def reset_state(self) -> None:
        """Start the state a stateful model carries between executions afresh:
        the next execution starts from the model's initial state (what a
        TFLite model's CALL_ONCE init subgraph assigns its variables; zeros
        for an LSTM's), as the first one did."""
        self._signature.reset_state()

    @property
    def devices(self) -> list[Device]:
        """The device of each step, in execution order."""
        return [s.device for s in self._steps]

    @property
    def device(self) -> Device:
        """The device of a single-device compilation (the first step's otherwise)."""
        return self._steps[0].device

    @property
    def _prepared(self) -> PreparedModel:
        return self._steps[0].prepared

    async def execute(self, inputs: Sequence[Any], *, outputs: Sequence[np.ndarray] | None = None,
                      measure_timing: bool = False, deadline: float | None = None,
                      loop_timeout: float | None = None) -> Result:
        """Run the model once. ``inputs`` are numpy arrays (or values numpy can
        convert), None for an omitted optional input. ``outputs`` may give
        the arrays to write results into; otherwise the runtime allocates them.
        ``inputs`` may also be a dict keyed by input name; a stateful model's
        state inputs and outputs are carried by the runtime, not passed.
        Each step runs a one-shot execution of its driver; for a model run
        again and again, :meth:`create_execution` binds once instead."""
        return await self._execute_through(None, inputs, outputs, measure_timing, deadline,
                                           loop_timeout)

    async def _execute_through(self, sessions: dict | None, inputs, outputs, measure_timing,
                               deadline, loop_timeout) -> Result:
        """:meth:`execute`, each step run by its HAL burst session in
        ``sessions`` (by step) when it has one: what a :class:`Burst`'s frames are."""
        if loop_timeout is not None:
            loop_timeout = check_loop_timeout(loop_timeout)
        sig = self._signature
        if sig.stateful:
            await self._ready_state()
        inputs, outputs = self._order(inputs, outputs)
        result = await self._execute(inputs, outputs, measure_timing, deadline, loop_timeout,
                                     sessions)
        return sig.carry_state(result) if sig.stateful else result

    async def _ready_state(self) -> None:
        """A stateful model keeps its state in device memories (two per
        state pair, taking turns), tried once: when the driver declines and
        shared memory cannot stand in, the state stays in numpy. Writes the
        initial state into them at first and after a reset; goes back to
        numpy state (the initial one, with a warning) when the model moved
        off the memories' device."""
        sig = self._signature
        if not sig.stateful:
            return
        if not self._state_tried:
            self._state_tried = True
            if sig.outputs_known():
                made: list = []
                try:
                    for i, o in sig.state_pairs:
                        pair = []
                        for _ in range(2):
                            desc = MemoryDesc()._add_model_role(self, "input", i)
                            pair.append(await self._runtime.allocate(
                                desc._add_model_role(self, "output", o)))
                            made.append(pair[-1])
                    sig.keep_state_in([made[k:k + 2] for k in range(0, len(made), 2)])
                except NnrtError as e:
                    vlog("execution", "the state stays in numpy: %s", e)
                    for m in made:
                        m.close()
        memories = sig.memories
        if memories is None:
            return
        if any(m.on_device and self.devices != [m.device] for pair in memories for m in pair):
            _log.warning("%s no longer runs on the device holding its state; the state "
                         "starts afresh in numpy", self)
            for m in sig.drop_memories():
                m.close()
            return
        if sig.reset_pending:
            for (current, _next), value in zip(memories, sig.initial_state()):
                with Memory.create(current.nbytes(current.declared),
                                   "nnrt-initial-state") as initial:
                    if value.any():   # a new memory is zero-filled
                        initial.array(value.dtype, value.shape)[...] = value
                    await memory_domain.copy(initial, current)
            sig.reset_done()

    def _order(self, inputs, outputs) -> tuple[list, Sequence | None]:
        self._check_open()
        sig = self._signature
        if inputs.__class__ is not list and inputs.__class__ is not tuple:
            inputs = request.sequence(inputs, "inputs")
        if outputs is not None:
            outputs = sig.order_outputs(request.sequence(outputs, "outputs"))
        elif sig.stateful:
            outputs = sig.order_outputs(None)
        return sig.order_inputs(inputs), outputs

    def _check_request(self, inputs, outputs, measure_timing, deadline):
        """Every check of a request before anything reaches a driver: the
        app's mistakes raise INVALID_ARGUMENT here (see nnrt.runtime.request)."""
        self._check_open()
        measure = measure_timing if measure_timing.__class__ is bool else \
            request.flag(measure_timing, "measure_timing")
        if deadline is not None:
            deadline = check_deadline(deadline)
        arrays = self._stage_inputs(inputs)
        user_outputs = self._check_outputs(outputs, arrays) if outputs is not None else None
        return arrays, user_outputs, measure, deadline

    @trace.traced("app: execute")
    async def _execute(self, inputs, outputs, measure_timing, deadline, loop_timeout,
                       sessions: dict | None) -> Result:
        arrays, user_outputs, measure, deadline = self._check_request(
            inputs, outputs, measure_timing, deadline)
        self._watch_for_return()
        try:
            try:
                result = await self._run(self._steps, arrays, user_outputs, measure, deadline,
                                         loop_timeout, sessions)
            except DriverFailure as failure:
                memories = [v for v in (*arrays, *(user_outputs or ()))
                            if isinstance(v, DeviceMemory) and v.on_device]
                # The memories' contents follow the execution to the CPU when
                # the dead driver left them readable (a service's mirrors).
                moved = [m.move_off_device() for m in memories]
                await self._move_off(failure)
                if not all(moved):
                    raise failure.error from None   # they died with the driver
                if memories:
                    self._signature.moved(memories)
                    arrays, user_outputs, measure, deadline = self._check_request(
                        inputs, outputs, measure_timing, deadline)
                result = await self._run(self._steps, arrays, user_outputs, measure, deadline,
                                         loop_timeout)
        except BaseException:
            self._failures += 1
            raise
        self._executions += 1
        if outputs is not None and _any_device_memory(outputs, None):
            result = _written(result, outputs)
        return result

    async def _move_off(self, failure: DriverFailure) -> None:
        """After a driver failure: the whole model moves to the best devices
        left (partitioned by capabilities, as a compilation would, without
        the one that failed: the in-process litert device before the
        reference one), or, when one of them refuses, to the CPU device."""
        kind = "died" if failure.error.status == ErrorStatus.DEAD_OBJECT else "failed"
        detail = f"{failure.device.name} {kind} during an execution: {failure.error}"
        note = Fallback(kind, failure.device.name, detail)
        hal = self.model.hal_model
        ops = hal.main.operations
        try:
            steps, placed = await self._steps_without(failure.device, note)
        except NnrtError as e:
            vlog("execution", "moving off %s: %s; the whole model goes to the CPU device",
                 failure.device.name, e)
            steps = await self._cpu_steps()
            placed = (PlacedStep(steps[0].device.name, tuple(range(len(ops))),
                                 tuple(op.type.name for op in ops), note),)
        if self._fallbacks == 0:
            _log.warning("%s %s during an execution (%s); this compiled model now runs on %s "
                         "(compile with fallback=False to get the error instead)",
                         failure.device.name, kind, failure.error,
                         ", ".join(dict.fromkeys(p.device for p in placed)))
        self._fallbacks += 1
        self._placement = Placement(placed)
        self._use_steps(steps)

    def _watch_for_return(self) -> None:
        """At an execution's start: when the device this model lost is back
        (the runtime reconnected a device of that name), prepare the model
        on the devices again in the background; the next execution after
        that runs there (a frame boundary: an execution reads the steps once)."""
        left = self._left
        if left is None or self._moving_back or self._closed:
            return
        devices = self._runtime._devices or ()
        back = next((d for d in devices if d.name == left and d.alive), None)
        if back is None:
            return
        self._moving_back = True
        try:
            self._runtime.task_group.start_soon(self._move_back, back)
        except NnrtError:      # the runtime is closing
            self._moving_back = False

    async def _move_back(self, back: Device) -> None:
        try:
            if self._fallback_allowed:
                steps, placed = await self._steps_without(None, None)
            else:   # pinned: the device it was compiled for, again
                steps, placed = await self._steps_over([back], None)
        except NnrtError as e:
            vlog("execution", "%s is back but preparing on it failed: %s", back.name, e)
            self._moving_back = False
            return
        if self._closed:
            release_all([s.prepared for s in steps])
            return
        self._left = None
        self._moving_back = False
        self._placement = Placement(placed)
        self._use_steps(steps)
        _log.warning("%s is back; %s runs on %s again", back.name, self,
                     ", ".join(dict.fromkeys(p.device for p in placed)))

    async def _steps_without(self, gone: Device | None,
                             note: Fallback | None) -> tuple[list[Step], tuple]:
        """The whole model partitioned over the runtime's devices but
        ``gone`` and prepared; each placed step carries ``note``.
        NnrtError when a device refuses its part (what was prepared is
        released)."""
        return await self._steps_over([d for d in self._runtime.devices if d is not gone], note)

    async def _steps_over(self, candidates: list[Device],
                          note: Fallback | None) -> tuple[list[Step], tuple]:
        """The whole model partitioned over ``candidates`` and prepared (see
        :meth:`_steps_without`)."""
        hal = self.model.hal_model
        ops = hal.main.operations
        if not candidates:
            raise NnrtError(ErrorStatus.DEVICE_UNAVAILABLE, "no device is left")
        supported = [await d.supported_operations(hal) for d in candidates]
        assignment, notes = partition.place(hal, candidates, supported, self.preference)
        steps: list[Step] = []
        try:
            for plan in partition.split(hal, assignment):
                prepared = await plan.device.prepare_model(plan.model, self.preference,
                                                           self.priority)
                self._prepared_models.append(prepared)
                steps.append(Step(plan.device, prepared, plan, self._validated))
        except NnrtError:
            for step in steps:
                self._prepared_models.remove(step.prepared)
            release_all([step.prepared for step in steps])
            raise
        placed = tuple(PlacedStep(device.name, tuple(indexes),
                                  tuple(ops[k].type.name for k in indexes), note,
                                  notes_of(notes, indexes))
                       for device, indexes in groups(assignment))
        return steps, placed

    def close(self) -> None:
        """Release the prepared models in their drivers now (also done when
        the compiled model is garbage collected). Executing it afterwards
        raises BAD_STATE."""
        self._closed = True
        for m in self._signature.drop_memories():
            m.close()
        if self._finalizer.detach() is not None:
            release_all(self._prepared_models)

    async def __aenter__(self) -> "CompiledModel":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    async def _cpu_steps(self) -> list[Step]:
        """The whole model prepared on the CPU device (fallback after a driver failure)."""
        cpu = self._runtime.cpu
        hal = self.model.hal_model
        plan = partition.StepPlan(cpu, hal, hal.main.input_indexes, hal.main.output_indexes)
        prepared = await cpu.prepare_model(hal, self.preference, self.priority)
        self._prepared_models.append(prepared)
        return [Step(cpu, prepared, plan, self._validated)]

    async def _run(self, steps: list[Step], arrays: list, user_outputs, measure: bool,
                   deadline: float | None, loop_timeout: float | None,
                   sessions: dict | None = None) -> Result:
        main = self._main
        single = len(steps) == 1
        # The one step of a whole-model compilation reads the model's inputs
        # and writes its outputs, in order: no table of values between steps.
        whole = steps is self._whole_steps
        values = None if whole else dict(zip(main.input_indexes, arrays))
        on_device = in_driver = 0
        measured = measure
        # A burst's ring carries shared-memory slots: a request naming a
        # driver buffer runs as a plain execution of the step.
        tokens = sessions is not None and _any_device_memory(arrays, user_outputs)
        for step in steps:
            session = sessions.get(id(step)) if sessions and not tokens else None
            runner = session if session is not None else step.prepared

            def execute(request, runner=runner):   # the awaitable itself: no coroutine around it
                return runner.execute(request, measure, deadline, loop_timeout)
            result, outs = await step.run_inputs(
                arrays if whole else [values[i] for i in step.plan.inputs], execute,
                user_outputs if single else None)
            if result.status != _NONE:
                self._step_failed(step, result)
            if not whole:
                values.update(zip(step.plan.outputs, outs))
            if measure:
                t = result.timing
                if t.on_device == UINT64_MAX or t.in_driver == UINT64_MAX:
                    measured = False
                else:
                    on_device += t.on_device
                    in_driver += t.in_driver
        if whole:
            outputs = outs
        else:
            outputs = [values[i] for i in main.output_indexes]
            if user_outputs is not None and not single:
                outputs = copy_into(user_outputs, outputs)
        request.check_on_time(deadline)
        shapes = [o.shape if o.__class__ is np.ndarray else _shape_of(o) for o in outputs]
        timing = None
        if measure:
            timing = ExecutionTiming(on_device if measured else None,
                                     in_driver if measured else None)
        return Result(outputs, shapes, timing)

    def _use_steps(self, steps: list[Step]) -> None:
        """Run on ``steps`` from now on; whether they are one step that is
        the whole model (its inputs and outputs the model's, in order:
        ``_run`` then needs no table of values) is decided here, once."""
        main = self._main
        self._steps = steps
        self._whole_steps = None
        if len(steps) == 1 and steps[0].plan.inputs == main.input_indexes \
                and steps[0].plan.outputs == main.output_indexes:
            self._whole_steps = steps

    def _step_failed(self, step: Step, result) -> NoReturn:
        """Raise the error of a step's failed ``result``: a ``DriverFailure``
        when the driver is to blame and the model may move to the CPU."""
        message = result.message or "execution failed"
        if result.status == ErrorStatus.OUTPUT_INSUFFICIENT_SIZE:
            message = f"{self._too_small(step, result.output_shapes)}: {message}"
        error = NnrtError(result.status, message,
                          output_shapes=[s.dimensions for s in result.output_shapes])
        if result.status == ErrorStatus.DEAD_OBJECT:
            self._runtime._forget(step.device)
            self._left = step.device.name    # (moved back when a device of that name returns)
        if result.status not in _NOT_THE_DRIVERS_FAULT and self._can_fall_back(step):
            raise DriverFailure(step.device, error)
        raise error

    def _too_small(self, step: Step, shapes) -> str:
        """Which outputs a too-small result names, and what each needs: the
        model's outputs by name when the step writes them, else the step's
        operands."""
        mine = step.plan.outputs == self._main.output_indexes
        said = []
        for k, shape in enumerate(shapes):
            if shape.is_sufficient:
                continue
            if mine:
                info = self.outputs[k]
                size = int(np.prod(shape.dimensions)) * np.dtype(info.dtype).itemsize
                said.append(f"output {k} ({info.signature_name or info.name}) needs "
                            f"{list(shape.dimensions)}, {size} bytes")
            else:
                said.append(f"operand {step.plan.outputs[k]} needs {list(shape.dimensions)}")
        return "; ".join(said) or "an output is too small"

    def _can_fall_back(self, step: Step) -> bool:
        try:
            return self._fallback_allowed and step.device is not self._runtime.cpu
        except NnrtError:  # a runtime without a CPU device has nothing to fall back to
            return False

    def create_execution(self, inputs: Sequence[Any] | dict | None = None, *, outputs=None,
                         measure_timing: bool = False, loop_timeout: float | None = None,
                         reusable: bool = True) -> Execution:
        """Bind ``inputs`` and ``outputs`` once, for computations again and
        again (NNAPI's reusable execution): ``await execution.compute()``.
        Inputs and outputs are checked as ``execute`` checks them; arrays
        taken as they are stay the execution's (write new input data into
        them, or into ``execution.inputs``), others are converted once.
        ``inputs=None`` makes zeroed input arrays of the declared shapes;
        ``outputs=None`` makes the output arrays. See
        nnrt/runtime/execution.py."""
        return Execution(self, inputs, outputs, measure_timing, loop_timeout, reusable)

    def burst(self) -> "Burst":
        self._check_open()
        return Burst(self)

    async def execute_fenced(self, inputs: Sequence[Any], *, outputs=None, wait_for=(),
                             measure_timing: bool = False, deadline: float | None = None,
                             loop_timeout: float | None = None,
                             timeout_after_fence: float | None = None):
        """Start an execution that waits for every fence in ``wait_for`` and
        return ``(fence, callback)`` at once: the fence is signaled when the
        execution ends; ``callback.get_result()`` / ``await callback.result()``
        give the outputs after that (see docs/guide/fences-and-pipelines.md). Steps on several
        devices are chained by fences, not by waiting in the app."""
        inputs, outputs = self._order(inputs, outputs)
        loop_timeout = check_loop_timeout(loop_timeout)
        if self._signature.stateful:
            raise invalid("execute_fenced does not carry a stateful model's state: use execute")
        if any(isinstance(v, DeviceMemory) for v in (*inputs, *(outputs or ()))):
            raise invalid("execute_fenced does not take device memories (yet): use execute "
                          "or a burst")
        return await execute_fenced(self, inputs, outputs, wait_for, measure_timing, deadline,
                                    loop_timeout, timeout_after_fence)

    def _stage_inputs(self, inputs: Sequence[Any]) -> list:
        if len(inputs) != len(self._inputs):
            raise invalid(f"the model takes {len(self._inputs)} inputs, got {len(inputs)}")
        staged = []
        for value, known in zip(inputs, self._as_is):
            if known is not None and request.as_is(value, *known):
                staged.append(value)   # what _stage_input would give, without its checks
            else:
                staged.append(self._stage_input(len(staged), value))
        return staged

    def _stage_input(self, k: int, value: Any):
        """App input ``k`` as the request carries it, checked."""
        operand = self._inputs[k]
        what = f"input {k} ({self._input_name(k)})"
        if value is None:
            hal = self.model.hal_model
            request.check_omitted(hal, hal.main.input_indexes[k], what)
            return None
        if isinstance(value, DeviceMemory):
            value.check_use(self, "input", k, what)
            return value if value.on_device else value.region()
        if isinstance(value, Region):
            if operand.type.is_tensor and not value.dimensions \
                    and not operand.is_fully_specified:
                raise invalid(f"input {k} has unknown dimensions "
                              f"{list(operand.dimensions)}: give them with the region "
                              f"(memory.region(offset, length, dimensions))")
            return value
        arr = request.convert(value, operand, what)
        if operand.type.is_tensor and operand.dimensions:
            declared = operand.dimensions
            if arr.ndim != len(declared) or any(
                    d and d != a for d, a in zip(declared, arr.shape)):
                raise invalid(f"{what} has shape {list(arr.shape)}, the model declares "
                              f"{list(declared)} (0 = any)")
        return arr

    def _input_name(self, k: int) -> str:
        return self._input_names[k]

    def _check_outputs(self, outputs: Sequence, inputs: Sequence = ()) -> list:
        if len(outputs) != len(self._outputs):
            raise invalid(f"the model has {len(self._outputs)} outputs, got {len(outputs)} "
                          f"output arrays")
        outputs = list(outputs)
        for k, (arr, operand) in enumerate(zip(outputs, self._outputs)):
            if request.as_is(arr, operand.type.dtype, writable=True):
                continue      # the common case, before the isinstance checks below
            if isinstance(arr, DeviceMemory):
                arr.check_use(self, "output", k, f"output {k}")
                if any(v is arr for v in inputs):
                    raise invalid(f"output {k}: the device memory is also an input: alternate "
                                  f"two memories")
                if not arr.on_device:
                    outputs[k] = arr.region()
                continue
            if isinstance(arr, Region):
                if not arr.memory.writable:
                    raise invalid(f"output {k}: the memory is mapped read-only")
                continue
            if not isinstance(arr, np.ndarray) \
                    or not request.as_is(np.asarray(arr), operand.type.dtype, writable=True):
                raise invalid(f"output {k} must be a writable C-contiguous numpy array of "
                              f"{operand.type.dtype}, or a Region of an nnrt.Memory")
        request.check_no_overlap(inputs, outputs)
        return outputs


def _any_device_memory(values, more) -> bool:
    for v in values:
        if v.__class__ is not np.ndarray and isinstance(v, DeviceMemory):
            return True
    return more is not None and any(isinstance(v, DeviceMemory) for v in more)


def _shape_of(value) -> tuple[int, ...]:
    if isinstance(value, DeviceMemory):
        return tuple(value.dimensions)
    return tuple(np.shape(value))


def _written(result: Result, outputs) -> Result:
    """``result`` with each device-memory output marked written at its
    shape and given back as the memory itself (its data stays where it is)."""
    values = list(result.outputs)
    for k, out in enumerate(outputs):
        if isinstance(out, DeviceMemory):
            out.written(result.output_shapes[k])
            values[k] = out
    return Result(values, result.output_shapes, result.timing)


class Burst:
    """A burst session: a sequence of executions of one compiled model
    (a camera-frame loop).

    Opening it configures a HAL burst on each step's prepared model: for a
    driver service that is a pair of shared-memory rings, so each frame costs
    one hand-off instead of a socket round trip; an in-process driver has
    nothing to hand off and runs frames as plain executions. Frames run in
    order, one at a time. After a driver failure the compiled model falls back
    to the CPU as ``execute`` does and the burst carries on there.
    """

    def __init__(self, compiled: CompiledModel):
        self._compiled = compiled
        # fast_acquire: a free lock is taken without a trip through the event
        # loop (the frame's own wait is the schedule point), as the HAL
        # session's own lock (issue 16).
        self._lock = anyio.Lock(fast_acquire=True)
        self._sessions: dict | None = None
        self._frames = self._failures = 0
        self._fallbacks_at_open = compiled._fallbacks

    def statistics(self) -> "BurstStatistics":
        """Frames run and failed in this session, fallbacks to the CPU since
        it opened, and each step's HAL session counters (for a driver
        service: ``BurstControllerStatistics`` -- executions, slots, bytes
        staged; None in process)."""
        sessions = tuple(s.statistics() for s in (self._sessions or {}).values())
        return BurstStatistics(self._frames, self._failures,
                               self._compiled._fallbacks - self._fallbacks_at_open, sessions)

    def __repr__(self) -> str:
        state = "open" if self._sessions is not None else "not open"
        return (f"<nnrt.Burst {state}, {self._frames} frame(s), {self._failures} failed, of "
                f"{self._compiled!r}>")

    async def __aenter__(self) -> "Burst":
        self._compiled._check_open()
        # A checkpoint even when opening fails at once (a pinned model's
        # service is down): an app retrying the open in a loop lets the
        # runtime's look for the returned service run, and the model moves
        # back (tests/integration/test_service_recovery.py).
        await anyio.lowlevel.checkpoint()
        self._compiled._watch_for_return()
        sessions = {}
        try:
            for step in self._compiled._steps:
                sessions[id(step)] = await step.prepared.configure_burst()
        except BaseException:
            for session in sessions.values():
                session.close()
            raise
        self._sessions = sessions
        return self

    async def __aexit__(self, *exc) -> None:
        sessions, self._sessions = self._sessions, None
        for session in (sessions or {}).values():
            session.close()

    async def compute(self, execution: Execution, *, deadline: float | None = None) -> Result:
        """Compute ``execution`` (``compiled.create_execution``, of this
        burst's compiled model) as the burst's next frame (NNAPI's
        ``ANeuralNetworksExecution_burstCompute``). Its request is bound to
        the burst once: on a driver service each later frame is a run frame
        of serial and deadline on the ring, the rest bound in the service."""
        sessions = self._sessions
        if sessions is None:
            raise bad_state("the burst session is not open: use 'async with compiled.burst()'")
        if not isinstance(execution, Execution) or execution._compiled is not self._compiled:
            raise invalid("burst.compute takes an execution of the burst's own compiled model "
                          "(compiled.create_execution)")
        async with self._lock:  # a burst runs its frames in order, one at a time
            try:
                result = await execution.compute_in(sessions, deadline)
            except BaseException:
                self._failures += 1
                raise
            self._frames += 1
            return result

    async def execute(self, inputs: Sequence[Any], *, outputs=None, measure_timing: bool = False,
                      deadline: float | None = None, loop_timeout: float | None = None) -> Result:
        """Run ``inputs`` as the next frame (each frame's request placed and
        sent anew: :meth:`compute` of a reusable execution binds it once)."""
        sessions = self._sessions
        if sessions is None:
            raise bad_state("the burst session is not open: use 'async with compiled.burst()'")
        # A frame is an execution of the compiled model whose steps the
        # sessions run.
        async with self._lock:  # a burst runs its requests in order, one at a time
            try:
                result = await self._compiled._execute_through(
                    sessions, inputs, outputs, measure_timing, deadline, loop_timeout)
            except BaseException:
                self._failures += 1
                raise
            self._frames += 1
            return result


@dataclass(frozen=True, slots=True)
class BurstStatistics:
    frames: int           # executions that completed
    failures: int         # executions that raised
    fallbacks: int        # executions rerun on the CPU after a driver failure
    sessions: tuple       # per step: the HAL session's statistics, or None
