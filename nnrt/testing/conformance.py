"""``nnrt conformance``: the kit a driver vendor runs against a device.

Three suites, one report:

- ``cts``: the NNAPI CTS vectors (``../shared/cts`` and nnrt's own HAL 1.3
  control-flow vectors) through the runtime, in every harness mode
  (:data:`nnrt.testing.cts.MODES`), on the device alone;
- ``vts``: the HAL contract checks of :mod:`nnrt.testing.vts`;
- ``random``: random graphs of the operations the device supports, compared
  with the reference driver (:mod:`nnrt.testing.random_graph`).

Every result is passed, failed (with what broke) or skipped (with the
reason); every failure carries the command that replays it alone.
:func:`run_conformance` is the library entry, :func:`main` the command line.
"""
from __future__ import annotations

import argparse
import html
import json
import os
import shlex
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import anyio

import nnrt

from . import cts, random_graph, vts

SUITES = ("cts", "vts", "random")
OWN_VECTORS = Path(__file__).resolve().parent / "vectors"


@dataclass
class Result:
    suite: str       # cts | vts | random
    name: str
    status: str      # passed | failed | skipped
    detail: str = ""
    replay: str = ""
    group: str = ""  # cts: "<CTS suite>/<mode>"; random: "<type>: <flags> | <operations>"


@dataclass
class Report:
    device: str
    spawn: list[str]
    suites: list[str]
    started: float
    duration: float = 0.0
    results: list[Result] = field(default_factory=list)
    settings: dict = field(default_factory=dict)

    @property
    def failed(self) -> list[Result]:
        return [r for r in self.results if r.status == "failed"]

    def counts(self) -> dict[str, Counter]:
        """Per suite (and per CTS harness mode: ``cts:<mode>``) the status counts."""
        out: dict[str, Counter] = {}
        for r in self.results:
            out.setdefault(r.suite, Counter())[r.status] += 1
            if r.suite == "cts":
                out.setdefault(f"cts:{r.group.split('/')[-1]}", Counter())[r.status] += 1
        return out

    def to_json(self) -> dict:
        return {"format": "nnrt-conformance/1", "device": self.device, "spawn": self.spawn,
                "suites": self.suites, "started": self.started, "duration": self.duration,
                "settings": self.settings,
                "counts": {k: dict(v) for k, v in self.counts().items()},
                "passed": not self.failed,
                "results": [asdict(r) for r in self.results]}

    def to_html(self) -> str:
        return _html(self)


def default_cts_paths() -> list[str]:
    """The shared CTS folders that exist (``$NNRT_CTS_DIR``, else ``../shared/cts``
    beside the checkout or the working directory) plus nnrt's own vectors
    (``V1_3``, and one folder per later feature level)."""
    roots = [os.environ.get("NNRT_CTS_DIR"),
             str(Path(__file__).resolve().parents[3] / "shared" / "cts"),
             str(Path.cwd().parent / "shared" / "cts"), str(Path.cwd() / "shared" / "cts")]
    paths: list[str] = []
    for root in roots:
        if root and Path(root).is_dir():
            paths = [str(p) for p in sorted(Path(root).iterdir())
                     if p.is_dir() and p.name.startswith("V1_")]
            if paths:
                break
    return paths + [str(p) for p in sorted(OWN_VECTORS.iterdir()) if p.is_dir()]


def _spawn_args(spawn) -> str:
    return "".join(f" --spawn {shlex.quote(k)}" for k in spawn)


def _cts_replay(o: cts.Outcome, device: str, spawn) -> str:
    return (f"python -m nnrt.testing.cts {shlex.quote(o.spec)} --filter {shlex.quote(o.name)} "
            f"--mode {o.mode} --device {shlex.quote(device)}{_spawn_args(spawn)} -j1")


async def _open_device(rt: nnrt.Runtime, name: str):
    try:
        return rt.device(name)
    except nnrt.NnrtError as e:
        raise SystemExit(f"nnrt conformance: {e.message}") from None


def run_conformance(device: str, *, spawn=(), suites=SUITES, cts_paths=None,
                    cts_modes=cts.MODES, cts_filter: str | None = None, vts_checks=None,
                    seed: int = 0, count: int = 200, jobs: int | None = None,
                    devices=None, progress=None) -> Report:
    """Run the selected suites against ``device``. ``spawn`` starts driver
    services of those kinds first; ``devices`` gives in-process devices
    instead of discovery (a test double). ``progress(suite, done, total)``
    reports progress. Synchronous: it runs its own event loops."""
    spawn = list(spawn)
    unknown = [s for s in suites if s not in SUITES]
    if unknown:
        raise ValueError(f"unknown suite(s) {unknown}; suites: {', '.join(SUITES)}")
    report = Report(device, spawn, list(suites), time.time(),
                    settings={"cts_modes": list(cts_modes), "cts_filter": cts_filter,
                              "seed": seed, "count": count})
    start = time.monotonic()
    if "cts" in suites:
        paths = list(cts_paths) if cts_paths is not None else default_cts_paths()
        report.settings["cts_paths"] = paths
        total = cts.planned_tasks(paths, jobs=jobs, spawn=spawn, devices=devices)
        done = 0

        def step(_n: int) -> None:
            nonlocal done
            done += 1
            if progress:
                progress("cts", done, total)

        outcomes = cts.run(paths, pattern=cts_filter, device=device, jobs=jobs,
                           spawn=spawn, modes=tuple(cts_modes), devices=devices,
                           progress=step)
        for o in sorted(outcomes, key=lambda o: (o.name, o.suite, o.mode)):
            report.results.append(Result("cts", o.name, o.status, o.detail,
                                         _cts_replay(o, device, spawn) if o.status != "passed"
                                         else "", f"{o.suite}/{o.mode}"))
    if "vts" in suites or "random" in suites:
        report.results += anyio.run(_hal_suites, device, spawn, suites, vts_checks, seed,
                                    count, devices, progress)
    report.duration = time.monotonic() - start
    return report


async def _hal_suites(device, spawn, suites, vts_checks, seed, count, devices, progress):
    from nnrt.drivers.reference import ReferenceDevice

    results = []
    runtime = nnrt.Runtime(devices=devices) if devices is not None else \
        nnrt.Runtime(spawn=spawn)
    base = f"nnrt conformance --device {shlex.quote(device)}{_spawn_args(spawn)}"
    async with runtime as rt:
        dev = await _open_device(rt, device)
        if "vts" in suites:
            total = len(vts_checks) if vts_checks else len(vts.CHECKS)
            done = 0

            def vts_step(_o) -> None:
                nonlocal done
                done += 1
                if progress:
                    progress("vts", done, total)

            for o in await vts.run_checks(dev, vts_checks, vts_step):
                results.append(Result("vts", o.name, o.status, o.detail,
                                      f"{base} --suite vts --check {o.name}"
                                      if o.status != "passed" else ""))
        if "random" in suites:
            seeds = range(seed, seed + count)
            done = 0

            def random_step(_o) -> None:
                nonlocal done
                done += 1
                if progress:
                    progress("random", done, count)

            for o in await random_graph.run_seeds(dev, ReferenceDevice(), seeds,
                                                  progress=random_step):
                results.append(Result("random", f"seed {o.seed}", o.status, o.detail,
                                      f"{base} --suite random --seed {o.seed} --count 1"
                                      if o.status != "passed" else "", o.graph))
    return results


# --- report ---------------------------------------------------------------------------

_CSS = """body{font-family:sans-serif;margin:2em;max-width:80em}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:.3em .6em;
text-align:left;vertical-align:top}.failed{color:#b00}.passed{color:#070}.skipped{color:#a60}
code{font-size:90%;word-break:break-all}"""


def _html(report: Report) -> str:
    e = html.escape
    verdict = "FAILED" if report.failed else "PASSED"
    rows = []
    for suite, c in report.counts().items():
        rows.append(f"<tr><td>{e(suite)}</td><td class=passed>{c['passed']}</td>"
                    f"<td class=failed>{c['failed']}</td><td class=skipped>{c['skipped']}</td></tr>")
    failures = "".join(
        f"<tr><td>{e(r.suite)}</td><td>{e(r.name)}</td><td>{e(r.group)}</td>"
        f"<td>{e(r.detail)}</td><td><code>{e(r.replay)}</code></td></tr>"
        for r in report.failed)
    reasons = Counter((r.suite, r.detail) for r in report.results if r.status == "skipped")
    skipped = "".join(f"<tr><td>{e(s)}</td><td>{n}</td><td>{e(d)}</td></tr>"
                      for (s, d), n in reasons.most_common())
    return f"""<!doctype html><html><head><meta charset=utf-8>
<title>nnrt conformance: {e(report.device)}</title><style>{_CSS}</style></head><body>
<h1>nnrt conformance: {e(report.device)} — <span class={verdict.lower()}>{verdict}</span></h1>
<p>Suites {e(', '.join(report.suites))}; spawned services: {e(', '.join(report.spawn) or 'none')};
started {e(time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(report.started)))}, took
{report.duration:.1f} s. Settings: <code>{e(json.dumps(report.settings))}</code></p>
<h2>Summary</h2><table><tr><th>suite</th><th>passed</th><th>failed</th><th>skipped</th></tr>
{''.join(rows)}</table>
<h2>Failures ({len(report.failed)})</h2>
<table><tr><th>suite</th><th>test</th><th>group</th><th>what failed</th><th>replay</th></tr>
{failures}</table>
<h2>Skipped, by reason</h2><table><tr><th>suite</th><th>runs</th><th>reason</th></tr>
{skipped}</table></body></html>
"""


# --- command line ------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", required=True, help="the device under test, by name")
    parser.add_argument("--spawn", action="append", default=[], metavar="KIND",
                        help="start a driver service of this kind for the run (repeatable)")
    parser.add_argument("--suite", default=",".join(SUITES),
                        help="comma-separated suites: cts,vts,random (default: all)")
    parser.add_argument("--report", metavar="OUT.html", help="write an HTML report")
    parser.add_argument("--json", dest="json_out", metavar="OUT.json",
                        help="write every result as JSON")
    parser.add_argument("--cts", action="append", metavar="PATH",
                        help="CTS spec files or folders (default: the shared vectors and "
                             "nnrt's own V1_3 vectors)")
    parser.add_argument("--mode", action="append", choices=cts.MODES,
                        help="CTS harness mode (repeatable; default: every mode)")
    parser.add_argument("--filter", help="fnmatch glob on CTS case or spec file names")
    parser.add_argument("--check", action="append", choices=sorted(vts.CHECKS),
                        help="run only this VTS check (repeatable)")
    parser.add_argument("--seed", type=int, default=0, help="first random-graph seed")
    parser.add_argument("--count", type=int, default=200, help="random graphs to run")
    parser.add_argument("--jobs", "-j", type=int, default=None,
                        help="CTS worker processes (default: number of CPUs)")
    parser.add_argument("--quick", action="store_true",
                        help="the fast selection: nnrt's own V1_3 vectors and V1_0 only, "
                             "50 random graphs")
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress bar")


def run_command(args) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, \
        TimeElapsedColumn
    from rich.table import Table

    suites = [s.strip() for s in args.suite.split(",") if s.strip()]
    bad = [s for s in suites if s not in SUITES]
    if bad or not suites:
        print(f"nnrt conformance: unknown suite(s) {bad}; suites: {', '.join(SUITES)}",
              file=sys.stderr)
        return 2
    paths, count = args.cts, args.count
    if args.quick:
        defaults = default_cts_paths()
        paths = paths or [p for p in defaults if p.endswith(("V1_0", "V1_3"))]
        count = min(count, 50)
    console = Console(stderr=True)
    progress = Progress(TextColumn("{task.description:>8}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=console,
                        disable=args.quiet or not console.is_terminal)
    tasks: dict[str, int] = {}

    def on_progress(suite: str, done: int, total: int) -> None:
        if suite not in tasks:
            tasks[suite] = progress.add_task(suite, total=total)
        progress.update(tasks[suite], completed=done, total=total)

    try:
        with progress:
            report = run_conformance(args.device, spawn=args.spawn, suites=suites,
                                     cts_paths=paths, cts_modes=args.mode or cts.MODES,
                                     cts_filter=args.filter, vts_checks=args.check,
                                     seed=args.seed, count=count, jobs=args.jobs,
                                     progress=on_progress)
    except FileNotFoundError as e:
        print(f"nnrt conformance: {e}", file=sys.stderr)
        return 2
    out = Console()
    table = Table(title=f"nnrt conformance: {args.device}")
    for column in ("suite", "passed", "failed", "skipped"):
        table.add_column(column, justify="left" if column == "suite" else "right")
    for suite, c in report.counts().items():
        table.add_row(suite, str(c["passed"]), str(c["failed"]), str(c["skipped"]))
    for r in report.failed:
        where = escape(f" [{r.group}]") if r.group else ""
        out.print(f"[red]FAILED[/red] {escape(r.suite)} {escape(r.name)}{where}: "
                  f"{escape(r.detail)}", highlight=False, soft_wrap=True)
        out.print(f"  replay: {r.replay}", markup=False, highlight=False, soft_wrap=True)
    out.print(table)
    if args.report:
        Path(args.report).write_text(report.to_html())
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report.to_json(), indent=1))
    out.print(f"{'FAILED' if report.failed else 'PASSED'}: {len(report.failed)} failed, "
              f"{sum(r.status == 'passed' for r in report.results)} passed, "
              f"{sum(r.status == 'skipped' for r in report.results)} skipped "
              f"in {report.duration:.1f} s", markup=False, highlight=False)
    return 1 if report.failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nnrt conformance",
                                     description="Run the conformance kit against a device.")
    add_arguments(parser)
    return run_command(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
