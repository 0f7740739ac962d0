"""The ``nnrt`` command line: ``nnrt devices`` lists the devices a runtime finds."""
from __future__ import annotations

import argparse
import sys

import anyio

import nnrt


def _devices(args) -> int:
    async def main():
        async with nnrt.Runtime() as rt:
            for d in rt.devices:
                caps = d.capabilities()
                f32 = caps.performance(nnrt.OperandType.TENSOR_FLOAT32)
                print(f"{d.name}\n  type: {d.type.name}\n  version: {d.version_string}\n"
                      f"  feature level: {d.feature_level}\n"
                      f"  TENSOR_FLOAT32 performance: exec_time {f32.exec_time:g}, "
                      f"power_usage {f32.power_usage:g}")
    anyio.run(main)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nnrt", description="nnrt neural-network runtime")
    parser.add_argument("--version", action="version", version=f"nnrt {nnrt.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("devices", help="list the devices the runtime finds").set_defaults(func=_devices)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
