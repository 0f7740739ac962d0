"""Sync fences (eventfd) and fenced executions.

``SyncFence`` (:mod:`.sync_fence`) depends only on :mod:`nnrt.errors`, so the
HAL may import it. The fenced-execution engine lives in :mod:`.fenced` and is
not imported here: it uses the HAL's ``ExecutionResult`` and ``Timing``, and
importing it from this package would make ``drivers.hal -> fence -> drivers.hal``
a cycle. Import it as ``from nnrt.fence.fenced import run_fenced``.
"""
from .merge import MergeStatistics
from .merge import statistics as merge_statistics
from .outcome import FenceState
from .sync_fence import FenceEvent, SyncFence

__all__ = ["FenceEvent", "FenceState", "MergeStatistics", "SyncFence", "merge_statistics"]
