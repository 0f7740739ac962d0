"""Reading a request's inputs and writing its outputs: what every driver
that computes on the CPU side of the seam does with a :class:`Request`.

A driver calls :func:`read_inputs` to get numpy views of the inputs (no
copy: they look into the request's pools) and :func:`write_outputs` to copy
its results into the output regions (or :func:`output_views` once, for an
execution that writes into them in place); :func:`output_shapes` reports,
per output, whether the region was big enough (OUTPUT_INSUFFICIENT_SIZE is the
caller's to return, with the shapes it needed).
"""
from __future__ import annotations

import numpy as np

from ..errors import ErrorStatus, NnrtError
from ..memory import as_buffer
from ..model.graph import HalModel, decode_value
from .types import OutputShape, Request


def read_inputs(model: HalModel, request: Request) -> list:
    """The main subgraph's inputs of a validated ``request``: an array view
    per tensor, a Python value per scalar, None for an omitted input."""
    sub = model.main
    inputs = []
    for arg, index in zip(request.inputs, sub.input_indexes):
        if arg.has_no_value:
            inputs.append(None)
            continue
        operand = sub.operands[index]
        loc = arg.location
        raw = as_buffer(request.pools[loc.pool_index])[loc.offset:loc.offset + loc.length]
        if operand.type.is_tensor:
            dims = tuple(arg.dimensions) or operand.dimensions
            inputs.append(np.frombuffer(raw, dtype=operand.type.dtype).reshape(dims))
        else:
            inputs.append(decode_value(operand, raw))
    return inputs


def output_shapes(request: Request, outputs: list) -> tuple[OutputShape, ...]:
    """Each output's shape and whether its region of ``request`` holds it."""
    return tuple(OutputShape(tuple(np.shape(o)), np.asarray(o).nbytes <= arg.location.length)
                 for o, arg in zip(outputs, request.outputs))


def output_views(model: HalModel, request: Request, shapes) -> list:
    """A writable array view of each output region of a validated
    ``request``, shaped as ``shapes`` (one per output, fully specified), to
    write results into in place; None for a region too small for its shape.
    INVALID_ARGUMENT for an output in a read-only pool."""
    sub = model.main
    views = []
    for arg, index, shape in zip(request.outputs, sub.output_indexes, shapes):
        dtype = sub.operands[index].type.dtype
        need = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        loc = arg.location
        if loc.length < need:
            views.append(None)
            continue
        pool = as_buffer(request.pools[loc.pool_index])
        if pool.readonly:
            raise NnrtError(ErrorStatus.INVALID_ARGUMENT,
                            f"output operand {index}: pool {loc.pool_index} is read-only")
        views.append(np.frombuffer(pool[loc.offset:loc.offset + need], dtype=dtype)
                     .reshape(shape))
    return views


def write_outputs(model: HalModel, request: Request, outputs: list) -> None:
    """Copy ``outputs`` (arrays, in the main subgraph's output order) into
    their regions, which :func:`output_shapes` said are big enough."""
    sub = model.main
    for arg, index, value in zip(request.outputs, sub.output_indexes, outputs):
        operand = sub.operands[index]
        arr = np.ascontiguousarray(value, dtype=operand.type.dtype)
        if arr.nbytes == 0:
            continue
        loc = arg.location
        pool = as_buffer(request.pools[loc.pool_index])
        if pool.readonly:
            raise NnrtError(ErrorStatus.INVALID_ARGUMENT,
                            f"output operand {index}: pool {loc.pool_index} is read-only")
        pool[loc.offset:loc.offset + arr.nbytes] = arr.reshape(-1).view(np.uint8)
