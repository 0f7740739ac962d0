"""The HAL model: plain data, as a driver receives it.

A :class:`Model` is the HAL 1.3 ``Model``: a main :class:`Subgraph`, the
subgraphs referenced by IF/WHILE operands, the bytes of the small constants
(``operand_values``) and the memory pools that hold large ones. It is
immutable once built (the app-facing builder in ``builder.py`` makes one at
``finish``) and carries no behaviour beyond reading its own constants.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..memory import as_buffer
from .types import OperandLifeTime, OperandType, OperationType


@dataclass(frozen=True, slots=True)
class ChannelQuant:
    """Per-channel quantization of a TENSOR_QUANT8_SYMM_PER_CHANNEL operand."""

    channel_dim: int
    scales: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class DataLocation:
    """Where an operand's bytes live: ``pool_index`` -1 means ``operand_values``."""

    pool_index: int
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class Operand:
    type: OperandType
    dimensions: tuple[int, ...] = ()   # 0 = unknown extent; () on a tensor = unknown rank
    scale: float = 0.0
    zero_point: int = 0
    lifetime: OperandLifeTime = OperandLifeTime.TEMPORARY_VARIABLE
    location: DataLocation | None = None  # constants; SUBGRAPH holds the subgraph index
    channel_quant: ChannelQuant | None = None
    extra_params: bytes | None = None     # extension operand data (opaque)

    @property
    def is_fully_specified(self) -> bool:
        if self.type.is_scalar:
            return True
        return len(self.dimensions) > 0 and all(d > 0 for d in self.dimensions)

    @property
    def byte_size(self) -> int:
        """Bytes a value of this operand takes, 0 when its shape is not fully known."""
        if self.type.is_scalar:
            return self.type.element_size if self.type != OperandType.BOOL else 1
        if not self.is_fully_specified:
            return 0
        return int(np.prod(self.dimensions, dtype=np.int64)) * self.type.element_size


@dataclass(frozen=True, slots=True)
class Operation:
    type: OperationType
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Subgraph:
    operands: tuple[Operand, ...]
    operations: tuple[Operation, ...]
    input_indexes: tuple[int, ...]
    output_indexes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ExtensionPrefix:
    name: str
    prefix: int


@dataclass(frozen=True)
class HalModel:
    main: Subgraph
    referenced: tuple[Subgraph, ...] = ()
    operand_values: bytes = b""
    pools: tuple[Sequence, ...] = ()  # bytes-like objects or nnrt.memory.Memory
    relax_computation_float32_to_float16: bool = False
    extension_prefixes: tuple[ExtensionPrefix, ...] = ()
    _constants: dict = field(default_factory=dict, repr=False, compare=False)
    # What validation learned of this model (``nnrt.hal.validate``), kept
    # with it: a model is immutable once built, so the runtime, the QoS
    # front and the driver each asking costs one validation. Not copied by
    # ``dataclasses.replace`` (init=False): a changed model is validated anew.
    _validated: list = field(default_factory=list, init=False, repr=False, compare=False)

    def subgraph(self, index: int | None) -> Subgraph:
        """``None`` is the main subgraph, an int a referenced one."""
        return self.main if index is None else self.referenced[index]

    def constant_bytes(self, operand: Operand) -> memoryview:
        loc = operand.location
        if loc is None:
            raise ValueError("operand has no location")
        if loc.pool_index < 0:
            return memoryview(self.operand_values)[loc.offset:loc.offset + loc.length]
        return as_buffer(self.pools[loc.pool_index])[loc.offset:loc.offset + loc.length]

    def constant_value(self, operand: Operand):
        """The value of a CONSTANT_COPY/CONSTANT_REFERENCE operand: a read-only
        numpy array for tensors, a Python scalar for scalars."""
        return decode_value(operand, self.constant_bytes(operand))


def decode_value(operand: Operand, raw) -> object:
    """Turn the bytes of a value of ``operand`` into a numpy array or a scalar."""
    t = operand.type
    if t.is_scalar:
        arr = np.frombuffer(raw, dtype=t.dtype, count=1)
        if t == OperandType.BOOL:
            return bool(arr[0])
        if t in (OperandType.FLOAT32, OperandType.FLOAT16):
            return float(arr[0])
        return int(arr[0])
    arr = np.frombuffer(raw, dtype=t.dtype)
    return arr.reshape(operand.dimensions) if operand.dimensions else arr
