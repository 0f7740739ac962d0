"""Run NNAPI CTS test vectors (the ``nnrt-cts-json/1`` format of
``../shared/cts``) through the public API and check them as the CTS harness does.

    python -m nnrt.testing.cts PATH... [--device NAME] [--spawn KIND] [--mode MODE]
                               [--filter GLOB] [--json OUT]

``--spawn sample-float-fast --device sample-float-fast`` runs the vectors on an
out-of-process driver service the runner starts (one per worker process).

Each case runs once per CTS suite this runner implements that the case belongs
to: ``GeneratedTests`` (as specified), ``DynamicOutputShapeTest`` (every
output declared with unknown dimensions), ``QuantizationCouplingTest`` (every
TENSOR_QUANT8_ASYMM operand turned into TENSOR_QUANT8_ASYMM_SIGNED, values and
zero points shifted by -128), or ``GeneratedValidationTests`` for
``expectFailure`` cases. ``SignedIdentity`` is nnrt's own check on the same
cases as QuantizationCouplingTest: the signed variant's outputs must equal the
unsigned outputs shifted by -128 exactly (not merely both within tolerance).
``DeviceMemoryTest`` runs through shared memory and ``FencedComputeTest``
through a chain of fenced executions. Referenced subgraphs (IF/WHILE,
nested) are built as SCHEMA §5.1 says.

``--mode`` picks harness modes (:data:`MODES`, repeatable, ``all``): the
default ``execute`` runs the suites above; ``sync``, ``burst``, ``fenced``,
``memory``, ``dynamic``, ``relaxed`` and ``domain`` (device memories from
roles) rerun the cases another way (see
the comment above :data:`MODES` and docs/vendors/conformance.md).

A run is skipped only when the device reports an operation of the model
unsupported; every skip is listed with its reason. The last line is
``N passed, M failed, K skipped`` (counting runs), after one such line per
mode when several ran.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
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
    mode: str = "execute"  # the harness mode (MODES)
    spec: str = ""         # the spec file the case came from (for replay commands)
    devices: str = ""      # the devices that ran it, "+"-joined in step order


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


def build_model(case: dict, dynamic_outputs: bool = False,
                relaxed: bool | None = None) -> nnrt.Model:
    """The case as an nnrt Model, referenced subgraphs (nested ones too)
    built and finished before the operands that refer to them (SCHEMA §5.1).
    ``relaxed`` overrides the case's ``isRelaxed`` (the relaxed harness mode)."""
    relaxed = case["isRelaxed"] if relaxed is None else relaxed
    referenced = case["referenced"]
    built: dict[int, nnrt.Model] = {}

    def subgraph(k: int, path: tuple[int, ...]) -> nnrt.Model:
        if k in path:
            raise nnrt.NnrtError(nnrt.ErrorStatus.INVALID_ARGUMENT,
                                 f"referenced subgraph {k} refers to itself")
        if not 0 <= k < len(referenced):
            raise nnrt.NnrtError(nnrt.ErrorStatus.INVALID_ARGUMENT,
                                 f"SUBGRAPH operand names subgraph {k}; the case has "
                                 f"{len(referenced)}")
        if k not in built:
            built[k] = _build_subgraph(referenced[k], relaxed, dynamic_outputs,
                                       lambda j: subgraph(j, path + (k,)))
        return built[k]

    return _build_subgraph(case["main"], relaxed, dynamic_outputs, lambda j: subgraph(j, ()))


def _build_subgraph(sub: dict, relaxed: bool, dynamic_outputs: bool,
                    subgraph) -> nnrt.Model:
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
        elif o["lifetime"] == "SUBGRAPH":
            m.set_operand_value_from_model(k, subgraph(int(o["data"][0])))
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


def check_outputs(case: dict, outputs: list[np.ndarray], shapes: list,
                  relaxed: bool = False) -> str | None:
    """None when every output passes the CTS criteria, else what failed.
    ``relaxed``: the model was run relaxed whatever the case says."""
    main = case["main"]
    relaxed_tol = relaxed or case["isRelaxed"] or _uses_float16(case)
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

# Harness modes, as AOSP's TestGenerated variants: how a run computes.
#   execute  CompiledModel.execute (the suites of SCHEMA §5.4; DeviceMemoryTest
#            and FencedComputeTest runs use the memory and fenced paths)
#   sync     a reusable execution computed synchronously on a worker thread
#            (the driver's execute_synchronously when one device runs the whole
#            model), every input and output in one shared-memory pool
#   burst    a burst session, two executions of the case in a row
#   fenced   a chain of fenced executions: the second waits for the first's fence
#   memory   inputs and outputs are regions of nnrt.Memory (shared memory)
#   dynamic  outputs declared with unknown dimensions, first run with 1-element
#            output buffers: must give OUTPUT_INSUFFICIENT_SIZE with the shapes,
#            then the retry with buffers of those shapes must pass
#   relaxed  float32 cases with relaxComputationFloat32toFloat16 on, checked
#            with the relaxed tolerance
#   domain   memory domains: every tensor input and output through its own
#            device memory made from a MemoryDesc with that role (rt.allocate),
#            inputs filled and outputs read back with nnrt.copy
MODES = ("execute", "sync", "burst", "fenced", "memory", "dynamic", "relaxed", "domain")
_SUITE_PATH = {"DeviceMemoryTest": "memory", "FencedComputeTest": "fenced"}


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


class CaseModels:
    """The models one case compiles, shared by its suites: GeneratedTests,
    DeviceMemoryTest and FencedComputeTest build and compile the very same
    model for the same devices and differ only in how they execute it (as
    an app compiles once and runs many ways), so it is built and compiled
    once per case. ``close`` releases them when the case is done: released
    here, not by the garbage collector at some later call (a finalizer
    firing inside a service client's send deadlocked it)."""

    def __init__(self):
        self._made: dict[tuple, tuple] = {}
        self._signed: dict[int, tuple[dict, dict]] = {}

    def signed(self, case: dict) -> dict:
        """``to_signed(case)``, the same object each time it is asked for, so
        QuantizationCouplingTest and SignedIdentity share its compilation."""
        made = self._signed.get(id(case))
        if made is None:
            made = self._signed[id(case)] = (case, to_signed(case))
        return made[1]

    async def get(self, rt, case, candidates, dynamic_outputs: bool, relaxed):
        """(skip reason or None, compiled model or None when skipped).
        _BuildRefused, NotImplementedError from building; NnrtError from
        compiling."""
        key = (id(case), tuple(candidates or ()), dynamic_outputs, relaxed)
        made = self._made.get(key)
        if made is None:
            try:
                model = build_model(case, dynamic_outputs=dynamic_outputs, relaxed=relaxed)
            except NnrtError as e:
                raise _BuildRefused(e) from None
            unsupported = await _unsupported(rt, model, candidates)
            compiled = None if unsupported else await rt.compile(model, devices=candidates)
            # (the case is kept with them: its id is the key)
            made = self._made[key] = (case, unsupported, compiled)
        return made[1:]

    def close(self) -> None:
        for _case, _unsupported_reason, compiled in self._made.values():
            if compiled is not None:
                compiled.close()
        self._made.clear()
        self._signed.clear()


class _BuildRefused(Exception):
    """The model builder refused a case (an NnrtError it raised)."""


async def run_case(rt: nnrt.Runtime, case: dict, suite: str, device: str | None,
                   mode: str = "execute", fallback: bool = False,
                   models: CaseModels | None = None) -> Outcome:
    """One run of ``case`` in ``suite`` and harness ``mode``. ``models``
    shares the case's built and compiled models between its suites (the
    caller closes it after the case); without it, this run builds and
    compiles its own and releases them."""
    if models is None:
        models = CaseModels()
        try:
            return await run_case(rt, case, suite, device, mode, fallback, models)
        finally:
            models.close()
    name = case["name"]
    candidates = _candidates(rt, device, fallback)
    path = _SUITE_PATH.get(suite, mode)
    if suite == "GeneratedValidationTests":
        try:
            model = build_model(case)
            compiled = await rt.compile(model, devices=candidates)
            try:
                await _COMPUTE[path](compiled, case)
            finally:
                compiled.close()
        except NnrtError:
            return Outcome(name, suite, "passed", mode=mode)
        except NotImplementedError as e:
            return Outcome(name, suite, "failed", f"cannot build: {e} not implemented", mode)
        return Outcome(name, suite, "failed", "expected a failure, but everything succeeded",
                       mode)
    if suite == "SignedIdentity":
        return await run_signed_identity(rt, case, candidates, models)
    if suite == "QuantizationCouplingTest":
        case = models.signed(case)
    relaxed = True if mode == "relaxed" else None
    dynamic = suite == "DynamicOutputShapeTest"
    ran_on = device or ""
    try:
        # Every mode compiles for the same candidate devices: a mode that
        # prepared on ``device`` itself (sync once did) would ignore ``fallback``.
        try:
            unsupported, compiled = await models.get(rt, case, candidates, dynamic, relaxed)
        except NotImplementedError as e:
            return Outcome(name, suite, "failed", f"cannot build: {e} not implemented", mode)
        except _BuildRefused as e:
            return Outcome(name, suite, "failed", f"model building refused: {e.args[0]}", mode)
        if unsupported:
            return Outcome(name, suite, "skipped", unsupported, mode)
        ran_on = _ran_on(compiled)
        outputs, shapes = await _COMPUTE[path](compiled, case)
    except NnrtError as e:
        return Outcome(name, suite, "failed", str(e), mode, devices=ran_on)
    except _HarnessFailure as e:
        return Outcome(name, suite, "failed", str(e), mode, devices=ran_on)
    if case["expectedMultinomialDistributionTolerance"] > 0:
        problem = check_multinomial(case, outputs)
    else:
        problem = check_outputs(case, outputs, shapes, relaxed=mode == "relaxed")
    return Outcome(name, suite, "failed" if problem else "passed", problem or "", mode,
                   devices=ran_on)


class _HarnessFailure(Exception):
    """The device broke a rule of the harness mode (not a numeric mismatch)."""


async def _compute_execute(compiled, case):
    r = await compiled.execute(_inputs(case))
    return r.outputs, r.output_shapes


async def _compute_burst(compiled, case):
    inputs = _inputs(case)
    async with compiled.burst() as burst:
        first = await burst.execute(inputs)
        first_out = [np.array(o, copy=True) for o in first.outputs]
        second = await burst.execute(inputs)
    if case["expectedMultinomialDistributionTolerance"] == 0:
        for k, (a, b) in enumerate(zip(first_out, second.outputs)):
            if first.output_shapes[k] != second.output_shapes[k] or \
                    not np.array_equal(a, np.asarray(b), equal_nan=a.dtype.kind == "f"):
                raise _HarnessFailure(f"burst: output {k} of the second execution differs "
                                      f"from the first")
    return second.outputs, second.output_shapes


async def _compute_fenced(compiled, case):
    """A chain: the second execution waits for the first one's fence."""
    inputs = _inputs(case)
    fence1, cb1 = await compiled.execute_fenced(inputs)
    fence2, cb2 = await compiled.execute_fenced(inputs, wait_for=[fence1])
    second = await cb2.result()
    if not cb1.done:
        raise _HarnessFailure("fenced: the second execution finished before the fence "
                              "it waited for was signaled")
    first = cb1.get_result()
    if case["expectedMultinomialDistributionTolerance"] == 0:
        for k, (a, b) in enumerate(zip(first.outputs, second.outputs)):
            if not np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True):
                raise _HarnessFailure(f"fenced: output {k} of the chained execution differs "
                                      f"from the first")
    return second.outputs, second.output_shapes


def _nbytes(operand: dict) -> int:
    return len(operand["data"]) * OperandType[operand["type"]].dtype.itemsize


@contextlib.contextmanager
def _in_one_memory(case: dict, align: int):
    """One shared Memory holding the case's input values, with a region for
    each input (None for an omitted one) and for each output, each aligned
    to ``align`` bytes: yields (input regions, output regions)."""
    main = case["main"]
    inputs = _inputs(case)
    sizes = [0 if v is None else v.nbytes for v in inputs] + \
        [max(1, _nbytes(main["operands"][i])) for i in main["outputIndexes"]]
    offsets, offset = [], 0
    for size in sizes:
        offsets.append(offset)
        offset += (size + align - 1) // align * align
    with nnrt.Memory.create(max(offset, align)) as memory:
        in_regions = []
        for k, v in enumerate(inputs):
            if v is None:
                in_regions.append(None)
                continue
            memory.view()[offsets[k]:offsets[k] + v.nbytes] = \
                np.ascontiguousarray(v).reshape(-1).view(np.uint8)
            in_regions.append(memory.region(offsets[k], v.nbytes))
        out_regions = [memory.region(offsets[k], sizes[k])
                       for k in range(len(inputs), len(sizes))]
        yield in_regions, out_regions


async def _compute_memory(compiled, case):
    """Inputs and outputs in one shared Memory, 4-byte-aligned regions
    (zero copy: the results are read back from the memory)."""
    with _in_one_memory(case, 4) as (inputs, outputs):
        r = await compiled.execute(inputs, outputs=outputs)
        outputs = [np.array(o, copy=True) for o in r.outputs]  # before the memory closes
        shapes = list(r.output_shapes)
        del r
        return outputs, shapes


async def _compute_sync(compiled, case):
    """A reusable execution over one shared Memory (64-byte-aligned
    regions) computed by ``compute_synchronously`` on a worker thread, as a
    SyncRuntime's execution computes: a compiled model that is one step on
    one device runs that driver's own ``execute_synchronously``; one split
    across devices (``fallback``) has no single synchronous HAL call and
    computes through the runtime's general path (``recover``)."""
    with _in_one_memory(case, 64) as (inputs, outputs):
        execution = compiled.create_execution(inputs, outputs=outputs)
        try:
            r = await anyio.to_thread.run_sync(execution.compute_synchronously)
            if r is None:
                r = await execution.recover()
            outputs = [np.array(o, copy=True) for o in r.outputs]  # before the memory closes
            return outputs, list(r.output_shapes)
        finally:
            execution.close()


async def _compute_dynamic(compiled, case):
    """Outputs of unknown size: too-small buffers first, then the retry."""
    main = case["main"]
    inputs = _inputs(case)
    dtypes = [OperandType[main["operands"][i]["type"]].dtype for i in main["outputIndexes"]]
    small = [np.zeros(1, d) for d in dtypes]
    needs = [max(1, _nbytes(main["operands"][i])) for i in main["outputIndexes"]]
    try:
        r = await compiled.execute(inputs, outputs=small)
    except NnrtError as e:
        if e.status != nnrt.ErrorStatus.OUTPUT_INSUFFICIENT_SIZE:
            raise
        shapes = list(e.output_shapes or [])
        if len(shapes) != len(dtypes):
            raise _HarnessFailure(f"dynamic: OUTPUT_INSUFFICIENT_SIZE came with "
                                  f"{len(shapes)} output shapes for {len(dtypes)} outputs")
        bigger = [np.zeros(max(1, int(np.prod(s, dtype=np.int64))), d)
                  for s, d in zip(shapes, dtypes)]
        r = await compiled.execute(inputs, outputs=bigger)
        return r.outputs, r.output_shapes
    if any(n > 1 * d.itemsize for n, d in zip(needs, dtypes)):
        raise _HarnessFailure("dynamic: an output larger than its 1-element buffer was "
                              "accepted without OUTPUT_INSUFFICIENT_SIZE")
    return r.outputs, r.output_shapes


async def _compute_domain(compiled, case):
    """Every tensor input and output in a device memory allocated for its
    role; scalars (which a memory does not hold) and empty inputs are
    passed as they are. Outputs are left to the driver to size."""
    rt = compiled.runtime
    main = case["main"]
    made: list = []
    try:
        inputs = []
        for k, v in enumerate(_inputs(case)):
            if v is None or v.ndim == 0 or v.nbytes == 0:
                inputs.append(v)
                continue
            memory = await rt.allocate(nnrt.MemoryDesc().add_input_role(compiled, k)
                                       .set_dimensions(v.shape))
            made.append(memory)
            with nnrt.Memory.create(v.nbytes) as staged:
                staged.view()[:] = np.ascontiguousarray(v).reshape(-1).view(np.uint8)
                await nnrt.copy(staged, memory)
            inputs.append(memory)
        outputs = []
        for k, i in enumerate(main["outputIndexes"]):
            operand = OperandType[main["operands"][i]["type"]]
            if not operand.is_tensor:
                outputs.append(np.empty(1, operand.dtype))
                continue
            memory = await rt.allocate(nnrt.MemoryDesc().add_output_role(compiled, k))
            made.append(memory)
            outputs.append(memory)
        r = await compiled.execute(inputs, outputs=outputs)
        values = []
        for out, shape in zip(r.outputs, r.output_shapes):
            if not isinstance(out, nnrt.DeviceMemory):
                values.append(np.array(out, copy=True).reshape(shape))
                continue
            n = out.nbytes(shape)
            if n == 0:
                values.append(np.empty(shape, out.dtype))
                continue
            with nnrt.Memory.create(n) as staged:
                await nnrt.copy(out, staged)
                values.append(np.array(staged.array(out.dtype, shape), copy=True))
        return values, list(r.output_shapes)
    finally:
        for memory in made:
            memory.close()


_COMPUTE = {"execute": _compute_execute, "domain": _compute_domain, "burst": _compute_burst, "fenced": _compute_fenced,
            "memory": _compute_memory, "dynamic": _compute_dynamic,
            "relaxed": _compute_execute, "sync": _compute_sync}


async def run_signed_identity(rt: nnrt.Runtime, case: dict, candidates: list[str] | None,
                              models: "CaseModels") -> Outcome:
    """Run ``case`` and its signed variant (the case's compilations, shared
    with its other suites); quantized outputs must differ by exactly 128 and
    every other output must be identical."""
    name, suite = case["name"], "SignedIdentity"
    results = []
    ran_on: list[str] = []
    for variant in (case, models.signed(case)):
        try:
            unsupported, compiled = await models.get(rt, variant, candidates, False, None)
            if unsupported:
                return Outcome(name, suite, "skipped", unsupported)
            ran_on.append(_ran_on(compiled))
            results.append(await compiled.execute(_inputs(variant)))
        except (NnrtError, _BuildRefused) as e:
            e = e.args[0] if isinstance(e, _BuildRefused) else e
            return Outcome(name, suite, "failed", f"{'signed' if results else 'unsigned'}: {e}")
    unsigned, signed = results
    main = case["main"]
    for pos, index in enumerate(main["outputIndexes"]):
        if main["operands"][index]["isIgnored"]:
            continue
        u, s = np.asarray(unsigned.outputs[pos]), np.asarray(signed.outputs[pos])
        if unsigned.output_shapes[pos] != signed.output_shapes[pos]:
            return Outcome(name, suite, "failed", f"output {pos}: shapes "
                           f"{unsigned.output_shapes[pos]} and {signed.output_shapes[pos]} differ")
        expected = u.astype(np.int32) - 128 if u.dtype == np.uint8 else u
        diff = np.flatnonzero(s.astype(np.float64).reshape(-1)
                              != expected.astype(np.float64).reshape(-1))
        if diff.size:
            k = int(diff[0])
            return Outcome(name, suite, "failed",
                           f"output {pos}: {diff.size} elements differ, first at {k}: signed "
                           f"{s.reshape(-1)[k]!r}, unsigned {u.reshape(-1)[k]!r}")
    return Outcome(name, suite, "passed", devices=",".join(dict.fromkeys(ran_on)))


async def _unsupported(rt: nnrt.Runtime, model: nnrt.Model,
                       devices: list[str] | None) -> str | None:
    """The skip reason when the named devices report an operation
    unsupported. With no device named there is nothing to skip: the runtime
    places each operation on a device that takes it, and a model none can
    take fails to compile (a failure, not a skip)."""
    if devices is None:
        return None
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


def suites_of(case: dict, mode: str = "execute") -> list[str]:
    """The runs of ``case`` in harness ``mode`` (suite names, SCHEMA §5.4).
    Every mode runs the validation cases; ``execute`` runs every suite."""
    listed = case["harness"]["ctsSuites"]
    if case["expectFailure"]:
        # Not listed: the infinite-loop WHILE cases (the VTS checks loop timeouts).
        if "GeneratedValidationTests" not in listed or mode in ("dynamic", "relaxed"):
            return []
        return ["GeneratedValidationTests"]
    if mode == "execute":
        suites = [s for s in SUITES if s in listed]
        if "QuantizationCouplingTest" in suites:
            suites.append("SignedIdentity")
        suites += [s for s in ("DeviceMemoryTest", "FencedComputeTest") if s in listed]
        return suites
    if mode == "dynamic":
        return ["DynamicOutputShapeTest"] if "DynamicOutputShapeTest" in listed else []
    if mode == "relaxed":
        types = {o["type"] for sub in (case["main"], *case["referenced"])
                 for o in sub["operands"]}
        eligible = "TENSOR_FLOAT32" in types and not case["isRelaxed"] \
            and not _uses_float16(case)
        return ["GeneratedTests"] if eligible else []
    return ["GeneratedTests"]


def _run_file_group(args) -> list[dict]:
    """Worker: run every case of some spec files; returns outcomes as dicts.
    ``devices`` (in-process only) replaces discovery and ``spawn``."""
    paths, pattern, device, spawn, modes, devices, fallback = args

    async def main():
        out = []
        runtime = nnrt.Runtime(devices=devices) if devices is not None else \
            nnrt.Runtime(spawn=spawn)
        async with runtime as rt:
            for path in paths:
                for _stem, case in load_cases([path], pattern):
                    for mode in modes:
                        models = CaseModels()
                        try:
                            for suite in suites_of(case, mode):
                                try:
                                    outcome = await run_case(rt, case, suite, device, mode,
                                                             fallback, models)
                                except Exception as e:  # a crash in one case must not hide others
                                    outcome = Outcome(case["name"], suite, "failed",
                                                      f"crashed: {type(e).__name__}: {e}", mode)
                                outcome.spec = str(path)
                                out.append(asdict(outcome))
                        finally:
                            models.close()
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


def planned_tasks(paths: list[str], *, jobs: int | None = None, spawn=(), devices=None) -> int:
    """How many times :func:`run` will call its ``progress`` callback."""
    files = len(_spec_files(paths))
    jobs = 1 if devices is not None else max(1, jobs or os.cpu_count() or 1)
    return jobs if jobs > 1 and spawn else files


def run(paths: list[str], *, pattern: str | None = None, device: str | None = None,
        jobs: int | None = None, progress=None, spawn: list[str] = (),
        modes: tuple[str, ...] = ("execute",), devices=None,
        fallback: bool = False) -> list[Outcome]:
    """Run every case under ``paths`` in each harness mode of ``modes``.
    ``fallback`` lets operations ``device`` does not support run on the
    reference CPU device instead of skipping the run.
    ``devices``: run on these in-process devices instead of discovering any
    (one worker; a test double, say). ``progress(n)`` is called as each spec
    file (or group of files) finishes, with the number of runs so far."""
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown harness mode(s) {unknown}; modes: {', '.join(MODES)}")
    modes = tuple(modes)
    files = _spec_files(paths)
    # Big files first so the workers finish together.
    files.sort(key=lambda f: -os.path.getsize(f))
    jobs = 1 if devices is not None else max(1, jobs or os.cpu_count() or 1)
    if spawn:
        # Each worker starts its own services; group the files so that
        # happens once per worker, not once per spec file (with one job, once).
        tasks = [(files[k::jobs], pattern, device, list(spawn), modes, None, fallback)
                 for k in range(jobs)]
    else:
        tasks = [([f], pattern, device, list(spawn), modes, devices, fallback) for f in files]
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
    parser.add_argument("--fallback", action="store_true",
                        help="with --device: partition what the device does not support to the "
                             "reference CPU device instead of skipping the run")
    parser.add_argument("--spawn", action="append", default=[], metavar="KIND",
                        help="start a driver service of this kind (e.g. sample-float-fast, "
                             "named after it) for the run; repeatable")
    parser.add_argument("--filter", dest="pattern",
                        help="fnmatch glob on case names or spec file names, e.g. 'conv*'")
    parser.add_argument("--mode", dest="modes", action="append", default=[],
                        choices=MODES + ("all",),
                        help="harness mode (repeatable; 'all' = every mode; default: execute)")
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
        modes = MODES if "all" in args.modes else tuple(dict.fromkeys(args.modes or ["execute"]))
        outcomes = run(args.paths, pattern=args.pattern, device=args.device, jobs=args.jobs,
                       progress=progress, spawn=args.spawn, modes=modes,
                       fallback=args.fallback)
    except FileNotFoundError as e:
        parser.error(str(e))
    if interactive:
        print(file=sys.stderr)
    outcomes.sort(key=lambda o: (o.name, o.suite, o.mode))
    for o in outcomes:
        if o.status == "failed":
            print(f"FAILED {o.name} [{o.suite}/{o.mode}]: {o.detail}")
    for o in outcomes:
        if o.status == "skipped":
            print(f"SKIPPED {o.name} [{o.suite}/{o.mode}]: {o.detail}")
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
    if len(modes) > 1:
        for mode in modes:
            runs = [o for o in outcomes if o.mode == mode]
            print(f"  {mode}: {sum(o.status == 'passed' for o in runs)} passed, "
                  f"{sum(o.status == 'failed' for o in runs)} failed, "
                  f"{sum(o.status == 'skipped' for o in runs)} skipped")
    print(f"{passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
