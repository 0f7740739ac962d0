"""Shared-memory pools (memfd, POSIX shm, mmap of an fd) and driver-managed buffers."""
