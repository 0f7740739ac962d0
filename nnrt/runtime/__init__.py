"""The framework: device discovery, compilation and executions."""
from .memory_domain import DeviceMemory, MemoryDesc, copy
from .placement import Fallback, PlacedStep, Placement
from .runtime import (Burst, CompiledModel, CompiledModelStatistics, ExecutionTiming, Result,
                      Runtime)
from .sync import SyncBurst, SyncCompiledModel, SyncRuntime, run

__all__ = ["Burst", "CompiledModel", "CompiledModelStatistics", "DeviceMemory", "ExecutionTiming",
           "Fallback", "MemoryDesc", "copy",
           "PlacedStep", "Placement", "Result", "Runtime", "SyncBurst", "SyncCompiledModel",
           "SyncRuntime",
           "run"]
