"""Shared-memory pools (memfd, POSIX shm, mmap of an fd) and driver-managed buffers."""
from .shared import Memory, as_buffer

__all__ = ["Memory", "as_buffer"]
