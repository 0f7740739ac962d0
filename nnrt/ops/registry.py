"""The operation registry: each NNAPI operation is declared here exactly once.

An entry has three parts, all pure functions:

* ``validate(op: OpView) -> HalVersion`` checks the signature (operand count,
  types, ranks, constant parameters that must be constant) and returns the
  oldest HAL version that accepts it; it raises :class:`NnrtError`
  (INVALID_ARGUMENT) naming the operand at fault otherwise.
* ``shape(op: OpView) -> list[tuple[int, ...]]`` infers output dimensions from
  what is known statically (0 = unknown extent, ``()`` for a tensor = unknown
  rank). Used at preparation to check declared outputs and to give shapes to
  temporaries.
* ``kernel(call: Call) -> list[np.ndarray]`` computes the outputs, each with
  the numpy dtype of its output operand type (quantized outputs already
  quantized). Kernels are vectorised numpy, and run with numpy's
  floating-point errors ignored (the executor sets that once per execution:
  an overflow or a division by zero gives inf or NaN, as on a device).

Operation families live one per module in this package
(``nnrt/ops/<family>.py``) and call :func:`register` at import time;
``nnrt.ops`` imports every module of the package, so adding a module is
enough to add its operations.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from ..errors import ErrorStatus, NnrtError, invalid
from ..model.extensions import Extension
from ..model.graph import ChannelQuant, HalModel, Operand, Operation
from ..model.types import HalVersion, OperandLifeTime, OperandType, OperationType


class OpView:
    """What a validator or shape function sees of one operation in one model."""

    def __init__(self, model: HalModel, subgraph_index: int | None, operation: Operation,
                 known_dims: dict[int, tuple[int, ...]] | None = None):
        self.model = model
        self.subgraph_index = subgraph_index
        self.operation = operation
        self.type = operation.type
        sub = model.subgraph(subgraph_index)
        self._operands = sub.operands
        self.inputs: list[Operand] = [sub.operands[i] for i in operation.inputs]
        self.outputs: list[Operand] = [sub.operands[i] for i in operation.outputs]
        self._known_dims = known_dims or {}

    # --- reading operands -------------------------------------------------
    def dims(self, i: int) -> tuple[int, ...]:
        """Dimensions of input ``i`` as best known (declared, or inferred upstream)."""
        return self._known_dims.get(self.operation.inputs[i], self.inputs[i].dimensions)

    def rank(self, i: int) -> int | None:
        """Rank of input ``i``, None when unknown."""
        d = self.dims(i)
        if not d and self.inputs[i].type.is_tensor:
            return None
        return len(d)

    def is_constant(self, i: int) -> bool:
        return self.inputs[i].lifetime in (OperandLifeTime.CONSTANT_COPY,
                                           OperandLifeTime.CONSTANT_REFERENCE)

    def is_omitted(self, i: int) -> bool:
        return self.inputs[i].lifetime == OperandLifeTime.NO_VALUE

    def value(self, i: int) -> Any:
        """Constant value of input ``i`` or None if it is not a constant."""
        if not self.is_constant(i):
            return None
        return self.model.constant_value(self.inputs[i])

    def subgraph_ref(self, i: int) -> int:
        """The referenced-subgraph index held by SUBGRAPH input ``i``."""
        operand = self.inputs[i]
        if operand.lifetime == OperandLifeTime.NO_VALUE:
            raise self.fail(f"input {i} (operand {self.operation.inputs[i]}) has no value; it "
                            f"must be a SUBGRAPH operand referring to a model")
        if operand.type != OperandType.SUBGRAPH or operand.lifetime != OperandLifeTime.SUBGRAPH \
                or operand.location is None:
            raise self.fail(f"input {i} (operand {self.operation.inputs[i]}) must be a "
                            f"SUBGRAPH operand referring to a model")
        index = operand.location.offset
        if not 0 <= index < len(self.model.referenced):
            raise self.fail(f"input {i} refers to subgraph {index}, which does not exist")
        return index

    def fail(self, message: str) -> NnrtError:
        return invalid(f"{self.type.name}: {message}")

    # --- signature checks (each raises INVALID_ARGUMENT naming the operand) ---
    def expect_counts(self, inputs: int | Sequence[int], outputs: int | Sequence[int]) -> None:
        ins = (inputs,) if isinstance(inputs, int) else tuple(inputs)
        outs = (outputs,) if isinstance(outputs, int) else tuple(outputs)
        if len(self.inputs) not in ins:
            raise self.fail(f"takes {' or '.join(map(str, ins))} inputs, got {len(self.inputs)}")
        if len(self.outputs) not in outs:
            raise self.fail(f"takes {' or '.join(map(str, outs))} outputs, got {len(self.outputs)}")

    def expect_types(self, inputs: Sequence[OperandType | None],
                     outputs: Sequence[OperandType | None]) -> None:
        """Check operand types position by position (None = not checked here).

        A trailing optional input may be shorter than ``inputs``: only the
        positions present are checked.
        """
        for pos, (want, got) in enumerate(zip(inputs, self.inputs)):
            if want is not None and got.type != want:
                raise self.fail(f"input {pos} (operand {self.operation.inputs[pos]}) must be "
                                f"{want.name}, got {got.type.name}")
        for pos, (want, got) in enumerate(zip(outputs, self.outputs)):
            if want is not None and got.type != want:
                raise self.fail(f"output {pos} (operand {self.operation.outputs[pos]}) must be "
                                f"{want.name}, got {got.type.name}")

    def expect_type_in(self, i: int, allowed: Sequence[OperandType]) -> OperandType:
        t = self.inputs[i].type
        if t not in allowed:
            raise self.fail(f"input {i} (operand {self.operation.inputs[i]}) has type {t.name}; "
                            f"accepted: {', '.join(a.name for a in allowed)}")
        return t

    def expect_rank(self, i: int, *ranks: int, at_most: int | None = None) -> None:
        """Input ``i`` must have one of ``ranks`` (or rank <= ``at_most``); unknown passes."""
        r = self.rank(i)
        if r is None:
            return
        if ranks and r not in ranks:
            raise self.fail(f"input {i} (operand {self.operation.inputs[i]}) must have rank "
                            f"{' or '.join(map(str, ranks))}, got {r}")
        if at_most is not None and r > at_most:
            raise self.fail(f"input {i} (operand {self.operation.inputs[i]}) must have rank "
                            f"at most {at_most}, got {r}")

    def expect_constant(self, *indexes: int) -> None:
        for i in indexes:
            if not self.is_constant(i):
                raise self.fail(f"input {i} (operand {self.operation.inputs[i]}) must be a constant")


class Arg(NamedTuple):
    """One input of a kernel call. ``value`` is a numpy array (tensors), a
    Python scalar (scalars) or None (omitted optional input).

    Immutable: the executor makes the Arg of a constant input once and
    hands the same one to every execution."""

    type: OperandType
    value: Any
    scale: float = 0.0
    zero_point: int = 0
    channel_quant: ChannelQuant | None = None

    @property
    def omitted(self) -> bool:
        return self.value is None


class Call:
    """A kernel invocation: inputs, declared outputs, and the executor's services."""

    __slots__ = ("type", "ins", "outs", "relaxed", "executor")

    def __init__(self, type: OperationType, ins: list[Arg], outs: Sequence[Operand],
                 relaxed: bool, executor: Any):
        self.type = type
        self.ins = ins
        self.outs = outs
        self.relaxed = relaxed
        # The executor that runs this call; control-flow kernels use it to run
        # referenced subgraphs (``executor.run_subgraph(index, values)``) and
        # to read the loop timeout.
        self.executor = executor

    def fail(self, message: str) -> NnrtError:
        return NnrtError(ErrorStatus.GENERAL_FAILURE, f"{self.type.name}: {message}")


Validate = Callable[[OpView], HalVersion]
Shape = Callable[[OpView], list[tuple[int, ...]]]
Kernel = Callable[[Call], list[np.ndarray]]


@dataclass(frozen=True, slots=True)
class OperationDef:
    type: OperationType
    validate: Validate
    shape: Shape
    kernel: Kernel


_REGISTRY: dict[OperationType, OperationDef] = {}
# Operations of nnrt's own extensions the reference driver runs, by
# (extension name, type within): a model numbers extensions itself, so the
# 32-bit code of an extension operation differs from model to model.
_EXTENSION_REGISTRY: dict[tuple[str, int], OperationDef] = {}
_EXTENSIONS: dict[str, Extension] = {}


def register(type: OperationType, *, validate: Validate, shape: Shape, kernel: Kernel) -> None:
    if type in _REGISTRY:
        raise RuntimeError(f"operation {type.name} registered twice")
    _REGISTRY[type] = OperationDef(type, validate, shape, kernel)


def register_extension(extension: Extension, type_within: int, *, validate: Validate,
                       shape: Shape, kernel: Kernel) -> None:
    """Register operation ``type_within`` of ``extension`` (one of nnrt's own,
    ``nnrt.extensions``): validated, shaped and run like NNAPI's own."""
    key = (extension.name, type_within)
    if key in _EXTENSION_REGISTRY:
        raise RuntimeError(f"operation {extension.name}:{type_within} registered twice")
    _EXTENSION_REGISTRY[key] = OperationDef(type_within, validate, shape, kernel)
    _EXTENSIONS[extension.name] = extension


def definition(type: OperationType) -> OperationDef:
    try:
        if type.is_extension:
            return _EXTENSION_REGISTRY[(type.extension, type.type_within)]
        return _REGISTRY[type]
    except KeyError:
        raise invalid(f"operation {type.name} is not supported") from None


def has_definition(type: OperationType) -> bool:
    """Whether :func:`definition` knows ``type`` (an extension operation's
    semantics are otherwise the driver's)."""
    if type.is_extension:
        return (type.extension, type.type_within) in _EXTENSION_REGISTRY
    return type in _REGISTRY


def registered_extensions() -> list[Extension]:
    """The extensions whose operations the registry runs."""
    return list(_EXTENSIONS.values())


def registered() -> dict[OperationType, OperationDef]:
    return dict(_REGISTRY)
