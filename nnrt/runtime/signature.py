"""A compiled model's inputs and outputs as the app sees them.

Pure bookkeeping, no I/O and no devices: :class:`Signature` describes the
inputs and outputs (names, dtypes, shapes, quantization — from the model's
metadata, or from its operands when it was built by hand), turns inputs given
as a dict keyed by name into the ordered list the HAL request needs, and
carries the state of a stateful model between executions.

State: a model whose metadata pairs state inputs with state outputs (an
imported LSTM's variable tensors, a model's resource variables) takes its
state inputs from here, not from the app. Execution k's state outputs become
execution k + 1's state inputs; the app sees neither. The first execution
starts from the metadata's initial states (zeros where it has none), and
``reset_state`` goes back to them. The runtime keeps the
state in device memories when it can (:meth:`Signature.keep_state_in`: two
per state pair, taking turns as the state input and the state output, so
the state stays in the driver and never crosses into the app); otherwise in
numpy arrays on the app side, crossing to the driver with each request.
``transfers`` counts how often the state's bytes crossed between the app side
and the driver. Executions of one stateful model must run one after another
— two at once would both read the same state.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping, Sequence

import numpy as np

from ..errors import invalid
from ..model.builder import Model
from ..model.metadata import ModelMetadata, Quantization, TensorInfo


def describe(model: Model) -> ModelMetadata:
    """The model's metadata, or a description of its operands when it has
    none (names ``input<k>`` / ``output<k>``)."""
    if model.metadata is not None:
        return model.metadata
    main = model.hal_model.main

    def info(prefix: str, k: int, index: int) -> TensorInfo:
        operand = main.operands[index]
        q = None
        if operand.channel_quant is not None:
            q = Quantization(operand.channel_quant.scales, (0,) * len(operand.channel_quant.scales),
                             operand.channel_quant.channel_dim)
        elif operand.type.is_quantized:
            q = Quantization((operand.scale,), (operand.zero_point,))
        shape = tuple(d or None for d in operand.dimensions)
        return TensorInfo(f"{prefix}{k}", operand.type.dtype, shape, q)
    return ModelMetadata(tuple(info("input", k, i) for k, i in enumerate(main.input_indexes)),
                         tuple(info("output", k, i) for k, i in enumerate(main.output_indexes)))


class Signature:
    """Inputs and outputs of one compiled model, and its carried state."""

    def __init__(self, model: Model):
        meta = describe(model)
        self._total_inputs = len(meta.inputs)
        self._total_outputs = len(meta.outputs)
        self._state_pairs = list(meta.states)
        # A plain attribute, not a property: read on every execution (issue 16).
        self.stateful = bool(self._state_pairs)
        state_in = {i for i, _ in meta.states}
        state_out = {o for _, o in meta.states}
        self._input_positions = [k for k in range(len(meta.inputs)) if k not in state_in]
        self._output_positions = [k for k in range(len(meta.outputs)) if k not in state_out]
        self.inputs: list[TensorInfo] = [meta.inputs[k] for k in self._input_positions]
        self.outputs: list[TensorInfo] = [meta.outputs[k] for k in self._output_positions]
        self._state_info = [meta.inputs[i] for i, _ in meta.states]
        self._initial = [np.zeros(info.shape, info.dtype) if value is None else
                         np.array(value, info.dtype, copy=True)
                         for info, value in zip(self._state_info,
                                                meta.initial_states or [None] * len(meta.states))]
        for info in self._state_info:
            if any(d is None for d in info.shape):
                raise invalid(f"state input {info.name!r} has unknown dimensions {info.shape}")
        self._positions_by_name: dict[str, int] = {}
        for k, info in enumerate(self.inputs):
            for key in (info.name, info.signature_name):
                if key:
                    self._positions_by_name.setdefault(key, k)
        self._memories: list[list] | None = None   # per pair: [current, next] memory
        self._reset_pending = True
        self.transfers = 0
        self.reset_state()

    @property
    def state_pairs(self) -> list[tuple[int, int]]:
        """(model input, model output) of each state."""
        return list(self._state_pairs)

    def outputs_known(self) -> bool:
        """Whether every output the app sees has a known shape (the runtime
        can then make them itself beside the state's memories)."""
        return all(None not in info.shape for info in self.outputs)

    def keep_state_in(self, memories) -> None:
        """Keep the state in ``memories`` from now on: per state pair, two
        memories (``nnrt.DeviceMemory``) that take turns as its input and
        its output. They start from the initial state (``reset_pending``)."""
        self._memories = [list(pair) for pair in memories]
        self._reset_pending = True

    @property
    def memories(self) -> list[list] | None:
        return self._memories

    def drop_memories(self) -> list:
        """Go back to numpy state (the initial one); the memories, to close."""
        memories, self._memories = self._memories or [], None
        self.reset_state()
        return [m for pair in memories for m in pair]

    @property
    def reset_pending(self) -> bool:
        """The state's memories must be given the initial state before the
        next execution."""
        return self._memories is not None and self._reset_pending

    def moved(self, memories) -> None:
        """``memories`` moved out of a dead driver into the runtime's shared
        memory: when the state's are among them, its bytes crossed to the
        app side once."""
        mine = {id(m) for pair in self._memories or () for m in pair}
        if any(id(m) in mine for m in memories):
            self.transfers += 1

    def reset_done(self) -> None:
        self._reset_pending = False
        self.transfers += 1

    def model_index(self, kind: str, k: int) -> int:
        """The model's own index of the app's input (output) ``k``."""
        positions = self._input_positions if kind == "input" else self._output_positions
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < len(positions):
            raise invalid(f"{kind} index {k!r} is not one of the model's {len(positions)} "
                          f"{kind}s")
        return positions[k]

    def app_values(self, kind: str, values: Sequence) -> list:
        """The app's inputs (outputs) among ``values``, one per model input
        (output), state included."""
        positions = self._input_positions if kind == "input" else self._output_positions
        return [values[k] for k in positions]

    def reset_state(self) -> None:
        """The next execution starts from the initial state (for memories: the
        runtime writes it into them before the next execution)."""
        self._state = [value.copy() for value in self._initial]
        self._reset_pending = True

    def initial_state(self) -> list[np.ndarray]:
        """The state the first execution starts from (copies)."""
        return [value.copy() for value in self._initial]

    def state(self) -> list[np.ndarray]:
        """The state the next execution starts from (copies)."""
        return [s.copy() for s in self._state]

    def order_inputs(self, inputs: Sequence[Any] | Mapping[str, Any]) -> list:
        """The app's inputs (a list in order, or a dict keyed by tensor or
        signature name) as the list of every model input, state included."""
        if inputs.__class__ is not list and isinstance(inputs, Mapping):
            ordered: list = [_MISSING] * len(self.inputs)
            for key, value in inputs.items():
                if key not in self._positions_by_name:
                    raise invalid(f"no input named {key!r}; inputs: "
                                  f"{[i.signature_name or i.name for i in self.inputs]}")
                ordered[self._positions_by_name[key]] = value
            missing = [self.inputs[k].name for k, v in enumerate(ordered) if v is _MISSING]
            if missing:
                raise invalid(f"missing inputs {missing}")
        else:
            ordered = list(inputs)
        if not self._state_pairs:
            return ordered
        if len(ordered) != len(self.inputs):
            raise invalid(f"the model takes {len(self.inputs)} inputs (its state is carried "
                          f"by the runtime), got {len(ordered)}")
        full: list = [None] * self._total_inputs
        for k, value in zip(self._input_positions, ordered):
            full[k] = value
        current = self._state if self._memories is None else [m[0] for m in self._memories]
        for (i, _), value in zip(self._state_pairs, current):
            full[i] = value
        return full

    def order_outputs(self, outputs: Sequence | None) -> Sequence | None:
        """The app's output buffers plus buffers (or the next memories) for
        the state outputs. With memories every output is given: the app's
        are made here when it gave none."""
        if not self._state_pairs or (outputs is None and self._memories is None):
            return outputs
        if outputs is None:
            outputs = [np.empty(info.shape, info.dtype) for info in self.outputs]
        if len(outputs) != len(self.outputs):
            raise invalid(f"the model has {len(self.outputs)} outputs, got {len(outputs)} "
                          f"output arrays")
        full: list = [None] * self._total_outputs
        for k, value in zip(self._output_positions, outputs):
            full[k] = value
        if self._memories is not None:
            for (_, o), pair in zip(self._state_pairs, self._memories):
                full[o] = pair[1]
            return full
        for (_, o), info in zip(self._state_pairs, self._state_info):
            full[o] = np.empty(info.shape, info.dtype)
        return full

    def carry_state(self, result):
        """Keep the state outputs of ``result`` for the next execution and
        return the result without them."""
        if not self._state_pairs:
            return result
        if self._memories is not None:
            for pair in self._memories:   # the output just written is the next input
                pair.reverse()
        else:
            self._state = [np.array(result.outputs[o], copy=True) for _, o in self._state_pairs]
            self.transfers += 1
        keep = self._output_positions
        return replace(result, outputs=[result.outputs[k] for k in keep],
                       output_shapes=[result.output_shapes[k] for k in keep])


_MISSING = object()
