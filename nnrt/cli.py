"""The ``nnrt`` command line: ``nnrt devices`` lists the devices a runtime
finds; ``nnrt driver serve NAME`` runs a driver service; ``nnrt demo`` runs
the simulated camera loop."""
from __future__ import annotations

import argparse
import ctypes
from functools import partial
import os
import signal
import sys

import anyio

import nnrt

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


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


def _driver_serve(args) -> int:
    from .drivers.sample import DRIVERS, make_driver
    from .drivers.service.server import default_socket_path, serve

    parent = None if args.parent_pid is None else _die_with_parent(args.parent_pid)
    kind = args.driver or (args.name if args.name in DRIVERS else "reference")
    device = make_driver(kind, args.name, slots=args.slots, queue_limit=args.queue_limit,
                         memory_limit=args.memory_limit)
    path = args.socket or default_socket_path(args.name)

    async def main():
        # The handlers are in place before the socket exists: a SIGTERM that
        # arrives right after it appears still removes it on the way out.
        # (Before this point a SIGTERM kills the process by default, and
        # there is nothing to clean up yet.)
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with anyio.create_task_group() as tg:
                if parent is not None:
                    tg.start_soon(_stop_when_readable, parent, tg.cancel_scope)
                await tg.start(partial(serve, device, path, app_key=args.app_key,
                                       group=args.group))
                print(f"nnrt driver {device.name} ({kind}) listening on {path}", flush=True)
                async for _ in signals:
                    tg.cancel_scope.cancel()
                    return

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nnrt", description="nnrt neural-network runtime")
    parser.add_argument("--version", action="version", version=f"nnrt {nnrt.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("devices", help="list the devices the runtime finds").set_defaults(func=_devices)
    driver = sub.add_parser("driver", help="driver services").add_subparsers(dest="action",
                                                                             required=True)
    serve = driver.add_parser("serve", help="run a driver in this process on a Unix socket")
    serve.add_argument("name", help="the device name the service reports")
    serve.add_argument("--socket", help="socket path (default $XDG_RUNTIME_DIR/nnrt/NAME.sock)")
    serve.add_argument("--driver", choices=["reference", "sample-float-fast", "sample-float-slow",
                                            "sample-minimal", "sample-quant", "sample-partial"],
                       help="which driver to serve (default: NAME if it is one of these, "
                            "else reference)")
    serve.add_argument("--app-key", choices=["uid", "pid"], default="uid",
                       help="which peer credential keys an app's queue (default: uid)")
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
                            "socket 0600 in a 0700 folder). See docs/security.md")
    serve.add_argument("--parent-pid", type=int, default=None, metavar="PID",
                       help="exit when process PID, the parent, exits (set by a runtime that "
                            "spawns the service)")
    serve.set_defaults(func=_driver_serve)
    demo = sub.add_parser("demo", help="the simulated camera loop (make demo)", add_help=False)
    demo.set_defaults(func=None)
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":  # the demo parses its own options (--seconds, --report)
        from .demo import main as demo_main
        return demo_main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
