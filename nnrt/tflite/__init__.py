"""Import ``.tflite`` models: ``nnrt.tflite.load(path_or_bytes) -> nnrt.Model``.

The flatbuffer is read with the ``tflite`` package (:mod:`.reader`) and each
operator is lowered to NNAPI operations (:mod:`.lower`). The model keeps the
tensor and signature names of its inputs and outputs, and the state of
stateful operators and of resource variables as paired state inputs/outputs
with the values they start from (``Model.metadata``).
"""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import invalid
from ..model.builder import Model
from .lower import lower_graph
from .reader import TfliteFile, read

__all__ = ["load", "read"]


def load(source: str | os.PathLike | bytes | bytearray | memoryview, *, subgraph: int = 0,
         name: str | None = None) -> Model:
    """Import a TFLite model (a file path or the file's bytes) as a finished
    ``nnrt.Model``; ``subgraph`` picks the graph that becomes the model (its
    control-flow bodies come along). A file that cannot be read, or an
    operator with no NNAPI lowering, raises ``NnrtError`` INVALID_ARGUMENT
    naming the model, the operator and its index."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        name = name or "<bytes>"
    else:
        path = Path(source)
        name = name or path.name
        try:
            data = path.read_bytes()
        except OSError as e:
            raise invalid(f"cannot read {str(path)!r}: {e.strerror or e}") from None
    file = read(data, name)
    if not 0 <= subgraph < len(file.graphs):
        raise invalid(f"{name}: subgraph {subgraph} does not exist (the file has "
                      f"{len(file.graphs)})")
    return lower_graph(file, subgraph, {})


def load_operators(file: TfliteFile, subgraph: int, operators: list[int]) -> Model:
    """A model of just ``operators`` of ``subgraph``: its inputs are the
    tensors those operators read that are neither constant nor written by one
    of them, its outputs what they write. Used to compare single operations
    with another runtime's (scripts/check_models.py)."""
    graph = file.graphs[subgraph]
    chosen = [graph.operators[k] for k in operators]
    written = {t for op in chosen for t in op.outputs}
    inputs = []
    for op in chosen:
        for t in op.inputs:
            if t >= 0 and t not in written and graph.tensors[t].data is None \
                    and t not in inputs:
                inputs.append(t)
    outputs = [t for op in chosen for t in op.outputs]
    return lower_graph(file, subgraph, {}, operators=chosen, inputs=tuple(inputs),
                       outputs=tuple(outputs))
