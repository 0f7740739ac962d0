"""Random-graph differential tests, in the spirit of AOSP's
``RandomGraphGenerator``: random valid graphs of the operations a device
supports run on the device under test and on the reference driver, and the
outputs must agree within the CTS tolerances (float32: atol 1e-5 + 5 ULP
relative; relaxed models: 5 float16 ULP).

Every graph comes from one integer seed, so a failure replays exactly:

    nnrt conformance --device NAME --suite random --seed SEED --count 1

About a third of the graphs first run with output regions one byte short: the
device must answer OUTPUT_INSUFFICIENT_SIZE with the shapes it needs, and
the retry with regions of those shapes must pass. About a fifth are relaxed
(float32 may compute in float16), checked with the relaxed tolerance.

The operation set is probed first: one single-operation model per kind,
kept when the device reports it supported (queries answer the same for a
driver's whole life, so a seed gives the same graph on the same device).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

import nnrt
from nnrt.errors import ErrorStatus, NnrtError
from nnrt.hal import Device, ExecutionPreference, Priority, Request, RequestArgument
from nnrt.model.graph import DataLocation
from nnrt.model.types import OperandType as T, OperationType as Op

F32_TOL = (1e-5, 5 * 1.1920928955078125e-7)
RELAXED_TOL = (5 * 0.0009765625, 5 * 0.0009765625)


Q8 = T.TENSOR_QUANT8_ASYMM
TYPES = (T.TENSOR_FLOAT32, Q8)


@dataclass
class _Tensor:
    index: int
    shape: tuple[int, ...]
    scale: float = 0.0
    zero_point: int = 0


@dataclass
class _Builder:
    """A graph under construction over one tensor type (float32 or quant8
    asymm); ``tensors`` are the values operations may read."""

    rng: np.random.Generator
    type: T = T.TENSOR_FLOAT32
    model: nnrt.Model = field(default_factory=nnrt.Model)
    tensors: list[_Tensor] = field(default_factory=list)
    inputs: list[int] = field(default_factory=list)
    input_values: list[np.ndarray] = field(default_factory=list)
    consumed: set[int] = field(default_factory=set)
    ops: list[str] = field(default_factory=list)

    @property
    def quantized(self) -> bool:
        return self.type == Q8

    def fresh_quant(self) -> tuple[float, int]:
        return float(np.float32(self.rng.uniform(0.02, 0.1))), int(self.rng.integers(100, 157))

    def _add(self, shape, quant) -> _Tensor:
        scale, zp = quant if self.quantized else (0.0, 0)
        k = self.model.add_operand(self.type, list(shape), scale=scale, zero_point=zp)
        return _Tensor(k, tuple(shape), scale, zp)

    def input(self, shape) -> _Tensor:
        t = self._add(shape, self.fresh_quant())
        self.inputs.append(t.index)
        self.input_values.append(
            self.rng.integers(0, 256, shape).astype(np.uint8) if self.quantized
            else self.rng.uniform(-1, 1, shape).astype(np.float32))
        self.tensors.append(t)
        return t

    def scalar(self, type: T, value) -> int:
        k = self.model.add_operand(type)
        self.model.set_operand_value(k, value)
        return k

    def const(self, array: np.ndarray, type: T = T.TENSOR_FLOAT32, scale: float = 0.0,
              zero_point: int = 0) -> int:
        k = self.model.add_operand(type, list(array.shape), scale=scale, zero_point=zero_point)
        self.model.set_operand_value(k, array)
        return k

    def weights(self, shape) -> _Tensor:
        """A constant of the graph's type (quant8: scale 1/64, zero point 128)."""
        if self.quantized:
            q = (0.015625, 128)
            return _Tensor(self.const(self.rng.integers(0, 256, shape).astype(np.uint8), Q8,
                                      *q), tuple(shape), *q)
        return _Tensor(self.const(self.rng.uniform(-1, 1, shape).astype(np.float32)),
                       tuple(shape))

    def bias(self, n: int, x: _Tensor, w: _Tensor) -> int:
        if self.quantized:  # int32 with scale input x filter, as NNAPI requires
            return self.const(self.rng.integers(-200, 200, (n,)).astype(np.int32), T.TENSOR_INT32,
                              float(np.float32(x.scale * w.scale)), 0)
        return self.const(self.rng.uniform(-1, 1, (n,)).astype(np.float32))

    def emit(self, op: Op, ins: list, shape, quant=None) -> _Tensor:
        """Add ``op`` writing a new tensor of ``shape``; ``quant`` (scale,
        zero point) for quant8 graphs, default a fresh one."""
        t = self._add(shape, quant or self.fresh_quant())
        self.model.add_operation(op, ins, [t.index])
        for i in ins:
            self.consumed.add(i)
        self.ops.append(op.name)
        self.tensors.append(t)
        return t

    def pick(self, rank: int | None = None, min_hw: int = 1) -> _Tensor | None:
        choices = [t for t in self.tensors if (rank is None or len(t.shape) == rank)
                   and (len(t.shape) != 4 or min(t.shape[1:3]) >= min_hw)]
        return choices[self.rng.integers(len(choices))] if choices else None

    def act(self) -> int:
        return self.scalar(T.INT32, int(self.rng.integers(4)))


def _same(x: _Tensor) -> tuple[float, int]:
    return (x.scale, x.zero_point)


# Each generator adds one operation reading existing tensors; None when no
# tensor fits.
Gen = Callable[[_Builder], "_Tensor | None"]


def _binary(op: Op, fused: bool) -> Gen:
    def gen(b: _Builder):
        x = b.pick()
        same = [t for t in b.tensors if t.shape == x.shape]
        y = same[b.rng.integers(len(same))]
        if b.rng.random() < 0.3 and len(x.shape) >= 1:  # broadcast a constant row
            y = b.weights(x.shape[-1:])
        ins = [x.index, y.index] + ([b.act()] if fused else [])
        quant = None
        if op == Op.MUL and b.quantized:  # NNAPI: output scale > product of input scales
            scale, zp = b.fresh_quant()
            quant = (max(scale, float(np.float32(x.scale * y.scale * 1.5))), zp)
        return b.emit(op, ins, x.shape, quant)
    return gen


def _unary(op: Op, quant=None) -> Gen:
    """``quant``: the output quantization NNAPI fixes for quant8 (None: as the input's)."""
    def gen(b: _Builder):
        x = b.pick()
        return b.emit(op, [x.index], x.shape, quant or _same(x))
    return gen


def _softmax(b: _Builder):
    x = b.pick()
    return b.emit(Op.SOFTMAX, [x.index, b.scalar(T.FLOAT32, float(b.rng.choice([0.5, 1.0])))],
                  x.shape, (1 / 256, 0))


def _fully_connected(b: _Builder):
    choices = [t for t in b.tensors if len(t.shape) >= 2]  # NNAPI: input rank 2 to 4
    if not choices:
        return None
    x = choices[b.rng.integers(len(choices))]
    batch, k = x.shape[0], int(np.prod(x.shape[1:]))
    n = int(b.rng.integers(1, 6))
    w = b.weights((n, k))
    ins = [x.index, w.index, b.bias(n, x, w), b.act()]
    return b.emit(Op.FULLY_CONNECTED, ins, (batch, n), _accumulated(b, x, w, k))


def _accumulated(b: _Builder, x: _Tensor, w: _Tensor, fan_in: int):
    """An output scale for a quant8 sum of ``fan_in`` products: large
    enough that results do not all saturate."""
    if not b.quantized:
        return None
    return (float(np.float32(x.scale * w.scale * 128 * max(1, fan_in) ** 0.5)), 128)


def _conv(b: _Builder):
    x = b.pick(rank=4, min_hw=2)
    if x is None:
        return None
    _, h, w, c = x.shape
    o, kh, kw = int(b.rng.integers(1, 5)), int(b.rng.integers(1, 3)), int(b.rng.integers(1, 3))
    stride = int(b.rng.integers(1, 3))
    padding = int(b.rng.integers(1, 3))  # 1 SAME, 2 VALID
    if padding == 1:
        oh, ow = math.ceil(h / stride), math.ceil(w / stride)
    else:
        oh, ow = (h - kh) // stride + 1, (w - kw) // stride + 1
    filt = b.weights((o, kh, kw, c))
    ins = [x.index, filt.index, b.bias(o, x, filt),
           b.scalar(T.INT32, padding), b.scalar(T.INT32, stride), b.scalar(T.INT32, stride),
           b.act()]
    return b.emit(Op.CONV_2D, ins, (x.shape[0], oh, ow, o), _accumulated(b, x, filt, kh * kw * c))


def _pool(op: Op) -> Gen:
    def gen(b: _Builder):
        x = b.pick(rank=4, min_hw=2)
        if x is None:
            return None
        n, h, w, c = x.shape
        stride = int(b.rng.integers(1, 3))
        padding = int(b.rng.integers(1, 3))
        if padding == 1:
            oh, ow = math.ceil(h / stride), math.ceil(w / stride)
        else:
            oh, ow = (h - 2) // stride + 1, (w - 2) // stride + 1
        ins = [x.index, b.scalar(T.INT32, padding), b.scalar(T.INT32, stride),
               b.scalar(T.INT32, stride), b.scalar(T.INT32, 2), b.scalar(T.INT32, 2), b.act()]
        return b.emit(op, ins, (n, oh, ow, c), _same(x))
    return gen


def _concat(b: _Builder):
    x = b.pick()
    axis = int(b.rng.integers(len(x.shape)))
    others = [t for t in b.tensors if len(t.shape) == len(x.shape) and all(
        d == e for i, (d, e) in enumerate(zip(t.shape, x.shape)) if i != axis)]
    y = others[b.rng.integers(len(others))]
    shape = list(x.shape)
    shape[axis] += y.shape[axis]
    return b.emit(Op.CONCATENATION, [x.index, y.index, b.scalar(T.INT32, axis)], shape)


def _reshape(b: _Builder):
    x = b.pick()
    n = int(np.prod(x.shape))
    shape = (1, n) if b.rng.random() < 0.5 else (n,)
    return b.emit(Op.RESHAPE, [x.index, b.const(np.array(shape, np.int32), T.TENSOR_INT32)],
                  shape, _same(x))


def _transpose(b: _Builder):
    x = b.pick()
    perm = b.rng.permutation(len(x.shape)).astype(np.int32)
    return b.emit(Op.TRANSPOSE, [x.index, b.const(perm, T.TENSOR_INT32)],
                  tuple(x.shape[p] for p in perm), _same(x))


def _mean(b: _Builder):
    x = b.pick()
    if len(x.shape) < 2:
        return None
    axis = int(b.rng.integers(len(x.shape)))
    shape = list(x.shape)
    shape[axis] = 1
    return b.emit(Op.MEAN, [x.index, b.const(np.array([axis], np.int32), T.TENSOR_INT32),
                            b.scalar(T.INT32, 1)], shape, _same(x))


GENERATORS: dict[str, Gen] = {
    "ADD": _binary(Op.ADD, True), "SUB": _binary(Op.SUB, True), "MUL": _binary(Op.MUL, True),
    "MAXIMUM": _binary(Op.MAXIMUM, False), "MINIMUM": _binary(Op.MINIMUM, False),
    "RELU": _unary(Op.RELU), "RELU1": _unary(Op.RELU1), "RELU6": _unary(Op.RELU6),
    "TANH": _unary(Op.TANH, (1 / 128, 128)), "LOGISTIC": _unary(Op.LOGISTIC, (1 / 256, 0)),
    "ABS": _unary(Op.ABS), "NEG": _unary(Op.NEG), "SOFTMAX": _softmax, "FULLY_CONNECTED": _fully_connected,
    "CONV_2D": _conv, "AVERAGE_POOL_2D": _pool(Op.AVERAGE_POOL_2D),
    "MAX_POOL_2D": _pool(Op.MAX_POOL_2D), "CONCATENATION": _concat, "RESHAPE": _reshape,
    "TRANSPOSE": _transpose, "MEAN": _mean,
}


@dataclass
class RandomGraph:
    seed: int
    model: nnrt.Model
    inputs: list[np.ndarray]
    ops: list[str]
    relaxed: bool
    undersized: bool = False  # first run with short outputs: OUTPUT_INSUFFICIENT_SIZE, retry
    type: T = T.TENSOR_FLOAT32

    def describe(self) -> str:
        flags = (" relaxed" if self.relaxed else "") + (" undersized" if self.undersized else "")
        return f"{self.type.name}:{flags} | {' '.join(self.ops)}"


Kinds = dict[T, list[str]]


# NNAPI defines ABS and NEG for float and int32 tensors, not quant8.
_NOT_FOR = {Q8: {"ABS", "NEG"}}


def all_kinds() -> Kinds:
    """Every generator valid in each tensor type."""
    return {t: sorted(set(GENERATORS) - _NOT_FOR.get(t, set())) for t in TYPES}


def generate(seed: int, kinds: Kinds | None = None, max_ops: int = 8) -> RandomGraph:
    """The graph of ``seed`` over ``kinds`` (tensor type -> operation names;
    default: every generator in float32 and quant8). The seed picks the type
    among those with operations, then the operations."""
    kinds = {t: sorted(ops) for t, ops in (kinds if kinds is not None else all_kinds()).items()
             if ops}
    if not kinds:
        raise ValueError("no operation kinds to build a graph from")
    rng = np.random.default_rng(seed)
    types = sorted(kinds)
    type = types[rng.integers(len(types))]
    names = kinds[type]
    b = _Builder(rng, type)
    shape = (1, int(rng.integers(2, 7)), int(rng.integers(2, 7)), int(rng.integers(1, 5)))
    b.input(shape)
    if rng.random() < 0.5:
        b.input(shape)
    count = int(rng.integers(1, max_ops + 1))
    attempts = 0
    while len(b.ops) < count and attempts < 10 * max_ops:
        attempts += 1
        GENERATORS[names[rng.integers(len(names))]](b)
    if not b.ops:  # nothing fit: one operation that always does keeps the graph valid
        for name in names:
            if GENERATORS[name](b) is not None:
                break
    outputs = [t.index for t in b.tensors if t.index not in b.consumed
               and t.index not in b.inputs]
    if not outputs:
        raise ValueError(f"seed {seed}: no operation of {names} fits the inputs")
    relaxed = bool(rng.random() < 0.2) and type == T.TENSOR_FLOAT32
    undersized = bool(rng.random() < 0.3)
    b.model.identify_inputs_and_outputs(b.inputs, outputs)
    if relaxed:
        b.model.relax_computation_float32_to_float16(True)
    b.model.finish()
    return RandomGraph(seed, b.model, b.input_values, b.ops, relaxed, undersized, type)


def single_op_models(types=TYPES):
    """(name, model, inputs, type, op): one single-operation model per
    generator kind and tensor type."""
    for type in types:
        for k, name in enumerate(all_kinds()[type]):
            for attempt in range(20):
                rng = np.random.default_rng(1000 * k + attempt)
                b = _Builder(rng, type)
                b.input((1, 4, 4, 2))
                if GENERATORS[name](b) is None:
                    continue
                out = b.tensors[-1].index
                b.model.identify_inputs_and_outputs(b.inputs, [out])
                b.model.finish()
                yield f"{name} ({type.name})", b.model, b.input_values, type, name
                break


async def supported_kinds(device: Device) -> Kinds:
    """Per tensor type, the generator kinds whose single-operation model
    ``device`` supports."""
    kinds: Kinds = {t: [] for t in TYPES}
    for _label, model, _inputs, type, name in single_op_models():
        if all(await device.supported_operations(model.hal_model)):
            kinds[type].append(name)
    return kinds


async def run_hal(device: Device, model: nnrt.Model, inputs,
                  undersized: bool = False) -> list[np.ndarray]:
    """Prepare ``model`` on ``device`` and run it once through the HAL,
    every operand in one shared memory. With ``undersized`` the first
    execution gets output regions one byte short and must answer
    OUTPUT_INSUFFICIENT_SIZE with the shapes it needs; the retry uses them."""
    hal = model.hal_model
    prepared = await device.prepare_model(hal, ExecutionPreference.FAST_SINGLE_ANSWER,
                                          Priority.MEDIUM)
    try:
        outputs = [hal.main.operands[i] for i in hal.main.output_indexes]
        out_sizes = [max(4, o.type.element_size * int(np.prod(o.dimensions)))
                     for o in outputs]
        if undersized:
            short = [o.type.element_size * int(np.prod(o.dimensions)) - 1 for o in outputs]
            result, _ = await execute_in_one_memory(prepared, hal, inputs, short)
            if result.status != ErrorStatus.OUTPUT_INSUFFICIENT_SIZE:
                raise _Broken(f"output regions one byte short: got {result.status.name}, "
                              f"expected OUTPUT_INSUFFICIENT_SIZE")
            if len(result.output_shapes) != len(outputs) or all(
                    s.is_sufficient for s in result.output_shapes):
                raise _Broken(f"OUTPUT_INSUFFICIENT_SIZE with output shapes "
                              f"{result.output_shapes}: none marked insufficient")
            out_sizes = [max(4, o.type.element_size * int(np.prod(s.dimensions)))
                         for o, s in zip(outputs, result.output_shapes)]
        result, arrays = await execute_in_one_memory(prepared, hal, inputs, out_sizes)
        if result.status != ErrorStatus.NONE:
            raise NnrtError(result.status, result.message or "execution failed")
        return arrays
    finally:
        prepared.release()


class _Broken(Exception):
    """The device broke the HAL contract on a valid graph."""


async def execute_in_one_memory(prepared, hal, inputs, out_sizes):
    """Run ``prepared`` with every input and output in one shared Memory
    (64-byte aligned regions; ``out_sizes`` bytes per output): the result
    and, when it succeeded, copies of the outputs at their reported shapes."""
    outputs = [hal.main.operands[i] for i in hal.main.output_indexes]
    sizes = [np.asarray(v).nbytes for v in inputs] + list(out_sizes)
    offsets, offset = [], 0
    for s in sizes:
        offsets.append(offset)
        offset += (s + 63) // 64 * 64
    with nnrt.Memory.create(offset) as memory:
        in_args = []
        for k, v in enumerate(inputs):
            v = np.ascontiguousarray(v)
            memory.view()[offsets[k]:offsets[k] + v.nbytes] = v.reshape(-1).view(np.uint8)
            in_args.append(RequestArgument(False, DataLocation(0, offsets[k], v.nbytes),
                                           tuple(v.shape)))
        n = len(inputs)
        out_args = [RequestArgument(False, DataLocation(0, offsets[n + k], out_sizes[k]))
                    for k in range(len(outputs))]
        result = await prepared.execute(Request(tuple(in_args), tuple(out_args), (memory,)))
        if result.status != ErrorStatus.NONE:
            return result, []
        return result, [np.array(memory.array(o.type.dtype, s.dimensions, offsets[n + k]))
                        for k, (o, s) in enumerate(zip(outputs, result.output_shapes))]


@dataclass
class RandomOutcome:
    seed: int
    status: str       # "passed" | "failed" | "skipped"
    detail: str
    graph: str        # RandomGraph.describe(): type, flags | operations


def compare(got: list[np.ndarray], want: list[np.ndarray], relaxed: bool,
            type: T = T.TENSOR_FLOAT32) -> str | None:
    """The CTS criteria: float32 (relaxed) tolerances, quant8 off by one."""
    atol, rtol = (1, 0) if type == Q8 else RELAXED_TOL if relaxed else F32_TOL
    if len(got) != len(want):
        return f"{len(got)} outputs, the reference gives {len(want)}"
    for k, (g, w) in enumerate(zip(got, want)):
        if g.shape != w.shape:
            return f"output {k}: shape {list(g.shape)}, the reference gives {list(w.shape)}"
        e, a = w.astype(np.float64), g.astype(np.float64)
        err = np.abs(a - e)
        bad = ~(err <= atol + rtol * np.abs(e))
        if bad.any():
            i = int(np.argmax(np.where(bad, err, -1)))
            return (f"output {k}: {int(bad.sum())}/{e.size} elements off, worst at {i}: got "
                    f"{a.reshape(-1)[i]!r}, reference {e.reshape(-1)[i]!r}")
    return None


async def run_seeds(device: Device, reference: Device, seeds, kinds: Kinds | None = None,
                    progress=None) -> list[RandomOutcome]:
    """One differential run per seed; ``kinds`` defaults to what ``device`` supports."""
    if kinds is None:
        try:
            kinds = await supported_kinds(device)
        except NnrtError as e:
            outcomes = [RandomOutcome(seed, "failed", f"supported_operations refused a valid "
                                      f"single-operation model: {e}", "") for seed in seeds]
            if progress:
                for o in outcomes:
                    progress(o)
            return outcomes
    outcomes = []
    for seed in seeds:
        if not any(kinds.values()):
            outcome = RandomOutcome(seed, "skipped", "the device supports none of the random "
                                    "graph operations in float32 or quant8", "")
        else:
            outcome = await run_one(device, reference, seed, kinds)
        outcomes.append(outcome)
        if progress:
            progress(outcome)
    return outcomes


async def run_one(device: Device, reference: Device, seed: int, kinds: Kinds) -> RandomOutcome:
    graph = generate(seed, kinds)
    what = graph.describe()
    try:
        flags = await device.supported_operations(graph.model.hal_model)
    except NnrtError as e:
        return RandomOutcome(seed, "failed", f"supported_operations refused a valid graph: {e}",
                             what)
    if not all(flags):
        missing = sorted({graph.ops[i] for i, ok in enumerate(flags) if not ok})
        return RandomOutcome(seed, "skipped", f"device reports unsupported: "
                             f"{', '.join(missing)} (as configured in this graph)", what)
    try:
        want = await run_hal(reference, graph.model, graph.inputs)
    except NnrtError as e:
        return RandomOutcome(seed, "skipped", f"the reference driver refused the graph: {e}",
                             what)
    try:
        got = await run_hal(device, graph.model, graph.inputs, graph.undersized)
    except NnrtError as e:
        return RandomOutcome(seed, "failed", f"the device failed a graph it supports: {e}",
                             what)
    except _Broken as e:
        return RandomOutcome(seed, "failed", str(e), what)
    problem = compare(got, want, graph.relaxed, graph.type)
    return RandomOutcome(seed, "failed" if problem else "passed", problem or "", what)
