"""nnrt: a neural-network runtime for Linux following the Android NNAPI (HAL 1.3) contract.

    import nnrt
    m = nnrt.Model(); ...; m.finish()
    async with nnrt.Runtime() as rt:
        compiled = await rt.compile(m)
        result = await compiled.execute([x, y])

or, from plain code (scripts, notebooks): ``with nnrt.SyncRuntime() as rt:
compiled = rt.compile(m); compiled.execute([x, y])``.
"""
from ._version import __version__

from .hal import DeviceType, ExecutionPreference  # noqa: E402
from .errors import ErrorStatus, NnrtError, ResultCode  # noqa: E402
from .fence import FenceState, SyncFence  # noqa: E402
from .memory import Memory  # noqa: E402
from .model.builder import Model  # noqa: E402
from .model.types import (FusedActivation, OperandType, OperationType,  # noqa: E402
                          PaddingScheme)
from .hal.types import Priority, deadline_in  # noqa: E402

__all__ = ["Burst", "CompiledModel", "DeviceMemory", "DeviceType", "ErrorStatus", "Execution", "ExecutionPreference",
           "ExecutionTiming", "FenceState", "FrameResult", "FusedActivation", "Memory", "MemoryDesc", "Model", "NnrtError",
           "OperandType", "OperationType", "PaddingScheme", "Pipeline", "Placement", "Priority", "Result",
           "ResultCode", "Runtime", "Stage", "Step", "SyncCompiledModel", "SyncExecution", "SyncFence", "SyncRuntime", "deadline_in",
           "copy", "run", "__version__"]


# The runtime's names, loaded on first use: a process that imports a part of
# nnrt without running apps (a driver service, the CLI's other commands) does
# not pay for the runtime (about 0.2 s of every service's start).
_RUNTIME_NAMES = frozenset({"Burst", "CompiledModel", "DeviceMemory", "Execution",
                            "ExecutionTiming", "FrameResult", "MemoryDesc", "Pipeline", "Placement", "Result", "Runtime", "Stage", "Step",
                            "SyncCompiledModel", "SyncExecution", "SyncRuntime", "copy", "run"})


def __getattr__(name: str):
    """The runtime's names and the public submodules, imported on first use
    (``import nnrt`` does not pay for the TFLite reader): ``nnrt.Runtime``,
    ``from nnrt import Runtime`` and ``nnrt.tflite.load(path)`` work after a
    plain ``import nnrt``, as ``nnrt.qos.Policy`` does."""
    # (Importing a name from the submodule loads it and binds it here as an
    # attribute of the package; ``from . import tflite`` would ask this
    # function again.)
    if name in _RUNTIME_NAMES:
        from . import runtime
        value = globals()[name] = getattr(runtime, name)
        return value
    if name == "tflite":
        from .tflite import load  # noqa: F401
        return globals()["tflite"]
    if name == "qos":
        from .qos import Policy  # noqa: F401
        return globals()["qos"]
    raise AttributeError(f"module 'nnrt' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _RUNTIME_NAMES | {"tflite", "qos"})
