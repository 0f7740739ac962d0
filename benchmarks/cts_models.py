"""Time CTS models through the runtime: the conv-heavy V1_0
``mobilenet_224_gender_basic_fixed`` and the largest LSTM vector.

For each model it prints the median time per execution through
``await compiled.execute`` (the public async path: staging, worker thread,
driver), the median time of the reference driver's ``execute_synchronously``
on a ready-made request (the baseline, measured in the same run), and the
ratio of the two, i.e. what the runtime layer costs on top of the kernels.

    .venv/bin/python benchmarks/cts_models.py [--runs N] [--cts ../shared/cts]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import anyio
import numpy as np

import nnrt
from nnrt.hal import Request, RequestArgument
from nnrt.model.graph import DataLocation
from nnrt.testing import cts

ROOT = Path(__file__).resolve().parents[1]


def find_cases(cts_dir: Path):
    mobilenet, lstm = None, None
    for _stem, case in cts.load_cases([str(cts_dir / v) for v in ("V1_0", "V1_1", "V1_2")
                                       if (cts_dir / v).exists()]):
        if case["name"] == "mobilenet_224_gender_basic_fixed":
            mobilenet = case
        if any(op["type"] == "LSTM" for op in case["main"]["operations"]) \
                and not case["expectFailure"]:
            size = sum(len(o["data"]) for o in case["main"]["operands"])
            if lstm is None or size > lstm[0]:
                lstm = (size, case)
    return [c for c in (mobilenet, lstm[1] if lstm else None) if c is not None]


def _driver_request(compiled, inputs):
    hal = compiled.model.hal_model
    pools, args = [], []
    for value in inputs:
        if value is None:
            args.append(RequestArgument(has_no_value=True))
            continue
        arr = np.ascontiguousarray(value)
        pools.append(arr.reshape(-1).view(np.uint8))
        args.append(RequestArgument(False, DataLocation(len(pools) - 1, 0, arr.nbytes), arr.shape))
    outs = []
    for i in hal.main.output_indexes:
        operand = hal.main.operands[i]
        buf = np.empty(operand.byte_size, np.uint8)
        pools.append(buf)
        outs.append(RequestArgument(False, DataLocation(len(pools) - 1, 0, buf.nbytes)))
    return Request(tuple(args), tuple(outs), tuple(pools))


async def bench(case, runs: int) -> tuple[float, float]:
    model = cts.build_model(case)
    inputs = cts._inputs(case)
    async with nnrt.Runtime() as rt:
        compiled = await rt.compile(model)
        await compiled.execute(inputs)  # warm-up
        through_runtime = []
        for _ in range(runs):
            t0 = time.perf_counter()
            await compiled.execute(inputs)
            through_runtime.append(time.perf_counter() - t0)
        request = _driver_request(compiled, inputs)
        prepared = compiled._prepared
        driver_only = []
        for _ in range(runs):
            t0 = time.perf_counter()
            result = prepared.execute_synchronously(request)
            driver_only.append(time.perf_counter() - t0)
            assert result.status == nnrt.ErrorStatus.NONE, result
    return statistics.median(through_runtime), statistics.median(driver_only)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--cts", type=Path, default=ROOT.parent / "shared" / "cts")
    args = parser.parse_args(argv)
    cases = find_cases(args.cts)
    if not cases:
        print(f"no CTS vectors under {args.cts}", file=sys.stderr)
        return 1
    print(f"{'model':50} {'runtime ms':>11} {'driver ms':>10} {'ratio':>6}")
    for case in cases:
        rt_s, drv_s = anyio.run(bench, case, args.runs)
        print(f"{case['name']:50} {rt_s * 1e3:11.3f} {drv_s * 1e3:10.3f} {rt_s / drv_s:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
