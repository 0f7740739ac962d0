"""A 3-stage pipeline of tiny models (y = x*s + o on 1x8 float32, two
operations each) on an out-of-process driver service, run two ways in the
same process against the same service:

* ``awaited``  ``y = (await stage.execute([y])).outputs[0]`` three times: the
  app waits for every stage before starting the next (the baseline);
* ``fenced``   three ``execute_fenced`` calls launched at once, stage n
  waiting for stage n-1's fence (its input is stage n-1's output array),
  the app awaiting only the last callback's result.

It prints median and p90 of a whole pipeline in microseconds per way and
the fenced/awaited ratio of the medians (< 1: fences are faster). Two more
pairs measure the same idea elsewhere:

* ``HAL``: the three stages as ``ServicePreparedModel`` calls sharing
  ``Memory`` pools (nothing copied by the runtime): ``await execute`` per
  stage against three ``execute_fenced`` chained by their fences;
* ``split model``: ONE compiled model whose partition alternates between two
  services (``sample-partial`` runs MUL/ADD, ``sample-float-fast`` the TANH),
  three steps: ``await compiled.execute`` (the runtime awaits each step)
  against ``execute_fenced`` (the steps chained by fences across the two
  service processes).

    .venv/bin/python benchmarks/fenced_pipeline.py [--runs N]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import anyio
import numpy as np

import nnrt
from nnrt import OperandType as T, OperationType as Op
from nnrt.hal import ErrorStatus, Request, RequestArgument
from nnrt.memory import Memory
from nnrt.model.graph import DataLocation
from nnrt.runtime.fenced import execute_fenced

SHAPE = (1, 8)
STAGES = [(2.0, 1.0), (0.5, -3.0), (3.0, 0.25)]


def affine_model(scale: float, offset: float) -> nnrt.Model:
    m = nnrt.Model()
    x = m.add_operand(T.TENSOR_FLOAT32, list(SHAPE))
    s = m.add_operand(T.TENSOR_FLOAT32, [1])
    m.set_operand_value(s, np.array([scale], np.float32))
    o = m.add_operand(T.TENSOR_FLOAT32, [1])
    m.set_operand_value(o, np.array([offset], np.float32))
    zero = m.add_operand(T.INT32)
    m.set_operand_value(zero, 0)
    t = m.add_operand(T.TENSOR_FLOAT32, list(SHAPE))
    m.add_operation(Op.MUL, [x, s, zero], [t])
    y = m.add_operand(T.TENSOR_FLOAT32, list(SHAPE))
    m.add_operation(Op.ADD, [t, o, zero], [y])
    m.identify_inputs_and_outputs([x], [y])
    return m.finish()


def split_model() -> nnrt.Model:
    """x*2+1 -> tanh -> *3+0.5: MUL/ADD on sample-partial, TANH elsewhere."""
    m = nnrt.Model()
    zero = m.add_operand(T.INT32)
    m.set_operand_value(zero, 0)

    def const(v):
        c = m.add_operand(T.TENSOR_FLOAT32, [1])
        m.set_operand_value(c, np.array([v], np.float32))
        return c

    def op(kind, *inputs):
        out = m.add_operand(T.TENSOR_FLOAT32, list(SHAPE))
        m.add_operation(kind, list(inputs), [out])
        return out

    x = m.add_operand(T.TENSOR_FLOAT32, list(SHAPE))
    a = op(Op.ADD, op(Op.MUL, x, const(2.0), zero), const(1.0), zero)
    t = op(Op.TANH, a)
    y = op(Op.ADD, op(Op.MUL, t, const(3.0), zero), const(0.5), zero)
    m.identify_inputs_and_outputs([x], [y])
    return m.finish()


async def split_awaited(compiled, x):
    return (await compiled.execute([x])).outputs[0]


async def split_fenced(compiled, x):
    fence, cb = await execute_fenced(compiled, [x])
    y = (await cb.result()).outputs[0]
    fence.close()
    return y


async def awaited(stages, x):
    y = x
    for c in stages:
        y = (await c.execute([y])).outputs[0]
    return y


async def fenced(stages, x, buffers):
    f1, _ = await execute_fenced(stages[0], [x], outputs=[buffers[0]])
    f2, _ = await execute_fenced(stages[1], [buffers[0]], outputs=[buffers[1]], wait_for=[f1])
    f3, cb = await execute_fenced(stages[2], [buffers[1]], wait_for=[f2])
    y = (await cb.result()).outputs[0]
    for f in (f1, f2, f3):
        f.close()
    return y


async def hal_awaited(prepared, requests):
    for p_, r in zip(prepared, requests):
        result = await p_.execute(r)
        assert result.status == ErrorStatus.NONE, result.message


async def hal_fenced(prepared, requests):
    prev, fences = [], []
    for p_, r in zip(prepared, requests):
        fence, cb = await p_.execute_fenced(None, r, prev)
        fences.append(fence)
        prev = [fence]
    await fences[-1].wait_signaled()
    for f in fences:
        f.close()


async def timed(fn, *args, runs):
    for _ in range(max(runs // 10, 10)):
        await fn(*args)
    samples = []
    for _ in range(runs):
        start = time.perf_counter_ns()
        await fn(*args)
        samples.append((time.perf_counter_ns() - start) / 1000)
    samples.sort()
    return statistics.median(samples), samples[int(0.9 * (len(samples) - 1))]


def row(name, median, p90, base=None):
    ratio = f"{median / base:6.2f}" if base else "  1.00"
    print(f"{name:26s} {median:10.0f} {p90:10.0f} {ratio}")


async def main(runs: int) -> None:
    os.environ.pop("NNRT_DRIVERS", None)
    async with nnrt.Runtime(spawn=[("svc", "sample-float-fast")], discover=False) as rt:
        stages = [await rt.compile(affine_model(*p), devices=["svc"]) for p in STAGES]
        x = np.arange(8, dtype=np.float32).reshape(SHAPE)
        buffers = [np.zeros(SHAPE, np.float32) for _ in range(2)]
        assert np.array_equal(await awaited(stages, x), await fenced(stages, x, buffers))
        base = await timed(awaited, stages, x, runs=runs)
        fence = await timed(fenced, stages, x, buffers, runs=runs)

        prepared = [c._steps[0].prepared for c in stages]
        memories = [Memory.create(32) for _ in range(4)]
        memories[0].array(np.float32, SHAPE)[...] = x
        requests = [Request((RequestArgument(False, DataLocation(0, 0, 32), SHAPE),),
                            (RequestArgument(False, DataLocation(1, 0, 32)),),
                            (memories[k], memories[k + 1])) for k in range(3)]
        hal_base = await timed(hal_awaited, prepared, requests, runs=runs)
        hal_fence = await timed(hal_fenced, prepared, requests, runs=runs)
        for m in memories:
            m.close()

    async with nnrt.Runtime(spawn=["sample-partial", "sample-float-fast"],
                            discover=False) as rt:
        split = await rt.compile(split_model(), devices=["sample-partial", "sample-float-fast"])
        assert [d.name for d in split.devices] == ["sample-partial", "sample-float-fast",
                                                   "sample-partial"], split.devices
        assert np.allclose(await split_awaited(split, x), await split_fenced(split, x))
        split_base = await timed(split_awaited, split, x, runs=runs)
        split_fence = await timed(split_fenced, split, x, runs=runs)

    print(f"3-stage pipeline on a driver service, {runs} runs, microseconds per pipeline")
    print(f"{'way':26s} {'median':>10s} {'p90':>10s} {'ratio'}")
    row("runtime: awaited", *base)
    row("runtime: fenced", *fence, base[0])
    row("HAL: awaited (Memory)", *hal_base)
    row("HAL: fenced (Memory)", *hal_fence, hal_base[0])
    row("split model: awaited", *split_base)
    row("split model: fenced", *split_fence, split_base[0])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=300)
    anyio.run(main, parser.parse_args().runs)
