"""Validation of a HAL model and of a request: the ValidateHal analogue.

A driver runs :func:`validate_model` on every model it is asked to prepare
(a model may come from another process, so nothing is trusted), and
:func:`validate_request` on every request. Failures are INVALID_ARGUMENT with
a message naming the operand, operation or argument at fault.

Operation signatures and shape inference come from the operation registry
(``nnrt.ops``), which is why this module, unlike the rest of ``nnrt.model``,
imports it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ErrorStatus, NnrtError, invalid
from .. import ops
from ..memory import as_buffer, pool_view
from ..model.extensions import MAX_PREFIX, check_extension_name
from ..model.graph import HalModel, Operand, Subgraph
from ..model.types import HalVersion, OperandLifeTime as L, OperandType, OperationType

_CONSTANT = (L.CONSTANT_COPY, L.CONSTANT_REFERENCE)


@dataclass(frozen=True)
class ValidatedModel:
    """What validation learned: the HAL version the model needs and the
    dimensions inferred for each operand of each subgraph (None = main)."""

    version: HalVersion
    dims: dict[int | None, dict[int, tuple[int, ...]]]


def validate_model(model: HalModel) -> ValidatedModel:
    """Check everything the runtime can check. Extension and OEM operations
    are checked only as a graph (operand indexes, run order, declared
    outputs); their semantics are the driver's to validate. A valid model
    keeps its answer (``HalModel._validated``): the runtime, the scheduler
    in front of a driver and the driver validating the same model object
    cost one validation; an invalid one is refused every time."""
    if model._validated:
        return model._validated[0]
    validated = _validate(model)
    model._validated[:] = [validated]
    return validated


def _validate(model: HalModel) -> ValidatedModel:
    version = HalVersion.V1_0
    if model.relax_computation_float32_to_float16:
        version = HalVersion.V1_1
    if _check_extension_prefixes(model):
        version = max(version, HalVersion.V1_2)
    _check_no_reference_cycle(model)
    dims = {}
    for index in [None, *range(len(model.referenced))]:
        where = "main subgraph" if index is None else f"subgraph {index}"
        v, d = _validate_subgraph(model, index, where)
        version = max(version, v)
        dims[index] = d
    return ValidatedModel(version, dims)


def _check_extension_prefixes(model: HalModel) -> bool:
    """The prefix map must be a bijection between valid names and prefixes
    in [1, 65535]. True when the model maps any extension."""
    names, prefixes = set(), set()
    for e in model.extension_prefixes:
        try:
            check_extension_name(e.name)
        except NnrtError as err:
            raise invalid(f"extension prefix map: {err.message}") from None
        if not 0 < e.prefix <= MAX_PREFIX:
            raise invalid(f"extension prefix map: prefix {e.prefix} of {e.name} is not in "
                          f"[1, 65535]")
        if e.name in names or e.prefix in prefixes:
            raise invalid(f"extension prefix map: {e.name} or prefix {e.prefix} appears twice")
        names.add(e.name)
        prefixes.add(e.prefix)
    return bool(names)


def _check_no_reference_cycle(model: HalModel) -> None:
    """A subgraph may not refer, directly or not, to itself (IF/WHILE would recurse).

    Written with module-level functions, not nested ones: a nested function
    that calls itself is a reference cycle (its closure holds its own cell)
    holding the model, and so the model's pools -- in a driver service, the
    mappings of an app's memfds -- until the garbage collector happens by."""
    state: dict[int, str] = {}  # "open" while on the DFS path, "done" after
    for k in sorted(_subgraph_refs(model, model.main)):
        _visit_subgraph(model, state, k, [])


def _subgraph_refs(model: HalModel, sub: Subgraph) -> set[int]:
    return {o.location.offset for o in sub.operands
            if o.lifetime == L.SUBGRAPH and o.location is not None
            and 0 <= o.location.offset < len(model.referenced)}


def _visit_subgraph(model: HalModel, state: dict[int, str], index: int, path: list[int]) -> None:
    if state.get(index) == "done":
        return
    if state.get(index) == "open":
        cycle = path[path.index(index):] + [index]
        raise invalid(f"subgraph reference cycle: {' -> '.join(map(str, cycle))}")
    state[index] = "open"
    for k in sorted(_subgraph_refs(model, model.referenced[index])):
        _visit_subgraph(model, state, k, path + [index])
    state[index] = "done"


def _validate_subgraph(model: HalModel, index: int | None, where: str):
    sub = model.subgraph(index)
    n = len(sub.operands)
    version = HalVersion.V1_0
    for k, operand in enumerate(sub.operands):
        _validate_operand(model, operand, f"{where} operand {k}")
        if operand.type in (OperandType.TENSOR_QUANT8_ASYMM_SIGNED, OperandType.SUBGRAPH):
            version = max(version, HalVersion.V1_3)
        elif operand.type in (OperandType.TENSOR_FLOAT16, OperandType.FLOAT16, OperandType.BOOL,
                              OperandType.TENSOR_BOOL8, OperandType.TENSOR_QUANT16_ASYMM,
                              OperandType.TENSOR_QUANT16_SYMM, OperandType.TENSOR_QUANT8_SYMM,
                              OperandType.TENSOR_QUANT8_SYMM_PER_CHANNEL):
            version = max(version, HalVersion.V1_2)
    for kind, indexes, lifetime in (("input", sub.input_indexes, L.SUBGRAPH_INPUT),
                                    ("output", sub.output_indexes, L.SUBGRAPH_OUTPUT)):
        for i in indexes:
            if not 0 <= i < n:
                raise invalid(f"{where}: {kind} operand index {i} out of range ({n} operands)")
            if sub.operands[i].lifetime != lifetime:
                raise invalid(f"{where}: {kind} operand {i} has lifetime "
                              f"{sub.operands[i].lifetime.name}, expected {lifetime.name}")
        if len(set(indexes)) != len(indexes):
            raise invalid(f"{where}: an operand is listed twice among the {kind}s")
    for i, operand in enumerate(sub.operands):
        if operand.lifetime == L.SUBGRAPH_INPUT and i not in sub.input_indexes:
            raise invalid(f"{where}: operand {i} is SUBGRAPH_INPUT but not a subgraph input")
        if operand.lifetime == L.SUBGRAPH_OUTPUT and i not in sub.output_indexes:
            raise invalid(f"{where}: operand {i} is SUBGRAPH_OUTPUT but not a subgraph output")

    # Operations must come in run order: each reads only what is already defined.
    defined = {i for i, o in enumerate(sub.operands)
               if o.lifetime in (*_CONSTANT, L.SUBGRAPH_INPUT, L.NO_VALUE, L.SUBGRAPH)}
    written: set[int] = set()
    known = {i: o.dimensions for i, o in enumerate(sub.operands)}
    for k, op in enumerate(sub.operations):
        _check_type(op.type, OperationType, f"{where} operation {k}")
        what = f"{where} operation {k} ({op.type.name})"
        for i in (*op.inputs, *op.outputs):
            if not 0 <= i < n:
                raise invalid(f"{what}: operand index {i} out of range ({n} operands)")
        for i in op.inputs:
            if i not in defined:
                raise invalid(f"{what}: input operand {i} is not defined before it is read "
                              f"(graph not in run order, cyclic, or operand never written)")
        for i in op.outputs:
            lifetime = sub.operands[i].lifetime
            if lifetime not in (L.TEMPORARY_VARIABLE, L.SUBGRAPH_OUTPUT):
                raise invalid(f"{what}: output operand {i} has lifetime {lifetime.name}")
            if i in written:
                raise invalid(f"{what}: operand {i} is written more than once")
            written.add(i)
            defined.add(i)
        if op.type.is_extension or op.type.is_oem:
            version = max(version, HalVersion.V1_2)
            if not ops.has_definition(op.type):
                # The driver that claims it validates it; outputs keep their
                # declared dimensions.
                continue
            # One of nnrt's own extensions (nnrt.extensions) that the
            # registry defines: checked and shaped like NNAPI's operations.
        opdef = ops.definition(op.type)
        view = ops.OpView(model, index, op, known)
        try:
            version = max(version, opdef.validate(view))
            inferred = opdef.shape(view)
        except NnrtError as e:
            raise invalid(f"{what}: {e.message}") from None
        except (ValueError, TypeError, IndexError, KeyError) as e:
            raise invalid(f"{what}: invalid operands ({e})") from None
        for i, shape in zip(op.outputs, inferred):
            known[i] = _merge_dims(known[i], tuple(shape), f"{what}: output operand {i}")
    for i, operand in enumerate(sub.operands):
        if operand.lifetime in (L.TEMPORARY_VARIABLE, L.SUBGRAPH_OUTPUT) and i not in written:
            raise invalid(f"{where}: operand {i} ({operand.lifetime.name}) is never written")
    return version, known


def _merge_dims(declared: tuple[int, ...], inferred: tuple[int, ...], what: str) -> tuple[int, ...]:
    """Combine declared and inferred dimensions; a conflict between two known
    extents (or ranks) makes the model invalid."""
    if not inferred:
        return declared
    if not declared:
        return inferred
    if len(declared) != len(inferred):
        raise invalid(f"{what} is declared with rank {len(declared)} "
                      f"({list(declared)}) but the operation produces rank {len(inferred)} "
                      f"({list(inferred)})")
    merged = []
    for d, s in zip(declared, inferred):
        if d and s and d != s:
            raise invalid(f"{what} is declared {list(declared)} but the operation "
                          f"produces {list(inferred)}")
        merged.append(d or s)
    return tuple(merged)


def _check_type(value, enum_type, what: str) -> None:
    """A type without an extension prefix (high 16 bits zero) must be one
    NNAPI defines; a model from another process may carry any integer."""
    if isinstance(value, enum_type):
        return
    if isinstance(value, int) and not isinstance(value, bool) and value >> 16 != 0:
        return  # an extension type: the extension's validation decides
    raise invalid(f"{what}: unknown {enum_type.__name__} {value!r}")


def _validate_operand(model: HalModel, operand: Operand, what: str) -> None:
    _check_type(operand.type, OperandType, what)
    t = operand.type
    if t.is_extension:
        mapped = {e.prefix: e.name for e in model.extension_prefixes}
        if mapped.get(t.prefix) != t.extension:
            raise invalid(f"{what}: type {t.name} has prefix {t.prefix}, which the model maps "
                          f"to {mapped.get(t.prefix)!r}")
    elif operand.extra_params is not None:
        raise invalid(f"{what}: extension data on a {t.name} operand (only extension "
                      f"operands carry it)")
    if t.is_scalar and operand.dimensions:
        raise invalid(f"{what}: scalar type {t.name} with dimensions {list(operand.dimensions)}")
    if any(d < 0 for d in operand.dimensions):
        raise invalid(f"{what}: negative dimension in {list(operand.dimensions)}")
    if t.is_quantized and t != OperandType.TENSOR_QUANT8_SYMM_PER_CHANNEL and not operand.scale > 0:
        raise invalid(f"{what}: {t.name} needs a positive scale")
    if t == OperandType.TENSOR_QUANT8_SYMM_PER_CHANNEL and operand.channel_quant is None:
        raise invalid(f"{what}: TENSOR_QUANT8_SYMM_PER_CHANNEL without channel quantization")
    lifetime = operand.lifetime
    if lifetime in _CONSTANT:
        loc = operand.location
        if loc is None:
            raise invalid(f"{what}: constant without a location")
        if lifetime == L.CONSTANT_COPY:
            if loc.pool_index != -1:
                raise invalid(f"{what}: CONSTANT_COPY must live in operand_values")
            size = len(model.operand_values)
        else:
            if not 0 <= loc.pool_index < len(model.pools):
                raise invalid(f"{what}: pool index {loc.pool_index} out of range "
                              f"({len(model.pools)} pools)")
            size = as_buffer(model.pools[loc.pool_index]).nbytes
        if loc.offset < 0 or loc.length < 0 or loc.offset + loc.length > size:
            raise invalid(f"{what}: value [{loc.offset}, {loc.offset + loc.length}) lies "
                          f"outside its pool of {size} bytes")
        if not operand.is_fully_specified:
            raise invalid(f"{what}: constant with unspecified dimensions "
                          f"{list(operand.dimensions)}")
        if loc.length != operand.byte_size:
            raise invalid(f"{what}: {t.name} {list(operand.dimensions)} needs {operand.byte_size} "
                          f"bytes, its value has {loc.length}")
    elif lifetime == L.SUBGRAPH:
        if t != OperandType.SUBGRAPH:
            raise invalid(f"{what}: lifetime SUBGRAPH on a {t.name} operand")
        loc = operand.location
        if loc is None or not 0 <= loc.offset < len(model.referenced):
            raise invalid(f"{what}: reference to a subgraph that does not exist")
    elif operand.location is not None and lifetime != L.NO_VALUE:
        raise invalid(f"{what}: {lifetime.name} operand must not have a value")


def checked_flags(flags, model: HalModel, who: str) -> list[bool]:
    """A device's answer to ``supported_operations(model)``, checked to hold
    one flag per operation of the main graph (GENERAL_FAILURE naming ``who``
    otherwise): a service or a remote host answers over a wire."""
    flags = list(flags)
    if len(flags) != len(model.main.operations):
        raise NnrtError(ErrorStatus.GENERAL_FAILURE,
                        f"{who} answered {len(flags)} flags for "
                        f"{len(model.main.operations)} operations")
    return flags


def validate_request(model: HalModel, request) -> tuple[int, ...]:
    """Check a request's arguments against the main subgraph and its pools;
    the pools' sizes in bytes."""
    sizes = pool_sizes(request.pools)
    _check_request(model, request, sizes)
    return sizes


def pool_sizes(pools) -> tuple[int, ...]:
    """Each pool's size in bytes (``pool_view(pool, k).nbytes``; a C-contiguous
    numpy array, the runtime's usual pool, without making a view of it)."""
    sizes = []
    for p in pools:
        if p.__class__ is np.ndarray and p.flags.c_contiguous:
            sizes.append(p.nbytes)
        else:
            sizes.append(pool_view(p, len(sizes)).nbytes)
    return tuple(sizes)


def _check_request(model: HalModel, request, pool_sizes) -> None:
    sub: Subgraph = model.main
    for kind, args, indexes in (("input", request.inputs, sub.input_indexes),
                                ("output", request.outputs, sub.output_indexes)):
        if len(args) != len(indexes):
            raise invalid(f"request has {len(args)} {kind}s, the model has {len(indexes)}")
        for k, (arg, index) in enumerate(zip(args, indexes)):
            operand = sub.operands[index]
            what = f"request {kind} {k} (operand {index})"
            if arg.has_no_value:
                if kind == "output":
                    raise invalid(f"{what}: an output must have a buffer")
                continue
            loc = arg.location
            if loc is None or not 0 <= loc.pool_index < len(pool_sizes):
                raise invalid(f"{what}: pool index "
                              f"{None if loc is None else loc.pool_index} out of range "
                              f"({len(pool_sizes)} pools)")
            if loc.offset < 0 or loc.length < 0 or loc.offset + loc.length > pool_sizes[loc.pool_index]:
                raise invalid(f"{what}: region [{loc.offset}, {loc.offset + loc.length}) lies "
                              f"outside pool {loc.pool_index} of {pool_sizes[loc.pool_index]} bytes")
            dims = tuple(arg.dimensions) if arg.dimensions else operand.dimensions
            if arg.dimensions:
                if operand.type.is_scalar:
                    raise invalid(f"{what}: dimensions given for a scalar")
                if operand.dimensions and len(arg.dimensions) != len(operand.dimensions):
                    raise invalid(f"{what}: rank {len(arg.dimensions)} differs from the "
                                  f"operand's rank {len(operand.dimensions)}")
                for d, m in zip(arg.dimensions, operand.dimensions):
                    if m and d != m:
                        raise invalid(f"{what}: dimensions {list(arg.dimensions)} conflict with "
                                      f"the operand's {list(operand.dimensions)}")
            if kind == "input":
                if operand.type.is_tensor and (not dims or 0 in dims):
                    raise invalid(f"{what}: dimensions {list(dims)} are not fully specified; "
                                  f"give them with the input")
                need = (operand.type.element_size * int(np.prod(dims, dtype=np.int64))
                        if operand.type.is_tensor else operand.byte_size)
                if loc.length != need:
                    raise invalid(f"{what}: needs {need} bytes, region has {loc.length}")
