"""The ``nnrt`` command line: ``nnrt devices`` lists the devices a runtime
finds; ``nnrt driver serve NAME`` runs a driver service; ``nnrt demo`` runs
the simulated camera loop; ``nnrt inspect MODEL.tflite`` shows a model's
operations and where they would run; ``nnrt run MODEL.tflite`` runs one;
``nnrt bench MODEL.tflite ...`` benchmarks models (nnrt.bench); ``nnrt cache
ls/clear`` shows and empties a compilation cache folder."""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import gc
from functools import partial
import os
import signal
import sys

import anyio

import nnrt
from .vlog import vlog

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _feature_level(code: int) -> str:
    """A device's NNAPI feature level as NeuralNetworks.h codes it (27..30:
    the Android API level; 1000000 + n from level 6) and as its number."""
    level = {27: 1, 28: 2, 29: 3, 30: 4, 31: 5}.get(code, code - 1_000_000)
    return f"{level} ({code})" if 0 < level < 100 else str(code)


def _devices(args) -> int:
    """Every device the runtime would offer (type, version, feature level,
    extensions, state, capabilities per operand type), then every configured
    driver service with its state: up, unreachable (and why) or refused
    (an untrusted owner or folder)."""
    async def main():
        async with nnrt.Runtime() as rt:
            for d in rt.devices:
                caps = d.capabilities()
                print(f"{d.name}\n  type: {d.type.name}\n  version: {d.version_string}\n"
                      f"  feature level: {_feature_level(d.feature_level)}\n"
                      f"  state: {'up' if d.alive else 'dead'}\n"
                      f"  extensions: {', '.join(e.name for e in d.supported_extensions()) or 'none'}")
                print("  capabilities (exec_time, power_usage; lower is better):")
                for t, perf in sorted(caps.operand_performance.items(), key=lambda kv: kv[0]):
                    print(f"    {t.name}: {perf.exec_time:g}, {perf.power_usage:g}")
                relaxed = caps.relaxed_float32_to_float16_tensor
                print(f"    relaxed float32 as float16 (tensors): {relaxed.exec_time:g}, "
                      f"{relaxed.power_usage:g}")
            services = rt.services
            print("\nconfigured driver services (NNRT_DRIVERS, "
                  f"{discovery.config_file()}):" if services else
                  "\nno driver services configured (NNRT_DRIVERS, "
                  f"{discovery.config_file()})")
            for state in services:
                print(f"  {state}")
    from .runtime import discovery
    anyio.run(main)
    return 0


def _driver_serve(args) -> int:
    from .memory.heap import give_back_soon
    from .drivers.sample import DRIVERS, make_driver
    import asyncio
    from .service.address import split_address
    from .service.server import DriverService, ServiceLimits, default_socket_path, serve
    from .qos import ScheduledDevice

    parent = None if args.parent_pid is None else _die_with_parent(args.parent_pid)
    kind = args.driver or (args.name if args.name in DRIVERS else "reference")
    from .qos.policy import Policy
    from .qos.status import reload_policy
    settings = {key: value for key, value in (("num_threads", args.threads),
                                              ("segment_time", args.segment_ms and
                                               args.segment_ms / 1e3)) if value is not None}
    try:
        policy = Policy.load(args.policy) if args.policy else None
        limits = ServiceLimits.parse(args.limit)
        listener = _listener(args)
        if args.metrics is not None:
            from .service.metrics import check_metrics_address
            check_metrics_address(args.metrics, listener is not None and listener.cert is not None)
        driver = make_driver(kind, args.name, **settings)
    except nnrt.NnrtError as e:
        print(f"nnrt driver serve: {e.message}", file=sys.stderr)
        return 1
    # inline_bound=0: the service's event loop, shared by every app, runs
    # no app's work itself (an inline run would).
    device = ScheduledDevice(driver, slots=args.slots, queue_limit=args.queue_limit,
                             memory_limit=args.memory_limit, policy=policy, inline_bound=0)
    # --listen alone serves on gRPC only; with --socket, on both.
    path = args.socket or (None if listener else default_socket_path(args.name))
    if args.realtime is not None:
        try:
            _realtime_loop(args.realtime)
        except OSError as e:
            print(f"nnrt driver serve: --realtime {args.realtime}: cannot make the event loop's "
                  f"thread SCHED_FIFO ({e.strerror}); it needs root or CAP_SYS_NICE (or an "
                  f"RLIMIT_RTPRIO of {args.realtime} or more); serve without --realtime",
                  file=sys.stderr)
            return 1

    async def main():
        # The handlers are in place before the socket exists: a SIGTERM that
        # arrives right after it appears still removes it on the way out.
        # (Before this point a SIGTERM kills the process by default, and
        # there is nothing to clean up yet.)
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT,
                                        signal.SIGHUP) as signals:
            async with anyio.create_task_group() as tg:
                if parent is not None:
                    tg.start_soon(_stop_when_readable, parent, tg.cancel_scope)
                if path is not None:
                    service = await tg.start(partial(
                        serve, device, path, app_key=args.app_key, group=args.group,
                        limits=limits, statistics=args.statistics, admin_uids=args.admin_uid))
                else:
                    service = DriverService(device, args.app_key, limits, args.statistics,
                                            args.admin_uid)
                if listener is not None:
                    # One service, one accounting: remote apps count against
                    # the same --limit values as the socket's apps.
                    from .service.remote.server import serve_remote
                    port = await tg.start(partial(serve_remote, service, listener))
                    host, _ = split_address(listener.address)
                metrics = None
                if args.metrics is not None:
                    from .service.metrics import serve_metrics
                    https = listener is not None and listener.cert is not None
                    metrics = serve_metrics(
                        service, args.metrics, asyncio.get_running_loop(),
                        certfile=args.tls_cert if https else None,
                        keyfile=args.tls_key if https else None,
                        client_cafile=args.client_ca if https else None)
                    tg.start_soon(_stop_metrics_on_exit, metrics)
                _freeze_heap(device.name)
                if path is not None:
                    print(f"nnrt driver {device.name} ({kind}) listening on {path}", flush=True)
                if listener is not None:
                    print(f"nnrt driver {device.name} ({kind}) listening on "
                          f"{'grpcs' if listener.cert else 'grpc'}://{host}:{port}", flush=True)
                if metrics is not None:
                    mhost, _ = split_address(args.metrics)
                    mhost = f"[{mhost}]" if ":" in mhost else mhost
                    print(f"nnrt driver {device.name} ({kind}) metrics on "
                          f"{'https' if https else 'http'}://{mhost}:{metrics.server_port}"
                          f"/metrics", flush=True)
                async for signum in signals:
                    if signum == signal.SIGHUP:    # re-read --policy, keep serving
                        if args.policy:
                            print(await reload_policy(device, args.policy), flush=True)
                            give_back_soon()   # what reading the file took
                        continue
                    tg.cancel_scope.cancel()
                    break
            # serve() has removed the socket. A spawned service also removes
            # its app's folder, still under the handlers: the parent-death
            # SIGTERM can come twice (per thread of the app), and a second
            # one must not end the process by default halfway.
            if parent is not None and path is not None:
                _remove_spawn_folder(path)

    try:
        import uvloop  # noqa: F401
        options = {"use_uvloop": True}
    except ImportError:
        options = {}
    failed = False
    try:
        anyio.run(main, backend="asyncio", backend_options=options)
    except* nnrt.NnrtError as group:
        for e in group.exceptions:
            print(f"nnrt driver serve: {e.message}", file=sys.stderr)
        failed = True
    return 1 if failed else 0


async def _stop_metrics_on_exit(server) -> None:
    """Stop the metrics endpoint when the service stops."""
    try:
        await anyio.sleep_forever()
    finally:
        server.shutdown()
        server.server_close()


def _listener(args):
    """The gRPC listener ``--listen`` and its TLS or token options ask for,
    or None; INVALID_ARGUMENT for options that do not go together."""
    remote_options = [o for o, v in (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key),
                                     ("--client-ca", args.client_ca),
                                     ("--token-file", args.token_file),
                                     ("--insecure", args.insecure),
                                     ("--admin-remote", args.admin_remote)) if v]
    if args.listen is None:
        if remote_options:
            raise nnrt.NnrtError(nnrt.ErrorStatus.INVALID_ARGUMENT,
                                 f"{', '.join(remote_options)} go with --listen")
        return None
    from .service.remote.server import Listener, load_tokens

    def pem(path):
        if path is None:
            return None
        try:
            with open(path, "rb") as f:
                return f.read(1 << 20)
        except OSError as e:
            raise nnrt.NnrtError(nnrt.ErrorStatus.INVALID_ARGUMENT,
                                 f"cannot read {path}: {e.strerror}") from None

    return Listener(args.listen, pem(args.tls_cert), pem(args.tls_key), pem(args.client_ca),
                    load_tokens(args.token_file) if args.token_file else {}, args.insecure,
                    frozenset(args.admin_remote))


def _remove_spawn_folder(socket_path: str) -> None:
    """A service its app spawned (``--parent-pid``) lives in the app's
    private ``nnrt-services-*`` folder. An app killed or SIGTERMed never
    cleans that folder up, so the last of its services to stop removes it
    (rmdir: only once it is empty, never anything else's folder)."""
    from .runtime.discovery import SPAWN_FOLDER_PREFIX
    folder = os.path.dirname(os.path.abspath(socket_path))
    if os.path.basename(folder).startswith(SPAWN_FOLDER_PREFIX):
        try:
            os.rmdir(folder)
        except OSError:     # another service of the app is still there, or it is gone
            pass


def _realtime_loop(priority: int) -> None:
    """The calling thread -- the one that runs the service's event loop --
    at SCHED_FIFO ``priority``, so that reading a request, or answering one,
    never waits for a CPU behind the clients' own processes (issue 15: the
    loop's waits were mostly behind a flooding client woken on its CPU).
    SCHED_RESET_ON_FORK gives every thread it starts later -- the threads
    that run the apps' jobs, burst servers -- the normal policy again: an
    app's work never runs real-time. The kernel's real-time throttling
    (sched_rt_runtime_us, 95% by default) still bounds a loop gone wrong."""
    os.sched_setscheduler(0, os.SCHED_FIFO | os.SCHED_RESET_ON_FORK,
                          os.sched_param(priority))


def _fifo_priority(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= 99:
        raise argparse.ArgumentTypeError(f"a SCHED_FIFO priority is 1 to 99, got {text!r}")
    return value


def _driver_status(args) -> int:
    import glob
    from .service.client import ServiceDevice
    from .service.server import default_socket_path
    from .qos.status import render

    if args.remote:
        return _remote_status(args)
    if args.socket or args.name:
        paths = [args.socket or default_socket_path(args.name)]
    else:
        paths = sorted(glob.glob(os.path.join(os.path.dirname(default_socket_path("x")),
                                              "*.sock")))
        if not paths:
            print("nnrt driver status: no driver services in the default socket folder",
                  file=sys.stderr)
            return 1

    async def main():
        devices = [await ServiceDevice.connect(path) for path in paths]
        try:
            while True:
                tables = [render(d.name, await d.statistics(), await d.finished_jobs())
                          for d in devices]
                if not args.once:
                    print("\x1b[H\x1b[2J", end="")     # home, clear: a refreshing table
                print("\n\n".join(tables), flush=True)
                if args.once:
                    return
                await anyio.sleep(args.interval)
        finally:
            for d in devices:
                d.close()

    try:
        anyio.run(main)
    except nnrt.NnrtError as e:
        print(f"nnrt driver status: {e.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0


def _remote_status(args) -> int:
    """``nnrt driver status --remote TARGET...``: every host's apps in one
    table (and any --socket/NAME service's beside them); a host that does not
    answer is a row saying why."""
    from .qos.status import render_hosts
    from .runtime import discovery
    from .service.client import ServiceDevice
    from .service.remote.client import parse_target, remote_status
    from .service.server import default_socket_path

    try:
        for target in args.remote:
            parse_target(target)
    except nnrt.NnrtError as e:
        print(f"nnrt driver status: {e.message}", file=sys.stderr)
        return 1
    local = [args.socket or default_socket_path(args.name)] if args.socket or args.name else []

    async def one_remote(target):
        try:
            name, value = await remote_status(target, timeout=discovery.connect_timeout(),
                                              **discovery.remote_credentials(target))
        except nnrt.NnrtError as e:
            return (target, e.message)
        return (target, name, value.statistics, value.jobs)

    async def one_local(path):
        try:
            device = await ServiceDevice.connect(path)
        except nnrt.NnrtError as e:
            return (path, e.message)
        try:
            return (path, device.name, await device.statistics(), await device.finished_jobs())
        finally:
            device.close()

    async def main():
        while True:
            rows = [None] * (len(local) + len(args.remote))

            async def fill(k, coro):
                rows[k] = await coro
            async with anyio.create_task_group() as tg:
                for k, path in enumerate(local):
                    tg.start_soon(fill, k, one_local(path))
                for k, target in enumerate(args.remote, len(local)):
                    tg.start_soon(fill, k, one_remote(target))
            if not args.once:
                print("\x1b[H\x1b[2J", end="")     # home, clear: a refreshing table
            print(render_hosts(rows), flush=True)
            if args.once:
                return
            await anyio.sleep(args.interval)

    try:
        anyio.run(main)
    except KeyboardInterrupt:
        pass
    return 0


def _freeze_heap(name: str) -> None:
    """Keep what the service holds once it is set up (the modules, the
    driver, the policy: all of it lives as long as the process) out of the
    garbage collector's passes. Otherwise every full pass walks all of it --
    about 40k objects, 9-28 ms on a 2-vCPU VM, measured in the middle of
    apps' executions (docs/design/scheduler.md) -- and stalls the
    service's loop and job threads meanwhile. What apps make later (models,
    connections, requests) is collected as before."""
    gc.collect()
    gc.freeze()
    vlog("driver", "%s: %d objects set up kept out of the garbage collector's passes",
         name, gc.get_freeze_count())


def _die_with_parent(pid: int) -> int:
    """Arrange to stop when process ``pid`` (our parent, a runtime that
    spawned us) dies; returns a pidfd of it that becomes readable then.

    Two mechanisms, because each has a gap: the kernel's parent-death signal
    (PR_SET_PDEATHSIG, SIGTERM: handled like an operator's SIGTERM) fires
    even when the parent is SIGKILLed, but it follows the parent *thread*
    that forked us and is lost if the parent died before we set it; the
    pidfd follows the process itself. A parent already gone is an error."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        pidfd = None
    if pidfd is None or os.getppid() != pid:
        print(f"nnrt driver serve: --parent-pid {pid}: that process is gone or is not our "
              f"parent ({os.getppid()})", file=sys.stderr)
        sys.exit(1)
    return pidfd


async def _stop_when_readable(fd: int, scope: anyio.CancelScope) -> None:
    await anyio.wait_readable(fd)
    scope.cancel()


def _load(path: str, command: str):
    import nnrt.tflite
    try:
        return nnrt.tflite.load(path)
    except nnrt.NnrtError as e:
        print(f"nnrt {command}: {e.message}", file=sys.stderr)
        return None


def _describe_tensor(info) -> str:
    shape = "x".join("?" if d is None else str(d) for d in info.shape) or "scalar"
    text = f"{info.name}  {info.dtype}  [{shape}]"
    if info.signature_name and info.signature_name != info.name:
        text = f"{info.signature_name} ({info.name})  {info.dtype}  [{shape}]"
    q = info.quantization
    if q is not None:
        text += (f"  scale={q.scales[0]:.6g} zero_point={q.zero_points[0]}" if len(q.scales) == 1
                 else f"  per-channel ({len(q.scales)} scales, dim {q.dimension})")
    return text


def _inspect(args) -> int:
    from collections import Counter

    from rich.console import Console
    from rich.table import Table

    from .tflite import read
    model = _load(args.model, "inspect")
    if model is None:
        return 1
    with open(args.model, "rb") as f:
        source = read(f.read(), args.model)
    console = Console()
    meta = model.metadata
    tflite_ops = Counter(op.name for g in source.graphs for op in g.operators)
    console.print(f"[bold]{args.model}[/bold]: {len(source.graphs)} subgraph(s), "
                  f"TFLite operators: " + ", ".join(f"{n}x{k}" for k, n in tflite_ops.most_common()))
    if meta.signature:
        console.print(f"signature: {meta.signature}")
    state_in = {i for i, _ in meta.states}
    state_out = {o for _, o in meta.states}
    for k, info in enumerate(meta.inputs):
        console.print(f"input {k}: {_describe_tensor(info)}" + ("  (state)" if k in state_in else ""))
    for k, info in enumerate(meta.outputs):
        console.print(f"output {k}: {_describe_tensor(info)}" + ("  (state)" if k in state_out else ""))

    async def placement():
        async with nnrt.Runtime(discover=not args.no_discover) as rt:
            devices = rt.devices
            flags = [await rt.supported_operations(model, [d]) for d in devices]
            return [d.name for d in devices], flags
    names, flags = anyio.run(placement)
    main = model.hal_model.main
    table = Table("#", "NNAPI operation", "input", "output", "device")
    unsupported = []

    def dims(indexes) -> str:
        tensors = [i for i in indexes if main.operands[i].type.is_tensor]
        return "x".join(map(str, main.operands[tensors[0]].dimensions)) or "?" if tensors else "-"
    for n, op in enumerate(main.operations):
        device = next((name for name, f in zip(names, flags) if f[n]), None)
        if device is None:
            unsupported.append(n)
        table.add_row(str(n), op.type.name, dims(op.inputs), dims(op.outputs),
                      device or "[red]none[/red]")
    console.print(table)
    referenced = model.hal_model.referenced
    if referenced:
        console.print(f"{len(referenced)} referenced subgraph(s) (IF/WHILE bodies) with "
                      f"{sum(len(s.operations) for s in referenced)} operations")
    if unsupported:
        console.print(f"[red]not supported by any device: operations {unsupported}[/red]")
        return 1
    console.print(f"every operation is supported (devices: {', '.join(names)})")
    return 0


def _parse_inputs(specs: list[str], signature) -> dict:
    import numpy as np
    names = {key: k for k, info in enumerate(signature)
             for key in (info.name, info.signature_name) if key}
    given = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep:
            raise ValueError(f"--input {spec!r}: expected NAME=FILE.npy")
        if name not in names:
            if name.isdigit() and int(name) < len(signature):
                names[name] = int(name)
            else:
                raise ValueError(f"--input {name!r}: the model has no input of that name; inputs: "
                                 f"{[i.signature_name or i.name for i in signature]}")
        try:
            given[names[name]] = np.load(path)
        except (OSError, ValueError) as e:
            raise ValueError(f"--input {name}: cannot read {path!r}: {e}") from None
    return given


def _random_input(info, rng):
    import numpy as np
    shape = tuple(1 if d is None else d for d in info.shape)
    if info.dtype.kind == "f":
        return rng.uniform(-1, 1, shape).astype(info.dtype)
    if info.dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(info.dtype)
    limits = np.iinfo(info.dtype)
    return rng.integers(max(limits.min, -128), min(limits.max, 255) + 1, shape).astype(info.dtype)


def _cache_ls(args) -> int:
    """``nnrt cache ls``: one line per entry."""
    import time
    from .runtime.cache import list_entries
    entries = list_entries(args.folder)
    if not entries:
        print(f"{args.folder}: no cache entries")
        return 0
    now = time.time()
    for e in entries:
        print(f"{e.key[:16]}  {e.bytes / 1e6:8.2f} MB  {(now - e.modified) / 60:7.1f} min ago  "
              f"{e.state:8s}  {', '.join(e.devices) or '-'}")
    total = sum(e.bytes for e in entries)
    print(f"{len(entries)} entries, {total / 1e6:.2f} MB in {args.folder}")
    return 0


def _cache_clear(args) -> int:
    """``nnrt cache clear``: remove the entries."""
    from .runtime.cache import clear
    print(f"removed {clear(args.folder)} cache entries from {args.folder}")
    return 0


def _run(args) -> int:
    import statistics
    import time

    import numpy as np
    model = _load(args.model, "run")
    if model is None:
        return 1
    if args.repeat < 1:
        print("nnrt run: --repeat must be at least 1", file=sys.stderr)
        return 2
    folder = args.output and os.path.dirname(os.path.abspath(args.output))
    if folder and not os.path.isdir(folder):
        # Said before the model runs, not as a traceback after it ran.
        print(f"nnrt run: --output {args.output}: the folder {folder} does not exist",
              file=sys.stderr)
        return 2

    async def main():
        async with nnrt.Runtime(discover=not args.no_discover, spawn=args.spawn) as rt:
            compiled = await rt.compile(model, devices=[args.device] if args.device else None,
                                        cache_dir=args.cache_dir)
            given = _parse_inputs(args.input, compiled.inputs)
            rng = np.random.default_rng(args.seed)
            inputs = []
            for k, info in enumerate(compiled.inputs):
                if k in given:
                    inputs.append(given[k])
                elif args.random:
                    inputs.append(_random_input(info, rng))
                else:
                    raise ValueError(f"no value for input {info.signature_name or info.name!r}: "
                                     f"give --input NAME=FILE.npy or --random")
            result = await compiled.execute(inputs, measure_timing=True)
            times = []
            for _ in range(args.repeat - 1):
                start = time.perf_counter()
                await compiled.execute(inputs)
                times.append(time.perf_counter() - start)
            return compiled, result, times

    try:
        compiled, result, times = anyio.run(main)
    except nnrt.NnrtError as e:
        print(f"nnrt run: {e.message}", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"nnrt run: {e}", file=sys.stderr)
        return 2
    devices = sorted({d.name for d in compiled.devices})
    print(f"ran on: {', '.join(devices)} ({len(compiled.devices)} step(s))")
    named = {}
    for info, out in zip(compiled.outputs, result.outputs):
        key = info.signature_name or info.name
        named[key] = out
        summary = ""
        if out.size and out.dtype.kind in "fiu":
            summary = (f"min {out.min():.6g}  max {out.max():.6g}  mean {out.mean():.6g}  "
                       f"argmax {int(out.argmax())}")
        print(f"{key}: shape {list(out.shape)} {out.dtype}  {summary}")
    t = result.timing
    if t is not None and t.on_device is not None:
        print(f"first execution: {t.on_device / 1e3:.3f} ms on device, "
              f"{t.in_driver / 1e3:.3f} ms in driver")
    if times:
        ms = sorted(x * 1e3 for x in times)
        print(f"{len(ms)} more executions: median {statistics.median(ms):.3f} ms, "
              f"min {ms[0]:.3f} ms, max {ms[-1]:.3f} ms")
    if args.output:
        try:
            np.savez(args.output, **named)
        except OSError as e:
            print(f"nnrt run: --output {args.output}: {e.strerror or e}", file=sys.stderr)
            return 1
        print(f"outputs written to {args.output}")
    return 0


def _bench(args) -> int:
    from .bench.command import main as bench_main
    return bench_main(args)


def _conformance(args) -> int:
    from .testing import conformance  # loaded only for this command
    return conformance.run_command(args)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # The command given (its first word): the arguments of the commands that
    # need heavy modules (cache: the runtime; bench; conformance) are added
    # only for them, so `nnrt driver serve` does not load what it never uses.
    wanted = next((a for a in argv if not a.startswith("-")), None)
    parser = argparse.ArgumentParser(prog="nnrt", description="nnrt neural-network runtime")
    parser.add_argument("--version", action="version", version=f"nnrt {nnrt.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("devices", help="list the devices the runtime finds").set_defaults(func=_devices)
    driver = sub.add_parser("driver", help="driver services").add_subparsers(dest="action",
                                                                             required=True)
    serve = driver.add_parser("serve", help="run a driver in this process on a Unix socket")
    serve.add_argument("name", help="the device name the service reports")
    serve.add_argument("--socket", help="socket path (default $XDG_RUNTIME_DIR/nnrt/NAME.sock)")
    serve.add_argument("--driver", choices=["reference", "litert", "sample-float-fast",
                                            "sample-float-slow", "sample-minimal", "sample-quant",
                                            "sample-partial", "mediapipe"],
                       help="which driver to serve (default: NAME if it is one of these, "
                            "else reference)")
    serve.add_argument("--threads", type=int, default=None,
                       help="litert: threads per interpreter (default: 1)")
    serve.add_argument("--segment-ms", type=float, default=None,
                       help="litert: bound on a segment's estimated run time, the longest a "
                            "HIGH execution waits behind a running one (default: 2)")
    serve.add_argument("--app-key", choices=["uid", "pid"], default="pid",
                       help="what an app is: each process (pid, the default) or every "
                            "process of a user together (uid)")
    serve.add_argument("--slots", type=int, default=1,
                       help="executions the device runs at once (default: 1)")
    serve.add_argument("--queue-limit", type=int, default=32,
                       help="waiting executions per app before RESOURCE_EXHAUSTED_TRANSIENT "
                            "(default: 32)")
    serve.add_argument("--memory-limit", type=int, default=None, metavar="BYTES",
                       help="refuse models with more constant bytes than this "
                            "(RESOURCE_EXHAUSTED_PERSISTENT)")
    serve.add_argument("--group", metavar="NAME",
                       help="also let members of this group connect (socket 0660 and its "
                            "folder 0710, both given to the group; default: only this user, "
                            "socket 0600 in a 0700 folder). See docs/operators/security.md")
    from .service.server import STATISTICS_SCOPES, ServiceLimits
    serve.add_argument("--limit", action="append", default=[], metavar="NAME=N",
                       help="a resource limit (repeatable): " + ", ".join(
                           f"{f.name}={f.default}" for f in dataclasses.fields(ServiceLimits))
                       + " (the defaults; see docs/operators/security.md)")
    serve.add_argument("--statistics", choices=list(STATISTICS_SCOPES), default="owner",
                       help="who sees every app's work in STATISTICS (and nnrt driver "
                            "status); any other caller sees its own app's: " + "; ".join(
                                f"{k}: {v}" for k, v in STATISTICS_SCOPES.items())
                            + " (default: owner)")
    serve.add_argument("--admin-uid", type=int, action="append", default=[], metavar="UID",
                       help="a uid that sees every app's work in STATISTICS (repeatable)")
    serve.add_argument("--parent-pid", type=int, default=None, metavar="PID",
                       help="exit when process PID, the parent, exits (set by a runtime that "
                            "spawns the service)")
    serve.add_argument("--policy", metavar="FILE",
                       help="per-app QoS policy (TOML: weights, priority caps, limits, "
                            "deadlines; see docs/operators/policy.md), re-read on SIGHUP")
    serve.add_argument("--realtime", type=_fifo_priority, nargs="?", const=1, default=None,
                       metavar="PRIORITY",
                       help="run the event loop's thread (only that thread: never an app's "
                            "work) at SCHED_FIFO PRIORITY (default 1), so requests are read "
                            "and answered without waiting for a CPU behind busy clients; "
                            "needs root or CAP_SYS_NICE (docs/operators/security.md)")
    serve.add_argument("--listen", metavar="HOST:PORT",
                       help="also serve on gRPC at HOST:PORT for apps on other hosts (only "
                            "there when --socket is not given; port 0: any free port); needs "
                            "--tls-cert and --tls-key, or --insecure on a loopback address. "
                            "See docs/operators/remote.md")
    serve.add_argument("--tls-cert", metavar="PEM", help="--listen: the server's certificate")
    serve.add_argument("--tls-key", metavar="PEM", help="--listen: the server's private key")
    serve.add_argument("--client-ca", metavar="PEM",
                       help="--listen: require client certificates signed by this CA (mutual "
                            "TLS); a client is the app its certificate's common name names")
    serve.add_argument("--token-file", metavar="FILE",
                       help="--listen: accept callers presenting one of these tokens (lines "
                            "NAME TOKEN, mode 0600); a caller is the app NAME")
    serve.add_argument("--insecure", action="store_true",
                       help="--listen: plaintext, refused on any address but loopback")
    serve.add_argument("--admin-remote", action="append", default=[], metavar="NAME",
                       help="--listen: a remote app (its certificate's common name or token "
                            "name) that sees every app's work in nnrt driver status --remote "
                            "(repeatable); any other remote caller sees its own app's, unless "
                            "--statistics all")
    serve.add_argument("--metrics", metavar="HOST:PORT",
                       help="serve per-app figures (queues, shares, waits, deadline misses, "
                            "preemptions, what each app holds) as Prometheus metrics at "
                            "http(s)://HOST:PORT/metrics: HTTPS with --listen's --tls-cert/"
                            "--tls-key (and --client-ca), else plain HTTP on loopback only. "
                            "See docs/operators/remote.md#metrics")
    serve.set_defaults(func=_driver_serve)
    status = driver.add_parser("status", help="per-app queues, shares, waits, preemptions "
                               "and misses of driver services, refreshed live")
    status.add_argument("name", nargs="?",
                        help="the service's device name (default: every service in the "
                             "default socket folder)")
    status.add_argument("--socket", help="socket path (default $XDG_RUNTIME_DIR/nnrt/NAME.sock)")
    status.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    status.add_argument("--once", action="store_true", help="print the table once and exit")
    status.add_argument("--remote", action="append", default=[], metavar="HOST:PORT",
                        help="a remote service ([grpc://|grpcs://]HOST:PORT, bare: TLS; "
                             "repeatable): every host's apps in one table, a host that does "
                             "not answer a row saying why; credentials from NNRT_REMOTE_* "
                             "(docs/operators/remote.md)")
    status.set_defaults(func=_driver_status)
    inspect = sub.add_parser("inspect", help="show a .tflite model's inputs, outputs, "
                             "operations and the device that would run each")
    inspect.add_argument("model", help="path of a .tflite file")
    inspect.add_argument("--no-discover", action="store_true",
                         help="only the in-process reference device (skip configured services)")
    inspect.set_defaults(func=_inspect)
    run = sub.add_parser("run", help="import a .tflite model and run it")
    run.add_argument("model", help="path of a .tflite file")
    run.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy",
                     help="value of input NAME (tensor or signature name, or index); repeatable")
    run.add_argument("--random", action="store_true",
                     help="fill inputs not given with --input with random values")
    run.add_argument("--seed", type=int, default=0, help="seed for --random (default: 0)")
    run.add_argument("--device", help="run only on this device (see 'nnrt devices')")
    run.add_argument("--output", metavar="OUT.npz", help="save the outputs, keyed by name")
    run.add_argument("--repeat", type=int, default=1, metavar="N",
                     help="execute N times and report timing (default: 1)")
    run.add_argument("--no-discover", action="store_true",
                     help="only the in-process reference device (skip configured services)")
    run.add_argument("--spawn", action="append", default=[], metavar="KIND",
                     help="start a driver service of this kind for the run (repeatable; e.g. "
                          "mediapipe, which offers the com.nnrt.mediapipe extension)")
    run.add_argument("--cache-dir", metavar="DIR", default=None,
                     help="keep the compilation in DIR and prepare from it next time "
                          "(see 'nnrt cache')")
    run.set_defaults(func=_run)
    cache = sub.add_parser("cache", help="list or clear a compilation cache folder").add_subparsers(
        dest="action", required=True)
    for action, func, text in (("ls", _cache_ls, "list the cache entries: key, size, age, "
                                "devices, state (ok, stale: another nnrt, bad, staging)"),
                               ("clear", _cache_clear, "remove every cache entry (and staging "
                                "folder left by a crash); nothing else in the folder")):
        cmd = cache.add_parser(action, help=text, description=text)
        if wanted == "cache":
            from .runtime.cache import default_cache_dir
            cmd.add_argument("folder", nargs="?", default=default_cache_dir(),
                             help=f"the cache folder given to compile(cache_dir=) "
                                  f"(default: {default_cache_dir()})")
        cmd.set_defaults(func=func)
    bench = sub.add_parser("bench", help="latency, accuracy and stress per model and device, "
                           "with an HTML report")
    if wanted == "bench":
        from .bench.command import add_arguments as bench_arguments
        bench_arguments(bench)
    bench.set_defaults(func=_bench)
    conf = sub.add_parser("conformance", help="run the conformance kit (CTS vectors, VTS "
                          "checks, random graphs) against a device")
    if wanted == "conformance":
        from .testing import conformance
        conformance.add_arguments(conf)
    conf.set_defaults(func=_conformance)
    demo = sub.add_parser("demo", help="the simulated camera loop (make demo)", add_help=False)
    demo.set_defaults(func=None)
    args, rest = parser.parse_known_args(argv)
    if args.command != "demo" and rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        if args.command == "demo":  # the demo parses its own options (--seconds, --report)
            from .demo import main as demo_main
            return demo_main(rest)
        return args.func(args)
    except KeyboardInterrupt:
        # Ctrl-C is how a user stops a run, a bench or the demo: a line, not
        # a traceback; 130 is the shell's code for a command ended by SIGINT.
        print(f"nnrt {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # Whoever read the output stopped reading (`nnrt driver status | head -1`):
        # nothing more to say. Python's final flush of stdout would fail
        # again, so stdout becomes /dev/null first.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
