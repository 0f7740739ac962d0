"""64-byte round trips between two processes: the fmq ring against a plain
Python eventfd ping-pong and a multiprocessing.Pipe ping-pong, measured in
the same run. Prints p50/p99 per transport and the ratios to the eventfd
baseline (goal: ring p50 within 1.5x of the eventfd ping-pong).

    .venv/bin/python benchmarks/fmq_ring.py [--rounds 20000] [--async]

The ring is measured with the native fenced handshake (when the C helper
is built) and with the pure-Python always-signal protocol. ``--async`` also
measures an asyncio client awaiting the ring (``read_async``).
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nnrt.fmq import NATIVE_AVAILABLE, Ring  # noqa: E402

PAYLOAD = bytes(range(64))


def _percentiles(samples: list[float]) -> tuple[float, float]:
    samples = sorted(samples)
    return (statistics.median(samples) * 1e6,
            samples[min(len(samples) - 1, int(len(samples) * 0.99))] * 1e6)


# -- plain eventfd ping-pong: the floor for any eventfd-signalled transport

def _eventfd_echo(ping: int, pong: int, rounds: int) -> None:
    for _ in range(rounds):
        os.eventfd_read(ping)
        os.eventfd_write(pong, 1)


def bench_eventfd(rounds: int, warmup: int) -> list[float]:
    ping, pong = os.eventfd(0), os.eventfd(0)   # blocking: one syscall per wait
    p = mp.get_context("fork").Process(target=_eventfd_echo, args=(ping, pong, rounds + warmup))
    p.start()
    out = []
    for i in range(rounds + warmup):
        t = time.perf_counter()
        os.eventfd_write(ping, 1)
        os.eventfd_read(pong)
        if i >= warmup:
            out.append(time.perf_counter() - t)
    p.join()
    os.close(ping)
    os.close(pong)
    return out


# -- multiprocessing.Pipe ping-pong

def _pipe_echo(conn, rounds: int) -> None:
    for _ in range(rounds):
        conn.send_bytes(conn.recv_bytes())


def bench_pipe(rounds: int, warmup: int) -> list[float]:
    a, b = mp.Pipe()
    p = mp.get_context("fork").Process(target=_pipe_echo, args=(b, rounds + warmup))
    p.start()
    out = []
    for i in range(rounds + warmup):
        t = time.perf_counter()
        a.send_bytes(PAYLOAD)
        a.recv_bytes()
        if i >= warmup:
            out.append(time.perf_counter() - t)
    p.join()
    return out


# -- the ring: a request ring and a reply ring, echo server in a child

def _ring_echo(req_fds, rep_fds, rounds: int, native: bool) -> None:
    req = Ring.attach(*(os.dup(fd) for fd in req_fds), native=native)
    rep = Ring.attach(*(os.dup(fd) for fd in rep_fds), native=native)
    for _ in range(rounds):
        rep.write(req.read())
    req.close()
    rep.close()


def _ring_pair(rounds: int, native: bool):
    req, rep = Ring.create(1 << 16, native=native), Ring.create(1 << 16, native=native)
    p = mp.get_context("fork").Process(target=_ring_echo,
                                       args=(req.fds(), rep.fds(), rounds, native))
    p.start()
    return req, rep, p


def bench_ring(rounds: int, warmup: int, native: bool) -> list[float]:
    req, rep, p = _ring_pair(rounds + warmup, native)
    out = []
    for i in range(rounds + warmup):
        t = time.perf_counter()
        req.write(PAYLOAD)
        rep.read()
        if i >= warmup:
            out.append(time.perf_counter() - t)
    p.join()
    req.close()
    rep.close()
    return out


def bench_ring_async(rounds: int, warmup: int, native: bool) -> list[float]:
    req, rep, p = _ring_pair(rounds + warmup, native)

    async def client() -> list[float]:
        out = []
        for i in range(rounds + warmup):
            t = time.perf_counter()
            req.write_nowait(PAYLOAD)
            await rep.read_async()
            if i >= warmup:
                out.append(time.perf_counter() - t)
        return out

    out = asyncio.run(client())
    p.join()
    req.close()
    rep.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20000)
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--batches", type=int, default=5)
    parser.add_argument("--async", dest="with_async", action="store_true")
    args = parser.parse_args()
    runs = [("eventfd ping-pong", bench_eventfd), ("multiprocessing.Pipe", bench_pipe)]
    protocols = [("native", True)] if NATIVE_AVAILABLE else []
    protocols.append(("always-signal", False))
    for label, native in protocols:
        runs.append((f"fmq ring, {label}", partial(bench_ring, native=native)))
        if args.with_async:
            runs.append((f"fmq ring, {label}, asyncio", partial(bench_ring_async, native=native)))
    # Interleave batches of every transport so a change in machine load hits
    # all of them alike; samples are pooled per transport.
    samples = {name: [] for name, _ in runs}
    batch = max(1, args.rounds // args.batches)
    for _ in range(args.batches):
        for name, fn in runs:
            samples[name] += fn(batch, args.warmup)
    results = {name: _percentiles(s) for name, s in samples.items()}
    base50, base99 = results["eventfd ping-pong"]
    print(f"64-byte round trip, {args.rounds} rounds in {args.batches} interleaved batches, "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}")
    print(f"{'transport':34s} {'p50 us':>8s} {'p99 us':>8s} {'p50/eventfd':>12s} {'p99/eventfd':>12s}")
    for name, (p50, p99) in results.items():
        print(f"{name:34s} {p50:8.1f} {p99:8.1f} {p50 / base50:12.2f} {p99 / base99:12.2f}")
    ring50 = results[f"fmq ring, {protocols[0][0]}"][0]
    print(f"goal: ring ({protocols[0][0]}) p50 within 1.5x of eventfd: {ring50 / base50:.2f}x "
          f"({'met' if ring50 / base50 <= 1.5 else 'NOT met'})")


if __name__ == "__main__":
    main()
