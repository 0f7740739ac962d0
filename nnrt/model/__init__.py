"""The model graph: NNAPI types, the HAL model, the builder, validation, dumps.

Validation (``validate.py``) uses the operation registry and the builder is
exported from the top-level ``nnrt`` package; this ``__init__`` imports only
the leaf modules so ``nnrt.ops`` can import ``nnrt.model.types`` freely.
"""
from .dot import to_dot
from .graph import ChannelQuant, DataLocation, HalModel, Operand, Operation, Subgraph
from .types import (FusedActivation, HalVersion, OperandLifeTime, OperandType, OperationType,
                    PaddingScheme)

__all__ = ["ChannelQuant", "DataLocation", "FusedActivation", "HalModel", "HalVersion", "Operand",
           "OperandLifeTime", "OperandType", "Operation", "OperationType", "PaddingScheme",
           "Subgraph", "to_dot"]
