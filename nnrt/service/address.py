"""``HOST:PORT`` addresses a service listens on (``--listen``, ``--metrics``)."""
from __future__ import annotations

import ipaddress

from ..errors import invalid


def split_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) as (host, port); INVALID_ARGUMENT otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise invalid(f"{address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def is_loopback(address: str) -> bool:
    """Whether ``address``'s host is a loopback one (only this host reaches it)."""
    host, _ = split_address(address)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
