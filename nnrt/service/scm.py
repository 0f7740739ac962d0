"""File descriptors beside a Unix socket's bytes (SCM_RIGHTS), for both
transports of the control protocol: the ancillary data that sends them and
the fds found in what ``recvmsg`` received."""
from __future__ import annotations

import array
import socket


def rights(fds) -> list:
    """The ancillary data of a ``sendmsg`` that passes ``fds`` (none: [])."""
    return [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []


def received_fds(ancdata) -> list[int]:
    """The fds in ``recvmsg``'s ancillary data (the caller owns them)."""
    fds = array.array("i")
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    return list(fds)
