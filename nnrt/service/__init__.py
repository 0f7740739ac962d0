"""Driver services: a driver in its own process behind a Unix stream socket.

``protocol`` is the sans-I/O control protocol (framing, messages, the
connection state machine), ``server`` hosts a :class:`~nnrt.hal.Device`
on a socket, ``client`` is the proxy ``Device`` an app uses to reach it.
"""
