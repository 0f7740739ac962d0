"""The ``nnrt bench`` command line: its options and what it prints."""
from __future__ import annotations

import argparse
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("models", nargs="+", metavar="MODEL.tflite",
                        help="models to run (inputs and LiteRT outputs are taken from "
                             "<stem>.in<i>.npy / <stem>.out<i>.npy beside each, when present)")
    parser.add_argument("--device", action="append", default=None, metavar="D",
                        help="device name (repeatable; default: every device found)")
    parser.add_argument("--mode", default="execute,burst",
                        help="comma-separated: execute, burst, fenced, sync (default: execute,burst)")
    parser.add_argument("--spawn", action="append", default=[], metavar="KIND",
                        help="start a driver service of this kind for the run (repeatable)")
    how_long = parser.add_mutually_exclusive_group()
    how_long.add_argument("--runs", type=int, default=None, metavar="N",
                          help="measured executions per case (default: 50)")
    how_long.add_argument("--seconds", type=float, default=None, metavar="S",
                          help="measure each case for S seconds instead")
    parser.add_argument("--warmup", type=int, default=3, metavar="N",
                        help="executions before measuring (default: 3)")
    parser.add_argument("--deadline-ms", type=float, default=None, metavar="X",
                        help="give every execution a deadline X ms after its call")
    parser.add_argument("--priority", choices=["LOW", "MEDIUM", "HIGH"], default="MEDIUM")
    parser.add_argument("--no-discover", action="store_true",
                        help="skip configured driver services (in-process and --spawn only)")
    parser.add_argument("--report", metavar="OUT.html", help="write the HTML report")
    parser.add_argument("--json", metavar="OUT.json", help="write every sample as JSON")
    parser.add_argument("--trace", metavar="OUT.json",
                        help="write a Chrome trace-event (Perfetto) trace of the run")
    parser.add_argument("--stress", action="store_true",
                        help="crash/stress test instead: each model in a child process, "
                             "classified SUCCESS/FAILURE/CRASH/HANG")
    parser.add_argument("--hang-seconds", type=float, default=30.0, metavar="S",
                        help="--stress: a child with no progress for S seconds hangs "
                             "(default: 30)")
    parser.add_argument("--start-seconds", type=float, default=None, metavar="S",
                        help="--stress: a child that has not loaded and compiled its model "
                             "after S seconds hangs (default: 120, or --hang-seconds if longer)")
    parser.add_argument("--driver", metavar="MODULE:FACTORY", default=None,
                        help="--stress: run on the device FACTORY() returns (a driver under "
                             "test, in the child process) instead of a named device")


def main(args: argparse.Namespace) -> int:
    import anyio

    import nnrt
    from .. import trace
    from .runner import SUMMARY_HEADER, BenchConfig, run_bench, summary_rows

    config = BenchConfig(models=args.models, devices=args.device,
                         modes=[m.strip() for m in args.mode.split(",") if m.strip()],
                         runs=args.runs if args.runs is not None else
                         (None if args.seconds is not None else 50),
                         seconds=args.seconds, warmup=args.warmup, deadline_ms=args.deadline_ms,
                         priority=args.priority, spawn=args.spawn,
                         discover=not args.no_discover)
    if args.stress:
        from .stress import START_SECONDS, print_stress, run_stress
        results = run_stress(config, seconds=args.seconds or 10.0,
                             hang_seconds=args.hang_seconds, driver=args.driver,
                             start_seconds=args.start_seconds or START_SECONDS)
        print_stress(results)
        if args.report:
            from .report import write_stress_report
            write_stress_report(args.report, results, " ".join(["nnrt", "bench"] + sys.argv[2:]))
            print(f"report written to {args.report}")
        return 0 if all(r.verdict == "SUCCESS" for r in results) else 1
    if args.trace:
        trace.start(args.trace)
    try:
        result = anyio.run(run_bench, config)
    except nnrt.NnrtError as e:
        print(f"nnrt bench: {e.message}", file=sys.stderr)
        return 1
    finally:
        if args.trace:
            written = trace.stop()
            if written:
                print(f"trace written to {written}")
    result.command = " ".join(["nnrt", "bench"] + sys.argv[2:])
    print_summary(result, SUMMARY_HEADER, summary_rows(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.to_json(), f, indent=1, default=str)
        print(f"samples written to {args.json}")
    if args.report:
        from .report import write_bench_report
        write_bench_report(args.report, result)
        print(f"report written to {args.report}")
    return 0 if all(c.error is None for c in result.cases) else 1


def print_summary(result, header, rows) -> None:
    from rich.console import Console
    from rich.table import Table
    console = Console(width=None if sys.stdout.isatty() else 200)
    table = Table(*header)
    for r in rows:
        table.add_row(*r)
    console.print(table)
    console.print(f"machine: {result.machine.summary()}")
