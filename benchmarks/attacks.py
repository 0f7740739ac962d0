"""Can one app starve another of a shared driver service? (issue 39's done-when)

    .venv/bin/python benchmarks/attacks.py [--rounds 300] [--attacks NAME ...]
        [--settle 10] [--json FILE]

A ``litert`` driver service (``nnrt driver serve``, default limits, apps
told apart by peer pid) serves a victim app, this process, which measures
the median and p99 of three things it does on a shared model
(mobilenet_v1_0.25_128_float32): a plain ``compiled.execute``, a frame of a
burst (``burst.compute`` of a reusable execution) and a compilation
(``rt.compile`` on the service; a fifth as many rounds). It measures them
with nobody else there, then while each attack below holds, each attacker
its own process (its own app).

Attacks, each the issue's scenario at the service's default limits:

- ``pools``: one app caches distinct request memories (an fd and a mapping
  each in the service) until the service refuses the next;
- ``bursts``: one app opens bursts over several connections until refused;
- ``connections``: eight apps open connections until each is refused;
- ``bytes``: one app sends requests of two 1 GiB inputs, again and again;
- ``models``: one app prepares models over several connections until refused;
- ``policy``: the service's policy file replaced by a FIFO, a link to
  /dev/zero, a 64 MiB file and an empty file, each followed by SIGHUP (the
  reload), while the victim runs; blocks with the good file between them
  are the "alone" figures.

Holding attacks alternate in three blocks: the victim alone, then an
attacker started and measured against once it has taken all it can, then
told to leave. For each: the victim's p99 under
attack over its p99 alone (the goal: at
most 2x), whether every victim call succeeded, what refused the attacker
(the service's own message), and, --settle seconds after the attacker has
gone, the service's open fds, threads and RSS over the idle footprint
measured just before it came (the goal: within 10 %); file pages (library
code mapped on first use, kept) and anonymous memory (the heap) apart.
"""
from __future__ import annotations

import argparse
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import anyio
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import nnrt  # noqa: E402
import nnrt.tflite  # noqa: E402
from nnrt import ErrorStatus, NnrtError  # noqa: E402
from nnrt.service.client import ServiceDevice  # noqa: E402
from nnrt.hal import Request, RequestArgument  # noqa: E402
from nnrt.memory import Memory  # noqa: E402
from nnrt.model.graph import DataLocation  # noqa: E402
from tests.integration.test_service import add_model  # noqa: E402

MODEL = os.path.join(ROOT, "..", "shared", "models", "generated",
                     "mobilenet_v1_0.25_128_float32.tflite")
ATTACKS = ("pools", "bursts", "connections", "bytes", "models", "policy")
CONNECTION_APPS = 8


# -- the attackers (each runs as `attacks.py --attacker KIND --socket PATH`) ------------

def _add_request(mem: Memory, n: int = 4) -> Request:
    size = 4 * n
    return Request((RequestArgument(False, DataLocation(0, 0, size), (1, n)),
                    RequestArgument(False, DataLocation(0, size, size), (1, n))),
                   (RequestArgument(False, DataLocation(0, 2 * size, size)),), (mem,))


async def _attack(kind: str, path: str) -> tuple[int, str]:
    """Take what ``kind`` takes until the service refuses; (count, refusal).
    ``bytes`` keeps sending until stdin closes. What was taken is kept (the
    process holds it) until the process ends."""
    held: list = []
    devices = [await ServiceDevice.connect(path)]
    held.append(devices)
    try:
        if kind == "pools":
            # Spread over models: the client itself keeps at most
            # CLIENT_CACHED_POOLS per prepared model cached in the service.
            models = [await devices[0].prepare_model(add_model()) for _ in range(64)]
            mems = []
            while True:
                mem = Memory.create(48)
                mems.append(mem)
                result = await models[len(mems) % len(models)].execute(_add_request(mem))
                if result.status != ErrorStatus.NONE:
                    held.append(mems)
                    return len(mems) - 1, result.message
        if kind == "bytes":
            prepared = await devices[0].prepare_model(add_model())
            n = (1 << 30) // 4
            sent, refusal = 0, ""
            with Memory.create(3 * 4 * n) as mem:    # a memfd: no page is touched here
                print(f"ready {sent} attacking", flush=True)
                while not select.select([sys.stdin], [], [], 0)[0]:
                    result = await prepared.execute(_add_request(mem, n))
                    sent += 1
                    refusal = result.message
            return sent, refusal
        if kind == "connections":
            while True:
                devices.append(await ServiceDevice.connect(path))
        if kind in ("bursts", "models"):
            # Each connection up to its own limit, then another connection.
            taken: list = []
            held.append(taken)
            while True:
                dev = devices[-1]
                for _ in range(32 if kind == "bursts" else 1024):
                    prepared = await dev.prepare_model(add_model())
                    if kind == "bursts":
                        held.append(prepared)
                        prepared = await prepared.configure_burst()
                    taken.append(prepared)
                devices.append(await ServiceDevice.connect(path))
        raise SystemExit(f"unknown attack {kind!r}")
    except NnrtError as e:
        count = len(devices) if kind == "connections" else len(taken)
        return count, e.message
    finally:
        _keep.append(held)


_keep: list = []


def run_attacker(kind: str, path: str) -> None:
    count, refusal = anyio.run(_attack, kind, path)
    print(f"ready {count} {refusal}", flush=True)
    sys.stdin.read()                 # hold everything until the benchmark says go


# -- the victim ----------------------------------------------------------------------

class Victim:
    """The app under attack: a plain execute, a burst frame and a compile."""

    def __init__(self, rt, model, compiled, image):
        self.rt, self.model, self.compiled, self.image = rt, model, compiled, image
        self.failures: list[str] = []

    async def measure(self, rounds: int) -> dict[str, list[float]]:
        """Seconds per successful call of each kind; failures are kept
        (compiled with ``devices=``, nothing falls back to the CPU)."""
        times = {"execute": [], "burst": [], "compile": []}
        for _ in range(rounds):
            await self._timed(times, "execute", self.compiled.execute, [self.image])
        execution = self.compiled.create_execution([self.image])
        try:
            async with self.compiled.burst() as burst:
                for _ in range(rounds):
                    await self._timed(times, "burst", burst.compute, execution)
        except NnrtError as e:
            self.failures.append(f"burst: {e.status.name}: {e.message}")
        execution.close()
        for _ in range(max(rounds // 5, 3)):
            compiled = await self._timed(times, "compile", self.rt.compile, self.model,
                                         devices=["attacked"])
            if compiled is not None:
                compiled.close()
        return times

    async def _timed(self, times, what, call, *args, **kwargs):
        start = time.perf_counter()
        try:
            value = await call(*args, **kwargs)
        except NnrtError as e:
            self.failures.append(f"{what}: {e.status.name}: {e.message}")
            return None
        times[what].append(time.perf_counter() - start)
        return value


def footprint(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/status") as f:
        status = dict(line.split(":", 1) for line in f)
    return {"fds": len(os.listdir(f"/proc/{pid}/fd")),
            "threads": int(status["Threads"]),
            "rss_kib": int(status["VmRSS"].split()[0]),
            # of which: anonymous (the heap, stacks) and file pages (code of
            # the libraries, mapped once on first use and kept)
            "anon_kib": int(status["RssAnon"].split()[0]),
            "file_kib": int(status["RssFile"].split()[0])}


def pct(values, q):
    values = sorted(values)
    return values[max(int(np.ceil(q * len(values))) - 1, 0)]


def start_attackers(kind: str, path: str) -> list[subprocess.Popen]:
    apps = CONNECTION_APPS if kind == "connections" else 1
    return [subprocess.Popen([sys.executable, __file__, "--attacker", kind, "--socket", path],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            for _ in range(apps)]


def attacker_ready(proc) -> str:
    line = proc.stdout.readline().strip()
    if not line.startswith("ready"):
        raise SystemExit(f"an attacker failed: {line!r}")
    return line.removeprefix("ready ")


class PolicyAttack:
    """The service's policy file replaced by something that must neither
    wedge nor lift a cap, then SIGHUP (the reload); ``restore`` puts the
    good file back."""

    KINDS = ("fifo", "/dev/zero", "64 MiB", "empty")

    def __init__(self, policy: str, service: subprocess.Popen):
        self.policy, self.service, self.told = policy, service, []
        with open(policy) as f:
            self.good = f.read()

    def next(self) -> None:
        kind = self.KINDS[len(self.told) % len(self.KINDS)]
        os.unlink(self.policy)
        if kind == "fifo":
            os.mkfifo(self.policy)
        elif kind == "/dev/zero":
            os.symlink("/dev/zero", self.policy)
        elif kind == "64 MiB":
            rule = '[[app]]\nname = "r"\nexe = "/nowhere"\nweight = 1\n'
            with open(self.policy, "w") as f:
                f.write(rule * ((64 << 20) // len(rule)))
        else:
            open(self.policy, "w").close()
        self.service.send_signal(signal.SIGHUP)
        self.told.append(kind)

    def restore(self) -> None:
        os.unlink(self.policy)
        with open(self.policy, "w") as f:
            f.write(self.good)
        self.service.send_signal(signal.SIGHUP)


async def run_attack(kind, args, victim, service, path, policy):
    """The victim's figures alone and attacked, what the attacker got, and
    the service's footprint after; the policy attack alternates with the
    good file block by block, the others hold from ready to the end."""
    alone = {"execute": [], "burst": [], "compile": []}
    attacked = {"execute": [], "burst": [], "compile": []}
    before = footprint(service.pid)

    async def into(phase):
        for what, values in (await victim.measure(per_block)).items():
            phase[what] += values
    if kind == "policy":
        blocks = 2 * len(PolicyAttack.KINDS)
        per_block = max(args.rounds // blocks, 1)
        attack = PolicyAttack(policy, service)
        for _ in range(blocks):
            attack.next()
            await into(attacked)
            attack.restore()
            await into(alone)
        took = attack.told
    else:
        blocks = 3
        per_block = max(args.rounds // blocks, 1)
        for _ in range(blocks):
            await into(alone)
            procs = start_attackers(kind, path)
            took = [attacker_ready(p) for p in procs]
            await into(attacked)
            for p in procs:
                p.stdin.close()
                if kind == "bytes":        # it says how many it sent once told to stop
                    took = [p.stdout.readline().strip().removeprefix("ready ")]
                p.wait(30)
    await anyio.sleep(args.settle)
    return alone, attacked, took, before, footprint(service.pid)


async def main(args) -> dict:
    folder = tempfile.mkdtemp(prefix="nnrt-attacks-")
    path = os.path.join(folder, "attacked.sock")
    policy = os.path.join(folder, "policy.toml")
    with open(policy, "w") as f:
        f.write('[default]\nweight = 1\n\n[[app]]\nname = "camera"\nexe = "/nowhere"\n'
                'weight = 2\n')
    log = open(os.path.join(folder, "service.log"), "w")
    service = subprocess.Popen([sys.executable, "-m", "nnrt", "driver", "serve", "attacked",
                                "--driver", "litert", "--socket", path, "--policy", policy],
                               stdout=subprocess.PIPE, stderr=log)
    ready, _, _ = select.select([service.stdout], [], [], 60)
    if not ready or b"listening" not in service.stdout.readline():
        raise SystemExit(f"the service did not start (log: {log.name})")
    report = {"model": os.path.basename(MODEL), "rounds": args.rounds, "attacks": {}}
    try:
        os.environ["NNRT_DRIVERS"] = path
        async with nnrt.Runtime(litert=False) as rt:
            model = nnrt.tflite.load(MODEL)
            compiled = await rt.compile(model, devices=["attacked"])
            victim = Victim(rt, model, compiled, np.load(MODEL.replace(".tflite", ".in0.npy")))
            await victim.measure(args.rounds)   # the idle footprint: the victim has worked
            await anyio.sleep(args.settle)
            idle = report["idle"] = footprint(service.pid)
            print(f"service idle: {idle}", flush=True)
            for kind in args.attacks:
                victim.failures = []
                alone, attacked, took, before, after = await run_attack(
                    kind, args, victim, service, path, policy)
                report["attacks"][kind] = _print(kind, alone, attacked, took, before, after,
                                                 victim.failures, args.settle)
            compiled.close()
    finally:
        service.terminate()
        service.wait(10)
        log.close()
    return report


def _print(kind, alone, attacked, took, before, after, failures, settle) -> dict:
    row = {"attacker": took, "failed": len(failures), "failures": failures[:5],
           "before": before, "after": after}
    if kind == "policy":
        print(f"\n{kind}: files {', '.join(took)}")
    else:
        print(f"\n{kind}: attacker took {took[0]}" + (f" (and {len(took) - 1} more apps "
                                                       f"like it)" if len(took) > 1 else ""))
    for what in ("execute", "burst", "compile"):
        a, b = alone[what], attacked[what]
        if not a or not b:
            row[what] = None
            print(f"  {what:8} no successful calls")
            continue
        ratio = pct(b, 0.99) / pct(a, 0.99)
        row[what] = {"alone_p50_ms": statistics.median(a) * 1e3, "alone_p99_ms": pct(a, 0.99) * 1e3,
                     "attacked_p50_ms": statistics.median(b) * 1e3,
                     "attacked_p99_ms": pct(b, 0.99) * 1e3, "p99_ratio": ratio}
        print(f"  {what:8} alone p50 {statistics.median(a) * 1e3:7.2f} p99 "
              f"{pct(a, 0.99) * 1e3:7.2f} ms | attacked p50 {statistics.median(b) * 1e3:7.2f} "
              f"p99 {pct(b, 0.99) * 1e3:7.2f} ms | p99 x{ratio:.2f} "
              f"{'ok' if ratio <= 2 else 'OVER 2x'}")
    print(f"  victim calls failed: {len(failures)}"
          + (f" (first: {failures[0]})" if failures else ""))
    print("  service " + ", ".join(
        f"{k} {before[k]} -> {after[k]} ({after[k] / before[k] - 1:+.0%})" for k in before)
        + f": before the attack, and {settle:g} s after the attacker left", flush=True)
    return row


def parse(argv=None):
    parser = argparse.ArgumentParser(
        description="A victim app's latency on a shared litert driver service while other "
                    "apps attack its resources (issue 39).")
    parser.add_argument("--rounds", type=int, default=300,
                        help="victim executes and burst frames per phase (default 300); "
                             "compilations are a fifth of it")
    parser.add_argument("--attacks", nargs="+", choices=ATTACKS, default=list(ATTACKS),
                        metavar="NAME", help=f"which of {', '.join(ATTACKS)} (default all)")
    parser.add_argument("--settle", type=float, default=10.0,
                        help="seconds after an attacker leaves before the footprint is read")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--attacker", choices=ATTACKS, help=argparse.SUPPRESS)
    parser.add_argument("--socket", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


if __name__ == "__main__":
    args = parse()
    if args.attacker:
        run_attacker(args.attacker, args.socket)
        sys.exit(0)
    if not os.path.exists(MODEL):
        sys.exit(f"{MODEL} is missing: the shared models folder must be beside the checkout")
    report = anyio.run(main, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
