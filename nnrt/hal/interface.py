"""The HAL interfaces: what a driver implements and what the runtime and the
driver service call (NNAPI HAL 1.3, spelled the Python way). Nothing above
the seam probes a driver with ``hasattr``, ``inspect`` or a class check:
whatever the runtime or the service needs to ask is declared here, with a
default where one is right for most drivers.

A driver writes the queries of :class:`Device`, ``prepare_model`` and
:meth:`PreparedModel.execute_synchronously`; that is all (see
docs/vendors/adding-a-driver.md). It does not schedule: the QoS front
(:class:`nnrt.qos.ScheduledDevice`) wraps every device, in process and inside
every driver service, and calls ``execute_synchronously`` on a thread it
owns, passing a ``checkpoint`` the driver calls at the boundaries it
declared in :meth:`Device.scheduling`. The front and the proxy of a driver
service (``nnrt.service.client.ServiceDevice``) implement the
asynchronous executions (``execute``, bursts, fenced) the runtime uses.

Status conventions: preparation and queries raise :class:`NnrtError`
carrying an :class:`ErrorStatus`; executions return an
:class:`ExecutionResult` ``(status, output_shapes, timing)`` because a failed
execution still reports shapes (OUTPUT_INSUFFICIENT_SIZE) and timing.
"""
from __future__ import annotations

import abc
import enum
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

import anyio

from ..errors import ErrorStatus, NnrtError
from ..handoff import Waiter, run_soon
from ..model.extensions import Extension
from .cache import CacheFiles, CacheReject, CacheRejected
from ..model.graph import HalModel
from .types import (AppDeclaration, BufferDesc, BufferRole, Capabilities, DeviceType, ExecutionPreference,
                    ExecutionResult, Priority, Request, Timing)


class Boundaries(enum.Enum):
    """Where a driver lets the scheduler stop a running execution."""

    NONE = "none"             # never: a whole run is the preemption granularity
    OPERATION = "operation"   # between any two operations (the reference driver)
    SEGMENT = "segment"       # between segments of bounded run time (the LiteRT driver)


@dataclass(frozen=True, slots=True)
class Scheduling:
    """What a device lets the scheduler do with it.

    ``boundaries``: where ``execute_synchronously`` calls its ``checkpoint``.
    ``slots``: how many executions it runs at once. ``fronted``: a scheduler
    already sits in front of this device (the QoS front itself, a driver
    service's proxy), so the runtime must not put another one there."""

    boundaries: Boundaries = Boundaries.NONE
    slots: int = 1
    fronted: bool = False


class Checkpoint:
    """What a driver calls at each boundary it declared: ``checkpoint()``
    returns to go on (maybe after a while: the execution was preempted and
    resumed), or raises ``NnrtError`` to stop it (deadline missed,
    cancelled); the driver then returns that error as its result.

    ``checkpoint.contended()`` says whether another job waits for the device
    now. A driver whose boundaries cost something (the litert driver's
    segments) may run a whole execution without them when nobody waits as
    it starts; a job that comes meanwhile then waits for that run. The
    scheduler makes these; ``Checkpoint(fn)`` wraps a plain function as
    always contended (stop at every boundary)."""

    __slots__ = ("_stop", "_contended")

    def __init__(self, stop: Callable[[], None], contended: Callable[[], bool] | None = None):
        self._stop = stop
        self._contended = contended

    def __call__(self) -> None:
        self._stop()

    def contended(self) -> bool:
        return True if self._contended is None else self._contended()

AppKey = Hashable
"""Who asks: the key of an app's queue (``("uid", 1000)`` in a service)."""


class FencedCallback(abc.ABC):
    """What a fenced execution reports once its fence is signaled (HAL
    ``IFencedExecutionCallback``). Nothing is available before."""

    @abc.abstractmethod
    def get_execution_info(self) -> tuple[ErrorStatus, Timing, Timing]:
        """``(status, timing_launched, timing_fenced)``; BAD_STATE before the
        fence is signaled."""

    @abc.abstractmethod
    def get_result(self) -> ExecutionResult:
        """The execution's result with its message; BAD_STATE before the fence
        is signaled."""

    @abc.abstractmethod
    async def wait_execution_info(self) -> tuple[ErrorStatus, Timing, Timing]:
        """Wait until the execution settles, then :meth:`get_execution_info`."""


class BurstExecution(abc.ABC):
    """A request bound to a burst session (canonical NNAPI
    ``IBurst::createReusableExecution``): :meth:`BurstSession.create_execution`
    binds it once, each ``execute`` computes it through the session (for a
    driver service: a frame of serial and deadline on the ring, the layout
    bound in the service). Every :class:`Execution` is one too."""

    @abc.abstractmethod
    async def execute(self, deadline: float | None = None) -> ExecutionResult:
        """Compute the bound request once more."""

    def release(self) -> None:
        """Let go of what the binding holds. Idempotent."""


class BurstSession(abc.ABC):
    """A sequence of executions of one prepared model (HAL ``IBurstContext``):
    opened once with :meth:`PreparedModel.configure_burst`, then every
    ``execute`` reuses what the first set up (for a driver service: two
    shared-memory rings and the memories already mapped, see nnrt.burst).
    Executions of one session run one after the other."""

    @abc.abstractmethod
    async def execute(self, request: Request, measure: bool = False,
                      deadline: float | None = None,
                      loop_timeout: float | None = None) -> ExecutionResult:
        """Run ``request`` as the next execution of the burst."""

    @abc.abstractmethod
    def create_execution(self, request: Request, measure: bool = False,
                         loop_timeout: float | None = None) -> BurstExecution:
        """Bind ``request`` to this session once (INVALID_ARGUMENT for one it
        cannot carry); its executions run in order with the session's others."""

    @abc.abstractmethod
    def close(self) -> None:
        """End the session and release what it holds. Idempotent."""

    def statistics(self):
        """The session's own counters (a frozen dataclass), None when it
        keeps none (an in-process session: nothing is handed off)."""
        return None

    async def __aenter__(self) -> "BurstSession":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()


class FrameExecution(BurstExecution):
    """A request bound to a burst session that keeps the binding itself (a
    remote burst binds each layout on the server, a pool's burst on its
    member): each ``execute`` is the session's ``execute`` of the request."""

    def __init__(self, session: BurstSession, request: Request, measure: bool = False,
                 loop_timeout: float | None = None):
        self.session = session
        self.request = request
        self.measure = measure
        self.loop_timeout = loop_timeout

    async def execute(self, deadline: float | None = None) -> ExecutionResult:
        return await self.session.execute(self.request, self.measure, deadline,
                                          self.loop_timeout)


class _InProcessBurst(BurstSession):
    """The burst of an in-process driver: there is nothing to hand off, so
    each execution is the prepared model's own ``execute``."""

    def __init__(self, prepared: "PreparedModel"):
        self._prepared = prepared
        self._closed = False

    async def execute(self, request: Request, measure: bool = False,
                      deadline: float | None = None,
                      loop_timeout: float | None = None) -> ExecutionResult:
        if self._closed:
            return ExecutionResult(ErrorStatus.INVALID_ARGUMENT,
                                   message="the burst session is closed")
        return await self._prepared.execute(request, measure, deadline, loop_timeout)

    def create_execution(self, request: Request, measure: bool = False,
                         loop_timeout: float | None = None) -> "Execution":
        """The prepared model's own execution: nothing to hand off."""
        if self._closed:
            raise NnrtError(ErrorStatus.INVALID_ARGUMENT, "the burst session is closed")
        return self._prepared.create_execution(request, measure, loop_timeout)

    def close(self) -> None:
        self._closed = True


class Execution(BurstExecution):
    """A request bound to a prepared model once, computed again and again
    (NNAPI feature level 5's reusable execution; AIDL
    ``IPreparedModel.createReusableExecution`` -> ``IExecution``).

    Made by :meth:`PreparedModel.create_execution`, which validates the
    request and binds whatever the driver can bind (the LiteRT driver: the
    interpreters' inputs and outputs to the request's regions). The request
    names its pools for the execution's whole life: new input values between
    two computations are writes into those pools, nothing else. One
    computation at a time: an execution is computed by one caller.

    A driver writes :meth:`execute_synchronously`; the asynchronous
    ``execute`` and ``execute_fenced`` have defaults (a worker thread, and
    fences waited for on the event loop) that the QoS front and a service's
    proxy replace."""

    request: Request
    measure: bool = False
    loop_timeout: float | None = None

    @abc.abstractmethod
    def execute_synchronously(self, deadline: float | None = None, *,
                              checkpoint: Checkpoint | None = None) -> ExecutionResult:
        """Compute the bound request and return when done (AIDL
        ``IExecution.executeSynchronously``), calling ``checkpoint`` (when
        given) at every boundary the device declared."""

    async def execute(self, deadline: float | None = None) -> ExecutionResult:
        """Compute without blocking the caller's event loop. This default
        runs :meth:`execute_synchronously` on a worker thread, unscheduled;
        a cancelled caller returns only once the thread let go of the
        request's pools."""
        return await in_worker(lambda: self.execute_synchronously(deadline))

    async def execute_fenced(self, task_group, wait_for=(), deadline: float | None = None,
                             timeout_after_fence: float | None = None):
        """Compute once every fence of ``wait_for`` is signaled (AIDL
        ``IExecution.executeFenced``): ``(SyncFence, callback)`` at once, as
        :meth:`PreparedModel.execute_fenced`. This default waits for the
        fences on the event loop, then runs :meth:`execute`."""
        from .fenced import run_fenced   # it uses this module's types

        return await run_fenced(task_group, self.execute, wait_for, measure=self.measure,
                                deadline=deadline, timeout_after_fence=timeout_after_fence)

    def release(self) -> None:
        """Let go of what the execution holds (its pools, its binding).
        Idempotent."""


class RequestExecution(Execution):
    """The execution of a driver that binds nothing: each computation is
    the prepared model's own execution of the request (the default of
    :meth:`PreparedModel.create_execution`, so a vendor driver stays small)."""

    def __init__(self, prepared: "PreparedModel", request: Request, measure: bool = False,
                 loop_timeout: float | None = None):
        self.prepared = prepared
        self.request = request
        self.measure = measure
        self.loop_timeout = loop_timeout

    def execute_synchronously(self, deadline: float | None = None, *,
                              checkpoint: Checkpoint | None = None) -> ExecutionResult:
        return self.prepared.execute_synchronously(self.request, self.measure, deadline,
                                                   self.loop_timeout, checkpoint=checkpoint)

    async def execute(self, deadline: float | None = None) -> ExecutionResult:
        return await self.prepared.execute(self.request, self.measure, deadline,
                                           self.loop_timeout)

    async def execute_fenced(self, task_group, wait_for=(), deadline: float | None = None,
                             timeout_after_fence: float | None = None):
        return await self.prepared.execute_fenced(task_group, self.request, wait_for,
                                                  self.measure, deadline, self.loop_timeout,
                                                  timeout_after_fence)

    def release(self) -> None:
        self.request = None

    def __repr__(self) -> str:
        return f"<RequestExecution of {self.prepared!r}>"


async def in_worker(work: Callable[[], ExecutionResult]) -> ExecutionResult:
    """``work()`` on a worker thread, awaited; a driver that raises still
    answers (GENERAL_FAILURE). A cancelled caller waits, shielded, until the
    thread is done with the request's pools."""
    waiter = Waiter()

    def run() -> None:
        try:
            result = work()
        except Exception as e:  # a driver bug still answers its caller
            result = ExecutionResult(ErrorStatus.GENERAL_FAILURE,
                                     message=f"the driver raised {e!r}")
        waiter.deliver(result)

    run_soon(run)
    try:
        return await waiter.wait()
    except BaseException:
        with anyio.CancelScope(shield=True):
            await waiter.wait()
        raise


class PreparedModel(abc.ABC):
    @abc.abstractmethod
    def execute_synchronously(self, request: Request, measure: bool = False,
                              deadline: float | None = None,
                              loop_timeout: float | None = None, *,
                              checkpoint: Checkpoint | None = None) -> ExecutionResult:
        """Run ``request`` and return when done (HAL ``executeSynchronously_1_3``),
        calling ``checkpoint`` (when given) at every boundary the device
        declared in :meth:`Device.scheduling`."""

    async def execute(self, request: Request, measure: bool = False,
                      deadline: float | None = None,
                      loop_timeout: float | None = None) -> ExecutionResult:
        """Run ``request`` without blocking the caller's event loop (HAL
        ``execute_1_3`` + ``IExecutionCallback``). This default runs
        :meth:`execute_synchronously` on a worker thread, unscheduled; the QoS
        front and the service proxy replace it. A cancelled caller returns
        only once the thread let go of the request's pools."""
        return await in_worker(lambda: self.execute_synchronously(
            request, measure, deadline, loop_timeout))

    def create_execution(self, request: Request, measure: bool = False,
                         loop_timeout: float | None = None) -> Execution:
        """Validate ``request`` and bind it once (AIDL
        ``createReusableExecution``): an :class:`Execution` to compute again
        and again. A driver that binds raises INVALID_ARGUMENT here for a
        request this model cannot run. This default binds nothing: each
        computation is :meth:`execute_synchronously` (or :meth:`execute`) of
        the request, and reports the request's faults as its result. A
        driver that can bind (its inputs and outputs to the request's
        regions) overrides it: that is where its per-call speed lives."""
        return RequestExecution(self, request, measure, loop_timeout)

    def release(self) -> None:
        """Free what the driver holds for this model (a service's proxy
        releases it in the service). Idempotent."""

    async def configure_burst(self) -> BurstSession:
        """Open a burst session (HAL ``configureExecutionBurst``). This
        default suits in-process drivers: each burst execution is
        :meth:`execute`. A driver service's proxy overrides it with the
        shared-memory ring of nnrt.burst."""
        return _InProcessBurst(self)

    async def execute_fenced(self, task_group, request: Request, wait_for=(),
                             measure: bool = False, deadline: float | None = None,
                             loop_timeout: float | None = None,
                             timeout_after_fence: float | None = None):
        """HAL ``executeFenced``: start ``request`` once every fence of
        ``wait_for`` is signaled and return ``(SyncFence, callback)`` at once;
        the fence is signaled when the execution is done, the callback
        (``get_execution_info()``, ``get_result()``, ``await
        wait_execution_info()``) holds the outcome from then on.

        ``task_group`` owns the execution's lifetime (cancelling it settles the
        fence with GENERAL_FAILURE). The request's pools are read and written
        after this returns, until the fence is signaled. This default waits
        for the fences on the event loop and then runs :meth:`execute`, so the
        execution goes through the driver's scheduler like any other."""
        # Imported here: nnrt.hal.fenced uses this module's types.
        from .fenced import run_fenced

        async def run(run_deadline: float | None) -> ExecutionResult:
            return await self.execute(request, measure, run_deadline, loop_timeout)

        return await run_fenced(task_group, run, wait_for, measure=measure, deadline=deadline,
                                timeout_after_fence=timeout_after_fence)


class Buffer(abc.ABC):
    """A driver-managed buffer (memory domains, HAL ``IBuffer``): made by
    :meth:`Device.allocate`, named in requests by its token (a
    :class:`nnrt.memory.DeviceToken` pool), its contents kept in the driver.
    Copies are awaited: a service's proxy asks over its socket."""

    token: int

    @abc.abstractmethod
    async def copy_to(self, memory) -> None:
        """Copy the buffer's contents into ``memory`` (an nnrt Memory or a
        writable buffer of exactly its size). INVALID_ARGUMENT when the
        buffer was never written or the sizes differ."""

    @abc.abstractmethod
    async def copy_from(self, memory, dimensions: Sequence[int] = ()) -> None:
        """Replace the contents with ``memory``'s bytes, shaped
        ``dimensions`` (combined with the buffer's: they must agree and be
        fully specified together). INVALID_ARGUMENT otherwise."""

    def release(self) -> None:
        """Free the buffer in the driver; its token names nothing after. Idempotent."""

    def recover(self) -> bytes | None:
        """After the buffer's driver died (a call failed with DEAD_OBJECT):
        the complete contents the buffer held last, for the runtime to
        rerun on the CPU with; None when they died with the driver — the
        default (a driver service mirrors buffers of known size: see
        nnrt.service.mirror). Never contents of a live driver."""
        return None


class Device(abc.ABC):
    """A driver. Its queries answer the same for the driver's whole life."""

    name: str
    type: DeviceType
    version_string: str
    feature_level: int

    @abc.abstractmethod
    def capabilities(self) -> Capabilities: ...

    def supported_extensions(self) -> list[Extension]:
        """The vendor extensions this driver implements, each with its name
        and operand types (HAL ``getSupportedExtensions``). A driver listing
        one validates the semantics of its operations in
        ``supported_operations`` and ``prepare_model``."""
        return []

    def number_of_cache_files_needed(self) -> tuple[int, int]:
        """(model cache files, data cache files); (0, 0) = no compilation
        caching: the runtime then passes no ``cache`` and never calls
        :meth:`prepare_model_from_cache`. At most ``MAX_CACHE_FILES`` each."""
        return (0, 0)

    def scheduling(self) -> Scheduling:
        """What the scheduler may do with this device; the default is a
        device it can never interrupt, running one execution at a time."""
        return Scheduling()

    @abc.abstractmethod
    async def supported_operations(self, model: HalModel) -> list[bool]:
        """One flag per operation of the main subgraph; INVALID_ARGUMENT for an
        invalid model. Awaited: a service's proxy asks over its socket."""

    @abc.abstractmethod
    async def prepare_model(self, model: HalModel, preference: ExecutionPreference,
                            priority: Priority, deadline: float | None = None,
                            cache=None, *, app: AppKey = None) -> PreparedModel:
        """Prepare ``model``. ``app`` is the calling app (the scheduler's
        queue key; a driver may use it to own what it allocates); None means
        the device's own process. ``cache`` (:class:`nnrt.hal.cache.CacheFiles`,
        only for a driver that needs cache files) holds fds the driver writes
        its compiled artifacts into before it returns (see docs/vendors/adding-a-driver.md);
        failing to write them does not fail the preparation."""

    async def prepare_model_from_cache(self, cache: CacheFiles,
                                       priority: Priority = Priority.MEDIUM,
                                       deadline: float | None = None, *,
                                       app: AppKey = None) -> PreparedModel:
        """Prepare the model whose artifacts ``prepare_model(..., cache=)``
        wrote into ``cache`` (HAL ``prepareModelFromCache``), without the
        model; ``priority`` is that of its executions, as for ``prepare_model``. Raises :class:`nnrt.hal.cache.CacheRejected` for files it
        will not use (the runtime counts the reason and compiles afresh).
        This default, right for a driver that needs no cache files, refuses."""
        raise CacheRejected(CacheReject.UNUSABLE, f"device {self.name} keeps no compilation cache")

    async def statistics(self):
        """The counters of the scheduler in front of this device
        (``nnrt.qos.SchedulerStatistics``), None when none is."""
        return None

    async def finished_jobs(self) -> tuple:
        """The scheduler's recent finished jobs (``JobRecord``), oldest first."""
        return ()

    def load(self):
        """How busy the scheduler in front of this device is now
        (``nnrt.qos.SchedulerLoad``: jobs waiting and running, slots, recent
        run time of a job), cheap enough to ask per execution; None when no
        scheduler is in front."""
        return None

    def introduce_app(self, app: AppKey, declaration: AppDeclaration) -> None:
        """``app`` (a driver service's new peer) declares a name and a script
        (:class:`AppDeclaration`): a scheduler's policy may match them, and
        its status shows them. This default keeps nothing."""

    def forget_app(self, app: AppKey) -> None:
        """``app`` has gone (a driver service's last connection of it
        closed): drop what is kept for it (a scheduler's counters, once its
        last job ends). This default keeps nothing."""

    @property
    def alive(self) -> bool:
        """False once the device is gone for good (a service that died: the
        HAL's DEAD_OBJECT); the runtime then stops offering it."""
        return True

    def close(self) -> None:
        """Let go of the device (a service's connection). Idempotent."""

    async def allocate(self, desc: BufferDesc, prepared_models: Sequence[PreparedModel],
                       input_roles: Sequence[BufferRole], output_roles: Sequence[BufferRole],
                       *, app: AppKey = None) -> tuple[Buffer, int]:
        """Allocate a driver-managed buffer for the given roles (HAL
        ``IDevice::allocate``): ``(buffer, token)``. ``prepared_models`` are
        this device's own, prepared for ``app``; the roles index them. A
        driver without memory domains declines with GENERAL_FAILURE (this
        default), and the runtime then uses shared memory instead (as the
        HAL allows); see nnrt/hal/buffers.py for the registry a CPU-side
        driver uses."""
        raise NnrtError(ErrorStatus.GENERAL_FAILURE,
                        f"device {self.name} does not allocate driver-managed buffers")
