"""Two-process torture test of the fmq ring: a producer process writes frames
of random sizes carrying a sequence number and a CRC; the consumer (blocking
or asyncio) checks that every frame arrives once, in order, intact.

The ring is small (4 KiB, frames up to half of it), so both sides block all
the time and every wake-up path is exercised. ``NNRT_TORTURE_FRAMES`` sets
the number of frames per run with native ends (default 50,000; the issue's
full run is ``NNRT_TORTURE_FRAMES=1000000``); runs with a pure-Python end,
four times slower per frame, use a fifth of that. A lost wake-up shows up as a failure
through the watchdog, never as a hung test run.
"""
import asyncio
import os
import random
import signal
import struct
import subprocess
import sys
import time
import zlib

import pytest

from nnrt.fmq import NATIVE_AVAILABLE, Ring

FRAMES = int(os.environ.get("NNRT_TORTURE_FRAMES", "50000"))
CAPACITY = 4096
HEAD = struct.Struct("<QI")       # sequence number, crc32 of the payload
WATCHDOG = 60 + FRAMES // 2000    # seconds; generous, it only catches hangs


def _frame(rng: random.Random, seq: int, max_frame: int) -> bytes:
    # Mostly small frames, sometimes up to the largest the ring accepts.
    n = rng.randint(0, 64) if rng.random() < 0.7 else rng.randint(0, max_frame - HEAD.size)
    payload = rng.randbytes(n)
    return HEAD.pack(seq, zlib.crc32(payload)) + payload


def produce(fds: list[int], frames: int, seed: int, native: bool) -> None:
    ring = Ring.attach(*fds, native=native)
    rng = random.Random(seed)
    for seq in range(frames):
        ring.write(_frame(rng, seq, ring.max_frame))
    ring.close()


def check(frame: bytes, seq: int, rng: random.Random, max_frame: int) -> None:
    got_seq, crc = HEAD.unpack_from(frame)
    assert got_seq == seq, f"expected frame {seq}, got {got_seq} (loss or duplication)"
    assert zlib.crc32(frame[HEAD.size:]) == crc, f"frame {seq} corrupted"
    assert frame == _frame(rng, seq, max_frame), f"frame {seq} differs from what was sent"


def _start_producer(ring: Ring, frames: int, seed: int, native: bool) -> subprocess.Popen:
    fds = ring.fds()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.Popen([sys.executable, __file__, str(frames), str(seed), str(int(native)),
                             *map(str, fds)], pass_fds=fds, env=env)


CASES = [("blocking", True, True), ("asyncio", True, True),
         ("blocking", False, True), ("asyncio", False, False)]


@pytest.mark.parametrize("consumer,consumer_native,producer_native", [
    pytest.param(*case, id=f"{case[0]}-{'native' if case[1] else 'python'}-consumer-"
                           f"{'native' if case[2] else 'python'}-producer",
                 marks=pytest.mark.skipif((case[1] or case[2]) and not NATIVE_AVAILABLE,
                                          reason="native helper not built"))
    for case in CASES])
def test_two_process_torture(consumer, consumer_native, producer_native):
    seed = 1234 + len(consumer) + 2 * consumer_native + producer_native
    frames = FRAMES if consumer_native and producer_native else max(1, FRAMES // 5)
    ring = Ring.create(CAPACITY, native=consumer_native)
    producer = _start_producer(ring, frames, seed, producer_native)
    rng = random.Random(seed)
    started = time.monotonic()

    def on_alarm(*_):
        raise TimeoutError(f"torture test hung: no progress within {WATCHDOG} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(WATCHDOG)
    try:
        if consumer == "blocking":
            for seq in range(frames):
                check(ring.read(), seq, rng, ring.max_frame)
        else:
            async def consume():
                for seq in range(frames):
                    check(await ring.read_async(), seq, rng, ring.max_frame)
            asyncio.run(asyncio.wait_for(consume(), WATCHDOG))
        assert producer.wait(10) == 0
        stats = ring.statistics()
        assert stats.frames_read == frames and stats.bytes_used == 0
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
        producer.kill()
        producer.wait()
        ring.close()
    elapsed = time.monotonic() - started
    ends = f"{'native' if consumer_native else 'pure-Python'} consumer, " \
           f"{'native' if producer_native else 'pure-Python'} producer"
    print(f"{frames} frames, {consumer} consumer ({ends}): {elapsed:.1f} s")


if __name__ == "__main__":     # the producer process
    frames, seed, native, *fds = map(int, sys.argv[1:])
    produce(fds, frames, seed, bool(native))
