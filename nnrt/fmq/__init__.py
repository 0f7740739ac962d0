"""Lock-free SPSC ring buffer in shared memory with an eventfd event flag (the
FMQ analogue). Imports nothing of nnrt; see :mod:`nnrt.fmq.ring` for the
theory of operation and ``docs/design/ring.md`` for the design."""
from .ring import (HEADER_SIZE, MAGIC, NATIVE_AVAILABLE, PREFIX, VERSION, FrameTooLarge, Ready,
                   Ring, RingClosed, RingCorrupted, RingError, RingStatistics, WouldBlock)

__all__ = ["FrameTooLarge", "HEADER_SIZE", "MAGIC", "NATIVE_AVAILABLE", "PREFIX", "Ready", "Ring",
           "RingClosed", "RingCorrupted", "RingError", "RingStatistics", "VERSION", "WouldBlock"]
