"""Pipelines: several models (and Python steps between them) per frame, the
stages of a frame chained by sync fences, frames overlapped across cores.

Theory of operation
-------------------
An app describes *stages* (:class:`Stage`: a compiled model; :class:`Step`:
a Python function between models, e.g. decoding boxes) and which outputs
feed which inputs; ``rt.pipeline(stages, in_flight=2)`` makes a
:class:`Pipeline`.

Lanes. The stages are placed on *lanes*, one thread each (as many as the
process has cores, at most one per stage); a lane runs its stages frame
after frame, in frame order, each stage of a frame in the order given
(a topological order: a stage reads only the frame and earlier stages).
Models run as bound reusable executions computed on the lane's thread
(``Execution.compute_synchronously``: the scheduler queues the job, the
driver runs on the calling thread), so two lanes compute at once wherever
the device lets the scheduler run two jobs (an in-process ``LiteRTDevice``
with ``slots=2``, two devices, a device and a service) -- LiteRT and numpy
release the GIL while they compute. A stage that reads the output of a stage
on another lane waits for that stage's *sync fence* of the same frame; a
stage whose producer failed or dropped the frame finds the fence in ERROR
and skips. Which stages share a lane decides the gain, so :func:`place`
chooses it from measured costs: it simulates the lanes running frames
(each lane in frame order, a stage waiting for its lane and its inputs, at
most ``in_flight`` frames in) for every assignment and keeps the one with
the shortest period between frames, then the shortest frame.

Costs. Without ``costs=``, the first ``warmup`` frames run on one lane,
every stage after the other, and each stage's cost is the least time it
took; the placement is made from these, then the lanes start. Every
``REVIEW`` frames the placement is made again from the times measured
since (:func:`review`); a better one (a tenth shorter period) takes over at
the next frame not yet submitted: the old lanes stop before it, the new
ones start from it, so every frame is run by exactly one placement. Costs keep
being measured: a stage's estimate is the least of its last 16 times, the
time it can still make (a frame is dropped only when it cannot make its
deadline even then).

Slots. ``in_flight`` frames may be in the pipeline at once, each in a
*slot* of its own: the frame's buffer and, per stage, an execution bound
once to the slot's arrays (the consumer's inputs are the producer's output
arrays, so a frame moves bytes only where a Step copies its results and
where the frame is written in). A frame takes slot ``index % in_flight``,
free once the frame before it in that slot has been delivered.

Deadlines. A frame's deadline goes to every stage's computation (the
scheduler refuses or aborts work that cannot make it), and before a stage
starts its lane checks that the stage and the longest chain of stages
after it (their estimated costs) still fit: if not, the frame is dropped
there -- at the earliest stage that knows it cannot make it -- and counted
(``statistics().dropped``, by stage). A dropped frame is delivered in its
place in the order, with ``dropped_at`` set and no outputs.
"""
from __future__ import annotations

import collections
import itertools
import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterable, Callable, Iterable, Mapping, Sequence

import anyio
import anyio.from_thread
import anyio.lowlevel
import numpy as np

from ..errors import ErrorStatus, NnrtError, bad_state, invalid
from ..fence.sync_fence import FenceState, SyncFence
from ..hal.types import check_deadline

_DROPS = (ErrorStatus.MISSED_DEADLINE_TRANSIENT, ErrorStatus.MISSED_DEADLINE_PERSISTENT)
FRAME = "frame"


# -- what the app describes ----------------------------------------------------

@dataclass(frozen=True)
class Stage:
    """A compiled model run on every frame. ``inputs`` names the source of
    each model input, in order: ``"frame"`` (the frame; ``"frame:KEY"`` for a
    frame given as a dict), ``"NAME"`` (output 0 of the stage or step NAME)
    or ``"NAME:K"`` (its output K, a number or an output name)."""
    name: str
    compiled: Any
    inputs: Sequence[str] = (FRAME,)


@dataclass(frozen=True)
class Step:
    """A Python function run on every frame between models: called with the
    arrays named by ``inputs`` (as for :class:`Stage`), it returns one array
    per entry of ``outputs``, a ``(shape, dtype)`` each; the pipeline copies
    them into arrays of its own, which later stages read. Keep it short and
    in numpy: it runs on a lane's thread."""
    name: str
    fn: Callable[..., Any]
    inputs: Sequence[str]
    outputs: Sequence[tuple[tuple[int, ...], Any]]


@dataclass(frozen=True)
class FrameResult:
    """One frame, delivered in frame order. ``outputs`` maps each of the
    pipeline's outputs (a source name as in ``Stage.inputs``) to a copy of
    its array; empty when the frame was dropped. ``dropped_at``: the stage
    that dropped the frame for its deadline, else None. ``latency``: seconds
    from ``submit`` to the frame's last stage."""
    index: int
    outputs: dict[str, np.ndarray]
    dropped_at: str | None
    latency: float


@dataclass(frozen=True)
class PipelineStatistics:
    """``frames``: delivered (dropped ones included); ``dropped``: stage ->
    frames dropped there for their deadline; ``stage_seconds``: each stage's
    estimated cost (the least of its last 16 times); ``lanes``: the placement, the stages of
    each lane in order (None before it is made); ``replaced``: how many
    times the stages were placed again from the costs measured running."""
    frames: int
    dropped: dict[str, int]
    stage_seconds: dict[str, float]
    lanes: tuple[tuple[str, ...], ...] | None
    replaced: int = 0


# -- placement (pure) -------------------------------------------------------------

def place(order: Sequence[str], needs: Mapping[str, Iterable[str]], costs: Mapping[str, float],
          lanes: int, in_flight: int = 2) -> tuple[tuple[str, ...], ...]:
    """The stages (``order``, a topological order; ``needs[s]``: the stages
    ``s`` reads) on at most ``lanes`` lanes, each lane's stages in ``order``.
    Chosen from ``costs`` (seconds per frame) by :func:`simulate`: the
    shortest period between frames (the frame rate), then the shortest
    frame, then the fewest lanes. Exhaustive up to 12 stages, else
    longest-first onto the least loaded lane."""
    order = list(order)
    if lanes < 1:
        raise invalid(f"lanes must be at least 1, got {lanes}")
    lanes = min(lanes, len(order))
    if len(order) > 12:
        load = [0.0] * lanes
        lane_of = {}
        for s in sorted(order, key=lambda s: -costs[s]):
            k = load.index(min(load))
            lane_of[s] = k
            load[k] += costs[s]
        return _lanes(order, lane_of, lanes)
    best = None
    # The first stage on lane 0: lanes are interchangeable.
    for rest in itertools.product(range(lanes), repeat=len(order) - 1):
        lane_of = dict(zip(order, (0, *rest)))
        period, latency = simulate(order, needs, costs, lane_of, in_flight)
        key = (round(period, 12), round(latency, 12), len(set(lane_of.values())))
        if best is None or key < best[0]:
            best = (key, lane_of)
    return _lanes(order, best[1], lanes)


def review(order: Sequence[str], needs: Mapping[str, Iterable[str]], costs: Mapping[str, float],
           now: tuple[tuple[str, ...], ...], lanes: int, in_flight: int = 2):
    """A placement for ``costs`` whose simulated period is at least a tenth
    shorter than that of ``now`` (the lanes in use), else None: a switch
    costs a drained frame boundary, so a small gain is not worth it."""
    better = place(order, needs, costs, lanes, in_flight)
    if better == now:
        return None
    period = {p: simulate(order, needs, costs,
                          {s: k for k, lane in enumerate(p) for s in lane}, in_flight)[0]
              for p in (now, better)}
    return better if period[better] < 0.9 * period[now] else None


def _lanes(order, lane_of, lanes) -> tuple[tuple[str, ...], ...]:
    return tuple(t for t in (tuple(s for s in order if lane_of[s] == k) for k in range(lanes)) if t)


def simulate(order: Sequence[str], needs: Mapping[str, Iterable[str]],
             costs: Mapping[str, float], lane_of: Mapping[str, int], in_flight: int = 2,
             frames: int = 16) -> tuple[float, float]:
    """``(period, latency)`` of a placement, as the lanes run it: each lane
    takes its stages frame after frame, a stage starts once its lane is free
    and what it reads is done, a frame enters once the frame ``in_flight``
    before it has left. ``period``: the steady time between frames (over the
    second half of ``frames``); ``latency``: the longest frame."""
    free: dict[int, float] = {}
    ends: list[float] = []
    latency = 0.0
    for k in range(frames):
        enter = ends[k - in_flight] if k >= in_flight else 0.0
        done: dict[str, float] = {}
        for s in order:
            start = max([free.get(lane_of[s], 0.0), enter] + [done[n] for n in needs[s]])
            done[s] = free[lane_of[s]] = start + costs[s]
        ends.append(max(done.values(), default=enter))
        latency = max(latency, ends[-1] - enter)
    half = frames // 2
    return (ends[-1] - ends[half - 1]) / (frames - half), latency


def _after(order: Sequence[str], needs: Mapping[str, Iterable[str]],
           costs: Mapping[str, float]) -> dict[str, float]:
    """For each stage, its cost plus the longest chain of stages after it:
    the least time a frame still needs when the stage starts."""
    chain: dict[str, float] = {}
    for s in reversed(order):
        later = [chain[t] for t in order if s in needs[t]]
        chain[s] = costs[s] + max(later, default=0.0)
    return chain


# -- the pipeline --------------------------------------------------------------------

def _source(text: str) -> tuple[str, str | int | None]:
    name, _, key = text.partition(":")
    if not name:
        raise invalid(f"pipeline: input source {text!r} names no stage")
    if not key:
        return name, None
    return name, int(key) if key.isdigit() else key


REVIEW = 32   # frames between reviews of the placement


@dataclass
class _Plan:
    """Lanes running frames ``first`` on, up to ``stop`` (excluded) once set."""
    first: int
    lanes: tuple[tuple[str, ...], ...]
    stop: int | None = None


def _check_step(step: Step) -> None:
    if not callable(step.fn):
        raise invalid(f"pipeline: step {step.name!r}: fn {step.fn!r} is not callable")
    for k, spec in enumerate(step.outputs):
        try:
            shape, dtype = spec
            np.empty(0, dtype)
            if not all(isinstance(d, int) and d >= 0 for d in shape):
                raise ValueError
        except (TypeError, ValueError):
            raise invalid(f"pipeline: step {step.name!r} output {k} must be (shape, dtype), "
                          f"got {spec!r}") from None


class _Slot:
    """One frame's buffers: the frame, each step's output arrays, each
    stage's bound execution (its outputs are the arrays later stages read)."""

    def __init__(self):
        self.frame: dict[Any, np.ndarray] = {}
        self.steps: dict[str, list[np.ndarray]] = {}
        self.executions: dict[str, Any] = {}
        self.done: SyncFence | None = None   # the last frame in the slot delivered

    def close(self) -> None:
        for execution in self.executions.values():
            execution.close()
        self.executions.clear()


class _Frame:
    """A frame in flight: its slot, deadline, one fence per stage (signaled
    when the stage's outputs are written, ERROR when it did not run) and the
    fence of the whole frame."""

    def __init__(self, index: int, slot: _Slot, deadline: float | None, lanes: int,
                 stages: Sequence[str]):
        self.index = index
        self.slot = slot
        self.deadline = deadline
        self.submitted = time.monotonic()
        self.fences = {s: SyncFence.create() for s in stages}
        self.done = SyncFence.create()
        self.lanes_left = lanes
        self.dropped_at: str | None = None
        self.error: NnrtError | None = None
        self.result: FrameResult | None = None

    def close(self) -> None:
        for f in self.fences.values():
            f.close()


class Pipeline:
    """Stages run on every frame, frames overlapped (``rt.pipeline``)::

        async with rt.pipeline([Stage("detect", detector), ...], in_flight=2) as pipe:
            async for result in pipe.run(frames, deadline_per_frame=0.033):
                use(result.outputs)          # in frame order

    ``submit(frame)`` and ``await ticket.result()`` do the same one frame at
    a time. ``statistics()`` says what was delivered, dropped and where each
    stage runs."""

    def __init__(self, stages: Sequence[Stage | Step], *, in_flight: int = 2,
                 lanes: int | None = None, costs: Mapping[str, float] | None = None,
                 outputs: Sequence[str] | None = None, warmup: int = 3):
        self._stages = list(stages)
        if not self._stages:
            raise invalid("pipeline: no stages")
        for s in self._stages:
            if not isinstance(s, (Stage, Step)):
                raise invalid(f"pipeline: {s!r} is neither a Stage nor a Step")
        self._order = [s.name for s in self._stages]
        if len(set(self._order)) != len(self._order) or FRAME in self._order:
            raise invalid(f"pipeline: stage names must be unique and not {FRAME!r}: "
                          f"{self._order}")
        self._by_name = {s.name: s for s in self._stages}
        self._needs: dict[str, set[str]] = {}
        for k, s in enumerate(self._stages):
            if isinstance(s, Stage) and len(s.inputs) != len(s.compiled.inputs):
                raise invalid(f"pipeline: stage {s.name!r} names {len(s.inputs)} input(s), its "
                              f"model takes {len(s.compiled.inputs)}")
            if isinstance(s, Step):
                _check_step(s)
            needs = set()
            for text in s.inputs:
                name, _ = _source(text)
                if name != FRAME and name not in self._order[:k]:
                    raise invalid(f"pipeline: stage {s.name!r} reads {text!r}, which is not the "
                                  f"frame or an earlier stage")
                if name != FRAME:
                    needs.add(name)
            self._needs[s.name] = needs
        for value, label, least in ((in_flight, "in_flight", 1), (warmup, "warmup", 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise invalid(f"pipeline: {label} must be an int >= {least}, got {value!r}")
        self.in_flight = in_flight
        cores = len(os.sched_getaffinity(0))
        self._lane_count = cores if lanes is None else lanes
        if isinstance(self._lane_count, bool) or not isinstance(self._lane_count, int) \
                or self._lane_count < 1:
            raise invalid(f"pipeline: lanes must be an int >= 1, got {lanes!r}")
        consumed = {(_source(t)) for s in self._stages for t in s.inputs}
        if outputs is None:
            read = {n for n, _ in consumed}
            outputs = [f"{s.name}:{k}" for s in self._stages if s.name not in read
                       for k in range(self._output_count(s))]
        self.outputs = [self._check_output(t) for t in outputs]
        self._costs: dict[str, float] = {}
        if costs is not None:
            missing = set(self._order) - set(costs)
            if missing:
                raise invalid(f"pipeline: costs lack stage(s) {sorted(missing)}")
            self._costs = {s: float(costs[s]) for s in self._order}
        self._warmup = 0 if costs is not None else warmup
        self._lanes: tuple[tuple[str, ...], ...] | None = None
        if costs is not None:
            self._lanes = place(self._order, self._needs, self._costs, self._lane_count,
                                 self.in_flight)
        self._slots = [_Slot() for _ in range(in_flight)]
        self._bound = False
        self._frames: dict[int, _Frame] = {}
        self._submitted = 0
        self._delivered = 0
        self._dropped = {s: 0 for s in self._order}
        self._cond = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._token = None
        self._warm_seen: dict[str, float] = {}
        self._plans: list[_Plan] = []
        self._next_review = REVIEW
        self._replaced = 0
        self._submitting = None
        self._recent: dict[str, collections.deque] = {
            s: collections.deque(maxlen=16) for s in self._order}

    @staticmethod
    def _output_count(s: Stage | Step) -> int:
        return len(s.compiled.outputs) if isinstance(s, Stage) else len(s.outputs)

    def _check_output(self, text: str) -> str:
        name, key = _source(text)
        if name not in self._by_name:
            raise invalid(f"pipeline: output {text!r} names no stage")
        self._output_index(name, key)
        return text

    def _output_index(self, name: str, key) -> int:
        s = self._by_name[name]
        if key is None:
            return 0
        if isinstance(key, str):
            names = [o.name for o in s.compiled.outputs] if isinstance(s, Stage) else []
            if key not in names:
                raise invalid(f"pipeline: stage {name!r} has no output named {key!r} "
                              f"(outputs: {names})")
            return names.index(key)
        if key >= self._output_count(s):
            raise invalid(f"pipeline: stage {name!r} has no output {key}")
        return key

    # -- binding a slot ---------------------------------------------------------

    def _array(self, slot: _Slot, text: str) -> np.ndarray:
        name, key = _source(text)
        if name == FRAME:
            if key not in slot.frame:
                raise invalid(f"pipeline: the frame has no {text!r} "
                              f"({'a dict' if None not in slot.frame else 'an array'} was given)")
            return slot.frame[key]
        k = self._output_index(name, key)
        if name in slot.steps:
            return slot.steps[name][k]
        outputs = slot.executions[name].outputs
        if outputs is None:
            raise invalid(f"pipeline: stage {name!r} has outputs of unknown shapes; a later "
                          f"stage cannot be bound to them")
        return outputs[k]

    def _bind(self, frame) -> None:
        """Make every slot's buffers and executions, from the first frame;
        nothing is kept when one cannot be bound (the frame is refused)."""
        try:
            self._bind_slots(frame)
        except BaseException:
            for slot in self._slots:
                slot.close()
                slot.frame, slot.steps = {}, {}
            raise
        self._bound = True

    def _bind_slots(self, frame) -> None:
        for slot in self._slots:
            slot.frame = {k: np.empty_like(np.ascontiguousarray(v)) for k, v in frame.items()}
            for s in self._stages:
                if isinstance(s, Step):
                    slot.steps[s.name] = [np.empty(shape, dtype) for shape, dtype in s.outputs]
                    continue
                ins = [self._array(slot, t) for t in s.inputs]
                try:
                    execution = s.compiled.create_execution(ins)
                except NnrtError as e:
                    raise NnrtError(e.status, f"pipeline: stage {s.name!r}: {e.message}") from e
                slot.executions[s.name] = execution
                for k, (given, bound) in enumerate(zip(ins, execution.inputs)):
                    if bound is not given:    # converted: it would not see later frames
                        model = s.compiled.inputs[k]
                        raise invalid(f"pipeline: stage {s.name!r} input {k} ({model.name}) "
                                      f"takes {model.dtype} {tuple(model.shape)}, its source "
                                      f"{s.inputs[k]!r} is {given.dtype} {given.shape}")

    # -- submitting and delivering ---------------------------------------------

    @staticmethod
    def _frame_dict(frame) -> dict:
        if isinstance(frame, Mapping):
            return {str(k): np.asarray(v) for k, v in frame.items()}
        return {None: np.asarray(frame)}

    async def submit(self, frame, *, deadline: float | None = None) -> "Ticket":
        """Start ``frame`` (an array, or a dict of arrays for ``"frame:KEY"``
        sources) through the pipeline, once its slot is free (at most
        ``in_flight`` frames are in flight: this waits for the oldest).
        ``deadline``: absolute ``time.monotonic()`` time for the whole frame.
        A frame of another shape or dtype than the first is INVALID_ARGUMENT
        and changes nothing."""
        values, deadline = self._check_frame(frame, deadline)
        # One submission at a time: frame numbers have no gaps (a lane waits
        # for each in turn), even when a submitting task is cancelled.
        async with self._submitting:
            slot = self._next_slot(values)
            if slot.done is not None:      # the slot's last frame must be delivered first
                await slot.done.wait_signaled()
            return self._enter(slot, values, deadline)

    def submit_nowait(self, frame, *, deadline: float | None = None) -> "Ticket":
        """:meth:`submit`, or ``anyio.WouldBlock`` when ``in_flight`` frames
        are in the pipeline: what a live camera calls, dropping the frame
        then rather than falling behind."""
        values, deadline = self._check_frame(frame, deadline)
        if self._submitting.locked():
            raise anyio.WouldBlock
        slot = self._next_slot(values)
        if slot.done is not None and slot.done.poll() is FenceState.ACTIVE:
            raise anyio.WouldBlock
        return self._enter(slot, values, deadline)

    def _check_frame(self, frame, deadline):
        if self._closed:
            raise bad_state("the pipeline is closed")
        if deadline is not None:
            deadline = check_deadline(deadline)
        if self._token is None:
            self._token = anyio.lowlevel.current_token()
            self._submitting = anyio.Lock()
        return self._frame_dict(frame), deadline

    def _next_slot(self, values: dict) -> _Slot:
        """The next frame's slot, the buffers bound at the first frame; the
        frame checked against them."""
        if not self._bound:
            self._bind(values)
        index = self._submitted
        slot = self._slots[index % self.in_flight]
        if set(values) != set(slot.frame):
            raise invalid(f"pipeline: frame {index} has keys {sorted(map(str, values))}, the "
                          f"first had {sorted(map(str, slot.frame))}")
        for key, v in values.items():
            b = slot.frame[key]
            if v.shape != b.shape or v.dtype != b.dtype:
                raise invalid(f"pipeline: frame {index}{'' if key is None else f' {key!r}'} is "
                              f"{v.dtype} {v.shape}, the first was {b.dtype} {b.shape}")
        return slot

    def _enter(self, slot: _Slot, values: dict, deadline: float | None) -> "Ticket":
        """The frame into its free slot, and to the lanes."""
        if self._closed:
            raise bad_state("the pipeline is closed")
        if slot.done is not None:
            slot.done.close()
        index = self._submitted
        for key, v in values.items():
            np.copyto(slot.frame[key], v)
        job = _Frame(index, slot, deadline, 0, self._order)
        slot.done = job.done.dup()
        ticket = Ticket(self, job)        # its handle on the fence, before a lane can close it
        self._submitted += 1
        with self._cond:
            self._frames[index] = job
            if index == 0:
                if self._warmup:       # the warm lane: every stage, one after the other
                    self._start(_Plan(0, (tuple(self._order),), stop=self._warmup))
                else:                  # costs given: placed already
                    self._start(_Plan(0, self._lanes))
            plan = self._plan_of(index)
            # None: a frame after the warm ones, before they are in (_finish sets it)
            job.lanes_left = 0 if plan is None else len(plan.lanes)
            self._cond.notify_all()
        return ticket

    def _plan_of(self, index: int) -> "_Plan | None":
        for plan in reversed(self._plans):
            if plan.first <= index and (plan.stop is None or index < plan.stop):
                return plan
        return None

    def _plan_and_start(self) -> None:
        """Place the stages from the warm frames' costs and start the lanes
        (holding ``_cond``), from frame ``warmup`` on."""
        self._lanes = place(self._order, self._needs, self._costs, self._lane_count,
                            self.in_flight)
        for index, job in self._frames.items():
            if index >= self._warmup:
                job.lanes_left = len(self._lanes)
        self._start(_Plan(self._warmup, self._lanes))

    def _review(self, done: int) -> None:
        """Every ``REVIEW`` frames (holding ``_cond``): place the stages again
        from the costs measured since; when that shortens the simulated
        period by a tenth or more, the lanes change hands at the next frame
        not yet submitted (the old lanes finish the frames before it)."""
        if self._lanes is None or done < self._next_review:
            return
        self._next_review = done + REVIEW
        better = review(self._order, self._needs, self._costs, self._lanes, self._lane_count,
                        self.in_flight)
        if better is None:
            return
        switch = max([*self._frames, done]) + 1
        self._plans[-1].stop = switch
        self._lanes = better
        self._replaced += 1
        self._start(_Plan(switch, better))
        self._cond.notify_all()

    def _start(self, plan: "_Plan") -> None:
        self._plans.append(plan)
        for stages in plan.lanes:
            t = threading.Thread(target=self._lane, args=(stages, plan),
                                 name=f"nnrt-pipeline-lane-{len(self._threads)}", daemon=True)
            self._threads.append(t)
            t.start()

    async def run(self, frames: Iterable | AsyncIterable, *,
                  deadline_per_frame: float | None = None):
        """Submit every frame of ``frames`` (deadline: ``deadline_per_frame``
        seconds after its submission), keeping ``in_flight`` of them in the
        pipeline, and yield each :class:`FrameResult` in frame order. A
        result is yielded when the pipeline needs its slot for the next
        frame, or once ``frames`` ran out: for frames that come with time (a
        live camera), submit them from a task of their own and await the
        tickets in order (docs/guide/pipelines.md#a-live-camera)."""
        if deadline_per_frame is not None and (
                isinstance(deadline_per_frame, bool)
                or not isinstance(deadline_per_frame, (int, float))
                or not deadline_per_frame > 0):
            raise invalid(f"deadline_per_frame must be seconds > 0, got {deadline_per_frame!r}")
        pending: list[Ticket] = []

        async def frames_of():
            if isinstance(frames, AsyncIterable):
                async for f in frames:
                    yield f
            else:
                for f in frames:
                    yield f

        async for frame in frames_of():
            if len(pending) == self.in_flight:
                yield await pending.pop(0).result()
            deadline = None if deadline_per_frame is None else \
                time.monotonic() + deadline_per_frame
            pending.append(await self.submit(frame, deadline=deadline))
        while pending:
            yield await pending.pop(0).result()

    # -- the lanes (threads) ------------------------------------------------------

    def _lane(self, stages: tuple[str, ...], plan: "_Plan") -> None:
        """Run ``stages`` of frames ``plan.first``, ``plan.first + 1``, ...
        in order, up to ``plan.stop`` (excluded) once it is set."""
        index = plan.first
        while True:
            with self._cond:
                # A submitted frame is run to its end even when closing: a
                # lane on it may wait for this lane's fences.
                while index not in self._frames:
                    if self._closed or (plan.stop is not None and index >= plan.stop):
                        return
                    self._cond.wait()
                if plan.stop is not None and index >= plan.stop:
                    return
                job = self._frames[index]
            for name in stages:
                self._run_stage(job, name)
            self._finish(job)
            index += 1

    def _run_stage(self, job: _Frame, name: str) -> None:
        fence = job.fences[name]
        try:
            if job.dropped_at is not None or job.error is not None:
                raise _Skip
            for need in self._needs[name]:
                mine = job.fences[need].dup()
                try:
                    mine.wait_signaled_blocking()
                except NnrtError:
                    raise _Skip
                finally:
                    mine.close()
            if job.deadline is not None and self._costs:
                need = _after(self._order, self._needs, self._costs)[name]
                if time.monotonic() + need > job.deadline:
                    self._drop(job, name)
                    raise _Skip
            began = time.perf_counter()
            self._compute(job, name)
            self._measured(name, time.perf_counter() - began, job.index)
        except _Skip:
            fence.signal_error(ErrorStatus.MISSED_DEADLINE_TRANSIENT
                               if job.error is None else job.error.status)
            return
        except Exception as e:      # noqa: BLE001 -- a lane must settle every fence it owns
            if not isinstance(e, NnrtError):
                e = NnrtError(ErrorStatus.GENERAL_FAILURE,
                              f"internal error: {type(e).__name__}: {e}")
            if e.status in _DROPS:
                self._drop(job, name)
            elif job.error is None:
                job.error = NnrtError(e.status, f"pipeline stage {name!r}: {e.message}")
            fence.signal_error(e.status)
            return
        fence.signal()

    def _compute(self, job: _Frame, name: str) -> None:
        s = self._by_name[name]
        slot = job.slot
        if isinstance(s, Step):
            try:
                got = s.fn(*(self._array(slot, t) for t in s.inputs))
            except NnrtError:
                raise
            except Exception as e:
                raise NnrtError(ErrorStatus.GENERAL_FAILURE,
                                f"step raised {type(e).__name__}: {e}") from e
            got = (got,) if isinstance(got, np.ndarray) else tuple(got)
            outs = slot.steps[name]
            if len(got) != len(outs):
                raise invalid(f"step returned {len(got)} array(s), it declares {len(outs)}")
            for k, (dst, value) in enumerate(zip(outs, got)):
                value = np.asarray(value)
                if value.shape != dst.shape or not np.can_cast(value.dtype, dst.dtype,
                                                               "same_kind"):
                    raise invalid(f"step output {k} is {value.dtype} {value.shape}, it declares "
                                  f"{dst.dtype} {dst.shape}")
                np.copyto(dst, value, casting="same_kind")
            return
        execution = slot.executions[name]
        if execution.compute_synchronously(job.deadline) is None:
            # Not bound, or a driver failure to recover from: the runtime's loop.
            anyio.from_thread.run(execution.recover, job.deadline, token=self._token)

    def _measured(self, name: str, seconds: float, index: int) -> None:
        with self._cond:
            if index < self._warmup:
                seen = self._warm_seen.get(name)
                self._warm_seen[name] = seconds if seen is None else min(seen, seconds)
                return
            recent = self._recent[name]
            recent.append(seconds)
            self._costs[name] = min(recent)

    def _drop(self, job: _Frame, name: str) -> None:
        with self._cond:
            if job.dropped_at is None:
                job.dropped_at = name
                self._dropped[name] += 1

    def _finish(self, job: _Frame) -> None:
        with self._cond:
            job.lanes_left -= 1
            if job.lanes_left:
                return
            del self._frames[job.index]
            if job.index == self._warmup - 1 and self._lanes is None:
                self._costs = dict(self._warm_seen)
                missing = [s for s in self._order if s not in self._costs]
                for s in missing:     # a stage every warm frame skipped: no estimate
                    self._costs[s] = 0.0
                for s, seconds in self._warm_seen.items():
                    self._recent[s].append(seconds)
                self._plan_and_start()
                self._next_review = job.index + REVIEW
            self._review(job.index)
        outputs = {}
        if job.dropped_at is None and job.error is None:
            for text in self.outputs:
                outputs[text] = self._array(job.slot, text).copy()
        job.result = FrameResult(job.index, outputs, job.dropped_at,
                                 time.monotonic() - job.submitted)
        job.close()
        job.done.signal()
        job.done.close()

    # -- the rest --------------------------------------------------------------------

    def statistics(self) -> PipelineStatistics:
        with self._cond:
            return PipelineStatistics(self._delivered, dict(self._dropped),
                                      dict(self._costs), self._lanes, self._replaced)

    def close(self) -> None:
        """Stop the lanes once the frames submitted have run (their results
        stay unread) and let go of the executions. Idempotent. From async
        code use ``async with`` or :meth:`aclose` (a stage recovering from a
        driver failure needs the event loop meanwhile)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        for t in self._threads:
            t.join()
        for slot in self._slots:
            slot.close()
            if slot.done is not None:
                slot.done.close()
                slot.done = None

    async def aclose(self) -> None:
        """:meth:`close`, waiting for the lanes' current stages off the loop."""
        await anyio.to_thread.run_sync(self.close)

    async def __aenter__(self) -> "Pipeline":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        lanes = "placed when warm" if self._lanes is None else \
            " | ".join(" -> ".join(lane) for lane in self._lanes)
        return (f"<Pipeline {' -> '.join(self._order)}; in_flight={self.in_flight}; "
                f"lanes: {lanes}{'; closed' if self._closed else ''}>")


class _Skip(Exception):
    """The stage does not run: the frame was dropped or failed earlier."""


class Ticket:
    """A submitted frame: ``await ticket.result()`` gives its
    :class:`FrameResult` (NnrtError naming the stage if one failed)."""

    def __init__(self, pipeline: Pipeline, job: _Frame):
        self._pipeline = pipeline
        self._job = job
        self._done = job.done.dup()
        self.index = job.index

    async def result(self) -> FrameResult:
        if self._done is not None:
            try:
                await self._done.wait_signaled()
            finally:
                self._done.close()
                self._done = None
            with self._pipeline._cond:
                self._pipeline._delivered += 1
        if self._job.error is not None:
            raise self._job.error
        return self._job.result
