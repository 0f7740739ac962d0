"""VTS-style tests of a driver through the HAL (``nnrt.hal.Device``), in the
manner of Android's ``VtsHalNeuralnetworksV1_3TargetTest``: every call with
valid and invalid arguments gets the right ``ErrorStatus``, and after every
refused call the driver still serves a valid execution with correct results.

The device under test is whatever the runtime holds under that name: an
in-process driver behind its QoS front, or a driver service's proxy (then
every argument crosses the socket and the service's own validation answers).

    checks = vts.CHECKS                    # name -> coroutine function(Target)
    outcomes = await vts.run_checks(device)

Each check gives one :class:`VtsOutcome`: passed, failed (what broke the
contract), or skipped with the reason (the device supports no model the
check needs). Nothing is counted passed without having run.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

import anyio
import numpy as np

import nnrt
from nnrt.errors import ErrorStatus, NnrtError
from nnrt.fence import SyncFence
from nnrt.hal import (UINT64_MAX, Capabilities, Device, DeviceType, ExecutionPreference,
                      ExecutionResult, Priority, Request, RequestArgument)
from nnrt.model.graph import DataLocation, HalModel
from nnrt.model.types import HalVersion, OperandType as T, OperationType as Op
from nnrt.testing.random_graph import execute_in_one_memory

MISSED_DEADLINE = {ErrorStatus.MISSED_DEADLINE_TRANSIENT, ErrorStatus.MISSED_DEADLINE_PERSISTENT}


@dataclass
class VtsOutcome:
    name: str
    status: str        # "passed" | "failed" | "skipped"
    detail: str = ""


class VtsFailure(Exception):
    """The device broke the HAL contract."""


class VtsSkip(Exception):
    """The check cannot run on this device (the reason says why)."""


# --- models the checks use ---------------------------------------------------------

@dataclass
class Probe:
    """A small model with inputs and expected outputs."""

    name: str
    model: nnrt.Model
    inputs: list
    expected: list


def _add_model(type: T, **quant) -> Probe:
    m = nnrt.Model()
    a = m.add_operand(type, [1, 4], **quant)
    b = m.add_operand(type, [1, 4], **quant)
    act = m.add_operand(T.INT32)
    m.set_operand_value(act, 0)
    out = m.add_operand(type, [1, 4], **quant)
    m.add_operation(Op.ADD, [a, b, act], [out])
    m.identify_inputs_and_outputs([a, b], [out])
    m.finish()
    x = np.array([[1, 2, 3, 4]], dtype=type.dtype)
    y = np.array([[10, 20, 30, 40]], dtype=type.dtype)
    if type == T.TENSOR_QUANT8_ASYMM:  # scale 0.5, zero point 0 on every operand: q + q
        return Probe("add_quant8", m, [x, y], [x + y])
    return Probe(f"add_{type.name.lower()}", m, [x, y], [x + y])


def probes() -> list[Probe]:
    return [_add_model(T.TENSOR_FLOAT32), _add_model(T.TENSOR_FLOAT16),
            _add_model(T.TENSOR_QUANT8_ASYMM, scale=0.5, zero_point=0),
            _add_model(T.TENSOR_INT32)]


def infinite_loop_model() -> Probe:
    """WHILE(true) { x = x + 1 }: only a loop timeout or a deadline ends it."""
    cond = nnrt.Model()
    x = cond.add_operand(T.TENSOR_FLOAT32, [1])
    zero = cond.add_operand(T.TENSOR_FLOAT32, [1])
    cond.set_operand_value(zero, np.zeros(1, np.float32))
    out = cond.add_operand(T.TENSOR_BOOL8, [1])
    cond.add_operation(Op.GREATER_EQUAL, [x, zero], [out])
    cond.identify_inputs_and_outputs([x], [out])
    cond.finish()
    body = nnrt.Model()
    x = body.add_operand(T.TENSOR_FLOAT32, [1])
    one = body.add_operand(T.TENSOR_FLOAT32, [1])
    body.set_operand_value(one, np.ones(1, np.float32))
    act = body.add_operand(T.INT32)
    body.set_operand_value(act, 0)
    out = body.add_operand(T.TENSOR_FLOAT32, [1])
    body.add_operation(Op.ADD, [x, one, act], [out])
    body.identify_inputs_and_outputs([x], [out])
    body.finish()
    m = nnrt.Model()
    c = m.add_operand(T.SUBGRAPH)
    m.set_operand_value_from_model(c, cond)
    b = m.add_operand(T.SUBGRAPH)
    m.set_operand_value_from_model(b, body)
    x = m.add_operand(T.TENSOR_FLOAT32, [1])
    out = m.add_operand(T.TENSOR_FLOAT32, [1])
    m.add_operation(Op.WHILE, [c, b, x], [out])
    m.identify_inputs_and_outputs([x], [out])
    m.finish()
    return Probe("while_infinite", m, [np.zeros(1, np.float32)], [])


# --- requests --------------------------------------------------------------------

class Staged:
    """A request for a probe: inputs and outputs in one shared Memory."""

    def __init__(self, probe: Probe, extra_output_bytes: int = 0):
        self.probe = probe
        sizes = [np.asarray(v).nbytes for v in probe.inputs] + \
            [np.asarray(e).nbytes + extra_output_bytes for e in probe.expected]
        self.offsets, offset = [], 0
        for s in sizes:
            self.offsets.append(offset)
            offset += (s + 63) // 64 * 64
        self.sizes = sizes
        self.memory = nnrt.Memory.create(max(64, offset))
        for k, v in enumerate(probe.inputs):
            v = np.ascontiguousarray(v)
            self.memory.view()[self.offsets[k]:self.offsets[k] + v.nbytes] = \
                v.reshape(-1).view(np.uint8)
        n = len(probe.inputs)
        self.inputs = tuple(RequestArgument(False, DataLocation(0, self.offsets[k], sizes[k]),
                                            tuple(np.shape(v)))
                            for k, v in enumerate(probe.inputs))
        self.outputs = tuple(RequestArgument(False, DataLocation(0, self.offsets[n + k],
                                                                 sizes[n + k]))
                             for k in range(len(probe.expected)))

    def request(self, **changes) -> Request:
        r = Request(self.inputs, self.outputs, (self.memory,))
        return dataclasses.replace(r, **changes) if changes else r

    def outputs_now(self, shapes) -> list[np.ndarray]:
        n = len(self.probe.inputs)
        return [np.array(self.memory.array(np.asarray(e).dtype, s.dimensions, self.offsets[n + k]))
                for k, (e, s) in enumerate(zip(self.probe.expected, shapes))]

    def close(self) -> None:
        self.memory.close()


def check_result(staged: Staged, result: ExecutionResult, what: str) -> None:
    if result.status != ErrorStatus.NONE:
        raise VtsFailure(f"{what}: status {result.status.name} ({result.message})")
    if len(result.output_shapes) != len(staged.probe.expected):
        raise VtsFailure(f"{what}: {len(result.output_shapes)} output shapes for "
                         f"{len(staged.probe.expected)} outputs")
    for k, (got, want, shape) in enumerate(zip(staged.outputs_now(result.output_shapes),
                                               staged.probe.expected, result.output_shapes)):
        if tuple(shape.dimensions) != np.shape(want) or not shape.is_sufficient:
            raise VtsFailure(f"{what}: output {k} shape {shape}, expected {list(np.shape(want))}")
        if not np.allclose(got.astype(np.float64), np.asarray(want, np.float64),
                           atol=1e-3, rtol=1e-3):
            raise VtsFailure(f"{what}: output {k} is {got.tolist()}, expected "
                             f"{np.asarray(want).tolist()}")


def _status_of(outcome) -> ErrorStatus:
    return outcome.status if isinstance(outcome, (ExecutionResult, NnrtError)) else \
        ErrorStatus.NONE


async def expect(what: str, call: Callable[[], Awaitable], statuses) -> object:
    """Await ``call()``; its status (raised or returned) must be in ``statuses``."""
    statuses = {statuses} if isinstance(statuses, ErrorStatus) else set(statuses)
    try:
        outcome = await call()
    except NnrtError as e:
        outcome = e
    except Exception as e:  # anything but an ErrorStatus is a contract break
        raise VtsFailure(f"{what}: raised {type(e).__name__}: {e} instead of an "
                         f"ErrorStatus ({' or '.join(sorted(s.name for s in statuses))})") from e
    status = _status_of(outcome)
    if status not in statuses:
        message = getattr(outcome, "message", "") or ""
        raise VtsFailure(f"{what}: got {status.name}{f' ({message})' if message else ''}, "
                         f"expected {' or '.join(sorted(s.name for s in statuses))}")
    return outcome


# --- the target ------------------------------------------------------------------------

class Target:
    """The device under test and what the checks share: its first fully
    supported probe, prepared once."""

    def __init__(self, device: Device):
        self.device = device
        self.probe: Probe | None = None
        self.prepared = None

    async def setup(self) -> None:
        for probe in probes():
            flags = await self.device.supported_operations(probe.model.hal_model)
            if all(flags):
                self.probe = probe
                self.prepared = await self.device.prepare_model(
                    probe.model.hal_model, ExecutionPreference.FAST_SINGLE_ANSWER,
                    Priority.MEDIUM)
                return

    def need_probe(self) -> Probe:
        if self.probe is None:
            raise VtsSkip("the device supports none of the probe models (ADD of float32, "
                          "float16, quant8 or int32)")
        return self.probe

    async def execute(self, request: Request, **kw) -> ExecutionResult:
        return await self.prepared.execute(request, **kw)

    async def still_serves(self, after: str) -> None:
        """A valid execution right after a refused call gives correct results."""
        staged = Staged(self.need_probe())
        try:
            check_result(staged, await self.prepared.execute(staged.request()),
                         f"a valid execution after {after}")
        finally:
            staged.close()

    def close(self) -> None:
        if self.prepared is not None:
            self.prepared.release()


# --- checks ---------------------------------------------------------------------------

CHECKS: dict[str, Callable[[Target], Awaitable[None]]] = {}


def check(name: str):
    def register(fn):
        CHECKS[name] = fn
        return fn
    return register


@check("device.queries")
async def _queries(t: Target) -> None:
    d = t.device
    if not isinstance(d.name, str) or not d.name:
        raise VtsFailure(f"name {d.name!r} is not a non-empty string")
    if not isinstance(d.type, DeviceType) and d.type not in set(DeviceType):
        raise VtsFailure(f"type {d.type!r} is not a DeviceType")
    if not isinstance(d.version_string, str) or not d.version_string:
        raise VtsFailure(f"version_string {d.version_string!r} is empty")
    levels = {v.feature_level for v in HalVersion}
    if not isinstance(d.feature_level, int) or d.feature_level not in levels:
        raise VtsFailure(f"feature_level {d.feature_level!r} is not an NNAPI feature level "
                         f"({', '.join(map(str, sorted(levels)))})")
    caps = [d.capabilities(), d.capabilities()]
    if not isinstance(caps[0], Capabilities) or caps[0] != caps[1]:
        raise VtsFailure("capabilities() changes between calls or is not Capabilities")
    for info in (caps[0].relaxed_float32_to_float16_scalar,
                 caps[0].relaxed_float32_to_float16_tensor, caps[0].if_performance,
                 caps[0].while_performance, *caps[0].operand_performance.values()):
        if not (info.exec_time > 0 and info.power_usage > 0):
            raise VtsFailure(f"capabilities: performance {info} is not positive")
    files = d.number_of_cache_files_needed()
    if len(files) != 2 or any(not isinstance(n, int) or not 0 <= n <= 32 for n in files):
        raise VtsFailure(f"number_of_cache_files_needed() = {files!r}, expected two ints "
                         f"in 0..32 (MAX_NUMBER_OF_CACHE_FILES)")
    if d.number_of_cache_files_needed() != files or d.supported_extensions() != \
            d.supported_extensions():
        raise VtsFailure("a query answers differently on a second call")


@check("supported_operations.answers")
async def _supported_answers(t: Target) -> None:
    """One bool per operation, the same answer twice."""
    for probe in [*probes(), infinite_loop_model()]:
        hal = probe.model.hal_model
        first = await t.device.supported_operations(hal)
        if len(first) != len(hal.main.operations) or \
                any(not isinstance(f, (bool, np.bool_)) for f in first):
            raise VtsFailure(f"{probe.name}: supported_operations gave {first!r} for "
                             f"{len(hal.main.operations)} operations")
        if list(await t.device.supported_operations(hal)) != list(first):
            raise VtsFailure(f"{probe.name}: supported_operations answers differently twice")


def invalid_models(model: HalModel) -> list[tuple[str, HalModel]]:
    """Each kind of bad operand and operation, applied to the probe (ADD a, b, act -> out)."""
    main = model.main
    a, b, act = main.operations[0].inputs
    out = main.operations[0].outputs[0]
    r = dataclasses.replace

    def with_operand(k: int, **changes) -> HalModel:
        operands = list(main.operands)
        operands[k] = r(operands[k], **changes)
        return r(model, main=r(main, operands=tuple(operands)))

    def with_operation(**changes) -> HalModel:
        return r(model, main=r(main, operations=(r(main.operations[0], **changes),)))

    n = len(main.operands)
    bad = [
        ("operation input index out of range", with_operation(inputs=(a, b, n + 5))),
        ("operation output index out of range", with_operation(outputs=(n,))),
        ("operation missing its activation input", with_operation(inputs=(a, b))),
        ("operation with an extra input", with_operation(inputs=(a, b, act, act))),
        ("operation with no outputs", with_operation(outputs=())),
        ("unknown operation type", with_operation(type=9999)),
        ("operand of an unknown type", with_operand(b, type=9999)),
        ("second input of another type", with_operand(
            b, type=T.TENSOR_INT32 if main.operands[a].type != T.TENSOR_INT32
            else T.TENSOR_FLOAT32)),
        ("tensor type on the activation scalar", with_operand(act, type=T.TENSOR_INT32,
                                                              dimensions=(1,))),
        ("negative zero point on a quant8 output", with_operand(
            out, type=T.TENSOR_QUANT8_ASYMM, scale=0.0, zero_point=-1)),
        ("constant whose value lies outside the model's values", with_operand(
            act, location=DataLocation(0, 1 << 20, 4))),
        ("model input index out of range", r(model, main=r(main, input_indexes=(a, n + 1)))),
        ("model output that nothing writes", r(model, main=r(
            main, output_indexes=(out,), operations=()))),
        ("an operation writing a model input", with_operation(outputs=(a,))),
    ]
    return bad


@check("supported_operations.invalid_model")
async def _supported_invalid(t: Target) -> None:
    probe = t.need_probe()
    for what, bad in invalid_models(probe.model.hal_model):
        await expect(f"supported_operations({what})",
                     lambda bad=bad: t.device.supported_operations(bad),
                     ErrorStatus.INVALID_ARGUMENT)
    await t.still_serves("refused supported_operations calls")


@check("prepare_model.invalid_model")
async def _prepare_invalid(t: Target) -> None:
    probe = t.need_probe()
    for what, bad in invalid_models(probe.model.hal_model):
        await expect(f"prepare_model({what})",
                     lambda bad=bad: t.device.prepare_model(
                         bad, ExecutionPreference.FAST_SINGLE_ANSWER, Priority.MEDIUM),
                     ErrorStatus.INVALID_ARGUMENT)
    await t.still_serves("refused prepare_model calls")


@check("prepare_model.invalid_arguments")
async def _prepare_arguments(t: Target) -> None:
    hal = t.need_probe().model.hal_model
    cases = [("execution preference 7", dict(preference=7)),
             ("execution preference -1", dict(preference=-1)),
             ("priority 5", dict(priority=5)),
             ("priority 111", dict(priority=111)),
             ("a NaN deadline", dict(deadline=math.nan)),
             ("a deadline that is a string", dict(deadline="soon"))]
    for what, kw in cases:
        args = dict(preference=ExecutionPreference.FAST_SINGLE_ANSWER,
                    priority=Priority.MEDIUM, deadline=None)
        args.update(kw)
        await expect(f"prepare_model with {what}",
                     lambda args=args: t.device.prepare_model(hal, args["preference"],
                                                              args["priority"],
                                                              args["deadline"]),
                     ErrorStatus.INVALID_ARGUMENT)
    for preference in ExecutionPreference:
        for priority in (Priority.LOW, Priority.MEDIUM, Priority.HIGH):
            prepared = await expect(f"prepare_model({preference.name}, {priority.name})",
                                    lambda p=preference, q=priority: t.device.prepare_model(
                                        hal, p, q), ErrorStatus.NONE)
            prepared.release()
    await t.still_serves("refused prepare_model arguments")


@check("prepare_model.deadline")
async def _prepare_deadline(t: Target) -> None:
    hal = t.need_probe().model.hal_model
    await expect("prepare_model with a deadline that has passed",
                 lambda: t.device.prepare_model(hal, ExecutionPreference.FAST_SINGLE_ANSWER,
                                                Priority.MEDIUM, time.monotonic() - 1.0),
                 MISSED_DEADLINE)
    prepared = await expect("prepare_model with a deadline 60 s away",
                            lambda: t.device.prepare_model(
                                hal, ExecutionPreference.FAST_SINGLE_ANSWER, Priority.MEDIUM,
                                time.monotonic() + 60), ErrorStatus.NONE)
    prepared.release()
    await t.still_serves("a missed preparation deadline")


def invalid_requests(staged: Staged) -> list[tuple[str, Request]]:
    """Each kind of bad request argument and pool."""
    ins, outs = staged.inputs, staged.outputs
    r = dataclasses.replace
    first = ins[0]
    loc = first.location
    size = staged.memory.size
    return [
        ("one input too few", staged.request(inputs=ins[:-1])),
        ("one input too many", staged.request(inputs=ins + ins[:1])),
        ("no outputs", staged.request(outputs=())),
        ("one output too many", staged.request(outputs=outs + outs[:1])),
        ("an input in pool 1 of 1", staged.request(
            inputs=(r(first, location=r(loc, pool_index=1)),) + ins[1:])),
        ("an input at a negative pool index", staged.request(
            inputs=(r(first, location=r(loc, pool_index=-1)),) + ins[1:])),
        ("an input region past the pool's end", staged.request(
            inputs=(r(first, location=r(loc, offset=size - loc.length + 1)),) + ins[1:])),
        ("an input at a negative offset", staged.request(
            inputs=(r(first, location=r(loc, offset=-8)),) + ins[1:])),
        ("an input region shorter than the operand", staged.request(
            inputs=(r(first, location=r(loc, length=loc.length - 1)),) + ins[1:])),
        ("an input region longer than the operand", staged.request(
            inputs=(r(first, location=r(loc, length=loc.length + 4)),) + ins[1:])),
        ("input dimensions that conflict with the operand", staged.request(
            inputs=(r(first, dimensions=(4, 1)),) + ins[1:])),
        ("input dimensions of another rank", staged.request(
            inputs=(r(first, dimensions=(1, 4, 1)),) + ins[1:])),
        ("an output with no value", staged.request(
            outputs=(RequestArgument(has_no_value=True),) + outs[1:])),
        ("an output region past the pool's end", staged.request(
            outputs=(r(outs[0], location=r(outs[0].location, offset=size)),) + outs[1:])),
        ("no pools", staged.request(pools=())),
    ]


@check("execute.invalid_request")
async def _execute_invalid(t: Target) -> None:
    staged = Staged(t.need_probe())
    try:
        for what, request in invalid_requests(staged):
            await expect(f"execute with {what}", lambda rq=request: t.execute(rq),
                         ErrorStatus.INVALID_ARGUMENT)
            await expect(f"execute_synchronously with {what}",
                         lambda rq=request: anyio.to_thread.run_sync(
                             t.prepared.execute_synchronously, rq),
                         ErrorStatus.INVALID_ARGUMENT)
        for what, kw in (("a NaN deadline", dict(deadline=math.nan)),
                         ("a negative loop timeout", dict(loop_timeout=-1.0)),
                         ("a NaN loop timeout", dict(loop_timeout=math.nan))):
            await expect(f"execute with {what}",
                         lambda kw=kw: t.execute(staged.request(), **kw),
                         ErrorStatus.INVALID_ARGUMENT)
    finally:
        staged.close()
    await t.still_serves("refused requests")


@check("execute.output_insufficient_size")
async def _execute_insufficient(t: Target) -> None:
    probe = t.need_probe()
    staged = Staged(probe)
    try:
        outs = staged.outputs
        short = (dataclasses.replace(outs[0], location=dataclasses.replace(
            outs[0].location, length=outs[0].location.length - 1)),) + outs[1:]
        result = await expect("execute with an output one byte too small",
                              lambda: t.execute(staged.request(outputs=short)),
                              ErrorStatus.OUTPUT_INSUFFICIENT_SIZE)
        shapes = result.output_shapes
        want = tuple(np.shape(probe.expected[0]))
        if not shapes or tuple(shapes[0].dimensions) != want or shapes[0].is_sufficient:
            raise VtsFailure(f"OUTPUT_INSUFFICIENT_SIZE reported output shapes {shapes}, "
                             f"expected output 0 {list(want)} marked insufficient")
    finally:
        staged.close()
    await t.still_serves("OUTPUT_INSUFFICIENT_SIZE")


@check("execute.results_and_timing")
async def _execute_timing(t: Target) -> None:
    staged = Staged(t.need_probe())
    try:
        result = await t.execute(staged.request(), measure=False)
        check_result(staged, result, "execute")
        if (result.timing.on_device, result.timing.in_driver) != (UINT64_MAX, UINT64_MAX):
            raise VtsFailure(f"timing {result.timing} reported without measure")
        result = await t.execute(staged.request(), measure=True)
        check_result(staged, result, "execute(measure=True)")
        on, drv = result.timing.on_device, result.timing.in_driver
        if on != UINT64_MAX and drv != UINT64_MAX and on > drv:
            raise VtsFailure(f"timing on_device {on} us > in_driver {drv} us")
        sync = await anyio.to_thread.run_sync(
            lambda: t.prepared.execute_synchronously(staged.request(), True))
        check_result(staged, sync, "execute_synchronously")
        on, drv = sync.timing.on_device, sync.timing.in_driver
        if on != UINT64_MAX and drv != UINT64_MAX and on > drv:
            raise VtsFailure(f"execute_synchronously timing on_device {on} > in_driver {drv}")
    finally:
        staged.close()


@check("execute.deadline")
async def _execute_deadline(t: Target) -> None:
    staged = Staged(t.need_probe())
    try:
        await expect("execute with a deadline that has passed",
                     lambda: t.execute(staged.request(), deadline=time.monotonic() - 1.0),
                     MISSED_DEADLINE)
        await expect("execute_synchronously with a deadline that has passed",
                     lambda: anyio.to_thread.run_sync(
                         lambda: t.prepared.execute_synchronously(
                             staged.request(), False, time.monotonic() - 1.0)),
                     MISSED_DEADLINE)
        check_result(staged, await t.execute(staged.request(),
                                             deadline=time.monotonic() + 60), "execute "
                     "with a deadline 60 s away")
    finally:
        staged.close()
    await t.still_serves("a missed deadline")


@check("execute.loop_timeout")
async def _loop_timeout(t: Target) -> None:
    probe = infinite_loop_model()
    hal = probe.model.hal_model
    if not all(await t.device.supported_operations(hal)):
        raise VtsSkip("the device does not support WHILE (with GREATER_EQUAL and ADD)")
    try:
        prepared = await t.device.prepare_model(hal, ExecutionPreference.FAST_SINGLE_ANSWER,
                                                Priority.MEDIUM)
    except NnrtError as e:
        raise VtsFailure(f"WHILE reported supported, but prepare_model failed: {e}") from None
    staged = Staged(Probe(probe.name, probe.model, probe.inputs, [np.zeros(1, np.float32)]))
    try:
        started = time.monotonic()
        await expect("an endless WHILE with loop_timeout=0.2 s",
                     lambda: prepared.execute(staged.request(), loop_timeout=0.2),
                     MISSED_DEADLINE)
        took = time.monotonic() - started
        if took > 10:
            raise VtsFailure(f"an endless WHILE with loop_timeout=0.2 s ran {took:.1f} s")
        await expect("an endless WHILE with a deadline 0.3 s away",
                     lambda: prepared.execute(staged.request(),
                                              deadline=time.monotonic() + 0.3),
                     MISSED_DEADLINE)
    finally:
        staged.close()
        prepared.release()
    await t.still_serves("an endless loop stopped by its timeout")


@check("burst.executions")
async def _burst(t: Target) -> None:
    probe = t.need_probe()
    session = await t.prepared.configure_burst()
    staged = [Staged(probe) for _ in range(3)]
    try:
        # The same memories again and again, then a new one mid-session.
        for k in (0, 1, 0, 1, 2, 0):
            check_result(staged[k], await session.execute(staged[k].request()),
                         f"burst execution on memory {k}")
        for what, request in invalid_requests(staged[0])[:11]:
            await expect(f"burst execution with {what}",
                         lambda rq=request: session.execute(rq),
                         ErrorStatus.INVALID_ARGUMENT)
            check_result(staged[2], await session.execute(staged[2].request()),
                         f"a burst execution after one with {what}")
        await expect("burst execution with a deadline that has passed",
                     lambda: session.execute(staged[1].request(),
                                             deadline=time.monotonic() - 1),
                     MISSED_DEADLINE)
        result = await session.execute(staged[1].request(), True)
        check_result(staged[1], result, "burst execution with measure")
        # The memory a released slot held is gone; a fresh memory still works.
        staged[0].close()
        staged[0] = Staged(probe)
        check_result(staged[0], await session.execute(staged[0].request()),
                     "burst execution on a fresh memory after one was closed")
    finally:
        session.close()
        for s in staged:
            s.close()
    await t.still_serves("a burst session")


@check("burst.malformed_packets")
async def _burst_malformed(t: Target) -> None:
    """Raw frames on a service's request ring: garbage, a truncated request,
    a slot the controller never gave. Each is refused with INVALID_ARGUMENT
    and the session keeps serving. (In-process drivers have no ring.)"""
    from nnrt.burst.controller import BurstController
    from nnrt.burst.wire import BurstArgument, BurstRequest, encode_request

    probe = t.need_probe()
    session = await t.prepared.configure_burst()
    staged = Staged(probe)
    try:
        if not isinstance(session, BurstController):
            raise VtsSkip("the device's bursts do not use a request ring (in-process driver)")
        check_result(staged, await session.execute(staged.request()), "burst execution")
        args = [BurstArgument(False, 0, a.location.offset, a.location.length,
                              tuple(a.dimensions)) for a in staged.inputs]
        outs = [BurstArgument(False, 0, a.location.offset, a.location.length)
                for a in staged.outputs]
        unknown_slot = encode_request(BurstRequest(1 << 20, tuple(args), tuple(outs),
                                                   (987654,)))
        frames = [("garbage bytes", b"\x00\xff" * 40),
                  ("an empty frame", b""),
                  ("a truncated request", unknown_slot[:len(unknown_slot) // 2]),
                  ("a request naming a slot the controller never gave", unknown_slot)]
        for what, frame in frames:
            await expect(f"burst frame with {what}",
                         lambda f=frame: session.for_test_execute_raw(f),
                         ErrorStatus.INVALID_ARGUMENT)
            check_result(staged, await session.execute(staged.request()),
                         f"a burst execution after a frame with {what}")
    finally:
        session.close()
        staged.close()
    await t.still_serves("malformed burst frames")


async def _fenced(t: Target, tg, staged: Staged, wait_for=(), **kw):
    return await t.prepared.execute_fenced(tg, staged.request(), wait_for, **kw)


@check("fenced.waits_and_chains")
async def _fenced_wait(t: Target) -> None:
    probe = t.need_probe()
    staged = [Staged(probe) for _ in range(3)]
    gate = SyncFence.create()
    try:
        async with anyio.create_task_group() as tg:
            fence1, cb1 = await _fenced(t, tg, staged[0], [gate])
            fence2, cb2 = await _fenced(t, tg, staged[1], [fence1])
            fence3, cb3 = await _fenced(t, tg, staged[2], [fence2, gate], measure=True)
            await anyio.sleep(0.1)
            for k, f in enumerate((fence1, fence2, fence3), 1):
                if f.poll() != nnrt.FenceState.ACTIVE:
                    raise VtsFailure(f"fenced execution {k} signaled ({f.poll().name}) before "
                                     f"the fence it waits for")
            try:
                cb3.get_execution_info()
            except NnrtError:
                pass  # nothing is available before the fence (BAD_STATE)
            else:
                raise VtsFailure("get_execution_info answered before the fence was signaled")
            gate.signal()
            with anyio.fail_after(30):
                await fence3.wait_signaled()
        for k, (cb, s) in enumerate(zip((cb1, cb2, cb3), staged), 1):
            check_result(s, cb.get_result(), f"fenced execution {k} of the chain")
        status, launched, fenced = cb3.get_execution_info()
        if status != ErrorStatus.NONE:
            raise VtsFailure(f"get_execution_info status {status.name}")
        for name, timing in (("launched", launched), ("fenced", fenced)):
            if timing.on_device != UINT64_MAX and timing.in_driver != UINT64_MAX \
                    and timing.on_device > timing.in_driver:
                raise VtsFailure(f"timing_{name} on_device {timing.on_device} > in_driver "
                                 f"{timing.in_driver}")
        if launched.in_driver != UINT64_MAX and fenced.in_driver != UINT64_MAX \
                and fenced.in_driver > launched.in_driver:
            raise VtsFailure(f"timing_fenced {fenced.in_driver} us exceeds timing_launched "
                             f"{launched.in_driver} us (it starts later)")
    finally:
        gate.close()
        for s in staged:
            s.close()
    await t.still_serves("a chain of fenced executions")


@check("fenced.errors")
async def _fenced_errors(t: Target) -> None:
    probe = t.need_probe()
    staged = Staged(probe)
    gate = SyncFence.create()
    try:
        async with anyio.create_task_group() as tg:
            # A fence that signals an error fails what waits for it.
            fence, cb = await _fenced(t, tg, staged, [gate])
            gate.signal_error(ErrorStatus.GENERAL_FAILURE)
            with anyio.fail_after(30):
                try:
                    await fence.wait_signaled()
                except NnrtError:
                    pass
            status, _, _ = cb.get_execution_info()
            if status == ErrorStatus.NONE:
                raise VtsFailure("an execution waiting for a failed fence reported NONE")
            if fence.status == ErrorStatus.NONE:
                raise VtsFailure("the fence of an execution that waited for a failed fence "
                                 "was signaled without an error")
            # An invalid request: refused at once or through the fence.
            bad = staged.request(inputs=staged.inputs[:-1])
            try:
                f2, cb2 = await t.prepared.execute_fenced(tg, bad, ())
            except NnrtError as e:
                if e.status != ErrorStatus.INVALID_ARGUMENT:
                    raise VtsFailure(f"execute_fenced with one input too few: "
                                     f"{e.status.name}, expected INVALID_ARGUMENT")
            else:
                with anyio.fail_after(30):
                    try:
                        await f2.wait_signaled()
                    except NnrtError:
                        pass
                if cb2.get_execution_info()[0] != ErrorStatus.INVALID_ARGUMENT:
                    raise VtsFailure(f"execute_fenced with one input too few: "
                                     f"{cb2.get_execution_info()[0].name}, expected "
                                     f"INVALID_ARGUMENT")
            # A passed deadline.
            f3, cb3 = await _fenced(t, tg, staged, (), deadline=time.monotonic() - 1)
            with anyio.fail_after(30):
                try:
                    await f3.wait_signaled()
                except NnrtError:
                    pass
            if cb3.get_execution_info()[0] not in MISSED_DEADLINE:
                raise VtsFailure(f"execute_fenced with a passed deadline: "
                                 f"{cb3.get_execution_info()[0].name}, expected MISSED_DEADLINE_*")
    finally:
        gate.close()
        staged.close()
    await t.still_serves("failed fenced executions")


@check("supported_operations.consistent")
async def _supported_consistent(t: Target) -> None:
    """Every single-operation model the device reports supported prepares
    and runs on it alone, with the reference driver's results."""
    from nnrt.drivers.reference import ReferenceDevice
    from .random_graph import single_op_models

    reference = ReferenceDevice()
    ran = 0
    for name, model, inputs, _type, _op in single_op_models():
        hal = model.hal_model
        if not all(await t.device.supported_operations(hal)):
            continue
        got = await _run_on(t.device, hal, inputs, f"{name} (reported supported)")
        want = await _run_on(reference, hal, inputs, f"{name} on the reference driver")
        for k, (g, w) in enumerate(zip(got, want)):
            # Quantized results off by at most one, floats within 5 float16 ULP.
            tol = (1, 0) if g.dtype.kind in "iu" else (5 * 0.0009765625, 5 * 0.0009765625)
            if g.shape != w.shape or not np.allclose(g.astype(np.float64),
                                                     w.astype(np.float64),
                                                     atol=tol[0], rtol=tol[1], equal_nan=True):
                raise VtsFailure(f"{name}: output {k} differs from the reference driver's")
        ran += 1
    if ran == 0:
        raise VtsSkip("the device reports none of the single-operation models supported")


async def _run_on(device: Device, hal: HalModel, inputs, what: str) -> list[np.ndarray]:
    try:
        prepared = await device.prepare_model(hal, ExecutionPreference.FAST_SINGLE_ANSWER,
                                              Priority.MEDIUM)
    except NnrtError as e:
        raise VtsFailure(f"{what}: prepare_model failed: {e}") from None
    try:
        result, arrays = await execute_in_one_memory(
            prepared, hal, inputs, [4096] * len(hal.main.output_indexes))
    finally:
        prepared.release()
    if result.status != ErrorStatus.NONE:
        raise VtsFailure(f"{what}: execution failed: {result.status.name} ({result.message})")
    return arrays


# --- running ----------------------------------------------------------------------

async def run_checks(device: Device, names=None, progress=None) -> list[VtsOutcome]:
    """Run the checks (default: all) against ``device``; ``progress(outcome)``
    is called after each."""
    target = Target(device)
    outcomes = []
    try:
        await target.setup()
    except NnrtError as e:
        return [VtsOutcome("setup", "failed", f"preparing a probe model failed: {e}")]
    try:
        for name, fn in CHECKS.items():
            if names is not None and name not in names:
                continue
            try:
                with anyio.fail_after(120):
                    await fn(target)
                outcome = VtsOutcome(name, "passed")
            except VtsSkip as e:
                outcome = VtsOutcome(name, "skipped", str(e))
            except VtsFailure as e:
                outcome = VtsOutcome(name, "failed", str(e))
            except TimeoutError:
                outcome = VtsOutcome(name, "failed", "hung: no answer within 120 s")
            except Exception as e:  # a crash is a failure of this check, not of the run
                outcome = VtsOutcome(name, "failed", f"crashed: {type(e).__name__}: {e}")
            outcomes.append(outcome)
            if progress:
                progress(outcome)
    finally:
        target.close()
    return outcomes
