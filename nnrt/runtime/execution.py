"""Reusable executions (NNAPI feature level 5's
``ANeuralNetworksExecution_setReusable``): a compiled model's inputs and
outputs bound once, computed again and again.

``compiled.create_execution(inputs, outputs)`` checks the inputs and
outputs as ``execute`` would, once, and asks the step's driver to bind the
request (:meth:`nnrt.hal.PreparedModel.create_execution`): the driver
validates it and ties its inputs and outputs to the arrays' memory then, not
at every computation. New input values are writes into ``execution.inputs``;
each computation writes ``execution.outputs`` in place. This is the
declared fast path: nothing is recognised by identity.

A compilation the driver can bind for is one step that is the whole model,
not stateful, with no device memory among the values, whose outputs are
given or of known shapes. Any other (a model split across devices, dynamic
output shapes) computes through the general path of ``execute`` on the same
bound arrays, with the same results: only slower. A stateful model's state
is its compiled model's (its state inputs change at every computation, so
nothing binds them): its executions bind the app's inputs and outputs and
compute through ``execute``'s path, which carries the state, shared with
``execute`` and bursts.

A driver failure falls back to the CPU as ``execute`` does; the execution
binds again on the CPU step and carries on there.
"""
from __future__ import annotations

import weakref
from typing import Any, Sequence

import numpy as np

from .. import handoff
from ..errors import STATUS_NONE as _NONE, NnrtError, bad_state, invalid
from ..hal import UINT64_MAX, Execution as HalExecution, ExecutionResult
from ..hal.types import check_deadline, check_loop_timeout
from . import request
from .memory_domain import DeviceMemory
from .results import ExecutionTiming, Result
from .step import DriverFailure, build_request, release_all, shaped


class Execution:
    """A compiled model's request, bound once (``compiled.create_execution``)::

        execution = compiled.create_execution([frame])
        for _ in frames:
            camera.read_into(execution.inputs[0])
            result = await execution.compute()   # result.outputs: execution.outputs

    One computation at a time; with ``reusable=False`` only one at all.
    ``close()`` (or ``with``) lets go of the binding; closing the compiled
    model ends its executions too."""

    def __init__(self, compiled, inputs: Sequence[Any] | dict | None, outputs,
                 measure_timing: bool, loop_timeout: float | None, reusable: bool):
        self._compiled = compiled
        self._reusable = request.flag(reusable, "reusable")
        self._measure = request.flag(measure_timing, "measure_timing")
        self._loop_timeout = check_loop_timeout(loop_timeout)
        compiled._check_open()
        sig = compiled._signature
        self._stateful = sig.stateful
        if inputs is None:
            inputs = [self._zeros(k) for k in range(len(compiled.inputs))]
        self._given_outputs = outputs is not None
        inputs, outputs = compiled._order(inputs, outputs)
        self._inputs, given, _, _ = compiled._check_request(inputs, outputs, self._measure, None)
        if self._stateful:   # the app's own: the state is carried by each computation
            self._inputs = sig.app_values("input", self._inputs)
            given = sig.app_values("output", given) if self._given_outputs else None
        self._outputs = given
        self._computed = 0
        self._computing = False
        self._closed = False
        self._steps = None
        self._hal: HalExecution | None = None
        # (a burst's HAL session, the bound request bound to it): see compute_in.
        self._in_burst: tuple | None = None
        self._shapes: list | None = None
        # What a collected execution releases (on a worker thread: the
        # collector may run with a service channel's send lock held, which a
        # release takes), as the compiled model does with its prepared models.
        self._held: list = []
        self._finalizer = weakref.finalize(self, handoff.run_soon, release_all, self._held)
        self._finalizer.atexit = False
        self._bind()

    def _zeros(self, k: int) -> np.ndarray:
        info = self._compiled.inputs[k]
        if info.shape is None or any(d is None or d == 0 for d in info.shape):
            raise invalid(f"input {k} ({info.name}) has unknown dimensions "
                          f"{info.shape}: give the inputs to bind")
        return np.zeros(info.shape, info.dtype)

    def _bind(self) -> None:
        """Bind the compiled model's current steps: the step's driver
        execution when one can be bound, else the general path."""
        compiled = self._compiled
        steps = self._steps = compiled._steps
        self._unbind()
        values = (*self._inputs, *(self._outputs or ()))
        if steps is not compiled._whole_steps or self._stateful \
                or any(isinstance(v, DeviceMemory) for v in values):
            return
        step = steps[0]
        if self._outputs is None:
            if not step.sized():
                return     # shapes known only once it ran: the general path allocates
            self._outputs = [np.empty(dims, o.type.dtype) if o.type.is_tensor
                             else np.empty((), o.type.dtype)
                             for dims, o in zip(step.output_guess, step.outputs)]
        self._hal = step.prepared.create_execution(
            build_request(self._inputs, step.inputs, self._outputs), self._measure,
            self._loop_timeout)
        self._held.append(self._hal)

    def _unbind(self) -> None:
        self._hal = self._in_burst = None
        release_all(self._held)

    @property
    def inputs(self) -> list:
        """The values the execution reads, in the app's input order: write
        new input data into these arrays (or the regions' memories)."""
        return list(self._inputs)

    @property
    def outputs(self) -> list | None:
        """The arrays each computation writes (None before the first of a
        model whose output shapes are known only once it ran)."""
        return None if self._outputs is None else list(self._outputs)

    @property
    def bound(self) -> bool:
        """Whether a driver bound the request (the fast path), rather than
        each computation taking the general path of ``execute``."""
        return self._hal is not None

    def _begin(self) -> None:
        if self._closed:
            raise bad_state("the execution is closed")
        if self._computing:
            raise bad_state("the execution is computing already: one computation at a time "
                            "(create another execution to run concurrently)")
        if self._computed and not self._reusable:
            raise bad_state("the execution was not made reusable: it computes once")
        compiled = self._compiled
        compiled._check_open()
        compiled._watch_for_return()
        if compiled._steps is not self._steps:
            self._bind()     # the compiled model moved (off a device, or back) meanwhile

    async def compute(self, *, deadline: float | None = None) -> Result:
        """Run the model on the bound inputs, into the bound outputs
        (``ANeuralNetworksExecution_compute``, awaited). ``deadline`` as for
        ``execute``."""
        return await self.compute_in(None, deadline)

    async def compute_in(self, sessions: dict | None, deadline: float | None) -> Result:
        """:meth:`compute`, through a burst's HAL sessions (by step) when
        given: what ``Burst.compute`` does. The bound request is bound to the
        step's session once (for a driver service: a layout of the burst's
        ring, bound in the service too), again only for another session."""
        self._begin()
        self._computing = True
        try:
            if deadline is not None:
                deadline = check_deadline(deadline)
            if self._hal is None:
                return await self._general(deadline, sessions)
            outcome = await self._runner(sessions).execute(deadline)
            try:
                return self._result(outcome, deadline)
            except _Recover as recover:
                return await self._recover(recover, deadline)
        finally:
            self._computing = False

    def _runner(self, sessions: dict | None):
        """What computes the bound request: its HAL execution, or its binding
        to the burst session of its step (a step the burst has no session
        for, after a move to the CPU: the HAL execution)."""
        session = None if sessions is None else sessions.get(id(self._steps[0]))
        if session is None:
            return self._hal
        in_burst = self._in_burst
        if in_burst is None or in_burst[0] is not session:
            if in_burst is not None:
                self._held.remove(in_burst[1])
                in_burst[1].release()
            self._in_burst = None
            in_burst = self._in_burst = (session, session.create_execution(
                self._hal.request, self._measure, self._loop_timeout))
            self._held.append(in_burst[1])
        return in_burst[1]

    def compute_synchronously(self, deadline: float | None = None) -> Result | None:
        """:meth:`compute` on the calling thread, with no event loop, when
        the execution is bound; None when it must run on the runtime's loop
        instead (not bound, or a driver failure to recover from): the
        caller then awaits :meth:`recover` there. What ``SyncRuntime``'s
        executions do."""
        self._begin()
        if self._hal is None:
            return None
        self._computing = True
        try:
            if deadline is not None:
                deadline = check_deadline(deadline)
            outcome = self._hal.execute_synchronously(deadline)
            try:
                return self._result(outcome, deadline)
            except _Recover as recover:
                self._pending = recover
                return None
        finally:
            self._computing = False

    async def _general(self, deadline, sessions: dict | None = None) -> Result:
        compiled = self._compiled
        if self._stateful:
            result = await compiled._execute_through(
                sessions, list(self._inputs), self._outputs if self._given_outputs else None,
                self._measure, deadline, self._loop_timeout)
        else:
            result = await compiled._execute(self._inputs, self._outputs, self._measure,
                                             deadline, self._loop_timeout, sessions)
        self._computed += 1
        if self._outputs is None or not self._given_outputs:
            self._outputs = list(result.outputs)
        return result

    def _result(self, outcome: ExecutionResult, deadline: float | None) -> Result:
        """The app's result of a computation of the bound execution; raises
        the error of a failed one (``_Recover`` when the model may move to
        the CPU), or of one whose result came after ``deadline``."""
        compiled = self._compiled
        if outcome.status != _NONE:
            try:
                compiled._step_failed(self._steps[0], outcome)
            except DriverFailure as failure:
                raise _Recover(failure) from None
            except BaseException:
                compiled._failures += 1
                raise
        if deadline is not None:
            try:
                request.check_on_time(deadline)
            except NnrtError:
                compiled._failures += 1
                raise
        reported = outcome.output_shapes
        step = self._steps[0]
        outputs = self._outputs
        if self._shapes is None or len(reported) != len(self._shapes) or any(
                s.dimensions != t for s, t in zip(reported, self._shapes)):
            self._shapes = [tuple(s.dimensions) for s in reported]
        shapes = self._shapes
        # Outputs may be memory regions (no .shape): ``shaped`` views them.
        values = [out if out.__class__ is np.ndarray and out.shape == shape
                  else shaped(out, shape, o) for out, shape, o in zip(outputs, shapes,
                                                                      step.outputs)]
        timing = None
        if self._measure:
            t = outcome.timing
            measured = t.on_device != UINT64_MAX and t.in_driver != UINT64_MAX
            timing = ExecutionTiming(t.on_device if measured else None,
                                     t.in_driver if measured else None)
        self._computed += 1
        compiled._executions += 1
        return Result(values, list(shapes), timing)

    async def _recover(self, recover: "_Recover", deadline) -> Result:
        """Move the compiled model to the CPU after its driver failed, bind
        there and compute again."""
        try:
            await self._compiled._move_off(recover.failure)
            self._bind()
            if self._hal is None:
                return await self._general(deadline)
            return self._result(await self._hal.execute(deadline), deadline)
        except _Recover as again:   # the CPU failed too: report it
            self._compiled._failures += 1
            raise again.failure.error from None
        except BaseException:
            self._compiled._failures += 1
            raise

    async def recover(self, deadline: float | None = None) -> Result:
        """After :meth:`compute_synchronously` returned None for a driver
        failure: move to the CPU and compute there; otherwise
        :meth:`compute`."""
        pending, self._pending = self._pending, None
        if pending is None:
            return await self.compute(deadline=deadline)
        self._computing = True
        try:
            return await self._recover(pending, deadline)
        finally:
            self._computing = False

    _pending: "_Recover | None" = None

    def close(self) -> None:
        """Let go of the binding (also done when the execution is garbage
        collected). Computing afterwards raises BAD_STATE. Idempotent."""
        self._closed = True
        self._finalizer.detach()
        self._unbind()

    def __enter__(self) -> "Execution":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    async def __aenter__(self) -> "Execution":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        if self._closed:
            state = "closed"
        else:
            state = "bound" if self._hal is not None else "general path"
            if not self._reusable:
                state += ", one-shot"
        return (f"<nnrt.Execution {state}, computed {self._computed} time(s), of "
                f"{self._compiled!r}>")


class _Recover(Exception):
    """A bound computation's driver failed: the model may move to the CPU."""

    def __init__(self, failure):
        super().__init__(str(failure))
        self.failure = failure


__all__ = ["Execution"]
