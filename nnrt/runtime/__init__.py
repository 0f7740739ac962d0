"""The framework: device discovery, compilation and executions."""
from .runtime import CompiledModel, ExecutionTiming, Result, Runtime, run

__all__ = ["CompiledModel", "ExecutionTiming", "Result", "Runtime", "run"]
