"""Sample drivers: the reference kernels behind a narrower claim, the
analogues of AOSP's sample drivers. They exist to exercise partitioning and
fallback: each says which operations it supports and how fast it is, and
refuses to prepare a model with an operation it does not claim (as a real
accelerator would).

A sample driver is a subclass of :class:`SampleDevice` that sets its
performance and overrides :meth:`SampleDevice.claims`; ``DRIVERS`` maps the
names ``nnrt driver serve --driver`` takes to factories.
"""
from __future__ import annotations

from typing import Callable

from .._version import __version__
from ..errors import ErrorStatus, NnrtError, invalid
from ..model.graph import HalModel, Operation
from ..model.types import OperandType as T, OperationType as Op
from ..hal import Capabilities, Device, DeviceType, PerformanceInfo
from .mediapipe import MediapipeDevice
from ..hal.validate import validate_model
from .reference import ReferenceDevice


class SampleDevice(ReferenceDevice):
    """The reference device restricted to the operations :meth:`claims`
    accepts, reporting ``performance`` for every operand type."""

    type = DeviceType.ACCELERATOR
    version_string = f"nnrt-sample-{__version__}"
    performance = PerformanceInfo(1.0, 1.0)

    def claims(self, model: HalModel, op: Operation) -> bool:
        return True

    def capabilities(self) -> Capabilities:
        perf = self.performance
        return Capabilities(perf, perf, {t: perf for t in T}, perf, perf)

    async def supported_operations(self, model: HalModel) -> list[bool]:
        # IF/WHILE are never claimed: prepare_model refuses control flow.
        return [ok and op.type not in (Op.IF, Op.WHILE) and self.claims(model, op)
                for ok, op in zip(await super().supported_operations(model),
                                  model.main.operations)]

    async def prepare_model(self, model: HalModel, *args, **kwargs):
        validate_model(model)  # a bad model is INVALID_ARGUMENT before any claim is checked
        if model.referenced:  # IF/WHILE bodies are never claimed by a sample driver
            raise invalid(f"{self.name} does not run control flow")
        for k, op in enumerate(model.main.operations):
            if not self.claims(model, op):
                raise invalid(f"{self.name} does not support operation {k} ({op.type.name})")
        return await super().prepare_model(model, *args, **kwargs)


def _tensor_types(model: HalModel, op: Operation) -> tuple[set, set]:
    operands = model.main.operands
    ins = {operands[i].type for i in op.inputs if operands[i].type.is_tensor}
    outs = {operands[i].type for i in op.outputs}
    return ins, outs


def _is_float32(model: HalModel, op: Operation) -> bool:
    # Shape and axis operands (TENSOR_INT32) may ride along with float data.
    ins, outs = _tensor_types(model, op)
    return outs == {T.TENSOR_FLOAT32} and ins <= {T.TENSOR_FLOAT32, T.TENSOR_INT32}


class FloatFastDevice(SampleDevice):
    """float32 operations only, twice as fast as the CPU reference."""

    performance = PerformanceInfo(0.5, 0.5)
    claims = staticmethod(_is_float32)


class FloatSlowDevice(SampleDevice):
    """float32 operations only, twice as slow as the CPU reference."""

    performance = PerformanceInfo(2.0, 2.0)
    claims = staticmethod(_is_float32)


class MinimalDevice(SampleDevice):
    """A handful of operations, in every type the reference runs them."""

    performance = PerformanceInfo(0.8, 0.8)
    OPERATIONS = frozenset({Op.ADD, Op.MUL, Op.CONV_2D, Op.RELU, Op.FULLY_CONNECTED, Op.SOFTMAX})

    def claims(self, model: HalModel, op: Operation) -> bool:
        return op.type in self.OPERATIONS


class QuantDevice(SampleDevice):
    """Operations on quantized tensors only (int32 biases and shapes allowed)."""

    performance = PerformanceInfo(0.3, 0.3)

    def claims(self, model: HalModel, op: Operation) -> bool:
        ins, outs = _tensor_types(model, op)
        return bool(outs) and all(t.is_quantized for t in outs) and \
            all(t.is_quantized or t == T.TENSOR_INT32 for t in ins)


class PartialDevice(SampleDevice):
    """Elementwise add/mul/sub and the ReLU family only, and fast at them: a
    model mixing these with anything else (a convolution, a softmax) is split
    between this driver and another device."""

    performance = PerformanceInfo(0.4, 0.4)
    OPERATIONS = frozenset({Op.ADD, Op.MUL, Op.SUB, Op.RELU, Op.RELU1, Op.RELU6})

    def claims(self, model: HalModel, op: Operation) -> bool:
        return op.type in self.OPERATIONS


def _litert(name: str, **settings) -> Device:
    # Imported when asked for: nnrt works without LiteRT installed.
    from . import litert
    if not litert.available():
        raise NnrtError(ErrorStatus.DEVICE_UNAVAILABLE,
                        "the litert driver needs ai-edge-litert, tflite and flatbuffers")
    return litert.LiteRTDevice(name, **settings)


DRIVERS: dict[str, Callable[..., Device]] = {
    "reference": ReferenceDevice,
    "litert": _litert,
    "sample-float-fast": FloatFastDevice,
    "sample-float-slow": FloatSlowDevice,
    "sample-minimal": MinimalDevice,
    "sample-quant": QuantDevice,
    "sample-partial": PartialDevice,
    "mediapipe": MediapipeDevice,     # an extension driver: com.nnrt.mediapipe
}


# The drivers that take settings (keyword arguments of their factory).
SETTINGS = {"litert": frozenset({"num_threads", "segment_time"})}


def make_driver(kind: str, name: str | None = None, **settings) -> Device:
    """The driver ``kind`` (a key of DRIVERS) named ``name`` (default:
    ``kind``), with ``settings`` for a driver that takes them (SETTINGS)."""
    try:
        factory = DRIVERS[kind]
    except KeyError:
        raise invalid(f"no driver {kind!r}; drivers: {', '.join(DRIVERS)}") from None
    unknown = set(settings) - SETTINGS.get(kind, frozenset())
    if unknown:
        raise invalid(f"driver {kind!r} takes no setting {', '.join(sorted(unknown))}")
    return factory(name or kind, **settings)
