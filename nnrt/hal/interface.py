"""The HAL: the interface between the runtime and a driver (NNAPI HAL 1.3,
spelled the Python way). The runtime talks to drivers only through these
classes; an in-process driver and a proxy to a driver service look the same.

Status conventions: preparation and queries raise :class:`NnrtError`
carrying an :class:`ErrorStatus`; executions return an
:class:`ExecutionResult` ``(status, output_shapes, timing)`` because a failed
execution still reports shapes (OUTPUT_INSUFFICIENT_SIZE) and timing.
"""
from __future__ import annotations

import abc
import enum
from typing import Sequence

from ..errors import ErrorStatus, NnrtError
from ..model.graph import HalModel
from .types import (Capabilities, DeviceType, ExecutionPreference, ExecutionResult, Priority,
                    Request)

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
    def close(self) -> None:
        """End the session and release what it holds. Idempotent."""

    async def __aenter__(self) -> "BurstSession":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()


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

    def close(self) -> None:
        self._closed = True


class PreparedModel(abc.ABC):
    @abc.abstractmethod
    def execute_synchronously(self, request: Request, measure: bool = False,
                              deadline: float | None = None,
                              loop_timeout: float | None = None) -> ExecutionResult:
        """Run ``request`` and return when done (HAL ``executeSynchronously_1_3``)."""

    @abc.abstractmethod
    async def execute(self, request: Request, measure: bool = False,
                      deadline: float | None = None,
                      loop_timeout: float | None = None) -> ExecutionResult:
        """Run ``request`` without blocking the caller's event loop (HAL
        ``execute_1_3`` + ``IExecutionCallback``)."""

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
    """A driver-managed buffer (memory domains)."""

    @abc.abstractmethod
    def copy_to(self, memory) -> None: ...

    @abc.abstractmethod
    def copy_from(self, memory, dimensions: Sequence[int]) -> None: ...


class Device(abc.ABC):
    """A driver. Its queries answer the same for the driver's whole life."""

    name: str
    type: DeviceType
    version_string: str
    feature_level: int

    @abc.abstractmethod
    def capabilities(self) -> Capabilities: ...

    def supported_extensions(self) -> list[str]:
        return []

    def number_of_cache_files_needed(self) -> tuple[int, int]:
        """(model cache files, data cache files); (0, 0) = no compilation caching."""
        return (0, 0)

    @abc.abstractmethod
    def supported_operations(self, model: HalModel) -> list[bool]:
        """One flag per operation of the main subgraph; INVALID_ARGUMENT for an
        invalid model."""

    @abc.abstractmethod
    async def prepare_model(self, model: HalModel, preference: ExecutionPreference,
                            priority: Priority, deadline: float | None = None,
                            cache=None) -> PreparedModel: ...

    def statistics(self):
        """The counters of the scheduler in front of this driver
        (``nnrt.qos.scheduler.SchedulerStatistics``), None without one."""
        return None

    def finished_jobs(self) -> tuple:
        """The scheduler's recent finished jobs (``JobRecord``), oldest first."""
        return ()

    def allocate(self, desc, roles) -> tuple[Buffer, int]:
        """Allocate a driver-managed buffer; a driver without memory domains
        fails, and the runtime then uses shared memory instead (as the HAL allows)."""
        raise NnrtError(ErrorStatus.GENERAL_FAILURE,
                        f"device {self.name} does not allocate driver-managed buffers")
