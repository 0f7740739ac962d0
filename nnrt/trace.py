"""Execution traces in the Chrome trace-event format (opens in Perfetto and
chrome://tracing): the analogue of NNAPI's NNTRACE/systrace points.

``NNRT_TRACE=out.json`` in the environment of any app (or ``trace.start(path)``,
which ``nnrt bench --trace`` calls) turns tracing on. Every process that
inherits the variable — the driver services a runtime spawns do — records
its own events; each writes a fragment ``out.json.<pid>.part`` when it exits,
and the process that started the trace (``NNRT_TRACE_OWNER``) merges the
fragments of the processes that ended before it into ``out.json`` when it
stops. Timestamps are ``CLOCK_MONOTONIC`` (``time.monotonic_ns``), which is
one clock for every process on the machine, so the app and its services
share one timeline without any clock exchange.

Trace points elsewhere in nnrt are single lines so that they stay easy to
re-apply while others edit those files: a decorator (``@trace.traced(name)``)
on a function that is one stage, ``trace.interval`` for a stage known only
after the fact (a queue wait, from the scheduler's timestamps) and
``trace.instant`` for a point in time (a fence signaled). When tracing is
off every point costs one attribute test.

This module is a leaf: it imports nothing of nnrt.
"""
from __future__ import annotations

import atexit
import functools
import glob
import inspect
import itertools
import json
import os
import threading
import time

ENV = "NNRT_TRACE"
OWNER_ENV = "NNRT_TRACE_OWNER"

# Event phases this writer emits: complete spans, async spans (which may
# overlap on one thread: queue waits of concurrent executions), instants and
# metadata (process and thread names).
PHASES = frozenset({"X", "b", "e", "i", "M"})

_ids = itertools.count(1)


class _State:
    def __init__(self):
        self.events: list[dict] = []
        self.lock = threading.Lock()
        self.named_threads: set[int] = set()


_state = _State()


# The file events are recorded to; None when not recording. A module
# attribute, read as ``trace.recording`` on the per-execution paths, where
# a call of ``enabled()`` costs more than the rest of the check (issue 16).
recording: str | None = None


def enabled() -> bool:
    return recording is not None


def _now_us() -> float:
    return time.monotonic_ns() / 1000.0


def _to_us(monotonic_seconds: float) -> float:
    return monotonic_seconds * 1e6


def _emit(event: dict) -> None:
    pid = os.getpid()
    tid = threading.get_native_id()
    event["pid"] = pid
    event.setdefault("tid", tid)
    with _state.lock:
        if tid not in _state.named_threads:
            _state.named_threads.add(tid)
            _state.events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                                  "args": {"name": threading.current_thread().name}})
        _state.events.append(event)


def _clean(args: dict) -> dict:
    return {k: (v if isinstance(v, (int, float, str, bool)) or v is None else str(v))
            for k, v in args.items()}


def start(path: str, *, process_name: str | None = None) -> None:
    """Record events of this process (and of the children that inherit the
    environment) to ``path``; the fragments are merged by :func:`stop`."""
    path = os.path.abspath(path)
    os.environ[ENV] = path
    os.environ.setdefault(OWNER_ENV, str(os.getpid()))
    _begin(path, process_name)


def _begin(path: str, process_name: str | None) -> None:
    global recording
    if recording == path:
        return
    recording = path
    name = process_name or _process_label()
    _state.events.append({"name": "process_name", "ph": "M", "pid": os.getpid(), "tid": 0,
                          "args": {"name": name}})
    atexit.register(_at_exit)


def _process_label() -> str:
    try:
        with open(f"/proc/{os.getpid()}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        argv = []
    if "serve" in argv and "driver" in argv:
        return f"driver service {argv[argv.index('serve') + 1]} (pid {os.getpid()})"
    return f"app (pid {os.getpid()})"


def _is_owner() -> bool:
    return os.environ.get(OWNER_ENV) == str(os.getpid())


def _write_fragment() -> None:
    if recording is None:
        return
    with _state.lock:
        events, _state.events = _state.events, []
    if events:
        fragment = f"{recording}.{os.getpid()}.part"
        with open(fragment, "a") as f:
            for event in events:
                f.write(json.dumps(event) + "\n")


def stop() -> str | None:
    """Stop recording. The owner merges every fragment into the trace file
    and returns its path; another process writes its fragment (None)."""
    global recording
    path = recording
    if path is None:
        return None
    _write_fragment()
    recording = None
    _state.named_threads.clear()
    if not _is_owner():
        return None
    events = []
    for fragment in sorted(glob.glob(glob.escape(path) + ".*.part")):
        with open(fragment) as f:
            events += [json.loads(line) for line in f if line.strip()]
        os.unlink(fragment)
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms",
                   "otherData": {"clock": "CLOCK_MONOTONIC", "producer": "nnrt"}}, f)
    os.environ.pop(ENV, None)
    os.environ.pop(OWNER_ENV, None)
    return path


def _at_exit() -> None:
    if recording is not None:
        stop()


# -- trace points -------------------------------------------------------------

def instant(name: str, **args) -> None:
    """A point in time on this thread (e.g. a fence signaled)."""
    if recording is not None:
        _emit({"name": name, "ph": "i", "s": "t", "ts": _now_us(), "cat": "nnrt",
               "args": _clean(args)})


def complete(name: str, start_us: float, end_us: float, **args) -> None:
    """A span on this thread, from two ``monotonic_ns() / 1000`` times."""
    if recording is not None:
        _emit({"name": name, "ph": "X", "ts": start_us, "dur": max(end_us - start_us, 0.0),
               "cat": "nnrt", "args": _clean(args)})


def interval(name: str, start: float | None, end: float | None, **args) -> None:
    """A span known after the fact, from two ``time.monotonic()`` times
    (seconds; a scheduler's timestamps), as an async span: such spans may
    overlap on one thread (the queue waits of concurrent executions)."""
    if recording is None or start is None or end is None:
        return
    ident = next(_ids)
    common = {"name": name, "cat": "nnrt", "id": ident}
    _emit({**common, "ph": "b", "ts": _to_us(start), "args": _clean(args)})
    _emit({**common, "ph": "e", "ts": _to_us(max(end, start))})


def traced(name: str):
    """Decorator: each call of the function is a span named ``name`` — a
    complete span on the calling thread for a plain function, an async span
    for a coroutine function (coroutines of one loop interleave)."""
    def wrap(fn):
        if inspect.iscoroutinefunction(fn):
            async def traced_async(*a, **kw):
                t0 = time.monotonic()
                try:
                    return await fn(*a, **kw)
                finally:
                    interval(name, t0, time.monotonic())

            # A plain function returning the coroutine to await: untraced,
            # that is ``fn``'s own, with no second frame around it on every
            # resume (a per-frame cost on the hot path, issue 16).
            @functools.wraps(fn)
            def run_async(*a, **kw):
                if recording is None:
                    return fn(*a, **kw)
                return traced_async(*a, **kw)
            return run_async

        @functools.wraps(fn)
        def run(*a, **kw):
            if recording is None:
                return fn(*a, **kw)
            t0 = _now_us()
            try:
                return fn(*a, **kw)
            finally:
                complete(name, t0, _now_us())
        return run
    return wrap


def call(name: str, fn, *args, **extra):
    """``fn(*args)`` as a span named ``name`` (one operation of a driver);
    ``extra`` become the span's arguments."""
    if recording is None:
        return fn(*args)
    t0 = _now_us()
    try:
        return fn(*args)
    finally:
        complete(name, t0, _now_us(), **extra)


# A process started with NNRT_TRACE set (an app, or a service a traced app
# spawned) records from its first import of nnrt.
if os.environ.get(ENV):
    os.environ.setdefault(OWNER_ENV, str(os.getpid()))   # the first traced process merges
    _begin(os.environ[ENV], None)
