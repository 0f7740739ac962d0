"""The HAL's value types: what crosses the seam between the runtime and a
driver (requests, results, timing, output shapes, capabilities, priorities
and deadlines). Plain data, importing nothing above the model; the fence
engine, bursts and the service protocol all speak in these."""
from __future__ import annotations

import enum
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field

from ..errors import ErrorStatus, NnrtError, invalid
from ..model.graph import DataLocation
from ..model.types import OperandType


class Priority(enum.IntEnum):
    """Relative priority among one app's models (NeuralNetworks.h values)."""

    LOW = 90
    MEDIUM = 100
    HIGH = 110
    DEFAULT = 100


def check_priority(priority) -> Priority:
    if priority.__class__ is Priority:
        return priority    # (an Enum call is a slow way to say so)
    try:
        return Priority(priority)
    except ValueError:
        raise invalid(f"priority {priority!r} is not LOW, MEDIUM or HIGH") from None


def check_deadline(deadline) -> float | None:
    """A deadline is None or an absolute ``time.monotonic()`` value in seconds."""
    if deadline is None:
        return None
    if isinstance(deadline, bool) or not isinstance(deadline, (int, float)) \
            or math.isnan(deadline):
        raise invalid(f"deadline {deadline!r} is not a monotonic-clock time in seconds")
    return float(deadline)


def check_loop_timeout(loop_timeout) -> float | None:
    """A WHILE loop timeout is None (the default, 2 s) or a duration in
    seconds >= 0; a driver clamps a longer one to 15 s, as NNAPI does. NaN
    would never time out (every comparison is false), so it is refused with
    the negative ones, whether the model has a WHILE or not."""
    if loop_timeout is None:
        return None
    if isinstance(loop_timeout, bool) or not isinstance(loop_timeout, (int, float)) \
            or not loop_timeout >= 0:
        raise invalid(f"loop_timeout {loop_timeout!r} is not a duration in seconds >= 0")
    return float(loop_timeout)


def deadline_in(ms: float = 0.0, *, s: float = 0.0) -> float:
    """The absolute deadline ``ms`` milliseconds (plus ``s`` seconds) from
    now, on the monotonic clock that every ``deadline=`` takes:
    ``compiled.execute(x, deadline=nnrt.deadline_in(ms=33))``."""
    for name, value in (("ms", ms), ("s", s)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value):
            raise invalid(f"deadline_in({name}={value!r}): expected a finite number")
    return time.monotonic() + ms / 1000.0 + s


UINT64_MAX = 2**64 - 1  # "not measured" in Timing


class DeviceType(enum.IntEnum):
    OTHER = 1
    CPU = 2
    GPU = 3
    ACCELERATOR = 4


class ExecutionPreference(enum.IntEnum):
    LOW_POWER = 0
    FAST_SINGLE_ANSWER = 1
    SUSTAINED_SPEED = 2


class MeasureTiming(enum.IntEnum):
    NO = 0
    YES = 1


@dataclass(frozen=True, slots=True)
class PerformanceInfo:
    """Ratio of a device's time / power to the CPU reference's; lower is better."""

    exec_time: float = 1.0
    power_usage: float = 1.0


@dataclass(frozen=True)
class Capabilities:
    relaxed_float32_to_float16_scalar: PerformanceInfo = PerformanceInfo()
    relaxed_float32_to_float16_tensor: PerformanceInfo = PerformanceInfo()
    operand_performance: dict[OperandType, PerformanceInfo] = field(default_factory=dict)
    if_performance: PerformanceInfo = PerformanceInfo()
    while_performance: PerformanceInfo = PerformanceInfo()
    # Seconds one execution on the device costs before any work: its
    # transport's round trip. 0 for a driver on this host; a remote device
    # measures it at connect (nnrt.service.remote.client). Not part of the
    # NNAPI HAL; partitioning weighs it (nnrt.runtime.partition).
    round_trip: float = 0.0

    def performance(self, type: OperandType) -> PerformanceInfo:
        # The HAL says a type missing from the table performs as badly as possible.
        return self.operand_performance.get(type, PerformanceInfo(float("inf"), float("inf")))


@dataclass(frozen=True, slots=True)
class Timing:
    """Microseconds; UINT64_MAX means not measured. in_driver >= on_device."""

    on_device: int = UINT64_MAX
    in_driver: int = UINT64_MAX


NO_TIMING = Timing()


@dataclass(frozen=True, slots=True)
class OutputShape:
    dimensions: tuple[int, ...]
    is_sufficient: bool = True


@dataclass(frozen=True, slots=True)
class RequestArgument:
    has_no_value: bool = False
    location: DataLocation | None = None
    dimensions: tuple[int, ...] = ()  # () = as declared by the operand


@dataclass(frozen=True, slots=True, init=False)
class Request:
    inputs: tuple[RequestArgument, ...]
    outputs: tuple[RequestArgument, ...]
    pools: tuple  # buffer-protocol objects the driver reads inputs from and writes outputs to

    def __init__(self, inputs: tuple[RequestArgument, ...], outputs: tuple[RequestArgument, ...],
                 pools: tuple):
        # Stored through the slots' descriptors, as nnrt.Result is: a request
        # is made per execution, and a frozen dataclass's own __init__ (an
        # object.__setattr__ per field) cost half as much again (issue 16).
        _set_inputs(self, inputs)
        _set_outputs(self, outputs)
        _set_pools(self, pools)


_set_inputs, _set_outputs, _set_pools = (getattr(Request, f).__set__
                                         for f in ("inputs", "outputs", "pools"))


@dataclass(frozen=True, slots=True)
class ExecutionResult:
    status: ErrorStatus
    output_shapes: tuple[OutputShape, ...] = ()
    timing: Timing = NO_TIMING
    message: str = ""


@dataclass(frozen=True, slots=True)
class BufferRole:
    """One use a driver-managed buffer is allocated for (HAL ``BufferRole``):
    input or output ``io_index`` of ``prepared_models[model_index]`` of the
    ``allocate`` call; ``frequency`` in (0, 1] is how often it is used so."""

    model_index: int
    io_index: int
    frequency: float = 1.0


@dataclass(frozen=True, slots=True)
class BufferDesc:
    """What the app says of a buffer beyond its roles (HAL ``BufferDesc``):
    its dimensions, 0 for an unknown extent, () for all unknown."""

    dimensions: tuple[int, ...] = ()


# An app's declared name: letters, digits and ``._-`` (it shows in ``nnrt
# driver status`` and is matched by policy rules); a script is a path.
MAX_APP_NAME = 64
MAX_SCRIPT = 4096
_APP_NAME = re.compile(r"[A-Za-z0-9._-]+")


@dataclass(frozen=True, slots=True)
class AppDeclaration:
    """What an app says about itself when it connects to a driver: the name
    it chose (``Runtime(app=...)``, ``NNRT_APP_NAME``) and the script it
    runs. Declared, so trusted only within the app's own uid: a policy rule
    that matches them also names the uid or user (``nnrt/qos/policy.py``)."""

    name: str = ""
    script: str = ""

    def __post_init__(self):
        if not isinstance(self.name, str) or (self.name and (
                len(self.name) > MAX_APP_NAME or not _APP_NAME.fullmatch(self.name))):
            raise invalid(f"an app name is up to {MAX_APP_NAME} letters, digits, '.', '_' "
                          f"or '-', got {self.name!r}")
        if not isinstance(self.script, str) or len(self.script) > MAX_SCRIPT \
                or not self.script.isprintable():
            raise invalid(f"an app's script is a printable path of up to {MAX_SCRIPT} "
                          f"characters, got {self.script[:80]!r}")

    @classmethod
    def for_process(cls, name: str | None = None, environ=os.environ) -> "AppDeclaration":
        """What this process tells the services it connects to: ``name``,
        else ``NNRT_APP_NAME``, else none; and the script Python runs (the
        file of ``sys.argv[0]``; none for ``python -c`` or a session)."""
        from_env = name is None
        if from_env:
            name = environ.get("NNRT_APP_NAME", "")
        argv0 = sys.argv[0] if sys.argv else ""
        script = os.path.realpath(argv0) if argv0 not in ("", "-c", "-") \
            and os.path.isfile(argv0) else ""
        try:
            return cls(name, script)
        except NnrtError as e:
            raise invalid(f"{'NNRT_APP_NAME' if from_env else 'app='}: {e.message}") from None
