"""Segments: a converted partition cut into pieces of bounded run time.

One ``invoke()`` cannot be stopped halfway, so a scheduler can only preempt
a LiteRT execution between invokes. The driver therefore cuts its operations
into *segments*, each its own TFLite model and interpreter, and calls the
scheduler's checkpoint between them: a waiting HIGH job waits at most one
segment. Cutting costs something, so the driver keeps the uncut
interpreter too and runs it when nobody waits as an execution starts
(``LiteRTExecution``).

How a partition is cut (:func:`cut`). At preparation the whole partition is
converted once and timed on LiteRT (a warm-up invoke, then the best of a few).
That total is spread over the operations in proportion to a static cost
estimate (multiply-accumulates for convolutions and fully-connected layers,
elements touched for the rest, plus a fixed per-operation cost), and
consecutive operations are grouped greedily while their estimated time stays
within the budget. A model that fits the budget is one segment and runs on
the very interpreter that was timed. Cutting costs a copy of every tensor
that crosses a cut and the loss of fusion across it: on MobileNet v2 a few
segments are nearly free and 16 cost 15-20 % (docs/design/scheduler.md).

Who owns what (:class:`Runner`). An :class:`InterpreterSet` holds one
interpreter per segment and is used by one execution at a time: the values
that cross a cut wait in the input tensors of the segments that read them,
which belong to that set, so an execution parked at a checkpoint keeps its
state while another execution of the same model runs on another set. Sets
are made at preparation; an execution that finds none free (a preempting
execution of the same model) makes one more, once, and every later
execution reuses it. No lock of ours is held around ``invoke()``, which
releases the GIL while XNNPACK computes.
"""
from __future__ import annotations

import math
import os
import queue
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import numpy as np
# LiteRT's library is loaded with the driver (a driver is loaded when its
# device is listed, as NNAPI loads a HAL), not by the first compilation.
from ai_edge_litert.interpreter import Interpreter

from ...vlog import vlog
from . import flatbuffer
from .table import Lowered, Temp

# The estimated cost of an operation beyond its arithmetic, in
# multiply-accumulate equivalents (a few microseconds of LiteRT's per-node work).
_OPERATION_OVERHEAD = 20_000
_TIMING_RUNS = 3
_LONG_RUN = 0.02   # seconds: one timed run of a model this slow is enough


@dataclass(frozen=True)
class Segment:
    ops: tuple[int, ...]            # positions in the lowered operation list
    inputs: tuple[int, ...]         # NNAPI operands read from the request or earlier segments
    outputs: tuple[int, ...]        # NNAPI operands produced here and needed later or returned
    model: bytes                    # the segment's TFLite model


def cost(model, ops: tuple[Lowered, ...], dims: dict[int, tuple[int, ...]]) -> float:
    """Static cost estimate of one NNAPI operation's TFLite operators."""
    return sum(_cost(model, op, dims) for op in ops)


def _cost(model, lowered: Lowered, dims: dict[int, tuple[int, ...]]) -> float:
    """Static cost estimate of one operator (multiply-accumulates, or elements)."""
    def shape(x):
        if isinstance(x, int):
            return dims.get(x, model.main.operands[x].dimensions)
        return x.shape if isinstance(x, Temp) else x.value.shape

    def numel(x):
        return math.prod(shape(x))
    out = sum(numel(i) for i in lowered.outputs)
    if lowered.builtin in ("CONV_2D", "DEPTHWISE_CONV_2D", "FULLY_CONNECTED"):
        _, *window = shape(lowered.inputs[1])
        if lowered.builtin == "CONV_2D":
            work = out * math.prod(window)               # kh * kw * in_c per output
        elif lowered.builtin == "DEPTHWISE_CONV_2D":
            work = out * math.prod(window[:-1])          # kh * kw per output
        else:
            work = out * math.prod(window)               # input size per output
    elif lowered.builtin in ("AVERAGE_POOL_2D", "MAX_POOL_2D", "L2_POOL_2D"):
        work = out * lowered.fields["FilterWidth"] * lowered.fields["FilterHeight"]
    else:
        work = out + sum(numel(i) for i in lowered.inputs if i is not None)
    return work + _OPERATION_OVERHEAD


def cut(costs: list[float], total_seconds: float, budget: float | None,
        count: int | None = None) -> list[range]:
    """Group consecutive operations into segments: each within ``budget``
    seconds of estimated time (an operation longer than the budget is a
    segment of its own), or, with ``count``, into that many segments of
    about equal estimated time."""
    n = len(costs)
    scale = total_seconds / sum(costs)
    times = [c * scale for c in costs]
    if count is not None:
        count = max(1, min(count, n))
        groups, start = [], 0
        for left in range(count, 0, -1):
            end = n if left == 1 else start + 1
            if left > 1:
                target = sum(times[start:]) / left
                acc, last = times[start], n - (left - 1)
                # Take the next operation while that brings the segment closer
                # to its share, leaving one operation for each segment to come.
                while end < last and abs(acc + times[end] - target) < abs(acc - target):
                    acc += times[end]
                    end += 1
            groups.append(range(start, end))
            start = end
        return groups
    segments, start, acc = [], 0, 0.0
    for k, t in enumerate(times):
        if k > start and budget is not None and acc + t > budget:
            segments.append(range(start, k))
            start, acc = k, 0.0
        acc += t
    segments.append(range(start, n))
    return segments


def plan(model, lowered: list[tuple[Lowered, ...]], dims: dict[int, tuple[int, ...]],
         groups: list[range]) -> list[Segment]:
    """The segments of ``groups`` (ranges of ``lowered``, the TFLite
    operators of each NNAPI operation): their inputs, outputs and models."""
    lowered = [_boundary(ops) for ops in lowered]
    main = model.main
    model_inputs, model_outputs = set(main.input_indexes), set(main.output_indexes)
    produced_in = {}
    read_in: dict[int, set[int]] = {}
    for s, group in enumerate(groups):
        for k in group:
            for i in lowered[k].outputs:
                produced_in[i] = s
            for i in lowered[k].inputs:
                if isinstance(i, int):
                    read_in.setdefault(i, set()).add(s)
    segments = []
    for s, group in enumerate(groups):
        inputs, outputs = [], []
        for k in group:
            for i in lowered[k].inputs:
                if not isinstance(i, int) or i in inputs:
                    continue
                if i in model_inputs or produced_in.get(i, s) < s:
                    inputs.append(i)
            for i in lowered[k].outputs:
                if i in model_outputs or any(r > s for r in read_in.get(i, ())):
                    outputs.append(i)
        ops = [op for k in group for op in lowered[k].ops]
        segments.append(Segment(tuple(group), tuple(inputs), tuple(outputs),
                                flatbuffer.build(model, ops, inputs, outputs, dims)))
    return segments


@dataclass(frozen=True)
class _Boundary:
    """The NNAPI operands one operation's operators read and write."""

    ops: tuple[Lowered, ...]
    inputs: tuple
    outputs: tuple[int, ...]


def _boundary(ops: tuple[Lowered, ...]) -> _Boundary:
    inputs = tuple(i for op in ops for i in op.inputs if isinstance(i, int))
    outputs = tuple(i for op in ops for i in op.outputs if isinstance(i, int))
    return _Boundary(ops, inputs, outputs)


def whole(model, lowered: list[tuple[Lowered, ...]], dims) -> Segment:
    """The partition as one segment."""
    return plan(model, lowered, dims, [range(len(lowered))])[0]


class InterpreterSet:
    """One interpreter per segment, and where each operand lives in them."""

    def __init__(self, segments: list[Segment], make_interpreter: Callable[[bytes], object],
                 first=None):
        self.interpreters = [first if (k == 0 and first is not None) else make_interpreter(s.model)
                             for k, s in enumerate(segments)]
        # Per segment: (operand, tensor index) of its inputs and of its outputs.
        self.inputs = []
        self.outputs = []
        for seg, interp in zip(segments, self.interpreters):
            self.inputs.append(tuple(zip(seg.inputs, (d["index"] for d in interp.get_input_details()))))
            self.outputs.append(tuple(zip(seg.outputs,
                                          (d["index"] for d in interp.get_output_details()))))


def new_interpreter(model: bytes, num_threads: int):
    with _without_delegate_banner():
        interp = Interpreter(model_content=model, num_threads=num_threads)
        interp.allocate_tensors()
    return interp


# LiteRT's C++ side writes "INFO: Created TensorFlow Lite XNNPACK delegate for
# CPU." to fd 2 once per process, with no switch the Python package exposes,
# so it landed in every nnrt command's output. The first interpreter is made
# with fd 2 sent to a file; what was written there goes back to fd 2 but that
# line. Later interpreters print nothing (the line is printed once).
_BANNER = b"INFO: Created TensorFlow Lite XNNPACK delegate for CPU.\n"
_banner_lock = threading.Lock()
_banner_shown = False


@contextmanager
def _without_delegate_banner():
    global _banner_shown
    if _banner_shown:
        yield
        return
    with _banner_lock:
        if _banner_shown:
            yield
            return
        with tempfile.TemporaryFile() as caught:
            sys.stderr.flush()
            saved = os.dup(2)
            os.dup2(caught.fileno(), 2)
            try:
                yield
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
                os.close(saved)
                _banner_shown = True
                caught.seek(0)
                rest = memoryview(caught.read().replace(_BANNER, b"", 1))
                while rest:
                    rest = rest[os.write(2, rest):]


def time_invoke(interp, num_threads: int = 1) -> float:
    """Seconds one invoke of ``interp`` takes (zero inputs; the best of a
    few runs). With one thread XNNPACK computes on the calling thread, so its
    CPU time is the measure: a busy host stretches wall time at preparation
    but not the model's own cost, and segments cut from a stretched time
    would be needlessly many."""
    clock = time.thread_time if num_threads == 1 else time.perf_counter
    for d in interp.get_input_details():
        interp.set_tensor(d["index"], np.zeros(d["shape"], d["dtype"]))
    interp.invoke()   # warm-up: XNNPACK packs weights and plans on the first run
    best = math.inf
    for _ in range(_TIMING_RUNS):
        start = clock()
        interp.invoke()
        best = min(best, clock() - start)
        if best > _LONG_RUN:
            break
    return best


class Runner:
    """Runs a segmented partition: values in from the caller, through every
    segment (with a checkpoint between two), values out to the caller."""

    def __init__(self, segments: list[Segment], model_inputs, model_outputs, num_threads: int,
                 first_interpreter=None):
        self.segments = segments
        self.num_threads = num_threads
        self._free: queue.SimpleQueue[InterpreterSet] = queue.SimpleQueue()
        self._free.put(InterpreterSet(segments, self._make, first_interpreter))
        model_inputs, model_outputs = set(model_inputs), set(model_outputs)
        # (segment, input position, operand) of every request input, and per
        # segment the later readers (segment, input position) of each output
        # and whether the caller gets it.
        self._request_inputs = [(s, k, i) for s, seg in enumerate(segments)
                                for k, i in enumerate(seg.inputs) if i in model_inputs]
        readers: dict[int, list[tuple[int, int]]] = {}
        for s, seg in enumerate(segments):
            for k, i in enumerate(seg.inputs):
                if i not in model_inputs:
                    readers.setdefault(i, []).append((s, k))
        self._hand_on = [tuple((i, tuple(readers.get(i, ())), i in model_outputs)
                               for i in seg.outputs) for seg in segments]

    def interpreter_for_test(self, segment: int):
        """The interpreter of ``segment`` in an idle interpreter set (for
        benchmarks that time it bare)."""
        sets = self._free.get_nowait()
        self._free.put(sets)
        return sets.interpreters[segment]

    def _make(self, model: bytes):
        return new_interpreter(model, self.num_threads)

    def run(self, inputs: dict[int, np.ndarray], outputs: dict[int, np.ndarray],
            checkpoint: Callable[[], None] | None) -> float:
        """One execution. ``inputs`` holds every model input by operand (any
        array of the right dtype and shape, read once); each model output is
        copied into ``outputs[operand]`` (an array of its dtype and shape);
        ``checkpoint()`` is called between segments and may raise to stop.
        Returns the seconds spent in ``invoke``."""
        try:
            sets = self._free.get_nowait()
        except queue.Empty:
            vlog("driver", "litert: another interpreter set for a concurrent execution")
            sets = InterpreterSet(self.segments, self._make)
        try:
            return self._run(sets, inputs, outputs, checkpoint)
        finally:
            self._free.put(sets)

    def _run(self, sets: InterpreterSet, inputs, outputs, checkpoint) -> float:
        interps = sets.interpreters
        for s, k, operand in self._request_inputs:
            interps[s].set_tensor(sets.inputs[s][k][1], inputs[operand])
        busy = 0.0
        last = len(interps) - 1
        for s, interp in enumerate(interps):
            start = time.perf_counter()
            interp.invoke()
            busy += time.perf_counter() - start
            for (operand, readers, returned), (_, tensor) in zip(self._hand_on[s],
                                                                  sets.outputs[s]):
                value = interp.tensor(tensor)()
                for reader, k in readers:
                    interps[reader].set_tensor(sets.inputs[reader][k][1], value)
                if returned:
                    np.copyto(outputs[operand], value, casting="no")
                del value   # no view into an interpreter outlives the execution
            if checkpoint is not None and s < last:
                checkpoint()
        return busy
