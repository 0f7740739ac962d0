"""The framework: device discovery, compilation and executions."""
from .placement import Fallback, PlacedStep, Placement
from .runtime import (Burst, CompiledModel, CompiledModelStatistics, ExecutionTiming, Result,
                      Runtime)
from .sync import SyncBurst, SyncCompiledModel, SyncRuntime, run

__all__ = ["Burst", "CompiledModel", "CompiledModelStatistics", "ExecutionTiming", "Fallback",
           "PlacedStep", "Placement", "Result", "Runtime", "SyncBurst", "SyncCompiledModel",
           "SyncRuntime",
           "run"]
