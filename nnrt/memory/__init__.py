"""Shared-memory pools (memfd, POSIX shm, mmap of an fd) and driver-managed buffers."""
from .shared import Memory, Region, as_buffer, check_sealed

__all__ = ["Memory", "Region", "as_buffer", "check_sealed"]
