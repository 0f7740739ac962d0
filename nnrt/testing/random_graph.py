"""Random-graph differential tests, in the spirit of AOSP's
``RandomGraphGenerator``: random valid graphs of the operations a device
supports run on the device under test and on the reference driver, and the
outputs must agree within the CTS tolerances (float32: atol 1e-5 + 5 ULP
relative; relaxed models: 5 float16 ULP).

Every graph comes from one integer seed, so a failure replays exactly:

    nnrt conformance --device NAME --suite random --seed SEED --count 1

About a third of the graphs first run with 1-byte output regions: the
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


@dataclass
class _Tensor:
    index: int
    shape: tuple[int, ...]


@dataclass
class _Builder:
    """A graph under construction; ``tensors`` are the float32 values ops may read."""

    rng: np.random.Generator
    model: nnrt.Model = field(default_factory=nnrt.Model)
    tensors: list[_Tensor] = field(default_factory=list)
    inputs: list[int] = field(default_factory=list)
    input_values: list[np.ndarray] = field(default_factory=list)
    consumed: set[int] = field(default_factory=set)
    ops: list[str] = field(default_factory=list)

    def input(self, shape) -> _Tensor:
        k = self.model.add_operand(T.TENSOR_FLOAT32, list(shape))
        self.inputs.append(k)
        self.input_values.append(self.rng.uniform(-1, 1, shape).astype(np.float32))
        t = _Tensor(k, tuple(shape))
        self.tensors.append(t)
        return t

    def scalar(self, type: T, value) -> int:
        k = self.model.add_operand(type)
        self.model.set_operand_value(k, value)
        return k

    def const(self, array: np.ndarray, type: T = T.TENSOR_FLOAT32) -> int:
        k = self.model.add_operand(type, list(array.shape))
        self.model.set_operand_value(k, array)
        return k

    def weights(self, shape) -> int:
        return self.const(self.rng.uniform(-1, 1, shape).astype(np.float32))

    def emit(self, op: Op, ins: list, shape) -> _Tensor:
        k = self.model.add_operand(T.TENSOR_FLOAT32, list(shape))
        self.model.add_operation(op, ins, [k])
        for i in ins:
            self.consumed.add(i)
        self.ops.append(op.name)
        t = _Tensor(k, tuple(shape))
        self.tensors.append(t)
        return t

    def pick(self, rank: int | None = None, min_hw: int = 1) -> _Tensor | None:
        choices = [t for t in self.tensors if (rank is None or len(t.shape) == rank)
                   and (len(t.shape) != 4 or min(t.shape[1:3]) >= min_hw)]
        return choices[self.rng.integers(len(choices))] if choices else None

    def act(self) -> int:
        return self.scalar(T.INT32, int(self.rng.integers(4)))


# Each generator adds one operation reading existing tensors; None when no
# tensor fits.
Gen = Callable[[_Builder], "_Tensor | None"]


def _binary(op: Op, fused: bool) -> Gen:
    def gen(b: _Builder):
        x = b.pick()
        same = [t for t in b.tensors if t.shape == x.shape]
        y = same[b.rng.integers(len(same))]
        if b.rng.random() < 0.3 and len(x.shape) >= 1:  # broadcast a constant row
            y = _Tensor(b.weights(x.shape[-1:]), x.shape[-1:])
        ins = [x.index, y.index] + ([b.act()] if fused else [])
        return b.emit(op, ins, x.shape)
    return gen


def _unary(op: Op) -> Gen:
    def gen(b: _Builder):
        x = b.pick()
        return b.emit(op, [x.index], x.shape)
    return gen


def _softmax(b: _Builder):
    x = b.pick()
    return b.emit(Op.SOFTMAX, [x.index, b.scalar(T.FLOAT32, float(b.rng.choice([0.5, 1.0])))],
                  x.shape)


def _fully_connected(b: _Builder):
    x = b.pick()
    batch, k = x.shape[0], int(np.prod(x.shape[1:])) if len(x.shape) > 1 else x.shape[0]
    if len(x.shape) == 1:
        batch, k = 1, x.shape[0]
    n = int(b.rng.integers(1, 6))
    ins = [x.index, b.weights((n, k)), b.weights((n,)), b.act()]
    return b.emit(Op.FULLY_CONNECTED, ins, (batch, n))


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
    ins = [x.index, b.weights((o, kh, kw, c)), b.weights((o,)),
           b.scalar(T.INT32, padding), b.scalar(T.INT32, stride), b.scalar(T.INT32, stride),
           b.act()]
    return b.emit(Op.CONV_2D, ins, (1, oh, ow, o))


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
        return b.emit(op, ins, (n, oh, ow, c))
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
                  shape)


def _transpose(b: _Builder):
    x = b.pick()
    perm = b.rng.permutation(len(x.shape)).astype(np.int32)
    return b.emit(Op.TRANSPOSE, [x.index, b.const(perm, T.TENSOR_INT32)],
                  tuple(x.shape[p] for p in perm))


def _mean(b: _Builder):
    x = b.pick()
    if len(x.shape) < 2:
        return None
    axis = int(b.rng.integers(len(x.shape)))
    shape = list(x.shape)
    shape[axis] = 1
    return b.emit(Op.MEAN, [x.index, b.const(np.array([axis], np.int32), T.TENSOR_INT32),
                            b.scalar(T.INT32, 1)], shape)


GENERATORS: dict[str, Gen] = {
    "ADD": _binary(Op.ADD, True), "SUB": _binary(Op.SUB, True), "MUL": _binary(Op.MUL, True),
    "MAXIMUM": _binary(Op.MAXIMUM, False), "MINIMUM": _binary(Op.MINIMUM, False),
    "RELU": _unary(Op.RELU), "RELU1": _unary(Op.RELU1), "RELU6": _unary(Op.RELU6),
    "TANH": _unary(Op.TANH), "LOGISTIC": _unary(Op.LOGISTIC), "ABS": _unary(Op.ABS),
    "NEG": _unary(Op.NEG), "SOFTMAX": _softmax, "FULLY_CONNECTED": _fully_connected,
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
    undersized: bool = False  # first run with 1-byte outputs: OUTPUT_INSUFFICIENT_SIZE, retry


def generate(seed: int, kinds: list[str] | None = None, max_ops: int = 8) -> RandomGraph:
    """The graph of ``seed`` over operation ``kinds`` (default: all)."""
    kinds = sorted(kinds if kinds is not None else GENERATORS)
    if not kinds:
        raise ValueError("no operation kinds to build a graph from")
    rng = np.random.default_rng(seed)
    b = _Builder(rng)
    shape = (1, int(rng.integers(2, 7)), int(rng.integers(2, 7)), int(rng.integers(1, 5)))
    b.input(shape)
    if rng.random() < 0.5:
        b.input(shape)
    count = int(rng.integers(1, max_ops + 1))
    attempts = 0
    while len(b.ops) < count and attempts < 10 * max_ops:
        attempts += 1
        GENERATORS[kinds[rng.integers(len(kinds))]](b)
    outputs = [t.index for t in b.tensors if t.index not in b.consumed
               and t.index not in b.inputs]
    if not outputs:  # nothing was added: an identity-like op keeps the graph valid
        outputs = [_unary(Op.RELU)(b).index] if "RELU" in kinds else \
            [GENERATORS[kinds[0]](b).index]
    relaxed = bool(rng.random() < 0.2)
    undersized = bool(rng.random() < 0.3)
    b.model.identify_inputs_and_outputs(b.inputs, outputs)
    if relaxed:
        b.model.relax_computation_float32_to_float16(True)
    b.model.finish()
    return RandomGraph(seed, b.model, b.input_values, b.ops, relaxed, undersized)


def single_op_models():
    """(name, model, inputs): one single-operation model per generator kind."""
    for k, name in enumerate(sorted(GENERATORS)):
        for attempt in range(20):
            rng = np.random.default_rng(1000 * k + attempt)
            b = _Builder(rng)
            b.input((1, 4, 4, 2))
            if GENERATORS[name](b) is None:
                continue
            out = b.tensors[-1].index
            b.model.identify_inputs_and_outputs(b.inputs, [out])
            b.model.finish()
            yield name, b.model, b.input_values
            break


async def supported_kinds(device: Device) -> list[str]:
    """The generator kinds whose single-operation model ``device`` supports."""
    kinds = []
    for name, model, _ in single_op_models():
        if all(await device.supported_operations(model.hal_model)):
            kinds.append(name)
    return kinds


async def run_hal(device: Device, model: nnrt.Model, inputs,
                  undersized: bool = False) -> list[np.ndarray]:
    """Prepare ``model`` on ``device`` and run it once through the HAL,
    every operand in one shared memory. With ``undersized`` the first
    execution gets 1-byte output regions and must answer
    OUTPUT_INSUFFICIENT_SIZE with the shapes it needs; the retry uses them."""
    hal = model.hal_model
    prepared = await device.prepare_model(hal, ExecutionPreference.FAST_SINGLE_ANSWER,
                                          Priority.MEDIUM)
    try:
        outputs = [hal.main.operands[i] for i in hal.main.output_indexes]
        out_sizes = [max(4, o.type.element_size * int(np.prod(o.dimensions)))
                     for o in outputs]
        if undersized:
            result, _ = await _execute(prepared, hal, inputs, [1] * len(outputs))
            if result.status != ErrorStatus.OUTPUT_INSUFFICIENT_SIZE:
                raise _Broken(f"1-byte output regions: got {result.status.name}, expected "
                              f"OUTPUT_INSUFFICIENT_SIZE")
            if len(result.output_shapes) != len(outputs) or all(
                    s.is_sufficient for s in result.output_shapes):
                raise _Broken(f"OUTPUT_INSUFFICIENT_SIZE with output shapes "
                              f"{result.output_shapes}: none marked insufficient")
            out_sizes = [max(4, o.type.element_size * int(np.prod(s.dimensions)))
                         for o, s in zip(outputs, result.output_shapes)]
        result, arrays = await _execute(prepared, hal, inputs, out_sizes)
        if result.status != ErrorStatus.NONE:
            raise NnrtError(result.status, result.message or "execution failed")
        return arrays
    finally:
        prepared.release()


class _Broken(Exception):
    """The device broke the HAL contract on a valid graph."""


async def _execute(prepared, hal, inputs, out_sizes):
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
    ops: list[str]


def compare(got: list[np.ndarray], want: list[np.ndarray], relaxed: bool) -> str | None:
    atol, rtol = RELAXED_TOL if relaxed else F32_TOL
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


async def run_seeds(device: Device, reference: Device, seeds, kinds: list[str] | None = None,
                    progress=None) -> list[RandomOutcome]:
    """One differential run per seed; ``kinds`` defaults to what ``device`` supports."""
    if kinds is None:
        kinds = await supported_kinds(device)
    outcomes = []
    for seed in seeds:
        if not kinds:
            outcome = RandomOutcome(seed, "skipped", "the device supports none of the random "
                                    "graph operations", [])
        else:
            outcome = await run_one(device, reference, seed, kinds)
        outcomes.append(outcome)
        if progress:
            progress(outcome)
    return outcomes


async def run_one(device: Device, reference: Device, seed: int,
                  kinds: list[str]) -> RandomOutcome:
    graph = generate(seed, kinds)
    try:
        flags = await device.supported_operations(graph.model.hal_model)
    except NnrtError as e:
        return RandomOutcome(seed, "failed", f"supported_operations refused a valid graph: {e}",
                             graph.ops)
    if not all(flags):
        missing = sorted({graph.ops[i] for i, ok in enumerate(flags) if not ok})
        return RandomOutcome(seed, "skipped", f"device reports unsupported: "
                             f"{', '.join(missing)} (as configured in this graph)", graph.ops)
    try:
        want = await run_hal(reference, graph.model, graph.inputs)
    except NnrtError as e:
        return RandomOutcome(seed, "skipped", f"the reference driver refused the graph: {e}",
                             graph.ops)
    try:
        got = await run_hal(device, graph.model, graph.inputs, graph.undersized)
    except NnrtError as e:
        return RandomOutcome(seed, "failed", f"the device failed a graph it supports: {e}",
                             graph.ops)
    except _Broken as e:
        return RandomOutcome(seed, "failed", str(e), graph.ops)
    problem = compare(got, want, graph.relaxed)
    return RandomOutcome(seed, "failed" if problem else "passed", problem or "", graph.ops)
