"""A fuzzer that drives a LIVE `nnrt driver serve` process as hostile apps
would (issue 23): random and mutated control frames, fds of every wrong
kind beside frames that expect fds, hostile request-ring contents and
counters, huge declared sizes, fd floods. After each batch a normal client
(the witness, connected all along) must still get correct results within
:data:`GUARD` seconds -- else it is a hang -- and the service must be alive
-- else a crash. At the end the service's fd count and RSS must be back
near where they started.

Run from the tests (`tests/fuzz/test_live_service_fuzz.py`: a short run in
`make test`, the long one with NNRT_FUZZ_LONG=1) or by hand::

    python -m tests.fuzz.live_service --frames 100000 --ring-writes 10000

which prints the figures docs/operators/security.md quotes.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import random
import select
import socket
import struct
import subprocess
import sys
import tempfile
import time

import anyio
import numpy as np

import nnrt
from nnrt import ErrorStatus, ExecutionPreference, OperandType as T, OperationType as Op, Priority
from nnrt.burst import wire
from nnrt.service import protocol as p
from nnrt.service.client import ServiceDevice
from nnrt.fmq import Ring
from nnrt.fmq.ring import HEADER_SIZE, READ_OFFSET, WRITE_OFFSET
from nnrt.hal import Request, RequestArgument
from nnrt.memory import Memory
from nnrt.model.graph import DataLocation

GUARD = 10.0   # seconds the witness may take after a batch: a guard against hangs


def add_model():
    m = nnrt.Model()
    a = m.add_operand(T.TENSOR_FLOAT32, [1, 4])
    b = m.add_operand(T.TENSOR_FLOAT32, [1, 4])
    act = m.add_operand(T.INT32)
    m.set_operand_value(act, 0)
    out = m.add_operand(T.TENSOR_FLOAT32, [1, 4])
    m.add_operation(Op.ADD, [a, b, act], [out])
    m.identify_inputs_and_outputs([a, b], [out])
    return m.finish().hal_model


def request_of(mem: Memory) -> Request:
    return Request((RequestArgument(False, DataLocation(0, 0, 16), (1, 4)),
                    RequestArgument(False, DataLocation(0, 16, 16), (1, 4))),
                   (RequestArgument(False, DataLocation(0, 32, 16)),), (mem,))


def process_figures(pid: int) -> tuple[int, int]:
    """(open fds, RSS bytes) of process ``pid``."""
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    return len(os.listdir(f"/proc/{pid}/fd")), rss


@dataclasses.dataclass
class Figures:
    frames: int = 0
    ring_writes: int = 0
    fds_sent: int = 0
    batches: int = 0
    reconnects: int = 0
    crashes: int = 0
    hangs: int = 0
    witness_checks: int = 0
    start_fds: int = 0
    end_fds: int = 0
    start_rss: int = 0
    end_rss: int = 0
    seconds: float = 0.0

    def line(self) -> str:
        return (f"{self.frames} frames, {self.ring_writes} hostile ring writes, "
                f"{self.fds_sent} fds sent in {self.batches} batches "
                f"({self.reconnects} connections closed on the fuzzer), "
                f"{self.crashes} crashes, {self.hangs} hangs, {self.witness_checks} witness "
                f"checks; service fds {self.start_fds} -> {self.end_fds}, RSS "
                f"{self.start_rss / 2**20:.1f} -> {self.end_rss / 2**20:.1f} MiB; "
                f"{self.seconds:.0f} s")


def _signal(efd: int, value: int) -> None:
    try:
        os.eventfd_write(efd, value)
    except BlockingIOError:
        pass   # saturated already: as good as signalled


class Hostile:
    """One hostile connection: raw frames and fds, replies read and dropped."""

    def __init__(self, path: str, rng: random.Random, figures: Figures):
        self.rng = rng
        self.figures = figures
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(GUARD)
        self.sock.connect(path)
        self.sock.setblocking(False)   # never wait on the service, except in call()
        self.ids = iter(range(1, 1 << 62))
        self.keep: list[int] = []    # fds whose other end we hold (pipes, sockets)
        self.rings: list[Ring] = []
        self.alive = True

    def send(self, data: bytes, fds=(), drain: bool = True) -> None:
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))] \
            if fds else []
        view = memoryview(data)
        deadline = time.monotonic() + GUARD
        try:
            while self.alive and view:
                try:
                    sent = self.sock.sendmsg([view], anc, socket.MSG_NOSIGNAL)
                except (BlockingIOError, InterruptedError):
                    self.drain()
                    if not select.select([], [self.sock], [], 0.05)[1] and \
                            time.monotonic() > deadline:
                        self.alive = False   # it stopped reading us: give this one up
                    continue
                anc = []
                view = view[sent:]
        except OSError:
            self.alive = False
        self.figures.frames += 1
        self.figures.fds_sent += len(fds)
        if drain:
            self.drain()

    def drain(self) -> None:
        """Read and drop whatever the service said (never block on it)."""
        try:
            while True:
                chunk, anc, _, _ = self.sock.recvmsg(1 << 16, socket.CMSG_SPACE(253 * 4),
                                                     socket.MSG_DONTWAIT)
                for level, kind, payload in anc:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        for fd in struct.unpack(f"{len(payload) // 4}i",
                                                payload[:len(payload) // 4 * 4]):
                            os.close(fd)
                if not chunk:
                    self.alive = False
                    return
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.alive = False

    def call(self, message) -> p.Reply | None:
        """Send a well-formed call and wait for its reply (None: closed)."""
        data, fds = p.encode(message)
        self.send(data, fds, drain=False)   # the reply may be back already: keep it
        buf = b""
        deadline = time.monotonic() + GUARD
        while self.alive and time.monotonic() < deadline:
            select.select([self.sock], [], [], 0.05)
            try:
                chunk, anc, _, _ = self.sock.recvmsg(1 << 16, socket.CMSG_SPACE(253 * 4))
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                return None
            for _level, _kind, payload in anc:
                for fd in struct.unpack(f"{len(payload) // 4}i", payload[:len(payload) // 4 * 4]):
                    os.close(fd)
            if not chunk:
                return None
            buf += chunk
            while len(buf) >= 5:
                length, _ = struct.unpack_from("<IB", buf)
                if len(buf) < 5 + length:
                    break
                body, buf = buf[5:5 + length], buf[5 + length:]
                try:
                    reply = p.decode_body(body)
                except p.ProtocolError:
                    continue
                if isinstance(reply, p.Reply) and reply.call_id == message.call_id:
                    return reply
        return None

    def close(self) -> None:
        self.sock.close()
        for fd in self.keep:
            os.close(fd)
        for ring in self.rings:
            ring.close()
        self.keep.clear()
        self.rings.clear()


class LiveFuzzer:
    """Batches of hostile actions against the service at ``path``."""

    def __init__(self, path: str, pid: int, seed: int = 0, tmpdir: str | None = None):
        self.path = path
        self.pid = pid
        self.rng = random.Random(seed)
        self.figures = Figures()
        self.tmpdir = tmpdir or tempfile.mkdtemp(prefix="nnrt-fuzz-")
        self.corpus = self._corpus()

    # -- what a hostile app sends ---------------------------------------------

    def _corpus(self) -> list[bytes]:
        """Well-formed frames of every call to mutate (fd counts included)."""
        model = add_model()
        arg = RequestArgument(False, DataLocation(0, 0, 16), (1, 4))
        pool = p.WirePool(1, None, True, 0, 64, 0, 48)
        messages = [
            p.Hello(1), p.Query(2, p.Method.CAPABILITIES), p.Query(3, p.Method.STATISTICS),
            p.Query(4, p.Method.SUPPORTED_EXTENSIONS), p.Query(5, p.Method.NUMBER_OF_CACHE_FILES),
            p.SupportedOperations(6, model),
            p.PrepareModel(7, model, ExecutionPreference.FAST_SINGLE_ANSWER, Priority.MEDIUM,
                           None),
            p.Execute(8, 1, (arg, arg), (arg,), (pool,), (), True, None, None),
            p.ReleaseModel(9, 1), p.Cancel(10, 8), p.ReleaseBurst(11, 1),
            p.FreeBurstSlots(12, 1, (1, 2, 3)),
        ]
        return [p.encode(m)[0] for m in messages]

    def wrong_fd(self, h: Hostile) -> int:
        """An fd of some kind a service must check: the caller closes it."""
        kind = self.rng.randrange(9)
        if kind == 0:
            return os.open(self.tmpdir, os.O_RDONLY | os.O_DIRECTORY)
        if kind == 1:
            return os.open("/dev/null", os.O_RDWR)
        if kind == 2:
            a, b = socket.socketpair()
            h.keep.append(b.detach())
            return a.detach()
        if kind == 3:
            r, w = os.pipe()
            h.keep.append(w)
            return r
        if kind == 4:
            return os.eventfd(self.rng.choice((0, 1, 2**32 - 1)))   # blocking
        if kind == 5:
            return os.eventfd(0, os.EFD_NONBLOCK | os.EFD_SEMAPHORE)
        if kind == 6:   # an unsealed memfd of a random size
            fd = os.memfd_create("fuzz", os.MFD_ALLOW_SEALING)
            os.ftruncate(fd, self.rng.choice((0, 1, 64, 4096, 1 << 20)))
            return fd
        if kind == 7:   # a sealed one, maybe too small for what a frame declares
            mem = Memory.create(self.rng.choice((64, 4096)))
            fd = os.dup(mem.fileno())
            mem.close()
            return fd
        return os.eventfd(0, os.EFD_NONBLOCK)

    def mutate(self, frame: bytes) -> bytes:
        data = bytearray(frame)
        for _ in range(self.rng.randint(1, 6)):
            op = self.rng.randrange(6)
            if op == 0 and data:
                data[self.rng.randrange(len(data))] = self.rng.randrange(256)
            elif op == 1 and len(data) > 5:
                del data[self.rng.randrange(5, len(data)):]
                struct.pack_into("<I", data, 0, len(data) - 5)   # keep the framing whole
            elif op == 2:
                at = self.rng.randrange(5, len(data) + 1)
                data[at:at] = self.rng.randbytes(self.rng.randint(1, 16))
                struct.pack_into("<I", data, 0, len(data) - 5)
            elif op == 3 and len(data) > 19:   # a huge count or length inside the body
                at = self.rng.randrange(15, len(data) - 3)
                struct.pack_into("<I", data, at, self.rng.choice((2**32 - 1, 1 << 20, 1 << 30)))
            elif op == 4:
                data[5:6] = bytes([self.rng.choice((1, 2, 3, 0))])    # the kind
            else:
                data[6:7] = bytes([self.rng.randrange(64)])           # the method
        data[4] = min(data[4], p.MAX_FDS)
        return bytes(data)

    def one_frame(self, h: Hostile) -> None:
        choice = self.rng.random()
        if choice < 0.55:
            frame = self.mutate(self.rng.choice(self.corpus))
        elif choice < 0.7:   # random body, sound framing
            body = self.rng.randbytes(self.rng.randint(0, 64))
            frame = struct.pack("<IB", len(body), 0) + body
        elif choice < 0.75:  # random bytes, framing and all (usually ends the connection)
            frame = self.rng.randbytes(self.rng.randint(1, 32))
        elif choice < 0.78:  # a huge declared size, then a little of it
            frame = struct.pack("<IB", self.rng.choice((p.MAX_FRAME, p.MAX_FRAME + 1,
                                                        2**32 - 1, 64 << 20)), 0) + b"\0" * 100
        else:                # a frame that takes fds, with fds of the wrong kind
            frame = bytearray(self.rng.choice(self.corpus[6:8]))
            fds = [self.wrong_fd(h) for _ in range(self.rng.randint(1, 4))]
            frame[4] = self.rng.choice((len(fds), len(fds), 0, len(fds) + 1))
            if self.rng.random() < 0.5:
                frame = self.mutate(bytes(frame))
            try:
                h.send(bytes(frame), fds)
            finally:
                for fd in fds:
                    os.close(fd)
            return
        h.send(frame)

    def fd_flood(self, h: Hostile) -> None:
        fd = self.wrong_fd(h)
        try:
            for _ in range(self.rng.randint(1, 4)):
                h.send(b"\x01" if self.rng.random() < 0.5 else b"", [fd] * p.MAX_FDS)
                if not h.alive:
                    break
        finally:
            os.close(fd)

    def hostile_burst(self, h: Hostile, model_id: int, writes: int) -> None:
        """A real burst, then hostile request-ring contents and counters."""
        requests, results = Ring.create(1 << 16), Ring.create(1 << 18)
        h.rings += [requests, results]
        reply = h.call(p.ConfigureBurst(next(h.ids) + 1000, model_id,
                                        tuple(requests.fds() + results.fds())))
        if reply is None or reply.status != ErrorStatus.NONE:
            return
        counters = memoryview(requests._mm).cast("B")
        capacity = len(counters) - HEADER_SIZE
        try:
            for _ in range(writes):
                kind = self.rng.randrange(6)
                if kind == 0:     # garbage bytes as a frame
                    frame = self.rng.randbytes(self.rng.randint(1, 512))
                elif kind == 1:   # a request for slots nobody gave
                    frame = wire.encode_request(wire.BurstRequest(
                        self.rng.randrange(1 << 32), (), (), tuple(
                            self.rng.randrange(1 << 20) for _ in range(self.rng.randint(0, 3)))))
                elif kind == 2:   # a mutated request
                    frame = bytearray(wire.encode_request(wire.BurstRequest(1, (), (), (1,))))
                    frame[self.rng.randrange(len(frame))] = self.rng.randrange(256)
                    frame = bytes(frame)
                else:
                    frame = None
                if frame is not None:
                    try:
                        requests.write_nowait(frame)
                    except Exception:
                        pass   # full: the service may have stopped reading (burst ended)
                elif kind == 3:   # scribble the data area
                    at = HEADER_SIZE + self.rng.randrange(capacity - 8)
                    counters[at:at + 8] = self.rng.randbytes(8)
                    _signal(requests.fds()[1], 1)
                elif kind == 4:   # an impossible write counter
                    struct.pack_into("<Q", counters, WRITE_OFFSET,
                                     self.rng.choice((1 << 63, 3, capacity * 2 + 8,
                                                      self.rng.randrange(1 << 64))))
                    _signal(requests.fds()[1], 1)
                else:             # a read counter of the result ring, or saturated eventfds
                    if self.rng.random() < 0.5:
                        struct.pack_into("<Q", memoryview(results._mm).cast("B"), READ_OFFSET,
                                         self.rng.randrange(1 << 64))
                    else:
                        _signal(requests.fds()[self.rng.choice((1, 2))], 2**64 - 2)
                self.figures.ring_writes += 1
                h.drain()
        finally:
            counters.release()

    # -- batches ---------------------------------------------------------------

    def batch(self, frames: int, ring_writes: int) -> None:
        h = Hostile(self.path, self.rng, self.figures)
        try:
            hello = h.call(p.Hello(next(h.ids)))
            reply = h.call(p.PrepareModel(next(h.ids), add_model(),
                                          ExecutionPreference.FAST_SINGLE_ANSWER,
                                          Priority.MEDIUM, None)) if hello else None
            model_id = reply.value if reply is not None and reply.status == 0 else None
            if model_id is not None and ring_writes:
                self.hostile_burst(h, model_id, ring_writes)
            sent = 0
            while sent < frames:
                if not h.alive:
                    h.close()
                    self.figures.reconnects += 1
                    h = Hostile(self.path, self.rng, self.figures)
                    if self.rng.random() < 0.8:
                        h.send(p.encode(p.Hello(next(h.ids)))[0])
                before = self.figures.frames
                if self.rng.random() < 0.03:
                    self.fd_flood(h)
                else:
                    self.one_frame(h)
                sent += self.figures.frames - before
        finally:
            h.close()
        self.figures.batches += 1

    async def check_witness(self, prepared, mem: Memory, k: int) -> bool:
        """The normal client: a correct ADD within GUARD seconds."""
        x = np.full(4, float(k % 100), np.float32)
        mem.array(np.float32, 8)[:] = np.concatenate([x, x])
        with anyio.move_on_after(GUARD):
            result = await prepared.execute(request_of(mem))
            self.figures.witness_checks += 1
            return result.status == ErrorStatus.NONE and \
                mem.array(np.float32, 4, 32).tolist() == (2 * x).tolist()
        return False

    async def run(self, frames: int, ring_writes: int, batch_frames: int = 200,
                  batch_ring_writes: int = 20, alive=lambda: True) -> Figures:
        started = time.monotonic()
        f = self.figures
        dev = await ServiceDevice.connect(self.path)
        try:
            prepared = await dev.prepare_model(add_model())
            with Memory.create(48) as mem:
                assert await self.check_witness(prepared, mem, 0)
                f.start_fds, f.start_rss = process_figures(self.pid)
                k = 0
                while f.frames < frames or f.ring_writes < ring_writes:
                    k += 1
                    await anyio.to_thread.run_sync(
                        self.batch, batch_frames,
                        batch_ring_writes if f.ring_writes < ring_writes else 0)
                    if not alive():
                        f.crashes += 1
                        break
                    if not await self.check_witness(prepared, mem, k):
                        f.hangs += 1
                        break
                # Everything of the hostile connections released: back to start?
                await self.settle(f.start_fds)
                f.end_fds, f.end_rss = process_figures(self.pid)
        finally:
            dev.close()
        f.seconds = time.monotonic() - started
        return f

    async def settle(self, fds: int) -> None:
        with anyio.move_on_after(GUARD):
            while process_figures(self.pid)[0] > fds:
                await anyio.sleep(0.05)


def serve(path: str, *extra: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "nnrt", "driver", "serve", "fuzzed",
                             "--socket", path, "--driver", "reference", *extra],
                            stdout=subprocess.PIPE)
    line = proc.stdout.readline()
    if b"listening" not in line:
        proc.kill()
        raise RuntimeError(f"the service did not start: {line!r}")
    return proc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frames", type=int, default=100_000)
    ap.add_argument("--ring-writes", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    folder = tempfile.mkdtemp(prefix="nnrt-fuzz-")
    path = os.path.join(folder, "fuzzed.sock")
    proc = serve(path)
    try:
        fuzzer = LiveFuzzer(path, proc.pid, args.seed, folder)
        figures = anyio.run(lambda: fuzzer.run(args.frames, args.ring_writes,
                                               alive=lambda: proc.poll() is None))
    finally:
        proc.terminate()
        try:
            code = proc.wait(30)
        except subprocess.TimeoutExpired:
            code = "none: it did not stop within 30 s of SIGTERM (killed)"
            proc.kill()
            proc.wait()
    print(figures.line())
    print(f"service exit code after SIGTERM: {code}")
    ok = (figures.crashes == 0 and figures.hangs == 0 and code == 0
          and figures.frames >= args.frames and figures.ring_writes >= args.ring_writes
          and figures.end_fds <= figures.start_fds * 1.1
          and figures.end_rss <= figures.start_rss * 1.1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
