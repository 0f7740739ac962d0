"""Validation of an app's request at the API edge, before any driver sees it.

Everything here is the app's mistake, refused with INVALID_ARGUMENT (a
closed object: BAD_STATE) and a message naming the input and the types. A
driver only ever receives a request that passed these checks, so a failure
it reports afterwards is its own -- and only such a failure may move work to
the CPU (``runtime.CompiledModel``).

The conversion rule for inputs ("same kind only"):

- float -> float (float16/32/64, widening or narrowing);
- int -> int (signed or unsigned, any width) only when every value fits the
  operand's type: checked, never wrapped;
- bool -> bool;
- anything else (int -> float, float -> int, bool -> int, objects) is
  refused. Python scalars and lists go through ``np.asarray`` first, so ``1``
  is an int and ``1.0`` a float.
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Sequence

import numpy as np

from ..errors import ErrorStatus, NnrtError, invalid
from ..hal.types import Priority, check_priority
from ..memory import Region
from ..model.graph import HalModel, Operand
from ..model.types import OperationType

# Operations with operands NNAPI lets an app omit (an optional weight or
# flag given as a model input without a value): only their inputs may be
# None in a request. Anything else would reach a kernel as a missing tensor.
OMISSIBLE_INPUTS = frozenset({
    OperationType.LSTM, OperationType.UNIDIRECTIONAL_SEQUENCE_LSTM,
    OperationType.BIDIRECTIONAL_SEQUENCE_LSTM, OperationType.QUANTIZED_LSTM,
    OperationType.BIDIRECTIONAL_SEQUENCE_RNN, OperationType.UNIDIRECTIONAL_SEQUENCE_RNN,
    OperationType.RNN, OperationType.SVDF, OperationType.LSH_PROJECTION,
    OperationType.AVERAGE_POOL_2D, OperationType.MAX_POOL_2D, OperationType.L2_POOL_2D,
    OperationType.RESIZE_BILINEAR, OperationType.RESIZE_NEAREST_NEIGHBOR,
    OperationType.SQUEEZE, OperationType.TRANSPOSE, OperationType.SPACE_TO_BATCH_ND,
    OperationType.BATCH_TO_SPACE_ND, OperationType.SPACE_TO_DEPTH,
    OperationType.DEPTH_TO_SPACE, OperationType.L2_NORMALIZATION,
    OperationType.LOCAL_RESPONSE_NORMALIZATION, OperationType.SOFTMAX,
    OperationType.LOG_SOFTMAX,
})


def sequence(values: Any, what: str) -> Sequence | Mapping:
    """``inputs`` / ``outputs`` as given: a list, a tuple or (inputs) a dict.
    A bare array is refused: iterating it along its first axis would give
    the model its rows as inputs."""
    if values.__class__ is list or values.__class__ is tuple:
        return values   # the common case, before the slower checks below
    if isinstance(values, np.ndarray) or isinstance(values, Region):
        raise invalid(f"{what} must be a list (one entry per model {what[:-1]}), got a bare "
                      f"{type(values).__name__}: write [{what[:-1]}]")
    if isinstance(values, Mapping):
        if what == "inputs":
            return values
        raise invalid(f"{what} must be a list, got a {type(values).__name__}")
    if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple)):
        raise invalid(f"{what} must be a list or tuple, got {type(values).__name__}")
    return values


def flag(value: Any, name: str) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise invalid(f"{name} must be True or False, got {value!r}")


def priority(value: Any) -> Priority:
    """A :class:`Priority`, or its name in any case (``"HIGH"``, ``"low"``)."""
    if isinstance(value, str):
        try:
            return Priority[value.strip().upper()]
        except KeyError:
            raise invalid(f"priority {value!r} is not one of LOW, MEDIUM, HIGH "
                          f"(nnrt.Priority or its name)") from None
    if isinstance(value, bool):
        raise invalid(f"priority {value!r} is not one of LOW, MEDIUM, HIGH")
    return check_priority(value)


def as_is(value: Any, dtype: np.dtype, shape: tuple | None = None,
          writable: bool = False) -> bool:
    """Whether ``value`` is taken as it is -- the one rule for inputs and
    outputs alike: a numpy array (not a subclass) of ``dtype``, C-contiguous,
    shaped ``shape`` when one is given, writable when it is an output."""
    if value.__class__ is not np.ndarray or value.dtype != dtype:
        return False
    flags = value.flags
    return flags.c_contiguous and (not writable or flags.writeable) \
        and (shape is None or value.shape == shape)


def convert(value: Any, operand: Operand, what: str) -> np.ndarray:
    """``value`` as a C-contiguous array of the operand's dtype, by the
    same-kind rule of this module."""
    dtype = operand.type.dtype
    arr = value if isinstance(value, np.ndarray) else np.asarray(value)
    if arr.dtype != dtype:
        src, dst = arr.dtype.kind, dtype.kind
        if src == "f" and dst == "f":
            arr = arr.astype(dtype)
        elif src in "iu" and dst in "iu":
            if arr.size:
                info = np.iinfo(dtype)
                lo, hi = arr.min(), arr.max()
                if lo < info.min or hi > info.max:
                    raise invalid(f"{what} is {operand.type.name} ({dtype}): the {arr.dtype} "
                                  f"values span [{lo}, {hi}], outside [{info.min}, {info.max}]")
            arr = arr.astype(dtype)
        else:
            raise invalid(f"{what} is {operand.type.name} ({dtype}): a {arr.dtype} value is "
                          f"not converted (same kind only: float to float, int to int that "
                          f"fits, bool to bool)")
    if operand.type.is_scalar and arr.ndim != 0:
        raise invalid(f"{what} is a scalar {operand.type.name}, got shape {list(arr.shape)}")
    return np.ascontiguousarray(arr)


def check_omitted(model: HalModel, operand_index: int, what: str) -> None:
    """None for a model input: allowed only when every operation reading it
    takes omitted operands."""
    for k, op in enumerate(model.main.operations):
        if operand_index in op.inputs and op.type not in OMISSIBLE_INPUTS:
            raise invalid(f"{what} is None, but operation {k} ({op.type.name}) needs it: "
                          f"only optional operands may be omitted")


def _overlap(a, b) -> str | None:
    """How output ``a`` overlaps value ``b``, None when it does not."""
    if isinstance(a, Region) and isinstance(b, Region):
        if a.memory is b.memory and a.offset < b.offset + b.length \
                and b.offset < a.offset + a.length:
            return f"bytes [{a.offset}, {a.offset + a.length}) of its memory"
    elif isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        if a.nbytes and b.nbytes and np.may_share_memory(a, b):
            return "its array"
    return None


def check_no_overlap(inputs: Sequence, outputs: Sequence) -> None:
    """Refuse an output that overlaps an input or another output: a driver
    writing it would corrupt what it reads (or the other result)."""
    for k, out in enumerate(outputs):
        for kind, others in (("input", inputs), ("output", outputs[:k])):
            for j, other in enumerate(others):
                if out.__class__ is np.ndarray and other.__class__ is np.ndarray:
                    # (_overlap's answer for two arrays, without the call)
                    if not (out.nbytes and other.nbytes and np.may_share_memory(out, other)):
                        continue
                    where = "its array"
                else:
                    where = _overlap(out, other)
                if where:
                    raise invalid(f"output {k} ({where}) overlaps {kind} {j}: an output must "
                                  f"not share memory with an input or another output")


def check_on_time(deadline: float | None) -> None:
    """A result that reaches the app after its deadline is a miss
    (MISSED_DEADLINE_TRANSIENT), as the scheduler reports a job that finished
    late: a driver service can finish in time and its reply still arrive
    late (the way back, the app's own loop), and an app that set a deadline
    must not take a late result for a timely one."""
    if deadline is None:
        return
    late = time.monotonic() - deadline
    if late > 0:
        raise NnrtError(ErrorStatus.MISSED_DEADLINE_TRANSIENT,
                        f"the result came {late * 1e3:.1f} ms after the deadline (the driver "
                        f"finished; the result did not reach the app in time)")
