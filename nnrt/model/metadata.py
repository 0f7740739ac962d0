"""What a model says about its inputs and outputs beyond their operands:
names, the dtype and shape an app sees (unknown dimensions as None),
quantization, and which inputs and outputs are the state of a stateful model.

An importer (``nnrt.tflite``) fills this in; the runtime uses it to accept
inputs by name and to carry state between executions
(``nnrt.runtime.signature``). A model built by hand has none, and the runtime
describes its operands instead.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Quantization:
    """Real value = scale * (q - zero_point); per channel along ``dimension``
    when there is more than one scale."""

    scales: tuple[float, ...]
    zero_points: tuple[int, ...]
    dimension: int = 0


@dataclass(frozen=True)
class TensorInfo:
    """One input or output as an app sees it (LiteRT's ``get_input_details``,
    ONNX Runtime's ``get_inputs``)."""

    name: str
    dtype: np.dtype
    shape: tuple[int | None, ...]     # None where the size is only known at execution
    quantization: Quantization | None = None
    signature_name: str | None = None  # the name in the model's signature, when it has one


@dataclass(frozen=True)
class ModelMetadata:
    """Descriptions of every model input and output, in operand order.

    ``states`` pairs a state input with the state output that gives its next
    value (positions among the model's inputs and outputs): the runtime feeds
    output ``o`` of execution k as input ``i`` of execution k + 1, and an app
    passes neither. ``initial_states`` gives, per pair, the value the first
    execution (and the first after ``reset_state``) starts from, None for
    zeros; empty when every state starts from zeros.
    """

    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]
    states: tuple[tuple[int, int], ...] = ()
    signature: str | None = None      # the signature key (e.g. "serving_default")
    source: str | None = None         # where the model came from (a file name)
    # Arrays: left out of ==, which would compare them element by element.
    initial_states: tuple[np.ndarray | None, ...] = field(default=(), compare=False)
