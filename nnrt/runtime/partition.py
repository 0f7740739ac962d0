"""Partitioning: assign each operation to a device and cut the model into steps.

Each operation goes to the device that supports it and reports the best
performance for the compilation's preference (LOW_POWER compares
``power_usage``, the others ``exec_time``) for the operation's data type;
ties go to the device listed first.

Extensions: an extension operation goes only to a device whose
``supported_extensions()`` lists its extension (and those of every extension
operand it touches), whatever that device's ``supported_operations`` says;
there is no CPU fallback for it (NNAPI has none), so a model needing an
extension no device offers fails to compile with a message naming it. A
model using extensions or OEM types compiles only for an app on the
allowlist (``nnrt.hal.allowlist``).

Round trips: a device whose capabilities carry a ``round_trip`` (a remote
device: the median of a few small calls, measured at connect) costs that
much per step before any work. Per-operation performance is a ratio to the
reference CPU, so to weigh a fixed cost against it the partitioner turns
each operation into an estimated amount of work (:func:`operation_work`:
multiply-adds of a convolution or fully connected layer, elements of
anything else) and that into reference-CPU seconds (``REFERENCE_RATE``).
:func:`weigh_round_trips` then moves a step off such a device when the
best other devices run its operations in less time than the device does
plus its round trip: a tiny model is not sent across the network to save
nothing, a large one still goes to a remote device faster by more than the
trip. Only for the speed preferences (LOW_POWER compares power, which a
round trip's seconds do not measure).

Consecutive operations (in run order) on one device form a step. A step is
a HAL model of its own: it shares the original model's constants
(``operand_values``, pools, referenced subgraphs), so only the main
subgraph's operands are renumbered; operands that cross a step boundary
become the step's inputs and outputs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..hal import Device, ExecutionPreference
from ..extensions import DRIVER_OF
from ..hal.allowlist import check_current_app
from ..model.extensions import uses_extensions
from ..errors import NnrtError, ErrorStatus
from ..model.graph import HalModel, Operation, Subgraph
from ..model.types import OperandLifeTime as L, OperandType, OperationType
from .placement import groups

_VALUE_LIFETIMES = (L.CONSTANT_COPY, L.CONSTANT_REFERENCE, L.NO_VALUE, L.SUBGRAPH)

# Units of work (:func:`operation_work`) a second on the reference CPU, the
# device whose PerformanceInfo is 1.0. An estimate (numpy's elementwise
# kernels and its convolutions on this class of machine), used only to weigh
# a device's fixed round trip against the time its speed saves.
REFERENCE_RATE = 1e9


@dataclass(frozen=True)
class StepPlan:
    device: Device
    model: HalModel                 # the step's own HAL model
    inputs: tuple[int, ...]      # original operand indexes, in step input order
    outputs: tuple[int, ...]     # original operand indexes, in step output order


def _operation_type(model: HalModel, op: Operation) -> OperandType:
    """The data type that decides an operation's performance: its first
    tensor input's (the way NNAPI's partitioner looks at an operation)."""
    for i in op.inputs:
        t = model.main.operands[i].type
        if t.is_tensor:
            return t
    return model.main.operands[op.outputs[0]].type


def _how_to_offer(extension: str) -> str:
    kind = DRIVER_OF.get(extension)
    if kind is None:
        return (f"; {extension} is a vendor's: run that vendor's driver service and list "
                f"it in NNRT_DRIVERS, and allowlist this app for it")
    return (f"; {extension} ships with nnrt (no allowlist entry needed) and the "
            f"{kind!r} driver offers it: start one with Runtime(spawn=[{kind!r}]) or "
            f"'nnrt run --spawn {kind}', or serve one (nnrt driver serve NAME --driver "
            f"{kind}) and list its socket in NNRT_DRIVERS")


def assign_devices(model: HalModel, devices: list[Device], supported: list[list[bool]],
                   preference: ExecutionPreference) -> list[Device]:
    """The device for each operation of the main subgraph (in order), given
    each device's ``supported_operations`` answer."""
    check_current_app(uses_extensions(model))
    offered = [{e.name for e in d.supported_extensions()} for d in devices]
    chosen = []
    for k, op in enumerate(model.main.operations):
        best, _ = _best(model, k, devices, supported, offered, preference)
        if best is None:
            needed = _extensions_of(model, op)
            missing = sorted(needed - set().union(*offered)) if needed else []
            if missing:
                raise NnrtError(ErrorStatus.INVALID_ARGUMENT,
                                f"operation {k} ({op.type.name}) needs the extension "
                                f"{', '.join(missing)}, which no device offers"
                                + "".join(_how_to_offer(name) for name in missing))
            raise NnrtError(ErrorStatus.INVALID_ARGUMENT,
                            f"no device supports operation {k} ({op.type.name})")
        chosen.append(best)
    return chosen


def place(model: HalModel, devices: list[Device], supported: list[list[bool]],
          preference: ExecutionPreference) -> tuple[list[Device], dict[int, str]]:
    """The device for each operation (:func:`assign_devices`), round trips
    weighed (:func:`weigh_round_trips`), and why operations were kept off a
    device with a round trip."""
    return weigh_round_trips(model, devices, supported, preference,
                             assign_devices(model, devices, supported, preference))


def _cost(model: HalModel, op: Operation, device: Device,
          preference: ExecutionPreference) -> float:
    """``device``'s performance ratio for ``op`` under ``preference``."""
    caps = device.capabilities()
    t = _operation_type(model, op)
    if model.relax_computation_float32_to_float16 and t == OperandType.TENSOR_FLOAT32:
        perf = caps.relaxed_float32_to_float16_tensor
    else:
        perf = caps.performance(t)
    return perf.power_usage if preference == ExecutionPreference.LOW_POWER else perf.exec_time


def _best(model: HalModel, k: int, devices: list[Device], supported: list[list[bool]],
          offered: list[set[str]], preference: ExecutionPreference,
          skip: Device | None = None) -> tuple[Device | None, float]:
    """The device (other than ``skip``) that runs operation ``k`` best, and
    its cost; ties go to the device listed first. (None, inf) when none can."""
    op = model.main.operations[k]
    needed = _extensions_of(model, op)
    best, best_cost = None, float("inf")
    for d, flags, has in zip(devices, supported, offered):
        if d is skip or not flags[k] or not needed <= has:
            continue
        cost = _cost(model, op, d, preference)
        if best is None or cost < best_cost:
            best, best_cost = d, cost
    return best, best_cost


def _elements(dimensions: tuple[int, ...]) -> int:
    n = 1
    for d in dimensions:
        n *= max(d, 1)      # an unknown extent counts as 1: never more work than is sure
    return n


# Where an operation's multiply-adds per output element are read from: the
# filter's (or weights') elements divided by the dimension that does not
# contribute to one output.
_PER_OUTPUT = {
    OperationType.CONV_2D: 0,                # filter [out, h, w, in]
    OperationType.GROUPED_CONV_2D: 0,        # filter [out, h, w, in / groups]
    OperationType.TRANSPOSE_CONV_2D: 0,      # filter [out, h, w, in]
    OperationType.DEPTHWISE_CONV_2D: 3,      # filter [1, h, w, out]
    OperationType.FULLY_CONNECTED: 0,        # weights [units, input size]
}


def operation_work(model: HalModel, op: Operation) -> float:
    """An estimate of the work of ``op``: multiply-adds for convolutions and
    fully connected layers, else the elements of its largest tensor."""
    operands = model.main.operands
    largest = max((_elements(operands[i].dimensions) for i in (*op.inputs, *op.outputs)
                   if operands[i].type.is_tensor), default=1)
    axis = _PER_OUTPUT.get(op.type)
    if axis is None or len(op.inputs) < 2:
        return float(largest)
    weights = operands[op.inputs[1]].dimensions
    if len(weights) <= axis:
        return float(largest)
    per_output = _elements(weights) // max(weights[axis], 1)
    return float(_elements(operands[op.outputs[0]].dimensions) * max(per_output, 1))


def weigh_round_trips(model: HalModel, devices: list[Device], supported: list[list[bool]],
                      preference: ExecutionPreference,
                      assignment: list[Device]) -> tuple[list[Device], dict[int, str]]:
    """``assignment`` with each step on a device with a round trip moved to
    the best other devices when they are at least as fast once the trip is
    counted; and, per operation moved, why (for the placement report)."""
    if preference == ExecutionPreference.LOW_POWER:
        return assignment, {}
    ops = model.main.operations
    offered = [{e.name for e in d.supported_extensions()} for d in devices]
    moved = list(assignment)
    why: dict[int, str] = {}
    for device, indexes in groups(assignment):
        trip = device.capabilities().round_trip
        if trip <= 0:
            continue
        there = trip
        here = 0.0
        others = []
        for k in indexes:
            other, cost = _best(model, k, devices, supported, offered, preference, skip=device)
            if other is None:
                break
            seconds = operation_work(model, ops[k]) / REFERENCE_RATE
            there += seconds * _cost(model, ops[k], device, preference)
            here += seconds * cost
            others.append(other)
        else:
            here += sum(d.capabilities().round_trip for d in set(others))
            if here <= there and math.isfinite(here):
                note = (f"kept off {device.name}: about {here * 1e3:.3f} ms here against "
                        f"{there * 1e3:.3f} ms there, its round trip "
                        f"{trip * 1e3:.3f} ms included")
                for k, other in zip(indexes, others):
                    moved[k] = other
                    why[k] = note
    return moved, why


def _extensions_of(model: HalModel, op: Operation) -> set[str]:
    """The extensions a device needs to run ``op``."""
    operands = model.main.operands
    needed = {operands[i].type.extension for i in (*op.inputs, *op.outputs)
              if operands[i].type.is_extension}
    if op.type.is_extension:
        needed.add(op.type.extension)
    return needed


def split(model: HalModel, assignment: list[Device]) -> list[StepPlan]:
    """Cut the main subgraph into steps of consecutive operations on one device."""
    main = model.main
    ops = main.operations
    if not ops:
        raise NnrtError(ErrorStatus.INVALID_ARGUMENT, "the model has no operations")
    groups: list[tuple[Device, list[Operation]]] = []
    for op, device in zip(ops, assignment):
        if groups and groups[-1][0] is device:
            groups[-1][1].append(op)
        else:
            groups.append((device, [op]))
    if len(groups) == 1:
        return [StepPlan(groups[0][0], model, main.input_indexes, main.output_indexes)]
    # Which step reads each operand, to know what a step must hand on.
    read_by: dict[int, set[int]] = {}
    for s, (_, group) in enumerate(groups):
        for op in group:
            for i in op.inputs:
                read_by.setdefault(i, set()).add(s)
    model_outputs = set(main.output_indexes)
    steps = []
    for s, (device, group) in enumerate(groups):
        produced = [i for op in group for i in op.outputs]
        produced_set = set(produced)
        inputs: list[int] = []
        for op in group:
            for i in op.inputs:
                if i in produced_set or i in inputs:
                    continue
                if main.operands[i].lifetime in _VALUE_LIFETIMES:
                    continue
                inputs.append(i)
        outputs = [i for i in produced
                   if i in model_outputs or any(r > s for r in read_by.get(i, ()))]
        steps.append(StepPlan(device, _step_model(model, group, inputs, outputs),
                              tuple(inputs), tuple(outputs)))
    return steps


def _step_model(model: HalModel, group: list[Operation], inputs: list[int],
                outputs: list[int]) -> HalModel:
    main = model.main
    used: list[int] = []
    seen: set[int] = set()
    for i in [*inputs, *(i for op in group for i in (*op.inputs, *op.outputs))]:
        if i not in seen:
            seen.add(i)
            used.append(i)
    index = {old: new for new, old in enumerate(used)}
    ins, outs = set(inputs), set(outputs)
    operands = []
    for old in used:
        o = main.operands[old]
        if old in ins:
            o = replace(o, lifetime=L.SUBGRAPH_INPUT)
        elif old in outs:
            o = replace(o, lifetime=L.SUBGRAPH_OUTPUT)
        elif o.lifetime in (L.SUBGRAPH_INPUT, L.SUBGRAPH_OUTPUT):
            o = replace(o, lifetime=L.TEMPORARY_VARIABLE)
        operands.append(o)
    operations = tuple(Operation(op.type, tuple(index[i] for i in op.inputs),
                                 tuple(index[i] for i in op.outputs)) for op in group)
    sub = Subgraph(tuple(operands), operations, tuple(index[i] for i in inputs),
                   tuple(index[i] for i in outputs))
    return replace(model, main=sub, _constants={})
