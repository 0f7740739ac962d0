"""Device memories (memory domains): a request pool that names a
driver-managed buffer by its token instead of holding bytes.

A driver allocates a buffer inside its own process
(``Device.allocate``, see nnrt/hal/buffers.py) and answers a token; a
request lists :class:`DeviceToken` among its pools and an argument of that
pool is the whole buffer (``DataLocation(pool, 0, 0)``, as NNAPI's token
pools). The token is all that crosses to the driver: the data stays there.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DeviceToken:
    """A request pool naming the driver buffer ``token`` (never 0)."""

    token: int
