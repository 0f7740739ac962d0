"""Driver-managed buffers (memory domains, HAL ``IDevice::allocate`` and
``IBuffer``) for drivers that compute on the CPU side of the seam: the one
registry of them, shared by the reference and the LiteRT driver.

Theory of operation
-------------------
``allocate`` checks the roles (each an input or output of one of the
driver's own prepared models, all of the calling app, all with the same
operand type and quantization), combines the dimensions of the desc and of
every role's operand (they must agree; extents may stay unknown) and keeps a
:class:`DriverBuffer` under a fresh token. A request names a buffer by its
token as one of its pools (:class:`nnrt.memory.DeviceToken`);
:meth:`BufferRegistry.execute` checks, on every use, that the token is a
buffer of the prepared model's app and that the use (this prepared model,
input or output k) is one of its roles, then *binds* the request: an input
reads the buffer's bytes in place, an output is written into a scratch
region of the size its dimensions need; after a successful run the scratch
becomes the buffer's contents, with the shape the run reported. An output
whose size is unknown before the run (dynamic shape) is sized from what the
driver reports (OUTPUT_INSUFFICIENT_SIZE) and the run is redone once, so the
buffer is resized by the driver, as NNAPI says.

Concurrency: a buffer's contents are replaced by one assignment under the
registry's lock, never written in place, so an execution reading a buffer
while another writes it reads the old or the new contents, never a torn mix
(NNAPI allows unspecified contents; this gives one or the other) and nothing
blocks. Limits (buffers per app, bytes per buffer) keep one app from
exhausting a service shared with others.
"""
from __future__ import annotations

import itertools
import math
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

from ..errors import ErrorStatus, NnrtError, invalid
from ..memory import DeviceToken, as_buffer
from ..model.graph import DataLocation, HalModel, Operand
from .interface import AppKey, Buffer
from .types import BufferDesc, BufferRole, ExecutionResult, Request, RequestArgument

MAX_BUFFERS_PER_APP = 1024
MAX_BUFFER_BYTES = 1 << 30


def merge_dimensions(a: tuple[int, ...], b: tuple[int, ...], what: str) -> tuple[int, ...]:
    """Combine two dimension lists (0 = unknown extent, () = unknown rank);
    INVALID_ARGUMENT when two known ranks or extents differ."""
    if not a:
        return tuple(b)
    if not b:
        return tuple(a)
    if len(a) != len(b):
        raise invalid(f"{what}: rank {len(a)} ({list(a)}) and rank {len(b)} ({list(b)}) differ")
    merged = []
    for x, y in zip(a, b):
        if x and y and x != y:
            raise invalid(f"{what}: dimensions {list(a)} and {list(b)} differ")
        merged.append(x or y)
    return tuple(merged)


def fully_specified(dims: tuple[int, ...]) -> bool:
    return bool(dims) and all(d > 0 for d in dims)


class DriverBuffer(Buffer):
    """A buffer kept inside the driver: bytes (None until first written) and
    the shape they hold."""

    def __init__(self, registry: "BufferRegistry", token: int, app: AppKey, operand: Operand,
                 declared: tuple[int, ...], roles: frozenset, models: tuple):
        self.token = token
        self.app = app
        self.operand = operand            # type and quantization every role shares
        self.declared = declared          # from the desc and the roles; 0 = unknown
        self.roles = roles                # {(id(prepared), "input"|"output", index)}
        self._models = models             # keeps the role models (and their ids) alive
        self._registry = registry
        self._data: bytes | bytearray | None = None
        self._dims = declared

    @property
    def dimensions(self) -> tuple[int, ...]:
        return self._dims

    @property
    def initialized(self) -> bool:
        return self._data is not None

    def nbytes(self, dims: tuple[int, ...]) -> int:
        return self.operand.type.element_size * math.prod(dims)

    def snapshot(self) -> tuple[bytes | bytearray | None, tuple[int, ...]]:
        with self._registry.lock:
            return self._data, self._dims

    def store(self, data, dims: tuple[int, ...]) -> None:
        if len(data) > MAX_BUFFER_BYTES:
            raise NnrtError(ErrorStatus.RESOURCE_EXHAUSTED_PERSISTENT,
                            f"buffer {self.token}: {len(data)} bytes exceed the "
                            f"{MAX_BUFFER_BYTES}-byte limit of one buffer")
        with self._registry.lock:
            self._data, self._dims = data, tuple(dims)

    def check_dimensions(self, dims: Sequence[int], what: str) -> tuple[int, ...]:
        return merge_dimensions(self.declared, tuple(int(d) for d in dims),
                                f"{what}: buffer {self.token}")

    async def copy_to(self, memory) -> None:
        data, dims = self.snapshot()
        if data is None:
            raise invalid(f"buffer {self.token} was never written: nothing to copy")
        dst = as_buffer(memory)
        if dst.readonly:
            raise invalid(f"copy_to: the destination of buffer {self.token} is read-only")
        if dst.nbytes != len(data):
            raise invalid(f"copy_to: buffer {self.token} holds {len(data)} bytes "
                          f"({list(dims)}), the destination has {dst.nbytes}")
        dst[:] = data

    async def copy_from(self, memory, dimensions: Sequence[int] = ()) -> None:
        src = as_buffer(memory)
        dims = self.check_dimensions(dimensions, "copy_from")
        if not fully_specified(dims):
            raise invalid(f"copy_from: buffer {self.token} has dimensions {list(dims)}; give "
                          f"them all")
        need = self.nbytes(dims)
        if src.nbytes != need:
            raise invalid(f"copy_from: buffer {self.token} at {list(dims)} takes {need} bytes, "
                          f"the source has {src.nbytes}")
        self.store(bytes(src), dims)

    def release(self) -> None:
        self._registry.release(self.token)

    def __repr__(self) -> str:
        return (f"<DriverBuffer {self.token} {self.operand.type.name} {list(self._dims)} "
                f"{'written' if self.initialized else 'never written'}>")


@dataclass(frozen=True, slots=True)
class BufferStatistics:
    live: int          # buffers allocated and not released
    allocated: int     # buffers allocated since the driver started
    executions: int    # executions that named a buffer by token


class BufferRegistry:
    """The buffers of one driver, keyed by token."""

    def __init__(self, max_per_app: int = MAX_BUFFERS_PER_APP):
        self.lock = threading.Lock()
        self._buffers: dict[int, DriverBuffer] = {}
        self._tokens = itertools.count(1)
        self._max_per_app = max_per_app
        self._allocated = self._executions = 0

    def __len__(self) -> int:
        return len(self._buffers)

    def statistics(self) -> BufferStatistics:
        with self.lock:
            return BufferStatistics(len(self._buffers), self._allocated, self._executions)

    def allocate(self, app: AppKey, desc: BufferDesc,
                 models: Sequence[tuple[object, HalModel, AppKey]],
                 input_roles: Sequence[BufferRole],
                 output_roles: Sequence[BufferRole]) -> tuple[DriverBuffer, int]:
        """A new buffer for ``app``. ``models`` are the driver's prepared
        models the roles index, each as ``(prepared, its HAL model, its app)``."""
        if not isinstance(desc, BufferDesc):
            raise invalid(f"allocate: desc is a {type(desc).__name__}, not a BufferDesc")
        if not input_roles and not output_roles:
            raise invalid("allocate: a buffer needs at least one role")
        for k, (_prepared, _model, owner) in enumerate(models):
            if owner != app:
                raise invalid(f"allocate: prepared model {k} belongs to another app")
        dims = merge_dimensions((), tuple(desc.dimensions), "allocate: desc")
        if any(d < 0 for d in dims):
            raise invalid(f"allocate: negative dimension in {list(dims)}")
        roles, first = set(), None
        for kind, role_list in (("input", input_roles), ("output", output_roles)):
            for r in role_list:
                what = f"allocate: {kind} role {r}"
                if not isinstance(r, BufferRole) or not 0 <= r.model_index < len(models):
                    raise invalid(f"{what}: no such prepared model ({len(models)} given)")
                if not 0.0 < r.frequency <= 1.0:
                    raise invalid(f"{what}: frequency {r.frequency} is not in (0, 1]")
                prepared, model, _owner = models[r.model_index]
                indexes = model.main.input_indexes if kind == "input" else model.main.output_indexes
                if not 0 <= r.io_index < len(indexes):
                    raise invalid(f"{what}: the model has {len(indexes)} {kind}s")
                key = (id(prepared), kind, r.io_index)
                if key in roles:
                    raise invalid(f"{what}: the same role is given twice")
                roles.add(key)
                operand = model.main.operands[indexes[r.io_index]]
                if not operand.type.is_tensor:
                    raise invalid(f"{what}: a {operand.type.name} operand; a buffer holds a tensor")
                if first is None:
                    first = operand
                elif (operand.type, operand.scale, operand.zero_point) != \
                        (first.type, first.scale, first.zero_point):
                    raise invalid(f"{what}: operand type {operand.type.name} (scale "
                                  f"{operand.scale}, zero point {operand.zero_point}) differs "
                                  f"from the first role's {first.type.name} ({first.scale}, "
                                  f"{first.zero_point})")
                dims = merge_dimensions(dims, operand.dimensions, what)
        with self.lock:
            owned = sum(1 for b in self._buffers.values() if b.app == app)
            if owned >= self._max_per_app:
                raise NnrtError(ErrorStatus.RESOURCE_EXHAUSTED_PERSISTENT,
                                f"allocate: the app holds {owned} buffers already (the limit); "
                                f"release some")
            token = next(self._tokens)
            buffer = DriverBuffer(self, token, app, first, dims, frozenset(roles),
                                  tuple(m[0] for m in models))
            self._buffers[token] = buffer
            self._allocated += 1
        return buffer, token

    def allocate_for(self, owner: str, kind: type, app: AppKey, desc: BufferDesc,
                     prepared_models, input_roles, output_roles) -> tuple[DriverBuffer, int]:
        """:meth:`allocate` for a driver whose prepared models are ``kind``
        instances carrying ``model``, ``app`` and this registry as
        ``buffers``; ``owner`` (the device's name) says whose they must be."""
        models = []
        for k, prepared in enumerate(prepared_models):
            if not isinstance(prepared, kind) or prepared.buffers is not self:
                raise invalid(f"allocate: prepared model {k} is not one of {owner}'s")
            models.append((prepared, prepared.model, prepared.app))
        return self.allocate(app, desc, models, input_roles, output_roles)

    def release(self, token: int) -> None:
        with self.lock:
            self._buffers.pop(token, None)

    def _use(self, token: int, prepared, app: AppKey, kind: str, index: int) -> DriverBuffer:
        buffer = self._buffers.get(token)
        what = f"request {kind} {index}"
        if buffer is None or buffer.app != app:
            raise invalid(f"{what}: token {token} names no buffer of this app")
        if (id(prepared), kind, index) not in buffer.roles:
            raise invalid(f"{what}: buffer {token} was not allocated for this use (it is not "
                          f"one of its roles)")
        return buffer

    def _bind(self, prepared, app: AppKey, request: Request, capacity: dict[int, int]):
        """``request`` with every token pool replaced by bytes: the request
        the driver runs, and the (output index, buffer, scratch) to keep."""
        tokens = {k: p.token for k, p in enumerate(request.pools) if isinstance(p, DeviceToken)}
        pools = [b"" if k in tokens else p for k, p in enumerate(request.pools)]
        inputs, outputs, written = [], [], []
        for kind, args, out in (("input", request.inputs, inputs),
                                ("output", request.outputs, outputs)):
            for i, arg in enumerate(args):
                loc = arg.location
                if arg.has_no_value or loc is None or loc.pool_index not in tokens:
                    out.append(arg)
                    continue
                if loc.offset or loc.length:
                    raise invalid(f"request {kind} {i}: a buffer is used whole: offset and "
                                  f"length must be 0, not {loc.offset} and {loc.length}")
                buffer = self._use(tokens[loc.pool_index], prepared, app, kind, i)
                if kind == "input":
                    data, dims = buffer.snapshot()
                    if data is None:
                        raise invalid(f"request input {i}: buffer {buffer.token} was never "
                                      f"written")
                    if arg.dimensions:
                        merge_dimensions(dims, tuple(arg.dimensions),
                                         f"request input {i}: buffer {buffer.token}")
                    pools.append(memoryview(data))
                    out.append(RequestArgument(False, DataLocation(len(pools) - 1, 0, len(data)),
                                               dims))
                else:
                    dims = buffer.check_dimensions(arg.dimensions, f"request output {i}")
                    if fully_specified(dims):
                        size = buffer.nbytes(dims)
                        if size > MAX_BUFFER_BYTES:   # before the scratch is made
                            raise NnrtError(ErrorStatus.RESOURCE_EXHAUSTED_PERSISTENT,
                                            f"request output {i}: buffer {buffer.token} at "
                                            f"{list(dims)} would hold {size} bytes, more than "
                                            f"the {MAX_BUFFER_BYTES}-byte limit of one buffer")
                    else:
                        data, _ = buffer.snapshot()
                        size = capacity.get(i, 0 if data is None else len(data))
                    scratch = bytearray(size)
                    pools.append(scratch)
                    out.append(RequestArgument(False, DataLocation(len(pools) - 1, 0, size),
                                               dims if fully_specified(dims) else ()))
                    written.append((i, buffer, scratch))
        return Request(tuple(inputs), tuple(outputs), tuple(pools)), written

    def execute(self, prepared, app: AppKey, request: Request,
                run: Callable[[Request], ExecutionResult]) -> ExecutionResult:
        """Run ``request`` (some of whose pools are tokens) with ``run`` (the
        driver's execution of a plain request) and keep the buffers it wrote."""
        with self.lock:
            self._executions += 1
        capacity: dict[int, int] = {}
        for _attempt in range(2):
            try:
                bound, written = self._bind(prepared, app, request, capacity)
            except NnrtError as e:
                return ExecutionResult(e.status, message=e.message)
            result = run(bound)
            if result.status != ErrorStatus.OUTPUT_INSUFFICIENT_SIZE or not written:
                break
            mine = {i for i, _b, _s in written}
            short = [k for k, s in enumerate(result.output_shapes) if not s.is_sufficient]
            if not short or any(k not in mine for k in short):
                break   # the caller's own outputs are too small: theirs to resize
            # The driver said how big the buffers' outputs are: resize, run again.
            element = {i: b.operand.type.element_size for i, b, _s in written}
            capacity = {k: element[k] * math.prod(result.output_shapes[k].dimensions)
                        for k in short}
        if result.status == ErrorStatus.NONE:
            try:
                for i, buffer, scratch in written:
                    shape = tuple(result.output_shapes[i].dimensions)
                    n = buffer.nbytes(shape)
                    buffer.store(scratch if n == len(scratch) else bytes(scratch[:n]), shape)
            except NnrtError as e:
                return ExecutionResult(e.status, result.output_shapes, message=e.message)
        return result


def uses_tokens(request: Request) -> bool:
    """Whether any pool of ``request`` names a driver buffer."""
    for pool in request.pools:   # (a loop, not any(): asked on every execution)
        if isinstance(pool, DeviceToken):
            return True
    return False
