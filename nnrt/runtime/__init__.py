"""The framework: device discovery, compilation and executions."""
from .memory_domain import DeviceMemory, MemoryDesc, copy
from .execution import Execution
from .pipeline import FrameResult, Pipeline, PipelineStatistics, Stage, Step
from .placement import Fallback, PlacedStep, Placement
from .runtime import (Burst, CompiledModel, CompiledModelStatistics, ExecutionTiming, Result,
                      Runtime)
from .sync import SyncBurst, SyncCompiledModel, SyncExecution, SyncRuntime, run

__all__ = ["Burst", "CompiledModel", "CompiledModelStatistics", "DeviceMemory", "Execution", "ExecutionTiming",
           "Fallback", "FrameResult", "MemoryDesc", "Pipeline", "PipelineStatistics", "Stage", "Step", "copy",
           "PlacedStep", "Placement", "Result", "Runtime", "SyncBurst", "SyncCompiledModel", "SyncExecution",
           "SyncRuntime",
           "run"]
