"""Memory domains for apps: NNAPI's ``ANeuralNetworksMemoryDesc``,
``ANeuralNetworksMemory_createFromDesc`` and ``ANeuralNetworksMemory_copy``,
spelled the Python way::

    desc = nnrt.MemoryDesc()
    desc.add_input_role(compiled, 1)          # the memory is input 1 of compiled
    desc.add_output_role(compiled, 1)         # ... and output 1
    memory = await rt.allocate(desc)          # a DeviceMemory
    await nnrt.copy(initial, memory)          # an nnrt.Memory (or a DeviceMemory) into it
    await compiled.execute([x, memory], outputs=[out, other])

:meth:`Runtime.allocate` asks the device every role's compiled model runs
on for a driver-managed buffer (HAL ``allocate``): the memory is then a
token, and its contents never cross into the app. When the roles span
devices or compilations split across devices, or the driver declines, the
memory is shared memory of the runtime's own with the same semantics (the
roles, the dimensions, "never written" refused as an input) — then it needs
its dimensions fully known. ``memory.on_device`` says which. When the
driver dies, the execution naming the memory moves it into shared memory
with the contents the driver last completed (:meth:`DeviceMemory.move_off_device`,
from a service's mirror) and reruns on the CPU.

A device memory is used whole (no regions). The same memory may not be an
input and an output of one execution: alternate two memories (as the
stateful-model example of docs/guide/memory-domains.md does).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..errors import ErrorStatus, NnrtError, bad_state, invalid
from ..hal import Buffer, BufferDesc, BufferRole, Device
from ..hal.buffers import fully_specified, merge_dimensions
from ..memory import Memory, Region
from ..model.graph import Operand


@dataclass(frozen=True, slots=True)
class _Role:
    compiled: object        # the CompiledModel
    kind: str               # "input" or "output"
    index: int              # the model's own input/output index (state included)
    frequency: float


class MemoryDesc:
    """The roles and dimensions of a memory to allocate
    (``ANeuralNetworksMemoryDesc``). ``index`` counts the inputs (outputs)
    an app passes to ``execute``, as ``compiled.inputs`` lists them."""

    def __init__(self):
        self._roles: list[_Role] = []
        self._dimensions: tuple[int, ...] = ()

    def add_input_role(self, compiled, index: int, frequency: float = 1.0) -> "MemoryDesc":
        return self._add(compiled, "input", index, frequency)

    def add_output_role(self, compiled, index: int, frequency: float = 1.0) -> "MemoryDesc":
        return self._add(compiled, "output", index, frequency)

    def set_dimensions(self, dimensions: Sequence[int]) -> "MemoryDesc":
        """The memory's dimensions, 0 for an extent left to the roles or to
        the executions; combined with every role's operand."""
        dims = tuple(dimensions)
        if any(isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 0
               for d in dims):
            raise invalid(f"set_dimensions: {list(dims)} is not a list of integers >= 0")
        self._dimensions = tuple(int(d) for d in dims)
        return self

    def __repr__(self) -> str:
        roles = ", ".join(f"{r.kind} {r.index}" for r in self._roles) or "no role"
        return f"<nnrt.MemoryDesc {roles}; dimensions {list(self._dimensions)}>"

    def _add(self, compiled, kind: str, index: int, frequency: float) -> "MemoryDesc":
        compiled._check_open()
        if isinstance(frequency, bool) or not isinstance(frequency, (int, float)) \
                or not 0.0 < frequency <= 1.0:
            raise invalid(f"add_{kind}_role: frequency {frequency!r} is not in (0, 1]")
        return self._add_model_role(compiled, kind, compiled._model_io_index(kind, index),
                                    frequency)

    def _add_model_role(self, compiled, kind: str, full: int,
                        frequency: float = 1.0) -> "MemoryDesc":
        """A role by the model's own index (a state input or output, which
        the app does not see)."""
        role = _Role(compiled, kind, full, float(frequency))
        if any(r.compiled is compiled and r.kind == kind and r.index == full
               for r in self._roles):
            raise invalid(f"add_{kind}_role: {kind} {full} of the model is a role "
                          f"already")
        self._roles.append(role)
        return self


class DeviceMemory:
    """A memory made from a :class:`MemoryDesc` by :meth:`Runtime.allocate`:
    a driver-managed buffer named by token (``on_device``), or the
    runtime's shared memory when the driver declined. Use it as an input or
    output of ``execute`` and ``burst.execute`` in one of its roles; read
    or fill it with :func:`copy`. Close it (or use ``with``) when done."""

    def __init__(self, roles: tuple[_Role, ...], operand: Operand, declared: tuple[int, ...],
                 device: Device | None, buffer: Buffer | None, token: int,
                 shared: Memory | None, declined: str = ""):
        self._roles = frozenset((id(r.compiled), r.kind, r.index) for r in roles)
        # Held so the ids the roles are keyed by name these models while the memory lives.
        self._compiled = tuple({id(r.compiled): r.compiled for r in roles}.values())
        self.operand = operand
        self.declared = declared
        self.dimensions = declared if fully_specified(declared) else ()
        self.initialized = False
        self.device = device
        self.buffer = buffer
        self.token = token
        self._shared = shared
        self.declined = declined      # why the driver declined (shared memory instead)
        self.closed = False

    @property
    def on_device(self) -> bool:
        """True for a driver-managed buffer, False for the shared-memory fallback."""
        return self.buffer is not None

    @property
    def dtype(self) -> np.dtype:
        return self.operand.type.dtype

    def nbytes(self, dims: Sequence[int]) -> int:
        return self.operand.type.element_size * math.prod(dims)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.buffer is not None:
            try:
                self.buffer.release()
            except NnrtError:   # the service is gone: nothing left to free
                pass
        if self._shared is not None:
            self._shared.close()

    def __enter__(self) -> "DeviceMemory":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        where = f"on {self.device.name}" if self.on_device else "in shared memory"
        state = "closed" if self.closed else ("written" if self.initialized else "never written")
        return (f"<nnrt.DeviceMemory {self.operand.type.name} {list(self.dimensions or self.declared)} "
                f"{where}, {state}>")

    # -- used by executions --------------------------------------------------------

    def check_use(self, compiled, kind: str, index: int, what: str) -> None:
        """INVALID_ARGUMENT unless (compiled, kind, index) is a role, the
        memory is open and, as an input, written; BAD_STATE when closed."""
        if self.closed:
            raise bad_state(f"{what}: the device memory is closed")
        if (id(compiled), kind, index) not in self._roles:
            raise invalid(f"{what}: the device memory was not allocated with this {kind} of "
                          f"this compiled model as a role")
        if kind == "input" and not self.initialized:
            raise invalid(f"{what}: the device memory was never written")
        if self.on_device:
            devices = compiled.devices
            if len(devices) != 1 or devices[0] is not self.device:
                raise NnrtError(ErrorStatus.DEVICE_UNAVAILABLE,
                                f"{what}: the device memory lives on {self.device.name}; the "
                                f"compiled model now runs on "
                                f"{', '.join(d.name for d in devices)}")

    def move_off_device(self) -> bool:
        """After the memory's driver died: make it shared memory of the
        runtime's own holding the contents the driver kept last
        (:meth:`Buffer.recover`), so an execution can rerun on the CPU
        with it (NNAPI's "CPU rerun"). False, changing nothing, when the
        contents died with the driver or the dimensions are not all known."""
        if not self.on_device:
            return True
        size = self.nbytes(self.declared)
        if not fully_specified(self.declared):
            return False
        data = self.buffer.recover() if self.initialized else b""
        if data is None or (self.initialized and len(data) != size):
            return False
        shared = Memory.create(max(size, 1), "nnrt-device-memory")
        shared.view()[:len(data)] = data
        try:
            self.buffer.release()
        except NnrtError:   # the service is gone: nothing left to free
            pass
        self.declined = f"{self.device.name} died; the contents moved to shared memory"
        self.buffer, self.device, self.token, self._shared = None, None, 0, shared
        return True

    def region(self) -> Region:
        """The fallback's shared memory as an execution value."""
        dims = self.dimensions
        return self._shared.region(0, self.nbytes(dims) if dims else self._shared.size, dims)

    def written(self, dimensions: Sequence[int]) -> None:
        """An execution (or a copy) wrote the memory at ``dimensions``."""
        self.dimensions = tuple(dimensions)
        self.initialized = True


async def allocate(desc: MemoryDesc, runtime) -> DeviceMemory:
    """See :meth:`nnrt.Runtime.allocate`."""
    if not isinstance(desc, MemoryDesc):
        raise invalid(f"allocate takes an nnrt.MemoryDesc, not a {type(desc).__name__}")
    roles = tuple(desc._roles)
    if not roles:
        raise invalid("allocate: the MemoryDesc has no role")
    dims, first = desc._dimensions, None
    for r in roles:
        r.compiled._check_open()
        if r.compiled._runtime is not runtime:
            raise invalid("allocate: a role's compiled model comes from another runtime")
        hal = r.compiled.model.hal_model
        indexes = hal.main.input_indexes if r.kind == "input" else hal.main.output_indexes
        operand = hal.main.operands[indexes[r.index]]
        what = f"allocate: {r.kind} role {r.index}"
        if not operand.type.is_tensor:
            raise invalid(f"{what}: a {operand.type.name} operand; a memory holds a tensor")
        if first is None:
            first = operand
        elif (operand.type, operand.scale, operand.zero_point) != \
                (first.type, first.scale, first.zero_point):
            raise invalid(f"{what}: operand type {operand.type.name} differs from the first "
                          f"role's {first.type.name} (or its quantization does)")
        dims = merge_dimensions(dims, operand.dimensions, what)
    device, reason = _one_device(roles)
    if device is not None:
        compiled = list({id(r.compiled): r.compiled for r in roles}.values())
        position = {id(c): k for k, c in enumerate(compiled)}
        hal_roles = {"input": [], "output": []}
        for r in roles:
            hal_roles[r.kind].append(BufferRole(position[id(r.compiled)], r.index, r.frequency))
        try:
            buffer, token = await device.allocate(
                BufferDesc(dims), [c._steps[0].prepared for c in compiled],
                hal_roles["input"], hal_roles["output"])
            return DeviceMemory(roles, first, dims, device, buffer, token, None)
        except NnrtError as e:
            reason = f"{device.name} declined: {e}"
    if not fully_specified(dims):
        raise invalid(f"allocate: no driver keeps this memory ({reason}), and its dimensions "
                      f"{list(dims)} are not all known for shared memory: set_dimensions")
    size = first.type.element_size * math.prod(dims)
    return DeviceMemory(roles, first, dims, None, None, 0,
                        Memory.create(max(size, 1), "nnrt-device-memory"), reason)


def _one_device(roles) -> tuple[Device | None, str]:
    """The device every role's compiled model runs on, whole; else why not."""
    devices = set()
    for r in roles:
        steps = r.compiled._steps
        if len(steps) != 1:
            return None, "a role's compiled model runs on several devices"
        devices.add(steps[0].device)
    if len(devices) != 1:
        return None, "the roles' compiled models run on different devices"
    return devices.pop(), ""


async def copy(src, dst) -> None:
    """Copy ``src`` into ``dst`` (``ANeuralNetworksMemory_copy``): each an
    nnrt.Memory or a DeviceMemory. A DeviceMemory source must have been
    written; sizes must agree, and between two DeviceMemories the
    dimensions too."""
    for name, m in (("src", src), ("dst", dst)):
        if not isinstance(m, (Memory, DeviceMemory)):
            raise invalid(f"copy: {name} is a {type(m).__name__}, not an nnrt.Memory or "
                          f"DeviceMemory")
        if m.closed:
            raise bad_state(f"copy: {name} is closed")
    if isinstance(src, DeviceMemory):
        if not src.initialized:
            raise invalid("copy: the source device memory was never written")
        dims = src.dimensions
        if isinstance(dst, DeviceMemory):
            if dst.operand.type != src.operand.type:
                raise invalid(f"copy: {src.operand.type.name} into {dst.operand.type.name}")
            dims = merge_dimensions(dst.declared, dims, "copy: the destination")
            await _device_to_device(src, dst, dims)
            return
        size = src.nbytes(dims)
        if dst.size != size:
            raise invalid(f"copy: the source holds {size} bytes ({list(dims)}), the "
                          f"destination has {dst.size}")
        if not dst.writable:
            raise invalid("copy: the destination memory is read-only")
        await _read_into(src, dst)
        return
    if isinstance(dst, DeviceMemory):
        dims = dst.dimensions or dst.declared
        if not fully_specified(dims):
            raise invalid(f"copy: the destination's dimensions {list(dims)} are not all known; "
                          f"copy from a written device memory or set them in its MemoryDesc")
        if src.size != dst.nbytes(dims):
            raise invalid(f"copy: the destination at {list(dims)} takes {dst.nbytes(dims)} "
                          f"bytes, the source has {src.size}")
        await _write_from(dst, src, dims)
        return
    if src.size != dst.size:
        raise invalid(f"copy: {src.size} bytes into {dst.size}")
    dst.view()[:] = src.view()


async def _read_into(src: DeviceMemory, dst: Memory) -> None:
    if src.on_device:
        await src.buffer.copy_to(dst)
    else:
        n = src.nbytes(src.dimensions)
        dst.view()[:n] = src._shared.view()[:n]


async def _write_from(dst: DeviceMemory, src: Memory, dims) -> None:
    if dst.on_device:
        await dst.buffer.copy_from(src, dims)
    else:
        dst._shared.view()[:src.size] = src.view()
    dst.written(dims)


async def _device_to_device(src: DeviceMemory, dst: DeviceMemory, dims) -> None:
    """Through a shared memory of the exact size (NNAPI's runtime does the
    same between two drivers)."""
    n = src.nbytes(src.dimensions)
    if n == 0:
        raise invalid(f"copy: the source's dimensions {list(src.dimensions)} hold no data")
    with Memory.create(n, "nnrt-copy") as staged:
        await _read_into(src, staged)
        await _write_from(dst, staged, dims)
