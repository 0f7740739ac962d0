"""Shared-memory pools (memfd, POSIX shm, mmap of an fd) and driver-managed buffers."""
from .device import DeviceToken
from .shared import Memory, Region, as_buffer, check_sealed, pool_view

__all__ = ["DeviceToken", "Memory", "Region", "as_buffer", "check_sealed", "pool_view"]
