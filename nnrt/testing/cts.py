"""Run NNAPI CTS test vectors (the ``nnrt-cts-json/1`` format of
``../shared/cts``) through the public API and check them as the CTS harness does.

    python -m nnrt.testing.cts PATH... [--device NAME] [--spawn KIND] [--filter GLOB] [--json OUT]

``--spawn sample-float-fast --device sample-float-fast`` runs the vectors on an
out-of-process driver service the runner starts (one per worker process).

``--device litert --fallback`` runs each model on ``litert`` where it claims
the operations and partitions the rest to the runtime's reference CPU device
(nothing is skipped); the summary then counts the runs by the devices they
ran on (``litert``, ``nnrt-reference``, or both in one partitioned run).

Each case runs once per CTS suite this runner implements that the case belongs
to: ``GeneratedTests`` (as specified), ``DynamicOutputShapeTest`` (every
output declared with unknown dimensions), ``QuantizationCouplingTest`` (every
TENSOR_QUANT8_ASYMM operand turned into TENSOR_QUANT8_ASYMM_SIGNED, values and
zero points shifted by -128), or ``GeneratedValidationTests`` for
``expectFailure`` cases. ``SignedIdentity`` is nnrt's own check on the same
cases as QuantizationCouplingTest: the signed variant's outputs must equal the
unsigned outputs shifted by -128 exactly (not merely both within tolerance). A run is skipped only when the device reports an
operation of the model unsupported; every skip is listed with its reason.
The last line is ``N passed, M failed, K skipped`` (counting runs).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import fnmatch
import gzip
import json
import multiprocessing
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import anyio
import numpy as np

import nnrt
from nnrt.errors import NnrtError
from nnrt.model.types import OperandType

SUITES = ("GeneratedTests", "DynamicOutputShapeTest", "QuantizationCouplingTest",
          "SignedIdentity")
_F16_ULP5 = 5 * 0.0009765625


@dataclass
class Outcome:
    name: str
    suite: str
    status: str          # "passed" | "failed" | "skipped"
    detail: str = ""     # failing operand and worst error, or skip reason
    devices: str = ""    # the devices that ran it, "+"-joined in step order


def load_cases(paths: list[str], pattern: str | None = None):
    """Yield (spec file stem, case) for every case under ``paths`` (files or folders)."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(f for f in p.iterdir() if f.name.endswith((".json", ".json.gz"))
                            and f.name != "INDEX.json")
        elif p.exists():
            files.append(p)
        else:
            raise FileNotFoundError(f"no such file or folder: {p}")
    for f in files:
        stem = f.name.split(".json")[0]
        opener = gzip.open if f.name.endswith(".gz") else open
        if pattern and not fnmatch.fnmatch(stem, pattern):
            # The filter may still match case names inside the file.
            with opener(f, "rt") as fh:
                cases = json.load(fh)["cases"]
            cases = [c for c in cases if fnmatch.fnmatch(c["name"], pattern)]
        else:
            with opener(f, "rt") as fh:
                cases = json.load(fh)["cases"]
        for c in cases:
            yield stem, c


# --- building -------------------------------------------------------------

def _array(operand: dict) -> np.ndarray:
    dtype = OperandType[operand["type"]].dtype
    data = operand["data"]
    arr = np.array(data, dtype=dtype) if operand["dtype"] != "bool8" else np.array(data, dtype=bool)
    return arr.reshape(operand["dimensions"]) if operand["dimensions"] and arr.size else arr


def build_model(case: dict, dynamic_outputs: bool = False) -> nnrt.Model:
    if case["referenced"]:
        raise NotImplementedError("referenced subgraphs")  # reported as a failure below
    return _build_subgraph(case["main"], case["isRelaxed"], dynamic_outputs)


def _build_subgraph(sub: dict, relaxed: bool, dynamic_outputs: bool) -> nnrt.Model:
    m = nnrt.Model()
    outputs = set(sub["outputIndexes"])
    for k, o in enumerate(sub["operands"]):
        dims = o["dimensions"]
        if dynamic_outputs and k in outputs:
            dims = [0] * len(dims)
        cq = o["channelQuant"]
        m.add_operand(OperandType[o["type"]], dims, scale=o["scale"], zero_point=o["zeroPoint"],
                      channel_quant=(cq["channelDim"], cq["scales"]) if cq else
                      ((0, []) if o["type"] == "TENSOR_QUANT8_SYMM_PER_CHANNEL" else None))
    for k, o in enumerate(sub["operands"]):
        if o["lifetime"] in ("CONSTANT_COPY", "CONSTANT_REFERENCE"):
            m.set_operand_value(k, _array(o))
        elif o["lifetime"] == "NO_VALUE":
            m.set_operand_value(k, None)
    for op in sub["operations"]:
        m.add_operation(nnrt.OperationType[op["type"]], op["inputs"], op["outputs"])
    m.identify_inputs_and_outputs(sub["inputIndexes"], sub["outputIndexes"])
    if relaxed:
        m.relax_computation_float32_to_float16(True)
    m.finish()
    return m


def to_signed(case: dict) -> dict:
    """The QuantizationCouplingTest variant of ``case``: every TENSOR_QUANT8_ASYMM
    operand becomes TENSOR_QUANT8_ASYMM_SIGNED with zero point and every value
    (expected outputs too) shifted by -128."""
    def convert(sub: dict) -> dict:
        operands = []
        for o in sub["operands"]:
            if o["type"] == "TENSOR_QUANT8_ASYMM":
                o = dict(o, type="TENSOR_QUANT8_ASYMM_SIGNED", dtype="int8",
                         zeroPoint=o["zeroPoint"] - 128, data=[v - 128 for v in o["data"]])
            operands.append(o)
        return dict(sub, operands=operands)
    return dict(case, main=convert(case["main"]),
                referenced=[convert(s) for s in case["referenced"]])


# --- checking ---------------------------------------------------------------

def _uses_float16(case: dict) -> bool:
    subs = [case["main"], *case["referenced"]]
    return any(o["type"] in ("TENSOR_FLOAT16", "FLOAT16") for s in subs for o in s["operands"])


def check_outputs(case: dict, outputs: list[np.ndarray], shapes: list) -> str | None:
    """None when every output passes the CTS criteria, else what failed."""
    main = case["main"]
    relaxed_tol = case["isRelaxed"] or _uses_float16(case)
    quant_tol = 3 if "mobilenet" in case["name"] else 1
    for pos, index in enumerate(main["outputIndexes"]):
        o = main["operands"][index]
        if o["isIgnored"]:
            continue
        if tuple(shapes[pos]) != tuple(o["dimensions"]):
            return f"output {pos} (operand {index}): shape {list(shapes[pos])}, expected {o['dimensions']}"
        expected = _array(o).reshape(-1)
        actual = np.asarray(outputs[pos]).reshape(-1)
        if expected.size != actual.size:
            return f"output {pos} (operand {index}): {actual.size} elements, expected {expected.size}"
        if expected.size == 0:
            continue
        t = o["type"]
        if t == "TENSOR_BOOL8":
            bad = np.count_nonzero(expected != actual.astype(bool))
            if bad:
                return f"output {pos} (operand {index}): {bad} booleans differ"
            continue
        if t in ("TENSOR_FLOAT32", "TENSOR_FLOAT16"):
            atol, rtol = ((_F16_ULP5, _F16_ULP5) if relaxed_tol or t == "TENSOR_FLOAT16"
                          else (1e-5, 5 * 1.1920928955078125e-7))
        elif t in ("TENSOR_INT32", "INT32", "TENSOR_QUANT16_ASYMM", "TENSOR_QUANT16_SYMM"):
            atol, rtol = 1, 0
        elif t in ("TENSOR_QUANT8_ASYMM", "TENSOR_QUANT8_ASYMM_SIGNED", "TENSOR_QUANT8_SYMM"):
            atol, rtol = quant_tol, 0
        else:
            return f"output {pos} (operand {index}): data type {t} not supported by the harness"
        e = expected.astype(np.float64)
        a = actual.astype(np.float64)
        if np.isnan(e).any():
            return f"output {pos} (operand {index}): NaN in the expected value"
        err = np.abs(a - e)
        bound = atol + rtol * np.abs(e)
        bad = ~(err <= bound)
        if bad.any():
            worst = int(np.argmax(np.where(np.isnan(err), np.inf, err - bound)))
            return (f"output {pos} (operand {index}): {int(bad.sum())}/{e.size} elements off, "
                    f"worst at {worst}: got {a[worst]!r}, expected {e[worst]!r} "
                    f"(error {err[worst]:.3g} > {bound[worst]:.3g})")
    return None


def check_multinomial(case: dict, outputs: list[np.ndarray]) -> str | None:
    """SCHEMA §4.3: class frequencies within the tolerance of softmax(logits)."""
    main = case["main"]
    logits_op = main["operands"][main["inputIndexes"][0]]
    x = _array(logits_op).astype(np.float32).reshape(logits_op["dimensions"])
    samples = np.asarray(outputs[0])
    tol = case["expectedMultinomialDistributionTolerance"]
    for b in range(x.shape[0]):
        p = np.exp(x[b]) / np.exp(x[b]).sum()
        counts = np.bincount(samples[b].astype(np.int64), minlength=x.shape[1])
        freq = counts[: x.shape[1]] / samples.shape[1]
        worst = float(np.max(np.abs(freq - p)))
        if worst > tol:
            return f"batch {b}: class frequency off by {worst:.4f} > {tol}"
    return None


# --- running ------------------------------------------------------------------

def _candidates(rt: nnrt.Runtime, device: str | None, fallback: bool) -> list[str] | None:
    """The devices a run may use: all, ``device`` only, or ``device`` and the CPU."""
    if device is None:
        return None
    if fallback and device != rt.cpu.name:
        return [device, rt.cpu.name]
    return [device]


def _ran_on(compiled) -> str:
    names = []
    for d in compiled.devices:
        if d.name not in names:
            names.append(d.name)
    return "+".join(names)


async def run_case(rt: nnrt.Runtime, case: dict, suite: str, device: str | None,
                   fallback: bool = False) -> Outcome:
    name = case["name"]
    candidates = _candidates(rt, device, fallback)
    if case["expectFailure"]:
        try:
            model = build_model(case)
            compiled = await rt.compile(model, devices=candidates)
            await compiled.execute(_inputs(case))
        except NnrtError:
            return Outcome(name, suite, "passed")
        except NotImplementedError as e:
            return Outcome(name, suite, "failed", f"cannot build: {e} not implemented")
        return Outcome(name, suite, "failed", "expected a failure, but everything succeeded")
    if suite == "SignedIdentity":
        return await run_signed_identity(rt, case, candidates)
    if suite == "QuantizationCouplingTest":
        case = to_signed(case)
    try:
        model = build_model(case, dynamic_outputs=suite == "DynamicOutputShapeTest")
    except NotImplementedError as e:
        return Outcome(name, suite, "failed", f"cannot build: {e} not implemented")
    except NnrtError as e:
        return Outcome(name, suite, "failed", f"model building refused: {e}")
    unsupported = await _unsupported(rt, model, candidates)
    if unsupported:
        return Outcome(name, suite, "skipped", unsupported)
    ran_on = ""
    try:
        compiled = await rt.compile(model, devices=candidates)
        ran_on = _ran_on(compiled)
        result = await compiled.execute(_inputs(case))
    except NnrtError as e:
        return Outcome(name, suite, "failed", str(e), ran_on)
    if case["expectedMultinomialDistributionTolerance"] > 0:
        problem = check_multinomial(case, result.outputs)
    else:
        problem = check_outputs(case, result.outputs, result.output_shapes)
    return Outcome(name, suite, "failed" if problem else "passed", problem or "", ran_on)


async def run_signed_identity(rt: nnrt.Runtime, case: dict,
                              candidates: list[str] | None) -> Outcome:
    """Run ``case`` and its signed variant; quantized outputs must differ by
    exactly 128 and every other output must be identical."""
    name, suite = case["name"], "SignedIdentity"
    results = []
    ran_on = []
    for variant in (case, to_signed(case)):
        try:
            model = build_model(variant)
            unsupported = await _unsupported(rt, model, candidates)
            if unsupported:
                return Outcome(name, suite, "skipped", unsupported)
            compiled = await rt.compile(model, devices=candidates)
            ran_on.append(_ran_on(compiled))
            results.append(await compiled.execute(_inputs(variant)))
        except NnrtError as e:
            return Outcome(name, suite, "failed", f"{'signed' if results else 'unsigned'}: {e}",
                           ",".join(ran_on))
    devices = ran_on[0] if ran_on[0] == ran_on[1] else ",".join(ran_on)
    unsigned, signed = results
    main = case["main"]
    for pos, index in enumerate(main["outputIndexes"]):
        if main["operands"][index]["isIgnored"]:
            continue
        u, s = np.asarray(unsigned.outputs[pos]), np.asarray(signed.outputs[pos])
        if unsigned.output_shapes[pos] != signed.output_shapes[pos]:
            return Outcome(name, suite, "failed", f"output {pos}: shapes "
                           f"{unsigned.output_shapes[pos]} and {signed.output_shapes[pos]} differ",
                           devices)
        expected = u.astype(np.int32) - 128 if u.dtype == np.uint8 else u
        diff = np.flatnonzero(s.astype(np.float64).reshape(-1)
                              != expected.astype(np.float64).reshape(-1))
        if diff.size:
            k = int(diff[0])
            return Outcome(name, suite, "failed",
                           f"output {pos}: {diff.size} elements differ, first at {k}: signed "
                           f"{s.reshape(-1)[k]!r}, unsigned {u.reshape(-1)[k]!r}", devices)
    return Outcome(name, suite, "passed", devices=devices)


async def _unsupported(rt: nnrt.Runtime, model: nnrt.Model,
                       devices: list[str] | None) -> str | None:
    """The skip reason when the devices report an operation unsupported."""
    flags = await rt.supported_operations(model, devices)
    if all(flags):
        return None
    ops = model.hal_model.main.operations
    missing = sorted({ops[i].type.name for i, ok in enumerate(flags) if not ok})
    return f"device reports unsupported: {', '.join(missing)}"


def _inputs(case: dict) -> list:
    main = case["main"]
    values = []
    for i in main["inputIndexes"]:
        o = main["operands"][i]
        values.append(_array(o) if o["data"] else None)
    return values


def suites_of(case: dict) -> list[str]:
    if case["expectFailure"]:
        return ["GeneratedValidationTests"]
    suites = [s for s in SUITES if s in case["harness"]["ctsSuites"]]
    if "QuantizationCouplingTest" in suites:
        suites.append("SignedIdentity")
    return suites


def _run_file_group(args) -> list[dict]:
    """Worker: run every case of some spec files; returns outcomes as dicts."""
    paths, pattern, device, spawn, fallback = args

    async def main():
        out = []
        async with nnrt.Runtime(spawn=spawn) as rt:
            for _stem, case in load_cases(paths, pattern):
                for suite in suites_of(case):
                    try:
                        outcome = await run_case(rt, case, suite, device, fallback)
                    except Exception as e:  # a crash in one case must not hide the others
                        outcome = Outcome(case["name"], suite, "failed",
                                          f"crashed: {type(e).__name__}: {e}")
                    out.append(asdict(outcome))
        return out
    return anyio.run(main)


def _spec_files(paths: list[str]) -> list[str]:
    files = []
    for p in map(Path, paths):
        if p.is_dir():
            files += [str(f) for f in sorted(p.iterdir())
                      if f.name.endswith((".json", ".json.gz")) and f.name != "INDEX.json"]
        elif p.exists():
            files.append(str(p))
        else:
            raise FileNotFoundError(f"no such file or folder: {p}")
    return files


def run(paths: list[str], *, pattern: str | None = None, device: str | None = None,
        jobs: int | None = None, progress=None, spawn: list[str] = (),
        fallback: bool = False) -> list[Outcome]:
    """Run every case under ``paths``; ``fallback`` lets operations ``device``
    does not support run on the reference CPU device instead of skipping."""
    files = _spec_files(paths)
    # Big files first so the workers finish together.
    files.sort(key=lambda f: -os.path.getsize(f))
    jobs = max(1, jobs or os.cpu_count() or 1)
    if jobs > 1 and spawn:
        # Each worker starts its own services; group the files so that
        # happens once per worker, not once per spec file.
        tasks = [(files[k::jobs], pattern, device, list(spawn), fallback) for k in range(jobs)]
    else:
        tasks = [([f], pattern, device, list(spawn), fallback) for f in files]
    outcomes: list[Outcome] = []
    if jobs == 1:
        for t in tasks:
            outcomes += [Outcome(**d) for d in _run_file_group(t)]
            if progress:
                progress(len(outcomes))
    else:
        # ProcessPoolExecutor, not multiprocessing.Pool: if a worker dies (a
        # kernel crashing the interpreter), the run fails with BrokenProcessPool
        # instead of waiting forever for the lost task.
        ctx = multiprocessing.get_context("forkserver")
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
            futures = [pool.submit(_run_file_group, t) for t in tasks]
            for future in concurrent.futures.as_completed(futures):
                outcomes += [Outcome(**d) for d in future.result()]
                if progress:
                    progress(len(outcomes))
    return outcomes


def count_by_devices(outcomes: list[Outcome]) -> dict[str, dict[str, int]]:
    """{devices the run used: {status: count}}."""
    counts: dict[str, dict[str, int]] = {}
    for o in outcomes:
        per = counts.setdefault(o.devices, {})
        per[o.status] = per.get(o.status, 0) + 1
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m nnrt.testing.cts",
        description="Run NNAPI CTS test vectors (nnrt-cts-json/1) through nnrt and check them "
                    "with the CTS accuracy criteria.")
    parser.add_argument("paths", nargs="+", help="spec files or folders (e.g. ../shared/cts/V1_0)")
    parser.add_argument("--device", help="run on this device only (default: the runtime's choice)")
    parser.add_argument("--spawn", action="append", default=[], metavar="KIND",
                        help="start a driver service of this kind (e.g. sample-float-fast, "
                             "named after it) for the run; repeatable")
    parser.add_argument("--fallback", action="store_true",
                        help="with --device: partition what the device does not support to the "
                             "reference CPU device instead of skipping the run")
    parser.add_argument("--filter", dest="pattern",
                        help="fnmatch glob on case names or spec file names, e.g. 'conv*'")
    parser.add_argument("--json", dest="json_out", help="write every outcome to this JSON file")
    parser.add_argument("--jobs", "-j", type=int, default=None,
                        help="worker processes (default: number of CPUs)")
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress on stderr")
    args = parser.parse_args(argv)
    start = time.monotonic()
    interactive = not args.quiet and sys.stderr.isatty()

    def progress(n: int) -> None:
        if interactive:
            print(f"\r{n} runs done", end="", file=sys.stderr, flush=True)

    try:
        outcomes = run(args.paths, pattern=args.pattern, device=args.device, jobs=args.jobs,
                       progress=progress, spawn=args.spawn, fallback=args.fallback)
    except FileNotFoundError as e:
        parser.error(str(e))
    if interactive:
        print(file=sys.stderr)
    outcomes.sort(key=lambda o: (o.name, o.suite))
    for o in outcomes:
        if o.status == "failed":
            print(f"FAILED {o.name} [{o.suite}]: {o.detail}")
    for o in outcomes:
        if o.status == "skipped":
            print(f"SKIPPED {o.name} [{o.suite}]: {o.detail}")
    passed = sum(o.status == "passed" for o in outcomes)
    failed = sum(o.status == "failed" for o in outcomes)
    skipped = sum(o.status == "skipped" for o in outcomes)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps([asdict(o) for o in outcomes], indent=1))
    if not args.quiet:
        print(f"({len(outcomes)} runs in {time.monotonic() - start:.1f} s)", file=sys.stderr)
    if args.device:
        for devices, counts in sorted(count_by_devices(outcomes).items()):
            print(f"ran on {devices or '(not compiled)'}: " +
                  ", ".join(f"{n} {status}" for status, n in sorted(counts.items())))
    print(f"{passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
