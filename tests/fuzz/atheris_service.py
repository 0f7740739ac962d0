"""Coverage-guided fuzzing with atheris (libFuzzer for Python), the way
AOSP fuzzes drivers (DriverFuzzTest): over the control protocol's decoder,
the burst wire decoders, and a service's handling of whole connections.

    python -m tests.fuzz.atheris_service TARGET [libFuzzer flags]

TARGET is ``protocol``, ``burst`` or ``service``; e.g. ``-runs=100000`` or
``-max_total_time=600``. A finding is any exception other than the
documented refusal (``ProtocolError`` / ``BurstProtocolError``), and, for
``service`` (the input cut into well-framed calls after a HELLO), anything
that escapes a connection's handling, or a last call's answer that does not
come within 5 s (the service wedged on one connection). The code under
test is instrumented for coverage (``atheris.instrument_imports``).
"""
from __future__ import annotations

import socket
import struct
import sys

import atheris

# What each target's coverage is taken from. atheris instruments whole
# top-level packages, and instrumenting all of nnrt takes ~4 s of every run;
# so a decoder's target first imports the rest of nnrt plainly (an imported
# module is not imported again), then its own modules instrumented.
UNDER_TEST = {"protocol": ("nnrt.service.protocol", "nnrt.wirecodec"),
              "burst": ("nnrt.burst.wire", "nnrt.wirecodec"),
              "service": ("nnrt",)}
_target = sys.argv[1] if __name__ == "__main__" and len(sys.argv) > 1 else "service"
if UNDER_TEST.get(_target, ("nnrt",)) != ("nnrt",):
    import nnrt.hal
    import nnrt.memory.staging
    import nnrt.model.graph
    import nnrt.qos.scheduler  # noqa: F401
with atheris.instrument_imports(include=["nnrt"]):
    import anyio

    from nnrt.burst import wire
    from nnrt.service import protocol as p
    from nnrt.service.protocol import codecs
    if _target == "service":
        from nnrt.drivers.sample import make_driver
        from nnrt.service.server import DriverService, ServiceLimits

FAKE_FDS = (1000, 1001, 1002, 1003, 1004, 1005)   # numbers only: decoders never use them


def fuzz_protocol(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    fds = FAKE_FDS[:fdp.ConsumeIntInRange(0, len(FAKE_FDS))]
    try:
        p.decode_body(fdp.ConsumeBytes(fdp.remaining_bytes()), fds)
    except p.ProtocolError:
        pass
    # The connection's framing with the same bytes, fed in two pieces.
    conn = p.ServerConnection(max_fds=64, max_frame=1 << 20)
    half = len(data) // 2
    conn.receive_data(data[:half], ())
    conn.receive_data(data[half:], ())
    try:
        while conn.next_event() is not None:
            pass
    except p.ProtocolError:
        pass


def fuzz_burst(data: bytes) -> None:
    for decode in (wire.decode, wire.decode_frame, wire.decode_request, wire.decode_result):
        try:
            decode(data)
        except wire.BurstProtocolError:
            pass


class _Service:
    """One in-process service on the reference driver, reused by every
    input, on one event loop in a thread of its own (the portal)."""

    service: DriverService | None = None
    portal = portal_cm = None


_HELLO = p.encode(p.Hello(1))[0]
_MARK = p.encode(p.Query((1 << 63) + 1, p.Method.STATISTICS))[0]


async def _one_connection(data: bytes) -> None:
    if _Service.service is None:
        _Service.service = DriverService(make_driver("reference", "fuzzed"),
                                         limits=ServiceLimits(frame_bytes_per_connection=1 << 20))
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ours.setblocking(False)
    async with anyio.create_task_group() as tg:
        # Not the fenced _serve_connection: anything escaping is a finding.
        tg.start_soon(_Service.service.handle_connection, theirs)
        with anyio.fail_after(5):      # the mark's answer not coming: a wedge
            await _send(ours, _HELLO + data + _MARK)
            await _wait_for_mark(ours)
        ours.close()


async def _send(sock: socket.socket, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[sock.send(view):]
        except BlockingIOError:
            await anyio.wait_writable(sock)
        except OSError:
            return   # the service closed the connection: fine


async def _wait_for_mark(sock: socket.socket) -> None:
    """Read replies until the mark's (or until the service closed us)."""
    buf = b""
    while True:
        await anyio.wait_readable(sock)
        try:
            chunk = sock.recv(1 << 16)
        except BlockingIOError:
            continue
        except OSError:
            return
        if not chunk:
            return
        buf += chunk
        while len(buf) >= p.FRAME_HEADER_SIZE:
            length, _ = struct.unpack_from("<IB", buf)
            if len(buf) < p.FRAME_HEADER_SIZE + length:
                break
            body = buf[p.FRAME_HEADER_SIZE:p.FRAME_HEADER_SIZE + length]
            buf = buf[p.FRAME_HEADER_SIZE + length:]
            call_id, _method = codecs._peek_ids(body)
            if call_id == (1 << 63) + 1:
                return


def _frames(data: bytes) -> bytes:
    """The input as well-framed calls (the framing itself is the protocol
    target's): a body length from the input, then that many bytes."""
    fdp = atheris.FuzzedDataProvider(data)
    out = []
    while fdp.remaining_bytes():
        body = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 4096))
        out.append(struct.pack("<IB", len(body), 0) + body)
    return b"".join(out)


def fuzz_service(data: bytes) -> None:
    if _Service.portal is None:
        _Service.portal_cm = anyio.from_thread.start_blocking_portal()   # kept: its loop lives
        _Service.portal = _Service.portal_cm.__enter__()
    _Service.portal.call(_one_connection, _frames(data))


TARGETS = {"protocol": fuzz_protocol, "burst": fuzz_burst, "service": fuzz_service}


def main(argv=None) -> None:
    argv = list(sys.argv if argv is None else argv)
    if len(argv) < 2 or argv[1] not in TARGETS:
        sys.exit(f"usage: {argv[0]} {{{'|'.join(TARGETS)}}} [libFuzzer flags]")
    target = TARGETS[argv.pop(1)]
    atheris.Setup(argv, target)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
