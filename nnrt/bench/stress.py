"""``nnrt bench --stress``: the MLTS crash test.

Each model runs in a child process for a duration, executing back to back
and checking every result against the reference driver (run in the child,
in-process, as the oracle). The parent watches the child's output and
classifies the model:

- SUCCESS: the child ran for the whole duration and every result matched;
- FAILURE: an execution failed or gave a wrong result (the child says which
  and exits with status 1);
- CRASH: the child died (a signal, or an exit without a verdict), e.g. an
  in-process driver that took the process down;
- HANG: the child printed no progress for ``hang_seconds`` once it started
  executing, or did not start (load the model, compile it) within
  ``start_seconds``; it is killed.

For each non-success the child's last output lines are kept. The child
prints one line per execution, so "no progress" means no execution finished.
The start-up has its own, longer allowance: importing numpy and compiling on
a busy machine can take longer than an execution may.
"""
from __future__ import annotations

import argparse
import collections
import importlib
import os
import signal
import subprocess
import sys
import threading
import time

from .results import StressResult

_TAIL = 12   # lines of the child's output kept for a non-success
START_SECONDS = 120.0   # default allowance for a child to load and compile


def _child_command(model: str, device: str | None, driver: str | None, seconds: float,
                   spawn: list[str], discover: bool) -> list[str]:
    cmd = [sys.executable, "-m", "nnrt.bench.stress", model, "--seconds", str(seconds)]
    if driver:
        cmd += ["--driver", driver]
    elif device:
        cmd += ["--device", device]
    for kind in spawn:
        cmd += ["--spawn", kind]
    if not discover:
        cmd.append("--no-discover")
    return cmd


def watch(cmd: list[str], hang_seconds: float, *, start_seconds: float = START_SECONDS,
          model: str = "", device: str = "") -> StressResult:
    """Run ``cmd`` (a stress child) and classify it."""
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    tail: collections.deque[str] = collections.deque(maxlen=_TAIL)
    progress = [time.monotonic()]
    started_running = threading.Event()   # the child said "started": it executes now
    runs = [0]

    def read() -> None:
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail.append(line)
            progress[0] = time.monotonic()
            if line.startswith("started "):
                started_running.set()
            elif line.startswith("run "):
                runs[0] += 1

    reader = threading.Thread(target=read, name="nnrt-stress-reader", daemon=True)
    reader.start()
    hung = ""
    while proc.poll() is None:
        limit = hang_seconds if started_running.is_set() else max(hang_seconds, start_seconds)
        if time.monotonic() - progress[0] > limit:
            hung = (f"no progress for {limit:g} s" if started_running.is_set()
                    else f"did not start within {limit:g} s")
            os.killpg(proc.pid, signal.SIGKILL)   # the child and any service it spawned
            proc.wait()
            break
        time.sleep(0.05)
    reader.join(timeout=5)
    elapsed = time.monotonic() - started
    lines = list(tail)
    last = "\n".join(lines)
    verdict_line = next((l for l in reversed(lines) if l.startswith(("SUCCESS", "FAILURE"))), None)
    if hung:
        return StressResult(model, device, "HANG", runs[0], elapsed,
                            f"{hung}; killed", last)
    code = proc.returncode
    if code == 0 and verdict_line and verdict_line.startswith("SUCCESS"):
        return StressResult(model, device, "SUCCESS", runs[0], elapsed, verdict_line)
    if code == 1 and verdict_line and verdict_line.startswith("FAILURE"):
        return StressResult(model, device, "FAILURE", runs[0], elapsed,
                            verdict_line.removeprefix("FAILURE: "), last)
    why = (f"killed by {signal.Signals(-code).name}" if code < 0
           else f"exited with status {code} without a verdict")
    return StressResult(model, device, "CRASH", runs[0], elapsed, why, last)


def run_stress(config, *, seconds: float, hang_seconds: float,
               start_seconds: float = START_SECONDS,
               driver: str | None = None) -> list[StressResult]:
    """Every model of ``config`` on each of its devices (or on ``driver``)."""
    results = []
    devices = [None] if driver or not config.devices else config.devices
    for model in config.models:
        for device in devices:
            label = driver or device or "default devices"
            print(f"stress: {os.path.basename(model)} on {label} for {seconds:g} s", flush=True)
            cmd = _child_command(model, device, driver, seconds, config.spawn, config.discover)
            results.append(watch(cmd, hang_seconds, start_seconds=start_seconds,
                                 model=os.path.basename(model), device=label))
    return results


def print_stress(results: list[StressResult]) -> None:
    for r in results:
        print(f"{r.verdict:8s} {r.model} on {r.device}: {r.runs} runs in {r.seconds:.1f} s; "
              f"{r.detail}")
        if r.verdict != "SUCCESS" and r.last_output:
            for line in r.last_output.splitlines()[-5:]:
                print(f"    | {line}")


# -- the child --------------------------------------------------------------------

def load_factory(spec: str):
    """``module:function`` -> the function (a driver under test)."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"--driver {spec!r}: expected MODULE:FACTORY")
    return getattr(importlib.import_module(module), name)


async def _child(args) -> int:
    import nnrt
    from ..drivers.reference import ReferenceDevice
    from .runner import compare, load_model, model_inputs

    model = load_model(args.model)
    async with nnrt.Runtime(devices=[ReferenceDevice()]) as oracle_rt:
        oracle = await oracle_rt.compile(model)
        inputs, _ = model_inputs(args.model, oracle, 0)
        want = (await oracle.execute(inputs)).outputs
    if args.driver:
        kwargs = {"devices": [load_factory(args.driver)()]}
    else:
        kwargs = {"spawn": args.spawn, "discover": not args.no_discover}
    async with nnrt.Runtime(**kwargs) as rt:
        devices = [args.device] if args.device else ([rt.devices[0]] if args.driver else None)
        compiled = await rt.compile(model, devices=devices)
        print(f"started on {', '.join(d.name for d in compiled.devices)}", flush=True)
        end = time.monotonic() + args.seconds
        runs = 0
        while time.monotonic() < end:
            compiled.reset_state()   # every run from a fresh state: comparable with the oracle
            try:
                got = (await compiled.execute(inputs)).outputs
            except nnrt.NnrtError as e:
                print(f"FAILURE: execution {runs + 1} failed: {e.status.name}: {e.message}",
                      flush=True)
                return 1
            check = compare(got, want, "reference device")
            runs += 1
            if not check.within_tolerance:
                print(f"FAILURE: execution {runs} gave a wrong result (max difference "
                      f"{', '.join(f'{d:.3g}' for d in check.max_diff)} {check.unit} against "
                      f"the reference driver)", flush=True)
                return 1
            print(f"run {runs} ok", flush=True)
        print(f"SUCCESS: {runs} executions, every result matched the reference driver",
              flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    import anyio
    parser = argparse.ArgumentParser(prog="python -m nnrt.bench.stress",
                                     description="one stress child (run by nnrt bench --stress)")
    parser.add_argument("model")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--device")
    parser.add_argument("--driver", metavar="MODULE:FACTORY")
    parser.add_argument("--spawn", action="append", default=[])
    parser.add_argument("--no-discover", action="store_true")
    args = parser.parse_args(argv)
    try:
        return anyio.run(_child, args)
    except Exception as e:   # a verdict, not a traceback only: the parent reads the last line
        print(f"FAILURE: {type(e).__name__}: {getattr(e, 'message', e)}", flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
