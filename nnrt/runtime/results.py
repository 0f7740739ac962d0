"""What an execution gives the app: its outputs, their shapes and timing."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ErrorStatus, NnrtError
from ..memory import Region


@dataclass(frozen=True, slots=True)
class ExecutionTiming:
    """Microseconds, None when not measured (the HAL's UINT64_MAX).

    ``on_device``: time the driver spent computing. ``in_driver``: from the
    moment the driver (for a service: its process) received the request to
    the moment it answered -- this includes waiting in the scheduler's queue
    behind other executions, so ``in_driver - on_device`` is mostly queueing.
    Neither includes the app's side (validation, the socket round trip). For
    a model split across devices both are sums over the steps."""

    on_device: int | None
    in_driver: int | None


@dataclass(frozen=True, slots=True, init=False)
class Result:
    outputs: list[np.ndarray]
    output_shapes: list[tuple[int, ...]]
    timing: ExecutionTiming | None  # None when timing was not asked for

    def __init__(self, outputs, output_shapes, timing):
        # Stored through the slots' descriptors: a frozen dataclass's own
        # __init__ goes through object.__setattr__ per field, a cost on every
        # execution (issue 16).
        _set_outputs(self, outputs)
        _set_output_shapes(self, output_shapes)
        _set_timing(self, timing)

    def __repr__(self) -> str:
        outs = ", ".join(f"{np.asarray(o).dtype} {tuple(s)}"
                         for o, s in zip(self.outputs, self.output_shapes))
        return f"<nnrt.Result outputs [{outs}], timing {self.timing}>"


_set_outputs = Result.outputs.__set__
_set_output_shapes = Result.output_shapes.__set__
_set_timing = Result.timing.__set__


def copy_into(user_outputs: list, results: list[np.ndarray]) -> list[np.ndarray]:
    """Copy ``results`` into the app's output buffers; views of them, shaped."""
    too_small = [r.nbytes > (u.length if isinstance(u, Region) else u.nbytes)
                 for u, r in zip(user_outputs, results)]
    if any(too_small):
        raise NnrtError(ErrorStatus.OUTPUT_INSUFFICIENT_SIZE, "an output buffer is too small",
                        output_shapes=[tuple(r.shape) for r in results])
    views = []
    for u, r in zip(user_outputs, results):
        view = u.array(r.dtype, r.shape) if isinstance(u, Region) \
            else u.reshape(-1)[:r.size].reshape(r.shape)
        view[...] = r
        views.append(view)
    return views
