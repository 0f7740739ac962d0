"""The app-facing model builder, ``nnrt.Model`` (ANeuralNetworksModel).

Operands and operations are added one by one, checked as they come (BAD_DATA
naming the operand or operation at fault); ``finish`` sorts the operations
into run order, checks the graph as a whole and freezes the model into the
HAL :class:`~nnrt.model.graph.HalModel`. Every mutating call after ``finish`` is
refused with BAD_STATE, as AOSP's ModelBuilder does. Operation signatures are
checked when the model is compiled (by the driver that prepares it), not here:
the CTS requires ``finish`` to succeed for any model whose building succeeded.
"""
from __future__ import annotations

import heapq
from dataclasses import replace
from typing import Any, Sequence

import numpy as np

from ..errors import NnrtError, bad_state, invalid
from .extensions import (ExtensionOperandType, ExtensionOperationType, TYPE_WITHIN_BITS,
                         MAX_PREFIX, known_extension, operand_type, operation_type,
                         check_extension_name)
from .graph import (ChannelQuant, DataLocation, ExtensionPrefix, HalModel, Operand, Operation,
                    Subgraph)
from ..memory import Memory
from .metadata import ModelMetadata
from .types import OperandLifeTime as L, OperandType, OperationType

# Values up to this size are copied at set_operand_value; larger ones are kept
# by reference until finish, like ANEURALNETWORKS_MAX_SIZE_OF_IMMEDIATELY_COPIED_VALUES.
MAX_SIZE_OF_IMMEDIATELY_COPIED_VALUES = 128
_POOL_ALIGNMENT = 64  # large constants start on a cache line so kernels read aligned data


class Model:
    """Builds a model graph. See DESIGN.md, "Public API"."""

    def __init__(self) -> None:
        self._operands: list[Operand] = []
        self._operations: list[Operation] = []
        self._inputs: tuple[int, ...] | None = None
        self._outputs: tuple[int, ...] | None = None
        self._small_values = bytearray()
        self._large_values: list[tuple[int, memoryview]] = []  # (operand, value) kept by reference
        self._relaxed = False
        self._models: dict[int, "Model"] = {}  # SUBGRAPH operand -> referenced model
        self._memories: dict[int, tuple] = {}  # operand -> (Memory, offset, length)
        self._hal: HalModel | None = None
        self._metadata: ModelMetadata | None = None
        self._prefixes: dict[str, int] = {}  # extension name -> prefix, assigned on first use

    # --- state ---------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self._hal is not None

    @property
    def hal_model(self) -> HalModel:
        """The frozen HAL model; only after :meth:`finish`."""
        if self._hal is None:
            raise bad_state("model is not finished")
        return self._hal

    def __repr__(self) -> str:
        kinds = sorted({op.type.name for op in self._operations})
        io = ""
        if self._inputs is not None:
            io = f", inputs {list(self._inputs)}, outputs {list(self._outputs)}"
        return (f"<nnrt.Model {'finished' if self.finished else 'being built'}: "
                f"{len(self._operands)} operands, {len(self._operations)} operations"
                f"{' (' + ', '.join(kinds[:6]) + (', ...' if len(kinds) > 6 else '') + ')' if kinds else ''}"
                f"{io}>")

    def _check_mutable(self, what: str) -> None:
        if self._hal is not None:
            raise bad_state(f"{what} after finish(): the model is immutable")

    def _operand_index(self, index: int, what: str) -> int:
        if not isinstance(index, (int, np.integer)) or isinstance(index, bool) \
                or not 0 <= index < len(self._operands):
            raise invalid(f"{what}: operand index {index!r} out of range "
                          f"(model has {len(self._operands)} operands)")
        return int(index)

    @property
    def operand_count(self) -> int:
        return len(self._operands)

    def operand(self, index: int) -> Operand:
        return self._operands[self._operand_index(index, "operand")]

    # --- extensions ------------------------------------------------------------
    def _prefix(self, name: str) -> int:
        """This model's prefix for extension ``name``, assigned on first use."""
        check_extension_name(name)
        if name not in self._prefixes:
            if len(self._prefixes) >= MAX_PREFIX:
                raise invalid("the model uses more extensions than prefixes exist")
            self._prefixes[name] = len(self._prefixes) + 1   # 0 means "not an extension"
        return self._prefixes[name]

    @property
    def _prefix_map(self) -> dict[int, str]:
        return {p: n for n, p in self._prefixes.items()}

    def get_extension_operand_type(self, extension: str, type_within: int) -> ExtensionOperandType:
        """The operand type ``type_within`` of extension ``extension`` in this
        model (ANeuralNetworksModel_getExtensionOperandType). The extension's
        definition must be known in this process (nnrt.model.extensions)."""
        self._check_mutable("get_extension_operand_type")
        ext = known_extension(extension)
        if isinstance(type_within, bool) or not isinstance(type_within, (int, np.integer)) \
                or not 0 <= type_within <= MAX_PREFIX:
            raise invalid(f"get_extension_operand_type: type {type_within!r} is not in [0, 65535]")
        info = ext.operand_type_info(int(type_within))
        code = (self._prefix(ext.name) << TYPE_WITHIN_BITS) | int(type_within)
        return ExtensionOperandType(code, ext.name, info)

    def get_extension_operation_type(self, extension: str,
                                     type_within: int) -> ExtensionOperationType:
        """The operation type ``type_within`` of extension ``extension`` in
        this model (ANeuralNetworksModel_getExtensionOperationType)."""
        self._check_mutable("get_extension_operation_type")
        check_extension_name(extension)
        if isinstance(type_within, bool) or not isinstance(type_within, (int, np.integer)) \
                or not 0 <= type_within <= MAX_PREFIX:
            raise invalid(f"get_extension_operation_type: type {type_within!r} is not in "
                          f"[0, 65535]")
        code = (self._prefix(extension) << TYPE_WITHIN_BITS) | int(type_within)
        return operation_type(code, self._prefix_map)

    def set_operand_extension_data(self, index: int, data: bytes | None) -> None:
        """Attach an opaque blob to extension operand ``index``
        (ANeuralNetworksModel_setOperandExtensionData); None removes it."""
        self._check_mutable("set_operand_extension_data")
        index = self._operand_index(index, "set_operand_extension_data")
        operand = self._operands[index]
        if not operand.type.is_extension:
            raise invalid(f"set_operand_extension_data: operand {index} is {operand.type.name}, "
                          f"not an extension operand type")
        if data is not None and not isinstance(data, (bytes, bytearray, memoryview)):
            raise invalid(f"set_operand_extension_data: expected bytes, got "
                          f"{type(data).__name__}")
        self._operands[index] = replace(operand,
                                        extra_params=None if data is None else bytes(data))

    # --- building --------------------------------------------------------------
    def add_operand(self, type: OperandType | int, dimensions: Sequence[int] | None = None, *,
                    scale: float = 0.0, zero_point: int = 0,
                    channel_quant: tuple[int, Sequence[float]] | None = None) -> int:
        """Add an operand and return its index. ``dimensions`` None or [] is a
        scalar for scalar types and an unknown rank for tensor types; a 0
        extent is unknown. ``type`` may be an extension type of this model
        (:meth:`get_extension_operand_type`)."""
        self._check_mutable("add_operand")
        if isinstance(type, ExtensionOperandType) \
                and self._prefixes.get(type.extension) != type.prefix:
            raise invalid(f"add_operand: {type.name} was made by another model "
                          f"(prefixes are per model)")
        try:
            type = operand_type(type, self._prefix_map)
        except NnrtError as e:
            raise invalid(f"add_operand: {e.message}") from None
        except TypeError:
            raise invalid(f"add_operand: unknown operand type {type!r}") from None
        index = len(self._operands)
        dims = tuple(int(d) for d in (dimensions or ()))
        if type.is_scalar and dims:
            raise invalid(f"add_operand: operand {index} of scalar type {type.name} "
                          f"cannot have dimensions {list(dims)}")
        if any(d < 0 for d in dims):
            raise invalid(f"add_operand: operand {index} has a negative dimension {list(dims)}")
        cq = None
        if type == OperandType.TENSOR_QUANT8_SYMM_PER_CHANNEL:
            if channel_quant is not None:
                channel_dim, scales = channel_quant
                cq = ChannelQuant(int(channel_dim), tuple(float(s) for s in scales))
                if dims and not 0 <= cq.channel_dim < len(dims):
                    raise invalid(f"add_operand: operand {index} channel_dim {cq.channel_dim} "
                                  f"outside rank {len(dims)}")
                if dims and dims[cq.channel_dim] and len(cq.scales) != dims[cq.channel_dim]:
                    raise invalid(f"add_operand: operand {index} has {len(cq.scales)} channel "
                                  f"scales for {dims[cq.channel_dim]} channels")
                if any(not s > 0 for s in cq.scales):
                    raise invalid(f"add_operand: operand {index} has a non-positive channel scale")
        elif channel_quant is not None:
            raise invalid(f"add_operand: operand {index}: channel_quant only applies to "
                          f"TENSOR_QUANT8_SYMM_PER_CHANNEL, not {type.name}")
        if type.is_quantized and type != OperandType.TENSOR_QUANT8_SYMM_PER_CHANNEL:
            if not float(scale) > 0:
                raise invalid(f"add_operand: quantized operand {index} ({type.name}) needs a "
                              f"positive scale, got {scale}")
        if scale < 0:
            raise invalid(f"add_operand: operand {index} has negative scale {scale}")
        self._operands.append(Operand(type=type, dimensions=dims, scale=float(scale),
                                      zero_point=int(zero_point), channel_quant=cq))
        return index

    def set_operand_value(self, index: int, value: Any) -> None:
        """Give operand ``index`` a constant value; ``None`` marks an omitted
        optional operand. Values of up to 128 bytes are copied now; larger
        numpy arrays are kept by reference until :meth:`finish` (do not change
        them before then), as NNAPI does."""
        self._check_mutable("set_operand_value")
        index = self._operand_index(index, "set_operand_value")
        operand = self._operands[index]
        if operand.type == OperandType.SUBGRAPH:
            raise invalid(f"set_operand_value: operand {index} is a SUBGRAPH operand; "
                          f"reference a model instead")
        self._models.pop(index, None)
        self._memories.pop(index, None)
        if value is None:
            self._operands[index] = replace(operand, lifetime=L.NO_VALUE, location=None)
            return
        data = self._value_bytes(index, operand, value)
        if len(data) <= MAX_SIZE_OF_IMMEDIATELY_COPIED_VALUES:
            offset = len(self._small_values)
            self._small_values += data
            self._operands[index] = replace(operand, lifetime=L.CONSTANT_COPY,
                                            location=DataLocation(-1, offset, len(data)))
        else:
            self._large_values = [(i, v) for i, v in self._large_values if i != index]
            self._large_values.append((index, data))
            self._operands[index] = replace(operand, lifetime=L.CONSTANT_REFERENCE,
                                            location=DataLocation(0, 0, len(data)))

    def set_operand_value_from_memory(self, index: int, memory: Memory, offset: int,
                                      length: int) -> None:
        """Give operand ``index`` the constant value at ``[offset, offset +
        length)`` of ``memory`` (CONSTANT_REFERENCE). The memory is shared with
        the drivers, not copied: keep it open and unchanged while the model or
        its compilations are in use."""
        self._check_mutable("set_operand_value_from_memory")
        index = self._operand_index(index, "set_operand_value_from_memory")
        operand = self._operands[index]
        if not isinstance(memory, Memory):
            raise invalid(f"set_operand_value_from_memory: expected an nnrt.Memory, got "
                          f"{type(memory).__name__}")
        if operand.type == OperandType.SUBGRAPH or not operand.is_fully_specified:
            raise invalid(f"set_operand_value_from_memory: operand {index} "
                          f"({operand.type.name} {list(operand.dimensions)}) cannot take a "
                          f"value from memory")
        if length != operand.byte_size:
            raise invalid(f"set_operand_value_from_memory: operand {index} needs "
                          f"{operand.byte_size} bytes, got length {length}")
        if offset < 0 or offset + length > memory.size:
            raise invalid(f"set_operand_value_from_memory: [{offset}, {offset + length}) lies "
                          f"outside the memory of {memory.size} bytes")
        self._models.pop(index, None)
        self._large_values = [(i, v) for i, v in self._large_values if i != index]
        self._memories[index] = (memory, int(offset), int(length))
        self._operands[index] = replace(operand, lifetime=L.CONSTANT_REFERENCE,
                                        location=DataLocation(0, int(offset), int(length)))

    def set_operand_value_from_model(self, index: int, model: "Model") -> None:
        """Make SUBGRAPH operand ``index`` refer to ``model`` (finished), the
        condition, branch or body of an IF or WHILE."""
        self._check_mutable("set_operand_value_from_model")
        index = self._operand_index(index, "set_operand_value_from_model")
        operand = self._operands[index]
        if operand.type != OperandType.SUBGRAPH:
            raise invalid(f"set_operand_value_from_model: operand {index} is "
                          f"{operand.type.name}, not SUBGRAPH")
        if not isinstance(model, Model):
            raise invalid(f"set_operand_value_from_model: expected an nnrt.Model, got "
                          f"{type(model).__name__}")
        if not model.finished:
            raise invalid("set_operand_value_from_model: the referenced model must be finished")
        self._memories.pop(index, None)
        self._large_values = [(i, v) for i, v in self._large_values if i != index]
        self._models[index] = model
        self._operands[index] = replace(operand, lifetime=L.SUBGRAPH,
                                        location=DataLocation(-1, 0, 0))

    @staticmethod
    def _value_bytes(index: int, operand: Operand, value: Any) -> memoryview:
        dtype = operand.type.dtype
        if isinstance(value, (bytes, bytearray, memoryview)):
            data = memoryview(value).cast("B")
        else:
            arr = np.asarray(value)
            if arr.dtype != dtype:
                if arr.dtype == object or not (np.can_cast(arr.dtype, dtype, "same_kind")
                                               or arr.dtype.kind in "iub" and dtype.kind in "iub"):
                    raise invalid(f"set_operand_value: operand {index} is {operand.type.name}; "
                                  f"a {arr.dtype} value does not convert to {dtype}")
                converted = arr.astype(dtype)
                if dtype.kind in "iu" and not np.array_equal(converted, arr):
                    raise invalid(f"set_operand_value: operand {index}: value out of range "
                                  f"for {operand.type.name}")
                arr = converted
            arr = np.ascontiguousarray(arr)
            if operand.type.is_tensor and operand.dimensions and all(operand.dimensions) \
                    and arr.size != int(np.prod(operand.dimensions)):
                raise invalid(f"set_operand_value: operand {index} has dimensions "
                              f"{list(operand.dimensions)} ({int(np.prod(operand.dimensions))} "
                              f"elements), value has {arr.size}")
            data = memoryview(arr).cast("B")
        if operand.type.is_scalar:
            expected = operand.type.element_size
        elif operand.is_fully_specified:
            expected = operand.byte_size
        else:
            raise invalid(f"set_operand_value: operand {index} has unspecified dimensions "
                          f"{list(operand.dimensions)}; a constant must be fully specified")
        if len(data) != expected:
            raise invalid(f"set_operand_value: operand {index} ({operand.type.name}, dimensions "
                          f"{list(operand.dimensions)}) needs {expected} bytes, got {len(data)}")
        return data

    def add_operation(self, type: OperationType | int, inputs: Sequence[int],
                      outputs: Sequence[int]) -> int:
        """Add an operation; returns its index (in the order added)."""
        self._check_mutable("add_operation")
        index = len(self._operations)
        if isinstance(type, ExtensionOperationType) \
                and self._prefixes.get(type.extension) != type.prefix:
            raise invalid(f"add_operation: {type.name} was made by another model "
                          f"(prefixes are per model)")
        try:
            type = operation_type(type, self._prefix_map)
        except NnrtError as e:
            raise invalid(f"add_operation: {e.message}") from None
        except TypeError:
            raise invalid(f"add_operation: unknown operation type {type!r}") from None
        ins = tuple(self._operand_index(i, f"add_operation {index} ({type.name}) input")
                    for i in inputs)
        outs = tuple(self._operand_index(i, f"add_operation {index} ({type.name}) output")
                     for i in outputs)
        if not outs:
            raise invalid(f"add_operation {index} ({type.name}) has no outputs")
        for o in outs:
            if self._operands[o].lifetime != L.TEMPORARY_VARIABLE:
                raise invalid(f"add_operation {index} ({type.name}): output operand {o} "
                              f"is a constant or omitted value")
        self._operations.append(Operation(type, ins, outs))
        return index

    def identify_inputs_and_outputs(self, inputs: Sequence[int], outputs: Sequence[int]) -> None:
        self._check_mutable("identify_inputs_and_outputs")
        ins = tuple(self._operand_index(i, "identify_inputs_and_outputs input") for i in inputs)
        outs = tuple(self._operand_index(i, "identify_inputs_and_outputs output") for i in outputs)
        for i in ins + outs:
            if self._operands[i].lifetime != L.TEMPORARY_VARIABLE:
                raise invalid(f"identify_inputs_and_outputs: operand {i} is a constant or "
                              f"omitted value and cannot be a model input or output")
        if len(set(ins)) != len(ins) or len(set(outs)) != len(outs):
            raise invalid("identify_inputs_and_outputs: an operand is listed twice")
        both = set(ins) & set(outs)
        if both:
            raise invalid(f"identify_inputs_and_outputs: operand {min(both)} is both an input "
                          f"and an output")
        self._inputs, self._outputs = ins, outs

    def set_metadata(self, metadata: ModelMetadata) -> None:
        """Describe the model's inputs and outputs (names, app-side shapes,
        state pairs); one entry per input and output identified."""
        self._check_mutable("set_metadata")
        if self._inputs is None:
            raise invalid("set_metadata: call identify_inputs_and_outputs first")
        if len(metadata.inputs) != len(self._inputs) or len(metadata.outputs) != len(self._outputs):
            raise invalid(f"set_metadata: {len(metadata.inputs)} inputs and "
                          f"{len(metadata.outputs)} outputs described, the model has "
                          f"{len(self._inputs)} and {len(self._outputs)}")
        for i, o in metadata.states:
            if not (0 <= i < len(self._inputs) and 0 <= o < len(self._outputs)):
                raise invalid(f"set_metadata: state pair ({i}, {o}) names no input/output")
        if metadata.initial_states and len(metadata.initial_states) != len(metadata.states):
            raise invalid(f"set_metadata: {len(metadata.initial_states)} initial states for "
                          f"{len(metadata.states)} state pairs")
        for (i, _), value in zip(metadata.states, metadata.initial_states):
            info = metadata.inputs[i]
            if value is not None and (np.asarray(value).dtype != info.dtype
                                      or np.shape(value) != tuple(info.shape)):
                raise invalid(f"set_metadata: the initial state of input {i} is "
                              f"{np.asarray(value).dtype} {list(np.shape(value))}, the input "
                              f"{info.dtype} {list(info.shape)}")
        self._metadata = metadata

    @property
    def metadata(self) -> ModelMetadata | None:
        """Names and state pairs of the inputs and outputs, None if not given."""
        return self._metadata

    def relax_computation_float32_to_float16(self, allow: bool = True) -> None:
        self._check_mutable("relax_computation_float32_to_float16")
        self._relaxed = bool(allow)

    # --- finishing --------------------------------------------------------------
    def finish(self) -> "Model":
        """Check the graph, sort operations into run order and freeze the model."""
        self._check_mutable("finish")
        if self._inputs is None:
            raise invalid("finish: identify_inputs_and_outputs was not called")
        operands = list(self._operands)
        for i in self._inputs:
            operands[i] = replace(operands[i], lifetime=L.SUBGRAPH_INPUT)
        for i in self._outputs:
            operands[i] = replace(operands[i], lifetime=L.SUBGRAPH_OUTPUT)
        # Large constants go into one pool, each at an aligned offset.
        pool = bytearray()
        for index, data in self._large_values:
            pool += b"\0" * (-len(pool) % _POOL_ALIGNMENT)
            operands[index] = replace(operands[index],
                                      location=DataLocation(0, len(pool), len(data)))
            pool += data
        operations = _run_order(self._operations, operands)
        values = bytearray(self._small_values)
        pools: list = [bytes(pool)] if self._large_values else []
        pool_of_memory: dict[int, int] = {}
        for index, (memory, offset, length) in self._memories.items():
            if id(memory) not in pool_of_memory:
                pool_of_memory[id(memory)] = len(pools)
                pools.append(memory)
            operands[index] = replace(operands[index], location=DataLocation(
                pool_of_memory[id(memory)], offset, length))
        referenced: list[Subgraph] = []
        placed: dict[int, int] = {}
        for index, model in self._models.items():
            if model.hal_model.extension_prefixes:
                # Each model numbers its extensions itself; renumbering the
                # types of a referenced body is not done (yet).
                raise invalid(f"finish: the model referenced by operand {index} uses "
                              f"extensions; extension types inside IF/WHILE bodies are not "
                              f"supported")
            slot = _place(model.hal_model, values, pools, referenced, placed)
            operands[index] = replace(operands[index], location=DataLocation(-1, slot, 0))
        hal = HalModel(
            main=Subgraph(tuple(operands), tuple(operations), self._inputs, self._outputs),
            referenced=tuple(referenced),
            operand_values=bytes(values),
            pools=tuple(pools),
            relax_computation_float32_to_float16=self._relaxed,
            extension_prefixes=tuple(ExtensionPrefix(n, p) for n, p in self._prefixes.items()),
        )
        self._large_values = []  # the app may reuse its buffers from now on
        self._hal = hal
        return self


def _place(hal: HalModel, values: bytearray, pools: list, referenced: list,
           placed: dict[int, int]) -> int:
    """Append the main subgraph of the finished model ``hal`` (and everything it
    references) to ``referenced``, rebasing its constants into ``values`` and
    ``pools``; returns its index. A model referenced twice is placed once."""
    if id(hal) in placed:
        return placed[id(hal)]
    value_base = len(values)
    values += hal.operand_values
    pool_base = len(pools)
    pools.extend(hal.pools)
    # hal.referenced is already flat: reserve its slots first, then the main.
    first = len(referenced)
    referenced.extend([None] * (len(hal.referenced) + 1))
    slot = first + len(hal.referenced)
    placed[id(hal)] = slot

    def rebase(sub: Subgraph) -> Subgraph:
        operands = []
        for o in sub.operands:
            loc = o.location
            if o.lifetime == L.CONSTANT_COPY:
                o = replace(o, location=DataLocation(-1, loc.offset + value_base, loc.length))
            elif o.lifetime == L.CONSTANT_REFERENCE:
                o = replace(o, location=DataLocation(loc.pool_index + pool_base, loc.offset,
                                                     loc.length))
            elif o.lifetime == L.SUBGRAPH:
                o = replace(o, location=DataLocation(-1, loc.offset + first, 0))
            operands.append(o)
        return replace(sub, operands=tuple(operands))

    for k, sub in enumerate(hal.referenced):
        referenced[first + k] = rebase(sub)
    referenced[slot] = rebase(hal.main)
    return slot


def _run_order(operations: list[Operation], operands: list[Operand]) -> list[Operation]:
    """Topologically sort ``operations``; refuse cycles, operands written twice
    and operands read but never written."""
    writer: dict[int, int] = {}
    for n, op in enumerate(operations):
        for o in op.outputs:
            if o in writer:
                raise invalid(f"finish: operand {o} is written by operation {writer[o]} "
                              f"({operations[writer[o]].type.name}) and operation {n} "
                              f"({op.type.name})")
            if operands[o].lifetime == L.SUBGRAPH_INPUT:
                raise invalid(f"finish: operation {n} ({op.type.name}) writes model input "
                              f"operand {o}")
            writer[o] = n
    for n, op in enumerate(operations):
        for o in op.inputs:
            if operands[o].lifetime in (L.TEMPORARY_VARIABLE, L.SUBGRAPH_OUTPUT) \
                    and o not in writer:
                raise invalid(f"finish: operation {n} ({op.type.name}) reads operand {o}, "
                              f"which is never written")
    for o, operand in enumerate(operands):
        if operand.lifetime == L.SUBGRAPH_OUTPUT and o not in writer:
            raise invalid(f"finish: model output operand {o} is never written")
    # Kahn's algorithm, stable: among ready operations, keep the order added.
    pending = [sum(1 for o in set(op.inputs) if o in writer) for op in operations]
    readers: dict[int, list[int]] = {}
    for n, op in enumerate(operations):
        for o in set(op.inputs):
            if o in writer:
                readers.setdefault(o, []).append(n)

    ready = [n for n, p in enumerate(pending) if p == 0]
    heapq.heapify(ready)
    order: list[Operation] = []
    while ready:
        n = heapq.heappop(ready)
        order.append(operations[n])
        for o in operations[n].outputs:
            for r in readers.get(o, ()):
                pending[r] -= 1
                if pending[r] == 0:
                    heapq.heappush(ready, r)
    if len(order) != len(operations):
        stuck = [n for n, p in enumerate(pending) if p > 0]
        raise invalid(f"finish: the graph has a cycle through operation {stuck[0]} "
                      f"({operations[stuck[0]].type.name})")
    return order
