"""Sync fences: an eventfd signaled once (``SyncFence``), the state a fence
reports (``FenceState``) and the merging of fences. This package imports
nothing of nnrt but ``errors``; the fenced-execution engine that waits for
fences, runs and signals one is part of the HAL (:mod:`nnrt.hal.fenced`).
"""
from .merge import MergeStatistics
from .merge import statistics as merge_statistics
from .outcome import FenceState
from .sync_fence import FenceEvent, SyncFence

__all__ = ["FenceEvent", "FenceState", "MergeStatistics", "SyncFence", "merge_statistics"]
