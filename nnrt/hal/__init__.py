"""The HAL: the one seam between the runtime and drivers (NNAPI HAL 1.3,
spelled the Python way).

``types`` holds the values that cross the seam, ``interface`` the abstract
``Device`` / ``PreparedModel`` / ``Execution`` / ``BurstSession`` / ``Buffer`` a driver
implements, ``buffers`` the registry of driver-managed buffers (memory domains),
``validate`` the checks of models and requests every side runs
(ValidateHal), ``fenced`` the fenced-execution engine.
"""
from .types import (NO_TIMING, AppDeclaration, UINT64_MAX, BufferDesc, BufferRole, Capabilities, DeviceType, ExecutionPreference,
                    ExecutionResult, MeasureTiming, OutputShape, PerformanceInfo, Priority,
                    Request, RequestArgument, Timing, check_deadline, check_priority, deadline_in)
from .interface import (AppKey, Boundaries, Buffer, BurstExecution, BurstSession, Checkpoint, Device, Execution,
                        FencedCallback, FrameExecution, PreparedModel, RequestExecution, Scheduling)
from .request import output_shapes, read_inputs, write_outputs
from ..errors import ErrorStatus

__all__ = ["AppDeclaration", "AppKey", "Boundaries", "Buffer", "BufferDesc", "BufferRole", "BurstExecution", "BurstSession", "Capabilities", "Checkpoint", "Device", "DeviceType", "ErrorStatus", "Execution", "FrameExecution",
           "ExecutionPreference", "ExecutionResult", "MeasureTiming", "NO_TIMING", "OutputShape",
           "FencedCallback", "PerformanceInfo", "PreparedModel", "RequestExecution", "Scheduling", "Priority", "Request", "RequestArgument", "Timing",
           "UINT64_MAX", "check_deadline", "check_priority", "deadline_in", "output_shapes",
           "read_inputs", "write_outputs"]
