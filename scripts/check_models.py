"""Import every shared ``.tflite`` model, run it on the reference device and
compare with LiteRT's outputs stored beside it.

    .venv/bin/python scripts/check_models.py [MODELS_DIR ...] [--no-per-op] [--repeat N]

Criteria (issue 13):
* float outputs within 1e-4 of the largest output magnitude of LiteRT's
  reference kernels (``*.ref_out<k>.npy``);
* quantized outputs no further from ``*.ref_out<k>.npy`` than LiteRT's
  XNNPACK outputs (``*.out<k>.npy``) are;
* for quantized models, every single operation within one unit when run alone
  on the inputs LiteRT's reference kernels gave it (needs ``ai-edge-litert``:
  the model is run with ``BUILTIN_REF`` and ``experimental_preserve_all_tensors``);
* a model that cannot be imported must be refused with INVALID_ARGUMENT
  naming the operator (reported as "refused", not as a pass).

The table lists the model, its operation count, the largest error, the
reference device's median time per execution and the verdict. Exit status 1
when any model fails.
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import anyio
import numpy as np

import nnrt
import nnrt.tflite
from nnrt.tflite import load_operators
from nnrt.tflite.reader import read

DEFAULT_DIRS = [Path(__file__).resolve().parents[2] / "shared" / "models", Path("/work/shared/models")]
FLOAT_TOLERANCE = 1e-4


def reference_inputs(stem: Path) -> list[np.ndarray]:
    return [np.load(p) for p in sorted(stem.parent.glob(stem.name + ".in*.npy"))]


def expected(stem: Path, k: int, kind: str) -> np.ndarray | None:
    path = stem.parent / f"{stem.name}.{kind}{k}.npy"
    return np.load(path) if path.exists() else None


async def run_model(model: nnrt.Model, inputs: list[np.ndarray], repeat: int):
    async with nnrt.Runtime(discover=False) as rt:
        compiled = await rt.compile(model, devices=[rt.cpu])
        result = await compiled.execute(inputs)
        times = []
        for _ in range(repeat):
            compiled.reset_state()
            start = time.perf_counter()
            await compiled.execute(inputs)
            times.append(time.perf_counter() - start)
        compiled.reset_state()
        return result.outputs, statistics.median(times) if times else float("nan")


def compare(stem: Path, outputs: list[np.ndarray]) -> tuple[list, bool]:
    """Per output: (error, allowed, what it was compared with); float errors
    relative to max |ref|, quantized in units."""
    rows, ok = [], True
    for k, out in enumerate(outputs):
        ref = expected(stem, k, "ref_out")
        xnn = expected(stem, k, "out")
        what = "XNNPACK"
        if ref is None:
            # conv/ keeps only the XNNPACK outputs: compare with those, one
            # unit allowed (the single-operation criterion).
            ref, xnn, what = xnn, None, "vs XNNPACK, allowed"
        if ref is None:
            rows.append((float("nan"), None, "no reference output"))
            ok = False
            continue
        if out.shape != ref.shape:
            rows.append((float("inf"), None, f"shape {out.shape} != {ref.shape}"))
            ok = False
            continue
        if ref.dtype.kind == "f":
            err = float(np.abs(out.astype(np.float64) - ref).max() / max(np.abs(ref).max(), 1e-30))
            allowed = FLOAT_TOLERANCE
        else:
            err = int(np.abs(out.astype(np.int64) - ref).max())
            allowed = int(np.abs(xnn.astype(np.int64) - ref).max()) if xnn is not None else 1
        rows.append((err, allowed, what))
        ok = ok and err <= allowed
    return rows, ok


def per_operation(path: Path, data: bytes) -> tuple[int, list[str]]:
    """Run each operation of a quantized model alone on LiteRT's reference
    kernels' inputs; returns the largest difference in units and failures."""
    from ai_edge_litert.interpreter import Interpreter, OpResolverType

    interp = Interpreter(model_content=data, experimental_op_resolver_type=OpResolverType.BUILTIN_REF,
                         experimental_preserve_all_tensors=True)
    interp.allocate_tensors()
    stem = path.with_suffix("")
    for detail, value in zip(interp.get_input_details(), reference_inputs(stem)):
        interp.set_tensor(detail["index"], value)
    interp.invoke()
    file = read(data, path.name)
    graph = file.graphs[0]
    worst, failures = 0, []
    for op in graph.operators:
        outs = [graph.tensors[t] for t in op.outputs]
        if not all(t.dtype is not None and t.dtype.kind in "iu" and t.quantization for t in outs):
            continue
        try:
            model = load_operators(file, 0, [op.index])
        except nnrt.NnrtError as e:
            failures.append(f"op {op.index} {op.name}: {e.message}")
            continue
        hal = model.hal_model
        if not hal.main.operations:
            continue  # folded at import: nothing runs
        meta = model.metadata
        inputs = [interp.get_tensor(_tensor_index(graph, info.name)) for info in meta.inputs]
        got = nnrt.run(model, inputs).outputs
        for t, value in zip(op.outputs, got):
            want = interp.get_tensor(t)
            diff = int(np.abs(value.astype(np.int64) - want.astype(np.int64)).max()) if want.size else 0
            worst = max(worst, diff)
            if diff > 1:
                failures.append(f"op {op.index} {op.name}: {diff} units")
    return worst, failures


def _tensor_index(graph, name: str) -> int:
    for t in graph.tensors:
        if t.name == name:
            return t.index
    raise KeyError(name)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dirs", nargs="*", type=Path, help="folders searched for *.tflite")
    parser.add_argument("--no-per-op", action="store_true",
                        help="skip the single-operation check of quantized models")
    parser.add_argument("--repeat", type=int, default=3, help="timed executions per model")
    args = parser.parse_args(argv)
    dirs = args.dirs or [d for d in DEFAULT_DIRS if d.is_dir()][:1]
    files = sorted(p for d in dirs for p in d.rglob("*.tflite"))
    have_litert = importlib.util.find_spec("ai_edge_litert") is not None
    rows, failed = [], 0
    for path in files:
        stem = path.with_suffix("")
        data = path.read_bytes()
        try:
            model = nnrt.tflite.load(data, name=path.name)
        except nnrt.NnrtError as e:
            rows.append((path.name, "-", "-", "-", "refused", e.message))
            continue
        ops = len(model.hal_model.main.operations) + sum(
            len(s.operations) for s in model.hal_model.referenced)
        outputs, seconds = anyio.run(run_model, model, reference_inputs(stem), args.repeat)
        errors, ok = compare(stem, outputs)
        note = ""
        quantized = any(o.dtype.kind in "iu" for o in outputs)
        if quantized and not args.no_per_op:
            if have_litert:
                worst, failures = per_operation(path, data)
                note = f"per-op max {worst} unit(s)"
                if failures:
                    ok = False
                    note += "; " + "; ".join(failures[:3])
            else:
                note = "per-op check skipped (ai-edge-litert not installed)"
        shown = ", ".join(f"{e:.2e}" if isinstance(e, float) else f"{e} ({what} {a})"
                          for e, a, what in errors)
        rows.append((path.name, str(ops), shown, f"{seconds * 1e3:.1f}", "ok" if ok else "FAIL",
                     note))
        failed += not ok
    _print_table(rows)
    return 1 if failed else 0


def _print_table(rows) -> None:
    header = ("model", "ops", "max error", "ref ms", "result", "notes")
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(" | ".join(header))
        for r in rows:
            print(" | ".join(r))
        return
    table = Table(*header)
    for r in rows:
        table.add_row(*r)
    Console(width=200).print(table)


if __name__ == "__main__":
    sys.exit(main())
